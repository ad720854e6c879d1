"""`compare` on real output folders: two CPU searches run by the CLI, and the GPU report under
reports/ (copied, and edited where a test needs a run without a baseline or with energy)."""

from __future__ import annotations

import io
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

from autotune.report.compare import compare, load_run, relative_words
from autotune.report.format import fmt_rate
from autotune.errors import ConfigError
from conftest import ROOT, run_cli

GPU_REPORT = ROOT / "reports" / "resnet50-h200"
SMALL = ["--model", "fake_models:tiny_cnn", "--device", "cpu", "--input-shape", "3x32x32", "--num-classes", "10",
         "--min-measure-time", "0.3", "--no-accuracy-check"]  # compare shows speed and knobs, not accuracy


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two real searches of the same model: fp32 only (the baseline only, on a CPU with native bf16
    too), and bf16 allowed
    at a pinned batch of 8 (baseline and one bf16 trial), so the best configurations differ at
    least in the batch. Run side by side to keep the module well under a minute: a trial is mostly
    worker start-up and warm-up, not compute."""
    root = tmp_path_factory.mktemp("cpu-runs")
    default, pinned = root / "default", root / "bf16-batch8"
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_cli, "search", *SMALL, "--precisions", "fp32", "--trials", "1", "--out", str(default)),
                pool.submit(run_cli, "search", *SMALL, "--precisions", "fp32,bf16", "--batch-size", "8",
                            "--trials", "2", "--out", str(pinned))]
        for job in jobs:
            job.result()
    return default, pinned


def _copy_gpu_report(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in ("config.json", "trials.csv"):
        shutil.copy(GPU_REPORT / name, dest / name)
    return dest


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _rows(comparison, title_start: str) -> dict[str, list[str]]:
    section = next(s for s in comparison.sections if s.title.startswith(title_start))
    return {row.label: row.cells for row in section.rows}


def _flat(knobs: dict) -> dict:
    return {f"{k}.{f}": v for k, fields in knobs.items() for f, v in fields.items()}


@pytest.mark.slow
def test_side_by_side_shows_each_runs_recorded_figures(cpu_runs, tmp_path):
    c = compare(list(cpu_runs), tmp_path / "cmp")
    rows = _rows(c, "Best configuration")
    for i, folder in enumerate(cpu_runs):
        data = _config(folder)
        f = data["figures"]
        assert c.runs[i].best.samples_per_s == f["samples_per_s"]
        assert rows["best configuration"][i] == data["summary"]
        assert rows["samples/s"][i] == fmt_rate(f["samples_per_s"])  # three significant digits under 100
        assert rows["step ms"][i] == f"{f['step_time_ms']:.1f}"
        assert rows["peak memory GiB"][i] == f"{f['peak_memory_bytes'] / 2**30:.2f}"
        assert rows["speed-up over own FP32 baseline"][i] == f"{data['speedup_vs_baseline']:.2f}x"
        assert rows["torch"][i] == data["provenance"]["torch"]
        assert data["optimizer"]["class"] == "torch.optim.sgd.SGD"  # the workload's, as the trials stepped it
        assert rows["device"][i] == f"CPU ({data['provenance']['num_cpus']} cores)"
        assert rows["CUDA"][i] == rows["driver"][i] == "-"  # a CPU run has none: not invented
        assert rows["joules per sample"][i] == "not measured"
        assert c.runs[i].label == f"fake_models:tiny_cnn on CPU ({data['provenance']['num_cpus']} cores), " \
                                  f"torch {data['provenance']['torch']}"
    # the terminal table: a label column and one column per run
    assert len(c.table.columns) == 3
    assert [col.header for col in c.table.columns[1:]] == c.columns == ["default", "bf16-batch8"]
    text = _console_text(c.table)
    for title in ("Best configuration side by side", "Knobs that differ", "Relative to default", "Speed-up"):
        assert title in text
    md = c.markdown.read_text()
    assert "| | default | bf16-batch8 |" in md
    assert f"| best configuration | {_config(cpu_runs[0])['summary']} | {_config(cpu_runs[1])['summary']} |" in md


@pytest.mark.slow
def test_only_the_knobs_that_differ_are_listed(cpu_runs, tmp_path):
    c = compare(list(cpu_runs), tmp_path / "cmp")
    a, b = (_flat(_config(f)["knobs"]) for f in cpu_runs)
    expected = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert set(c.differing_knobs) == expected
    assert "batch_size.base_batch_size" in expected  # 16 (the CPU default) against the pinned 8
    assert "grad_scaler.init_scale" not in c.differing_knobs  # the same in both: not listed
    rows = _rows(c, "Knobs that differ")
    assert set(rows) == expected
    assert rows["batch_size.base_batch_size"] == [str(a["batch_size.base_batch_size"]), "8"]
    md = c.markdown.read_text()
    assert f"| batch_size.base_batch_size | {a['batch_size.base_batch_size']} | **8** |" in md  # marked
    assert "grad_scaler.init_scale" not in md


@pytest.mark.slow
def test_ratios_are_relative_to_the_first_run(cpu_runs, tmp_path):
    c = compare(list(cpu_runs), tmp_path / "cmp")
    first, second = (_config(f)["figures"] for f in cpu_runs)
    assert c.ratios["samples_per_s"] == pytest.approx([1.0, second["samples_per_s"] / first["samples_per_s"]])
    assert c.ratios["peak_memory"] == pytest.approx([1.0, second["peak_memory_bytes"] / first["peak_memory_bytes"]])
    ratio = second["samples_per_s"] / first["samples_per_s"]
    assert _rows(c, "Relative to default")["samples/s"] == ["the reference", relative_words(ratio, "faster", "slower")]
    assert relative_words(0.00061, "faster", "slower") == "1,639x slower"  # not "0.00061x"


def test_precision_speedups_of_the_gpu_report(tmp_path):
    gpu = _copy_gpu_report(tmp_path / "h200")
    other = _copy_gpu_report(tmp_path / "h200-again")
    c = compare([gpu, other], tmp_path / "cmp")
    trials = pd.read_csv(gpu / "trials.csv")
    done = trials[trials["state"] == "COMPLETE"]
    base = done[done["role"] == "baseline"]["samples_per_s"].iloc[0]
    for mode in ("fp32", "tf32", "fp16", "bf16"):
        best = done[done["config"].str.startswith(mode + ",")]["samples_per_s"].max()
        assert c.precision_speedups[mode] == pytest.approx([best / base] * 2), mode
    fp16 = done[done["config"].str.startswith("fp16,")]["samples_per_s"].max()
    assert c.precision_speedups["fp16"][0] == pytest.approx(fp16 / base)
    assert c.precision_speedups["fp16"][0] == pytest.approx(_config(gpu)["speedup_vs_baseline"])  # fp16 won
    assert _rows(c, "Speed-up of each precision")["fp16"][0] == f"{fp16 / base:.2f}x ({fp16:,.0f} samples/s)"
    assert c.differing_knobs == {}  # the same run twice
    rows = _rows(c, "Best configuration")
    assert rows["device"] == ["NVIDIA H200"] * 2
    assert rows["cuDNN"] == ["9.19.0"] * 2 and rows["driver"] == ["580.159.04"] * 2 and rows["CUDA"] == ["13.0"] * 2
    assert load_run(gpu).label == "resnet50 on NVIDIA H200, torch 2.11.0+cu130"


@pytest.mark.slow
def test_gpu_report_against_a_cpu_run_of_another_model(cpu_runs, tmp_path):
    gpu = _copy_gpu_report(tmp_path / "resnet50-h200")
    default, pinned = cpu_runs
    with pytest.raises(ConfigError) as err:
        compare([gpu, default], tmp_path / "refused")
    message = str(err.value)
    assert "resnet50" in message and "fake_models:tiny_cnn" in message and "--allow-different-models" in message
    assert not (tmp_path / "refused").exists()

    c = compare([gpu, default, pinned], tmp_path / "cmp", allow_different_models=True)
    rows = _rows(c, "Best configuration")
    assert rows["device"][0] == "NVIDIA H200" and rows["device"][1].startswith("CPU (")
    speedups = c.precision_speedups
    assert speedups["tf32"][1:] == [None, None] and _rows(c, "Speed-up")["tf32"][1:] == ["-", "-"]
    assert speedups["fp16"][1] is None
    # the fp32-only CPU run did not search precision (no param.precision.mode column): fp32 from its descriptions
    assert "param.precision.mode" not in pd.read_csv(default / "trials.csv").columns
    assert speedups["fp32"][1] is not None
    trials = pd.read_csv(pinned / "trials.csv")
    base = _config(pinned)["baseline"]["figures"]["samples_per_s"]
    bf16 = trials[(trials["state"] == "COMPLETE") & trials["config"].str.startswith("bf16,")]["samples_per_s"]
    assert speedups["bf16"][2] == (pytest.approx(bf16.max() / base) if len(bf16) else None)
    assert c.ratios["samples_per_s"][1] == pytest.approx(
        _config(default)["figures"]["samples_per_s"] / _config(gpu)["figures"]["samples_per_s"])
    assert c.chart and "<svg" in c.html.read_text()


def test_a_run_without_baseline_precision_parameter_or_energy_still_compares(tmp_path):
    full = _copy_gpu_report(tmp_path / "full")
    bare = _copy_gpu_report(tmp_path / "bare")
    data = _config(bare)
    data["baseline"] = None
    del data["speedup_vs_baseline"], data["memory_vs_baseline"]
    (bare / "config.json").write_text(json.dumps(data))
    trials = pd.read_csv(bare / "trials.csv")
    trials = trials[trials["role"] != "baseline"].drop(columns=["param.precision.mode"])
    trials.to_csv(bare / "trials.csv", index=False)
    # and the full one measured energy: shown as recorded
    data = _config(full)
    data["figures"]["energy"] = {"joules_per_sample": 0.0731}
    (full / "config.json").write_text(json.dumps(data))

    c = compare([full, bare], tmp_path / "cmp")
    rows = _rows(c, "Best configuration")
    assert rows["FP32 baseline"][1] == "-" and rows["speed-up over own FP32 baseline"][1] == "-"
    assert rows["joules per sample"] == ["0.0731", "not measured"]
    assert c.precision_speedups["fp16"] == [pytest.approx(data["speedup_vs_baseline"]), None]
    # still measured, so the best rate is shown; only the speed-up is unknown
    assert _rows(c, "Speed-up")["fp16"][1] == "- (6,367 samples/s)"
    assert c.ratios["joules_per_sample"] == [1.0, None]
    assert "| joules per sample | 0.0731 | not measured |" in c.markdown.read_text()


def test_fewer_than_two_folders_are_refused(tmp_path):
    gpu = _copy_gpu_report(tmp_path / "h200")
    for folders in ([gpu], []):
        with pytest.raises(ConfigError, match="at least two"):
            compare(folders, tmp_path / "cmp")


def test_a_folder_where_no_configuration_completed_is_refused(tmp_path):
    gpu = _copy_gpu_report(tmp_path / "h200")
    failed = tmp_path / "failed"
    failed.mkdir()
    shutil.copy(GPU_REPORT / "trials.csv", failed / "trials.csv")  # the search wrote trials but no config
    with pytest.raises(ConfigError) as err:
        compare([gpu, failed], tmp_path / "cmp")
    assert str(failed) in str(err.value) and "no configuration completed there" in str(err.value)
    with pytest.raises(ConfigError, match="no configuration completed"):
        load_run(failed)


def test_html_is_self_contained_and_markdown_has_the_tables(tmp_path):
    c = compare([_copy_gpu_report(tmp_path / "a"), _copy_gpu_report(tmp_path / "b")], tmp_path / "cmp")
    page = c.html.read_text()
    assert c.html == tmp_path / "cmp" / "compare.html" and c.markdown == tmp_path / "cmp" / "compare.md"
    assert not re.search(r"https?://", page), re.findall(r".{40}https?://.{40}", page)
    assert not re.search(r"<script[^>]*\bsrc=|<link\b|<img\b|@import|url\((?!#)", page)  # url(#clip) is the SVG's own
    assert "<style>" in page and "<svg" in page and "fp16, channels_last, batch 1024" in page
    md = c.markdown.read_text()
    assert "## Best configuration side by side" in md and "| | a | b |" in md
    assert "| samples/s | 6,367 | 6,367 |" in md
    assert "| speed-up over own FP32 baseline | 7.08x | 7.08x |" in md
    assert "| fp16 | 7.08x (6,367 samples/s) | 7.08x (6,367 samples/s) |" in md


OLDER, NEWER = (ROOT / "reports" / "search-yield" / name / "resnet50-5m" for name in ("h200-b092e42", "h100-867eb8d"))
"""The same ResNet-50 search at two commits: the newer config.json records knobs the older one had not."""


def test_knobs_at_their_defaults_or_that_do_not_apply_are_no_difference(tmp_path):
    """The older run lacks fp8_layers, llm_kernels and depthwise_conv; the newer one has them at their
    defaults (fp8_layers applies to fp8 alone; both runs are bf16): none of them differs. The swapped stem
    and the second CUDA stream do."""
    c = compare([OLDER, NEWER], tmp_path / "cmp")
    old, new = (_flat(_config(f)["knobs"]) for f in (OLDER, NEWER))
    assert "fp8_layers.layers" not in old and new["fp8_layers.layers"] == "all"  # what the rows were made of
    rows = _rows(c, "Knobs that differ")
    assert rows == {"streams.num_streams": ["1", "2"], "stem_conv.stem": ["-", "space_to_depth"]}
    assert set(c.differing_knobs) == set(rows)
    md = c.markdown.read_text()
    for knob in ("fp8_layers", "llm_kernels", "depthwise_conv", "activation_checkpointing"):
        assert knob not in md


def test_a_knob_differs_only_where_it_applies_and_a_missing_one_is_its_default():
    from autotune.report.compare import DOES_NOT_APPLY, differing_knobs

    bf16 = {"precision": {"mode": "bf16"}, "grad_scaler": {"enabled": False, "init_scale": 65536.0}}
    older = {"precision": {"mode": "bf16"}}  # before grad_scaler and fp8_layers were recorded
    fp16 = {"precision": {"mode": "fp16"}, "grad_scaler": {"enabled": True, "init_scale": 1024.0}}
    fp8 = {"precision": {"mode": "fp8"}, "fp8_layers": {"layers": "feed-forward"}}
    # a GradScaler's settings mean nothing without fp16, fp8_layers' nothing without fp8
    assert differing_knobs([bf16, {**bf16, "grad_scaler": {"enabled": False, "init_scale": 1024.0}}]) == {}
    assert differing_knobs([bf16, {**bf16, "fp8_layers": {"layers": "feed-forward"}}]) == {}
    assert differing_knobs([older, {**bf16, "fp8_layers": {"layers": "all"}}]) == {}
    assert differing_knobs([bf16, fp16]) == {
        "precision.mode": ["bf16", "fp16"], "grad_scaler.enabled": [DOES_NOT_APPLY, True],
        "grad_scaler.init_scale": [DOES_NOT_APPLY, 1024.0]}
    assert differing_knobs([older, fp8]) == {"precision.mode": ["bf16", "fp8"],
                                             "fp8_layers.layers": [DOES_NOT_APPLY, "feed-forward"]}
    # missing, and the other run's value is not the default: a difference, shown as not recorded
    assert differing_knobs([older, {**older, "stem_conv": {"stem": "space_to_depth"}}]) == {
        "stem_conv.stem": [None, "space_to_depth"]}


def _console_text(table) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()
