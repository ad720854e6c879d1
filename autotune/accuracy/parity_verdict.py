"""The verdict of a numerics parity check (autotune.accuracy.parity) from its figures: the deviations
of a run's loss trajectory, progress on the first batch and first gradients from FP32's, the band the
calibration gives (k x its deviation + a floor), and the verdict in one line; and the same verdict as
the accuracy gate records it on a trial (``evidence``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

BF16_EPS = 2.0 ** -7
"""torch.finfo(torch.bfloat16).eps: the spacing of bf16 numbers just above 1."""
NOISE_TENSOR = 0.5
"""A tensor whose FP32 first gradient moved by more than this (relative) under the calibration's
change is rounding noise: its direction says nothing, so it is not judged on its own."""


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
    """Steps run (fewer where the loss went NaN/Inf, 1 where the run stopped on its first gradients)."""
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
    stopped: str | None = None
    """"gradients" where the run stopped after its first step, whose gradients were already out of band
    (gradients_out_of_band): its losses and ``steps`` are that step's, its progress is not judged. None
    where it ran every step (or to a NaN/Inf loss)."""

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParityResult":
        return cls(**{**data, "band": ParityBand(**data["band"])})


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


def tensor_bands(sums: Mapping[str, tuple[float, float, float, float]], calibration: Mapping[str, Any],
                 settings) -> tuple[dict[str, dict[str, float]], list[str], str, float]:
    """Per tensor of ``sums``: its figures (tensor_figures) with its calibration error and its band,
    ``k`` x that error + ``grad_floor``; the tensors whose FP32 gradient is rounding noise (NOISE_TENSOR:
    not judged on their own); and the judged tensor that came closest to its band or went furthest past
    it, with its error's share of that band ("" and -1 where none was compared)."""
    tensors = tensor_figures(sums)
    errors = calibration["grad_rel_errors"]
    noise = sorted(n for n, v in errors.items() if v > NOISE_TENSOR)
    worst_name, worst_share = "", -1.0
    for name, fig in tensors.items():
        fig["calibration_rel_error"] = errors.get(name, 0.0)
        fig["band"] = settings.k * fig["calibration_rel_error"] + settings.grad_floor
        share = fig["rel_error"] / fig["band"] if fig["band"] > 0 else (0.0 if fig["rel_error"] == 0 else math.inf)
        if name not in noise and share > worst_share:
            worst_name, worst_share = name, share
    return tensors, noise, worst_name, worst_share


def gradients_out_of_band(sums: Mapping[str, tuple[float, float, float, float]], calibration: Mapping[str, Any],
                          settings) -> str | None:
    """The judged tensor whose first gradient went furthest past its band (a NaN/Inf one is infinitely
    past it), or None where every one is within its band: the check's gradient rule, by which ``judge``
    decides and a configuration's run stops after its first step (parity._one_run), since whatever its
    other steps do its verdict is then "violated" (or "unstable")."""
    _, _, name, share = tensor_bands(sums, calibration, settings)
    return name if share > 1.0 else None


def judge(run: Mapping[str, Any], reference: Mapping[str, Any], settings, *,
          label: str = "configuration", seconds: float = 0.0) -> ParityResult:
    """The verdict on a run (its losses, and its first gradients' sums against the reference's) from
    the reference (its losses and the calibration's figures) and the band of ``settings``. A run that
    stopped on its first gradients (``stopped``: "gradients") is judged on the steps it ran: its loss
    deviation over them, its progress not at all (it did not run the trajectory); it never passes."""
    calib, stopped = reference["calibration"], run.get("stopped")
    ran = reference["losses"][:len(run["losses"])] if stopped else reference["losses"]
    loss_dev = loss_deviation(run["losses"], ran)
    tensors, noise, worst_name, worst_share = tensor_bands(run["sums"], calib, settings)
    # no gradients to compare: every step skipped, or no parameter of the configuration's model is FP32's
    worst = tensors.get(worst_name, {"rel_error": math.nan, "band": settings.grad_floor,
                                     "calibration_rel_error": math.nan})
    rel, cos = global_figures(run["sums"]) if run["sums"] else (math.nan, math.nan)
    drift = None if stopped else progress_drift(run["losses"], reference["losses"])
    cal_drift = calib.get("progress_drift")
    band = ParityBand(k=settings.k, loss_floor=settings.loss_floor, grad_floor=settings.grad_floor,
                      loss=settings.k * calib["loss_deviation"] + settings.loss_floor, grad=worst["band"],
                      drift_floor=settings.drift_floor,
                      drift=None if drift is None else settings.k * abs(cal_drift or 0.0) + settings.drift_floor)
    if not (math.isfinite(loss_dev) and all(math.isfinite(f["rel_error"]) for f in tensors.values())):
        verdict = "unstable"
    else:
        lost = drift is not None and drift > band.drift
        in_band = loss_dev <= band.loss and worst_share <= 1.0  # gradients_out_of_band's rule, on these bands
        verdict = "passed" if in_band and not lost and not stopped else "violated"
    result = ParityResult(
        verdict=verdict, reason="", label=label, steps=len(run["losses"]), band=band, loss_deviation=loss_dev,
        grad_deviation=worst["rel_error"], grad_tensor=worst_name, grad_rel_error=rel, grad_cosine=cos,
        min_grad_cosine=min((f["cosine"] for n, f in tensors.items() if n not in noise), default=1.0),
        calibration_loss_deviation=calib["loss_deviation"], calibration_grad_deviation=worst["calibration_rel_error"],
        progress_drift=drift, calibration_drift=cal_drift,
        losses=list(run["losses"]), reference_losses=list(reference["losses"]), skipped_steps=run.get("skipped", 0),
        noise_tensors=noise, reference_source=reference.get("reference_source", "trained"), seconds=seconds,
        tensors=tensors, stopped=stopped)
    result.reason = describe(result)
    return result


def describe(result: ParityResult) -> str:
    """The verdict in one line: what deviated from FP32, by how much, against which band; what failed
    first leads, and a run that stopped on its first gradients says so last."""
    b = result.band
    if result.verdict == "unstable":
        where = (f"the loss was NaN/Inf at step {result.steps}" if not math.isfinite(result.loss_deviation)
                 else "a first-step gradient was NaN/Inf")
        stop = "; stopped after its first step" if result.stopped else ""
        return f"{result.label}: unstable: {where} (FP32's stayed finite){stop}"
    loss = (f"loss {_pct(result.loss_deviation)} off FP32 at worst over {result.steps} "
            f"step{'' if result.steps == 1 else 's'} (band "
            f"{_pct(b.loss)} = {b.k:g} x the calibration's {_pct(result.calibration_loss_deviation)} + {_pct(b.loss_floor)})")
    grad = (f"first gradients {_pct(result.grad_rel_error)} off (cosine {result.grad_cosine:.4f}), worst tensor "
            f"{result.grad_tensor} {_pct(result.grad_deviation)} (band {_pct(b.grad)})" if result.grad_tensor
            else "first gradients not compared (no parameter of the configuration's model is FP32's)")
    parts = [loss, grad]
    if result.stopped or result.loss_deviation <= b.loss and result.grad_deviation > b.grad:
        parts.reverse()  # what failed first
    if result.progress_drift is not None and b.drift is not None:
        learnt = (f"made {_pct(1 - result.progress_drift)} of FP32's progress on the first batch (at least "
                  f"{_pct(1 - b.drift)} = 100% - {b.k:g} x the calibration's {_pct(abs(result.calibration_drift or 0.0))} "
                  f"lost - {_pct(b.drift_floor)})")
        parts.insert(0 if result.progress_drift > b.drift and result.loss_deviation <= b.loss else 1, learnt)
    if result.stopped:
        parts.append("stopped after its first step: the first gradients were already out of band")
    return f"{result.label}: {result.verdict}: " + "; ".join(parts)


def _pct(x: float) -> str:
    if not math.isfinite(x):
        return "n/a" if math.isnan(x) else "inf"
    a = abs(x)
    if a == 0 or a >= 0.001:
        return f"{100 * x:.2g}%" if a < 0.1 else f"{100 * x:.0f}%"
    return f"{100 * x:.1e}%"


METHOD = "parity"
"""The ``method`` of the evidence a parity check leaves on a trial (the held-out check's has none)."""
UNSTABLE_CONSTRAINT = 100.0
"""As autotune.accuracy.settings.UNSTABLE_CONSTRAINT: Optuna's constraint of an unstable configuration."""


def evidence(result: ParityResult, *, numerics_key: str | None = None) -> dict[str, Any]:
    """The verdict as the accuracy gate records it on a trial and in config.json: verdict, stable,
    reason, and Optuna's constraint (<= 0 feasible: the largest deviation's share of its band, less
    1), with the figures the report draws (the loss deviation against its band, ``allowed``)."""
    b = result.band
    shares = [result.loss_deviation / b.loss if b.loss > 0 else math.inf]
    if result.grad_tensor and b.grad > 0:
        shares.append(result.grad_deviation / b.grad)
    if result.progress_drift is not None and b.drift:
        shares.append(result.progress_drift / b.drift)
    unstable = result.verdict == "unstable"
    return {"method": METHOD, "verdict": result.verdict, "stable": not unstable, "reason": result.reason,
            "constraint": UNSTABLE_CONSTRAINT if unstable else float(max(shares) - 1.0),
            "steps": result.steps, "loss_deviation": result.loss_deviation, "allowed": b.loss,
            "progress_drift": result.progress_drift, "allowed_drift": b.drift,
            "grad_deviation": result.grad_deviation, "allowed_grad": b.grad, "grad_tensor": result.grad_tensor,
            "grad_rel_error": result.grad_rel_error, "grad_cosine": result.grad_cosine,
            "calibration_loss_deviation": result.calibration_loss_deviation,
            "skipped_steps": result.skipped_steps, "stopped": result.stopped,
            "reference_source": result.reference_source,
            "seconds": round(result.seconds, 3), "losses": result.losses, "reference_losses": result.reference_losses,
            "numerics_key": numerics_key}


def reference_evidence(reference: Mapping[str, Any], *, numerics_key: str | None = None) -> dict[str, Any]:
    """The verdict on FP32's own numerics (any configuration whose numerics knobs are FP32's: the
    reference is its run), passed by definition, with the band the others are judged by."""
    calib = reference.get("calibration") or {}
    steps = len(reference.get("losses") or [])
    return {"method": METHOD, "verdict": "passed", "stable": True, "constraint": 0.0, "steps": steps,
            "reason": f"FP32 numerics: the parity check's reference itself ({steps} steps; the calibration moved its "
                      f"loss by {_pct(calib.get('loss_deviation', 0.0))} at worst)",
            "loss_deviation": 0.0, "progress_drift": 0.0, "reference_source": reference.get("reference_source"),
            "numerics_key": numerics_key}
