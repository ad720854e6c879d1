"""Where autotune keeps what outlives one search: ``$AUTOTUNE_CACHE_DIR``, else ``~/.cache/autotune``.

Beneath it: ``compile/`` (TorchInductor's cache, its FX-graph, AOTAutograd and Triton parts: a
compile measured once is loaded, not redone, by every later trial and search of the same graph)
and ``accuracy/`` (the accuracy check's FP32 references, autotune.accuracy.reference_cache).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CACHE_ENV = "AUTOTUNE_CACHE_DIR"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "autotune"


def compile_cache_dir() -> Path:
    """TorchInductor's cache for trial workers (unless the user set TORCHINDUCTOR_CACHE_DIR):
    persistent, where torch's default (/tmp/torchinductor_<user>) goes with a reboot or a new
    container."""
    return cache_root() / "compile"


def users_inductor_cache() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR as the user set it, else None. Torch's own cache_dir() writes its
    default (/tmp/torchinductor_<user>) into os.environ of a process that had none, and importing
    torch._dynamo calls it: torchvision's models import it, so a search of a torchvision model had it
    set in its own process before its first trial, and every trial compiled into /tmp instead of
    compile_cache_dir() (a search_yield run "with empty caches" would load the compiles of the search
    before it). That default is no user's choice; set to it explicitly, it counts as unset."""
    value = os.environ.get(INDUCTOR_ENV)
    torch_cache = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if not value or torch_cache is None:  # torch has not written it: the user's, or none
        return value or None
    return None if os.path.abspath(value) == os.path.abspath(torch_cache.default_cache_dir()) else value
