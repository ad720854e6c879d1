"""The search's queue: the one module that writes it, hands the planner's choice to Optuna and ends a
trial unmeasured.

Proposers (the seeds and their feeder, the plain recipe grown to fit, the neighbours and climbs, the
findings' remedies, eager screening's twins and the compile finalist, the out-of-memory back-off, the
end-of-budget eager twin, distributed give-back) read the study and return ``Candidate``s (parameters,
and why: role, steered_by, grown_from, ...); none of them writes the queue or creates an Optuna trial
(tests/test_structure.py checks it).
Their callers hand what they return to this module: ``put`` (the objective's back-off and remedies, the
study's seeds, ``Feeder`` for the proposers that run after each trial), ``prune`` and ``skip`` (a
trial ended with its replacement: its eager twin, a surplus trial's configuration given back), and
``requeue`` (a re-run of a trial cut short). One writer keeps one order and one numbering, and what a
proposer puts forward can be replayed without a search (scripts/replay_plan.py). The candidates are
kept as a study user attribute, so a search that is killed resumes with its queue and several
processes of one study share it. Right before Optuna asks for the next trial (``feed``: before the
first, and from ``Feeder``, Optuna's callback, after each trial), the planner
(autotune.search.planner) chooses one candidate, and only that one is queued with
``study.enqueue_trial``, its plan recorded on it as the ``planned`` user attribute: Optuna's public API,
and the answer to "why did this trial run now?" kept on the trial itself (Ray Tune's split: searchers
propose, a scheduler decides).

A trial is ended unmeasured here too (``prune``: the objective and eager screening say why, this module
ends it; ``skip``: a shared study's process found its last trials taken), and the search is stopped here
(``Feeder``, on the stop rule's word).

Trials Optuna itself holds WAITING (one queued here that no thread has asked for yet, a re-run that
storage's crash recovery queued, a study from before this queue) are candidates too (``queued``), and run
before any other: Optuna asks for them in their order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NoReturn

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.trial.record import TrialRecord, queue_attrs, write

CANDIDATES_ATTR = "autotune:candidates"
"""The study's user attribute holding the queue: [{"id", "params", "attrs"}] in the order proposed."""
CANDIDATE_BASE = 1_000_000
"""Candidates are numbered from here, apart from the trials' numbers, in the order they were proposed: a
candidate is no trial until it is chosen, and a number of its own cannot be mistaken for one."""

_lock = threading.RLock()  # --gpus: a thread per GPU proposes and chooses


@dataclass(frozen=True)
class Candidate:
    """One configuration a proposer puts forward: its parameters and why it was proposed (its role and
    the rest of ``autotune.trial.record.queue_attrs``)."""

    params: dict[str, Any]
    attrs: dict[str, Any] = field(default_factory=dict)
    id: int | None = None

    @classmethod
    def of(cls, params: dict[str, Any], **attrs: Any) -> Candidate:
        """``params`` put forward with ``attrs`` (``autotune.trial.record.queue_attrs``: role, steered_by,
        ...), checked against TrialRecord's fields; numbered once ``put`` in the queue."""
        return cls(dict(params), queue_attrs(**attrs))

    @property
    def role(self) -> str | None:
        return self.attrs.get("role")

    def as_trial(self) -> FrozenTrial:
        """The candidate as a WAITING trial of its parameters (what Optuna's queue held): every reader
        of the queue sees proposed and queued configurations alike."""
        return FrozenTrial(number=self.id, state=TrialState.WAITING, value=None, values=None, datetime_start=None,
                           datetime_complete=None, params={}, distributions={}, user_attrs=dict(self.attrs),
                           system_attrs={"fixed_params": dict(self.params)}, intermediate_values={},
                           trial_id=-1)


def _stored(study: optuna.Study) -> list[dict[str, Any]]:
    return list(study.user_attrs.get(CANDIDATES_ATTR) or [])


def candidates(study: optuna.Study) -> list[Candidate]:
    """The proposed candidates not chosen yet, in the order they were proposed."""
    return [Candidate(dict(c["params"]), dict(c.get("attrs") or {}), c["id"]) for c in _stored(study)]


Proposed = Candidate | Iterable[Candidate] | None
"""What a proposer returns: one candidate, several in the order it proposes them, or none."""


def put(study: optuna.Study, proposed: Proposed) -> list[Candidate]:
    """Put ``proposed`` in the queue, in its order: the queue's one writer. Returns the candidates as
    stored, numbered."""
    if proposed is None:
        return []
    candidates = [proposed] if isinstance(proposed, Candidate) else list(proposed)
    if not candidates:
        return []
    numbered = []
    with _lock:  # the queue read once and written once, however many candidates a proposer returned
        stored = _stored(study)
        number = max([c["id"] + 1 for c in stored] + [int(study.user_attrs.get(_NEXT_ATTR) or CANDIDATE_BASE)])
        for candidate in candidates:
            attrs = queue_attrs(**candidate.attrs)
            stored.append({"id": number, "params": dict(candidate.params), "attrs": attrs})
            numbered.append(Candidate(dict(candidate.params), attrs, number))
            number += 1
        study.set_user_attr(CANDIDATES_ATTR, stored)
        study.set_user_attr(_NEXT_ATTR, number)
    return numbered


_NEXT_ATTR = "autotune:next_candidate"
"""The study's user attribute holding the next candidate's number (numbers are never reused)."""


def requeue(study: optuna.Study, trial: optuna.Trial | FrozenTrial) -> Candidate:
    """Put a trial's parameters forward to be measured again (its role kept), for a trial that was cut
    short through no fault of its configuration."""
    role = TrialRecord.of(trial).role
    return put(study, Candidate.of(trial.params, retry_of=trial.number, **({"role": role} if role else {})))[0]


def waiting(study: optuna.Study) -> list[FrozenTrial]:
    """Trials Optuna holds WAITING: asked for before any candidate, in their order."""
    return study.get_trials(deepcopy=False, states=(TrialState.WAITING,))


def queued(study: optuna.Study) -> list[FrozenTrial]:
    """Everything queued, as WAITING trials: Optuna's waiting trials, then the candidates."""
    return waiting(study) + [c.as_trial() for c in candidates(study)]


def queued_trial(study: optuna.Study, number: int) -> FrozenTrial:
    """The queued trial or candidate numbered ``number`` (a plan's: autotune.search.planner.Plan.number)."""
    return next(t for t in queued(study) if t.number == number)


def trials(study: optuna.Study) -> list[FrozenTrial]:
    """The study's trials and the candidates after them: what proposers compare a new proposal with (a
    configuration measured, running or queued is not proposed again)."""
    return study.get_trials(deepcopy=False) + [c.as_trial() for c in candidates(study)]


def feed(study: optuna.Study, planner=None, slots: int = 1) -> None:
    """Queue the planner's choice for Optuna's next ask, until ``slots`` trials wait (one a thread that
    asks): the chosen candidate leaves the list and becomes a WAITING trial with its ``planned`` record.
    Nothing is queued where none is proposed (the sampler then proposes) or Optuna holds a trial already.
    Without a planner, the candidates run in the order proposed."""
    with _lock:
        while len(waiting(study)) < slots:
            stored = _stored(study)
            if planner is None:
                chosen, planned = (stored[0], None) if stored else (None, None)
            else:
                plan = planner.choose(study)
                chosen = None if plan is None else next((c for c in stored if c["id"] == plan.number), None)
                planned = None if plan is None else plan.to_attr()
            if chosen is None:
                return
            stored.remove(chosen)
            study.set_user_attr(CANDIDATES_ATTR, stored)
            attrs = dict(chosen["attrs"], **({"planned": planned} if planned is not None else {}))
            study.enqueue_trial(chosen["params"], user_attrs=attrs, skip_if_exists=False)


class Feeder:
    """Optuna's callback after each trial (the last but tracking's): hand the trial to the ``proposers``
    (callables of the study and the trial that return candidates: autotune.cli.run._proposers) and put what
    each returns in the queue before the next one is asked, so each sees what those before it proposed;
    then stop the search where the stop rule (autotune.search.budget.StopRule) says so, else queue what
    runs next (``feed``). ``slots``: the trials run at once (--gpus), each asking for one."""

    def __init__(self, planner=None, stop_rule=None, slots: int = 1,
                 proposers: Iterable[Callable[[optuna.Study, FrozenTrial], Proposed]] = ()) -> None:
        self.planner = planner
        self.stop_rule = stop_rule
        self.slots = slots
        self.proposers = list(proposers)

    def feed(self, study: optuna.Study) -> None:
        """Queue what runs first (before Optuna's loop starts)."""
        feed(study, self.planner, self.slots)

    def propose(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """Put what each proposer proposes after ``trial`` in the queue, in the proposers' order (also for
        the trials a study was warmed with: autotune.search.warm.propose_from_evidence)."""
        for proposer in self.proposers:
            put(study, proposer(study, trial))

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.propose(study, trial)
        if self.stop_rule is not None and self.stop_rule(study, trial):
            study.stop()  # nothing more is queued: a stopped search leaves no trial waiting
            return
        self.feed(study)


class TrialFailed(Exception):
    """A trial that ends without a measurement and is not the sampler's evidence: its worker crashed, timed out
    or raised, or the budget cut it; or it was skipped (``skip``). Recorded on the trial, and the study goes on."""


def skip(trial: optuna.Trial, reason: str, instead: Proposed = None) -> NoReturn:
    """End ``trial`` unrun (FAIL, as Optuna's ``catch``), and put ``instead`` in the queue (its
    configuration given back, where it was queued): another process of a shared study has taken the
    study's last trials."""
    put(trial.study, instead)
    write(trial, reason=reason)
    raise TrialFailed(f"trial {trial.number} {reason}")


def prune(trial: optuna.Trial, reason: str | None, instead: Proposed = None, **record: Any) -> NoReturn:
    """End ``trial`` as Optuna's PRUNED, with ``reason`` (where given) and ``record`` (TrialRecord fields)
    written on it, and ``instead`` put in the queue (its eager twin, measured first): not run (it cannot
    fit, cannot run, fails its numerics, waits for its eager twin, would end past the budget), or run and
    stopped early, or out of memory. Optuna's samplers rank a pruned trial below every completed one, so
    the region stops being proposed."""
    put(trial.study, instead)
    write(trial, **({"reason": reason} if reason else {}), **record)
    raise optuna.TrialPruned(reason)
