"""Several GPUs of one machine: ``--gpus 0,1`` or ``--gpus all``.

One search process runs ``study.optimize(n_jobs=len(gpus))``: Optuna's own parallel loop, one
thread per GPU, each trial of a thread measured in a worker process pinned to that thread's GPU
with ``CUDA_VISIBLE_DEVICES`` (autotune.trial.runner reads :func:`current_pin`). The study, its lock,
its output folder and its export stay one; the default SQLite storage is then written by several
threads of one process, which its retries absorb.

All GPUs of one search must be the same model: a study holds the measurements of one GPU model
(see autotune.search.distributed), so a mixed machine runs one search per model, each with its own
``--gpus`` and ``--study-name``; the refusal says which.

NVML numbers GPUs in PCI bus order and ignores ``CUDA_VISIBLE_DEVICES``; :func:`nvml_index`
finds the NVML device of a CUDA device by its PCI bus id.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from autotune.errors import ConfigError

_local = threading.local()
_default_pin: str | None = None


def current_pin() -> str | None:
    """The CUDA_VISIBLE_DEVICES value for a worker started by this thread: the GPU its trial was
    given, else the search's first GPU, else None (the worker inherits the environment)."""
    return getattr(_local, "pin", None) or _default_pin


@contextlib.contextmanager
def pinned(pin: str | None) -> Iterator[None]:
    """Workers started by this thread inside the block see only the GPU ``pin``."""
    before = getattr(_local, "pin", None)
    _local.pin = pin
    try:
        yield
    finally:
        _local.pin = before


def parse_gpus(text: str | None) -> list[int] | str | None:
    """'0,1' -> [0, 1]; 'all' -> 'all'; None -> None."""
    if text is None:
        return None
    if text.strip().lower() == "all":
        return "all"
    try:
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--gpus {text!r}: give CUDA device indices such as 0,1 (as nvidia-smi numbers them "
                          "when CUDA_VISIBLE_DEVICES is unset), or all") from None
    if not indices or any(i < 0 for i in indices):
        raise ConfigError(f"--gpus {text!r}: give CUDA device indices such as 0,1, or all")
    if len(set(indices)) != len(indices):
        raise ConfigError(f"--gpus {text!r} names a GPU twice; one trial worker runs per GPU")
    return indices


@dataclass(frozen=True)
class Gpu:
    index: int
    """CUDA index as this process sees it (after the user's CUDA_VISIBLE_DEVICES)."""
    name: str
    pin: str
    """The CUDA_VISIBLE_DEVICES value that shows a worker this GPU, and only it."""


_LIST_SCRIPT = ("import json, torch; print(json.dumps([torch.cuda.get_device_properties(i).name "
                "for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []))")


def cuda_device_names() -> list[str]:
    """The names of the CUDA devices this process would see, asked of a short subprocess so that
    the search process itself never creates a CUDA context."""
    proc = subprocess.run([sys.executable, "-c", _LIST_SCRIPT], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise ConfigError(f"--gpus: listing the CUDA devices failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def resolve(requested: list[int] | str, names: list[str] | dict[int, str], visible: str | None) -> list[Gpu]:
    """The GPUs of ``--gpus``, each with the CUDA_VISIBLE_DEVICES value that pins a worker to it.

    ``names``: the CUDA devices this process sees (a list), or the name of each requested index;
    ``visible``: this process's own CUDA_VISIBLE_DEVICES (an index of ``--gpus`` counts within it,
    as CUDA counts).
    """
    if isinstance(names, list):
        names = dict(enumerate(names))
    if not names:
        raise ConfigError("--gpus: PyTorch sees no CUDA GPU here; drop --gpus, or use --device cpu without it")
    indices = sorted(names) if requested == "all" else list(requested)
    missing = [i for i in indices if i not in names]
    if missing:
        raise ConfigError(f"--gpus: no CUDA device {', '.join(map(str, missing))}; this machine shows "
                          f"{len(names)} ({', '.join(f'{i}: {n}' for i, n in sorted(names.items()))})")
    parents = [p.strip() for p in visible.split(",")] if visible else None
    gpus = [Gpu(index=i, name=names[i], pin=parents[i] if parents else str(i)) for i in indices]
    models = sorted({g.name for g in gpus})
    if len(models) > 1:
        per_model = "; ".join(
            f"--gpus {','.join(str(g.index) for g in gpus if g.name == m)} --study-name MODEL-{_slug(m)}"
            for m in models)
        raise ConfigError(f"--gpus mixes GPU models ({', '.join(models)}): a study holds the measurements of "
                          f"one model. Run one search per model, each with its own --out: {per_model}")
    return gpus


def _slug(name: str) -> str:
    import re

    name = name.lower().replace("nvidia", "").replace("geforce", "")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


class GpuPool:
    """The search's GPUs, handed to trials: each trial takes a free GPU for its thread and gives
    it back when it ends, so ``n_jobs=len(pool)`` threads never share one."""

    def __init__(self, gpus: list[Gpu]) -> None:
        self.gpus = gpus
        self._free: queue.SimpleQueue[str] = queue.SimpleQueue()
        for gpu in gpus:
            self._free.put(gpu.pin)

    def __len__(self) -> int:
        return len(self.gpus)

    @staticmethod
    def check_device(requested: list[int] | str | None, device: str) -> None:
        """``--gpus`` is refused on a CPU, before any device time."""
        if requested is not None and device != "cuda":
            raise ConfigError("--gpus runs one trial worker per CUDA GPU, but this search runs on the CPU; "
                              "drop --gpus, or search on a GPU machine with --device cuda")

    @classmethod
    def for_search(cls, requested: list[int] | str | None, device: str,
                   probed: list[str] | None = None) -> "GpuPool | None":
        """The pool for ``--gpus`` (None without it); refused on a CPU or a mix of GPU models.

        ``probed``: the CUDA devices the search's probe saw through :func:`probe_view`, the
        requested GPUs in the order given. When it names them all, no process of its own lists
        the machine's GPUs (a CUDA context: seconds of every search); else, to say which are
        missing, one does."""
        GpuPool.check_device(requested, device)
        if requested is None:
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names: list[str] | dict[int, str]
        if probed and requested == "all":
            names = probed
        elif probed and len(probed) == len(requested):  # requested is a list here
            names = dict(zip(requested, probed))
        else:
            names = cuda_device_names()
        return cls(resolve(requested, names, visible))

    def activate(self) -> None:
        """Workers started outside a trial (the probe, the final accuracy checks) use the first GPU."""
        global _default_pin
        _default_pin = self.gpus[0].pin

    @staticmethod
    def deactivate() -> None:
        global _default_pin
        _default_pin = None

    def wrap(self, objective: Callable[[Any], float]) -> Callable[[Any], float]:
        """``objective`` run with a GPU of its own for the trial's duration."""

        def on_a_free_gpu(trial: Any) -> float:
            pin = self._free.get()
            try:
                with pinned(pin):
                    return objective(trial)
            finally:
                self._free.put(pin)

        return on_a_free_gpu


def probe_view(requested: list[int] | str | None, visible: str | None) -> str | None:
    """The CUDA_VISIBLE_DEVICES under which the search's probe sees the requested GPUs, in the
    order given: its CUDA device 0 is the GPU of the probe (the first one given) and its device
    list names each requested GPU. None: the probe sees what the search sees (no --gpus, or
    --gpus all, or an index beyond the user's own CUDA_VISIBLE_DEVICES, which resolve refuses)."""
    if requested is None or requested == "all":
        return visible if requested == "all" else None
    parents = [p.strip() for p in visible.split(",")] if visible else None
    if parents is not None and any(i >= len(parents) for i in requested):
        return None
    return ",".join(parents[i] if parents else str(i) for i in requested)


def _pci_bus_id(props: Any) -> str:
    """NVML's form of a CUDA device's PCI address: domain:bus:device.function, in hex."""
    return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def own_device_bytes(cuda_index: int = 0) -> int | None:
    """Device memory this process holds on CUDA device ``cuda_index`` as NVML lists it per process: the CUDA
    context, library handles and the caching allocator's pool together, and nothing of other processes on
    the GPU. The driver's free-memory figure counts those too: every trial's peak would take in the next
    trial's prestarted worker, and a --memory-limit cap tighten by it. None where NVML cannot tell (no NVML,
    or a driver or container that does not list this process): the caller then falls back to the device's
    whole use."""
    try:
        with _nvml_handle(cuda_index) as (pynvml, handle):
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == os.getpid() and process.usedGpuMemory is not None:
                    return int(process.usedGpuMemory)
    except Exception:  # no NVML, no such field in this torch: the device's whole use instead
        return None
    return None


@contextlib.contextmanager
def _nvml_handle(cuda_index: int) -> Iterator[tuple[Any, Any]]:
    """(pynvml, NVML's handle of CUDA device ``cuda_index``), found by its PCI bus id, with NVML
    initialised for the block; raises where NVML or torch's PCI fields cannot tell."""
    import pynvml
    import torch

    props = torch.cuda.get_device_properties(cuda_index)
    pynvml.nvmlInit()
    try:
        yield pynvml, pynvml.nvmlDeviceGetHandleByPciBusId(_pci_bus_id(props))
    finally:
        pynvml.nvmlShutdown()


def nvml_index(cuda_index: int = 0) -> int:
    """The NVML index of CUDA device ``cuda_index`` of this process.

    NVML ignores CUDA_VISIBLE_DEVICES and numbers GPUs in PCI bus order, while CUDA numbers the
    visible ones, fastest first: the two agree only when every GPU is visible and alike. The
    device is found by its PCI bus id; without NVML or torch's PCI fields, the first entry of
    CUDA_VISIBLE_DEVICES when it is a plain index, else ``cuda_index``.
    """
    try:
        with _nvml_handle(cuda_index) as (pynvml, handle):
            return int(pynvml.nvmlDeviceGetIndex(handle))
    except Exception:  # no NVML, no such field in this torch: fall back to the environment
        pass
    visible = [p.strip() for p in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if len(visible) > cuda_index and visible[cuda_index].isdigit():
        return int(visible[cuda_index])
    return cuda_index
