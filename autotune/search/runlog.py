"""The search's own log, logs/search.log in its output folder: Optuna's per-trial messages
("Trial 3 failed with parameters ... Traceback ...") and autotune's log records go there in full,
so the terminal shows one line per trial and the log keeps every detail."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import optuna

RUN_LOG = "search.log"
"""Its name in the output folder's logs/."""


@contextlib.contextmanager
def run_log(log_dir: Path) -> Iterator[Path]:
    """While the search runs: Optuna logs at INFO to ``log_dir``/search.log and not to the
    terminal; autotune's warnings go to both. Optuna's terminal handler is back afterwards."""
    path = log_dir / RUN_LOG
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    optuna_logger = logging.getLogger("optuna")
    ours = logging.getLogger("autotune")
    previous_verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.INFO)
    optuna.logging.disable_default_handler()
    optuna_logger.addHandler(handler)
    ours.addHandler(handler)
    terminal = None
    if not logging.getLogger().handlers:  # no logging set up by a caller: warnings still show
        terminal = logging.StreamHandler()
        terminal.setLevel(logging.WARNING)
        ours.addHandler(terminal)
    try:
        yield path
    finally:
        optuna_logger.removeHandler(handler)
        ours.removeHandler(handler)
        if terminal is not None:
            ours.removeHandler(terminal)
        handler.close()
        optuna.logging.enable_default_handler()
        optuna.logging.set_verbosity(previous_verbosity)
