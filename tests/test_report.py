"""The report of a real (tiny) search: report.html is one self-contained page with the summary,
inline SVG plots and every trial; report.md holds the main tables; sections for figures the
search did not measure say so, and render when trials carry them."""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

from autotune.report.format import trial_counts, trials_text
from autotune.report.render import write_report
from conftest import ROOT

NOT_MEASURED = "not measured in this search"
_searches: dict[str, Path] = {}


def tiny_search(tiny_cpu_search, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the session's real `autotune search` (conftest.tiny_cpu_search: no accuracy check, so
    these tests see how sections a search did not measure render; tests/test_accuracy.py renders a
    measured accuracy section from a real search), made once per session and shared with the browser
    test: its report is rewritten in place, which the shared folder must not be."""
    if "out" not in _searches:
        shared, proc = tiny_cpu_search
        out = tmp_path_factory.mktemp("tiny-search") / "out"
        shutil.copytree(shared, out)
        _searches["said"] = " ".join(proc.stderr.split())  # rich wraps lines
        _searches["out"] = out
    return _searches["out"]


def load(out: Path) -> tuple[optuna.Study, dict]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    return study, json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def report(tiny_cpu_search, tmp_path_factory):
    out = tiny_search(tiny_cpu_search, tmp_path_factory)
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


@pytest.mark.slow  # the module's report comes from one real search (tiny_search)
def test_files(report):
    assert set(report.files) == {"report.html", "report.md"}
    assert report.files["report.html"] == report.out / "report.html"
    assert all(p.stat().st_size > 0 for p in report.files.values())


@pytest.mark.slow  # the module's report comes from one real search (tiny_search)
def test_html_opens_offline(report):
    page = report.html
    assert not re.search(r"https?://", page)
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, flags=re.I)
    assert not re.search(r"<link\b", page, flags=re.I)
    assert not re.search(r"""\b(?:src|href)\s*=\s*["'](?!#)""", page), "only in-page references (#id)"
    assert not re.search(r"url\((?!#)|@import", page)
    assert page.count("<script") == 1, "one small inline script: the table sorting"


@pytest.mark.slow  # the module's report comes from one real search (tiny_search)
def test_summary_figures_match_config(report):
    page, config = report.html, report.config
    assert config["workload"]["model"] in page
    speedup = re.search(r'id="speedup" data-value="([^"]+)">([^<]+)<', page)
    assert float(speedup.group(1)) == pytest.approx(config["speedup_vs_baseline"])
    assert speedup.group(2) == f"{config['speedup_vs_baseline']:.2f}×"
    best_rate = re.search(r'id="best-rate" data-value="([^"]+)"', page)
    assert float(best_rate.group(1)) == pytest.approx(config["figures"]["samples_per_s"])
    assert html.escape(config["summary"]) in section(page, "summary")
    cost = config["search"]
    early = " in their warm-up as clearly slower than the best"
    assert html.escape(trials_text(cost, early)) in page  # repeats named apart, not counted as trials
    # every trial counted is measured, a copy of one, or run without a figure
    ran = cost["num_measured"] + cost["num_out_of_memory"] + cost["num_failed"]
    copies = sum(t.user_attrs.get("duplicate_of") is not None for t in report.study.trials
                 if t.user_attrs.get("status") is not None)
    assert ran + copies == cost["num_trials"]


@pytest.mark.slow  # the module's report comes from one real search (tiny_search)
def test_every_trial_in_the_table(report):
    assert sorted(table_numbers(report.html)) == [t.number for t in report.study.trials]
    headers = re.findall(r'<th data-key="([^"]+)"', report.html)
    for key in ("number", "role", "state", "config", "samples_per_s", "step_time_ms", "spread", "peak_memory_gb",
                "reason", "trial_wall_s"):
        assert key in headers


@pytest.mark.slow  # the module's report comes from one real search (tiny_search)
def test_reproduce(report):
    reproduce = section(report.html, "reproduce")
    assert html.escape(report.config["command"]) in reproduce
    snippet = html.unescape(re.search(r'<pre id="snippet"><code>(.*?)</code></pre>', reproduce, flags=re.S).group(1))
    assert f'autotune.load("{report.out / "config.json"}")' in snippet
    for call in ("from fake_models import tiny_cnn", "cfg.prepare(model, optimizer)", "cfg.grad_scaler()",
                 "with cfg.autocast():", "cfg.loader(loader)", "scaler.scale(loss).backward()"):
        assert call in snippet
    compile(snippet, "snippet", "exec")


@pytest.mark.slow  # the module's report comes from one real search (tiny_search)
def test_plots_are_inline_svg(report):
    found = plots(report.html)
    for name in ("throughput-memory", "knob-precision-memory_format", "batch-size"):
        assert name in found
    for name, inner in found.items():
        assert inner.lstrip().startswith("<svg"), name
        assert inner.count("<svg") == 1 and "</svg>" in inner, name
    assert set(found) & {"speed-accuracy", "energy", "profile"} == set()


@pytest.mark.slow  # the module's report comes from one real search (tiny_search)
def test_sections_not_measured_say_so(report):
    for name in ("speed-accuracy", "energy", "profile", "findings"):
        part = section(report.html, name)
        assert NOT_MEASURED in part, name
        assert "<svg" not in part, name
    assert f"Energy:** {NOT_MEASURED}" in report.md
    assert f"Accuracy:** {NOT_MEASURED}" in report.md


@pytest.mark.slow  # the module's report comes from one real search (tiny_search)
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


@pytest.mark.slow  # the module's report comes from one real search (tiny_search)
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


@pytest.mark.slow  # the module's report comes from one real search (tiny_search)
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


@pytest.mark.slow
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


# --- knob effects from pairs of trials that differ in one knob alone ----------------------------

_CHOICES = {"precision.mode": ["fp32", "fp16", "bf16"], "streams.num_streams": [1, 2],
            "batch_size.batch_size": [256, 512], "memory_format.format": ["contiguous", "channels_last"]}


def _planted_study(rows: list[tuple], findings: dict[int, list[dict]] | None = None) -> optuna.Study:
    """A study of completed trials: (role, precision, streams, batch, memory format, samples/s) each,
    with the records a search writes (knobs, figures, status), and ``findings`` rules by trial."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", study_name="planted")
    study.set_user_attr("device", "cuda")
    study.set_user_attr("workload", {"model": "resnet50", "input_shape": None, "num_classes": 1000})
    for n, (role, mode, streams, batch, fmt, rate) in enumerate(rows):
        params = {"precision.mode": mode, "streams.num_streams": streams, "batch_size.batch_size": batch,
                  "memory_format.format": fmt}
        knobs = {"precision": {"mode": mode}, "streams": {"num_streams": streams},
                 "batch_size": {"batch_size": batch, "base_batch_size": 256}, "memory_format": {"format": fmt}}
        rules = (findings or {}).get(n, [])
        study.add_trial(optuna.trial.create_trial(
            state=TrialState.COMPLETE, value=rate, params=params,
            distributions={k: optuna.distributions.CategoricalDistribution(c) for k, c in _CHOICES.items()},
            user_attrs={"role": role, "status": "ok", "knobs": knobs,
                        "figures": {"samples_per_s": rate, "step_time_ms": 1000 * batch / rate, "spread": 0.01,
                                    "peak_memory_bytes": 2**30 * batch / 64},
                        "timing": {"worker_start_s": 1.0, "wall_s": 5.0},
                        **({"findings": [r["text"] for r in rules], "finding_rules": rules} if rules else {})}))
    return study


# streams is confounded: the slow FP32 trials ran with 1 stream, the fast fp16 ones mostly with 2;
# the one pair that differs in streams alone (#3, #4) ran at the same speed
_CONFOUNDED = [
    ("baseline", "fp32", 1, 256, "contiguous", 1000.0),
    ("known-good", "fp32", 1, 512, "contiguous", 1050.0),
    (None, "fp16", 2, 256, "contiguous", 5000.0),
    (None, "fp16", 2, 512, "contiguous", 5200.0),
    (None, "fp16", 1, 512, "contiguous", 5180.0),
    (None, "bf16", 2, 512, "channels_last", 4500.0),
    (None, "bf16", 2, 256, "channels_last", 4400.0),
]


def _knob_part(md: str) -> tuple[str, str]:
    """The paired part of report.md's knob section, and its marginal part."""
    part = md.split("## Effect of each knob")[1].split("\n## ")[0]
    paired, marginal = part.split("### Marginal: all trials with each value")
    return paired, marginal


def _md_rows(text: str, label: str) -> list[list[str]]:
    """The cells of a Markdown table's rows for one knob (its label, then the rows after it with none)."""
    rows, mine = [], False
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith("| knob |"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0]:
            mine = cells[0] == label
        if mine:
            rows.append(cells)
    return rows


def test_the_report_shows_a_knobs_paired_effect_where_the_marginal_one_disagrees(tmp_path):
    study = _planted_study(_CONFOUNDED)
    files = write_report(study, tmp_path, None)
    md, page = files["report.md"].read_text(), files["report.html"].read_text()
    paired, marginal = _knob_part(md)
    # the marginal medians say 2 streams are 4.8x faster (1,050 against 5,000 samples/s) ...
    assert "| 1 | 3 | 1,050 | 5,180 |" in marginal and "| 2 | 4 | 4,750 | 5,200 |" in marginal
    assert "mix their effects with this knob's" in marginal
    # ... the pair that changes streams alone says they change nothing, and that is what the knob's row shows
    streams = _md_rows(paired, "CUDA streams")
    assert len(streams) == 1, streams
    _, _, change, pairs, ratio, _, noise, verdict = streams[0]
    assert (change, pairs, ratio, noise) == ("1 → 2", "1", "1.00×", "±3.0%")
    assert verdict == "within the noise (#4/#3)"
    # precision's one pair: fp32 -> fp16 at batch 512, 1 stream
    assert _md_rows(paired, "precision")[0][2:5] == ["fp32 → fp16", "1", f"{5180 / 1050:.2f}×"]
    # memory format only ever changed with precision: said plainly, no ratio
    fmt = _md_rows(paired, "memory format")
    assert fmt[0][2:5] == ["", "0", ""]
    assert "no pair of trials differs in this knob alone: its marginal figures are confounded" in fmt[0][-1]
    # the page: the same row in the paired table, above the (still drawn) marginal bars
    knobs = section(page, "knobs")
    table = re.search(r'<table id="paired-effects".*?</table>', knobs, flags=re.S).group(0)
    row = re.search(r'<tr data-param="streams.num_streams">(.*?)</tr>', table, flags=re.S).group(1)
    assert "1 → 2" in row and "1.00×" in row and "within the noise" in row
    assert "no pair of trials differs in this knob alone: its marginal bars are confounded" in table
    assert knobs.index('id="paired-effects"') < knobs.index("Marginal: all trials with each value")
    assert {"knob-pairs", "knob-streams"} <= set(plots(page))
    assert "Importance: too few measured trials for PED-ANOVA (7, repeats, and trials that diverged or failed the accuracy check, left out; it needs at least 10" in md


def test_knob_importance_from_ped_anova_beside_the_pairs(tmp_path):
    """With enough trials Optuna's PED-ANOVA rates each parameter; precision, which alone sets the
    speed here, gets the largest share."""
    more = [(None, mode, streams, batch, "contiguous", {"fp32": 1000.0, "fp16": 5000.0, "bf16": 4500.0}[mode]
             + 10 * streams + batch / 256)
            for mode in ("fp32", "fp16", "bf16") for streams in (1, 2) for batch in (256, 512)]
    study = _planted_study([("baseline", "fp32", 1, 256, "contiguous", 999.0), *more])
    md = write_report(study, tmp_path, None)["report.md"].read_text()
    paired, _ = _knob_part(md)
    assert "Importance: Optuna's PED-ANOVA over 13 measured trials" in paired
    shares = {label: float(_md_rows(paired, label)[0][1].rstrip("%"))
              for label in ("precision", "CUDA streams", "batch size")}
    assert max(shares, key=shares.get) == "precision", shares
    assert all(0 <= s <= 100 for s in shares.values())


def test_repeated_findings_are_one_line_per_kind_with_their_trials(tmp_path):
    def power(watts: int) -> dict:
        return {"rule": "power-cap", "text": f"power-capped at {watts} W for 100% of the measured window",
                "suggest": {}}

    overlap = {"rule": "copies-hidden", "text": "81% of the host-to-device copy time runs under compute",
               "suggest": {}}
    tensor = {"rule": "no-tensor-cores", "text": "73% of GPU time is in FP32 GEMM/conv kernels", "suggest": {}}
    findings = {0: [tensor], 2: [power(676), overlap], 3: [power(683), overlap], 5: [power(691)]}
    files = write_report(_planted_study(_CONFOUNDED, findings), tmp_path, None)
    md, page = files["report.md"].read_text(), files["report.html"].read_text()
    lines = [line for line in md.split("## Findings")[1].split("\n## ")[0].splitlines() if line.startswith("- ")]
    assert len(lines) == 3, lines
    # the best trial's (#3) kinds first, its own text as the example; then the baseline's
    assert lines[0] == ("- **power-capped** in 3 trials (#2, #3, #5); #3: power-capped at 683 W for 100% of the "
                        "measured window")
    assert lines[1].startswith("- **copies overlap compute** in 2 trials (#2, #3); #3: 81% of the host-to-device")
    assert lines[2] == "- **no Tensor Cores:** 73% of GPU time is in FP32 GEMM/conv kernels (#0)"
    found = section(page, "findings")
    assert found.count('data-rule="power-cap"') == 1
    for watts in (676, 683, 691):  # every trial's own text is still on the page
        assert f"power-capped at {watts} W" in found


def test_what_a_search_counts_as_measured():
    """The H200 hf:gpt2 search said "20 trials (18 measured, 5 stopped early)" where 5 of the 18 ran
    out of memory and 2 could not run their attention backend: run is not measured. The CPU main job
    said "37 trials (37 measured, 20 stopped early; 12 repeats ...)" where one of the 20 was a repeat
    of a stopped trial: a repeat is counted once, as a repeat."""
    import optuna
    from optuna.distributions import IntDistribution

    from autotune.search.trials import search_cost

    study = optuna.create_study(direction="maximize")
    outcomes = ["ok", "ok", "pruned", "oom", "oom", "error", ("ok", 0), ("pruned", 2)]
    for i, outcome in enumerate(outcomes):
        status, copy_of = outcome if isinstance(outcome, tuple) else (outcome, None)
        state = {"ok": optuna.trial.TrialState.COMPLETE, "error": optuna.trial.TrialState.FAIL}.get(
            status, optuna.trial.TrialState.PRUNED)
        attrs = {"status": status, "timing": {"wall_s": 10.0, "worker_start_s": 1.0}}
        if copy_of is not None:
            attrs["duplicate_of"] = copy_of
        study.add_trial(optuna.trial.create_trial(
            params={"x": i}, distributions={"x": IntDistribution(0, 10)}, state=state,
            value=1.0 if state == optuna.trial.TrialState.COMPLETE else None, user_attrs=attrs))
    cost = search_cost(study)
    assert (cost["num_trials"], cost["num_measured"], cost["num_stopped_early"]) == (8, 3, 1)
    assert (cost["num_out_of_memory"], cost["num_failed"]) == (2, 1)
    assert cost["trial_wall_s"] == 60.0  # the copies ran nothing
    assert trials_text(cost) == ("6 trials (3 measured, 1 stopped early; 3 run without a figure: 2 out of memory, "
                                 "1 failed; 2 repeats of an earlier trial, its result reused)")
    assert trial_counts(cost) == "3 measured, 1 stopped early; 3 run without a figure: 2 out of memory, 1 failed"
    # a config.json from before these counts still reads
    assert trial_counts({"num_measured": 18, "num_stopped_early": 5}) == "18 measured, 5 stopped early"
