"""A costly candidate's accuracy verdict before it runs (autotune.search.precheck): a compiled candidate
the planner expects to lead is checked first, and not run where its numerics fail; one whose numerics
failed already is not run at all. Scripted: a stand-in gate and trial worker (no worker runs)."""

from __future__ import annotations

import time

import optuna
import pytest
from optuna.trial import TrialState

from autotune.search.neighbours import RULE
from autotune.search.objective import Objective
from conftest import workers_answer_ok
from test_planner import SPACE, _params

VIOLATED = {"verdict": "violated", "constraint": 0.1, "reason": "fp16: violated: first gradients 45% off"}
PASSED = {"verdict": "passed", "constraint": 0.0, "reason": "fp16: passed"}


class _Gate:
    """A parity gate with scripted verdicts: ``known`` for a look-up, ``checked`` for a check."""

    timeout_s = 60.0

    def __init__(self, *, known=None, checked=None, estimate_s=20.0):
        self.known, self.checked, self.estimate = known, checked, estimate_s
        self.calls = []

    def estimate_s(self, study):
        return self.estimate

    def verdict_reserve_s(self, study):
        return 0.0

    def near_frontier(self, study, value):
        return False

    def evidence(self, study, knobs, *, check, timeout_s=None, label=""):
        self.calls.append((label, check, timeout_s))
        return self.checked if check else self.known


class _Planner:
    def expects_better(self, study, value):
        return None


def _run(monkeypatch, gate, *, mode="fp16", compile_mode="default", role="steered", predicted=2000.0,
         cost_s=80.0, left_s=600.0, best=1000.0):
    """One queued candidate run by the objective after a measured bar of ``best``: (its trial, whether its
    worker ran, the gate's calls)."""
    ran = []
    workers_answer_ok(monkeypatch, asked=ran.append)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    if best is not None:
        study.add_trial(optuna.trial.create_trial(
            params={}, distributions={}, value=best, user_attrs={"role": "plain-recipe", "status": "ok"}))
    # one knob from the bar, as Neighbours queues it: ranked from the bar, with no eager twin screened first
    study.enqueue_trial(_params(mode, 64, compile_mode), user_attrs={
        "role": role, "planned": {"predicted": predicted, "cost_s": cost_s}, "steered_by": {"rule": RULE}})
    objective = Objective(space=SPACE, workload={"kind": "torchvision", "name": "resnet18"}, measure={},
                          input_on_device=False, seed=0, trial_timeout_s=100.0, accuracy=gate, steer=False,
                          deadline=time.time() + left_s, profile=False)
    objective.planner = _Planner()
    study.optimize(objective, n_trials=1)
    return study.trials[-1], bool(ran), gate.calls


def test_a_compiled_candidate_expected_to_lead_is_checked_first_and_not_run_where_it_fails(monkeypatch):
    trial, ran, calls = _run(monkeypatch, _Gate(checked=VIOLATED))
    assert not ran and trial.state == TrialState.PRUNED
    assert trial.user_attrs["reason"].startswith("not run: its accuracy check, before it ran, failed: fp16: violated")
    assert trial.user_attrs["accuracy"]["verdict"] == "violated"
    assert [(label, check) for label, check, _ in calls] == [("", False), ("#1, before it runs", True)]
    assert calls[1][2] == pytest.approx(60.0)  # the gate's own limit: 520 s are left after the trial's 80
    # passed: it runs, and its check after it is the one made before (the gate's look-up finds it)
    trial, ran, calls = _run(monkeypatch, _Gate(checked=PASSED))
    assert ran and trial.state == TrialState.COMPLETE


@pytest.mark.parametrize("case", [
    {"compile_mode": "off"},  # eager: cheaper to run, and its check follows if it leads
    {"role": "plain-recipe"},  # the bar runs as it is
    {"predicted": 900.0},  # not expected to lead: its check would likely be spent for nothing
    {"left_s": 90.0},  # 90 s hold the trial's 80 but not the check's 20 before it
    {"best": None},  # nothing measured to lead yet
    {"mode": "fp32"},  # FP32's numerics are the reference's own
])
def test_a_candidate_is_run_unchecked_where_a_check_first_is_not_worth_it(monkeypatch, case):
    trial, ran, calls = _run(monkeypatch, _Gate(checked=VIOLATED), **case)
    assert ran and trial.state == TrialState.COMPLETE
    assert not any("before it runs" in label for label, _, _ in calls)


def test_numerics_that_failed_already_are_not_run_at_all(monkeypatch):
    trial, ran, calls = _run(monkeypatch, _Gate(known=VIOLATED), compile_mode="off", predicted=None)
    assert not ran and trial.state == TrialState.PRUNED
    assert trial.user_attrs["reason"] == ("not run: its numerics (fp16, GradScaler init 65536) failed their accuracy check "
                                          "already: fp16: violated: first gradients 45% off")
    assert calls == [("", False, None)]

