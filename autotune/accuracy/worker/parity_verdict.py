"""The verdict of a numerics parity check (autotune.accuracy.worker.parity) from its figures, and the same
verdict as the accuracy gate records it on a trial (``evidence``).

What is compared with FP32's run (the reference), each figure against a band:

- the loss trajectory, averaged over windows of parity_figures.LOSS_WINDOW of the steps (the batch-to-batch
  scatter of a small batch is not the numerics);
- the progress on the first batch: its loss before the run against after it (progress_drift);
- per parameter tensor, its first gradient: how far off FP32's (relative error), its size (norm
  ratio), and the share of its elements that vanished (zero where FP32's are not: underflow);
- per parameter tensor, its update over the run (``w_T - w_0``): its size, and the share of its
  elements that never moved where FP32's did (stalled: a frozen gain, gradients underflowed to zero,
  updates rounded away in low-precision weights); how far off FP32's it points is reported, not
  judged (REPORTED_ONLY).

The band of each figure: ``k`` x its noise + its floor. The noise is the same figure of the
calibrations, FP32 runs from weights moved to random bf16 neighbours, the largest over them: how far
this network's own training carries a rounding-sized difference (on a BatchNorm network at batch 8,
a first gradient's direction 20-60% and an update's entirely, while an update's size stays within a
few percent). A band wider than MAX_BAND judges nothing: that figure is reported, not judged. What is
judged fails on its own (any figure past its band), so a frozen tensor fails whatever the loss did.

The floors are what a change known to be harmless costs where FP32 is robust: a 16-bit format's
rounding, in bf16 machine epsilons, as Megatron-LM bounds a bf16 run's relative gradient error per
tensor by ``k * eps_bf16`` (tests/functional_tests/python_test_utils/test_optimizer_grads_match.py,
after arXiv 2506.09280 theorem 5.3), and for the shares, a few elements of a tensor (a ReLU unit dead
in one run's batch and not in the other's zeroes a row of the next layer's gradient).
Micikevicius et al. 2018 ("Mixed Precision Training", arXiv 1710.03740) name what the shares catch:
gradients flushed to zero in fp16 without loss scaling, updates lost to weights kept in 16 bits
without an FP32 master copy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from autotune.accuracy.worker.parity_figures import (
    TENSOR_FIGURES,
    global_figures,
    loss_deviation,
    progress_drift,
    tensor_figures,
)

BF16_EPS = 2.0 ** -7
"""torch.finfo(torch.bfloat16).eps: the spacing of bf16 numbers just above 1."""
MAX_BAND = 0.5
"""The widest band a figure is judged by (a share of what it bounds: 50% of the loss, of FP32's
progress, of a gradient's or an update's norm): where the run-to-run noise needs more, the figure
says nothing of the numerics and is reported, not judged."""
NOISE_TENSOR = 1.0
"""A tensor whose FP32 first gradient the calibrations moved by more than this (relative: more than
the gradient itself, a bias before a BatchNorm, whose exact gradient is zero) is rounding noise: its
first gradient's figures are not judged."""
SHARE_ELEMENTS = 2
"""Elements of a tensor a share figure (vanished, stalled) lets go whatever the floor: a unit dead in
one run's batch and alive in the other's."""

REPORTED_ONLY = ("update_error",)
"""Tensor figures reported, never judged: under AdamW an element's update follows the signs of its
gradients, and where those sit near zero a 16-bit format's compute flips them step after step, which
rounding the gradients once calibrates poorly: on the ConvNeXt bf16 autocast put a bias's update 37%
off FP32's (its size 6.5%) where the calibrations moved it 1.5%. An update's size and its stalled
share carry what is harmful (weights that stop, or move at another scale)."""
WORDS = {"loss": "loss", "progress": "progress on the first batch", "grad_error": "first gradients' directions",
         "grad_size": "first gradients' sizes", "grad_vanished": "vanished gradients",
         "update_error": "updates' directions", "update_size": "updates' sizes", "update_stalled": "stalled weights"}
"""How the reason names a figure it could not judge."""


@dataclass(kw_only=True)
class ParityBand:
    """The band's rule (k x noise + floor, judged where at most ``max_band``) and the bands of the
    loss and progress figures and of the worst tensor's figure."""

    k: float
    loss_floor: float
    grad_floor: float
    loss: float | None
    """The largest relative (windowed) loss difference accepted; None: not judged (too noisy)."""
    grad: float | None
    """The band of the worst tensor figure (``ParityResult.grad_tensor``'s ``grad_figure``)."""
    drift_floor: float = 0.25
    drift: float | None = None
    """The share of FP32's progress on the first batch a run may lose; None where FP32 made none or
    its noise is too large to judge."""
    size_floor: float = 0.0
    share_floor: float = 0.0
    max_band: float = MAX_BAND


@dataclass(kw_only=True)
class ParityResult:
    """A parity check's verdict, its bands and the figures it was decided on."""

    verdict: str
    """passed, violated (outside a band) or unstable (a NaN/Inf loss, gradient or weight)."""
    reason: str
    """The verdict in one line, for a user."""
    label: str
    steps: int
    """Steps run (fewer where the loss went NaN/Inf, 1 where the run stopped on its first gradients)."""
    band: ParityBand
    loss_deviation: float
    """max over the windows of |mean loss - FP32's| / |FP32's|."""
    grad_deviation: float
    """The measured value of the worst tensor figure (``grad_figure`` of ``grad_tensor``)."""
    grad_tensor: str
    """The tensor whose judged figure came closest to its band (or went furthest past it)."""
    grad_rel_error: float
    """||g - g_ref|| / ||g_ref|| over all first gradients together."""
    grad_cosine: float
    """Cosine of all first gradients together against FP32's."""
    min_grad_cosine: float
    """The lowest cosine of a tensor whose first gradient was judged."""
    calibration_loss_deviation: float
    calibration_grad_deviation: float
    """The calibrations' (noise) of the worst tensor figure."""
    progress_drift: float | None = None
    """The share of FP32's progress on the first batch this run lost (progress_drift)."""
    calibration_drift: float | None = None
    losses: list[float]
    reference_losses: list[float]
    grad_figure: str = "grad_error"
    """Which of TENSOR_FIGURES ``grad_tensor``'s worst is."""
    update_rel_error: float | None = None
    """||u - u_ref|| / ||u_ref|| over all tensors' updates together (None where the run stopped early)."""
    skipped_steps: int = 0
    """Steps the GradScaler skipped (each taken again on its batch)."""
    noise_tensors: list[str] = field(default_factory=list)
    """Tensors whose FP32 first gradient is rounding noise (NOISE_TENSOR): their gradients not judged."""
    reference_source: str = "trained"
    """"trained" by this check, or "cache": an earlier search's (reference_cache)."""
    seconds: float = 0.0
    """Wall time of the check, with the reference's runs where it trained them."""
    calibrations: int = 1
    """FP32 calibration runs the noise is the largest of."""
    figures: list[dict[str, Any]] = field(default_factory=list)
    """Each judged or reported kind of figure, its worst: {figure, tensor ("" for loss and progress),
    measured, noise, band (None: not judged), failing (tensors past their band), judged (tensors judged)}."""
    tensors: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per parameter tensor: each of TENSOR_FIGURES, with ``noise_...`` and ``band_...`` (None: not judged)."""
    stopped: str | None = None
    """"gradients" where the run stopped after its first step, whose gradients were already out of band
    (gradients_out_of_band): its losses and ``steps`` are that step's, its progress and updates are not
    judged. None where it ran every step (or to a NaN/Inf loss)."""

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParityResult":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in data.items() if k in names}, "band": ParityBand(**data["band"])})


def calibration_noise(runs: list[Mapping[str, Any]], reference_losses: list[float], steps: int) -> dict[str, Any]:
    """The calibrations' figures against the reference (each run: losses, sums), as the reference
    keeps them: per figure the largest over the runs (the noise)."""
    tensors: dict[str, dict[str, float]] = {}
    for run in runs:
        for name, figs in tensor_figures(run["sums"]).items():
            kept = tensors.setdefault(name, {})
            for figure in TENSOR_FIGURES:
                if figure in figs:
                    kept[figure] = max(kept.get(figure, 0.0), figs[figure])
    drifts = [progress_drift(r["losses"], reference_losses) for r in runs]
    return {"runs": len(runs), "losses": [list(r["losses"]) for r in runs],
            "loss_deviation": max(loss_deviation(r["losses"], reference_losses, steps) for r in runs),
            "progress_drift": None if drifts[0] is None else max(abs(d) for d in drifts),
            "grad_rel_error": max(global_figures(r["sums"].get("grads") or {})[0] for r in runs),
            "update_rel_error": max(global_figures(r["sums"].get("updates") or {})[0] for r in runs),
            "tensors": tensors}


# ---------------------------------------------------------------------------------------------
# bands and the verdict


def floor_of(figure: str, settings, nonzero: float = 0.0) -> float:
    """The floor of ``figure``'s band (ParitySettings' floors; a share's lets SHARE_ELEMENTS go)."""
    if figure.endswith("_error"):
        return settings.grad_floor
    if figure.endswith("_size"):
        return settings.size_floor
    return max(settings.share_floor, SHARE_ELEMENTS / nonzero if nonzero > 0 else 0.0)


def band_of(noise: float, floor: float, settings) -> float | None:
    """``k`` x noise + floor, or None where that passes MAX_BAND (the figure is then not judged)."""
    band = settings.k * noise + floor
    return band if band <= settings.max_band else None


def tensor_bands(sums: Mapping[str, Mapping[str, tuple[float, ...]]], calibration: Mapping[str, Any], settings
                 ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Per tensor of ``sums``: its figures (tensor_figures), with each figure's noise (the
    calibrations') and band (apply_bands); and the tensors whose first gradient is rounding noise."""
    tensors = tensor_figures(sums)
    noise = calibration.get("tensors") or {}
    for name, figs in tensors.items():
        for figure in TENSOR_FIGURES:
            if figure in figs:
                figs[f"noise_{figure}"] = (noise.get(name) or {}).get(figure, 0.0)
    return tensors, apply_bands(tensors, settings)


def apply_bands(tensors: Mapping[str, dict[str, Any]], settings) -> list[str]:
    """Each tensor figure's band from its noise (``noise_...``), in place: ``band_...`` None where it
    is not judged (too noisy: band_of; a tensor FP32 did not move; a first gradient that is rounding
    noise, NOISE_TENSOR). Returns the tensors whose first gradient is rounding noise."""
    noisy = sorted(n for n, figs in tensors.items() if figs.get("noise_grad_error", 0.0) > NOISE_TENSOR)
    for name, figs in tensors.items():
        for figure in TENSOR_FIGURES:
            if f"noise_{figure}" not in figs:
                continue
            prefix = figure.split("_")[0]
            judged = figs[f"{prefix}_moved"] and not (prefix == "grad" and name in noisy) and \
                figure not in REPORTED_ONLY
            floor = floor_of(figure, settings, figs[f"{prefix}_nonzero"])
            figs[f"band_{figure}"] = band_of(figs[f"noise_{figure}"], floor, settings) if judged else None
    return noisy


def global_checks(loss_dev: float, drift: float | None, calibration: Mapping[str, Any], settings
                  ) -> list[dict[str, Any]]:
    """The loss and progress figures with their noise and bands (progress where FP32 made some)."""
    out = []
    cal_drift = calibration.get("progress_drift")
    for figure, measured, noise, floor in (("loss", loss_dev, calibration["loss_deviation"], settings.loss_floor),
                                           ("progress", drift, abs(cal_drift or 0.0), settings.drift_floor)):
        if measured is None:
            continue
        band = band_of(noise, floor, settings)
        share = _share(measured, band)
        out.append({"figure": figure, "tensor": "", "measured": measured, "noise": noise, "band": band,
                    "share": share, "judged": int(band is not None), "failing": int(share > 1.0)})
    return out


def verdict_of(figures: list[Mapping[str, Any]], *, unstable: bool, stopped: str | None) -> str:
    """unstable; passed where at least one figure was judged and every judged one is within its band
    and the run ran every step; violated otherwise."""
    if unstable:
        return "unstable"
    judged = [f for f in figures if f["band"] is not None]
    return "passed" if judged and not stopped and all(f["share"] <= 1.0 for f in judged) else "violated"


def _share(measured: float, band: float | None) -> float:
    if band is None:
        return -1.0
    if band <= 0:
        return 0.0 if measured <= 0 else math.inf
    return measured / band


def figures_out_of_band(tensors: Mapping[str, Mapping[str, Any]], kinds=TENSOR_FIGURES) -> list[dict[str, Any]]:
    """Per figure of ``kinds``: the tensor past its band furthest (or closest to it), with the count of
    tensors judged and past their band; for a figure no tensor was judged by (too noisy), the tensor
    furthest from FP32's, with no band."""
    out = []
    for figure in kinds:
        judged = [(name, figs) for name, figs in tensors.items() if figs.get(f"band_{figure}") is not None]
        if not judged:
            measured = [(figs[figure], name) for name, figs in tensors.items()
                        if figure in figs and figs.get(f"{figure.split('_')[0]}_moved")]
            if measured:
                value, name = max(measured)
                out.append({"figure": figure, "tensor": name, "measured": value,
                            "noise": tensors[name].get(f"noise_{figure}", 0.0), "band": None, "share": -1.0,
                            "judged": 0, "failing": 0, "ratio": tensors[name].get(f"{figure.split('_')[0]}_ratio")})
            continue
        shares = [(_share(figs[figure], figs[f"band_{figure}"]), name) for name, figs in judged]
        share, name = max(shares)
        figs = tensors[name]
        out.append({"figure": figure, "tensor": name, "measured": figs[figure], "noise": figs[f"noise_{figure}"],
                    "band": figs[f"band_{figure}"], "share": share, "judged": len(judged),
                    "failing": sum(s > 1.0 for s, _ in shares), "ratio": figs.get(f"{figure.split('_')[0]}_ratio")})
    return out


def gradients_out_of_band(sums: Mapping[str, Mapping[str, tuple[float, ...]]], calibration: Mapping[str, Any],
                          settings) -> str | None:
    """The tensor whose first gradient went furthest past a band (a NaN/Inf one is infinitely past
    it), or None where every judged one is within its bands: the check's gradient rule, by which
    ``judge`` decides and a configuration's run stops after its first step (parity._one_run), since
    whatever its other steps do its verdict is then "violated" (or "unstable")."""
    tensors, _ = tensor_bands({"grads": sums.get("grads") or {}}, calibration, settings)
    if any(not figs.get("grad_finite", True) for figs in tensors.values()):
        return next(n for n, figs in tensors.items() if not figs.get("grad_finite", True))
    worst = [f for f in figures_out_of_band(tensors, ("grad_error", "grad_size", "grad_vanished")) if f["share"] > 1.0]
    return max(worst, key=lambda f: f["share"])["tensor"] if worst else None


def judge(run: Mapping[str, Any], reference: Mapping[str, Any], settings, *,
          label: str = "configuration", seconds: float = 0.0) -> ParityResult:
    """The verdict on a run (its losses, and its first gradients' and updates' sums against the
    reference's) from the reference (its losses and the calibrations' noise) and the bands of
    ``settings``. A run that stopped on its first gradients (``stopped``: "gradients") is judged on
    the step it ran: its loss then, its gradients; its progress and updates not at all; it never passes."""
    calib, stopped = reference["calibration"], run.get("stopped")
    steps = len(reference["losses"]) - 1 if len(reference["losses"]) > 1 else 1
    trajectory = len(run["losses"]) if stopped else steps
    sums = run["sums"]
    loss_dev = loss_deviation(run["losses"], reference["losses"], trajectory)
    tensors, noisy = tensor_bands(sums, calib, settings)
    worst = figures_out_of_band(tensors)
    drift = None if stopped else progress_drift(run["losses"], reference["losses"])
    cal_drift = calib.get("progress_drift")
    unstable = not math.isfinite(loss_dev) or any(not figs.get("grad_finite", True) or not figs.get("update_finite", True)
                                                  for figs in tensors.values())
    figures = global_checks(loss_dev, drift, calib, settings) + worst
    top = max(worst, key=lambda f: f["share"]) if worst else None
    verdict = verdict_of(figures, unstable=unstable, stopped=stopped)
    loss_band = figures[0]["band"]
    drift_band = figures[1]["band"] if drift is not None else None
    grad_rel, grad_cos = global_figures(sums.get("grads") or {})
    update_rel = global_figures(sums["updates"])[0] if sums.get("updates") else None
    band = ParityBand(k=settings.k, loss_floor=settings.loss_floor, grad_floor=settings.grad_floor, loss=loss_band,
                      grad=top["band"] if top else None, drift_floor=settings.drift_floor, drift=drift_band,
                      size_floor=settings.size_floor, share_floor=settings.share_floor, max_band=settings.max_band)
    result = ParityResult(
        verdict=verdict, reason="", label=label, steps=len(run["losses"]), band=band, loss_deviation=loss_dev,
        grad_deviation=top["measured"] if top else math.nan, grad_tensor=top["tensor"] if top else "",
        grad_figure=top["figure"] if top else "grad_error", grad_rel_error=grad_rel, grad_cosine=grad_cos,
        min_grad_cosine=min((f["grad_cosine"] for f in tensors.values()
                             if f.get("band_grad_error") is not None), default=1.0),
        calibration_loss_deviation=calib["loss_deviation"], calibration_grad_deviation=top["noise"] if top else math.nan,
        progress_drift=drift, calibration_drift=cal_drift, update_rel_error=update_rel,
        losses=list(run["losses"]), reference_losses=list(reference["losses"]), skipped_steps=run.get("skipped", 0),
        noise_tensors=noisy, reference_source=reference.get("reference_source", "trained"), seconds=seconds,
        calibrations=int(calib.get("runs", 1)), figures=figures, tensors=tensors, stopped=stopped)
    result.reason = describe(result)
    return result


# ---------------------------------------------------------------------------------------------
# the verdict in words


def _pct(x: float) -> str:
    if not math.isfinite(x):
        return "n/a" if math.isnan(x) else "inf"
    a = 100 * abs(x)
    if a == 0:
        return "0%"
    if a < 0.001:
        return f"{'-' if x < 0 else ''}under 0.001%"
    return f"{100 * x:.2g}%" if a < 10 else f"{100 * x:.0f}%"


def _tensors(n: int, *, owner: bool = False) -> str:
    return f"{n} tensor{'' if n == 1 else 's'}" + (("'s" if n == 1 else "'") if owner else "")


def _failure(f: Mapping[str, Any], steps: int) -> str:
    """One failing figure in words."""
    allows, n = f"the run-to-run noise allows {_pct(f['band'])}", f["failing"]
    figure, tensor, measured = f["figure"], f["tensor"], f["measured"]
    if figure == "loss":
        return f"its loss is {_pct(measured)} off FP32's over {steps} step{'' if steps == 1 else 's'} ({allows})"
    if figure == "progress":
        if measured >= 1:
            return (f"it learnt nothing of the first batch (its loss there {'rose' if measured > 1 else 'stayed'} "
                    f"where FP32's fell; {allows} lost)")
        return f"it learnt {_pct(measured)} less than FP32 on the first batch ({allows})"
    if figure == "grad_vanished":
        return (f"gradients vanish in {_tensors(n)} ({tensor}: {_pct(measured)} of its first gradient is zero where "
                f"FP32's is not; {allows})")
    if figure == "update_stalled":
        return (f"{_tensors(n)} stop{'s' if n == 1 else ''} learning ({tensor}: {_pct(measured)} of its weights never "
                f"moved where FP32's did; {allows})")
    what = "first gradient" if figure.startswith("grad") else "update"
    if figure.endswith("_size"):
        ratio = f.get("ratio")
        size = ("zero" if ratio == 0 else "not finite" if ratio is None or not math.isfinite(ratio)
                else f"{ratio:.3g}x FP32's" if ratio >= 2 else f"{_pct(ratio)} of FP32's")
        return (f"{_tensors(n, owner=True)} {what}{' is' if n == 1 else 's are'} the wrong size ({tensor}'s is "
                f"{size}; {allows} either way)")
    return (f"{_tensors(n, owner=True)} {what}{' is' if n == 1 else 's are'} off FP32's ({tensor}'s by "
            f"{_pct(measured)}; {allows})")


def describe(result: ParityResult) -> str:
    """The verdict in one line, numbers in plain terms: for a pass, how close the loss and the
    updates stayed and what the noise allows; for a failure, what failed first (how many tensors, the
    worst), and a run that stopped on its first gradients says so last."""
    steps = len(result.reference_losses) - 1 if len(result.reference_losses) > 1 else 1
    head = f"{result.label}: {result.verdict}: "
    stop = "; stopped after its first step, the first gradients already out of band" if result.stopped else ""
    if result.verdict == "unstable":
        where = (f"the loss was NaN/Inf at step {result.steps}" if not math.isfinite(result.loss_deviation)
                 else "a gradient or weight went NaN/Inf")
        return f"{head}{where} (FP32's stayed finite){stop}"
    judged = [f for f in result.figures if f["band"] is not None]
    failing = sorted((f for f in judged if f["share"] > 1.0), key=lambda f: -f["share"])
    if result.verdict == "violated":
        if not failing:
            words = "the run-to-run noise of this network leaves no figure to judge it by" if not judged else \
                "it was not run to the end"
        else:
            order = ("update_stalled", "grad_vanished", "update_size", "grad_size", "progress", "loss",
                     "update_error", "grad_error")
            failing.sort(key=lambda f: order.index(f["figure"]))
            words = "; ".join(_failure(f, result.steps if result.stopped else steps) for f in failing[:2])
            if len(failing) > 2:
                words += f"; and {len(failing) - 2} more"
        return head + words + stop
    parts = []
    loss = next((f for f in judged if f["figure"] == "loss"), None)
    if loss is not None:
        parts.append(f"loss within {_pct(loss['measured'])} of FP32's over {steps} steps, the run-to-run noise "
                     f"allows {_pct(loss['band'])}")
    sizes = [f for f in judged if f["figure"] == "update_size"]
    if sizes:
        size = sizes[0]
        parts.append(f"updates within {_pct(size['measured'])} of FP32's size, the noise allows {_pct(size['band'])}")
    stalled = next((f for f in judged if f["figure"] == "update_stalled"), None)
    vanished = next((f for f in judged if f["figure"] == "grad_vanished"), None)
    if stalled and vanished and stalled["measured"] == 0 and vanished["measured"] == 0:
        parts.append("no gradient vanished, no weight stalled")
    unjudged = [WORDS[f["figure"]] for f in result.figures if f["band"] is None and f["figure"] not in REPORTED_ONLY]
    if unjudged:
        parts.append("too noisy here to judge: " + ", ".join(unjudged))
    return f"{head}trains like FP32 here ({'; '.join(parts)})"


METHOD = "parity"
"""The ``method`` of the evidence a parity check leaves on a trial (the held-out check's has none)."""
UNSTABLE_CONSTRAINT = 100.0
"""As autotune.accuracy.settings.UNSTABLE_CONSTRAINT: Optuna's constraint of an unstable configuration."""


def evidence(result: ParityResult, *, numerics_key: str | None = None) -> dict[str, Any]:
    """The verdict as the accuracy gate records it on a trial and in config.json: verdict, stable,
    reason, and Optuna's constraint (<= 0 feasible: the largest judged figure's share of its band,
    less 1), with each figure's band beside what was measured (``bands``) and the loss deviation
    against its band (``allowed``) that the report draws."""
    b = result.band
    judged = [f for f in result.figures if f["band"] is not None]
    shares = [f["share"] for f in judged] or [math.inf]
    unstable = result.verdict == "unstable"
    constraint = UNSTABLE_CONSTRAINT if unstable else float(max(shares) - 1.0)
    if result.verdict == "violated" and constraint <= 0:
        constraint = 1.0  # stopped early, or nothing judged: never feasible
    return {"method": METHOD, "verdict": result.verdict, "stable": not unstable, "reason": result.reason,
            "constraint": min(constraint, UNSTABLE_CONSTRAINT) if math.isfinite(constraint) else UNSTABLE_CONSTRAINT,
            "steps": result.steps, "loss_deviation": result.loss_deviation, "allowed": b.loss,
            "progress_drift": result.progress_drift, "allowed_drift": b.drift,
            "grad_deviation": result.grad_deviation, "allowed_grad": b.grad, "grad_tensor": result.grad_tensor,
            "grad_figure": result.grad_figure, "grad_rel_error": result.grad_rel_error, "grad_cosine": result.grad_cosine,
            "update_rel_error": result.update_rel_error,
            "calibration_loss_deviation": result.calibration_loss_deviation, "calibrations": result.calibrations,
            "bands": [{k: f[k] for k in ("figure", "tensor", "measured", "noise", "band", "judged", "failing")}
                      for f in result.figures],
            "skipped_steps": result.skipped_steps, "stopped": result.stopped,
            "reference_source": result.reference_source,
            "seconds": round(result.seconds, 3), "losses": result.losses, "reference_losses": result.reference_losses,
            "numerics_key": numerics_key}


def reference_evidence(reference: Mapping[str, Any], *, numerics_key: str | None = None) -> dict[str, Any]:
    """The verdict on FP32's own numerics (any configuration whose numerics knobs are FP32's: the
    reference is its run), passed by definition, with the noise the others are judged by."""
    calib = reference.get("calibration") or {}
    steps = len(reference.get("losses") or [])
    return {"method": METHOD, "verdict": "passed", "stable": True, "constraint": 0.0, "steps": steps,
            "reason": f"fp32: passed: its numerics are FP32's, the reference every other configuration is checked "
                      f"against ({steps} steps; the run-to-run noise moved the loss "
                      f"{_pct(calib.get('loss_deviation', 0.0))} at worst)",
            "loss_deviation": 0.0, "progress_drift": 0.0, "reference_source": reference.get("reference_source"),
            "numerics_key": numerics_key}
