"""When a search stops: the expected wall time of the next trial against the budget, the trial
count across every process of the study (StopRule, Optuna's callback after each trial)."""

from __future__ import annotations

import time
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

import strategies
from autotune.search.distributed import SharedStudy
from autotune.search.knob_effects import fix_no_effect_knobs
from autotune.search.options import SearchConfig
from autotune.search.trials import planned_params
from autotune.search.walls import expected_wall, trial_wall
from autotune.trial.record import TrialRecord

STOP_ATTR = "stopped_early"
"""The study's user attribute saying why the search ended before its budget (StopRule.nothing_to_gain)."""


def export_reserve(budget_s: float) -> float:
    """Seconds of a --budget kept for writing the outputs after the last trial and check (config,
    CSV, report with its plots: one to a few seconds), so the whole command ends within it."""
    return min(10.0, max(2.0, 0.02 * budget_s))


def deadline(config: SearchConfig, started: float) -> float | None:
    """When trials and accuracy checks must be done (time.time()): the budget, counted from the
    command's start (``started``), less the export's reserve. None without --budget."""
    if config.budget_s is None:
        return None
    return started + config.budget_s - export_reserve(config.budget_s)


def estimate_next_wall(study: optuna.Study, walls: list[tuple[float, bool]], *, left_s: float | None = None,
                       compile_prior_s: float = 0.0, planner=None) -> float:
    """Expected seconds of the next trial, from past trials' walls ``(seconds, compiled)``.

    A trial that compiles takes minutes where an eager one takes seconds, so the two kinds are
    estimated apart: the next queued configuration's own kind when one is queued (the seeds),
    otherwise both kinds weighted by how often they came so far. A compiled trial expected to end
    past ``left_s`` is not started (the objective queues its eager twin instead), so then the next
    trial is an eager one.
    """
    if not walls:
        return 0.0
    eager, compiled = expected_wall(walls, False), expected_wall(walls, True, compile_prior_s)
    if left_s is not None and compiled > left_s:
        return eager
    from autotune.search.queue import queued

    waiting = queued(study)
    if waiting:
        # the one the planner (autotune.search.planner) runs next, else the queue's first
        plan = planner.choose(study, left_s) if planner is not None else None
        if plan is not None:
            return plan.cost_s
        fixed = planned_params(waiting[0])
        return compiled if fixed.get(strategies.compile.MODE_PARAM, "off") != "off" else eager
    share = sum(c for _, c in walls) / len(walls)
    return share * compiled + (1 - share) * eager


class StopRule:
    """Called after each trial (by autotune.search.queue.Feeder, which stops the search): counts the trials
    this run measured, fixes the knobs shown to have no effect (with --steer), reports the trial, and says
    whether the search is done: its trials are (--trials, across every process of the study) or the next
    one would end past the budget."""

    def __init__(self, config: SearchConfig, shared: SharedStudy, started: float,
                 emit: Callable[[str, Any], None], compile_prior_s: float = 0.0) -> None:
        self.config = config
        self.shared = shared
        self.started = started
        self.emit = emit
        self.walls: list[tuple[float, bool]] = []  # (wall seconds, compiled) of each measured trial
        self.compile_prior_s = compile_prior_s
        self.new_trials = 0
        self.planner = None
        """The search's planner (autotune.search.planner), asked what runs next and what it costs."""
        self.gate = None
        """The search's accuracy gate, or None: the trials leave it the seconds of the recommendation's
        verdict (verdict_reserve_s)."""

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        """Whether the search stops after ``trial``."""
        config, started, record = self.config, self.started, TrialRecord.of(trial)
        if record.status is not None:
            self.new_trials += 1
            if (wall := trial_wall(record)) is not None:
                self.walls.append(wall)
        if config.steer and record.status is not None:
            # knobs whose measured effect is below noise stop being explored
            newly = fix_no_effect_knobs(study)
            if newly:
                self.emit("fixed", newly)
        self.emit("trial", trial)
        # other processes of the study (and other GPUs' threads) count: finished, or running
        # and waited for (a process that dies has its trial re-run here)
        end = deadline(config, started)
        if config.trials is not None and self.shared.has_its_trials(deadline=end):
            return True
        if end is not None:
            now = time.time()
            end -= self.gate.verdict_reserve_s(study) if self.gate is not None else 0.0
            if now + estimate_next_wall(study, self.walls, left_s=end - now, compile_prior_s=self.compile_prior_s,
                                        planner=self.planner) > end:
                return True
            if (why := self.nothing_to_gain(study, end - now)) is not None:
                study.set_user_attr(STOP_ATTR, why)
                self.emit("stopped", why)
                return True
        return False

    def nothing_to_gain(self, study: optuna.Study, left_s: float) -> str | None:
        """Why the search ends before its budget, or None: no compile fits the ``left_s`` left, and the
        candidate the planner would run next is predicted below the best measured, with nothing new to
        hope for (its gain is 0): such candidates could not be recommended, and may run out of memory
        at the cap's edge. Only once a compiled trial was
        measured (a CPU search compiles nothing: the rule never ends it)."""
        if self.planner is None or not any(compiled for _, compiled in self.walls):
            return None
        if expected_wall(self.walls, True, self.compile_prior_s) <= left_s:
            return None  # a compile still fits: what the planner queues next may gain
        if not any(t.state == TrialState.COMPLETE and t.value is not None for t in study.get_trials(deepcopy=False)):
            return None
        plan = self.planner.choose(study, left_s)
        if plan is None or plan.rank < 5 or plan.predicted is None or plan.gain > 0:
            return None
        return (f"stopped with {left_s:.0f} s of the budget left: no compiled trial fits them, and the next "
                f"candidate (#{plan.number}, predicted {plan.predicted:,.4g}) is not expected to beat the best")
