"""The reference a check worker trained, written for the study as soon as it is trained: within a
search, the worker that trains a reference writes it to a file of the study's (reference_writer),
which the gate reads (read_reference) where that worker then fails. Across searches the study keeps
references itself (autotune.accuracy.study.reference_cache)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping


def reference_writer(path: str | None, on_written: Callable[[str], None] | None = None):
    """Where a worker that trains the reference before the configuration's run writes it (JSON, whole
    or not at all) as soon as it is trained: a configuration's run that runs out of memory, fails or
    is cut by the budget then costs its own verdict, not the reference (read_reference). None
    without a ``path``; ``on_written`` is told the path once it is written."""
    if not path:
        return None

    def write(reference: Mapping[str, Any]) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(reference, f)
        os.replace(tmp, path)
        if on_written is not None:
            on_written(path)

    return write


def read_reference(path) -> dict[str, Any] | None:
    """The reference a worker wrote (reference_writer), or None where it wrote none."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
