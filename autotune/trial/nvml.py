"""NVML sampling while a measured window runs (Zeus-style ``begin_window``/``end_window``): energy,
power, clocks, temperature, utilization, memory and clock throttling of one GPU.

A background daemon thread samples every ``interval_s``; energy comes from the GPU's total-energy
counter where the device has one (Volta and newer), else from integrating the sampled power over
time. Without pynvml or an NVIDIA driver the monitor still works and returns ``None``, with one
warning per process saying why the figures are missing.

NVML numbers GPUs in PCI bus order and ignores ``CUDA_VISIBLE_DEVICES``: ``device_index`` is an
NVML index, which equals the CUDA index only when every GPU is visible and
``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from autotune.errors import ConfigError

__all__ = ["NvmlMonitor", "NvmlUnavailableWarning", "NvmlWindow", "nvml_available"]

THROTTLED_SHARE = 0.05
"""A power or thermal reason active in at least this share of the samples marks a window throttled."""

# Our name -> the suffix of pynvml's constant (nvmlClocksEventReason<suffix>, called
# nvmlClocksThrottleReason<suffix> before driver 535). GPU idle, application clocks and display
# clocks are left out: they are not slowdowns of a busy GPU.
_REASONS = {
    "power_cap": "SwPowerCap",
    "hw_slowdown": "HwSlowdown",
    "hw_thermal": "HwThermalSlowdown",
    "sw_thermal": "SwThermalSlowdown",
    "hw_power_brake": "HwPowerBrakeSlowdown",
    "sync_boost": "SyncBoost",
}
# sync_boost only follows the slowest GPU of a sync-boost group; it says nothing about power or heat.
_POWER_THERMAL = ("power_cap", "hw_slowdown", "hw_thermal", "sw_thermal", "hw_power_brake")

_METRICS = ("power", "sm_clock", "mem_clock", "temperature", "utilization", "memory", "throttle_reasons")


class NvmlUnavailableWarning(RuntimeWarning):
    """NVML cannot be used here (no pynvml, no driver): energy, power and clock figures are missing."""


# --- availability (probed once per process) -------------------------------------------------------

_available: bool | None = None
_unavailable_reason = ""
_warned = False
_lock = threading.Lock()


def probe() -> tuple[bool, str]:
    try:
        import pynvml
    except ImportError:
        return False, "pynvml is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError) as e:
        return False, f"nvmlInit failed with '{e}'; is an NVIDIA driver installed (nvidia-smi)?"
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass
    return True, ""


def nvml_available() -> bool:
    """Whether pynvml imports and ``nvmlInit()`` succeeds. Probed once; the answer is cached."""
    global _available, _unavailable_reason
    with _lock:
        if _available is None:
            _available, _unavailable_reason = probe()
        return _available


def _warn_unavailable_once(stacklevel: int) -> None:
    global _warned
    with _lock:
        if _warned:
            return
        _warned = True
    warnings.warn(f"NVML is unavailable: {_unavailable_reason}. Energy, power, clock and throttling "
                  "figures will be missing from the measurements.", NvmlUnavailableWarning,
                  stacklevel=stacklevel + 1)


def _reset_availability() -> None:
    """Forget the cached probe and the warning (tests swap ``pynvml`` in and out)."""
    global _available, _unavailable_reason, _warned
    with _lock:
        _available, _unavailable_reason, _warned = None, "", False


# --- the result -----------------------------------------------------------------------------------

@dataclass(kw_only=True)
class NvmlWindow:
    """What NVML saw during one measured window. A figure the device does not report is ``None``."""

    duration_s: float
    """Wall time from ``begin_window()`` to ``end_window()``."""
    energy_j: float | None
    energy_source: str | None
    """"energy counter" (the GPU's total-energy counter, read at both ends), "power integral"
    (sampled power integrated over time, where the counter is not supported) or None."""
    avg_power_w: float | None
    """energy_j / duration_s: the time-weighted mean, not the mean of the samples."""
    peak_power_w: float | None
    avg_sm_clock_mhz: float | None
    min_sm_clock_mhz: float | None
    avg_mem_clock_mhz: float | None
    max_temperature_c: float | None
    avg_gpu_util_pct: float | None
    avg_mem_util_pct: float | None
    peak_memory_used_bytes: int | None
    """Device memory used by all processes, as nvidia-smi shows it (not just the PyTorch allocator)."""
    num_samples: int
    """How many times NVML was sampled (not training samples)."""
    throttle: dict[str, float] = field(default_factory=dict)
    """Share of samples (0..1) in which each clock-slowdown reason was active; empty when the
    device does not report reasons."""
    throttled: bool = False
    """A power or thermal reason was active in at least 5% of the samples."""
    unsupported: dict[str, str] = field(default_factory=dict)
    """Metric -> NVML error, for the calls the device refused (skipped for the rest of the window)."""

    def joules_per_sample(self, num_samples_processed: int) -> float | None:
        """Energy per training example processed in the window; None without an energy figure."""
        if num_samples_processed <= 0:
            raise ValueError(f"num_samples_processed must be positive, got {num_samples_processed}")
        if self.energy_j is None:
            return None
        return self.energy_j / num_samples_processed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- the monitor ----------------------------------------------------------------------------------

@dataclass(slots=True)
class _Sample:
    t: float
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    temperature_c: float | None = None
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    memory_used_bytes: int | None = None
    reasons: int | None = None


class _WindowState:
    """One open window: written by the sampler thread until it is joined, then by end_window."""

    def __init__(self) -> None:
        self.samples: list[_Sample] = []
        self.unsupported: dict[str, str] = {}
        self.t_begin = 0.0
        self.energy_begin_mj: int | None = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None


class NvmlMonitor:
    """Samples one GPU through NVML from a daemon thread while a window is open.

    ``begin_window()`` ... ``end_window()`` returns an :class:`NvmlWindow` (``None`` where NVML is
    unavailable); windows may be repeated. As a context manager it measures one window, leaves it
    in ``monitor.window`` and closes NVML on exit. ``close()`` shuts NVML down (reopened on the
    next window).
    """

    def __init__(self, device_index: int = 0, interval_s: float = 0.05) -> None:
        if device_index < 0:
            raise ConfigError(f"NVML device index must be 0 or more, got {device_index}")
        if not interval_s > 0:
            raise ConfigError(f"NVML sampling interval must be positive, got {interval_s} s")
        self.device_index = device_index
        self.interval_s = interval_s
        self.window: NvmlWindow | None = None
        """The last window measured by the context manager."""
        self._nvml: Any = None  # the pynvml module, while NVML is initialised by this monitor
        self._handle: Any = None
        self._calls: dict[str, Callable[[], Any]] = {}
        self._state: _WindowState | None = None
        if not nvml_available():
            _warn_unavailable_once(stacklevel=2)

    # -- NVML lifetime

    def _open(self) -> bool:
        if self._nvml is not None:
            return True
        if not nvml_available():
            return False
        import pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:  # worked in the probe; the driver went away since
            warnings.warn(f"nvmlInit failed: {e}; this window has no energy, power or clock figures",
                          NvmlUnavailableWarning, stacklevel=3)
            return False
        try:
            count = pynvml.nvmlDeviceGetCount()
            if self.device_index >= count:
                raise ConfigError(f"no GPU at NVML index {self.device_index}: NVML sees {count} "
                                  f"(indices 0..{count - 1}; `nvidia-smi -L` lists them)")
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        self._nvml, self._handle = pynvml, handle
        self._calls = self._sampled_calls(pynvml, handle)
        return True

    def close(self) -> None:
        """Stop any open window (discarding it) and shut NVML down. Safe to call twice."""
        if self._state is not None:
            self._stop_thread(self._state)
            self._state = None
        if self._nvml is not None:
            nvml, self._nvml, self._handle, self._calls = self._nvml, None, None, {}
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass

    def __enter__(self) -> "NvmlMonitor":
        self.begin_window()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.window = self.end_window()
        finally:
            self.close()

    # -- windows

    def begin_window(self) -> None:
        """Start sampling. Reads the energy counter, then starts the sampler thread."""
        if self._state is not None:
            raise RuntimeError("NvmlMonitor.begin_window() called while a window is open; call end_window() first")
        state = _WindowState()
        if not self._open():
            state.t_begin = time.perf_counter()
            self._state = state
            return
        for name in _METRICS:
            if name not in self._calls:
                state.unsupported[name] = "not in this pynvml"
        state.energy_begin_mj = self._read_energy(state)
        state.t_begin = time.perf_counter()
        state.thread = threading.Thread(target=self._run, args=(state,), daemon=True,
                                        name=f"nvml-monitor-{self.device_index}")
        self._state = state
        state.thread.start()

    @contextlib.contextmanager
    def window_into(self, windows: list[NvmlWindow | None]) -> Iterator[None]:
        """One window around the block, appended to ``windows`` (``None`` where NVML is
        unavailable): the ``timed_window`` that ``measure`` enters around its timed steps."""
        self.begin_window()
        try:
            yield
        finally:
            windows.append(self.end_window())

    def end_window(self) -> NvmlWindow | None:
        """Stop sampling and summarise the window; ``None`` where NVML is unavailable."""
        state = self._state
        if state is None:
            raise RuntimeError("NvmlMonitor.end_window() called without begin_window()")
        self._state = None
        t_end = time.perf_counter()
        if state.thread is None:  # NVML unavailable
            return None
        energy_end_mj = self._read_energy(state) if state.energy_begin_mj is not None else None
        self._stop_thread(state)
        if state.error is not None:
            raise state.error
        state.samples.append(self._sample(state))  # power at the very end, for the integral
        return _summarise(self._nvml, state, t_end, energy_end_mj)

    def _stop_thread(self, state: _WindowState) -> None:
        state.stop.set()
        if state.thread is not None:
            # An NVML call in flight finishes first (milliseconds); the wait between samples is cut short.
            timeout = max(5.0, 2 * self.interval_s)
            state.thread.join(timeout)
            if state.thread.is_alive():
                warnings.warn(f"the NVML sampler thread did not stop within {timeout:g} s (an NVML call "
                              "hangs); the window is summarised without it", RuntimeWarning, stacklevel=3)

    def _run(self, state: _WindowState) -> None:
        try:
            next_t = time.perf_counter()
            while not state.stop.is_set():
                state.samples.append(self._sample(state))
                # Keep to a fixed grid, so slow NVML calls do not stretch the interval.
                next_t += self.interval_s
                now = time.perf_counter()
                if next_t < now:
                    next_t = now
                if state.stop.wait(next_t - now):
                    break
        except BaseException as e:  # a bug, not an unsupported call: end_window() re-raises it
            state.error = e

    # -- NVML calls

    def _read_energy(self, state: _WindowState) -> int | None:
        nvml = self._nvml
        if "energy" in state.unsupported:
            return None
        try:
            return int(nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except nvml.NVMLError as e:
            state.unsupported["energy"] = str(e) or type(e).__name__
            return None

    @staticmethod
    def _sampled_calls(nvml: Any, handle: Any) -> dict[str, Callable[[], Any]]:
        calls: dict[str, Callable[[], Any]] = {
            "power": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # mW -> W
            "sm_clock": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            "mem_clock": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
            "temperature": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
            "utilization": lambda: nvml.nvmlDeviceGetUtilizationRates(handle),
            "memory": lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).used),
        }
        # "Throttle" was renamed "Event" in driver 535; bindings newer than the driver have the new
        # name but the driver lacks the symbol (NVMLError_FunctionNotFound), so fall back once.
        reason_fns = [getattr(nvml, name) for name in ("nvmlDeviceGetCurrentClocksEventReasons",
                                                        "nvmlDeviceGetCurrentClocksThrottleReasons")
                      if hasattr(nvml, name)]
        if reason_fns:
            def reasons() -> int:
                while True:
                    try:
                        return int(reason_fns[0](handle))
                    except nvml.NVMLError:
                        if len(reason_fns) == 1:
                            raise
                        reason_fns.pop(0)

            calls["throttle_reasons"] = reasons
        return calls

    def _sample(self, state: _WindowState) -> _Sample:
        nvml = self._nvml
        values: dict[str, Any] = {}
        t = time.perf_counter()  # power is read first, so this is when it was read
        for name, call in self._calls.items():
            if name in state.unsupported:
                continue
            try:
                values[name] = call()
            except nvml.NVMLError as e:
                state.unsupported[name] = str(e) or type(e).__name__
        s = _Sample(t=t)
        s.power_w = values.get("power")
        s.sm_clock_mhz = values.get("sm_clock")
        s.mem_clock_mhz = values.get("mem_clock")
        s.temperature_c = values.get("temperature")
        if "utilization" in values:
            s.gpu_util_pct, s.mem_util_pct = values["utilization"].gpu, values["utilization"].memory
        s.memory_used_bytes = values.get("memory")
        s.reasons = values.get("throttle_reasons")
        return s


# --- summary --------------------------------------------------------------------------------------

def _reason_masks(nvml: Any) -> dict[str, int]:
    masks = {}
    for name, suffix in _REASONS.items():
        for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
            mask = getattr(nvml, prefix + suffix, None)
            if mask is not None:
                masks[name] = int(mask)
                break
    return masks


def _integrate(points: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Integral over [t0, t1] of the piecewise-linear curve through ``points`` (trapezoids between
    samples), held constant before the first and after the last point."""
    points = sorted(points)
    ts = [t for t, _ in points]

    def at(t: float) -> float:
        i = bisect.bisect_left(ts, t)
        if i == 0:
            return points[0][1]
        if i == len(points):
            return points[-1][1]
        (ta, pa), (tb, pb) = points[i - 1], points[i]
        return pb if tb == ta else pa + (pb - pa) * (t - ta) / (tb - ta)

    grid = [t0] + [t for t in ts if t0 < t < t1] + [t1]
    return math.fsum((tb - ta) * (at(ta) + at(tb)) / 2 for ta, tb in zip(grid, grid[1:]))


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _summarise(nvml: Any, state: _WindowState, t_end: float, energy_end_mj: int | None) -> NvmlWindow:
    samples = state.samples
    duration = max(t_end - state.t_begin, 0.0)

    def col(attr: str) -> list:
        return [getattr(s, attr) for s in samples if getattr(s, attr) is not None]

    power = [(s.t, s.power_w) for s in samples if s.power_w is not None]
    energy_j: float | None = None
    source: str | None = None
    if state.energy_begin_mj is not None and energy_end_mj is not None and energy_end_mj >= state.energy_begin_mj:
        energy_j, source = (energy_end_mj - state.energy_begin_mj) / 1000.0, "energy counter"
    elif power and duration > 0:  # counter unsupported (or reset by a driver reload)
        energy_j, source = _integrate(power, state.t_begin, t_end), "power integral"

    reasons = col("reasons")
    throttle: dict[str, float] = {}
    if reasons:
        for name, mask in _reason_masks(nvml).items():
            throttle[name] = sum(1 for r in reasons if r & mask) / len(reasons)
    sm, temps, mem = col("sm_clock_mhz"), col("temperature_c"), col("memory_used_bytes")
    return NvmlWindow(
        duration_s=duration,
        energy_j=energy_j,
        energy_source=source,
        avg_power_w=energy_j / duration if energy_j is not None and duration > 0 else None,
        peak_power_w=max((p for _, p in power), default=None),
        avg_sm_clock_mhz=_mean(sm),
        min_sm_clock_mhz=min(sm, default=None),
        avg_mem_clock_mhz=_mean(col("mem_clock_mhz")),
        max_temperature_c=max(temps, default=None),
        avg_gpu_util_pct=_mean(col("gpu_util_pct")),
        avg_mem_util_pct=_mean(col("mem_util_pct")),
        peak_memory_used_bytes=max(mem, default=None),
        num_samples=len(samples),
        throttle=throttle,
        throttled=any(throttle.get(name, 0.0) >= THROTTLED_SHARE for name in _POWER_THERMAL),
        unsupported=dict(state.unsupported),
    )
