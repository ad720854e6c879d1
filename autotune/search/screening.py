"""Eager screening: a configuration is compiled only once its eager twin ran among the fastest.

A compiled trial costs a minute or more of compiling where an eager one costs seconds, and torch.compile
speeds up a configuration that is already fast eagerly by a bounded factor, so the eager figure ranks
candidates for compiling at a fraction of the cost:

* ``screen_eagerly`` (the objective, before a compiled trial runs): a compiled configuration whose
  eager twin (the same knobs, compile off) was not measured yet is not started, and its twin is
  proposed in its place (handed to ``autotune.search.queue.prune``, which puts it in the queue); one
  whose twin ran below SCREEN_SHARE of the fastest eager trial is not compiled at all, and once a
  compile of its precision was measured, neither is one that could not win with the most that
  compiling gave that precision here (its "gain spread" prior over it: autotune.priors).
  Both are pruned unstarted and uncounted (no "status"); Optuna's sampler ranks them low, so its own
  proposals stay mostly eager and the budget measures many configurations. fp8 is the exception
  (COMPILED_ONLY_PRECISIONS): it is built to be compiled, and its eager figure says little. So is a
  configuration of a precision already measured compiled (the plain recipe, say) and without an
  eager twin: the planner (autotune.search.planner) ranks it from that compiled trial.
* ``CompileFinalist`` (a proposer after each trial: autotune.search.queue.Feeder): the fastest eager
  configuration is proposed compiled, so the compile is spent where it can win.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import TrialState

import strategies
from autotune.space import SearchSpace
from autotune.priors import prior
from autotune.search.queue import Candidate, prune as _prune, queued, trials
from autotune.search.steering import complete_params
from autotune.search.trials import best_trial, planned_params
from autotune.trial.record import TrialRecord

SCREEN_SHARE = 0.9
"""A configuration is compiled only when its eager twin ran at this share of the fastest eager
trial or more: compiling speeds up a configuration by a bounded factor, so one far behind eagerly
stays behind compiled. How much more compiling may give one configuration than another of the same
precision and compile mode is the "gain spread" prior (autotune.priors); the gains differ far
more between precisions, so a gain is carried within a precision only."""

RULE_SCREEN, RULE_FINALIST = "screen eagerly", "compile the fastest eager"

COMPILED_ONLY_PRECISIONS = frozenset({"fp8"})
"""Precision modes whose eager figure does not rank them for compiling: torchao's float8 training
casts and scales every Linear's inputs in kernels of their own unless torch.compile fuses them
(TorchTitan's float8 recipe calls compiling "required"), so fp8 runs behind bf16 eagerly and is
meant to win compiled. Their compiled configurations are measured without an eager twin."""


def eager_twin(params: dict[str, Any], space: SearchSpace) -> dict[str, Any]:
    """The same configuration with compile off, completed through the strategies."""
    return complete_params({**params, strategies.compile.MODE_PARAM: "off"}, space)


def _twin(trial: optuna.Trial, space: SearchSpace) -> optuna.trial.FrozenTrial | None:
    """The trial of ``trial``'s eager twin, measured or queued; None when there is none."""
    twin_params = eager_twin(trial.params, space)
    return next((t for t in trials(trial.study)
                 if t.number != trial.number and complete_params(planned_params(t), space) == twin_params), None)


def _compiled_sibling(trial: optuna.Trial, compile_mode: str) -> optuna.trial.FrozenTrial | None:
    """A completed trial of ``trial``'s precision compiled in ``compile_mode`` (not a copy)."""
    precision = strategies.precision.MODE_PARAM
    for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        record = TrialRecord.of(t)
        if (t.params.get(precision) == trial.params.get(precision) and not record.unstable
                and record.knob("compile", "mode", "off") == compile_mode and record.duplicate_of is None):
            return t
    return None


def missing_eager_twin(trial: optuna.Trial, space: SearchSpace, rule: str) -> Candidate | None:
    """``trial``'s eager twin as a candidate (role "steered", by ``rule``) where no trial of it is measured
    or queued; else None."""
    return _twin_candidate(trial, space, rule) if _twin(trial, space) is None else None


def _twin_candidate(trial: optuna.Trial, space: SearchSpace, rule: str) -> Candidate:
    return Candidate.of(eager_twin(trial.params, space), role="steered",
                        steered_by={"trial": trial.number, "rule": rule})


def eager_rate(trial: optuna.trial.FrozenTrial) -> float | None:
    """What an eager trial ran at: its value, or for one stopped early in its warm-up (well below the
    best so far, such as the compiled plain recipe) its last warm-up window's samples/s; None when
    it has neither."""
    if trial.state == TrialState.COMPLETE:
        return trial.value
    record = TrialRecord.of(trial)
    windows = (record.screening or {}).get("windows") if record.status == "pruned" else None
    return windows[-1] if windows else None


def _fastest_eager(study: optuna.Study, maximize: bool) -> tuple[optuna.trial.FrozenTrial, float] | None:
    """The fastest eager trial and its rate (eager_rate: trials stopped early count by their warm-up)."""
    eager = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        record = TrialRecord.of(t)
        rate = eager_rate(t)
        if rate is not None and record.knob("compile", "mode", "off") == "off" and not record.unstable:
            eager.append((t, rate))
    if not eager:
        return None
    return (max if maximize else min)(eager, key=lambda pair: pair[1])


def screen_eagerly(trial: optuna.Trial, space: SearchSpace, *, compile_mode: str, maximize: bool, unit: str) -> None:
    """Prune, unstarted, a compiled configuration not screened eagerly yet (its twin is proposed in its
    place) or whose eager twin ran below SCREEN_SHARE of the fastest eager trial; return when it may
    compile."""
    if compile_mode == "off" or trial.params.get(strategies.precision.MODE_PARAM) in COMPILED_ONLY_PRECISIONS:
        return
    twin = _twin(trial, space)
    if twin is None:
        if _compiled_sibling(trial, compile_mode) is not None:
            # a compile of its precision ran (the plain recipe, say): the planner ranks this one from
            # it, compiled, and an eager twin would tell less than it costs (autotune.search.planner)
            return
        _prune(trial, "screened eagerly first: its eager twin (compile off) is measured instead, and the "
                      "configuration is compiled only if that one ranks among the fastest",
               instead=_twin_candidate(trial, space, RULE_SCREEN))
    if twin.state in (TrialState.WAITING, TrialState.RUNNING):
        _prune(trial, f"screened eagerly first: its eager twin #{twin.number} is queued")
    # a twin stopped early in its warm-up counts by its warm-up's rate: an eager trial stopped far
    # below the compiled plain recipe has no rate otherwise, and its compile would never run
    rate = eager_rate(twin)
    if rate is None:
        _prune(trial, f"not compiled: its eager twin #{twin.number} did not complete")
    fastest = _fastest_eager(trial.study, maximize)
    if fastest is None:
        return
    best, best_rate = fastest
    behind = rate < SCREEN_SHARE * best_rate if maximize else rate * SCREEN_SHARE > best_rate
    if behind:
        where = (f"below {SCREEN_SHARE:.0%} of the fastest eager" if maximize
                 else f"over {1 / SCREEN_SHARE:.0%} of the best eager")
        _prune(trial, f"not compiled: its eager twin #{twin.number} measured {rate:,.4g} {unit}, "
                      f"{where} #{best.number} ({best_rate:,.4g})")
    _prune_if_it_cannot_win(trial, twin, rate, space, compile_mode=compile_mode, maximize=maximize, unit=unit)


def compile_gains(study: optuna.Study, space: SearchSpace, precision: str, compile_mode: str
                  ) -> list[tuple[float, int, int]]:
    """(compiled value / eager twin's value, compiled trial, twin) of each compiled configuration of
    ``precision`` and ``compile_mode`` measured in the study with its eager twin."""
    done = [(t, complete_params(planned_params(t), space))
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value]
    eager = {}
    for t, params in done:
        if params.get(strategies.compile.MODE_PARAM, "off") == "off":
            eager.setdefault(tuple(sorted(params.items())), t)
    gains = []
    for t, params in done:
        if (params.get(strategies.compile.MODE_PARAM) != compile_mode
                or params.get(strategies.precision.MODE_PARAM) != precision):
            continue
        twin = eager.get(tuple(sorted(eager_twin(params, space).items())))
        if twin is not None and not TrialRecord.of(t).unstable:
            gains.append((t.value / twin.value, t.number, twin.number))
    return gains


def _prune_if_it_cannot_win(trial: optuna.Trial, twin: optuna.trial.FrozenTrial, rate: float, space: SearchSpace,
                            *, compile_mode: str, maximize: bool, unit: str) -> None:
    """Prune a compiled configuration whose eager twin, times the most that compiling gave its
    precision in this search (its "gain spread" prior more), stays behind the best trial: a compile
    costs the time of several eager trials."""
    params = complete_params(trial.params, space)
    gains = compile_gains(trial.study, space, params.get(strategies.precision.MODE_PARAM), compile_mode)
    best = best_trial(trial.study)
    if not gains or best is None:
        return
    gain, compiled, measured_twin = (max if maximize else min)(gains)
    spread = prior(strategies.compile.MODE_PARAM, None, "gain spread")
    reach = rate * gain * ((1 + spread) if maximize else 1 / (1 + spread))
    if reach >= best.value if maximize else reach <= best.value:
        return
    _prune(trial, f"not compiled: its eager twin #{twin.number} measured {rate:,.4g} {unit}; with compiling's gain for "
                  f"{params.get(strategies.precision.MODE_PARAM, 'its precision')} here (x{gain:.2f}: #{compiled} over "
                  f"#{measured_twin}) and {spread:.0%} more, about {reach:,.4g}, "
                  f"{'below' if maximize else 'over'} the best #{best.number} ({best.value:,.4g})")


class CompileFinalist:
    """A proposer after each trial: the fastest eager configuration compiled (mode "default"), where no
    trial has measured, runs or queued it, the space offers compiling and no eager candidate is still
    queued."""

    def __init__(self, space: SearchSpace, maximize: bool) -> None:
        self.space = space
        self.maximize = maximize

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> Candidate | None:
        if "default" not in self.space.compile_modes:
            return None
        if any(planned_params(t).get(strategies.compile.MODE_PARAM, "off") == "off" for t in queued(study)):
            return None  # eager candidates are still queued: the fastest is known once they ran
        fastest = _fastest_eager(study, self.maximize)
        best = None if fastest is None else fastest[0]
        if best is None or TrialRecord.of(best).role == "baseline":
            return None  # the untuned FP32 baseline is not what anyone compiles
        compiled = complete_params({**best.params, strategies.compile.MODE_PARAM: "default"}, self.space)
        known = [complete_params(planned_params(t), self.space) for t in trials(study)]
        if compiled in known:
            return None
        return Candidate.of(compiled, role="steered", steered_by={"trial": best.number, "rule": RULE_FINALIST})
