"""Warm up until steady, then time many steps and take the median (timm's benchmark, with a
stability check). On CUDA each step is bracketed by CUDA events, so the host never waits inside
the timed window; on the CPU, by the wall clock."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch


@dataclass(kw_only=True)
class MeasureSettings:
    """How long to warm up and measure. Defaults depend on the device (see ``for_device``)."""

    min_warmup_steps: int = 5
    """Steps run before any window is timed (cudnn.benchmark tunes in the first ones)."""
    max_warmup_s: float = 60.0
    """Give up waiting for steadiness after this long and measure anyway (recorded)."""
    steady_tolerance: float = 0.03
    """Two consecutive warm-up windows within this relative difference count as steady."""
    min_steps: int = 20
    """At least this many timed steps."""
    min_time_s: float = 2.0
    """And at least this much timed time."""
    max_steps: int = 500
    spread_tolerance: float = 0.05
    """(p90 - p10) / median above this is noisy: measure again."""
    max_remeasure: int = 2
    """How many times a noisy measurement is repeated (the least noisy one is kept)."""

    def __post_init__(self) -> None:
        for name in ("min_warmup_steps", "min_steps", "max_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"MeasureSettings.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps < self.min_steps:
            raise ValueError(f"MeasureSettings.max_steps ({self.max_steps}) is below min_steps ({self.min_steps})")
        for name in ("max_warmup_s", "min_time_s", "steady_tolerance", "spread_tolerance"):
            if getattr(self, name) < 0:
                raise ValueError(f"MeasureSettings.{name} must not be negative")
        if self.max_remeasure < 0:
            raise ValueError("MeasureSettings.max_remeasure must not be negative")

    @classmethod
    def for_device(cls, device: str) -> "MeasureSettings":
        if device == "cpu":
            return cls(min_warmup_steps=1, max_warmup_s=30.0, steady_tolerance=0.10, min_steps=3,
                       min_time_s=2.0, max_steps=100, spread_tolerance=0.15, max_remeasure=1)
        return cls()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class Measurement:
    step_time_ms: float
    """Median step time."""
    step_time_p10_ms: float
    step_time_p90_ms: float
    spread: float
    """(p90 - p10) / median of the kept window."""
    num_steps: int
    num_warmup_steps: int
    steady: bool
    """False when warm-up hit max_warmup_s before two windows agreed."""
    noisy: bool
    """True when even the kept window's spread is above spread_tolerance."""
    num_remeasured: int
    warmup_s: float
    measure_s: float
    compile_s: float = 0.0
    """Wall time of the setup steps before warm-up: compiling and/or capturing a CUDA graph (0 when
    the step needs no setup). Kept apart from warm-up and step time: it is paid once per run."""
    num_setup_steps: int = 0
    num_timed_steps_total: int = 0
    """Steps run inside the timed window, re-measurements included (what its energy was spent on)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TooSlow(Exception):
    """Raised by ``measure`` when two consecutive warm-up windows are both clearly slower than the
    best configuration so far (``give_up``): the trial is stopped, a screening result."""

    def __init__(self, windows_ms: list[float], elapsed_s: float) -> None:
        super().__init__(f"stopped after {len(windows_ms)} warm-up windows ({elapsed_s:.1f} s)")
        self.windows_ms = windows_ms
        """The median step time of each warm-up window, in order (the trial's intermediate values)."""
        self.elapsed_s = elapsed_s


class Timer:
    """Per-step durations in milliseconds, with CUDA events or the host clock."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def run(self, step: Callable[[], Any], num_steps: int) -> list[float]:
        if self.cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(num_steps + 1)]
            events[0].record()
            for i in range(num_steps):
                step()
                events[i + 1].record()
            events[-1].synchronize()
            return [events[i].elapsed_time(events[i + 1]) for i in range(num_steps)]
        times = []
        last = time.perf_counter()
        for _ in range(num_steps):
            step()
            now = time.perf_counter()
            times.append((now - last) * 1e3)
            last = now
        return times


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def measure(step: Callable[[], Any], device: str, settings: MeasureSettings, *,
            setup_steps: int = 0,
            timed_window: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
            give_up: Callable[[float], bool] | None = None) -> Measurement:
    """Run ``setup_steps`` steps that compile or capture (timed apart, as ``compile_s``), warm up
    until two consecutive windows agree, then time enough steps for a stable median.

    ``timed_window()`` is entered around the timed steps only (every attempt, warm-up excluded):
    the NVML sampling window, so energy and power are those of the steps whose time is reported.
    ``give_up(step_ms)`` judges each warm-up window: two windows in a row it calls too slow raise
    ``TooSlow`` (a configuration clearly below the best so far is not measured in full; a warm-up
    only gets faster, so two slow windows are not a cold start's first one)."""
    if setup_steps < 0:
        raise ValueError(f"setup_steps must not be negative, got {setup_steps}")
    timer = Timer(device)
    compile_s = 0.0
    if setup_steps:
        start = time.perf_counter()
        for _ in range(setup_steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
    step_ms, num_warmup, steady, warmup_s = _warm_up(step, timer, settings, give_up)

    num_steps = max(settings.min_steps, math.ceil(settings.min_time_s * 1e3 / max(step_ms, 1e-3)))
    num_steps = min(num_steps, settings.max_steps)
    start = time.perf_counter()
    best: list[float] | None = None
    best_spread = math.inf
    num_remeasured = 0
    timed_ctx = timed_window() if timed_window is not None else contextlib.nullcontext()
    timed_total = 0
    with timed_ctx:
        for attempt in range(settings.max_remeasure + 1):
            times = timer.run(step, num_steps)
            timed_total += num_steps
            med = statistics.median(times)
            spread = (quantile(times, 0.9) - quantile(times, 0.1)) / med
            if spread < best_spread:
                best, best_spread = times, spread
            if spread <= settings.spread_tolerance:
                break
            num_remeasured = attempt + 1 if attempt < settings.max_remeasure else num_remeasured
    measure_s = time.perf_counter() - start
    assert best is not None
    med = statistics.median(best)
    return Measurement(
        step_time_ms=med,
        step_time_p10_ms=quantile(best, 0.1),
        step_time_p90_ms=quantile(best, 0.9),
        spread=best_spread,
        num_steps=len(best),
        num_warmup_steps=num_warmup,
        steady=steady,
        noisy=best_spread > settings.spread_tolerance,
        num_remeasured=num_remeasured,
        warmup_s=warmup_s,
        measure_s=measure_s,
        compile_s=compile_s,
        num_setup_steps=setup_steps,
        num_timed_steps_total=timed_total,
    )


LONG_STEP_MS = 1000.0
"""A warm-up step this long is a window of its own (see _warm_up)."""


def _warm_up(step: Callable[[], Any], timer: Timer, settings: MeasureSettings,
             give_up: Callable[[float], bool] | None) -> tuple[float, int, bool, float]:
    """Warm up until two consecutive windows agree (or max_warmup_s); returns the last window's
    median step time, the steps run, whether it became steady and the seconds it took. Raises
    TooSlow when ``give_up`` calls two windows in a row too slow."""
    start = time.perf_counter()
    warm = timer.run(step, settings.min_warmup_steps)
    num_warmup = settings.min_warmup_steps
    step_ms = statistics.median(warm[-max(1, len(warm) // 2):])
    # windows of about half a second (at least 2 steps) until the median stops moving; a step of a
    # second or more is a window of its own (ResNet-50 on 2 CPU cores: 1.6-10 s a step, and 2-step
    # windows took 35 s to warm up its baseline and 44 s to stop a clearly slower trial)
    previous, steady = None, False
    windows_ms: list[float] = []
    while True:
        if step_ms >= LONG_STEP_MS:
            window = 1
        else:
            window = max(2, min(50, int(500 / max(step_ms, 1e-3))))
            window += window % 2  # even, so a step time that alternates has a stable median
        times = timer.run(step, window)
        num_warmup += window
        step_ms = statistics.median(times)
        windows_ms.append(step_ms)
        if give_up is not None and len(windows_ms) >= 2 and all(give_up(ms) for ms in windows_ms[-2:]):
            raise TooSlow(windows_ms, time.perf_counter() - start)
        if previous is not None and abs(step_ms - previous) / previous <= settings.steady_tolerance:
            steady = True
            break
        previous = step_ms
        if time.perf_counter() - start > settings.max_warmup_s:
            break
    warmup_s = time.perf_counter() - start
    return step_ms, num_warmup, steady, warmup_s


def outside_allocator_bytes() -> int:
    """What this process holds on its CUDA device outside the caching allocator (the context,
    library handles): its own use (autotune.trial.gpus.own_device_bytes, else the device's whole
    use) less the allocator's reserved pool."""
    from autotune.trial.gpus import own_device_bytes

    used = own_device_bytes(torch.cuda.current_device())
    if used is None:
        free, total = torch.cuda.mem_get_info()
        used = total - free
    return max(0, used - torch.cuda.memory_reserved())


def memory_figures(device: str) -> dict[str, int]:
    """Peak memory as the device really needed it.

    CUDA: the caching allocator's peak reserved bytes (cuDNN workspaces and CUDA-graph pools are
    allocated through it) plus what lives outside it (CUDA context, cuBLAS/cuDNN handles): this
    process's own use as NVML lists it, less the allocator's pool (the driver's free-memory figure
    where NVML cannot tell, which also counts other processes). CPU: the worker process's peak
    resident set.
    """
    if device == "cuda":
        total = torch.cuda.mem_get_info()[1]
        outside = outside_allocator_bytes()
        return {
            "peak_memory_bytes": torch.cuda.max_memory_reserved() + outside,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "outside_allocator_bytes": outside,
            "device_total_bytes": total,
        }
    import resource

    return {"peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# when a DataLoader-fed step counts as data-bound (its findings: autotune.search.findings)
DATA_BOUND_RATIO = 0.90
"""Loader-fed throughput below this share of the same step fed from memory is data-bound ..."""
DATA_WAIT_SHARE = 0.10
"""... when the step waited for its batches at least this share of the time (a dataset that only
indexes memory, fed in-process at 16 samples a step, waits 3.4-3.9% on 2 CPU cores), or ..."""
DATA_BOUND_CLEAR_RATIO = 0.75
"""... when the loss is this large even without waits (the loader's workers taking the CPU the
step needs). A smaller loss without waits is within the noise of two separate windows."""


def is_data_bound(loader_fed: float, compute_only: float, wait_share: float) -> bool:
    """Whether a DataLoader-fed step is held back by its data pipeline (see the thresholds above)."""
    if loader_fed >= DATA_BOUND_RATIO * compute_only:
        return False
    return wait_share >= DATA_WAIT_SHARE or loader_fed < DATA_BOUND_CLEAR_RATIO * compute_only
