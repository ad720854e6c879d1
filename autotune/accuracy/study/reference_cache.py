"""The accuracy check's FP32 reference, kept across searches: trained once per (model, input shape,
classes, data, check settings with their seed and steps, torch, device) and reused by every later
search of the same workload on the same kind of device, in a fresh --out or on resume.

One JSON file per key in ``$AUTOTUNE_CACHE_DIR/accuracy`` (else ``~/.cache/autotune/accuracy``).
A file that cannot be read, or that is not a reference for its key, is a miss: the reference is
trained again. A folder that cannot be written only warns; the next search trains it again.

Within a search, the worker that trains a reference writes it to a file of the study's as soon as it
is trained, which the gate reads where that worker then fails (autotune.accuracy.worker.reference_file).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

from autotune.accuracy.settings import AccuracySettings
from autotune.cache import CACHE_ENV, cache_root

FORMAT = 2
"""Part of every key: bumped when what a reference holds changes, so an older file is never read as
a newer one (2: the synthetic data is labelled by a teacher, and a language model's has a held-out split)."""


def cache_dir() -> Path:
    """``$AUTOTUNE_CACHE_DIR/accuracy``, else ``~/.cache/autotune/accuracy`` (autotune.cache)."""
    return cache_root() / "accuracy"


def reference_key(workload: Mapping[str, Any], settings: AccuracySettings, *, device_name: str,
                  torch_version: str) -> str:
    """The name under which the reference of this workload, check and device is kept. What stands
    behind a ``--model`` or ``--data`` value is part of it too (a factory's module file, an image
    folder's class folders), so an edited model or a changed data set trains a new reference."""
    parts = {"format": FORMAT, "workload": dict(workload), "settings": settings.fingerprint(),
             "torch": torch_version, "device": device_name,
             "model_source": source_stamp(workload.get("model")), "data_source": source_stamp(settings.data)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def source_stamp(spec: str | None) -> str | None:
    """What changes with the code or data a ``--model``/``--data`` value names: the hash of a
    ``package.module:factory``'s module file, the modification times of an image folder and its
    class folders (adding or removing an image changes its folder's), torchvision's version for a
    torchvision model name; None for synthetic data or what cannot be found."""
    if not spec:
        return None
    from autotune.workload.data import is_factory

    path = Path(spec).expanduser()
    try:
        if path.is_dir():
            folders = sorted((e.name, e.stat().st_mtime_ns) for e in os.scandir(path) if e.is_dir())
            return hashlib.sha1(json.dumps([path.stat().st_mtime_ns, folders]).encode()).hexdigest()
        if is_factory(spec):
            import importlib.util

            origin = importlib.util.find_spec(spec.partition(":")[0]).origin
            return hashlib.sha1(Path(origin).read_bytes()).hexdigest()
        from importlib.metadata import version

        return f"torchvision {version('torchvision')}"
    except Exception:  # the key then leaves it out; the study itself checks the value
        return None


class ReferenceCache:
    """The FP32 references kept on disk, one JSON file per key."""

    def __init__(self, directory: Path | str | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_dir()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, key: str) -> dict[str, Any] | None:
        """The reference kept under ``key``; None when there is none, or none that can be read."""
        try:
            data = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("reference"), dict):
            return None
        return data["reference"]

    def store(self, key: str, reference: Mapping[str, Any], about: Mapping[str, Any]) -> bool:
        """Keep ``reference`` under ``key`` with ``about`` (what it was trained on, for a reader of the
        folder). Written whole, then renamed, so a search reading it meanwhile never sees half a file.
        False, with a warning, when the folder cannot be written."""
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"key": key, "created": created, "about": dict(about),
                                       "reference": dict(reference)}, indent=1, default=str))
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            warnings.warn(f"the accuracy check's FP32 reference could not be kept in {self.directory} ({exc}); "
                          f"the next search trains it again. Set {CACHE_ENV} to a writable folder", stacklevel=2)
            return False
        return True
