"""A compiled configuration's compile, carried beside its config.json: ``compile-cache.zip``.

A trial that compiles saves what its compile produced (``save``); the search keeps the
recommendation's archive beside config.json, and ``cfg.prepare`` / ``cfg.train_step`` (or, in a
script of your own, ``autotune.load_compile_cache(path)``) load it before the first compiled step,
which then loads its graphs and kernels instead of compiling them.

The archive holds, with ``meta.json`` saying what it is valid for (torch, Triton, the device):

- PyTorch's Mega-Cache (``torch.compiler.save_cache_artifacts()``): the FX-graph (Inductor) and
  AOTAutograd entries, the autotuning results and, on a GPU, the Triton kernels, which Inductor
  bundles into its FX-graph entries (``torch._inductor.config.bundle_triton_into_fx_graph_cache``).
- The shared libraries this process loaded from Inductor's cache folder: a CPU's compiled C++
  kernels, which the Mega-Cache does not carry (a graph loaded from it still runs g++ on every
  kernel), and on a GPU any launcher Inductor or Triton built there. Each keeps its path inside the
  cache folder, which its source's hash names: a library is found where its source would build it.

A stale or foreign archive is never an error: ``load`` says in one line why it was not used (another
torch or GPU, a missing or corrupt file) and the step compiles as it would without it. Torch checks
its own entries too (a key holds torch's and the graph's hashes), so a library or entry that does not
match is a cache miss, never a wrong kernel.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch

ARCHIVE = "compile-cache.zip"
"""Its name beside config.json."""
FORMAT = 1
META = "meta.json"
MEGA_CACHE = "mega_cache.bin"
LIBRARIES = "libraries/"

_outcomes: dict[str, str | None] = {}  # archive path -> None (loaded) or why not: once per process


def valid_for(device: str) -> dict[str, Any]:
    """What a compile made in this process is valid for: torch's and Triton's versions (None without
    Triton) and the device ("cpu", the GPU's name, or None for "cuda" in a process without a GPU), as
    PyTorch's Mega-Cache requires of its artifacts; on a CPU also its vector instructions (ATen's
    capability, "AVX2" say), which Inductor's C++ kernels are written for and its graph keys omit."""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    if device == "cpu":
        return {"torch": torch.__version__, "triton": triton, "device": "cpu",
                "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    gpu = torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "triton": triton, "device": gpu}


def inductor_cache_dir() -> Path:
    """Where this process's Inductor reads and writes its cache (TORCHINDUCTOR_CACHE_DIR, else
    torch's default under /tmp)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def compiled_libraries(root: Path | None = None) -> dict[str, Path]:
    """The shared libraries this process loaded from Inductor's cache folder ``root``, by their
    path inside it: those the dynamic loader mapped (/proc/self/maps, on Linux) and the extension
    modules imported from there (elsewhere)."""
    root = (root or inductor_cache_dir()).resolve()
    paths = set()
    try:
        with open("/proc/self/maps") as maps:  # address, permissions, offset, device, inode, path
            paths.update(fields[5].strip() for fields in (line.split(maxsplit=5) for line in maps)
                         if len(fields) == 6 and fields[5].strip().endswith(".so"))
    except OSError:
        pass
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.endswith(".so"):
            paths.add(file)
    # the vector-ISA probe's libraries: Inductor builds one per ISA and dlopens it in a subprocess
    # (so it is not mapped here), and marks it loadable; without them a first compile builds them again
    paths.update(str(marker)[: -len(".load_ok")] for marker in root.glob("*/*.so.load_ok"))
    paths.update(str(marker) for marker in root.glob("*/*.so.load_ok"))
    found = {}
    for name in paths:
        path = Path(name).resolve()
        if path.is_relative_to(root) and path.is_file():
            found[path.relative_to(root).as_posix()] = path
    return dict(sorted(found.items()))


def save(path: str | Path, device: str) -> dict[str, Any] | None:
    """Write this process's compile artifacts (call after its compiled steps) to the archive
    ``path``, atomically; returns its ``meta.json`` with its size in ``bytes``, or None where this
    process compiled nothing that torch records."""
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        return None
    blob, info = artifacts
    libraries = compiled_libraries()
    meta = {"format": FORMAT, **valid_for(device),
            "entries": {kind: len(keys) for kind, keys in sorted(info.artifacts.items())},
            "bypassed": bypassed(), "mega_cache_bytes": len(blob), "libraries": len(libraries),
            "libraries_bytes": sum(p.stat().st_size for p in libraries.values())}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
        archive.writestr(META, json.dumps(meta, indent=2))
        archive.writestr(MEGA_CACHE, blob)
        for name, source in libraries.items():
            archive.write(source, LIBRARIES + name)
    os.replace(tmp, path)
    return {**meta, "bytes": path.stat().st_size}


def bypassed() -> dict[str, int]:
    """How many graphs this process compiled that Inductor's FX-graph cache or AOTAutograd's cache left
    out (a cache "bypass": a graph holding something neither can serialize), by cache; an archive
    carries none of those, and the first step compiles them again wherever it is loaded."""
    from torch._dynamo.utils import counters

    found = {"inductor": counters["inductor"]["fxgraph_cache_bypass"],
             "aot_autograd": counters["aot_autograd"]["autograd_cache_bypass"]}
    return {kind: int(n) for kind, n in found.items() if n}


def graphs(meta: dict[str, Any]) -> int:
    """How many compiled graphs an archive's ``meta.json`` says it carries (its FX-graph entries)."""
    return int((meta.get("entries") or {}).get("inductor", 0))


def describe(path: str | Path) -> dict[str, Any] | None:
    """The archive's ``meta.json`` with its file name and size (what config.json records), or None
    where there is no readable archive at ``path``."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            meta = json.loads(archive.read(META))
    except (OSError, zipfile.BadZipFile, KeyError, ValueError):
        return None
    return {"file": path.name, "bytes": path.stat().st_size, **meta}


def mismatch(meta: dict[str, Any], device: str) -> str | None:
    """Why an archive made where ``meta`` says cannot serve this process, or None where it can.
    Triton's version counts only for a GPU's archive (a CPU compile has no Triton kernel), the
    CPU's vector instructions only for a CPU's."""
    if meta.get("format") != FORMAT:
        return f"its format {meta.get('format')!r} is not this autotune's ({FORMAT})"
    here = valid_for(device)
    if meta.get("torch") != here["torch"]:
        return f"it was compiled with torch {meta.get('torch')}, this is torch {here['torch']}"
    if meta.get("device") != here["device"]:
        return f"it was compiled for {meta.get('device')}, this process runs on {here['device'] or 'no GPU'}"
    if here["device"] == "cpu" and meta.get("cpu_capability") != here["cpu_capability"]:
        return f"it was compiled for a CPU with {meta.get('cpu_capability')}, this one runs {here['cpu_capability']}"
    if here["device"] != "cpu" and meta.get("triton") != here["triton"]:
        return f"it was compiled with Triton {meta.get('triton')}, this is Triton {here['triton']}"
    return None


def load(path: str | Path, device: str | None = None) -> str | None:
    """Put the archive's artifacts in place for this process's compiles: its Mega-Cache into torch's
    caches and its libraries into Inductor's cache folder (where missing). Returns None when
    loaded, else why not, in one line. ``device``: where this process trains ("cuda" or "cpu";
    by default the archive's own)."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            meta = json.loads(archive.read(META))
            reason = mismatch(meta, device or ("cpu" if meta.get("device") == "cpu" else "cuda"))
            if reason is not None:
                return reason
            blob = archive.read(MEGA_CACHE)
            libraries = {name[len(LIBRARIES):]: archive.read(name) for name in archive.namelist()
                         if name.startswith(LIBRARIES) and not name.endswith("/")}
    except FileNotFoundError:
        return "the file is missing"
    except (OSError, zipfile.BadZipFile, KeyError, ValueError) as exc:
        return f"it is not a readable compile-cache archive ({type(exc).__name__}: {str(exc)[:120]})"
    root = inductor_cache_dir().resolve()
    targets = {(root / name).resolve(): content for name, content in libraries.items()}
    if any(not target.is_relative_to(root) for target in targets):  # a forged archive's paths
        return "it names a library outside Inductor's cache folder"
    try:
        with _quiet_torch_cache_log():
            loaded = torch.compiler.load_cache_artifacts(blob)
    except Exception as exc:  # torch's own reading of a blob it does not recognise
        return f"torch could not load its Mega-Cache ({type(exc).__name__}: {str(exc)[:120]})"
    if loaded is None:
        return "torch could not read its Mega-Cache (a corrupt or foreign blob)"
    for target, content in targets.items():
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            tmp.write_bytes(content)
            tmp.chmod(0o755)
            os.replace(tmp, target)  # another process loading the same archive finds a whole file or none
    return None


def load_once(path: str | Path, device: str | None = None, *, stacklevel: int = 2) -> bool:
    """``load`` once per process and archive; where it cannot, one warning says why (the first
    compiled step then compiles as it would without it). Returns whether it loaded."""
    key = str(Path(path).resolve())
    if key not in _outcomes:
        _outcomes[key] = load(path, device)
        if _outcomes[key] is not None:
            warnings.warn(f"{path} not loaded: {_outcomes[key]}; the first compiled step compiles from scratch",
                          stacklevel=stacklevel + 1)
    return _outcomes[key] is None


@contextlib.contextmanager
def _quiet_torch_cache_log() -> Iterator[None]:
    """torch logs a traceback at WARNING when a Mega-Cache does not deserialize; ``load`` says it in
    one line instead."""
    logger = logging.getLogger("torch.compiler._cache")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_compile_cache(path: str | Path) -> bool:
    """For a training script that compiles by itself (Hugging Face's Trainer, accelerate): load the
    compile cache a search saved (``compile-cache.zip``, or the search's output folder) before the
    first compiled step. Where it cannot, one warning says why and the step compiles as without it.

        autotune.load_compile_cache("runs/resnet50-h100/compile-cache.zip")
    """
    path = Path(path)
    return load_once(path / ARCHIVE if path.is_dir() else path, stacklevel=2)
