"""Knobs shown to have no effect stop being explored (steered searches only).

The evidence is matched comparisons: two usable completed trials whose parameters are the same
except for one knob (the parameters that exist only in one of them are the knob's own conditional
ones, e.g. the GradScaler settings that come with fp16; parameters of knobs already fixed this way
are ignored too). Only such a pair says what the knob itself does: TPE changes many knobs at once,
so a per-knob spread over all trials mixes each knob's effect with the others'. Matched pairs come
from the seeds (the same recipe at several batch sizes), from the steering (each remedy changes
one or two knobs of a measured trial) and from TPE re-visiting a neighbourhood.

A knob is fixed when, after at least ``MIN_COMPLETED`` usable trials,

* it has at least ``MIN_PAIRS`` matched pairs,
* every value the space offers for it appears in one of them (a batch size never compared says
  nothing about the others), and
* no pair moved the objective by more than the noise: ``NOISE_FLOOR`` (run-to-run differences of
  separate worker processes, clocks and allocators), or half the larger step-time spread
  ((p90 - p10) / median) of the two trials when that is wider.

It is then fixed to its value in the best usable trial that has it, for the rest of the search,
through Optuna's own ``PartialFixedSampler`` wrapped around the study's sampler. Queued
configurations (seeds, remedies) still carry their own values; the steering no longer queues a
remedy that changes a fixed knob. Which knobs were fixed, to what and on what evidence is stored
in the study user attribute ``FIXED_ATTR`` (a resumed steered search re-applies it) and shown in
the report.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.trial.record import TrialRecord

FIXED_ATTR = "fixed_knobs"
MIN_COMPLETED = 6
"""Usable completed trials before any knob is judged."""
MIN_PAIRS = 2
"""Matched pairs a knob needs before it may be fixed."""
NOISE_FLOOR = 0.03
"""A relative difference between two trials below this is noise."""

_MISSING = object()


def usable_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Completed, measured trials that could be recommended: not a repeat of another trial, loss
    finite, accuracy not failed."""
    from autotune.accuracy.study.gate import accuracy_of, failed

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None and t.value > 0 and (r := TrialRecord.of(t)).duplicate_of is None
            and not r.unstable and not failed(accuracy_of(study, t))]


def differs_only_in(a: dict[str, Any], b: dict[str, Any], ignore: set[str] | frozenset = frozenset()) -> str | None:
    """The one parameter two parameter sets differ in, or None.

    Parameters present in only one set are conditional ones the differing knob brings in, and
    ``ignore`` holds parameters that do not count (knobs already found to have no effect)."""
    shared = (a.keys() & b.keys()) - ignore
    core = [k for k in shared if a[k] != b[k]]
    return core[0] if len(core) == 1 else None


def relative_difference(x: float, y: float) -> float:
    return abs(x - y) / min(abs(x), abs(y))


def pair_noise(a: FrozenTrial, b: FrozenTrial) -> float:
    spreads = [TrialRecord.of(t).figures.get("spread") or 0.0 for t in (a, b)]
    return max(NOISE_FLOOR, 0.5 * max(spreads))


def knob_evidence(trials: list[FrozenTrial], ignore: set[str] | frozenset = frozenset()
                  ) -> dict[str, list[tuple[FrozenTrial, FrozenTrial]]]:
    """Parameter -> the matched pairs of ``trials`` that differ only in it."""
    pairs: dict[str, list[tuple[FrozenTrial, FrozenTrial]]] = {}
    for a, b in itertools.combinations(trials, 2):
        param = differs_only_in(a.params, b.params, ignore)
        if param is not None:
            pairs.setdefault(param, []).append((a, b))
    return pairs


def no_effect_knobs(study: optuna.Study, already: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The parameters (beyond ``already`` fixed ones) that the matched pairs show to have no
    effect on the objective, each with its best-seen value and the evidence."""
    trials = usable_trials(study)
    if len(trials) < MIN_COMPLETED:
        return {}
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    fixed = dict(already or {})
    found: dict[str, dict[str, Any]] = {}
    changed = True
    while changed:  # a knob fixed lets pairs that also differ in it count for the others
        changed = False
        for param, pairs in sorted(knob_evidence(trials, set(fixed)).items()):
            if param in fixed or len(pairs) < MIN_PAIRS:
                continue
            distribution = pairs[0][0].distributions.get(param)
            offered = list(getattr(distribution, "choices", []) or [])
            compared = {t.params[param] for pair in pairs for t in pair}
            if not offered or any(value not in compared for value in offered):
                continue
            effects = [(relative_difference(a.value, b.value), pair_noise(a, b)) for a, b in pairs]
            if any(effect > noise for effect, noise in effects):
                continue
            having = [t for t in trials if param in t.params]
            best = (max if maximize else min)(having, key=lambda t: t.value)
            largest = max(effect for effect, _ in effects)
            found[param] = {
                "value": best.params[param],
                "best_trial": best.number,
                "pairs": [[a.number, b.number] for a, b in pairs],
                "max_effect": round(largest, 4),
                "reason": (f"{len(pairs)} pairs of trials that differ only in {param} "
                           f"(values {', '.join(map(str, offered))}) moved the objective by at most "
                           f"{100 * largest:.1f}%, within the noise; fixed to {best.params[param]!r}, "
                           f"its value in trial #{best.number}"),
            }
            fixed[param] = best.params[param]
            changed = True
    return found


def fixed_knobs(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """What ``fix_no_effect_knobs`` fixed in this study so far: parameter -> value and evidence."""
    return dict(study.user_attrs.get(FIXED_ATTR) or {})


def apply_fixed_knobs(study: optuna.Study) -> None:
    """Wrap the study's sampler in a PartialFixedSampler holding the fixed knobs (none: unwrapped)."""
    fixed = {param: entry["value"] for param, entry in fixed_knobs(study).items()}
    base = getattr(study.sampler, "autotune_base_sampler", study.sampler)
    if not fixed:
        study.sampler = base
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.PartialFixedSampler(fixed, base)
    sampler.autotune_base_sampler = base  # so that fixing more knobs later wraps the same TPE sampler
    study.sampler = sampler


def fix_no_effect_knobs(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """Judge the knobs on the trials so far; fix the ones with no effect (recorded in the study,
    applied to its sampler). Returns the newly fixed ones."""
    known = fixed_knobs(study)
    newly = no_effect_knobs(study, {param: entry["value"] for param, entry in known.items()})
    if newly:
        study.set_user_attr(FIXED_ATTR, {**known, **newly})
        apply_fixed_knobs(study)
    return newly
