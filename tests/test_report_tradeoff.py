"""The report shows the speed-accuracy trade-off as it was measured (issue 37, item 6), on the committed
H200 studies it was found on: gpt2-h200 (one accuracy check per precision mode; every bf16 check
failed its allowed drift) and resnet50-h200-24gib (every check at drop 0; pruned and out-of-memory
trials; an optimizer pair that also switches CUDA graphs; a best within the noise of the runner-up),
and `autotune compare` of the H200 and CPU ResNet-50 runs."""

from __future__ import annotations

import html
import itertools
import json
import re
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from autotune.report.render import write_report
from conftest import ROOT
from test_report import plots, section

GPT2, RESNET = ROOT / "reports" / "gpt2-h200", ROOT / "reports" / "resnet50-h200-24gib"


def _written(folder: Path, tmp_path: Path) -> SimpleNamespace:
    """The report of a committed study, written afresh into ``tmp_path``."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for name in ("study.db", "config.json"):
        shutil.copy(folder / name, tmp_path / name)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{tmp_path / 'study.db'}")
    config = json.loads((tmp_path / "config.json").read_text())
    files = write_report(study, tmp_path, config)
    return SimpleNamespace(study=study, config=config, html=files["report.html"].read_text(),
                           md=files["report.md"].read_text(), out=tmp_path)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return _written(GPT2, tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    return _written(RESNET, tmp_path_factory.mktemp("resnet"))


def _trial_cell(page: str, number: int, key: str) -> str:
    row = re.search(rf'<tr class="[^"]*" data-number="{number}">(.*?)</tr>', page, flags=re.S).group(1)
    return html.unescape(re.search(rf'<td data-key="{key}"[^>]*>(.*?)</td>', row, flags=re.S).group(1)).strip()


def test_the_allowed_drift_is_drawn_and_failed_points_are_marked(gpt2):
    figure = plots(gpt2.html)["speed-accuracy"]
    caption = html.unescape(re.search(r"<figcaption>(.*?)</figcaption>", figure, flags=re.S).group(1))
    allowed = gpt2.study.trials[1].user_attrs["accuracy"]["allowed"]  # the bf16 check's, 0.1 + FP32's noise
    assert f"red dotted line: the allowed drift ({allowed:.3g}" in caption
    failed = [t.number for t in gpt2.study.trials if t.state.name == "COMPLETE"
              and (t.user_attrs.get("accuracy") or {}).get("verdict") == "violated"]
    assert len(failed) == 7  # every completed bf16 trial: drift 0.251 over the allowed 0.222
    assert "× marks the 7 that failed the check" in caption
    # matplotlib writes each text of the figure as a comment beside its glyphs
    assert "<!-- allowed drift -->" in figure and "<!-- failed the check -->" in figure


def test_an_accuracy_shared_by_a_precision_modes_trials_is_labelled_so(gpt2):
    figure = plots(gpt2.html)["speed-accuracy"]
    caption = html.unescape(re.search(r"<figcaption>(.*?)</figcaption>", figure, flags=re.S).group(1))
    assert "The check trains each precision mode's numerics once, not each configuration" in caption
    assert "<!-- bf16: 1 check, 7 trials -->" in figure and "<!-- fp16: 1 check, 2 trials -->" in figure


def test_a_plot_whose_points_are_all_equal_is_a_sentence(resnet):
    part = section(resnet.html, "speed-accuracy")
    assert "<svg" not in part and "speed-accuracy" not in plots(resnet.html)
    checked = sum(t.state.name == "COMPLETE" and "figures" in t.user_attrs for t in resnet.study.trials)
    assert checked == 12
    assert ("All 12 configurations checked have the same accuracy drop vs FP32, 0 (allowed 0.5): the check "
            "cannot tell them apart, so there is no plot of speed against it; every one passed the check.") in \
        html.unescape(part)


def test_trials_that_trained_nothing_show_no_accuracy(resnet):
    """The pruned and out-of-memory trials share their precision's check; the table gave them its drop 0."""
    unmeasured = [t.number for t in resnet.study.trials if t.state.name in ("PRUNED", "FAIL")]
    assert unmeasured == [2, 3, 9, 11, 13, 17]
    for n in unmeasured:
        assert _trial_cell(resnet.html, n, "accuracy_drop") == "", n
    assert _trial_cell(resnet.html, 15, "accuracy_drop") == "0"  # a trial that completed keeps its check's


def test_an_optimizer_pair_that_also_switches_cuda_graphs_is_not_the_optimizers_alone(resnet):
    """#7 -> #5 and #8 -> #6 change foreach to fused and, with it, switch CUDA graphs on (a parameter
    that exists only with the fused optimizer): +9% and +13% was the optimizer's in the report."""
    table = re.search(r'<table id="paired-effects".*?</table>', resnet.html, flags=re.S).group(0)
    rows = [html.unescape(r) for r in re.findall(r'<tr data-param="optimizer.implementation">(.*?)</tr>',
                                                  table, flags=re.S)]
    assert len(rows) == 2, rows
    alone = next(r for r in rows if "foreach → fused<" in r)
    both = next(r for r in rows if "foreach → fused + CUDA graphs<" in r)
    assert "#16/#1" in alone and "#7" not in alone and "#8" not in alone
    assert "#7/#5" in both and "#8/#6" in both
    md_rows = [line for line in resnet.md.splitlines() if "foreach → fused" in line]
    assert any("foreach → fused + CUDA graphs" in line for line in md_rows)


def test_a_best_within_the_noise_of_the_runner_up_is_a_tie(resnet, gpt2):
    summary = html.unescape(section(resnet.html, "summary"))
    best, runner = resnet.study.trials[15].value, resnet.study.trials[4].value
    assert abs(best - runner) / runner < 0.03  # 6,882 against 6,880 samples/s
    assert "a tie with the runner-up, #4, within the noise" in summary
    assert re.search(r"<dt>Runner-up</dt><dd>a tie: bf16, channels_last, batch 384, .*\(trial #4\): 6,880 samples/s",
                     summary)
    assert "**Runner-up:** a tie:" in resnet.md
    # gpt2: the runner-up that passed its check (#8, fp16 without compile) is far behind: no tie
    other = html.unescape(section(gpt2.html, "summary"))
    assert "<dt>Runner-up</dt><dd>fp16" in other and "a tie" not in other and "beyond the ±3.0% noise" in other


def test_the_causal_lm_snippet_computes_the_loss_from_the_logits(gpt2):
    """The snippet applied CrossEntropyLoss to the model's output object: it would not run. Its loss
    lines, run on a tiny GPT-2, give the next-token cross-entropy."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    snippet = html.unescape(re.search(r'<pre id="snippet"><code>(.*?)</code></pre>', gpt2.html, flags=re.S).group(1))
    assert "loss_fn(model(x), y)" not in snippet
    compile(snippet, "snippet", "exec")
    body = snippet.split("    with cfg.autocast():\n")[1].split("    scaler.scale")[0]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2,
                                                                  vocab_size=50, bos_token_id=0,
                                                                  eos_token_id=0, use_cache=False)).eval()
    tokens = torch.randint(0, 50, (2, 9))
    scope = {"model": model, "tokens": tokens, "loss_fn": torch.nn.CrossEntropyLoss(), "torch": torch}
    exec(textwrap.dedent(body), scope)
    logits = model(input_ids=tokens[:, :-1]).logits
    expected = F.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))
    assert scope["loss"].item() == pytest.approx(expected.item(), rel=1e-5)


def test_the_comparison_says_which_run_is_faster_and_flags_what_differs(tmp_path):
    from autotune.report.compare import compare

    folders = []
    for name in ("resnet50-h200", "resnet50-cpu"):
        folders.append(tmp_path / name)
        folders[-1].mkdir()
        for f in ("config.json", "trials.csv"):
            shutil.copy(ROOT / "reports" / name / f, folders[-1] / f)
    c = compare(folders, tmp_path / "cmp")
    gpu, cpu = (json.loads((f / "config.json").read_text()) for f in folders)
    ratio = gpu["figures"]["samples_per_s"] / cpu["figures"]["samples_per_s"]
    assert c.headline == (f"resnet50-h200 is the fastest: its best configuration trains 6,367 samples/s, "
                          f"{ratio:,.0f}x as fast as resnet50-cpu (3.90 samples/s).")
    md, page = c.markdown.read_text(), c.html.read_text()
    assert f"**{c.headline}**" in md and html.escape(c.headline) in page
    assert "0.00061x" not in md and "0.00061x" not in page
    assert f"| samples/s | the reference | {ratio:,.0f}x slower |" in md
    torch_flag = next(f for f in c.flags if f.startswith("torch versions differ"))
    assert gpu["provenance"]["torch"] in torch_flag and cpu["provenance"]["torch"] in torch_flag
    assert any(f.startswith("batch sizes differ (resnet50-h200: 1024, resnet50-cpu: 8)") for f in c.flags)
    assert 'id="flags"' in page

    same = compare([folders[0], _twin(folders[0], tmp_path / "again")], tmp_path / "cmp-same")
    assert same.flags == [] and "as fast as again" in same.headline


def _twin(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def test_a_very_long_kernel_name_is_cut_with_its_whole_name_as_title():
    from autotune.report.sections import KERNEL_NAME_CHARS, kernel_name

    name = "void cutlass::Kernel2<" + "cutlass_80_tensorop_s16816gemm_" * 60 + ">(Params)"
    shown = kernel_name(name)
    assert len(shown["name"]) == KERNEL_NAME_CHARS and shown["name"].endswith("…") and shown["title"] == name
    assert kernel_name("elementwise_kernel") == {"name": "elementwise_kernel", "title": ""}


def test_the_committed_reports_kernel_table_holds_the_cut_name(resnet):
    profile = section(resnet.html, "profile")
    longest = max((k["name"] for t in resnet.study.trials
                   for k in (t.user_attrs.get("profile") or {}).get("top_kernels") or []), key=len)
    assert len(longest) == 1676  # the best's (#15), whose kernels the profile section lists
    assert html.escape(longest[:60]) in profile
    assert html.escape(longest) not in re.sub(r'title="[^"]*"', "", profile)  # cut in the cell ...
    assert f'title="{html.escape(longest)}"' in profile  # ... whole on hover


# --- each configuration's style in the trade-off plots (issue 58) -------------------------------------

FOUR_SERIES = ROOT / "reports" / "gpus-speedup-h200-44trials" / "one"
"""A committed study with fp32 and bf16 trials in both memory formats."""


def _lab(color) -> tuple[float, float, float]:
    """sRGB to CIELAB (D65), where the distance between two colours is roughly how far apart they look."""
    from matplotlib.colors import to_rgb

    def linear(u: float) -> float:
        return u / 12.92 if u <= 0.04045 else ((u + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(u) for u in to_rgb(color))
    xyz = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
           (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)
    fx, fy, fz = (t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def _marker(collection) -> str:
    """The marker a scatter's PathCollection draws, read back from its path."""
    import numpy as np
    from matplotlib.markers import MarkerStyle

    drawn = collection.get_paths()[0].vertices
    for name in MarkerStyle.filled_markers + ("x",):
        style = MarkerStyle(name)
        path = style.get_path().transformed(style.get_transform())
        if path.vertices.shape == drawn.shape and np.allclose(path.vertices, drawn):
            return name
    raise AssertionError("a marker none of matplotlib's")


def test_each_configuration_in_a_tradeoff_plot_has_a_colour_and_marker_of_its_own(monkeypatch):
    """Each series differs from every other in its marker, or in a colour the eye tells apart: at least 40
    apart in CIELAB (fp32's slate and bf16's purple, 29.5 apart, read as one colour in the same circle)."""
    import math

    from matplotlib.colors import to_hex

    from autotune.report import plots as report_plots
    from autotune.report.data import collect

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{FOUR_SERIES / 'study.db'}")
    data = collect(study, FOUR_SERIES, json.loads((FOUR_SERIES / "config.json").read_text()))
    figures = {}
    inline = report_plots.inline_svg

    def keep(fig, name: str) -> str:
        figures[name] = fig
        return inline(fig, name)

    monkeypatch.setattr(report_plots, "inline_svg", keep)
    assert report_plots.plot_throughput_memory(data) is not None
    series = {c.get_label(): (to_hex(c.get_facecolor()[0], keep_alpha=False), _marker(c))
              for c in figures["throughput-memory"].axes[0].collections if not c.get_label().startswith("_")}
    assert {"fp32, contiguous", "bf16, contiguous", "fp32, channels_last", "bf16, channels_last"} <= set(series)
    assert len(set(series.values())) == len(series), series
    for (a, (color_a, marker_a)), (b, (color_b, marker_b)) in itertools.combinations(series.items(), 2):
        if marker_a == marker_b:
            assert math.dist(_lab(color_a), _lab(color_b)) >= 40, (a, color_a, b, color_b)


def test_series_styles_are_distinct_and_deterministic_for_any_number_of_series():
    """Precision modes and memory formats beyond the palette's named ones (a future mode, torch's
    channels_last_3d) still get pairs of their own, the same whatever order the trials came in."""
    from autotune.report.styles import FORMAT_MARKERS, PRECISION_COLORS, SERIES_COLORS, SERIES_MARKERS, series_styles

    modes = ["fp32", "tf32", "fp16", "bf16", "fp8", "mxfp8", "nvfp4", "fp6", "int8", "fp4"]
    formats = ["contiguous", "channels_last", "channels_last_3d", "preserve_format"]
    keys = [(m, f) for m in modes for f in formats]
    styles = series_styles(keys)
    assert set(styles) == set(keys)
    assert len(set(styles.values())) == len(keys)  # 40 series, 40 pairs
    assert series_styles(list(reversed(keys))) == styles
    assert styles[("bf16", "contiguous")] == (PRECISION_COLORS["bf16"], FORMAT_MARKERS["contiguous"])
    assert styles[("fp32", "channels_last")] == (PRECISION_COLORS["fp32"], FORMAT_MARKERS["channels_last"])
    every = [(f"mode{i}", "contiguous") for i in range(len(SERIES_COLORS) * len(SERIES_MARKERS) + 5)]
    crowded = series_styles(every)  # more series than pairs: each pair is used before any repeats
    assert len(set(crowded.values())) == len(SERIES_COLORS) * len(SERIES_MARKERS)
