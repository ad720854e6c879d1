"""Which of a study's trials count: those with a recorded outcome, the best one under the study's
objective and accuracy gate, and the FP32 baseline."""

from __future__ import annotations

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
    none (it is failed on resume and re-run), so no trial is counted twice."""
    return [t for t in study.get_trials(deepcopy=False, states=FINISHED) if TrialRecord.of(t).status is not None]


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The best completed trial under the study's objective (its direction: the fastest, or the
    least energy or memory) that is neither unstable nor failed its accuracy check."""
    from autotune.accuracy.gate import accuracy_of, failed

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if not TrialRecord.of(t).unstable and not failed(accuracy_of(study, t))]
    if not done:
        return None
    pick = max if study.direction == optuna.study.StudyDirection.MAXIMIZE else min
    return pick(done, key=lambda t: t.value)


def baseline_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if TrialRecord.of(t).role == "baseline":
            return t
    return None
