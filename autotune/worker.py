"""The isolated worker: one process per trial builds the model, runs the measured steps, exits.

A fresh process per trial means global flags (TF32, cudnn.benchmark, threads), the caching
allocator's state, cuDNN's algorithm cache and a sticky CUDA error never reach the next trial
(timm's bulk_runner does the same). The study process talks to it through a JSON request on
stdin and a JSON result file.

    python -m autotune.worker RESULT.json STUDY_PID < REQUEST.json
"""

from __future__ import annotations

import os
import sys
import threading
import time


def _watch_parent(expected_parent: int) -> None:
    """Exit when the study process dies: a killed search must not leave a worker on the GPU.
    Started before the heavy imports, since the study can die while the worker imports torch."""

    def watch() -> None:
        while True:
            if os.getppid() != expected_parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__" and len(sys.argv) > 2:
    _watch_parent(int(sys.argv[2]))

import contextlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import torch  # noqa: E402

import strategies  # noqa: E402
from autotune.config import TunedConfig, load  # noqa: E402
from autotune.measure import MeasureSettings, measure, memory_figures  # noqa: E402
from autotune.profile import analyze, record  # noqa: E402
from autotune.space import SearchSpace  # noqa: E402
from autotune.workloads import WorkloadSpec, build  # noqa: E402

READY_AT = time.time()

NUM_HOST_BATCHES = 3  # distinct batches, cycled, so consecutive steps never reuse one buffer


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


def provenance() -> dict[str, Any]:
    """Where a figure was measured: GPU, driver, CUDA, cuDNN, torch, CPU."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "num_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:
        pass
    try:
        import optuna

        info["optuna"] = optuna.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            compute_capability=f"{props.major}.{props.minor}",
            num_sms=props.multi_processor_count,
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
        )
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
            pynvml.nvmlShutdown()
        except Exception as exc:  # no NVML: the rest of the provenance still stands
            info["driver"] = f"unknown ({type(exc).__name__})"
    return info


def probe(request: dict[str, Any]) -> dict[str, Any]:
    """Describe the device and check the workload builds (before a study starts)."""
    from strategies.channel_alignment import misaligned_layers
    from strategies.fp32_layers import kinds_present
    from strategies.precision import supported_modes

    device = request["device"]
    result: dict[str, Any] = {"provenance": provenance(), "cuda_available": torch.cuda.is_available()}
    if device == "cuda":
        result["precisions"] = supported_modes("cuda")
        from autotune.nvml import _probe as nvml_probe

        available, reason = nvml_probe()
        result["nvml"] = {"available": available, "reason": reason}
    else:
        result["precisions"] = supported_modes("cpu")
    workload = build(WorkloadSpec.from_dict(request["workload"]))
    x, _ = workload.batch(2, torch.Generator().manual_seed(0))
    result["input_dim"] = x.dim() if isinstance(x, torch.Tensor) else None
    result["input_shape"] = list(workload.input_shape)
    result["num_parameters"] = sum(p.numel() for p in workload.model.parameters())
    result["misaligned"] = {str(m): misaligned_layers(workload.model, m) for m in (8, 16)}
    result["fp32_layer_kinds"] = kinds_present(workload.model)
    if request.get("check_compile"):
        from strategies.compile import check_compile

        result["compile"] = check_compile(device)
    return result


def _input_batches(workload, batch_size: int, device: str, on_device: bool, seed: int) -> list[Any]:
    """Distinct random batches, cycled by the measured loop: in pinned host memory (copied each
    step, as from a DataLoader with pin_memory=True) or, with on_device, already on the GPU."""
    if device == "cuda" and workload.make_batch is None:
        # generating a large batch on the CPU takes seconds per trial; on the GPU, milliseconds
        generator = torch.Generator(device="cuda").manual_seed(seed)
        batches = []
        for _ in range(NUM_HOST_BATCHES):
            x = torch.randn((batch_size, *workload.input_shape), generator=generator, device="cuda")
            y = torch.randint(0, workload.num_classes, (batch_size,), generator=generator, device="cuda")
            batches.append((x, y) if on_device else (x.cpu().pin_memory(), y.cpu().pin_memory()))
        return batches
    generator = torch.Generator().manual_seed(seed)
    batches = [workload.batch(batch_size, generator) for _ in range(NUM_HOST_BATCHES)]
    if device == "cuda":
        if on_device:
            return [tuple(t.to("cuda") for t in b) for b in batches]
        return [tuple(t.pin_memory() for t in b) for b in batches]
    return batches


def run_trial(request: dict[str, Any]) -> dict[str, Any]:
    """Build the model through TunedConfig (what user code does), warm up, measure."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if request.get("config_path"):
        cfg = load(request["config_path"])  # `autotune verify`: re-measure an exported config
        spec = WorkloadSpec.from_dict(cfg.info["workload"])
        settings = MeasureSettings(**cfg.info.get("measure", {})) if "measure" in cfg.info else MeasureSettings.for_device(cfg.device)
        input_on_device = cfg.info.get("input_on_device", False)
    else:
        space = SearchSpace.from_dict(request["space"])
        cfg = TunedConfig(strategies.knobs_from_dict(request["knobs"]), space)
        spec = WorkloadSpec.from_dict(request["workload"])
        settings = MeasureSettings(**request["measure"])
        input_on_device = request.get("input_on_device", False)
    device = cfg.device
    seed = int(request.get("seed", 0))
    torch.manual_seed(seed)
    workload = build(spec)
    model = workload.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    model, optimizer = cfg.prepare(model, optimizer)
    step = cfg.train_step(model, optimizer, workload.loss_fn)
    batches = _input_batches(workload, cfg.batch_size, device, input_on_device, seed)
    stream = iter(cfg.loader(itertools.cycle(batches)))
    last_loss: list[torch.Tensor] = []

    def one_step() -> None:
        x, y = next(stream)
        last_loss[:] = [step(x, y)]

    timings["build_s"] = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    monitor, windows = _nvml_monitor(device, request), []

    @contextlib.contextmanager
    def nvml_window() -> Iterator[None]:
        monitor.begin_window()
        try:
            yield
        finally:
            windows.append(monitor.end_window())

    try:
        m = measure(one_step, device, settings, setup_steps=step.num_setup_steps,
                    timed_window=nvml_window if monitor is not None else None)
    finally:
        if monitor is not None:
            monitor.close()
    loss = float(last_loss[0].float().item())
    figures = m.to_dict()
    figures.update(memory_figures(device))
    figures["samples_per_s"] = cfg.batch_size * 1e3 / m.step_time_ms
    figures["batch_size"] = cfg.batch_size
    figures["final_loss"] = loss
    figures["loss_finite"] = bool(torch.isfinite(torch.tensor(loss)))
    result: dict[str, Any] = {"status": "ok", "figures": figures, "knobs": strategies.knobs_to_dict(cfg.knobs)}
    if windows and windows[0] is not None:
        energy = windows[0].to_dict()
        energy["joules_per_sample"] = windows[0].joules_per_sample(m.num_timed_steps_total * cfg.batch_size)
        result["energy"] = energy
    if device == "cuda" and request.get("profile", True):
        # its own short window after the timed one: the profiler slows the host, so no reported
        # time includes it; shares are taken of the step time measured above
        t1 = time.perf_counter()
        try:
            result["profile"] = _profile(one_step, request, cfg.batch_size, m.step_time_ms)
        except Exception as exc:  # the measurement stands; only its explanation is missing
            result["profile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        timings["profile_s"] = time.perf_counter() - t1
    figures.update(timings)
    return result


def _profile(one_step, request: dict[str, Any], batch_size: int, step_time_ms: float) -> dict[str, Any]:
    trace_path = request.get("trace_path")
    trace = record(one_step, int(request.get("profile_steps", 3)), device="cuda", chrome_trace=trace_path,
                   meta={"batch": batch_size, "step_time_ms": step_time_ms})
    if trace_path:
        _gzip_in_place(trace_path)
    return analyze(trace, step_time_ms=step_time_ms)


def _nvml_monitor(device: str, request: dict[str, Any]):
    """An NVML monitor of this process's GPU, or None (CPU, or asked not to sample)."""
    if device != "cuda" or not request.get("nvml", True):
        return None
    from autotune.nvml import NvmlMonitor

    return NvmlMonitor(device_index=_nvml_index(), interval_s=0.05)


def _nvml_index() -> int:
    """The NVML index of CUDA device 0 of this process: NVML ignores CUDA_VISIBLE_DEVICES, so the
    device is found by its PCI bus id (autotune.gpus.nvml_index)."""
    from autotune.gpus import nvml_index

    return nvml_index(0)


def _gzip_in_place(path: str) -> None:
    import gzip
    import shutil

    with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=5) as dst:
        shutil.copyfileobj(src, dst)
    os.unlink(path)


def main(argv: list[str]) -> int:
    result_path = argv[1]
    request = json.load(sys.stdin)
    try:
        if request.get("mode") == "probe":
            result = {"status": "ok", **probe(request)}
        elif request.get("mode") == "accuracy":
            from autotune.accuracy import run_check

            result = run_check(request)
        else:
            result = run_trial(request)
    except Exception as exc:  # reported to the study, which records it on the trial
        if is_out_of_memory(exc):
            result = {"status": "oom", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        else:
            result = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
    result["ready_at"] = READY_AT
    result["done_at"] = time.time()
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, default=str)
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
