"""The report of a real (tiny) search: report.html is one self-contained page with the summary,
inline SVG plots and every trial; report.md holds the main tables; sections for figures the
search did not measure say so, and render when trials carry them."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from types import SimpleNamespace

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

from autotune.report.render import write_report
from conftest import ROOT, run_cli

SEARCH = ["search", "--model", "fake_models:tiny_cnn", "--device", "cpu", "--input-shape", "3x32x32",
          "--num-classes", "10", "--min-measure-time", "0.3", "--trials", "5",
          # these tests check how sections a search did not measure render; tests/test_accuracy.py
          # renders a measured accuracy section from a real search
          "--no-accuracy-check"]
NOT_MEASURED = "not measured in this search"
_searches: dict[str, Path] = {}


def tiny_search(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of one real `autotune search`, run once per test session (the browser
    test uses it too: a search costs most of these tests' time)."""
    if "out" not in _searches:
        out = tmp_path_factory.mktemp("tiny-search") / "out"
        _searches["said"] = " ".join(run_cli(*SEARCH, "--out", str(out)).stderr.split())  # rich wraps lines
        _searches["out"] = out
    return _searches["out"]


def load(out: Path) -> tuple[optuna.Study, dict]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    return study, json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tiny_search(tmp_path_factory)
    study, config = load(out)
    files = write_report(study, out, config)
    return SimpleNamespace(out=out, study=study, config=config, files=files,
                           html=files["report.html"].read_text(), md=files["report.md"].read_text())


def section(page: str, name: str) -> str:
    match = re.search(rf'<section id="{name}">(.*?)</section>', page, flags=re.S)
    assert match, f"no section {name!r}"
    return match.group(1)


def plots(page: str) -> dict[str, str]:
    """data-plot name -> the figure's inner HTML."""
    return dict(re.findall(r'<figure class="plot" data-plot="([^"]+)">(.*?)</figure>', page, flags=re.S))


def table_numbers(page: str) -> list[int]:
    table = re.search(r'<table id="trials".*?</table>', page, flags=re.S).group(0)
    return [int(n) for n in re.findall(r'<tr class="[^"]*" data-number="(\d+)"', table)]


def copy_with(study: optuna.Study, extra) -> optuna.Study:
    """An in-memory copy of ``study`` whose trials get ``extra(trial)`` as more user attributes."""
    copy = optuna.create_study(direction="maximize", study_name=study.study_name)
    for key, value in study.user_attrs.items():
        copy.set_user_attr(key, value)
    for t in study.get_trials():
        copy.add_trial(optuna.trial.create_trial(
            state=t.state, value=t.value if t.state == TrialState.COMPLETE else None, params=t.params,
            distributions=t.distributions, user_attrs={**t.user_attrs, **extra(t)}, system_attrs=t.system_attrs))
    assert [t.number for t in copy.trials] == [t.number for t in study.trials]
    return copy


@pytest.mark.slow
def test_the_search_says_what_its_run_cost_outside_the_trials(report):
    said = _searches["said"]
    match = re.search(r"trials in all (\d+)s; this run (\d+)s \(probe ([\d.]+)s, export ([\d.]+)s\)", said)
    assert match, said[-600:]
    trials, run, probe, export = map(float, match.groups())
    assert 0 < probe < run and 0 < export < run and probe + export < run


def test_files(report):
    assert set(report.files) == {"report.html", "report.md"}
    assert report.files["report.html"] == report.out / "report.html"
    assert all(p.stat().st_size > 0 for p in report.files.values())


def test_html_opens_offline(report):
    page = report.html
    assert not re.search(r"https?://", page)
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, flags=re.I)
    assert not re.search(r"<link\b", page, flags=re.I)
    assert not re.search(r"""\b(?:src|href)\s*=\s*["'](?!#)""", page), "only in-page references (#id)"
    assert not re.search(r"url\((?!#)|@import", page)
    assert page.count("<script") == 1, "one small inline script: the table sorting"


def test_summary_figures_match_config(report):
    page, config = report.html, report.config
    assert config["workload"]["model"] in page
    speedup = re.search(r'id="speedup" data-value="([^"]+)">([^<]+)<', page)
    assert float(speedup.group(1)) == pytest.approx(config["speedup_vs_baseline"])
    assert speedup.group(2) == f"{config['speedup_vs_baseline']:.2f}×"
    best_rate = re.search(r'id="best-rate" data-value="([^"]+)"', page)
    assert float(best_rate.group(1)) == pytest.approx(config["figures"]["samples_per_s"])
    assert html.escape(config["summary"]) in section(page, "summary")
    assert f"{config['search']['num_trials']} trials ({config['search']['num_measured']} measured)" in page


def test_every_trial_in_the_table(report):
    assert sorted(table_numbers(report.html)) == [t.number for t in report.study.trials]
    headers = re.findall(r'<th data-key="([^"]+)"', report.html)
    for key in ("number", "role", "state", "config", "samples_per_s", "step_time_ms", "spread", "peak_memory_gb",
                "reason", "trial_wall_s"):
        assert key in headers


def test_reproduce(report):
    reproduce = section(report.html, "reproduce")
    assert html.escape(report.config["command"]) in reproduce
    snippet = html.unescape(re.search(r'<pre id="snippet"><code>(.*?)</code></pre>', reproduce, flags=re.S).group(1))
    assert f'autotune.load("{report.out / "config.json"}")' in snippet
    for call in ("from fake_models import tiny_cnn", "cfg.prepare(model, optimizer)", "cfg.grad_scaler()",
                 "with cfg.autocast():", "cfg.loader(loader)", "scaler.scale(loss).backward()"):
        assert call in snippet
    compile(snippet, "snippet", "exec")


def test_plots_are_inline_svg(report):
    found = plots(report.html)
    for name in ("throughput-memory", "knob-precision-memory_format", "batch-size"):
        assert name in found
    for name, inner in found.items():
        assert inner.lstrip().startswith("<svg"), name
        assert inner.count("<svg") == 1 and "</svg>" in inner, name
    assert set(found) & {"speed-accuracy", "energy", "profile"} == set()


def test_sections_not_measured_say_so(report):
    for name in ("speed-accuracy", "energy", "profile", "findings"):
        part = section(report.html, name)
        assert NOT_MEASURED in part, name
        assert "<svg" not in part, name
    assert f"Energy:** {NOT_MEASURED}" in report.md
    assert f"Accuracy:** {NOT_MEASURED}" in report.md


def test_optional_sections_render_when_measured(report, tmp_path):
    def extra(t):
        if t.state != TrialState.COMPLETE:
            return {}
        n = t.number
        return {
            "energy": {"joules_per_sample": 0.0125 + 0.001 * n, "avg_power_w": 310.0 + n},
            "accuracy": {"accuracy": 0.91 - 0.01 * n, "accuracy_drop": 0.002 * n, "final_loss": 0.3, "stable": True},
            "profile": {"tensor_core_share": 0.42, "other_gemm_conv_share": 0.18, "elementwise_share": 0.2,
                        "layout_share": 0.05, "memcpy_share": 0.03, "idle_share": 0.07, "kernels_per_step": 131 + n,
                        "copy_overlap": n % 2 == 0,
                        "top_kernels": [{"name": "sm90_xmma_gemm<f16>_tn", "share": 0.31},
                                        {"name": "elementwise_kernel", "share": 0.12}]},
            "findings": [f"<b>channels_last</b> removes 12 layout transposes per step (trial {n})",
                         "GPU idle between steps: the input pipeline is the bottleneck"],
        }

    study = copy_with(report.study, extra)
    files = write_report(study, tmp_path, report.config)
    page, md = files["report.html"].read_text(), files["report.md"].read_text()
    best = report.config["study"]["trial_number"]
    found = plots(page)
    assert {"speed-accuracy", "energy", "profile", "throughput-memory"} <= set(found)
    assert all(inner.lstrip().startswith("<svg") for inner in found.values())
    for name in ("speed-accuracy", "energy", "profile", "findings"):
        assert NOT_MEASURED not in section(page, name), name
    summary = section(page, "summary")
    assert f"{0.0125 + 0.001 * best:.3g} J/sample" in summary
    assert f"accuracy drop {0.002 * best:.3g}" in summary
    profile = section(page, "profile")
    assert f"{131 + best} kernels per step" in profile
    assert "sm90_xmma_gemm&lt;f16&gt;_tn" in profile and "Tensor Core GEMM/conv 42.0%" in profile
    findings = section(page, "findings")
    assert f"&lt;b&gt;channels_last&lt;/b&gt; removes 12 layout transposes per step (trial {best})" in findings
    assert "<b>channels_last" not in page
    assert "the input pipeline is the bottleneck" in findings
    headers = re.findall(r'<th data-key="([^"]+)"', page)
    assert "joules_per_sample" in headers and "accuracy_drop" in headers
    assert "| J/sample | accuracy drop |" in md
    assert "## Findings" in md and "\\<b\\>channels\\_last" not in md and "\\<b\\>channels_last\\</b\\>" in md


def test_markdown_has_the_main_tables(report):
    md, config = report.md, report.config
    best, base = config["study"]["trial_number"], config["baseline"]["trial_number"]
    assert "## Best vs baseline" in md
    assert "|  | trial | configuration | samples/s | step ms | peak GiB |" in md
    assert f"| best | #{best} | {config['summary']} |" in md
    assert f"| baseline | #{base} | {config['baseline']['summary']} |" in md
    assert f"| best / baseline |  |  | {config['speedup_vs_baseline']:.2f}× |" in md
    assert "## Top 10 configurations" in md
    assert "## Effect of each knob" in md and "| memory format | trials | median samples/s | best samples/s |" in md
    assert "## Failed and pruned trials" in md
    assert config["command"] in md and "autotune.load(" in md
    assert not re.search(r"<[a-zA-Z/!]", md), "GitHub-readable Markdown, no HTML"


def test_study_loads_through_optuna_alone(report):
    study, config = load(report.out)
    frame = study.trials_dataframe()
    assert {"user_attrs_figures", "user_attrs_knobs", "user_attrs_status", "user_attrs_role",
            "user_attrs_timing"} <= set(frame.columns)
    assert len(frame) == len(study.trials)
    assert study.best_trial.number == config["study"]["trial_number"]
    assert study.best_trial.value == pytest.approx(config["figures"]["samples_per_s"])
    assert study.best_trial.user_attrs["figures"]["samples_per_s"] == pytest.approx(config["figures"]["samples_per_s"])


def _failed_study() -> optuna.Study:
    """What a search records when nothing fits or runs: pruned (out of memory) and failed trials."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", study_name="nothing-fits")
    study.set_user_attr("device", "cuda")
    study.set_user_attr("workload", {"model": "resnet50", "input_shape": None, "num_classes": 1000})
    study.set_user_attr("provenance", {"gpu": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0"})
    outcomes = [
        ("baseline", TrialState.PRUNED, "oom", 256,
         "does not fit at batch 256: CUDA out of memory. Tried to allocate 2 GiB"),
        ("known-good", TrialState.FAIL, "crashed", 512, "the worker died with signal 11 <img src=x onerror=alert(1)>"),
        (None, TrialState.FAIL, "timeout", 1024, "no result within 600 s"),
        (None, TrialState.PRUNED, "oom", 1024, "does not fit at batch 1024: CUDA out of memory | twice"),
    ]
    for role, state, status, batch, reason in outcomes:
        trial = study.ask()
        if role:
            trial.set_user_attr("role", role)
        trial.set_user_attr("knobs", {"precision": {"mode": "fp16" if role != "baseline" else "fp32"},
                                      "batch_size": {"batch_size": batch, "base_batch_size": 256},
                                      "memory_format": {"format": "channels_last"}})
        trial.set_user_attr("status", status)
        trial.set_user_attr("reason", reason)
        trial.set_user_attr("timing", {"worker_start_s": 4.0, "wall_s": 9.5})
        study.tell(trial, state=state)
    return study


def test_no_completed_trial_still_reports(tmp_path):
    study = _failed_study()
    files = write_report(study, tmp_path, None)
    page, md = files["report.html"].read_text(), files["report.md"].read_text()
    assert "No configuration completed" in section(page, "summary")
    assert "No configuration completed" in md
    for t in study.trials:
        assert html.escape(t.user_attrs["reason"]) in page
        assert f"| #{t.number} |" in md
    assert sorted(table_numbers(page)) == [0, 1, 2, 3]
    assert "&lt;img src=x onerror=alert(1)&gt;" in page and "<img" not in page
    assert "\\<img src=x onerror=alert(1)\\>" in md and "CUDA out of memory \\| twice" in md
    assert plots(page) == {}
    assert "nothing to plot" in section(page, "throughput-memory")
    assert "NVIDIA H200" in page and "resnet50" in page
    assert not re.search(r"https?://", page)


@pytest.mark.parametrize("wait, workers, remedy", [
    (0.87, 32, "more loader workers, DALI or a faster decode would help"),
    # the H200 JPEG search's best: no wait, yet 3,211 of a possible 5,485 samples/s
    (0.004, 32, "the 32 loader workers compete with the training process for the CPUs, so a cheaper decode"),
    (0.004, 0, "more loader workers, DALI or a faster decode would help"),
])
def test_the_data_pipeline_line_names_the_remedy_that_fits_the_wait(wait, workers, remedy):
    from autotune.report.summary import data_text as _data_text

    best = pd.Series({"loader_fed_samples_per_s": 3211.4, "compute_only_samples_per_s": 5484.7,
                      "loader_wait_share": wait, "data_bound": True, "param.dataloader.num_workers": workers})
    text = _data_text(best, "cuda")
    assert text.startswith("data-bound: the data pipeline delivers 3,211 samples/s, the GPU could train 5,485")
    assert remedy in text
    kept = _data_text(best.copy().replace({True: False}), "cuda")
    assert kept.startswith("the data pipeline keeps the GPU busy (loader-fed 3,211 samples/s")


def test_a_faster_trial_whose_loss_was_not_finite_is_marked_not_chosen(tmp_path):
    """The H200 JPEG search: trial #1 (fp16 + CUDA graphs) ran fastest but ended with a NaN loss;
    trials.csv says so, the top table marks it, and the best is #2."""
    import shutil

    from autotune.report.export import trials_frame

    folder = ROOT / "reports" / "resnet50-h200-jpegs"
    for name in ("study.db", "config.json"):
        shutil.copy(folder / name, tmp_path / name)
    study, config = load(tmp_path)
    frame = trials_frame(study).set_index("number")
    assert frame.loc[1, "loss_finite"] == False and frame.loc[2, "loss_finite"] == True  # noqa: E712
    assert frame.loc[1, "samples_per_s"] > frame.loc[2, "samples_per_s"]
    md = write_report(study, tmp_path, config)["report.md"].read_text()
    assert "(trial #2)" in md.split("**Best configuration:**")[1].splitlines()[0]
    rows = {line.split(" | ")[1]: line for line in md.split("## Top 10 configurations")[1].split("##")[0].splitlines()
            if line.startswith("| ") and " | #" in line}
    assert "(unstable: loss not finite, never chosen as best)" in rows["#1"]
    assert "unstable" not in rows["#2"]
