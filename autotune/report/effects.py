"""Each knob's effect as far as the measurements can show it without the other knobs mixed in.

The search changes many knobs at once, so the best or median samples/s of all trials with one value
of a knob mixes that knob's effect with the others' (1 CUDA stream can look far slower than 2 mostly
because the FP32 baseline ran with 1). What isolates a knob is a pair of
measured trials whose parameters are the same except for it: ``autotune.search.knob_effects`` finds
those pairs for the search's own no-effect rule, and the same pairs, with the same noise band
(``pair_noise``), give the effects here. Beside them stands Optuna's PED-ANOVA importance of each
parameter (``optuna.importance.PedAnovaImportanceEvaluator``): how differently a parameter's values
are spread among the fastest trials than among all of them. It says which knobs matter, not in
which direction, and it needs enough trials to have a top to speak of.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial

import strategies
from autotune.report.format import sort_key
from autotune.search.knob_effects import (
    knob_evidence,
    pair_noise,
    relative_difference,
    usable_trials,
)
from autotune.trial.record import TrialRecord
from strategies.base import ReportKnob

MIN_IMPORTANCE_TRIALS = 10
"""Usable trials before PED-ANOVA is asked: fewer leave no top group apart from the rest."""
TOP_TRIALS = 5
"""Trials in PED-ANOVA's top group: Optuna's documentation asks for at least 5 above the quantile."""
TOP_SHARE = 0.1
"""The top group's share of the trials once there are enough (Optuna's default target_quantile)."""


@dataclass
class Change:
    """One change of a knob's value, from ``before`` to ``after``, as the pairs that make it show it."""

    before: Any
    after: Any
    pairs: list[tuple[int, int]] = field(default_factory=list)
    """(the trial with ``before``, the trial with ``after``), by number."""
    ratios: list[float] = field(default_factory=list)
    """samples/s with ``after`` over samples/s with ``before``, one per pair."""
    noises: list[float] = field(default_factory=list)
    """Each pair's noise band (a relative difference below it is noise)."""
    signs: list[int] = field(default_factory=list)
    """Each pair: +1 faster beyond its noise, -1 slower beyond it, 0 within it."""
    with_before: str = ""
    with_after: str = ""
    """Another knob the pairs switch on with ``before`` (``after``) alone: a parameter that exists only
    with that value and is set off its default ("CUDA graphs", which exist only with the fused
    optimizer). The ratio is then the two knobs' together, and the change says so."""

    @property
    def label(self) -> str:
        """The change in words: "foreach → fused + CUDA graphs"."""
        from autotune.report.format import value_label

        before = value_label(self.before) + (f" + {self.with_before}" if self.with_before else "")
        after = value_label(self.after) + (f" + {self.with_after}" if self.with_after else "")
        return f"{before} → {after}"

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def noise(self) -> float:
        return statistics.median(self.noises)

    def verdict(self) -> str:
        """The pairs' conclusion in words: faster, slower, within the noise, or that they disagree."""
        faster, slower, n = self.signs.count(1), self.signs.count(-1), len(self.signs)
        if faster and slower:
            return f"pairs disagree: {faster} faster, {slower} slower"
        if not faster and not slower:
            return "within the noise"
        word, k = ("faster", faster) if faster else ("slower", slower)
        return word if k == n else f"{word} in {k} of {n} pairs, the rest within the noise"


@dataclass
class ParamEffect:
    """One Optuna parameter that took several values among the usable trials."""

    param: str
    """Its Optuna name, "<strategy>.<field>" ("streams.num_streams")."""
    label: str
    knob: ReportKnob | None
    """The report's knob for it (None: a parameter the report has no bars for, "compile.mode")."""
    changes: list[Change]
    """Value changes that some pair differs in alone; empty: no pair isolates this parameter."""
    importance: float | None = None
    """Its share of the PED-ANOVA importance (all parameters' sum to 1); None: not evaluated."""


@dataclass
class Effects:
    """The paired effects and importances of one study's parameters."""

    trials: int
    """Usable trials compared (completed, measured, not a repeat, loss finite, accuracy not failed)."""
    params: list[ParamEffect]
    importance_note: str
    """How the importances were found, or why there are none, in one sentence."""


def measure(study: optuna.Study, knobs: list[ReportKnob]) -> Effects:
    """The paired effect and PED-ANOVA importance of every parameter of ``study`` that took more than
    one value among its usable trials; the report's ``knobs`` first, in their order."""
    trials = [t for t in usable_trials(study) if TrialRecord.of(t).samples_per_s]
    values: dict[str, set] = {}
    for t in trials:
        for param, value in t.params.items():
            values.setdefault(param, set()).add(value)
    varied = [p for p, seen in values.items() if len(seen) > 1]
    by_param = {f"{k.strategy}.{k.field}": k for k in knobs}
    order = [p for p in by_param if p in varied] + sorted(p for p in varied if p not in by_param)
    evidence = knob_evidence(trials)
    importance, note = importances(study, trials)
    params = [ParamEffect(param=p, label=by_param[p].label if p in by_param else p, knob=by_param.get(p),
                          changes=_changes(p, evidence.get(p, []), by_param.get(p)), importance=importance.get(p))
              for p in order]
    return Effects(trials=len(trials), params=params, importance_note=note)


def _changes(param: str, pairs: list[tuple[FrozenTrial, FrozenTrial]], knob: ReportKnob | None) -> list[Change]:
    """The pairs of one parameter grouped by the change of value they make, each read from the knob's
    untuned value when it is one of the two (so 1 -> 2 streams, fp32 -> bf16), else from the lower value."""
    strategy, _, name = param.partition(".")
    untuned = strategies.BY_NAME[strategy].default() if strategy in strategies.BY_NAME else None
    default = knob.default if knob is not None else getattr(untuned, name, None)
    changes: dict[tuple, Change] = {}
    for a, b in pairs:
        va, vb = a.params[param], b.params[param]
        if vb == default or (va != default and sort_key(vb) < sort_key(va)):
            a, b, va, vb = b, a, vb, va
        also_a, also_b = _switched_with(param, a, b), _switched_with(param, b, a)
        change = changes.setdefault((repr(va), repr(vb), also_a, also_b),
                                    Change(va, vb, with_before=also_a, with_after=also_b))
        rate_a, rate_b = TrialRecord.of(a).samples_per_s, TrialRecord.of(b).samples_per_s
        noise = pair_noise(a, b)
        change.pairs.append((a.number, b.number))
        change.ratios.append(rate_b / rate_a)
        change.noises.append(noise)
        change.signs.append(0 if relative_difference(rate_a, rate_b) <= noise else (1 if rate_b > rate_a else -1))
    return sorted(changes.values(), key=lambda c: (sort_key(c.before), sort_key(c.after), c.with_before, c.with_after))


def _switched_with(param: str, a: FrozenTrial, b: FrozenTrial) -> str:
    """What else trial ``a`` of a pair switches on against ``b``: the knobs of its parameters that ``b``
    lacks (they exist only with ``a``'s value of ``param``), from another strategy than ``param``'s and
    set off that strategy's default, in the strategy's own words ("CUDA graphs"); "" where none.
    (The GradScaler settings that come with fp16 are at their defaults unless tuned: not a switch.)"""
    strategy = param.partition(".")[0]
    words = []
    for other in sorted(a.params.keys() - b.params.keys()):
        name, _, field_name = other.partition(".")
        if name == strategy or name not in strategies.BY_NAME:
            continue
        default = getattr(strategies.BY_NAME[name].default(), field_name, _NO_DEFAULT)
        if a.params[other] == default:
            continue
        said = strategies.BY_NAME[name].words(TrialRecord.of(a).knobs.get(name) or {}) or f"{other}={a.params[other]}"
        if said not in words:
            words.append(said)
    return " + ".join(words)


_NO_DEFAULT = object()


LEFT_OUT = "repeats, and trials that diverged or failed the accuracy check, left out"
"""Which measured trials the knob effects and importances count (knob_effects.usable_trials)."""


def importances(study: optuna.Study, trials: list[FrozenTrial]) -> tuple[dict[str, float], str]:
    """Each parameter's share of PED-ANOVA importance for reaching the fastest of ``trials`` (by
    samples/s, whatever the search's objective), and a sentence on how it was found or why not."""
    n = len(trials)
    if n < MIN_IMPORTANCE_TRIALS:
        return {}, (f"Importance: too few measured trials for PED-ANOVA ({n}, {LEFT_OUT}; it needs at least "
                    f"{MIN_IMPORTANCE_TRIALS} to tell the fastest from the rest).")
    # the top group holds TOP_TRIALS trials (Optuna keeps ceil(quantile * n) of them: the half
    # keeps the product off a whole number) until TOP_SHARE of the trials is more
    quantile = min(0.5, max(TOP_SHARE, (TOP_TRIALS - 0.5) / n))
    top = math.ceil(quantile * n)
    # a copy of the usable trials valued by samples/s: repeats, unstable and failed trials would
    # weigh in otherwise, and every figure of this section is samples/s
    copy = optuna.create_study(direction="maximize", storage=optuna.storages.InMemoryStorage())
    copy.add_trials([optuna.trial.create_trial(params=t.params, distributions=t.distributions,
                                               value=TrialRecord.of(t).samples_per_s) for t in trials])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna warns when a quantile selects few trials: said below
            raw = optuna.importance.PedAnovaImportanceEvaluator(target_quantile=quantile).evaluate(copy)
    except Exception as error:  # an analysis beside the measurements never stops the report
        return {}, f"Importance: PED-ANOVA could not be computed ({type(error).__name__}: {error})."
    total = sum(raw.values())
    if total <= 0:
        return {}, (f"Importance: PED-ANOVA found no parameter whose values differ between the {top} "
                    f"fastest of {n} measured trials and the rest.")
    return {p: v / total for p, v in raw.items()}, (
        f"Importance: Optuna's PED-ANOVA over {n} measured trials, how differently each parameter's values "
        f"are spread among the {top} fastest than among all; shares of 100%. It says which knobs matter "
        "for the fastest configurations, not in which direction.")
