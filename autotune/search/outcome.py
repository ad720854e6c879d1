"""Why a whole search has no recommendation, in words that point at the cause.

One trial's reason says what happened to one configuration; when none of them can be recommended
the pattern across them is what the user needs: every configuration unstable, the FP32 baseline
too (the model itself produces NaN, not the knobs); nothing fits (the smallest batch tried and the
option that goes lower); every trial crashed (their common reason).
"""

from __future__ import annotations

import re
from collections import Counter

import optuna

from autotune.trial.record import TrialRecord

FAILED_STATUSES = ("crashed", "error", "timeout")


def _common_reason(trials: list[TrialRecord]) -> tuple[str, int]:
    """The reason most of ``trials`` share (trial numbers and addresses left out), and how many."""
    def key(trial: TrialRecord) -> str:
        reason = trial.reason or trial.status or "no reason recorded"
        return re.sub(r"0x[0-9a-f]+", "0x…", reason.splitlines()[0]).strip()

    reason, count = Counter(key(t) for t in trials).most_common(1)[0]
    return reason, count


def explain(study: optuna.Study, *, min_batch_size: int | None = None) -> list[str]:
    """Lines that say why ``study`` has nothing to recommend, most telling first (called when it
    has none)."""
    from autotune.accuracy.study.gate import accuracy_of, failed

    frozen = {t.number: t for t in study.get_trials(deepcopy=False)}
    trials = [r for r in map(TrialRecord.of, frozen.values()) if r.status is not None]
    if not trials:
        return ["no trial was measured: the budget ended first, or the search was stopped; "
                "give a longer --budget (or --trials N)"]
    measured = [t for t in trials if t.status == "ok"]
    unstable = [t for t in measured if t.unstable]
    rejected = [t for t in measured if not t.unstable and failed(accuracy_of(study, frozen[t.number]))]
    oom = [t for t in trials if t.status == "oom"]
    crashed = [t for t in trials if t.status in FAILED_STATUSES]
    lines: list[str] = []
    n = len(trials)
    if unstable and len(unstable) == len(measured):
        baseline = [t for t in unstable if t.role == "baseline"]
        fp32 = [t for t in unstable if t.knob("precision", "mode") == "fp32"]
        text = (f"every configuration measured ({len(unstable)} of {n} trials) gave a non-finite loss (NaN or Inf)")
        if baseline or fp32:
            which = f"the FP32 baseline (#{baseline[0].number})" if baseline else f"FP32 (#{fp32[0].number})"
            text += (f", {which} too: the model itself produces NaN, not the knobs. Check its loss, inputs and "
                     "initialisation: one plain FP32 training step must give a finite loss")
        else:
            text += "; FP32 was not among them, so a lower precision may be the cause: try --precisions fp32,tf32"
        lines.append(text)
    if oom and len(oom) == n:
        smallest = min(b for b in (t.batch_size for t in oom) if b is not None)
        lower = max(1, smallest // 2)
        hint = (f"--min-batch-size {lower} goes lower" if smallest > 1
                else "the model does not fit even at batch 1: a smaller --input-shape or model is needed")
        if min_batch_size is not None and smallest > min_batch_size:
            hint = f"the search had not reached --min-batch-size {min_batch_size} yet: run longer, or {hint}"
        lines.append(f"nothing fits: all {n} trials ran out of memory; the smallest batch tried was {smallest}; {hint}")
    if crashed and len(crashed) == n:
        reason, count = _common_reason(crashed)
        lines.append(f"every trial failed ({n} of {n}); the common reason ({count} of them): {reason}")
    if rejected and len(rejected) == len(measured):
        lines.append(f"every configuration measured ({len(rejected)}) failed the accuracy check against FP32; "
                     "see the report's accuracy table, or allow more with --max-accuracy-drop")
    if not lines:
        parts = [f"{len(x)} {what}" for x, what in ((oom, "ran out of memory"), (crashed, "failed"),
                                                     (unstable, "had a non-finite loss"),
                                                     (rejected, "failed the accuracy check")) if x]
        lines.append(f"none of the {n} trials can be recommended: {', '.join(parts)}")
        if crashed:
            reason, count = _common_reason(crashed)
            lines.append(f"the failures' common reason ({count} of {len(crashed)}): {reason}")
    return lines

