"""Trials' logs and traces and the search's report attached through optuna.artifacts
(autotune.search.artifacts): read back through Optuna's API, and opened by optuna-dashboard's own
WSGI app (no browser)."""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import optuna
import pytest

from autotune.search.artifacts import ARTIFACT_DIR, Artifacts, artifact_store, read_artifacts
from autotune.trial.record import TrialRecord

def _study(out: Path) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(study_name="s", storage=f"sqlite:///{out / 'study.db'}", direction="maximize")


def _objective_writing_logs(log_dir: Path, fail_on: int | None = None):
    """A stand-in for the search's objective: the worker's log and gzipped trace land in logs/."""

    def objective(trial: optuna.Trial) -> float:
        x = trial.suggest_int("x", 1, 8)
        (log_dir / f"trial-{trial.number:04d}.log").write_text(f"worker log of trial {trial.number}\n")
        with gzip.open(log_dir / f"trace-{trial.number:04d}.json.gz", "wt") as f:
            json.dump({"traceEvents": [], "trial": trial.number}, f)
        if trial.number == fail_on:
            raise optuna.TrialPruned("does not fit")
        return float(x)

    return objective


@pytest.mark.slow
def test_each_trials_log_and_trace_are_read_back_through_optunas_api(tmp_path):
    (tmp_path / "logs").mkdir()
    study = _study(tmp_path)
    artifacts = Artifacts(tmp_path)
    study.optimize(artifacts.wrap(_objective_writing_logs(tmp_path / "logs", fail_on=1)), n_trials=3)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                                              optuna.trial.TrialState.COMPLETE]
    for trial in study.trials:  # a pruned trial's log says why: attached as well
        metas = {m.filename: m for m in optuna.artifacts.get_all_artifact_meta(trial, storage=study._storage)}
        assert set(metas) == {f"trial-{trial.number:04d}.log", f"trace-{trial.number:04d}.json.gz"}
        assert metas[f"trial-{trial.number:04d}.log"].mimetype == "text/plain"
        assert metas[f"trace-{trial.number:04d}.json.gz"].mimetype == "application/gzip"
        got = read_artifacts(study, trial, tmp_path, tmp_path / "down" / str(trial.number))
        assert got[f"trial-{trial.number:04d}.log"].read_text() == f"worker log of trial {trial.number}\n"
        with gzip.open(got[f"trace-{trial.number:04d}.json.gz"], "rt") as f:
            assert json.load(f)["trial"] == trial.number
    assert (tmp_path / ARTIFACT_DIR).is_dir()


def test_the_outputs_are_the_studys_and_replaced_in_place_on_a_second_run(tmp_path):
    study = _study(tmp_path)
    report = tmp_path / "report.md"
    report.write_text("first")
    artifacts = Artifacts(tmp_path)
    first = artifacts.attach_outputs(study, {"report.md": report, "missing.csv": tmp_path / "missing.csv"})
    report.write_text("second")
    second = Artifacts(tmp_path).attach_outputs(study, {"report.md": report})
    assert first == second and len(first) == 1  # one report.md, not one per run
    got = read_artifacts(study, None, tmp_path, tmp_path / "down")
    assert list(got) == ["report.md"] and got["report.md"].read_text() == "second"


class _BrokenStore:
    def write(self, artifact_id, content_body):
        raise OSError("disk full")


def test_an_upload_that_fails_warns_once_and_fails_no_trial(tmp_path):
    (tmp_path / "logs").mkdir()
    study = _study(tmp_path)
    artifacts = Artifacts(tmp_path)
    artifacts.store = _BrokenStore()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        study.optimize(artifacts.wrap(_objective_writing_logs(tmp_path / "logs")), n_trials=2)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    messages = [str(w.message) for w in caught if "artifacts" in str(w.message)]
    assert len(messages) == 1 and "disk full" in messages[0]


def _dashboard_get(app, path: str) -> tuple[int, bytes]:
    """One GET through the WSGI interface itself (the standard library's, no server, no browser)."""
    from wsgiref.util import setup_testing_defaults

    environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}
    setup_testing_defaults(environ)
    status = []
    body = b"".join(app(environ, lambda code, headers, exc_info=None: status.append(code)))
    return int(status[0].split()[0]), body


def _check_dashboard_opens(storage_url: str, out: Path) -> dict:
    """optuna-dashboard's own WSGI app over the study and its artifact store: the study, each
    trial's artifact list, and one artifact's bytes as the dashboard serves them."""
    optuna_dashboard = pytest.importorskip("optuna_dashboard")
    app = optuna_dashboard.wsgi(storage_url, artifact_store=artifact_store(out))
    status, body = _dashboard_get(app, "/api/meta")
    assert status == 200 and json.loads(body)["artifact_is_available"] is True
    status, body = _dashboard_get(app, "/api/studies")
    assert status == 200
    study_id = json.loads(body)["study_summaries"][0]["study_id"]
    status, body = _dashboard_get(app, f"/api/studies/{study_id}")
    assert status == 200
    detail = json.loads(body)
    trial = next(t for t in detail["trials"] if t["artifacts"])
    meta = next(a for a in trial["artifacts"] if a["filename"].endswith(".log"))
    status, served = _dashboard_get(app, f"/artifacts/{study_id}/{trial['trial_id']}/{meta['artifact_id']}")
    assert status == 200
    assert served == (out / "logs" / meta["filename"]).read_bytes()
    return detail


def test_optuna_dashboard_opens_the_study_and_serves_a_trials_artifact(tmp_path):
    (tmp_path / "logs").mkdir()
    study = _study(tmp_path)
    study.optimize(Artifacts(tmp_path).wrap(_objective_writing_logs(tmp_path / "logs")), n_trials=2)
    detail = _check_dashboard_opens(f"sqlite:///{tmp_path / 'study.db'}", tmp_path)
    assert {a["filename"] for t in detail["trials"] for a in t["artifacts"]} == {
        "trial-0000.log", "trace-0000.json.gz", "trial-0001.log", "trace-0001.json.gz"}


@pytest.mark.slow
def test_a_search_attaches_each_trials_log_and_its_report(tiny_cpu_search, tmp_path):
    out, _ = tiny_cpu_search  # the session's 3-trial CPU search: read here, downloaded into tmp_path
    storage = f"sqlite:///{out / 'study.db'}"
    study = optuna.load_study(study_name=None, storage=storage)
    measured = [t for t in study.trials if TrialRecord.of(t).duplicate_of is None and TrialRecord.of(t).counted]
    assert measured
    for trial in measured:
        got = read_artifacts(study, trial, out, tmp_path / "down" / str(trial.number))
        name = f"trial-{trial.number:04d}.log"
        assert got[name].read_bytes() == (out / "logs" / name).read_bytes()
    got = read_artifacts(study, None, out, tmp_path / "down" / "study")
    assert {"report.html", "report.md", "config.json", "trials.csv"} <= set(got)
    assert json.loads(got["config.json"].read_text()) == json.loads((out / "config.json").read_text())
    _check_dashboard_opens(storage, out)
