"""Out of memory in a trial: recognising it, capping the GPU's memory (--memory-limit), and finding
the largest batch that still fits after a step ran out (the search's memory model uses it)."""

from __future__ import annotations

import gc
import itertools
from typing import Any

import torch

from autotune.deploy.config import TunedConfig
from autotune.trial.batches import input_batches
from autotune.trial.measure import memory_figures, outside_allocator_bytes


def is_out_of_memory(exc: BaseException) -> bool:
    """OOM in any of its disguises: torch's own error, the CPU allocator, cuDNN/cuBLAS failing to
    allocate, or any of these wrapped in another exception."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        text = str(exc)
        if any(s in text for s in ("out of memory", "can't allocate memory", "CUDNN_STATUS_ALLOC_FAILED",
                                   "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_NOT_SUPPORTED")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def cap_memory(limit_bytes: int) -> None:
    """Cap this process's CUDA memory at ``limit_bytes``, what lives outside the caching allocator
    (the CUDA context, library handles) included: the allocator gets the rest, and a step that
    needs more raises out-of-memory as on a GPU of that size (--memory-limit)."""
    total = torch.cuda.mem_get_info()[1]  # makes the context, which is what lives outside
    outside = outside_allocator_bytes()  # this process's own: other processes' memory is not ours to count
    torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, (limit_bytes - outside) / total)))


def peak_at(step, workload, cfg: TunedConfig, batch: int, seed: int) -> int | None:
    """Peak device bytes of two steps of ``step`` at ``batch`` (at least one optimizer step, and its
    state), from a clean allocator; None when they run out of memory."""
    device = cfg.device
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        stream = iter(cfg.loader(itertools.cycle(input_batches(workload, batch, device, False, seed))))
        for _ in range(cfg.accumulation_steps + 1):
            x, y = next(stream)
            loss = step(x, y)
        float(loss.float().item())  # waits for the GPU
    except Exception as exc:
        if is_out_of_memory(exc):
            return None
        raise
    return memory_figures(device)["peak_memory_bytes"]


def forward_held(step, workload, cfg: TunedConfig, batches: list[int], seed: int) -> dict[str, int]:
    """Bytes a forward and its loss keep for the backward at each of ``batches`` (the activations, the
    logits, the autocast copies of the weights): what they add to what was allocated before. The
    optimizer's state and the gradients are let go first, so that batches whose whole step does not fit
    still run; the slope between two batches is a sample's activations, measured rather than bounded
    (autotune.search.memory.MemoryModel.add_probe). The last thing a memory probe does: its optimizer
    is spent. Empty on a CPU; a batch that runs out of memory ends it."""
    if cfg.device != "cuda":
        return {}
    step.optimizer.state.clear()
    step.optimizer.zero_grad(set_to_none=True)
    held: dict[str, int] = {}
    for batch in batches:
        gc.collect()
        torch.cuda.empty_cache()
        x, y = next(iter(cfg.loader(iter(input_batches(workload, batch, cfg.device, False, seed)))))
        before = torch.cuda.memory_allocated()
        try:
            with cfg.autocast():
                loss = step.forward_loss(x, y)
            held[str(batch)] = max(0, torch.cuda.memory_allocated() - before)
            del loss
        except Exception as exc:
            if is_out_of_memory(exc):
                break
            raise
        finally:
            x = y = None
    return held


def largest_fit(step, workload, cfg: TunedConfig, candidates: list[int], seed: int) -> dict[str, Any]:
    """After a step ran out of memory: the largest of ``candidates`` (smaller batches, ascending)
    at which two steps of the same configuration fit, found by bisection (a fit at b means a fit
    below b), with each fitting batch's peak. The search measures the configuration there next
    (autotune.search.memory); eager steps only, so no recompilation or graph capture is involved."""
    peaks: dict[int, int] = {}
    failed: list[int] = []

    def fits(batch: int) -> bool:
        peak = peak_at(step, workload, cfg, batch, seed)
        if peak is not None:
            peaks[batch] = peak
        return peak is not None

    low, high, best = 0, len(candidates) - 1, None
    while low <= high:
        mid = (low + high) // 2
        if fits(candidates[mid]):
            best, low = candidates[mid], mid + 1
        else:
            failed.append(candidates[mid])
            high = mid - 1
    return {"fits_at": best, "peaks": {str(b): p for b, p in peaks.items()},
            "does_not_fit_at": min(failed) if failed else None}
