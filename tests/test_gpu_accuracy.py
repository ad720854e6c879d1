"""GPU tests of the accuracy check (issue 4): run on the GPU machine with
`python3 -m pytest -q -m gpu tests/test_gpu_accuracy.py -s` (skipped where there is no CUDA).

They print the figures quoted in the issue: each precision mode's accuracy drop versus FP32 for
ResNet-50 with the number of steps used, and the configuration a budgeted search chooses.
"""

from __future__ import annotations

import json

import pytest

from autotune.accuracy.settings import AccuracySettings
from autotune.accuracy.study.compare import compare_modes, mode_configurations
from autotune.space import SearchSpace
from conftest import run_cli
from strategies.precision import supported_modes

pytestmark = pytest.mark.gpu

SMALL = {"model": "fake_models:tiny_cnn", "input_shape": [3, 32, 32], "num_classes": 10}


def _table(rows):
    for r in rows:
        print(f"  {r['mode']:<24} steps {r.get('steps')}  final loss {r.get('final_loss')}  "
              f"acc {r.get('accuracy')}  drop {r.get('accuracy_drop')}  skipped {r.get('skipped_steps')}  "
              f"loss rel.err {r.get('loss_rel_error')}  grad cos {r.get('grad_cosine')}  {r.get('verdict')}")


def test_small_model_every_mode_on_cuda():
    """tiny_cnn on the GPU: fp32, tf32, fp16 (GradScaler), bf16 pass; fp16 with underflowing
    gradients and no scaler is caught."""
    modes = [m for m in supported_modes("cuda") if m != "fp8"]  # no Linear of tiny_cnn can train in FP8
    space = SearchSpace(device="cuda", precisions=modes)
    settings = AccuracySettings.for_device("cuda", steps=200, batch_size=32)
    rows = compare_modes(workload=SMALL, space=space, settings=settings,
                         configurations=mode_configurations(modes, ["norm+head"]))
    _table(rows)
    by = {r["mode"]: r for r in rows}
    for mode in [m for m in modes if m != "fp16"] + ["fp16"]:
        assert by[mode]["verdict"] == "passed", by[mode]
    underflow = compare_modes(workload={**SMALL, "model": "fake_models:tiny_loss_cnn"}, space=space,
                              settings=settings, configurations=mode_configurations(["fp32", "fp16"]))
    _table(underflow)
    assert {r["mode"]: r["verdict"] for r in underflow}["fp16, no GradScaler"] == "violated"


def test_fp8_is_checked_against_fp32_beside_bf16_on_cuda():
    """FP8 Linear layers (Ada, Hopper) go through the same accuracy check as bf16 on an MLP they apply
    to, and it learns the teacher's task. On the saturated task of before, all three ended at 100%;
    on the teacher-labelled data FP8 ended 1.27 points under FP32 on the H200 (70.99% against
    72.27%: violated), bf16 0.59 over: the check's verdict is the figure, not a pass."""
    if "fp8" not in supported_modes("cuda"):
        pytest.skip("this GPU (or this install: torchao) has no FP8 training")
    modes = ["fp32", "bf16", "fp8"]
    space = SearchSpace(device="cuda", precisions=modes)
    settings = AccuracySettings.for_device("cuda", steps=200, batch_size=32)
    rows = compare_modes(workload={**SMALL, "model": "fake_models:fp8_mlp"}, space=space, settings=settings,
                         configurations=mode_configurations(modes))
    _table(rows)
    by = {r["mode"]: r for r in rows}
    assert by["fp32"]["verdict"] == "passed" and by["bf16"]["verdict"] == "passed", rows
    fp8 = by["fp8"]
    assert fp8["verdict"] in ("passed", "violated") and fp8["reason"], fp8  # judged, with its reason
    assert fp8["accuracy"] > 50 and abs(fp8["accuracy_drop"]) < 5, fp8  # it learns (FP32: about 72%)


def test_resnet50_precision_modes_against_fp32(cli):
    """The figures for the issue: `autotune accuracy --model resnet50` on the H200 (300 steps,
    batch 64, synthetic 10-class data at 224x224)."""
    proc = cli("accuracy", "--model", "resnet50", "--device", "cuda", "--fp32-layers", "norm,head", timeout=3000)
    print(proc.stderr[-6000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {r["mode"]: r for r in result["rows"]}
    print(json.dumps(result["rows"], indent=1, default=str))
    assert rows["fp32"]["verdict"] == "passed" and rows["fp32"]["accuracy"] > 50  # FP32 itself learnt the data
    for mode in ("bf16", "fp16"):
        if mode in rows:
            assert rows[mode]["verdict"] in ("passed", "violated", "unstable")
            assert rows[mode]["steps"] == 300


def test_resnet50_search_within_budget_chooses_a_passing_configuration(tmp_path):
    out = tmp_path / "resnet50"
    proc = run_cli("search", "--model", "resnet50", "--budget", "8m", "--out", str(out), timeout=1500)
    print(proc.stderr[-4000:])
    data = json.loads((out / "config.json").read_text())
    print("chosen:", data["summary"], "|", data["accuracy"]["reason"])
    assert data["accuracy"]["verdict"] == "passed"
    assert data["accuracy"]["accuracy_drop"] <= 0.5
