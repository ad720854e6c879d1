"""The study storage: a busy or briefly unreachable database is waited out, never recorded as a
trial failure; a long outage stops with a message that says how to resume; a bad URL is refused
before any device time, its password masked."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time

import optuna
import pytest
from optuna.trial import TrialState

from autotune.search.storage import RetryingRDBStorage, StorageUnavailable, is_transient, open_storage
from conftest import run_cli

# the SQLite busy timeout is 5 s by default; a short one makes a held lock an error at once
QUICK = {"connect_args": {"timeout": 0.05}}


def _hold_exclusive_lock(path, seconds: float, taken: threading.Event) -> threading.Thread:
    """Another process's write transaction on the SQLite file, as `autotune report` or a second
    search would hold it."""

    def hold() -> None:
        con = sqlite3.connect(path, timeout=5, isolation_level=None)
        con.execute("BEGIN EXCLUSIVE")
        taken.set()
        time.sleep(seconds)
        con.execute("COMMIT")
        con.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    return thread


def _objective(lock_after: int, path, seconds: float, taken: threading.Event):
    def objective(trial: optuna.Trial) -> float:
        x = trial.suggest_float("x", -1, 1)
        if trial.number == lock_after:
            _hold_exclusive_lock(path, seconds, taken)
            taken.wait(5)
        trial.set_user_attr("figures", {"samples_per_s": 100 + x})  # written while the lock is held
        return 100 + x

    return objective


@pytest.mark.slow
def test_a_locked_database_is_waited_out_and_no_trial_fails(tmp_path, caplog):
    path = tmp_path / "study.db"
    storage = open_storage(f"sqlite:///{path}", engine_kwargs=QUICK, patience_s=30)
    study = optuna.create_study(storage=storage, study_name="s", direction="maximize")
    taken = threading.Event()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="autotune.search.storage"):
        study.optimize(_objective(1, path, 1.5, taken), n_trials=4)
    assert taken.is_set()
    assert time.monotonic() - started >= 1.4  # the lock really was in the way
    states = [t.state for t in study.trials]
    assert states == [TrialState.COMPLETE] * 4
    assert all("figures" in t.user_attrs for t in study.trials)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "busy or unreachable" in messages and "database is locked" in messages
    assert "reachable again" in messages


@pytest.mark.slow
def test_an_outage_longer_than_the_patience_stops_with_how_to_resume(tmp_path):
    path = tmp_path / "study.db"
    storage = open_storage(f"sqlite:///{path}", engine_kwargs=QUICK, patience_s=0.5)
    study = optuna.create_study(storage=storage, study_name="s", direction="maximize")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    taken = threading.Event()
    holder = _hold_exclusive_lock(path, 3.0, taken)
    taken.wait(5)
    with pytest.raises(StorageUnavailable, match="run the same command again to resume"):
        study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    holder.join()
    # nothing that was recorded is lost
    again = optuna.load_study(study_name="s", storage=f"sqlite:///{path}")
    assert again.trials[0].state == TrialState.COMPLETE


def test_only_errors_that_can_pass_are_retried():
    from sqlalchemy import exc as sa

    locked = sa.OperationalError("UPDATE trials", {}, sqlite3.OperationalError("database is locked"))
    refused = sa.OperationalError("SELECT 1", {}, Exception("connection refused"))
    assert is_transient(locked) and is_transient(refused)
    wrapped = optuna.exceptions.StorageInternalError("commit failed")
    wrapped.__cause__ = locked
    assert is_transient(wrapped)
    assert not is_transient(sa.OperationalError("SELECT", {}, sqlite3.OperationalError("no such table: trials")))
    assert not is_transient(sa.IntegrityError("INSERT", {}, Exception("UNIQUE constraint failed")))
    assert not is_transient(ValueError("bad value"))


def test_a_permanent_error_is_raised_at_once(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path / 'study.db'}", patience_s=30)
    started = time.monotonic()
    with pytest.raises(KeyError):
        storage.get_study_id_from_name("no-such-study")
    assert time.monotonic() - started < 5


def test_every_database_call_is_retried():
    """Optuna's cache calls these on its backend; each must go through the retry."""
    for name in ("create_new_trial", "_create_new_trial", "set_trial_user_attr", "set_trial_state_values",
                 "_get_trials", "get_all_trials", "record_heartbeat", "_get_stale_trial_ids",
                 "set_study_user_attr", "get_study_id_from_name"):
        assert getattr(RetryingRDBStorage, name) is not getattr(optuna.storages.RDBStorage, name), name


@pytest.mark.slow
def test_a_bad_storage_url_is_refused_before_the_probe_runs(tmp_path):
    marker = tmp_path / "built"
    env_before = os.environ.get("AUTOTUNE_TEST_MARKER")
    os.environ["AUTOTUNE_TEST_MARKER"] = str(marker)
    try:
        proc = run_cli("search", "--model", "fake_models:marks_its_build", "--device", "cpu", "--trials", "1",
                       "--out", str(tmp_path / "o"), "--storage", "postgresql://ann:hunter2@127.0.0.1:1/tune",
                       check=False, timeout=120)
    finally:
        if env_before is None:
            del os.environ["AUTOTUNE_TEST_MARKER"]
        else:
            os.environ["AUTOTUNE_TEST_MARKER"] = env_before
    assert proc.returncode == 2, proc.stderr
    assert "cannot be opened" in proc.stderr and "ann:***@" in proc.stderr
    assert "hunter2" not in proc.stderr + proc.stdout
    assert not marker.exists(), "the model was built (the probe ran) before the storage was checked"


@pytest.mark.slow
def test_report_refuses_a_bad_storage_url_without_its_password(tmp_path):
    proc = run_cli("report", "--storage", "mysql://ann:hunter2@127.0.0.1:1/tune", "--study-name", "x",
                   "--out", str(tmp_path), check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "cannot be opened" in proc.stderr and "hunter2" not in proc.stderr + proc.stdout
