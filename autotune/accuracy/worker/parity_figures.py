"""What a numerics parity run measured against FP32's (autotune.accuracy.worker.parity): the loss trajectory
in windows, the progress on the first batch, and each parameter tensor's first gradient and update
against FP32's, from the sums a run keeps (autotune.accuracy.worker.parity_grads). The verdict judges these
figures against their bands (autotune.accuracy.worker.parity_verdict)."""

from __future__ import annotations

import math
from typing import Mapping

LOSS_WINDOW = 8
"""The loss trajectory is compared as the means of windows of steps // LOSS_WINDOW steps (at least 1)."""
TENSOR_FIGURES = ("grad_error", "grad_size", "grad_vanished", "update_error", "update_size", "update_stalled")
"""Per tensor: first gradient and update, each off FP32's (relative error), its size (max(r, 1/r) - 1
of the norm ratio r) and its share of elements zero where FP32's are not."""


def window_means(losses: list[float], steps: int) -> list[float]:
    """The mean of each step's loss and the ``w - 1`` before it (fewer at the start; w = steps //
    LOSS_WINDOW, at least 1): the first step alone, where both runs start from the same weights."""
    w = max(1, steps // LOSS_WINDOW)
    return [sum(losses[max(0, t - w + 1):t + 1]) / len(losses[max(0, t - w + 1):t + 1]) for t in range(len(losses))]


def loss_deviation(losses: list[float], reference: list[float], steps: int | None = None) -> float:
    """max_t |l(t) - l_ref(t)| / |l_ref(t)| over the windowed trajectories (window_means of the first
    ``steps`` losses; all given where None); infinite where a loss is NaN/Inf or the run stopped early."""
    n = len(reference) if steps is None else steps
    if len(losses) < n:
        return math.inf
    if not all(math.isfinite(v) for v in losses[:n]):
        return math.inf
    run, ref = window_means(losses[:n], n), window_means(reference[:n], n)
    return max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(run, ref)), default=0.0)


def progress_drift(losses: list[float], reference: list[float]) -> float | None:
    """The share of FP32's progress on the first batch that a run lost: ``1 - p / p_ref``, where a
    run's progress is its first step's loss less its last's (the first batch again, after the run).
    Both losses are the run's own, so a precision's rounding of the loss itself (the same batch from
    nearly the same weights) cancels. 0: learnt as much, 1: nothing; None where the reference did not
    learn the batch (nothing to lose), infinite where the run stopped early or went NaN/Inf."""
    if len(reference) < 2 or not reference[0] > reference[-1]:
        return None
    if len(losses) < len(reference) or not all(math.isfinite(x) for x in (losses[0], losses[-1])):
        return math.inf
    return 1.0 - (losses[0] - losses[-1]) / (reference[0] - reference[-1])


def _ratio(d2: float, r2: float) -> float:
    return math.sqrt(d2 / r2) if r2 > 0 else (0.0 if d2 == 0 else math.inf)


def _cosine(dot: float, g2: float, r2: float) -> float:
    return dot / math.sqrt(g2 * r2) if g2 > 0 and r2 > 0 else (1.0 if g2 == r2 == 0 else 0.0)


def _size(g2: float, r2: float) -> float:
    """max(r, 1/r) - 1 of the norm ratio r = |g| / |r|: 0 the same size, 1 twice or half, inf zero."""
    if r2 <= 0:
        return 0.0 if g2 <= 0 else math.inf
    if g2 <= 0:
        return math.inf
    return math.exp(abs(0.5 * math.log(g2 / r2))) - 1.0


def sums_figures(sums: tuple[float, ...]) -> dict[str, float]:
    """One tensor's figures from its sums (parity_grads.SUMS): error, cosine, ratio, size, vanished
    share, and ``moved`` (whether FP32's is not zero)."""
    d2, r2, g2, dot, vanished, nonzero = (tuple(sums) + (0.0, 0.0))[:6]
    if not all(math.isfinite(v) for v in (d2, g2, dot)):
        return {"error": math.inf, "cosine": math.nan, "ratio": math.nan, "size": math.inf, "vanished": 0.0,
                "nonzero": nonzero, "finite": False, "moved": r2 > 0}
    return {"error": _ratio(d2, r2), "cosine": _cosine(dot, g2, r2), "ratio": math.sqrt(g2 / r2) if r2 > 0 else math.nan,
            "size": _size(g2, r2), "vanished": vanished / nonzero if nonzero > 0 else 0.0, "nonzero": nonzero,
            "finite": True, "moved": r2 > 0}


def tensor_figures(sums: Mapping[str, Mapping[str, tuple[float, ...]]]) -> dict[str, dict[str, float]]:
    """Per tensor of ``sums`` ({"grads", "updates"}: name -> its sums): TENSOR_FIGURES, with the
    cosines, norm ratios and whether FP32's gradient and update were zero."""
    out: dict[str, dict[str, float]] = {}
    for kind, prefix in (("grads", "grad"), ("updates", "update")):
        for name, s in (sums.get(kind) or {}).items():
            f = sums_figures(s)
            out.setdefault(name, {}).update({
                f"{prefix}_error": f["error"], f"{prefix}_size": f["size"], f"{prefix}_ratio": f["ratio"],
                f"{prefix}_{'vanished' if prefix == 'grad' else 'stalled'}": f["vanished"],
                f"{prefix}_cosine": f["cosine"], f"{prefix}_nonzero": f["nonzero"], f"{prefix}_moved": f["moved"],
                f"{prefix}_finite": f["finite"]})
    return out


def global_figures(sums: Mapping[str, tuple[float, ...]]) -> tuple[float, float]:
    """(relative error, cosine) of all tensors of one kind together (name -> sums)."""
    if not sums:
        return math.nan, math.nan
    d2, r2, g2, dot = (sum(s[i] for s in sums.values()) for i in range(4))
    if not all(math.isfinite(v) for v in (d2, g2, dot)):
        return math.inf, math.nan
    return _ratio(d2, r2), _cosine(dot, g2, r2)
