"""The numerics parity check (autotune.accuracy.worker.parity): configurations that must fail do, every
time (fp16 gradients that underflow without a GradScaler, fp16 activations that overflow, bf16
weights with no FP32 master copy, a norm gain whose gradient is zeroed, on a LayerNorm MLP and on a
BatchNorm ConvNet), harmless changes pass (another reduction order, other calibration directions, the
fused optimizer, activation checkpointing, bf16 autocast), each band is k times the calibrations'
noise plus a floor, and a band wider than MAX_BAND judges nothing. The models are
scripts/parity_models.py's."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch

from autotune.accuracy.study.reference_cache import ReferenceCache, reference_key
from autotune.accuracy.worker.parity import (
    BF16_EPS,
    MAX_BAND,
    ParityResult,
    ParitySettings,
    check_parity,
    judge,
    parity_recipe,
    perturb_weights,
    run_parity,
)
from autotune.accuracy.worker.parity_figures import TENSOR_FIGURES, loss_deviation, progress_drift
from autotune.accuracy.worker.parity_verdict import NOISE_TENSOR, REPORTED_ONLY, floor_of
from autotune.accuracy.worker.reference_file import read_reference
from autotune.errors import ConfigError
from autotune.workload.models import WorkloadSpec

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
FP16 = {"precision": {"mode": "fp16"}}
FP16_SCALED = {"precision": {"mode": "fp16"}, "grad_scaler": {"enabled": True, "init_scale": 65536.0}}
BF16 = {"precision": {"mode": "bf16"}}
SETTINGS = ParitySettings(steps=10, batch_size=16)


@pytest.fixture(autouse=True)
def parity_models(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import parity_models

    return parity_models


def spec(name: str) -> WorkloadSpec:
    return WorkloadSpec(model=f"parity_models:{name}")


def check(name, knobs, settings=SETTINGS, *, reference=None, transform=None, device="cpu"):
    recipe = parity_recipe(knobs, device)
    if transform is not None:
        recipe.model_transforms.append(transform)
    return check_parity(spec(name), knobs, settings, device=device, reference=reference, recipe=recipe)


# the verdict, on figures -------------------------------------------------------------------------

def _noise(**figures):
    """A tensor's calibration noise: every figure 1e-6 unless given."""
    return {f: figures.get(f, 1e-6) for f in TENSOR_FIGURES}


def _reference(cal_loss=1e-3, tensors=None, losses=(2.0, 1.8, 1.6), drift=0.01):
    return {"losses": list(losses), "calibration": {
        "runs": 2, "loss_deviation": cal_loss, "progress_drift": drift,
        "tensors": tensors if tensors is not None else {"w": _noise(), "b": _noise()}}}


def _sums(rel=0.01, size=1.0, vanished=0.0, n=100):
    """Sums (|g-r|^2, |r|^2, |g|^2, g.r, vanished, nonzero) of a tensor whose reference norm is 1,
    relative error ``rel``, norm ``size`` and ``vanished`` of its ``n`` elements zero."""
    dot = (1 + size ** 2 - rel ** 2) / 2
    return (rel ** 2, 1.0, size ** 2, dot, vanished * n, float(n))


def _run(losses, w_rel=0.01, b_rel=0.01, **updates):
    return {"losses": list(losses), "sums": {"grads": {"w": _sums(w_rel), "b": _sums(b_rel)},
                                             "updates": {"w": _sums(**updates), "b": _sums()}}}


def test_each_band_is_k_times_the_calibrations_noise_plus_a_floor():
    settings = ParitySettings(k=4, loss_floor=0.01, grad_floor=0.1)
    ref = _reference(cal_loss=1e-3)
    inside = judge(_run([2.0, 1.8 * 1.013, 1.6]), ref, settings, label="x")
    assert inside.band.loss == pytest.approx(4 * 1e-3 + 0.01)
    assert inside.verdict == "passed" and inside.loss_deviation == pytest.approx(0.013)  # 2 steps: windows of 1
    outside = judge(_run([2.0, 1.8 * 1.03, 1.6]), ref, settings, label="x")
    assert outside.verdict == "violated" and not outside.passed
    assert "its loss is 3% off FP32's over 2 steps (the run-to-run noise allows 1.4%)" in outside.reason
    # a tensor past its band fails however close the loss is, and the reason names it
    grads = judge(_run([2.0, 1.8, 1.6], b_rel=0.2), ref, settings, label="x")
    assert grads.verdict == "violated" and grads.grad_tensor == "b" and grads.grad_deviation == pytest.approx(0.2)
    assert grads.grad_figure == "grad_error" and grads.band.grad == pytest.approx(0.1 + 4e-6)
    assert grads.reason.startswith("x: violated: 1 tensor's first gradient is off FP32's (b's by 20%; the run-to-run "
                                   "noise allows 10%)")
    assert "\n" not in grads.reason
    # every figure's band is reported beside what was measured
    figures = {f["figure"]: f for f in grads.figures}
    assert set(figures) == {"loss", "progress", *TENSOR_FIGURES}
    assert all(f["band"] == pytest.approx(4 * f["noise"] + floor_of(f["figure"], settings, 100.0))
               for f in grads.figures if f["tensor"] and f["figure"] not in REPORTED_ONLY)
    # an update's direction is reported, never judged
    assert [f["band"] for f in grads.figures if f["figure"] == "update_error"] == [None]


def test_a_band_wider_than_max_band_judges_nothing():
    """Where the run-to-run noise needs a band past MAX_BAND (50% of what it bounds), the figure says
    nothing of the numerics: it is reported, not judged, and the verdict rests on the others; a tensor
    whose update stops is still caught by its stalled share, whose noise is nil."""
    chaotic = {"w": _noise(grad_error=0.4, update_error=1.2, update_size=0.3), "b": _noise()}
    ref = _reference(cal_loss=0.2, tensors=chaotic)  # 3 x 0.2 + 1.6%: loss not judged
    result = judge(_run([2.0, 1.8 * 1.3, 1.6], w_rel=0.9, rel=1.3, size=0.6), ref, ParitySettings(), label="bn")
    assert MAX_BAND == 0.5 and result.verdict == "passed", result.reason
    assert result.band.loss is None and result.tensors["w"]["band_grad_error"] is None
    assert result.tensors["w"]["band_update_error"] is None and result.tensors["w"]["band_update_size"] is None
    assert all(f["band"] is None or f["band"] <= MAX_BAND for f in result.figures)
    assert "too noisy here to judge: loss" in result.reason
    frozen = judge(_run([2.0, 1.8, 1.6], rel=1.0, size=0.0, vanished=1.0), ref, ParitySettings(), label="bn")
    assert frozen.verdict == "violated" and frozen.reason.startswith(
        "bn: violated: 1 tensor stops learning (w: 100% of its weights never moved where FP32's did")


def test_a_tensor_whose_fp32_gradient_is_rounding_noise_is_not_judged_alone():
    """A bias before a BatchNorm: its exact gradient is zero, FP32's is rounding noise, which the
    calibrations' change of the weights moves by more than itself; 16-bit noise is far larger."""
    ref = _reference(tensors={"w": _noise(), "b": _noise(grad_error=1.3, grad_size=0.4)})
    run = _run([2.0, 1.8, 1.6], b_rel=50.0)
    run["sums"]["grads"]["b"] = _sums(50.0, size=50.0, vanished=0.5)
    result = judge(run, ref, ParitySettings(), label="x")
    assert 1.3 > NOISE_TENSOR and result.noise_tensors == ["b"]
    assert result.verdict == "passed" and result.grad_tensor == "w"
    assert result.tensors["b"]["grad_error"] == pytest.approx(50.0)  # still reported
    assert result.tensors["b"]["band_grad_vanished"] is None


def test_nan_losses_gradients_and_weights_are_unstable():
    ref = _reference()
    nan_loss = judge(_run([2.0, float("nan")]), ref, ParitySettings(), label="fp16")
    assert nan_loss.verdict == "unstable" and nan_loss.reason == "fp16: unstable: the loss was NaN/Inf at step 2 " \
                                                                  "(FP32's stayed finite)"
    for kind in ("grads", "updates"):
        run = _run([2.0, 1.8, 1.6])
        run["sums"][kind]["w"] = (math.inf, 1.0, math.inf, math.nan, 0.0, 100.0)
        assert judge(run, ref, ParitySettings(), label="x").verdict == "unstable"


def test_a_run_stopped_on_its_first_gradients_is_violated_on_the_step_it_ran():
    """A configuration's run whose first gradients are out of band stops after its first step
    (parity._one_run, by gradients_out_of_band, the rule judge applies): violated, its loss deviation
    that step's (finite), its progress and updates not judged; the reason says what failed and that
    it stopped."""
    from autotune.accuracy.worker.parity_verdict import gradients_out_of_band

    settings = ParitySettings(k=4, loss_floor=0.01, grad_floor=0.1)
    ref = _reference(tensors={"w": _noise(grad_error=0.01), "b": _noise(grad_error=1.2)})
    assert gradients_out_of_band({"grads": {"w": _sums(0.13), "b": _sums(50.0)}}, ref["calibration"], settings) is None
    assert gradients_out_of_band({"grads": {"w": _sums(0.15)}}, ref["calibration"], settings) == "w"  # band 14%
    assert gradients_out_of_band({"grads": {"w": _sums(0.01, vanished=0.2)}}, ref["calibration"], settings) == "w"
    nan = {"w": (math.inf, 1.0, math.inf, math.nan, 0.0, 100.0)}
    assert gradients_out_of_band({"grads": nan}, ref["calibration"], settings) == "w"
    first = {"losses": [2.01], "sums": {"grads": {"w": _sums(0.15)}, "updates": {}}, "stopped": "gradients"}
    stopped = judge(first, ref, settings, label="fp8")
    assert stopped.verdict == "violated" and stopped.steps == 1 and stopped.stopped == "gradients"
    assert stopped.loss_deviation == pytest.approx(0.005)  # over the step it ran
    assert stopped.progress_drift is None and stopped.band.drift is None
    assert stopped.reason == ("fp8: violated: 1 tensor's first gradient is off FP32's (w's by 15%; the run-to-run "
                              "noise allows 14%); stopped after its first step, the first gradients already out of band")
    # the same run had it not stopped: its loss deviation infinite (it ran short), and nothing said of a stop
    short = judge({**first, "stopped": None}, ref, settings, label="fp8")
    assert short.verdict == "unstable" and "stopped" not in short.reason and short.stopped is None
    unstable = judge({**first, "sums": {"grads": nan}}, ref, settings, label="fp16")
    assert unstable.verdict == "unstable"
    assert unstable.reason == ("fp16: unstable: a gradient or weight went NaN/Inf (FP32's stayed finite); stopped "
                               "after its first step, the first gradients already out of band")
    assert ParityResult.from_dict(json.loads(json.dumps(stopped.to_dict()))) == stopped


def test_a_tensor_that_stops_moving_or_moves_at_the_wrong_scale_fails_whatever_its_gradient():
    """A tensor's update over the run against FP32's: stalled (weights that never moved where FP32's
    did: a frozen gain, updates rounded away) or the wrong size fails, though its first gradient, the
    loss and the progress are FP32's."""
    ref = _reference()
    stalled = judge(_run([2.0, 1.8, 1.6], rel=1.0, size=0.0, vanished=1.0), ref, ParitySettings(), label="bf16")
    assert stalled.verdict == "violated" and stalled.grad_figure in ("update_stalled", "update_size", "update_error")
    assert stalled.reason.startswith("bf16: violated: 1 tensor stops learning (w: 100% of its weights never moved "
                                     "where FP32's did; the run-to-run noise allows 2%)")
    small = judge(_run([2.0, 1.8, 1.6], rel=0.5, size=0.5), ref, ParitySettings(), label="fp16")
    assert small.verdict == "violated" and "1 tensor's update is the wrong size (w's is 50% of FP32's" in small.reason
    near = judge(_run([2.0, 1.8, 1.6], rel=0.05, size=0.95), ref, ParitySettings(), label="bf16")
    assert near.verdict == "passed" and near.reason.startswith("bf16: passed: trains like FP32 here (loss within 0% "
                                                              "of FP32's over 2 steps, the run-to-run noise allows")


def test_settings_say_what_is_wrong_and_the_fingerprint_leaves_the_band_out():
    with pytest.raises(ConfigError, match="at least one step"):
        ParitySettings(steps=0)
    with pytest.raises(ConfigError, match="batch of at least 1"):
        ParitySettings(batch_size=0)
    with pytest.raises(ConfigError, match="k and floors"):
        ParitySettings(k=-1)
    with pytest.raises(ConfigError, match="at least one calibration"):
        ParitySettings(calibrations=0)
    base = ParitySettings()
    assert base.fingerprint() == ParitySettings(k=10, loss_floor=0.5, size_floor=0.3, max_band=0.9).fingerprint()
    assert base.fingerprint() != ParitySettings(steps=21).fingerprint()
    assert base.fingerprint() != ParitySettings(calibrations=3).fingerprint()
    assert ParitySettings.from_dict({**base.to_dict(), "unknown": 1}) == base
    # 40 steps and the first batch again; with nothing kept, the reference's and two calibrations' too
    assert base.loss_floor == 2 * BF16_EPS and base.first_verdict_runs == 4
    assert base.step_equivalents(reference_kept=True) == 41
    assert base.step_equivalents(reference_kept=False) == 4 * 41


def test_the_calibration_moves_every_weight_to_a_bf16_neighbour_and_leaves_the_global_rng():
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.bias[:8] = torch.tensor([2.0 ** 16, 1.0, -0.5, 0.0, 3.0, -2.0 ** 10, 0.25, 6.0])  # bf16 values
    before = model.weight.detach().clone()
    state = torch.get_rng_state()
    perturb_weights(model, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    moved = model.weight.detach()
    # each weight is now a bf16 value, its truncation towards zero or one bf16 step past that
    assert torch.equal(moved, moved.to(torch.bfloat16).float())
    step = (before.abs() - moved.abs()).abs() / before.abs()
    assert float(step.max()) <= 2.0 ** -7 and bool((torch.sign(moved) == torch.sign(before)).all())
    down = moved.abs() <= before.abs()
    assert 0.4 < float(down.float().mean()) < 0.6
    assert torch.equal(model.bias[:8], torch.tensor([2.0 ** 16, 1.0, -0.5, 0.0, 3.0, -2.0 ** 10, 0.25, 6.0]))


def test_a_run_that_learns_less_of_the_first_batch_than_fp32_fails_on_its_progress():
    """The last step is the first batch again: FP32's loss on it fell 2.0 -> 1.5; a run whose own
    loss fell 2.01 -> 1.71 made 60% of that progress (lost 40%, band 25% + 3 x the calibrations')."""
    ref = _reference(cal_loss=0.05, losses=[2.0, 1.8, 1.6, 1.5])  # a loss band of 17%
    assert progress_drift([2.01, 1.8, 1.6, 1.71], ref["losses"]) == pytest.approx(0.4)
    slow = judge(_run([2.01, 1.8, 1.6, 1.71]), ref, ParitySettings(), label="x")
    assert slow.verdict == "violated" and slow.band.drift == pytest.approx(0.28)
    assert slow.reason.startswith("x: violated: it learnt 40% less than FP32 on the first batch (the run-to-run noise "
                                  "allows 28%)")
    # a rounding offset of the loss itself (the same on the first and last step) cancels
    assert judge(_run([2.02, 1.82, 1.62, 1.52]), ref, ParitySettings()).verdict == "passed"
    # where FP32 learnt nothing of the batch there is nothing to lose: not judged
    flat = {**ref, "losses": [2.0, 1.8, 1.6, 2.1]}
    assert progress_drift([2.0, 1.8, 1.6, 2.5], flat["losses"]) is None


def test_the_loss_is_compared_over_windows_of_steps():
    """At batch 8 one step's loss scatters with its batch; the trajectory is compared as the means of
    windows of steps // LOSS_WINDOW steps, the first step alone (both runs from the same weights)."""
    from autotune.accuracy.worker.parity_figures import LOSS_WINDOW, window_means

    assert LOSS_WINDOW == 8 and window_means([1.0, 3.0, 2.0, 4.0], 4) == [1.0, 3.0, 2.0, 4.0]
    assert window_means([1.0] * 8 + [3.0] * 8, 16) == [1.0] * 8 + [2.0] + [3.0] * 7  # windows of 2 steps
    ref = [2.0] * 16 + [1.5]
    zigzag = [2.0] + [2.0 * (1.1 if i % 2 else 0.9) for i in range(1, 16)] + [1.5]  # 10% off, even on average
    assert loss_deviation(zigzag, ref, 16) == pytest.approx(0.05)  # the window of steps 1-2; the others 0
    assert loss_deviation([1.8] + zigzag[1:], ref, 16) == pytest.approx(0.1)  # the first step is a window


# must fail ---------------------------------------------------------------------------------------

def test_fp16_without_a_grad_scaler_fails_where_gradients_underflow_and_passes_with_one():
    """Every gradient of the logits is below half of fp16's smallest subnormal: without loss scaling
    they all round to zero (no layer learns), with the GradScaler's 65,536 they are kept."""
    bare, reference = check("underflow_mlp", FP16)
    assert bare.verdict == "violated"
    assert bare.grad_rel_error == pytest.approx(1.0) and bare.grad_cosine == 0.0  # all zero
    assert all(t["grad_vanished"] == 1.0 for t in bare.tensors.values())
    # out of band on its first gradients, it stopped there: its other steps could not make it pass
    assert bare.steps == 1 and bare.stopped == "gradients" and bare.progress_drift is None
    assert bare.reason.startswith("fp16, no GradScaler: violated: gradients vanish in 18 tensors (")
    assert bare.reason.endswith("stopped after its first step, the first gradients already out of band")
    scaled, _ = check("underflow_mlp", FP16_SCALED, reference=reference)
    assert scaled.verdict == "passed", scaled.reason
    assert scaled.loss_deviation < bare.band.loss / 10 and scaled.grad_rel_error < 0.01 and scaled.progress_drift < 0.1
    assert scaled.steps == SETTINGS.steps + 1 and scaled.stopped is None  # every step, and the first batch again


def test_a_check_that_fails_on_its_first_gradients_stops_there_every_time_and_says_so_in_its_phases():
    """Over seeds, fp16 without a GradScaler on underflow_mlp fails on its first gradients, and its
    run (the worker's phases: RUN_PHASES) takes one step where the reference and calibration ran every
    one; a scaler whose first steps overflow (skipped, taken again at a lower scale, the fused step
    reading their Inf gradients) stops on none of them: it is judged on the step taken, and passes."""
    for seed in range(3):
        request = {"workload": spec("underflow_mlp").to_dict(), "device": "cpu", "knobs": FP16,
                   "settings": ParitySettings(steps=6, seed=seed).to_dict(), "reference": None}
        answer = run_parity(request)
        result = ParityResult.from_dict(answer["result"])
        assert result.verdict == "violated" and result.steps == 1 and result.stopped == "gradients", result.reason
        assert [(r["steps_run"], r["stopped"]) for r in answer["runs"]] == [(7, None)] * 3 + [(1, "gradients")]
    high = {"precision": {"mode": "fp16"}, "grad_scaler": {"enabled": True, "init_scale": 2.0 ** 40},
            "optimizer": {"implementation": "fused"}}
    answer = run_parity({**request, "knobs": high, "reference": answer["reference"]})
    result = ParityResult.from_dict(answer["result"])
    assert result.skipped_steps > 0 and result.steps == 7 and result.stopped is None
    assert result.verdict == "passed", result.reason


def test_fp16_fails_where_activations_overflow_with_or_without_a_grad_scaler():
    """Inputs in raw units reach the first layer as 2**17 times N(0, 1): past fp16's 65,504 they turn
    to inf in the forward pass, which no loss scale can undo; bf16 (FP32's range) trains it."""
    bare, reference = check("overflow_mlp", FP16)
    assert bare.verdict == "unstable" and "NaN/Inf at step 1" in bare.reason
    scaled, _ = check("overflow_mlp", FP16_SCALED, reference=reference)
    assert scaled.verdict == "unstable" and scaled.reason.startswith("fp16, GradScaler init 65536: unstable")
    bf16, _ = check("overflow_mlp", BF16, reference=reference)
    assert bf16.verdict != "unstable" and bf16.loss_deviation < bf16.band.loss


@pytest.mark.slow
def test_bf16_weights_without_an_fp32_master_copy_fail_where_bf16_autocast_passes(parity_models):
    """At lr 1e-4 every AdamW update is under half of bf16's spacing at weights of magnitude 1 to 2:
    bf16 weights never move, FP32 master weights (bf16 autocast) do, at the same learning rate. The
    loss stays within its band (FP32 learns slowly at this rate); the weights stall, the progress is lost."""
    settings = ParitySettings(steps=20, batch_size=16)
    lost, reference = check("wide_linear", BF16, settings, transform=parity_models.bf16_weights)
    assert lost.verdict == "violated" and lost.tensors["weight"]["update_stalled"] == 1.0, lost.reason
    assert lost.progress_drift > 3 * lost.band.drift
    assert lost.tensors["weight"]["grad_error"] < 0.1  # the first step's gradients are fine: its updates are lost
    assert lost.steps == settings.steps + 1 and lost.stopped is None  # so it ran every step
    assert lost.reason.startswith("bf16: violated: 1 tensor stops learning (weight: 100% of its weights never moved")
    kept, _ = check("wide_linear", BF16, settings, reference=reference)
    assert kept.verdict == "passed" and kept.loss_deviation < kept.band.loss / 3, kept.reason


def test_on_a_layernorm_mlp_a_zeroed_gain_and_bf16_weights_fail_where_bf16_autocast_passes(parity_models):
    """A norm gain whose gradient is zeroed (frozen by mistake) fails on its first gradient and stops
    there; bf16 weights with no FP32 master copy stall at lr 1e-4 (AdamW's updates under half of
    bf16's spacing at |w| > 0.026, every gain at 1.0); bf16 autocast, FP32 master weights, passes."""
    frozen, reference = check("mlp", {}, transform=parity_models.zero_grad_of())
    assert frozen.verdict == "violated" and frozen.stopped == "gradients" and frozen.grad_tensor == "norm.weight"
    assert frozen.reason.startswith(
        "fp32: violated: gradients vanish in 1 tensor (norm.weight: 100% of its first gradient is zero where FP32's "
        "is not;")
    stalled, _ = check("mlp", BF16, reference=reference, transform=parity_models.bf16_weights)
    assert stalled.verdict == "violated" and stalled.stopped is None
    assert stalled.tensors["norm.weight"]["update_stalled"] == 1.0 and "stop learning" in stalled.reason
    kept, _ = check("mlp", BF16, reference=reference)
    assert kept.verdict == "passed", kept.reason
    assert all(t["update_stalled"] <= 0.02 and t["grad_vanished"] <= 0.02 for t in kept.tensors.values())
    assert all(f["band"] is None or f["band"] <= MAX_BAND for f in frozen.figures + stalled.figures + kept.figures)


def test_on_a_batchnorm_convnet_a_zeroed_gain_and_bf16_weights_fail_where_bf16_autocast_passes(parity_models):
    """The same rules on two convolutions with BatchNorm, over seeds: a BatchNorm gain whose gradient
    is zeroed fails, bf16 weights stall, bf16 autocast passes; no band judged by is wider than 50%."""
    for seed in range(2):
        settings = ParitySettings(steps=8, batch_size=8, seed=seed)
        frozen, reference = check("bn_cnn", {}, settings, transform=parity_models.zero_grad_of())
        assert frozen.verdict == "violated" and frozen.grad_tensor == "features.1.weight", frozen.reason
        stalled, _ = check("bn_cnn", BF16, settings, reference=reference, transform=parity_models.bf16_weights)
        assert stalled.verdict == "violated" and stalled.tensors["features.1.weight"]["update_stalled"] == 1.0
        kept, _ = check("bn_cnn", BF16, settings, reference=reference)
        assert kept.verdict == "passed", kept.reason
        assert kept.reason.startswith("bf16: passed: trains like FP32 here (loss within ")
        bands = [f["band"] for r in (frozen, stalled, kept) for f in r.figures if f["band"] is not None]
        assert bands and max(bands) <= MAX_BAND


# must pass ---------------------------------------------------------------------------------------

def test_harmless_changes_pass_and_equivalent_kernels_match_fp32():
    """Another reduction order (1 thread instead of 2), other one-ulp directions, AdamW's fused
    kernel, and activation checkpointing, which recomputes the same FP32 forward bit for bit."""
    settings = ParitySettings(steps=10, batch_size=16, seed=1)
    ckpt, reference = check("mlp", {"activation_checkpointing": {"every": 1}}, settings)
    assert ckpt.verdict == "passed" and ckpt.loss_deviation == 0.0 and ckpt.grad_rel_error == 0.0
    fused, _ = check("mlp", {"optimizer": {"implementation": "fused"}}, settings, reference=reference)
    assert fused.verdict == "passed" and fused.grad_rel_error == 0.0  # the same gradients; updates round alike
    assert fused.loss_deviation < 1e-5
    threads, _ = check("mlp", {"threads": {"num_threads": 1}}, settings, reference=reference)
    assert threads.verdict == "passed" and threads.loss_deviation < 1e-5
    other, _ = check("mlp", {}, settings, reference=reference, transform=functools.partial(perturb_weights, seed=99))
    assert other.verdict == "passed" and other.loss_deviation < other.band.loss / 2
    assert 0 < reference["calibration"]["loss_deviation"] < 1e-2 and reference["calibration"]["runs"] == 2


def test_bf16_autocast_on_a_well_conditioned_model_passes_within_the_floor():
    """bf16 autocast keeps FP32 master weights: on the mlp at lr 1e-4 its loss stays within a tenth
    of a percent of FP32's (band 1.7%), its updates' sizes within a few percent; fp16 with the
    GradScaler is closer still."""
    bf16, reference = check("mlp", BF16)
    assert bf16.verdict == "passed", bf16.reason
    assert bf16.loss_deviation < bf16.band.loss / 3
    fp16, _ = check("mlp", FP16_SCALED, reference=reference)
    assert fp16.verdict == "passed" and fp16.loss_deviation < bf16.loss_deviation


# the reference kept across searches, and the worker's request -------------------------------------

def test_a_kept_reference_gives_the_same_verdict_at_the_cost_of_one_fp32_run(tmp_path):
    """The cache keeps the reference's losses and its calibrations' figures (JSON), not its tensors:
    a check from it takes the FP32 reference's run again (not its calibrations') for them."""
    cache = ReferenceCache(tmp_path)
    workload = spec("underflow_mlp").to_dict()
    trained, reference = check("underflow_mlp", FP16)
    assert reference["reference_source"] == "trained" and reference["device_name"] == "cpu"

    def key(settings):  # the gate's key (autotune.accuracy.study.gate): workload, settings, device, torch
        return reference_key(workload, settings, device_name="cpu", torch_version=torch.__version__)

    assert cache.load(key(SETTINGS)) is None
    assert cache.store(key(SETTINGS), reference, {**workload, "device": "cpu"})
    found = {**cache.load(key(SETTINGS)), "reference_source": "cache"}
    assert found["losses"] == reference["losses"] and found["calibration"] == reference["calibration"]
    # another step count is another reference
    assert cache.load(key(ParitySettings(steps=11))) is None
    again, _ = check("underflow_mlp", FP16, reference=found)
    assert again.reference_source == "cache"
    assert (again.verdict, again.losses, again.grad_rel_error) == (trained.verdict, trained.losses, trained.grad_rel_error)


def test_the_worker_request_round_trips_through_json(tmp_path):
    request = {"workload": spec("mlp").to_dict(), "device": "cpu", "knobs": BF16,
               "settings": ParitySettings(steps=3).to_dict(), "reference": None,
               "reference_path": str(tmp_path / "reference.json")}
    answer = json.loads(json.dumps(run_parity(json.loads(json.dumps(request)))))
    # the reference it trained was also written before the configuration's run (read_reference)
    assert read_reference(tmp_path / "reference.json")["losses"] == answer["reference"]["losses"]
    assert read_reference(tmp_path / "none.json") is None
    result = ParityResult.from_dict(answer["result"])
    assert answer["status"] == "ok" and result.label == "bf16" and result.steps == 4  # and the first batch again
    assert result.verdict in ("passed", "violated") and result.band.loss > 0
    again = run_parity({**request, "reference": answer["reference"]})
    assert again["result"]["losses"] == answer["result"]["losses"]
    # each run's seconds by phase come back: the reference, its calibration (perturbed) and the configuration's
    # run; with a reference given, the FP32 step whose gradients are compared and the configuration's run
    runs = answer["runs"]
    assert len(runs) == 4 and [r["compared"] for r in runs] == [False, True, True, True]
    assert [r["steps_run"] for r in runs] == [4, 4, 4, 4] and runs[1]["perturb"] >= 0 and runs[0]["perturb"] < 0.01
    assert all(set(r) >= {"build", "perturb", "first step", "steps"} for r in runs)
    assert [r["steps_run"] for r in again["runs"]] == [4, 4]  # the reference's run again for its tensors
    # and the worker's own seconds, which hold its runs' phases (the rest of a check's is its start and exit)
    phases = sum(r[k] for r in runs for k in ("build", "perturb", "first step", "steps"))
    assert phases - 0.05 <= answer["in_worker_s"] < phases + 30



@pytest.mark.parametrize("given_reference", [False, True])
def test_a_parity_worker_builds_its_data_where_its_runs_build_the_model(monkeypatch, given_reference):
    """The data's workload is built where the runs initialise the model (an hf: model on the GPU), so
    that the runs copy that build: built on the CPU for the data alone, a 1B Llama's 1.24B weights
    take seconds of the worker for nothing. On the CPU, one build serves them all."""
    import autotune.accuracy.worker.check as check_module
    import autotune.workload.models as models

    class Stop(Exception):
        pass

    def recorded(spec, settings, device, *, init_device="cpu"):
        raise Stop(init_device)

    monkeypatch.setattr(check_module, "datasets", recorded)
    request = {"workload": spec("mlp").to_dict(), "device": "cuda", "knobs": BF16,
               "settings": ParitySettings(steps=3).to_dict(), "reference": {"losses": []} if given_reference else None,
               "reference_only": not given_reference}
    with pytest.raises(Stop, match="^cuda$"):
        run_parity(request)
    monkeypatch.undo()
    builds = []
    real = models.build
    monkeypatch.setattr(check_module, "_PRISTINE", {})
    monkeypatch.setattr(models, "build", lambda *a, **kw: builds.append(kw) or real(*a, **kw))
    answer = run_parity({**request, "device": "cpu", "reference": None, "reference_only": False})
    assert answer["status"] == "ok" and len(answer["runs"]) == 4
    assert builds == [{"init_device": "cpu"}]  # the data's build, which the four runs copied


def test_the_fp32_reference_steps_with_fused_adamw_on_a_gpu_and_as_the_user_wrote_it_on_a_cpu():
    """A foreach AdamW step holds a new FP32 tensor a parameter (4.6 GiB for the 1B Llama, whose FP32
    step at batch 1 peaked at 23.9 GiB under a 24 GiB cap): on a GPU the reference steps fused."""
    from autotune.accuracy.worker.parity import parity_recipe, reference_knobs

    assert parity_recipe(reference_knobs("cuda"), "cuda").optimizer_implementation == "fused"
    assert parity_recipe(reference_knobs("cuda"), "cuda").autocast_dtype is None  # still FP32
    assert parity_recipe(reference_knobs("cpu"), "cpu").optimizer_implementation == "default"


def test_a_gradients_figures_are_summed_in_chunks_as_whole_and_unscaled():
    """A 1B Llama's embedding gradient is 262M elements: summed whole in FP64 it took four 2 GB
    copies on a card its FP32 step had filled. In chunks the figures are the same, and a GradScaler's
    scale divides each chunk."""
    from autotune.accuracy.worker.parity_grads import tensor_sums

    g, r = torch.randn(1000, 37), torch.randn(1000, 37)
    g.view(-1)[:10], r.view(-1)[5:20] = 0.0, 0.0  # 5 elements vanished where r is not zero, of 37,000 - 15
    whole = [float((g.double() - r.double()).pow(2).sum()), float(r.double().pow(2).sum()),
             float(g.double().pow(2).sum()), float((g.double() * r.double()).sum()), 5.0, 37000.0 - 15]
    assert tensor_sums(g, r, chunk=999) == pytest.approx(whole, rel=1e-12)
    assert tensor_sums(g * 1024, r, scale=torch.tensor(1024.0), chunk=999) == pytest.approx(whole, rel=1e-12)

def test_a_large_gradient_is_compared_on_a_sample_that_estimates_its_figures():
    """A tensor of more than GRAD_SAMPLE elements keeps and compares GRAD_SAMPLE of them, the same ones
    in every run (drawn from the seed and its name): its relative error and cosine are estimated within
    about 1% of the whole tensor's, and a NaN anywhere in it is still seen. Smaller ones are whole."""
    from autotune.accuracy.worker.parity_figures import sums_figures
    from autotune.accuracy.worker.parity_grads import GRAD_SAMPLE, sample_indices, tensor_sums

    assert sample_indices("head.bias", GRAD_SAMPLE, 0) is None
    idx = sample_indices("layers.0.weight", 1_000_003, 0)
    assert len(idx) == GRAD_SAMPLE and bool((idx[1:] >= idx[:-1]).all()) and 0 <= int(idx[0]) and int(idx[-1]) < 1_000_003
    assert torch.equal(idx, sample_indices("layers.0.weight", 1_000_003, 0))
    assert not torch.equal(idx, sample_indices("layers.1.weight", 1_000_003, 0))
    assert not torch.equal(idx, sample_indices("layers.0.weight", 1_000_003, 1))
    shares = []
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        r = torch.randn(1000, 1000, generator=gen)
        g = r + (0.05 + 0.4 * seed / 8) * torch.randn(1000, 1000, generator=gen)  # 5% to 40% off
        idx = sample_indices(f"w{seed}", r.numel(), seed)
        whole = sums_figures(tensor_sums(g, r))
        sampled = sums_figures(tensor_sums(g, r.reshape(-1)[idx], idx=idx))
        shares.append(sampled["error"] / whole["error"] - 1)
        assert sampled["cosine"] == pytest.approx(whole["cosine"], abs=0.005)
    assert max(map(abs, shares)) < 0.02
    g = r.clone()
    outside = torch.ones(r.numel(), dtype=torch.bool)
    outside[idx] = False
    g.view(-1)[int(outside.nonzero()[0])] = math.nan  # an element not sampled
    assert not math.isfinite(sums_figures(tensor_sums(g, r.reshape(-1)[idx], idx=idx))["error"])


def test_a_later_check_runs_the_configuration_alone_where_the_references_tensors_were_kept(tmp_path):
    """The worker that trains the reference keeps its first gradients and updates (sampled) in the
    gate's file; a later worker given the reference reads them and runs the configuration alone, to
    the same verdict; without them it takes the FP32 reference's run again."""
    from autotune.accuracy.worker.parity_grads import read_grads

    path = tmp_path / "grads.pt"
    request = {"workload": spec("mlp").to_dict(), "device": "cpu", "knobs": BF16,
               "settings": ParitySettings(steps=3).to_dict(), "reference": None, "grads_path": str(path)}
    first = run_parity(request)
    kept = read_grads(path)
    names = {n for n, _ in __import__("parity_models").mlp().model.named_parameters()}
    assert set(kept) == {"grads", "updates"} and set(kept["grads"]) == set(kept["updates"]) == names
    assert read_grads(tmp_path / "none.pt") is None
    later = run_parity({**request, "reference": first["reference"]})
    assert [r["steps_run"] for r in later["runs"]] == [4]  # the configuration's run alone
    without = run_parity({**request, "reference": first["reference"], "grads_path": None})
    assert [r["steps_run"] for r in without["runs"]] == [4, 4]  # the FP32 run again for its tensors
    for figures in ("grad_rel_error", "grad_cosine", "losses", "verdict", "grad_deviation", "update_rel_error"):
        assert later["result"][figures] == first["result"][figures] == without["result"][figures]
    # a reference from the cache has no kept tensors: its first check takes the FP32 run and keeps them
    path.unlink()
    cached = run_parity({**request, "reference": first["reference"]})
    assert [r["steps_run"] for r in cached["runs"]] == [4, 4] and read_grads(path) is not None


def test_a_check_at_batch_one_runs_as_a_worker_under_a_memory_limit():
    """A 1B model's FP32 step fits one sequence under a 24 GiB cap, so the plan may run the check at
    batch 1 with the search's --memory-limit (a CPU has no cap to set): the check data's own batch
    stays at least 2, and the request runs."""
    request = {"workload": spec("mlp").to_dict(), "device": "cpu", "knobs": BF16,
               "settings": ParitySettings(steps=3, batch_size=1).to_dict(), "reference": None,
               "memory_limit_bytes": 24 * 2 ** 30}
    answer = run_parity(request)
    assert answer["status"] == "ok" and len(answer["reference"]["losses"]) == 4  # 3 steps and the first batch again
    assert answer["result"]["verdict"] in ("passed", "violated")

# on the GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.slow
def test_on_a_gpu_tf32_and_bf16_pass_and_the_must_fail_cases_fail(parity_models):
    underflow, ref = check("underflow_mlp", FP16, device="cuda")
    assert underflow.verdict == "violated" and underflow.grad_rel_error == pytest.approx(1.0)
    assert check("underflow_mlp", FP16_SCALED, device="cuda", reference=ref)[0].verdict == "passed"
    assert check("overflow_mlp", FP16_SCALED, device="cuda")[0].verdict == "unstable"
    tf32, ref = check("mlp", {"precision": {"mode": "tf32"}}, device="cuda")
    assert tf32.verdict == "passed", tf32.reason
    assert check("mlp", BF16, device="cuda", reference=ref)[0].verdict == "passed"
    settings = ParitySettings(steps=20, batch_size=16)
    lost, ref = check("wide_linear", BF16, settings, device="cuda", transform=parity_models.bf16_weights)
    assert lost.verdict == "violated"
    assert check("wide_linear", BF16, settings, device="cuda", reference=ref)[0].verdict == "passed"


@pytest.mark.slow
def test_the_calibration_script_prints_each_case_and_meets_every_expectation(capsys):
    import importlib.util

    loaded = importlib.util.spec_from_file_location("parity_calibration", SCRIPTS / "parity_calibration.py")
    script = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(script)
    assert script.main(["--repeats", "1", "--steps", "20", "--models", ""]) == 0  # the small models' rows
    out = capsys.readouterr().out
    assert "MUST FAIL bf16 weights, no FP32 master copy" in out and "every case as expected" in out
    assert "widest band judged by: " in out
