"""Several search processes on one study, through Optuna's own mechanism: a shared RDB storage.

Any number of ``autotune search`` processes, on one machine or many, given the same ``--storage``
and ``--study-name``, cooperate on one study: Optuna hands each WAITING trial to exactly one of
them and the sampler sees every process's results. What this module adds on top:

- the study is set up once: one process claims the setup (an atomic insert, see
  :func:`claim_setup`), records the search space and hardware and queues the seed
  configurations; the others wait for it and then join. (``enqueue_trial(skip_if_exists=True)``
  is not enough: Optuna documents that simultaneous calls from several processes may still
  queue a configuration twice.)
- a study's measurements belong to one kind of hardware: a process on another GPU model (or a CPU
  joining a GPU study) is refused, with the study name to use instead (:func:`check_same_hardware`);
- ``--trials N`` counts the study's trials, all processes together: a process stops once the
  finished trials make N, waiting for those that live processes are running (one of them may die,
  and its trial is then re-run); a trial started in the instant two processes both saw room for
  one more ends unmeasured (:class:`SharedStudy`);
- each trial records which process (host:pid) and GPU ran it, so a process sees when another one
  writes to the same SQLite file and says to use PostgreSQL instead.

A process that dies leaves its trial RUNNING; its heartbeat stops, and the next trial any process
starts fails it and queues it for one re-run (autotune.search.storage.RetryStaleTrial).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import warnings
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

from autotune.errors import ConfigError
from autotune.search.storage import is_transient, mask_url, stale_trial_numbers, trial_id
from autotune.search.queue import Candidate, skip
from autotune.trial.record import TrialRecord

log = logging.getLogger("autotune.search.distributed")

OWNER = f"{socket.gethostname()}:{os.getpid()}"
"""This search process, as trials record it."""
OWNER_ATTR = "autotune:owner"
"""Trial system attribute: the host:pid of the search process that ran the trial."""
GPU_ATTR = "autotune:gpu"
"""Trial system attribute: the CUDA_VISIBLE_DEVICES value of the worker that measured it."""
SETUP_ATTR = "autotune:setup"
"""Study user attribute: "claimed by HOST:PID" while that process sets the study up, then "done"."""
SETUP_WAIT_S = 120.0
"""How long a joining process waits for another to finish setting the study up; after that the
setter is taken to have died, and the joiner sets the study up itself."""


class SqliteSharedWarning(UserWarning):
    """Several processes write to one SQLite study."""


CLAIM_ATTEMPTS = 5
"""Tries of the setup claim's INSERT on a busy database (a locked SQLite file, a PostgreSQL restart)."""


def claim_setup(storage: optuna.storages.RDBStorage, study: optuna.Study) -> bool:
    """Whether this process won the right to set the study up (record its space, queue its seeds).

    The claim is an INSERT of a study user attribute: Optuna's schema makes (study, key) unique,
    so of several processes inserting at once exactly one succeeds, on SQLite and PostgreSQL alike
    (Optuna's own set_study_user_attr is an upsert, which cannot tell who was first).
    """
    import sqlalchemy
    from sqlalchemy import exc as sa

    def insert(rdb: optuna.storages.RDBStorage) -> bool:
        try:
            with rdb.engine.begin() as connection:
                connection.execute(
                    sqlalchemy.text("INSERT INTO study_user_attributes (study_id, key, value_json) "
                                    "VALUES (:study_id, :key, :value)"),
                    {"study_id": study_id, "key": SETUP_ATTR, "value": json.dumps(f"claimed by {OWNER}")})
            return True
        except sa.IntegrityError:
            return False

    study_id = storage.get_study_id_from_name(study.study_name)
    for attempt in range(CLAIM_ATTEMPTS):  # a busy database is waited out, as the storage's own calls are
        try:
            return insert(storage)
        except Exception as exc:
            if not is_transient(exc) or attempt == CLAIM_ATTEMPTS - 1:
                raise
            time.sleep(0.5 * 2 ** attempt)
    return False


def setup_done(study: optuna.Study) -> None:
    study.set_user_attr(SETUP_ATTR, "done")


def wait_for_setup(storage: optuna.storages.RDBStorage, study: optuna.Study, *,
                   timeout_s: float = SETUP_WAIT_S) -> dict[str, Any] | None:
    """The study's recorded search space, once it is set up; None when this process must set it
    up (it claimed the setup, or the process that claimed it died before finishing)."""
    attrs = study.user_attrs
    if "space" in attrs and attrs.get(SETUP_ATTR, "done") == "done":
        return attrs["space"]  # set up long ago (studies from before this module have no SETUP_ATTR)
    if SETUP_ATTR not in attrs and claim_setup(storage, study):
        return None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        attrs = study.user_attrs
        if attrs.get(SETUP_ATTR) == "done":
            return attrs["space"]
        time.sleep(0.5)
    log.warning("study %s: %s did not finish setting it up within %.0f s; setting it up here",
                study.study_name, attrs.get(SETUP_ATTR, "another process"), timeout_s)
    return attrs.get("space")


def hardware_of(device: str, provenance: dict[str, Any]) -> str:
    """What a study's measurements hold for: 'cuda' and the GPU's name, or 'cpu' and its model."""
    if device == "cuda":
        return f"cuda {provenance.get('gpu', 'unknown GPU')}"
    return f"cpu {provenance.get('cpu', '')}".strip()


def check_same_hardware(study: optuna.Study, device: str, provenance: dict[str, Any], *, where: str,
                        suggestion: str) -> None:
    """Refuse to add this process's measurements to a study recorded on other hardware: a
    samples/s figure of one GPU model says nothing about another."""
    recorded_device = study.user_attrs.get("device")
    if recorded_device is None:
        return  # not set up yet: this process sets it up
    theirs = hardware_of(recorded_device, study.user_attrs.get("provenance") or {})
    ours = hardware_of(device, provenance)
    if theirs != ours:
        raise ConfigError(
            f"study {study.study_name!r} in {where} holds measurements made on {theirs}, and this process "
            f"runs on {ours}: one study must not mix the two. Give this hardware its own study, e.g. "
            f"--study-name {suggestion}")


def sampler_seed(seed: int, num_trials: int, shared: bool) -> int:
    """The TPE seed of a resumed or joined study: processes that join the same study at the same
    moment must not propose the same sequence, so a shared storage adds this process's identity."""
    if not shared:
        return seed + num_trials
    import zlib

    return (seed + num_trials + zlib.crc32(OWNER.encode())) % 2**31


WAIT_POLL_S = 0.5
"""How often a search waiting for the study's last running trials looks at the storage again."""


class SharedStudy:
    """The study as one of possibly several processes sees it: whose trials are running, how many
    are taken, and the guard every trial passes before it is measured."""

    def __init__(self, study: optuna.Study, storage: optuna.storages.RDBStorage, url: str,
                 trials: int | None) -> None:
        self.study = study
        self.storage = storage
        self.url = url
        self.trials = trials
        self.warned = False

    def live_running(self, *, before: int | None = None) -> list[optuna.trial.FrozenTrial]:
        """RUNNING trials whose process is alive (heartbeat within the grace period), optionally
        only those numbered below ``before``."""
        stale = stale_trial_numbers(self.storage, self.study)
        return [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if t.number not in stale and (before is None or t.number < before)]

    def has_its_trials(self, deadline: float | None = None) -> bool:
        """Whether the study has its --trials: finished ones, and those running in live processes
        (this process's other GPUs included), which are waited for; False as soon as there is room
        for another trial. A process that died mid-trial stops counting once its heartbeat is
        stale, and the next trial started here re-runs its trial: no process stops while a dead
        one's trial is still RUNNING. ``deadline`` (time.time()) ends the wait: --budget.

        The wait polls every WAIT_POLL_S, not every heartbeat interval: a running trial may finish
        at any moment, and with --gpus the search ends only when this wait does (a 10 s sleep
        here once kept a finished two-GPU search waiting 9 s for nothing)."""
        from autotune.search.trials import counted_trials

        assert self.trials is not None
        while True:
            counted = len(counted_trials(self.study))
            if counted >= self.trials:
                return True
            if counted + len(self.live_running()) < self.trials:
                return False
            if deadline is not None and time.time() >= deadline:
                return True
            time.sleep(WAIT_POLL_S)

    def guard(self, objective: Callable[[optuna.Trial], float]) -> Callable[[optuna.Trial], float]:
        """``objective`` behind the checks each trial passes first: it records its process, warns
        once when another process shares a SQLite study, and ends unmeasured when the study's
        --trials are already taken by trials started before it."""
        def guarded(trial: optuna.Trial) -> float:
            from autotune.trial.gpus import current_pin

            here = trial_id(self.storage, self.study, trial.number)
            self.storage.set_trial_system_attr(here, OWNER_ATTR, OWNER)
            pin = current_pin()
            if pin is not None:
                self.storage.set_trial_system_attr(here, GPU_ATTR, pin)
            self.warn_if_sqlite_shared()
            if self.trials is not None:
                from autotune.search.trials import counted_trials

                ahead = len(counted_trials(self.study)) + len(self.live_running(before=trial.number))
                if ahead >= self.trials:  # the stop rule then waits for those, see has_its_trials
                    skip(trial, f"not run: the study's {self.trials} trials were already finished or running "
                                "in other processes", instead=self._give_back(trial))
            return objective(trial)

        return guarded

    def _give_back(self, trial: optuna.Trial) -> Candidate | None:
        """A trial that ends unmeasured says why it has no result; its configuration, where it was queued
        (a seed, a re-run), is returned as a candidate with its role, for ``skip`` to put back in the
        queue so that nothing queued is lost."""
        here = trial_id(self.storage, self.study, trial.number)
        frozen = self.storage.get_trial(here)
        fixed = frozen.system_attrs.get("fixed_params")
        self.storage.set_trial_system_attr(here, "fail_reason", "surplus: the study had its trials")
        if fixed is not None:
            record = TrialRecord.of(frozen)
            kept = {k: v for k, v in (("role", record.role), ("retry_of", record.retry_of)) if v is not None}
            return Candidate.of(fixed, **kept)
        return None

    def other_processes(self) -> set[str]:
        """The host:pid of live processes, other than this one, running trials of the study."""
        return {t.system_attrs[OWNER_ATTR] for t in self.live_running()
                if t.system_attrs.get(OWNER_ATTR, OWNER) != OWNER}

    def warn_if_sqlite_shared(self) -> None:
        """One warning when another process writes to the same SQLite study: SQLite locks the
        whole file for every write, so several processes wait on each other (the storage retries,
        but a search slows down, and the file must be on a local disk, never NFS)."""
        if self.warned or not self.url.startswith("sqlite"):
            return
        others = self.other_processes()
        if not others:
            return
        self.warned = True
        name = self.study.study_name
        warnings.warn(
            f"study {name!r} in {mask_url(self.url)} is also being searched by {', '.join(sorted(others))}: "
            "SQLite serialises every write of several processes and must stay on one machine's local disk. "
            "For several processes or machines use PostgreSQL, e.g. `autotune search ... --storage "
            f"postgresql://USER@HOST/DB --study-name {name}` on each (README: Several machines)",
            SqliteSharedWarning, stacklevel=2)
