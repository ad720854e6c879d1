"""Numerics parity: a configuration's loss trajectory and first gradients against FP32's, from the
same initial weights on the same batches, judged by a band that a harmless change calibrates in the
same run.

Three runs of ``steps`` optimizer steps (AdamW, constant learning rate, dropout off), each through the
project's own training step (``runtime.TrainStep`` on the configuration's recipe, as
``TunedConfig.train_step`` builds it), so every knob's numerics are what is measured (precision,
GradScaler, fp32_layers, loss_kernel, optimizer_state and implementation, activation_checkpointing,
compile): the FP32 reference; the calibration, the same FP32 run with every initial weight moved by
half of bf16's spacing (CALIBRATION_STEP, 2**-9 of itself, up or down at random: at most what storing
the initial weights in bf16 would change, a change known to be harmless), which shows how far this
model's training carries a rounding-sized difference; and the configuration. From each: the loss at
every step, and per parameter tensor the first step's gradients (unscaled, of the step taken: one the
GradScaler skips is taken again on its batch, as ``autotune.accuracy.check`` does). Deviations from
the reference: the largest relative loss difference over the trajectory,
``max_t |l(t) - l_ref(t)| / |l_ref(t)|``, and per tensor the relative gradient error
``||g - g_ref|| / ||g_ref||`` (its cosine reported beside it).

The calibration's size is a 16-bit format's rounding, not FP32's: a randomly initialised ResNet-50's
first gradients (batch 8, CPU) amplify rounding by about 10^5 through its BatchNorms, so one FP32
ulp moved 142 of its 161 tensors' gradients by 1.6-2.3% and the others by under 1%, while bf16
autocast moved those others by 56-81%: a one-ulp calibration saw none of that amplification and
failed bf16 on them. Moved by 2**-9, the calibration shows it. The learning rate (LR) is small for the
same reason: at 1e-3 the same ResNet-50's loss after 5 steps was 3.06 for FP32, 4.87 and 2.90 for
two calibrations and 3.73 on one thread instead of two (training itself is chaotic there, so no
band is sharp); at 1e-4 the four stayed within 1.1% of each other at every step and bf16 within
0.6%.

The band: the loss deviation at most ``k`` x the calibration's + ``loss_floor``, each tensor's
gradient error at most ``k`` x that tensor's calibration error + ``grad_floor``. The calibration term
widens the band where FP32 itself is fragile (a trajectory that amplifies rounding); the floors are
what a 16-bit format's rounding may cost where FP32 is robust, in bf16 machine epsilons (2**-7), as
Megatron-LM bounds a bf16 run's relative gradient error per tensor by ``k * eps_bf16`` (k = 4, grown
with depth to about 8: tests/functional_tests/python_test_utils/test_optimizer_grads_match.py, after
arXiv 2506.09280 theorem 5.3). The loss's floor is 2 eps; the gradients' 32 eps, four times
Megatron's deepest, for the check's small batch: under bf16 autocast the ReLU gates that flip in a
batch of 16 put one block's gradients (its LayerNorm's, its first layer's) 3.6-14% off FP32's over 20
seeds of scripts/parity_models.py's mlp, whose loss stayed within 0.05-0.2%. A tensor whose FP32 gradient
the calibration moves by more than NOISE_TENSOR (a bias before a BatchNorm: its exact gradient is
zero) is rounding noise, counted in the global figures only. A NaN/Inf loss or gradient
where FP32's are finite is "unstable".

Taken from training frameworks: torchtitan's loss-converging guide (docs/converging.md) keeps the
data deterministic and the initial weights identical (a seed checkpoint) and compares a test run's
loss curve with a control's, as its scripts/loss_compare.py compares two configurations' per-step
losses; Megatron-LM's functional tests compare per-step losses by ``numpy.isclose(rtol, atol)`` with
golden values (tests/functional_tests/python_test_utils/common.py) whose tolerances come from the
spread of repeated runs (compute_golden_statistics.py). Here the spread is measured in the same run,
by the calibration, since the model is the user's. Cost: ``steps`` steps a run; the reference's
losses and the calibration's figures are kept across searches (reference_cache: by model, batch,
data, steps, seed, device, torch), and with them a check costs its own run and one FP32 step (the
reference's first gradients, as large as the model, are not kept).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from autotune.accuracy.settings import MIN_STEPS, AccuracySettings

BF16_EPS = 2.0 ** -7
"""torch.finfo(torch.bfloat16).eps: the spacing of bf16 numbers just above 1."""
NOISE_TENSOR = 0.5
"""A tensor whose FP32 first gradient moved by more than this (relative) under the calibration's
change is rounding noise: its direction says nothing, so it is not judged on its own."""
CALIBRATION_STEP = 2.0 ** -9
"""The calibration moves every initial weight by this share of itself: half of bf16's spacing."""
FORMAT = 2
"""Part of the reference's cache key: bumped when what a parity reference holds changes."""


@dataclass(kw_only=True)
class ParitySettings:
    """How a parity check runs and what it accepts; fixed per study so that every check compares."""

    steps: int = 20
    """Optimizer steps of each run (the caller sizes them to its budget)."""
    batch_size: int = 16
    """The check's own batch size, the same for every run."""
    lr: float = 1e-4
    """Constant AdamW learning rate (no weight decay): small, so that the runs stay comparable (the
    module's docstring says why)."""
    seed: int = 0
    """Initial weights, data and data order; the calibration's directions are drawn from it too."""
    data: str | None = None
    """As AccuracySettings.data: None (synthetic), an image folder, or package.module:factory."""
    k: float = 4.0
    """The band's multiple of the calibration's deviation."""
    loss_floor: float = 2 * BF16_EPS
    """Relative loss difference accepted whatever the calibration says (1.6%)."""
    grad_floor: float = 32 * BF16_EPS
    """Relative gradient error accepted per tensor whatever the calibration says (25%)."""
    drift_floor: float = 0.25
    """Share of FP32's progress on the first batch a run may lose whatever the calibration says: over
    20 seeds of parity_models' wide_linear (loss down 0.03 in 20 steps at lr 1e-4) bf16 autocast lost
    up to 7.5% of it, bf16 weights without an FP32 master copy all of it."""

    def __post_init__(self) -> None:
        from autotune.errors import ConfigError

        for wrong, words in ((self.steps < 1, f"needs at least one step, got {self.steps}"),
                             (self.batch_size < 2, f"needs a batch of at least 2, got {self.batch_size}"),
                             (not self.lr > 0, f"needs a positive learning rate, got {self.lr}"),
                             (not min(self.k, self.loss_floor, self.grad_floor, self.drift_floor) >= 0,
                              "band's k and floors must be >= 0")):
            if wrong:
                raise ConfigError(f"the parity check {words}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParitySettings":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def fingerprint(self) -> str:
        """What makes two runs comparable (not the band, which only judges them), marked as a parity
        run's so that a cache shared with the accuracy check never mixes the two (reference_key)."""
        run = {k: v for k, v in self.to_dict().items() if k not in ("k", "loss_floor", "grad_floor", "drift_floor")}
        run["kind"] = f"parity-{FORMAT}"
        return hashlib.sha1(json.dumps(run, sort_keys=True).encode()).hexdigest()[:10]

    def data_settings(self) -> AccuracySettings:
        """Accuracy-check settings that make this check's training data (``check.datasets``)."""
        return AccuracySettings(steps=max(MIN_STEPS, self.steps), batch_size=self.batch_size, held_out_size=1,
                                seed=self.seed, data=self.data, fp64=False)

    def step_equivalents(self, *, reference_kept: bool) -> int:
        """Training steps one check takes: the configuration's run (its steps and the first batch
        again), and the reference's first step (kept reference) or the reference's and the
        calibration's runs (none kept)."""
        run = self.steps + (1 if self.steps > 1 else 0)
        return run + (1 if reference_kept else 2 * run)


@dataclass(kw_only=True)
class ParityBand:
    """What a configuration may deviate from FP32: ``k`` x the calibration's deviation + a floor."""

    k: float
    loss_floor: float
    grad_floor: float
    loss: float
    """The largest relative loss difference accepted over the trajectory."""
    grad: float
    """The relative gradient error accepted for the tensor named by the result's ``grad_tensor``
    (each tensor has its own: k x its calibration error + grad_floor)."""
    drift_floor: float = 0.25
    drift: float | None = None
    """The share of FP32's progress on the first batch a run may lose; None where FP32 made none."""


@dataclass(kw_only=True)
class ParityResult:
    """A parity check's verdict, its band and the figures it was decided on."""

    verdict: str
    """passed, violated (outside the band) or unstable (a NaN/Inf loss or gradient)."""
    reason: str
    """The verdict in one line, for a user."""
    label: str
    steps: int
    """Steps run (fewer where the loss went NaN/Inf)."""
    band: ParityBand
    loss_deviation: float
    """max over the steps of |loss - FP32's| / |FP32's|."""
    grad_deviation: float
    """The relative first-step gradient error of ``grad_tensor``."""
    grad_tensor: str
    """The judged tensor that came closest to its band (or went furthest past it)."""
    grad_rel_error: float
    """||g - g_ref|| / ||g_ref|| over all first-step gradients together."""
    grad_cosine: float
    """Cosine of all first-step gradients together against FP32's."""
    min_grad_cosine: float
    """The lowest cosine of a judged tensor."""
    calibration_loss_deviation: float
    calibration_grad_deviation: float
    """The calibration's on ``grad_tensor``."""
    progress_drift: float | None = None
    """The share of FP32's progress on the first batch this run lost (progress_drift)."""
    calibration_drift: float | None = None
    losses: list[float]
    reference_losses: list[float]
    skipped_steps: int = 0
    """Steps the GradScaler skipped (each taken again on its batch)."""
    noise_tensors: list[str] = field(default_factory=list)
    """Tensors whose FP32 gradient is rounding noise (NOISE_TENSOR): not judged on their own."""
    reference_source: str = "trained"
    """"trained" by this check, or "cache": an earlier search's (reference_cache)."""
    seconds: float = 0.0
    """Wall time of the check, with the reference's runs where it trained them."""
    tensors: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per parameter tensor: rel_error, cosine, calibration_rel_error, band."""

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParityResult":
        return cls(**{**data, "band": ParityBand(**data["band"])})


# ---------------------------------------------------------------------------------------------
# one run


def perturb_weights(model, seed: int, step: float = CALIBRATION_STEP):
    """``model`` with every floating-point parameter multiplied by ``1 + step`` or ``1 - step`` at
    random (drawn from ``seed`` by a generator of its own: the global random state is untouched).
    A model transform: the calibration's change, and with another seed a control's."""
    import torch

    g = torch.Generator().manual_seed(seed + 7919)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                up = torch.rand(p.shape, generator=g) < 0.5
                p.mul_(1 + torch.where(up, step, -step).to(p.device, p.dtype))
    return model


class _FirstGradients:
    """An optimizer step pre-hook that reads the first step's gradients: unscaled where a fused
    optimizer unscales them itself (GradScaler then sets ``optimizer.grad_scale``), already unscaled
    otherwise. Against ``reference`` (name -> CPU tensor) it keeps per-tensor sums only (|g-r|^2,
    |r|^2, |g|^2, g.r); without one it keeps the gradients themselves (CPU, FP32)."""

    def __init__(self, names: dict[int, str], reference: Mapping[str, Any] | None) -> None:
        self.names = names
        self.reference = reference
        self.active = True
        self.kept: dict[str, Any] = {}
        self.sums: dict[str, tuple[float, float, float, float]] = {}

    def __call__(self, optimizer, args, kwargs) -> None:
        if not self.active:
            return
        scale = getattr(optimizer, "grad_scale", None)
        self.kept, self.sums = {}, {}  # a step taken again replaces the one the scaler skipped
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = self.names.get(id(p))
                if name is None or p.grad is None:
                    continue
                g = p.grad.detach().float()
                if scale is not None:
                    g = g / scale.float()
                if self.reference is None:
                    self.kept[name] = g.cpu().clone()
                elif name in self.reference and tuple(self.reference[name].shape) == tuple(g.shape):
                    r = self.reference[name].to(g.device).double()
                    g = g.double()
                    self.sums[name] = (float((g - r).pow(2).sum()), float(r.pow(2).sum()), float(g.pow(2).sum()),
                                       float((g * r).sum()))


def _one_run(spec, recipe, settings: ParitySettings, data, *, steps: int, reference_grads=None,
             perturb: bool = False) -> dict[str, Any]:
    """``steps`` steps of ``recipe`` from the seeded initial weights on the check's batches: each
    step's loss, and the first step's gradients (kept, or compared with ``reference_grads``). Stops
    at the first NaN/Inf loss."""
    import torch

    from autotune.accuracy.check import seeded_workload, to_device, without_dropout
    from autotune.deploy import runtime
    from autotune.deploy.recipe import backend_flags
    from autotune.workload.data import batch_order, collate

    started = time.perf_counter()
    workload = seeded_workload(spec, settings.seed)
    names = {id(p): n for n, p in workload.model.named_parameters()}
    if perturb:
        perturb_weights(workload.model, settings.seed)
    with backend_flags(recipe.backend_flags):
        model = runtime.prepare_model(workload.model, recipe, set_flags=False)
        without_dropout(model)  # the numerics, not the masks (check.step_numerics says why)
        optimizer = runtime.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=settings.lr,
                                                                weight_decay=0.0), recipe)
        first = _FirstGradients(names, reference_grads)
        handle = optimizer.register_step_pre_hook(first)
        step = runtime.TrainStep(model, optimizer, workload.loss_fn, recipe)
        losses, skipped, retries = [], 0, max_retries(steps)
        torch.manual_seed(settings.seed)
        order = list(batch_order(len(data.train), settings.batch_size, steps, settings.seed))
        # the first batch again after the run: its loss then, against the first step's, is what the
        # run learnt (progress_drift); the update of that extra step is not used
        for i, indices in enumerate(order + order[:1] if steps > 1 else order):
            x, y = to_device(collate(data.train, indices), recipe.device, recipe)
            while True:
                before = step.scaler.get_scale() if step.scaler.is_enabled() else None
                loss = float(step(x, y).float())
                if before is None or step.scaler.get_scale() >= before or retries == 0 or not math.isfinite(loss):
                    break
                skipped, retries = skipped + 1, retries - 1  # skipped by the scaler: again, at its lower scale
            losses.append(loss)
            first.active = False
            if not math.isfinite(loss):
                break
        handle.remove()
    return {"losses": losses, "grads": first.kept, "sums": first.sums, "skipped": skipped,
            "wall_s": time.perf_counter() - started}


def max_retries(steps: int) -> int:
    """Steps the GradScaler skipped that a run takes again: its calibration from 65,536 down (16
    halvings), bounded for a run whose gradients overflow throughout."""
    return max(16, steps // 4)


# ---------------------------------------------------------------------------------------------
# deviations and the verdict


def loss_deviation(losses: list[float], reference: list[float]) -> float:
    """max_t |l(t) - l_ref(t)| / |l_ref(t)|; infinite where a loss is NaN/Inf or the run stopped early."""
    if len(losses) < len(reference):
        return math.inf
    worst = 0.0
    for value, ref in zip(losses, reference):
        if not math.isfinite(value):
            return math.inf
        worst = max(worst, abs(value - ref) / max(abs(ref), 1e-30))
    return worst


def progress_drift(losses: list[float], reference: list[float]) -> float | None:
    """The share of FP32's progress on the first batch that a run lost: ``1 - p / p_ref``, where a
    run's progress is its first step's loss less its last's (the first batch again, after the run).
    Both losses are the run's own, so a precision's rounding of the loss itself (the same batch from
    nearly the same weights) cancels: on parity_models' wide_linear at lr 1e-4, whose loss fell by
    0.03 in 20 steps, bf16 autocast's last loss alone put it up to 12% behind FP32. 0: learnt as
    much, 1: nothing; None where the reference did not learn the batch (nothing to lose), infinite
    where the run stopped early or went NaN/Inf."""
    if len(reference) < 2 or not reference[0] > reference[-1]:
        return None
    if len(losses) < len(reference) or not all(math.isfinite(x) for x in (losses[0], losses[-1])):
        return math.inf
    return 1.0 - (losses[0] - losses[-1]) / (reference[0] - reference[-1])


def _ratio(d2: float, r2: float) -> float:
    return math.sqrt(d2 / r2) if r2 > 0 else (0.0 if d2 == 0 else math.inf)


def _cosine(dot: float, g2: float, r2: float) -> float:
    return dot / math.sqrt(g2 * r2) if g2 > 0 and r2 > 0 else (1.0 if g2 == r2 == 0 else 0.0)


def tensor_figures(sums: Mapping[str, tuple[float, float, float, float]]) -> dict[str, dict[str, float]]:
    """Per tensor: relative error ||g - r|| / ||r|| and cosine, from its sums (|g-r|^2, |r|^2, |g|^2, g.r)."""
    out = {}
    for name, (d2, r2, g2, dot) in sums.items():
        finite = all(math.isfinite(v) for v in (d2, g2, dot))
        out[name] = ({"rel_error": _ratio(d2, r2), "cosine": _cosine(dot, g2, r2)} if finite
                     else {"rel_error": math.inf, "cosine": math.nan})
    return out


def global_figures(sums: Mapping[str, tuple[float, float, float, float]]) -> tuple[float, float]:
    """(relative error, cosine) of all tensors' gradients together."""
    d2, r2, g2, dot = (sum(s[i] for s in sums.values()) for i in range(4))
    if not all(math.isfinite(v) for v in (d2, g2, dot)):
        return math.inf, math.nan
    return _ratio(d2, r2), _cosine(dot, g2, r2)


def judge(run: Mapping[str, Any], reference: Mapping[str, Any], settings: ParitySettings, *,
          label: str = "configuration", seconds: float = 0.0) -> ParityResult:
    """The verdict on a run (its losses, and its first gradients' sums against the reference's) from
    the reference (its losses and the calibration's figures) and the band of ``settings``."""
    calib = reference["calibration"]
    loss_dev = loss_deviation(run["losses"], reference["losses"])
    tensors = tensor_figures(run["sums"])
    noise = sorted(n for n, v in calib["grad_rel_errors"].items() if v > NOISE_TENSOR)
    worst_name, worst_ratio = "", -1.0
    for name, fig in tensors.items():
        fig["calibration_rel_error"] = calib["grad_rel_errors"].get(name, 0.0)
        fig["band"] = settings.k * fig["calibration_rel_error"] + settings.grad_floor
        ratio = fig["rel_error"] / fig["band"] if fig["band"] > 0 else (0.0 if fig["rel_error"] == 0 else math.inf)
        if name not in noise and ratio > worst_ratio:
            worst_name, worst_ratio = name, ratio
    # no gradients to compare: every step skipped, or no parameter of the configuration's model is FP32's
    worst = tensors.get(worst_name, {"rel_error": math.nan, "band": settings.grad_floor,
                                     "calibration_rel_error": math.nan})
    rel, cos = global_figures(run["sums"]) if run["sums"] else (math.nan, math.nan)
    drift, cal_drift = progress_drift(run["losses"], reference["losses"]), calib.get("progress_drift")
    band = ParityBand(k=settings.k, loss_floor=settings.loss_floor, grad_floor=settings.grad_floor,
                      loss=settings.k * calib["loss_deviation"] + settings.loss_floor, grad=worst["band"],
                      drift_floor=settings.drift_floor,
                      drift=None if drift is None else settings.k * abs(cal_drift or 0.0) + settings.drift_floor)
    if not (math.isfinite(loss_dev) and all(math.isfinite(f["rel_error"]) for f in tensors.values())):
        verdict = "unstable"
    else:
        lost = drift is not None and drift > band.drift
        verdict = "passed" if loss_dev <= band.loss and worst_ratio <= 1.0 and not lost else "violated"
    result = ParityResult(
        verdict=verdict, reason="", label=label, steps=len(run["losses"]), band=band, loss_deviation=loss_dev,
        grad_deviation=worst["rel_error"], grad_tensor=worst_name, grad_rel_error=rel, grad_cosine=cos,
        min_grad_cosine=min((f["cosine"] for n, f in tensors.items() if n not in noise), default=1.0),
        calibration_loss_deviation=calib["loss_deviation"], calibration_grad_deviation=worst["calibration_rel_error"],
        progress_drift=drift, calibration_drift=cal_drift,
        losses=list(run["losses"]), reference_losses=list(reference["losses"]), skipped_steps=run.get("skipped", 0),
        noise_tensors=noise, reference_source=reference.get("reference_source", "trained"), seconds=seconds,
        tensors=tensors)
    result.reason = describe(result)
    return result


def describe(result: ParityResult) -> str:
    """The verdict in one line: what deviated from FP32, by how much, against which band."""
    b = result.band
    if result.verdict == "unstable":
        where = (f"the loss was NaN/Inf at step {result.steps}" if not math.isfinite(result.loss_deviation)
                 else "a first-step gradient was NaN/Inf")
        return f"{result.label}: unstable: {where} (FP32's stayed finite)"
    loss = (f"loss {_pct(result.loss_deviation)} off FP32 at worst over {result.steps} steps (band "
            f"{_pct(b.loss)} = {b.k:g} x the calibration's {_pct(result.calibration_loss_deviation)} + {_pct(b.loss_floor)})")
    grad = (f"first gradients {_pct(result.grad_rel_error)} off (cosine {result.grad_cosine:.4f}), worst tensor "
            f"{result.grad_tensor} {_pct(result.grad_deviation)} (band {_pct(b.grad)})" if result.grad_tensor
            else "first gradients not compared (no parameter of the configuration's model is FP32's)")
    parts = [loss, grad]
    if result.loss_deviation <= b.loss and result.grad_deviation > b.grad:
        parts.reverse()  # what failed first
    if result.progress_drift is not None and b.drift is not None:
        learnt = (f"made {_pct(1 - result.progress_drift)} of FP32's progress on the first batch (at least "
                  f"{_pct(1 - b.drift)} = 100% - {b.k:g} x the calibration's {_pct(abs(result.calibration_drift or 0.0))} "
                  f"lost - {_pct(b.drift_floor)})")
        parts.insert(0 if result.progress_drift > b.drift and result.loss_deviation <= b.loss else 1, learnt)
    return f"{result.label}: {result.verdict}: " + "; ".join(parts)


def _pct(x: float) -> str:
    if not math.isfinite(x):
        return "n/a" if math.isnan(x) else "inf"
    a = abs(x)
    if a == 0 or a >= 0.001:
        return f"{100 * x:.2g}%" if a < 0.1 else f"{100 * x:.0f}%"
    return f"{100 * x:.1e}%"


# ---------------------------------------------------------------------------------------------
# the check


def parity_recipe(knobs: Mapping[str, Any], device: str):
    """The configuration's recipe as the check runs it: one optimizer step a call (the check's batch
    is its own: no gradient accumulation), one process (no DDP)."""
    import strategies

    recipe = strategies.build_recipe(strategies.knobs_from_dict(dict(knobs)), device)
    recipe.accumulation_steps = 1
    recipe.ddp, recipe.ddp_world_size = None, 1
    return recipe


def train_reference(spec, settings: ParitySettings, device: str, data) -> tuple[dict[str, Any], dict[str, Any]]:
    """The FP32 reference's losses and the calibration's figures (what the cache keeps, JSON), and
    the reference's first-step gradients (name -> CPU tensor; not kept)."""
    from autotune.accuracy.check import trained_on

    fp32 = parity_recipe({}, device)
    ref = _one_run(spec, fp32, settings, data, steps=settings.steps)
    cal = _one_run(spec, fp32, settings, data, steps=settings.steps, reference_grads=ref["grads"], perturb=True)
    reference = {
        "losses": ref["losses"],
        "calibration": {"losses": cal["losses"], "loss_deviation": loss_deviation(cal["losses"], ref["losses"]),
                        "progress_drift": progress_drift(cal["losses"], ref["losses"]),
                        "grad_rel_errors": {n: f["rel_error"] for n, f in tensor_figures(cal["sums"]).items()},
                        "grad_rel_error": global_figures(cal["sums"])[0]},
        "settings": settings.to_dict(),
        "wall_s": round(ref["wall_s"] + cal["wall_s"], 3),
        **trained_on(device),
    }
    return reference, ref["grads"]


def check_parity(spec, knobs: Mapping[str, Any], settings: ParitySettings, *, device: str = "cpu",
                 reference: Mapping[str, Any] | None = None, recipe=None, label: str | None = None,
                 ) -> tuple[ParityResult, dict[str, Any]]:
    """Judge the configuration ``knobs`` (knob name -> its values, as recorded; or a ``recipe`` the
    caller built) against FP32 on the model of ``spec`` (a WorkloadSpec). ``reference``: an earlier
    check's (or the cache's) for these settings and device, else it is trained here. Returns the
    result and the reference (to keep: ``keep_reference``)."""
    from autotune.accuracy.check import datasets
    from autotune.accuracy.settings import describe_numerics

    started = time.perf_counter()
    data = datasets(spec, settings.data_settings(), device)
    if reference is None:
        reference, ref_grads = train_reference(spec, settings, device, data)
        reference["reference_source"] = "trained"
    else:
        ref_grads = _one_run(spec, parity_recipe({}, device), settings, data, steps=1)["grads"]
    recipe = recipe if recipe is not None else parity_recipe(knobs, device)
    run = _one_run(spec, recipe, settings, data, steps=settings.steps, reference_grads=ref_grads)
    result = judge(run, reference, settings, label=label or describe_numerics(knobs),
                   seconds=time.perf_counter() - started)
    return result, dict(reference)


def run_parity(request: Mapping[str, Any]) -> dict[str, Any]:
    """A worker mode ("parity"), as check.run_check is "accuracy": request {"workload": spec dict,
    "device", "knobs", "settings", "reference": a kept one or None}; returns {"status": "ok",
    "result": ParityResult dict, "reference": the reference (trained here, or the one given)}."""
    from autotune.workload.models import WorkloadSpec

    settings = ParitySettings.from_dict(request["settings"])
    spec = WorkloadSpec.from_dict(request["workload"])
    result, reference = check_parity(spec, request.get("knobs") or {}, settings, device=request.get("device", "cpu"),
                                     reference=request.get("reference"), label=request.get("label"))
    return {"status": "ok", "result": result.to_dict(), "reference": reference}


# ---------------------------------------------------------------------------------------------
# the reference kept across searches (autotune.accuracy.reference_cache)


def cached_reference(cache, workload: Mapping[str, Any], settings: ParitySettings, *, device_name: str,
                     torch_version: str) -> dict[str, Any] | None:
    """The parity reference an earlier search kept for this workload (spec dict), settings, device
    and torch, marked ``reference_source: "cache"``; None where there is none."""
    from autotune.accuracy.reference_cache import reference_key

    key = reference_key(workload, settings, device_name=device_name, torch_version=torch_version)
    found = cache.load(key)
    if found is None or "calibration" not in found or found.get("settings", {}).get("steps") != settings.steps:
        return None
    return {**found, "reference_source": "cache"}


def keep_reference(cache, workload: Mapping[str, Any], settings: ParitySettings, reference: Mapping[str, Any]) -> bool:
    """Keep a reference trained by ``check_parity`` for later searches, under the device and torch it
    was trained on; False (with the cache's warning) where the folder cannot be written."""
    from autotune.accuracy.reference_cache import reference_key

    key = reference_key(workload, settings, device_name=reference["device_name"], torch_version=reference["torch"])
    kept = {k: v for k, v in reference.items() if k != "reference_source"}
    about = {**dict(workload), "kind": "parity", "data": settings.data, "steps": settings.steps,
             "batch_size": settings.batch_size, "seed": settings.seed, "device": reference["device_name"]}
    return cache.store(key, kept, about)
