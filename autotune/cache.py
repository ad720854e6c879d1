"""Where autotune keeps what outlives one search: ``$AUTOTUNE_CACHE_DIR``, else ``~/.cache/autotune``.

Beneath it: ``compile/`` (TorchInductor's cache, its FX-graph, AOTAutograd and Triton parts: a
compile measured once is loaded, not redone, by every later trial and search of the same graph)
and ``accuracy/`` (the accuracy check's FP32 references, autotune.accuracy.reference_cache).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "AUTOTUNE_CACHE_DIR"


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "autotune"


def compile_cache_dir() -> Path:
    """TorchInductor's cache for trial workers (unless the user set TORCHINDUCTOR_CACHE_DIR):
    persistent, where torch's default (/tmp/torchinductor_<user>) goes with a reboot or a new
    container."""
    return cache_root() / "compile"
