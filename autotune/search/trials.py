"""Which of a study's trials count: those with a recorded outcome, the best one under the study's
objective and accuracy gate, and the FP32 baseline."""

from __future__ import annotations

from typing import Callable

import optuna
from optuna.trial import TrialState

from autotune.trial.record import TrialRecord

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def planned_params(trial: optuna.trial.FrozenTrial) -> dict:
    """A trial's parameters, run or not: a queued trial has none until it runs, and its parameters
    wait in its ``fixed_params`` system attribute."""
    return trial.params or trial.system_attrs.get("fixed_params") or {}


def counted_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Finished trials with a recorded outcome. A trial whose search process was killed has
    none (it is failed on resume and re-run), so no trial is counted twice; one an earlier search
    measured (autotune.search.warm) is this search's evidence, not its trial."""
    return [t for t in study.get_trials(deepcopy=False, states=FINISHED)
            if (r := TrialRecord.of(t)).status is not None and r.warm_from is None]


MEASURED = ("ok", "pruned")
"""Outcomes with a throughput: measured in full, or stopped early after its warm-up windows."""


def search_cost(study: optuna.Study) -> dict:
    """What the search spent its trials on: the counted trials (copies of an earlier trial's result
    included); of those run (copies aside), the measured ones (a throughput, in full or stopped early
    in the warm-up), those without a figure (out of memory, failed), and the seconds of each phase."""
    counted = [TrialRecord.of(t) for t in counted_trials(study)]
    ran = [t for t in counted if t.duplicate_of is None]
    timing = [t.timing for t in ran]

    def total(key: str) -> float:
        return round(sum(x.get(key) or 0.0 for x in timing), 2)

    return {"num_trials": len(counted), "num_measured": sum(t.status in MEASURED for t in ran),
            "num_stopped_early": sum(t.status == "pruned" for t in ran),
            "num_out_of_memory": sum(t.status == "oom" for t in ran),
            "num_failed": sum(t.status not in (*MEASURED, "oom") for t in ran),
            "worker_start_s": total("worker_start_s"), "build_s": total("build_s"),
            "compile_s": total("compile_s"),
            "compile_cache_hits": sum(t.get("compile_cache") == "hit" for t in timing),
            "warmup_s": total("warmup_s"), "measure_s": total("measure_s"), "trial_wall_s": total("wall_s")}


def best_trial(study: optuna.Study, where: Callable[[TrialRecord], bool] | None = None
               ) -> optuna.trial.FrozenTrial | None:
    """The best completed trial under the study's objective (its direction: the fastest, or the
    least energy or memory) that is neither unstable nor failed its accuracy check; among those whose
    record ``where`` accepts, where given."""
    ranked = ranked_trials(study, where)
    return ranked[0] if ranked else None


def ranked_trials(study: optuna.Study, where: Callable[[TrialRecord], bool] | None = None
                  ) -> list[optuna.trial.FrozenTrial]:
    """The trials best_trial chooses among, best first (ties in the order they ran)."""
    from autotune.accuracy.study.gate import accuracy_of, failed

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if not TrialRecord.of(t).unstable and not failed(accuracy_of(study, t))
            and (where is None or where(TrialRecord.of(t)))]
    # a stable sort keeps the first of equal values first, as max and min do
    return sorted(done, key=lambda t: t.value, reverse=study.direction == optuna.study.StudyDirection.MAXIMIZE)


def best_without_memory_knobs(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The best trial as best_trial picks it, among those with none of the memory knobs on
    (autotune.search.levers: 8-bit optimizer states, a fused loss, recomputed activations, expandable
    segments): what the search gave without them, beside a best that has them."""
    from autotune.search.levers import levers_of

    return best_trial(study, where=lambda record: not levers_of(record.knobs or {}))


def role_trial(study: optuna.Study, role: str) -> optuna.trial.FrozenTrial | None:
    """The first completed trial of ``role``."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if TrialRecord.of(t).role == role:
            return t
    return None


def baseline_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The FP32 baseline, as the user's own script would run it."""
    return role_trial(study, "baseline")


def plain_recipe_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The plain recipe (autotune.search.plain_recipe): the bar every recommendation must clear. Where
    it was measured at more than one batch (GrowToFit), the best of them: the largest batch that fits."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if TrialRecord.of(t).role == "plain-recipe" and t.value is not None]
    if not done:
        return None
    pick = max if study.direction == optuna.study.StudyDirection.MAXIMIZE else min
    return pick(done, key=lambda t: t.value)
