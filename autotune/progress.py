"""What a worker is doing now, for the search's live line ("#5 compiling", "accuracy check of #2:
FP32 reference 40/100 steps"): the worker overwrites one small JSON file (atomically, so a reader
never sees half of it), the parent reads it while it waits (autotune.trial.runner)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

_path: str | None = None
_started = time.time()


def start(path: str | None) -> None:
    """In the worker: where its progress goes (the request's ``progress_path``; None: nowhere)."""
    global _path, _started
    _path, _started = path, time.time()


def say(phase: str, done: int | None = None, total: int | None = None) -> None:
    """In the worker: its current phase, with a count where there is one (steps of a training run)."""
    if _path is None:
        return
    state: dict[str, Any] = {"phase": phase, "at": time.time(), "since": _started}
    if done is not None:
        state.update(done=done, total=total)
    tmp = f"{_path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, _path)
    except OSError:  # progress is a courtesy: never the reason a trial fails
        pass


def read(path: str) -> dict[str, Any] | None:
    """In the parent: the worker's last word, or None before its first."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def words(state: dict[str, Any] | None) -> str:
    """"compiling, 35 s" or "FP32 reference 40/100 steps"."""
    if not state:
        return "starting"
    if state.get("total"):
        return f"{state['phase']} {state['done']}/{state['total']} steps"
    return f"{state['phase']}, {time.time() - state['since']:.0f} s"
