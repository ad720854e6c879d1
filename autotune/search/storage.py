"""The study's storage: opened (and checked) before any device time, retried while it is busy
or briefly unreachable, and named in messages without its password.

A search may run for an hour against a shared PostgreSQL server or a SQLite file that another
process (``autotune report``, a second search) is reading. A storage that is locked or drops its
connection for a moment must not turn a measured trial into a failed one, so every call to the
database is retried with exponential backoff; only an outage longer than ``patience_s`` stops the
search, with a message that says how to resume.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
import warnings
from typing import Any, Callable

import optuna
from optuna.storages import RDBStorage

from autotune.errors import AutotuneError, ConfigError
from autotune.trial.record import TrialRecord, queue_attrs

log = logging.getLogger("autotune.search.storage")

DEFAULT_PATIENCE_S = 120.0
"""How long a storage may stay unreachable before the search stops (it resumes on the next run)."""

HEARTBEAT_S = (10, 60)
"""(interval, grace period) in seconds: a search process records each running trial's heartbeat
every interval; a trial whose heartbeat is older than the grace period belongs to a process that
died, and the next trial any process of the study starts fails it and queues it for one re-run.
``AUTOTUNE_HEARTBEAT=INTERVAL,GRACE`` overrides it (tests shorten it to seconds)."""


class StorageUnavailable(AutotuneError):
    """The storage stayed unreachable for longer than the search waits."""


def mask_url(url: str) -> str:
    """A storage URL fit for logs, reports and error messages: the password replaced by ***."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a database URL (a journal file path, say): nothing to hide
        return re.sub(r"(//[^:/@]+:)[^@/]*@", r"\1***@", url)


_PERMANENT = ("no such table", "no such column", "syntax error", "readonly database", "read-only")


def is_transient(exc: BaseException) -> bool:
    """A database error that may go away by itself: locked, busy, connection lost or refused,
    pool exhausted. Wrong SQL, a missing table or a constraint violation are not."""
    from sqlalchemy import exc as sa

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, sa.IntegrityError):
            return False
        if isinstance(exc, sa.OperationalError):
            return not any(s in str(exc).lower() for s in _PERMANENT)
        if isinstance(exc, (sa.TimeoutError, sa.InterfaceError)):
            return True
        if isinstance(exc, sa.DBAPIError) and exc.connection_invalidated:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class RetryingRDBStorage(RDBStorage):
    """Optuna's RDBStorage whose every call is retried, with backoff, while the database is busy
    or unreachable. Optuna wraps it in its usual cache (it is an RDBStorage), and heartbeats go
    through it too, so a brief outage neither fails a trial nor marks a live one stale."""

    patience_s: float = DEFAULT_PATIENCE_S
    max_backoff_s: float = 8.0
    _depth = threading.local()  # only the outermost call retries; nested calls just raise

    def _retrying(self, call: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(self._depth, "n", 0)
        if depth:
            return call(self, *args, **kwargs)
        started = time.monotonic()
        delay = 0.25
        attempt = 0
        while True:
            self._depth.n = depth + 1
            try:
                result = call(self, *args, **kwargs)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                waited = time.monotonic() - started
                cause = _first_line(exc)
                if waited + delay > self.patience_s:
                    raise StorageUnavailable(
                        f"the study storage {mask_url(self.url)} has been busy or unreachable for {waited:.0f} s "
                        f"({cause}); every finished trial is saved in it: run the same command again to resume "
                        "once it is back") from None
                attempt += 1
                if attempt == 1:
                    log.warning("storage %s busy or unreachable during %s (%s); retrying for up to %.0f s",
                                mask_url(self.url), name, cause, self.patience_s)
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
                continue
            finally:
                self._depth.n = depth
            if attempt:
                log.warning("storage %s reachable again after %.1f s (%d retries of %s)",
                            mask_url(self.url), time.monotonic() - started, attempt, name)
            return result


def _first_line(exc: BaseException) -> str:
    inner = exc.__cause__ or exc
    text = str(getattr(inner, "orig", None) or inner).splitlines()[0][:200]
    return f"{type(inner).__name__}: {text}"


def _wrap(name: str) -> None:
    original = getattr(RDBStorage, name)

    @functools.wraps(original)
    def method(self: RetryingRDBStorage, *args: Any, **kwargs: Any) -> Any:
        return self._retrying(original, name, *args, **kwargs)

    setattr(RetryingRDBStorage, name, method)


# every database call Optuna makes, public and the private ones its cache calls
_NOT_DB_CALLS = {"get_heartbeat_interval", "get_heartbeat_stale_trial_callback", "get_failed_trial_callback",
                 "remove_session", "upgrade", "get_current_version", "get_head_version", "get_all_versions"}
for _name, _value in list(vars(RDBStorage).items()):
    if callable(_value) and not _name.startswith("__") and _name not in _NOT_DB_CALLS and not isinstance(
            _value, (staticmethod, classmethod)):
        _wrap(_name)


def open_storage(url: str, *, engine_kwargs: dict[str, Any] | None = None,
                 patience_s: float | None = None) -> RetryingRDBStorage:
    """Open (and create the tables of) an Optuna database storage, or fail with a message that
    says how to fix the URL, masking its password. Calls are retried while the database is busy;
    heartbeats let a search process that dies mid-trial have that trial failed and re-run once
    (RetryStaleTrial), by another process of the same study or the next run."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            kwargs = dict(engine_kwargs or {})
            if not url.startswith("sqlite"):
                kwargs.setdefault("pool_pre_ping", True)  # a server restart leaves dead pooled connections
            interval, grace = heartbeat_settings()
            storage = RetryingRDBStorage(
                url, engine_kwargs=kwargs, heartbeat_interval=interval, grace_period=grace,
                heartbeat_stale_trial_callback=RetryStaleTrial())
            if patience_s is not None:
                storage.patience_s = patience_s
            return storage
    except (ValueError, ImportError, optuna.exceptions.OptunaError, _sqlalchemy_error()) as exc:
        reason = str(exc).splitlines()[0].replace(url, mask_url(url)) if str(exc) else type(exc).__name__
        raise ConfigError(f"--storage {mask_url(url)!r} cannot be opened ({reason}); give an Optuna storage URL "
                          "such as sqlite:///study.db or postgresql://user@host/db") from None


def heartbeat_settings() -> tuple[int, int]:
    """(heartbeat interval, grace period) in seconds: HEARTBEAT_S, or $AUTOTUNE_HEARTBEAT."""
    text = os.environ.get("AUTOTUNE_HEARTBEAT")
    if not text:
        return HEARTBEAT_S
    match = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", text)
    if not match or not 0 < int(match.group(1)) < int(match.group(2)):
        raise ConfigError(f"AUTOTUNE_HEARTBEAT={text!r}: write INTERVAL,GRACE in whole seconds, the grace period "
                          f"longer than the interval (default {HEARTBEAT_S[0]},{HEARTBEAT_S[1]})")
    return int(match.group(1)), int(match.group(2))


class RetryStaleTrial:
    """Heartbeat-stale trial callback: a trial whose search process died (its heartbeat stopped)
    is queued once more, with the same parameters, by whichever live process notices it.

    Optuna's RetryHeartbeatStaleTrialCallback(max_retry=1) copies every user attribute of the dead
    trial, and a process can die after recording part of a result; the re-run carries only the
    trial's role and ``retry_of`` (as a re-run after a killed single search does, see
    recover_dead_trials), so a re-run that dies too is not queued again.
    """

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        record = TrialRecord.of(trial)
        if record.retry_of is not None:
            log.warning("trial %d died with its search process again; it stays failed", trial.number)
            return
        queued = queue_attrs(retry_of=trial.number, **({"role": record.role} if record.role else {}))
        fixed = trial.system_attrs.get("fixed_params")
        log.warning("trial %d was running in a search process that stopped answering (no heartbeat for over "
                    "%d s); it is failed and queued again", trial.number, heartbeat_settings()[1])
        study.enqueue_trial(trial.params or fixed or {}, user_attrs=queued, skip_if_exists=False)


def _sqlalchemy_error() -> type[Exception]:
    try:
        from sqlalchemy.exc import SQLAlchemyError

        return SQLAlchemyError
    except ImportError:
        return optuna.exceptions.OptunaError


def trial_id(storage: optuna.storages.BaseStorage, study: optuna.Study, number: int) -> int:
    """The storage's id of ``study``'s trial ``number``, through Optuna's public storage API."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)


def stale_trial_numbers(storage: optuna.storages.BaseStorage, study: optuna.Study) -> set[int]:
    """Numbers of ``study``'s RUNNING trials whose process's heartbeat stopped: crash recovery's one private
    call into Optuna (its heartbeat has no public query; ``optuna.storages.fail_stale_trials`` fails them).
    Usually none, so the live trials cost no lookup of their own."""
    if not isinstance(storage, RDBStorage):
        return set()
    stale = storage._get_stale_trial_ids(storage.get_study_id_from_name(study.study_name))
    return {storage.get_trial_number_from_id(i) for i in stale}


def recover_dead_trials(study: optuna.Study, storage: optuna.storages.BaseStorage) -> list[int]:
    """Fail the trials a killed search left RUNNING and queue each for one re-run.

    Only called while holding the output folder's lock on its own SQLite study, which proves no
    other process is running them.
    """
    from optuna.trial import TrialState

    from autotune.search.queue import requeue

    recovered = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        number = trial_id(storage, study, trial.number)
        storage.set_trial_system_attr(number, "fail_reason", "search process died; re-queued")
        storage.set_trial_state_values(number, TrialState.FAIL)
        if TrialRecord.of(trial).retry_of is None:  # re-run once: a trial that dies twice stays failed
            requeue(study, trial)
        recovered.append(trial.number)
    return recovered
