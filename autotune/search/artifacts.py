"""Each trial's log and profile trace, and the search's report, attached to the study through
``optuna.artifacts``: a file-system artifact store beside the study (OUT/artifacts/), so
optuna-dashboard shows them per trial (``optuna-dashboard sqlite:///OUT/study.db --artifact-dir OUT/artifacts``).

Optuna stores an artifact's metadata as a system attribute of its trial, and a finished trial's
attributes cannot change: a trial's files are therefore attached by the search process at the end
of its objective call (the worker has written them, the trial is still running), not in a callback
after the trial. Attaching never fails a trial or the search: the first failure is warned about once.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import optuna
from optuna.artifacts import FileSystemArtifactStore, get_all_artifact_meta, upload_artifact

ARTIFACT_DIR = "artifacts"
"""The artifact store's folder inside the output folder."""

# the types optuna-dashboard previews or offers for download; a .json.gz trace is stored as the
# gzip file it is (Perfetto opens it), not as JSON with a content encoding the browser would undo
MIMETYPES = {".log": "text/plain", ".md": "text/markdown", ".csv": "text/csv", ".html": "text/html",
             ".json": "application/json", ".gz": "application/gzip"}


def artifact_store(out_dir: Path) -> FileSystemArtifactStore:
    """The search's artifact store, OUT/artifacts/ (created when missing)."""
    path = Path(out_dir) / ARTIFACT_DIR
    path.mkdir(parents=True, exist_ok=True)
    return FileSystemArtifactStore(str(path))


def trial_files(log_dir: Path, number: int) -> list[Path]:
    """The files a trial's worker left in logs/: its log and (a profiled GPU trial) its Chrome trace."""
    candidates = [log_dir / f"trial-{number:04d}.log", log_dir / f"trace-{number:04d}.json.gz"]
    return [path for path in candidates if path.is_file()]


def mimetype(path: Path) -> str | None:
    """The MIME type an artifact is stored with; None: Optuna guesses it from the name."""
    return MIMETYPES.get(path.suffix)


class Artifacts:
    """Attaches trials' files and the search's outputs to a study, through its artifact store."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.store = artifact_store(self.out_dir)
        self.log_dir = self.out_dir / "logs"
        self._warned = threading.Event()  # --gpus runs trials in threads: one warning for all

    def wrap(self, objective: Callable[[optuna.Trial], float]) -> Callable[[optuna.Trial], float]:
        """``objective`` followed by attaching the trial's files, whether it returned, pruned or failed."""

        def with_artifacts(trial: optuna.Trial) -> float:
            try:
                value = objective(trial)
            except Exception:  # pruned or failed: its log says why, so it is attached too
                self.attach_trial(trial)
                raise
            self.attach_trial(trial)
            return value

        return with_artifacts

    def attach_trial(self, trial: optuna.Trial) -> list[str]:
        """Attach the trial's log and trace (those that exist) to the running ``trial``; their artifact ids."""
        ids = []
        for path in trial_files(self.log_dir, trial.number):
            artifact_id = self._upload(path, trial)
            if artifact_id is not None:
                ids.append(artifact_id)
        return ids

    def attach_outputs(self, study: optuna.Study, files: dict[str, Path]) -> list[str]:
        """Attach the search's outputs (report, config.json, trials.csv, kept traces) to the study.
        A file the study already holds under the same name is replaced in place, so a resumed
        search's study shows one current report, not one per run."""
        try:
            held = {meta.filename: meta.artifact_id for meta in get_all_artifact_meta(study)}
        except Exception as exc:  # an unreadable storage: the outputs are on disk all the same
            self._warn(exc)
            return []
        ids = []
        for path in files.values():
            if not Path(path).is_file():
                continue
            if Path(path).name in held:
                artifact_id = self._replace(Path(path), held[Path(path).name])
            else:
                artifact_id = self._upload(Path(path), study)
            if artifact_id is not None:
                ids.append(artifact_id)
        return ids

    def _upload(self, path: Path, owner: optuna.Trial | optuna.Study) -> str | None:
        try:
            return upload_artifact(artifact_store=self.store, file_path=str(path), study_or_trial=owner,
                                   mimetype=mimetype(path))
        except Exception as exc:
            self._warn(exc)
            return None

    def _replace(self, path: Path, artifact_id: str) -> str | None:
        try:
            with open(path, "rb") as f:
                self.store.write(artifact_id, f)
            return artifact_id
        except Exception as exc:
            self._warn(exc)
            return None

    def _warn(self, exc: Exception) -> None:
        if not self._warned.is_set():
            self._warned.set()
            warnings.warn(f"could not attach a file to the study's artifacts in {self.out_dir / ARTIFACT_DIR} ({exc}); "
                          "the search goes on, and logs/ and the report still hold everything", stacklevel=3)


def read_artifacts(study: optuna.Study, trial: optuna.trial.FrozenTrial | None, out_dir: Path,
                   into: Path, storage: optuna.storages.BaseStorage | str | None = None) -> dict[str, Path]:
    """Download the artifacts of ``trial`` (None: the study's own) from OUT/artifacts/ into ``into``;
    {file name: downloaded path}. ``storage``: the study's (a URL or the object; default OUT/study.db, the
    search's own). For scripts and tests reading a search's artifacts back."""
    from optuna.artifacts import download_artifact
    from optuna.storages import get_storage

    storage = get_storage(storage or f"sqlite:///{out_dir / 'study.db'}")

    store = artifact_store(out_dir)
    owner: Any = study if trial is None else trial
    into.mkdir(parents=True, exist_ok=True)
    found = {}
    for meta in get_all_artifact_meta(owner, storage=storage):
        target = into / meta.filename
        target.unlink(missing_ok=True)  # download_artifact refuses to overwrite
        download_artifact(artifact_store=store, file_path=str(target), artifact_id=meta.artifact_id)
        found[meta.filename] = target
    return found
