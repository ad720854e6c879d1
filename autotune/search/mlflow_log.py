"""--mlflow URI: the search logged to MLflow. One run for the search (named after the study, in
an experiment of the study's name) holds the best configuration's parameters and figures and the
search's config.json, report and trials.csv as artifacts; each trial is a run nested under it with
its parameters, figures (as metrics) and outcome (as tags).

mlflow is imported here only, and only when --mlflow is given: autotune works without it. Logging
runs in the search process, in Optuna's callback after each trial; a failure to log is warned about
once and never fails a trial or the search.
"""

from __future__ import annotations

import math
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.errors import ConfigError
from autotune.search.storage import mask_url
from autotune.search.trials import best_trial
from autotune.trial.record import TrialRecord

PACKAGE = "mlflow-skinny"
"""What to install for --mlflow (the full ``mlflow`` package works as well)."""
MAX_PARAM_CHARS = 6000  # MLflow refuses longer parameter values
MAX_TAG_CHARS = 5000
# the trial record's groups of numbers logged as metrics, with their metric-name prefix
METRIC_GROUPS = (("figures", ""), ("timing", "timing."), ("energy", "energy."))


def require_mlflow() -> None:
    """Refuse --mlflow, naming the package to install, where mlflow cannot be imported."""
    try:
        import mlflow.tracking  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--mlflow needs the mlflow package, which is not installed here ({exc}): "
                          f"pip install {PACKAGE}") from None


def metrics_of(record: TrialRecord) -> dict[str, float]:
    """A trial's numbers as MLflow metrics: its value, its figures, timing and energy (finite numbers
    only; nested groups flattened with dots)."""
    found: dict[str, float] = {}
    if record.value is not None:
        found["value"] = float(record.value)
    for group, prefix in METRIC_GROUPS:
        _flatten(getattr(record, group) or {}, prefix, found)
    # MLflow refuses a whole batch over one key outside its alphabet: such characters become "_"
    return {re.sub(r"[^\w\-. /]", "_", key): value for key, value in found.items() if math.isfinite(value)}


def _flatten(values: dict[str, Any], prefix: str, into: dict[str, float]) -> None:
    for key, value in values.items():
        if isinstance(value, dict):
            _flatten(value, f"{prefix}{key}.", into)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            into[f"{prefix}{key}"] = float(value)


def tags_of(record: TrialRecord, study_name: str) -> dict[str, str]:
    """What a trial's run is tagged with: the study, the trial's number, state and outcome."""
    tags = {"autotune.study": study_name, "autotune.trial": str(record.number), "autotune.state": record.state.name,
            "autotune.role": record.role or "search"}
    for name in ("status", "reason", "duplicate_of"):
        value = getattr(record, name)
        if value is not None:
            tags[f"autotune.{name}"] = str(value)[:MAX_TAG_CHARS]
    return tags


def _millis(moment: Any) -> int | None:
    return None if moment is None else int(moment.timestamp() * 1000)


class MlflowLog:
    """The search's MLflow run and its trials' nested runs; an Optuna callback after each trial."""

    def __init__(self, uri: str) -> None:
        """Open the tracking store at ``uri`` (a bad URI, or a store MLflow refuses, is a ConfigError
        before any device time)."""
        require_mlflow()
        from mlflow.tracking import MlflowClient

        self.uri = uri
        try:
            self.client = MlflowClient(tracking_uri=uri)
        except Exception as exc:
            raise ConfigError(f"--mlflow {mask_url(uri)}: MLflow cannot open this tracking store ({exc})") from None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.study_name = ""
        self._warned = threading.Event()  # --gpus runs trials' callbacks in threads: one warning for all

    def start(self, study: optuna.Study, command: str = "") -> None:
        """Create (or reuse) the experiment named after the study and start the search's run in it."""
        self.study_name = study.study_name
        try:
            found = self.client.get_experiment_by_name(study.study_name)
            self.experiment_id = (found.experiment_id if found is not None
                                  else self.client.create_experiment(study.study_name))
            tags = {"autotune.study": study.study_name, "autotune.command": command[:MAX_TAG_CHARS]}
            run = self.client.create_run(self.experiment_id, run_name=study.study_name, tags=tags)
            self.run_id = run.info.run_id
        except Exception as exc:
            raise ConfigError(f"--mlflow {mask_url(self.uri)}: cannot create the search's run ({exc})") from None

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        """Log ``trial`` as a run nested under the search's; never raises."""
        try:
            self.log_trial(trial)
        except Exception as exc:
            self._warn(exc)

    def log_trial(self, trial: optuna.trial.FrozenTrial) -> str:
        """Log one finished trial as a nested run; its run id."""
        from mlflow.entities import Metric, Param, RunTag

        record = TrialRecord.of(trial)
        tags = {"mlflow.parentRunId": self.run_id, **tags_of(record, self.study_name)}
        run = self.client.create_run(self.experiment_id, run_name=f"trial-{trial.number:04d}",
                                     start_time=_millis(trial.datetime_start), tags=tags)
        stamp = _millis(trial.datetime_complete) or int(time.time() * 1000)
        self.client.log_batch(run.info.run_id,
                              metrics=[Metric(k, v, stamp, 0) for k, v in metrics_of(record).items()],
                              params=[Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in trial.params.items()],
                              tags=[RunTag(k, v) for k, v in tags.items() if k != "mlflow.parentRunId"])
        status = "FAILED" if trial.state == TrialState.FAIL else "FINISHED"
        self.client.set_terminated(run.info.run_id, status=status, end_time=stamp)
        return run.info.run_id

    def finish(self, study: optuna.Study, files: dict[str, Path], interrupted: bool = False) -> None:
        """Log the best trial's parameters and figures and the search's files on the search's run, and end it."""
        if self.run_id is None:
            return
        try:
            self._log_best(study)
            for path in files.values():
                if Path(path).is_file():
                    self.client.log_artifact(self.run_id, str(path))
        except Exception as exc:
            self._warn(exc)
        self.close("KILLED" if interrupted else "FINISHED")

    def _log_best(self, study: optuna.Study) -> None:
        from mlflow.entities import Metric, Param, RunTag

        best = best_trial(study)
        if best is None:
            return
        record = TrialRecord.of(best)
        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id,
                              metrics=[Metric(f"best.{k}", v, stamp, 0) for k, v in metrics_of(record).items()],
                              params=[Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in best.params.items()],
                              tags=[RunTag("autotune.best_trial", str(best.number))])

    def close(self, status: str = "FAILED") -> None:
        """End the search's run with ``status`` unless it has ended; never raises."""
        if self.run_id is None:
            return
        run_id, self.run_id = self.run_id, None
        try:
            self.client.set_terminated(run_id, status=status)
        except Exception as exc:
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        if not self._warned.is_set():
            self._warned.set()
            warnings.warn(f"could not log to MLflow at {mask_url(self.uri)} ({exc}); the search goes on, "
                          "and its output folder holds everything", stacklevel=3)
