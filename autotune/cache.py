"""Where autotune keeps what outlives one search: ``$AUTOTUNE_CACHE_DIR``, else ``~/.cache/autotune``.

Beneath it: ``compile/`` (TorchInductor's cache, its FX-graph, AOTAutograd and Triton parts: a
compile measured once is loaded, not redone, by every later trial and search of the same graph)
``accuracy/`` (the accuracy check's FP32 references, autotune.accuracy.study.reference_cache) and
``searches/`` (each search's measured trials, which start the next search of the same workload:
autotune.search.warm). Everything in it may be deleted at any time: what is missing is measured or
compiled again. trim_cache keeps it under a size (--cache-limit).
"""

from __future__ import annotations

import contextlib
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


DEFAULT_LIMIT_BYTES = 20 * 2**30
"""What the cache may hold on disk unless --cache-limit says otherwise: a ResNet-50's compiles take
tens of megabytes, a search's kept trials kilobytes."""


def cache_size(root: Path | None = None) -> int:
    """Bytes the cache holds on disk."""
    root = root or cache_root()
    return sum(_unit([f])[1] for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0


def trim_cache(limit_bytes: int | None = None) -> dict[str, object]:
    """Delete what was used least recently until the cache holds at most ``limit_bytes``
    (DEFAULT_LIMIT_BYTES): a compile's folder whole (an Inductor or Triton entry), an FP32 reference's
    file; the kept searches (searches/, kilobytes) stay. Returns {"path", "bytes", "limit_bytes",
    "freed_bytes"}. A deleted entry is a cache miss later: compiled or trained again, never wrong."""
    limit = DEFAULT_LIMIT_BYTES if limit_bytes is None else limit_bytes
    root = cache_root()
    entries = _entries(root)
    total = sum(size for _, size, _ in entries) + cache_size(root / "searches")
    freed = 0
    for files, size, _ in sorted(entries, key=lambda e: e[2]):
        if total - freed <= limit:
            break
        for f in files:
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # its folder, where now empty
            files[0].parent.rmdir()
        freed += size
    return {"path": str(root), "bytes": total - freed, "limit_bytes": limit, "freed_bytes": freed}


def _entries(root: Path) -> list[tuple[list[Path], int, float]]:
    """(files, bytes, last used) of what trim_cache may delete at once: the files of each folder under
    compile/ (one cache entry), each file elsewhere but searches/."""
    found = []
    if not root.is_dir():
        return found
    for top in root.iterdir():
        if top.name == "searches":
            continue
        if top.is_file():
            found.append(_unit([top]))
        elif top.name == "compile":
            for folder, _, names in os.walk(top):
                if names:
                    found.append(_unit([Path(folder) / n for n in names]))
        else:
            found.extend(_unit([f]) for f in top.rglob("*") if f.is_file())
    return [e for e in found if e[1] > 0]


def _unit(files: list[Path]) -> tuple[list[Path], int, float]:
    size, used = 0, 0.0
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        size += st.st_size
        used = max(used, st.st_atime, st.st_mtime)
    return files, size, used
