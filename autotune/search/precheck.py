"""A costly candidate's accuracy verdict before it runs (autotune.search.objective).

A numerics parity check (autotune.accuracy.study.parity_gate) runs the configuration eager at the check's batch:
it needs nothing the trial measures. A compiled candidate that the planner expects to lead costs its compile
before a figure exists, and its check follows if it leads; checked first, one that fails costs the check
alone, and leaves the budget to the candidates that may pass. A candidate whose numerics were already judged
failed is not run either.
"""

from __future__ import annotations

import time
from typing import Any

import optuna

from autotune.search import plain_recipe
from autotune.search.trials import best_trial
from autotune.trial.record import TrialRecord


def verdict_before_running(objective, trial: optuna.Trial) -> tuple[str, dict[str, Any]] | None:
    """(why ``trial`` is not run, its failed accuracy evidence), or None to run it: its numerics failed
    their check already, or, checked now (``worth_checking_first``), they fail."""
    from autotune.accuracy.settings import describe_numerics, numerics_key
    from autotune.accuracy.study.gate import failed

    gate, study = objective.accuracy, trial.study
    knobs = TrialRecord.of(trial).knobs
    if gate is None or numerics_key(knobs) == numerics_key({}):
        return None
    known = gate.evidence(study, knobs, check=False)
    if failed(known):
        return (f"not run: its numerics ({describe_numerics(knobs)}) failed their accuracy check already: "
                f"{known.get('reason')}"), known
    timeout = worth_checking_first(objective, trial)
    if timeout is None:
        return None
    checked = gate.evidence(study, knobs, check=True, timeout_s=timeout, label=f"#{trial.number}, before it runs")
    if failed(checked):
        return f"not run: its accuracy check, before it ran, failed: {checked.get('reason')}", checked
    return None


def worth_checking_first(objective, trial: optuna.Trial) -> float | None:
    """The seconds a check of ``trial`` before it runs may take, or None where it is not worth it: a
    compiled candidate, not the plain recipe (the bar runs as it is), that the planner chose expecting
    it to lead (its predicted throughput past the best trial that can be recommended), in a budgeted
    search whose time left holds the check's estimate and then the trial's planned cost."""
    planned = trial.user_attrs.get("planned") or {}
    predicted, cost = planned.get("predicted"), planned.get("cost_s")
    record = TrialRecord.of(trial)
    if (objective.deadline is None or objective.planner is None or not objective.goal.maximize
            or predicted is None or cost is None or record.role == plain_recipe.ROLE
            or (record.knobs.get("compile") or {}).get("mode", "off") == "off"):
        return None
    best = best_trial(trial.study)  # the best that can be recommended
    if best is None or predicted <= best.value:
        return None
    estimate = objective.accuracy.estimate_s(trial.study)
    left = objective.deadline - time.time() - cost
    if not estimate or left < estimate:
        return None
    return min(objective.accuracy.timeout_s, left)

