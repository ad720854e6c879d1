"""--mlflow URI (autotune.search.mlflow_log): a search logged to a local MLflow store, its runs,
parameters, metrics and artifacts read back through MlflowClient; without mlflow, a clear error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from autotune.errors import ConfigError
from autotune.search.mlflow_log import MlflowLog, metrics_of, require_mlflow, tags_of
from autotune.trial.record import TrialRecord, write

MODEL = ["--model", "fake_models:tiny_cnn", "--device", "cpu", "--input-shape", "3x32x32", "--num-classes", "10",
         "--min-measure-time", "0.2", "--precisions", "fp32", "--no-accuracy-check"]


def _file_store(path: Path, monkeypatch) -> str:
    # MLflow 3 refuses a plain folder as its store unless this opt-out is set
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return path.as_uri()


def _measured_study() -> optuna.Study:
    """A small study whose trials carry records as the search writes them."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="tiny-cpu", direction="maximize")

    def objective(trial: optuna.Trial) -> float:
        batch = trial.suggest_categorical("batch_size.batch_size", [4, 8, 16])
        write(trial, status="ok", role="baseline" if trial.number == 0 else None,
              figures={"samples_per_s": 100.0 * batch, "step_ms": {"median": 10.0, "p90": float("nan")}},
              timing={"wall_s": 1.5, "worker_start_s": None})
        return 100.0 * batch

    study.optimize(objective, n_trials=3)
    return study


def test_a_trials_figures_become_metrics_and_its_outcome_tags():
    trial = _measured_study().trials[0]
    record = TrialRecord.of(trial)
    metrics = metrics_of(record)
    assert metrics["value"] == trial.value and metrics["samples_per_s"] == trial.value
    assert metrics["step_ms.median"] == 10.0 and "step_ms.p90" not in metrics  # NaN is not a metric
    assert metrics["timing.wall_s"] == 1.5 and "timing.worker_start_s" not in metrics
    tags = tags_of(record, "tiny-cpu")
    assert tags["autotune.status"] == "ok" and tags["autotune.role"] == "baseline"
    assert tags["autotune.state"] == "COMPLETE" and tags["autotune.trial"] == "0"


@pytest.mark.slow
def test_a_small_study_is_read_back_from_a_local_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = _file_store(tmp_path / "mlruns", monkeypatch)
    study = _measured_study()
    log = MlflowLog(uri)
    log.start(study, "autotune search --model tiny")
    search_run = log.run_id
    for trial in study.trials:
        log(study, trial)
    report = tmp_path / "report.md"
    report.write_text("# report")
    log.finish(study, {"report.md": report})
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tiny-cpu")
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if r.info.run_id == search_run)
    trials = sorted((r for r in runs if r.info.run_id != search_run), key=lambda r: r.info.run_name)
    assert [r.info.run_name for r in trials] == ["trial-0000", "trial-0001", "trial-0002"]
    assert all(r.data.tags["mlflow.parentRunId"] == search_run and r.info.status == "FINISHED" for r in trials)
    for run, trial in zip(trials, study.trials):
        assert run.data.params == {"batch_size.batch_size": str(trial.params["batch_size.batch_size"])}
        assert run.data.metrics["samples_per_s"] == trial.value
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["autotune.best_trial"] == str(study.best_trial.number)
    assert parent.data.metrics["best.samples_per_s"] == study.best_value
    assert [a.path for a in client.list_artifacts(search_run)] == ["report.md"]


def test_a_store_mlflow_refuses_is_a_config_error(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match="--mlflow"):
        MlflowLog((tmp_path / "mlruns").as_uri())


def test_without_mlflow_installed_the_error_names_the_package(monkeypatch):
    # a None entry in sys.modules makes `import mlflow` raise ImportError, as when it is not installed
    for name in [n for n in sys.modules if n == "mlflow" or n.startswith("mlflow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError, match="pip install mlflow-skinny"):
        require_mlflow()
    with pytest.raises(ConfigError, match="mlflow-skinny"):
        MlflowLog("sqlite:///never.db")


@pytest.mark.slow
def test_a_search_logs_its_trials_best_config_and_report_to_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from conftest import ROOT, subprocess_env
    from mlflow.tracking import MlflowClient

    uri, out = _file_store(tmp_path / "mlruns", monkeypatch), tmp_path / "run"  # the search inherits the opt-out
    proc = subprocess.run([sys.executable, "-m", "autotune", "search", *MODEL, "--trials", "3", "--out", str(out),
                           "--mlflow", uri], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(study.study_name)
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    search_run = parents[0].info.run_id
    trials = {int(r.data.tags["autotune.trial"]): r for r in runs if r.info.run_id != search_run}
    finished = [t for t in study.trials if t.state.is_finished()]  # not the seeds still queued
    assert set(trials) == {t.number for t in finished}
    for trial in finished:
        run = trials[trial.number]
        assert run.data.params == {k: str(v) for k, v in trial.params.items()}
        if TrialRecord.of(trial).measured:
            assert run.data.metrics["samples_per_s"] == pytest.approx(TrialRecord.of(trial).samples_per_s)
    artifacts = {a.path for a in client.list_artifacts(search_run)}
    assert {"config.json", "report.html", "report.md", "trials.csv"} <= artifacts
    local = Path(client.download_artifacts(search_run, "config.json", str(tmp_path)))
    assert local.read_text() == (out / "config.json").read_text()
