"""NvmlMonitor against a fake ``pynvml`` (no GPU, no driver needed): the fake records every call
and returns scripted values, so each figure of a window can be checked against what NVML said."""

import math
import sys
import threading
import time
import types
import warnings
from collections import Counter, defaultdict

import pytest

from autotune.trial import nvml
from autotune.errors import ConfigError
from autotune.trial.nvml import NvmlMonitor, NvmlUnavailableWarning, NvmlWindow, nvml_available

INTERVAL = 0.005  # fast sampling keeps every window short

# The values of NVML's nvmlClocksEventReason* bits (nvml.h).
GPU_IDLE, APP_CLOCKS, SW_POWER_CAP, HW_SLOWDOWN = 0x1, 0x2, 0x4, 0x8
SYNC_BOOST, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x10, 0x20, 0x40, 0x80
REASON_NAMES = {"GpuIdle": GPU_IDLE, "ApplicationsClocksSetting": APP_CLOCKS, "SwPowerCap": SW_POWER_CAP,
                "HwSlowdown": HW_SLOWDOWN, "SyncBoost": SYNC_BOOST, "SwThermalSlowdown": SW_THERMAL,
                "HwThermalSlowdown": HW_THERMAL, "HwPowerBrakeSlowdown": HW_POWER_BRAKE}


class FakeNVMLError(Exception):
    pass


class FakeNotSupported(FakeNVMLError):
    pass


class FakeFunctionNotFound(FakeNVMLError):
    pass


class FakeDriverNotLoaded(FakeNVMLError):
    pass


DEFAULT_SCRIPTS = {
    "power": [300_000, 700_000],  # mW
    "energy": [1_000_000, 1_250_000],  # mJ
    "sm_clock": [1980],
    "mem_clock": [3201],
    "temperature": [55],
    "utilization": [(90, 40)],
    "memory": [8 << 30],
    "reasons": [0],
}


class FakeNvml:
    """A stand-in for the pynvml module. A script is a list (one value per call, the last one
    repeats) or ``f(call_index, seconds_since_start_clock)``; an exception instance is raised."""

    def __init__(self, *, init_error: Exception | None = None, event_names: bool = True,
                 device_count: int = 1, **scripts):
        self.scripts = {**DEFAULT_SCRIPTS, **scripts}
        self.init_error = init_error
        self.calls: Counter = Counter()
        self.returned: dict[str, list] = defaultdict(list)
        self.epoch = time.perf_counter()
        self.lock = threading.Lock()
        m = types.ModuleType("pynvml")
        m.NVMLError, m.NVMLError_NotSupported = FakeNVMLError, FakeNotSupported
        m.NVMLError_FunctionNotFound, m.NVMLError_DriverNotLoaded = FakeFunctionNotFound, FakeDriverNotLoaded
        m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM, m.NVML_TEMPERATURE_GPU = 1, 2, 0
        m.nvmlInit = lambda: self._init()
        m.nvmlShutdown = lambda: self._count("shutdown")
        m.nvmlDeviceGetCount = lambda: device_count
        m.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
        m.nvmlDeviceGetPowerUsage = lambda h: self._value("power", h)
        m.nvmlDeviceGetTotalEnergyConsumption = lambda h: self._value("energy", h)
        m.nvmlDeviceGetClockInfo = lambda h, kind: self._value({1: "sm_clock", 2: "mem_clock"}[kind], h)
        m.nvmlDeviceGetTemperature = lambda h, sensor: self._value("temperature", h, sensor == 0)
        m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(
            **dict(zip(("gpu", "memory"), self._value("utilization", h))))
        m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=self._value("memory", h))
        m.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: self._value("reasons", h)
        prefixes = ["nvmlClocksThrottleReason"]
        if event_names:  # pynvml for drivers >= 535 has both spellings
            m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: self._value("event_reasons", h)
            self.scripts.setdefault("event_reasons", self.scripts["reasons"])
            prefixes.append("nvmlClocksEventReason")
        for prefix in prefixes:
            for name, bit in REASON_NAMES.items():
                setattr(m, prefix + name, bit)
        self.module = m

    def start_clock(self) -> None:
        self.epoch = time.perf_counter()

    def _init(self) -> None:
        self._count("init")
        if self.init_error is not None:
            raise self.init_error

    def _count(self, name: str) -> None:
        with self.lock:
            self.calls[name] += 1

    def _value(self, name: str, handle, args_ok: bool = True):
        assert handle == ("handle", 0) and args_ok, f"{name} called with wrong arguments"
        with self.lock:
            self.calls[name] += 1
            script = self.scripts[name]
            i = len(self.returned[name])
            if callable(script):
                value = script(i, time.perf_counter() - self.epoch)
            else:
                value = script[min(i, len(script) - 1)]
            if isinstance(value, Exception):
                raise value
            self.returned[name].append(value)
            return value


@pytest.fixture(autouse=True)
def fresh_availability():
    nvml._reset_availability()
    yield
    nvml._reset_availability()


@pytest.fixture
def install(monkeypatch):
    def install(fake: FakeNvml | None) -> FakeNvml | None:
        monkeypatch.setitem(sys.modules, "pynvml", fake.module if fake is not None else None)
        nvml._reset_availability()
        return fake
    return install


def measure(seconds: float = 0.05, **kwargs) -> NvmlWindow:
    monitor = NvmlMonitor(0, interval_s=kwargs.pop("interval_s", INTERVAL))
    monitor.begin_window()
    time.sleep(seconds)
    window = monitor.end_window()
    monitor.close()
    assert window is not None
    return window


def monitor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("nvml-monitor")]


def test_energy_is_the_counter_delta(install):
    fake = install(FakeNvml(power=[300_000, 700_000], energy=[1_000_000, 1_250_000]))
    w = measure(0.05)
    assert w.energy_source == "energy counter"
    assert w.energy_j == 250.0
    assert fake.calls["energy"] == 2  # read at begin and at end, not sampled
    assert w.avg_power_w == pytest.approx(250.0 / w.duration_s)
    assert w.peak_power_w == 700.0
    assert 0.05 <= w.duration_s < 1.0
    assert w.num_samples == len(fake.returned["power"]) >= 3
    assert w.unsupported == {}
    assert w.joules_per_sample(125) == 2.0


def test_window_into_appends_one_window_per_block_even_when_the_block_fails(install):
    install(FakeNvml(power=[500_000], energy=[1_000_000, 1_100_000, 1_100_000, 1_300_000]))
    monitor, windows = NvmlMonitor(0, interval_s=INTERVAL), []
    with monitor.window_into(windows):
        time.sleep(0.02)
    with pytest.raises(RuntimeError, match="step failed"), monitor.window_into(windows):
        raise RuntimeError("step failed")
    monitor.close()
    assert [w.energy_j for w in windows] == [100.0, 200.0] and not monitor_threads()
    install(None)  # no NVML: the window is None, the block still runs
    unavailable = []
    with pytest.warns(nvml.NvmlUnavailableWarning), NvmlMonitor(0).window_into(unavailable):
        pass
    assert unavailable == [None]


def test_power_integral_where_the_counter_is_not_supported(install):
    # 300 W for the first 0.08 s, then 700 W.
    fake = install(FakeNvml(energy=[FakeNotSupported()],
                            power=lambda i, t: 300_000 if t < 0.08 else 700_000))
    fake.start_clock()
    w = measure(0.2)
    assert w.energy_source == "power integral"
    assert "energy" in w.unsupported
    step = min(0.08, w.duration_s)
    expected = 300 * step + 700 * (w.duration_s - step)
    # Between the two samples around the step the trapezoid is off by at most 400 W x half a gap.
    assert w.energy_j == pytest.approx(expected, abs=15.0)
    assert w.avg_power_w == pytest.approx(w.energy_j / w.duration_s)
    assert 300 < w.avg_power_w < 700
    assert w.peak_power_w == 700.0


def test_power_integral_of_constant_power_is_exact(install):
    install(FakeNvml(energy=[FakeNVMLError()], power=[250_000]))
    w = measure(0.05)
    assert w.energy_source == "power integral"
    assert w.energy_j == pytest.approx(250.0 * w.duration_s, rel=1e-9)
    assert w.avg_power_w == pytest.approx(250.0)


def test_counter_that_went_backwards_falls_back_to_power(install):
    install(FakeNvml(energy=[5_000_000, 1_000], power=[200_000]))  # driver reloaded mid-window
    w = measure(0.03)
    assert w.energy_source == "power integral"
    assert w.energy_j == pytest.approx(200.0 * w.duration_s)


def test_clocks_temperature_utilization_memory(install):
    fake = install(FakeNvml(
        sm_clock=lambda i, t: [1980, 1755, 1410][i % 3],
        mem_clock=[3201],
        temperature=lambda i, t: [60, 71, 65][i % 3],
        utilization=lambda i, t: (100 - i % 2 * 10, 40 + i % 2 * 10),
        memory=lambda i, t: (10 + i) << 30,
    ))
    w = measure(0.05)
    assert w.num_samples >= 3
    sm = fake.returned["sm_clock"]
    assert w.avg_sm_clock_mhz == pytest.approx(sum(sm) / len(sm))
    assert w.min_sm_clock_mhz == 1410
    assert w.avg_mem_clock_mhz == 3201
    assert w.max_temperature_c == 71
    util = fake.returned["utilization"]
    assert w.avg_gpu_util_pct == pytest.approx(sum(g for g, _ in util) / len(util))
    assert w.avg_mem_util_pct == pytest.approx(sum(m for _, m in util) / len(util))
    assert 90 < w.avg_gpu_util_pct < 100
    assert w.peak_memory_used_bytes == (10 + w.num_samples - 1) << 30
    assert isinstance(w.peak_memory_used_bytes, int)


def test_power_cap_in_most_samples_is_throttled(install):
    # Power cap in three samples of four; the idle bit rides along and is ignored.
    fake = install(FakeNvml(event_reasons=lambda i, t: 0 if i % 4 == 3 else SW_POWER_CAP | GPU_IDLE))
    w = measure(0.05)
    reasons = fake.returned["event_reasons"]
    assert w.throttle["power_cap"] == pytest.approx(sum(1 for r in reasons if r & SW_POWER_CAP) / len(reasons))
    assert w.throttle["power_cap"] > 0.5
    assert set(w.throttle) == {"power_cap", "hw_slowdown", "hw_thermal", "sw_thermal", "hw_power_brake",
                               "sync_boost"}
    assert w.throttle["hw_thermal"] == 0.0
    assert w.throttled
    assert fake.calls["reasons"] == 0  # the current name was used, not the deprecated one


@pytest.mark.parametrize("bits, active", [
    (GPU_IDLE, None),
    (GPU_IDLE | APP_CLOCKS, None),
    (SYNC_BOOST, "sync_boost"),  # follows another GPU; not a power or thermal limit
])
def test_idle_and_clock_setting_reasons_are_not_throttling(install, bits, active):
    install(FakeNvml(event_reasons=[bits]))
    w = measure(0.02)
    assert not w.throttled
    assert {k: v for k, v in w.throttle.items() if v} == ({active: 1.0} if active else {})


@pytest.mark.parametrize("bit, name", [(HW_THERMAL, "hw_thermal"), (SW_THERMAL, "sw_thermal"),
                                       (HW_POWER_BRAKE, "hw_power_brake"), (HW_SLOWDOWN, "hw_slowdown")])
def test_thermal_and_hardware_reasons_are_throttling(install, bit, name):
    install(FakeNvml(event_reasons=[bit]))
    w = measure(0.02)
    assert w.throttle[name] == 1.0
    assert w.throttled


def test_older_bindings_use_the_throttle_names(install):
    fake = install(FakeNvml(event_names=False, reasons=[SW_POWER_CAP]))
    assert not hasattr(fake.module, "nvmlClocksEventReasonSwPowerCap")
    w = measure(0.02)
    assert w.throttle["power_cap"] == 1.0 and w.throttled


def test_driver_without_the_event_call_falls_back_once(install):
    fake = install(FakeNvml(event_reasons=[FakeFunctionNotFound()], reasons=[HW_THERMAL]))
    w = measure(0.03)
    assert w.throttle["hw_thermal"] == 1.0
    assert fake.calls["event_reasons"] == 1
    assert fake.calls["reasons"] == w.num_samples
    assert "throttle_reasons" not in w.unsupported


def test_unsupported_calls_are_skipped_and_the_rest_reported(install):
    fake = install(FakeNvml(temperature=[FakeNotSupported()], utilization=[FakeNVMLError()]))
    monitor = NvmlMonitor(0, interval_s=INTERVAL)
    for window in (1, 2):
        monitor.begin_window()
        time.sleep(0.03)
        w = monitor.end_window()
        assert w.max_temperature_c is None and w.avg_gpu_util_pct is None and w.avg_mem_util_pct is None
        assert set(w.unsupported) == {"temperature", "utilization"}
        assert fake.calls["temperature"] == window  # tried once per window, then skipped
        assert fake.calls["utilization"] == window
        assert w.num_samples >= 3
        assert w.energy_j == 250.0 and w.peak_power_w == 700.0
        assert w.avg_sm_clock_mhz == 1980 and w.peak_memory_used_bytes == 8 << 30
        fake.returned.clear()  # script the energy counter afresh for the second window
    monitor.close()


def test_a_bug_in_sampling_is_not_swallowed(install):
    install(FakeNvml(power=[ValueError("boom")]))
    monitor = NvmlMonitor(0, interval_s=INTERVAL)
    monitor.begin_window()
    with pytest.raises(ValueError, match="boom"):
        monitor.end_window()
    monitor.close()
    assert monitor_threads() == []


def caught_unavailable(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, NvmlUnavailableWarning)]


def test_without_pynvml_windows_are_none_with_one_warning(install):
    install(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count our once-per-process guard, not Python's filter
        assert nvml_available() is False
        for _ in range(3):
            monitor = NvmlMonitor()
            monitor.begin_window()
            assert monitor.end_window() is None
            monitor.close()
        with NvmlMonitor() as monitor:
            pass
        assert monitor.window is None
    [warning] = caught_unavailable(caught)
    message = str(warning.message)
    assert "pynvml is not installed" in message and "nvidia-ml-py" in message
    assert "energy" in message.lower() and "missing" in message


def test_without_a_driver_windows_are_none_with_one_warning(install):
    fake = install(FakeNvml(init_error=FakeDriverNotLoaded("Driver Not Loaded")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitors = [NvmlMonitor(), NvmlMonitor(), NvmlMonitor()]
        for monitor in monitors:
            monitor.begin_window()
        assert [monitor.end_window() for monitor in monitors] == [None, None, None]
    [warning] = caught_unavailable(caught)
    assert "Driver Not Loaded" in str(warning.message) and "driver" in str(warning.message)
    assert fake.calls["init"] == 1  # probed once, cached
    assert fake.calls["power"] == 0
    assert monitor_threads() == []


def test_thread_runs_only_during_the_window_and_stops_promptly(install):
    fake = install(FakeNvml())
    monitor = NvmlMonitor(0, interval_s=10.0)  # the sampler waits 10 s between samples...
    monitor.begin_window()
    time.sleep(0.02)
    [thread] = monitor_threads()
    assert thread.daemon
    start = time.perf_counter()
    w = monitor.end_window()
    assert time.perf_counter() - start < 0.5  # ...but end_window() cuts the wait short
    assert not thread.is_alive() and monitor_threads() == []
    assert w.num_samples == 2  # one at the start, one at the end
    monitor.close()
    assert fake.calls["init"] == fake.calls["shutdown"] == 2  # the probe's and the monitor's


def test_context_manager_measures_one_window_and_shuts_nvml_down(install):
    fake = install(FakeNvml())
    with NvmlMonitor(0, interval_s=INTERVAL) as monitor:
        time.sleep(0.02)
    assert isinstance(monitor.window, NvmlWindow) and monitor.window.energy_j == 250.0
    assert fake.calls["init"] == fake.calls["shutdown"]
    assert monitor_threads() == []


def test_misuse_is_reported(install):
    install(FakeNvml(device_count=1))
    with pytest.raises(RuntimeError, match="without begin_window"):
        NvmlMonitor().end_window()
    with pytest.raises(ConfigError, match="NVML index 3"):
        NvmlMonitor(3).begin_window()
    with pytest.raises(ConfigError, match="interval"):
        NvmlMonitor(0, interval_s=0)
    monitor = NvmlMonitor()
    monitor.begin_window()
    with pytest.raises(RuntimeError, match="window is open"):
        monitor.begin_window()
    monitor.close()
    assert monitor_threads() == []


def test_joules_per_sample_and_to_dict():
    w = NvmlWindow(duration_s=2.0, energy_j=600.0, energy_source="energy counter", avg_power_w=300.0,
                   peak_power_w=350.0, avg_sm_clock_mhz=1900.0, min_sm_clock_mhz=1800.0,
                   avg_mem_clock_mhz=3201.0, max_temperature_c=70.0, avg_gpu_util_pct=98.0,
                   avg_mem_util_pct=45.0, peak_memory_used_bytes=1 << 34, num_samples=40,
                   throttle={"power_cap": 0.5}, throttled=True)
    assert w.joules_per_sample(256) == pytest.approx(600.0 / 256)
    assert math.isclose(w.joules_per_sample(1), 600.0)
    with pytest.raises(ValueError):
        w.joules_per_sample(0)
    no_energy = NvmlWindow(**{**w.to_dict(), "energy_j": None, "energy_source": None})
    assert no_energy.joules_per_sample(256) is None
    d = w.to_dict()
    assert d["energy_j"] == 600.0 and d["throttle"] == {"power_cap": 0.5} and d["throttled"] is True
    assert {"duration_s", "energy_source", "avg_power_w", "peak_power_w", "avg_sm_clock_mhz",
            "min_sm_clock_mhz", "avg_mem_clock_mhz", "max_temperature_c", "avg_gpu_util_pct",
            "avg_mem_util_pct", "peak_memory_used_bytes", "num_samples"} <= set(d)
