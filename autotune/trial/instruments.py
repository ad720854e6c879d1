"""What a trial process records besides its step time: its GPU's NVML monitor, the graphs TorchDynamo
compiled, and the profiler window; shared by the worker and the DDP ranks."""

from __future__ import annotations

import os
from typing import Any

from autotune.trial.profile import analyze, record


def nvml_monitor(device: str, request: dict[str, Any], cuda_index: int = 0):
    """An NVML monitor of this process's CUDA device ``cuda_index`` (a DDP rank's: its local rank),
    or None (CPU, or asked not to sample). NVML ignores CUDA_VISIBLE_DEVICES, so the device is
    found by its PCI bus id (autotune.trial.gpus.nvml_index)."""
    if device != "cuda" or not request.get("nvml", True):
        return None
    from autotune.trial.gpus import nvml_index
    from autotune.trial.nvml import NvmlMonitor

    return NvmlMonitor(device_index=nvml_index(cuda_index), interval_s=0.05)


def compiled_graphs() -> int:
    """Graphs TorchDynamo compiled in this process so far. A compiled trial with none ran eagerly
    (its frames skipped, or reusing code compiled for an identical model): its compile_s is then
    no compile time, and its speed is eager speed."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_cache() -> dict[str, int]:
    """What this process's compiles found in TorchInductor's cache (autotune.cache): FX graphs and
    AOTAutograd graphs loaded (hits) or compiled and saved (misses)."""
    from torch._dynamo.utils import counters

    return {"fx_graph_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "fx_graph_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
            "aot_autograd_hits": int(counters["aot_autograd"]["autograd_cache_hit"]),
            "aot_autograd_misses": int(counters["aot_autograd"]["autograd_cache_miss"])}


def cache_outcome(counts: dict[str, int] | None) -> str | None:
    """"hit" (every graph loaded from the cache), "miss" (every one compiled), "partial", or None
    when nothing went through the cache (an eager trial)."""
    if not counts:
        return None
    hits = counts.get("fx_graph_hits", 0) + counts.get("aot_autograd_hits", 0)
    misses = counts.get("fx_graph_misses", 0) + counts.get("aot_autograd_misses", 0)
    if not hits and not misses:
        return None
    return "hit" if not misses else "miss" if not hits else "partial"


def profile_window(one_step, request: dict[str, Any], batch_size: int, step_time_ms: float, *,
                   model: Any = None, multiple: int = 8) -> dict[str, Any]:
    """Profile a few more steps of ``one_step`` (torch.profiler) and analyze them against the step time
    measured without the profiler; the Chrome trace is kept, gzipped, where the request asks. The
    GEMMs and convolutions of ``model``'s layers whose widths are not multiples of ``multiple`` (what
    the trial's precision needs for Tensor Cores) are named with their share of the step."""
    trace_path = request.get("trace_path")
    trace = record(one_step, int(request.get("profile_steps", 3)), device="cuda", chrome_trace=trace_path,
                   meta={"batch": batch_size, "step_time_ms": step_time_ms}, model=model)
    if trace_path:
        _gzip_in_place(trace_path)
    return analyze(trace, step_time_ms=step_time_ms, multiple=multiple)


def _gzip_in_place(path: str) -> None:
    import gzip
    import shutil

    with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=5) as dst:
        shutil.copyfileobj(src, dst)
    os.unlink(path)
