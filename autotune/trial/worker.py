"""The isolated worker: one process per trial builds the model, runs the measured steps, exits.

A fresh process per trial means global flags (TF32, cudnn.benchmark, threads), the caching
allocator's state, cuDNN's algorithm cache and a sticky CUDA error never reach the next trial
(timm's bulk_runner does the same). The study process talks to it through a JSON request on
stdin and a JSON result file.

    python -m autotune.trial.worker RESULT.json STUDY_PID < REQUEST.json
"""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__" and len(sys.argv) > 2:
    from autotune.trial.orphan import watch_parent

    watch_parent(int(sys.argv[2]))  # before the heavy imports below

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import importlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import torch  # noqa: E402

import strategies  # noqa: E402
from autotune.deploy.config import TunedConfig, load  # noqa: E402
from autotune.deploy.space import SearchSpace  # noqa: E402
from autotune.trial.measure import MeasureSettings, measure, memory_figures  # noqa: E402
from autotune.trial.process import PRELOAD_CUDA, PRELOAD_IMPORTS  # noqa: E402
from autotune.trial.profile import analyze, record  # noqa: E402
from autotune.workload.models import WorkloadSpec, build  # noqa: E402


def _preload() -> list[str]:
    """What autotune.trial.runner.preload asked for, done before the request: the model's module
    imported, the CUDA context made. Each is done again by the trial if it fails here, and says
    what went wrong then."""
    done = []
    module = os.environ.get(PRELOAD_IMPORTS)
    if module:
        try:
            importlib.import_module(module)
            done.append(module)
        except Exception:
            pass
    if os.environ.get(PRELOAD_CUDA) == "1":
        try:
            if torch.cuda.is_available():
                torch.empty(1, device="cuda")  # the first allocation makes the context
                torch.cuda.empty_cache()  # and nothing of it stays reserved
                done.append("cuda")
        except Exception:
            pass
    return done


PRELOADED = _preload()
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
        uuid = getattr(props, "uuid", None)  # which GPU, for autotune.search.machine
        if uuid is not None:
            info["gpu_uuid"] = str(uuid)
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
    result: dict[str, Any] = {}
    if request.get("list_devices"):
        # --gpus: the requested GPUs, in the order given (autotune.trial.gpus.probe_view)
        result["cuda_devices"] = [torch.cuda.get_device_properties(i).name for i in range(torch.cuda.device_count())]
        if not result["cuda_devices"]:  # none of them exists: the search says which there are
            return result
    result.update(provenance=provenance(), cuda_available=torch.cuda.is_available())
    if device == "cuda":
        result["precisions"] = supported_modes("cuda")
        from autotune.trial.nvml import probe as nvml_probe

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


def compiled_graphs() -> int:
    """Graphs TorchDynamo compiled in this process so far. A compiled trial with none ran eagerly
    (its frames skipped, or reusing code compiled for an identical model): its compile_s is then
    no compile time, and its speed is eager speed."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def input_batches(workload, batch_size: int, device: str, on_device: bool, seed: int) -> list[Any]:
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


class _LoaderFeed:
    """With ``--data``: the trial's steps fed from a DataLoader over the training split, built
    with the dataloader knob's settings (``TunedConfig.dataloader_kwargs``, as user code builds
    it), its batches copied to the device by the streams knob (``TunedConfig.loader``).

    Whether the loader keeps up is measured, not assumed: the same step is first timed fed from
    memory (the loader's first batches, cycled: "compute-only"), then fed by the loader, and each
    step's wait for its next batch is logged. Workers are started after the compute-only window,
    so no batches pile up ahead of the timed window, and their first batches fall in the warm-up.
    """

    def __init__(self, spec: str, workload, cfg: TunedConfig, seed: int) -> None:
        from autotune.workload.data import load_data
        from strategies.dataloader import endless_loader

        datasets = load_data(spec, input_shape=tuple(workload.input_shape), num_classes=workload.num_classes,
                             train_size=1024, held_out_size=256, seed=seed)
        self.cfg = cfg
        self.kwargs = cfg.dataloader_kwargs()
        self.loader = endless_loader(datasets.train, cfg.batch_size, self.kwargs, seed=seed)
        self.iterator: Iterator[Any] | None = None
        self.log: list[tuple[float, float]] = []
        """(time the batch arrived, seconds next() waited for it), one entry per fed step."""

    def first_batches(self) -> list[Any]:
        """NUM_HOST_BATCHES batches as the loader makes them (pinned when it pins); its workers
        are shut down again before anything is timed."""
        iterator = iter(self.loader)
        try:
            return [next(iterator) for _ in range(NUM_HOST_BATCHES)]
        finally:
            del iterator

    def _batches(self) -> Iterator[Any]:
        assert self.iterator is not None
        while True:
            start = time.perf_counter()
            batch = next(self.iterator)
            now = time.perf_counter()
            self.log.append((now, now - start))
            yield batch

    def measure(self, compute_step, step, last_loss: list, settings: MeasureSettings, nvml_window):
        """Time the step fed from memory (a short window; compiling and warm-up happen here), then
        fed by the loader (its timed window under NVML); returns the loader-fed Measurement, the
        loader-fed step (for the profile window) and the loader figures."""
        from autotune.trial.measure import is_data_bound

        device, batch = self.cfg.device, self.cfg.batch_size
        compute_wall: list[tuple[float, float]] = []
        compute = measure(compute_step, device,
                          dataclasses.replace(settings, min_time_s=min(settings.min_time_s, 1.0), max_remeasure=0),
                          setup_steps=step.num_setup_steps, timed_window=lambda: _wall(compute_wall))
        compute_rate = compute.num_timed_steps_total * batch / max(compute_wall[0][1] - compute_wall[0][0], 1e-9)

        self.iterator = iter(self.loader)  # the workers start now, before the warm-up
        fed_stream = iter(self.cfg.loader(self._batches()))

        def fed_step() -> None:
            x, y = next(fed_stream)
            last_loss[:] = [step(x, y)]

        fed_wall: list[tuple[float, float]] = []

        @contextlib.contextmanager
        def timed() -> Iterator[None]:
            with (nvml_window() if nvml_window is not None else contextlib.nullcontext()), _wall(fed_wall):
                yield

        workers = self.kwargs.get("num_workers", 0)
        # a loader-fed step time varies by design (workers deliver in waves): one window, long
        # enough for two waves, and the rate is taken over it rather than from the median step.
        # Its warm-up only has to let the workers deliver their first wave (the compile, cudnn's
        # autotuning and the steady state were reached in the compute-only window): waiting for
        # two windows to agree would wait out max_warmup_s (60 s on a GPU) on waves that never do
        m = measure(fed_step, device, dataclasses.replace(settings, max_remeasure=0, max_warmup_s=0.0,
                                                          min_warmup_steps=max(settings.min_warmup_steps, 2 * workers + 1),
                                                          min_steps=max(settings.min_steps, 2 * workers + 1)),
                    timed_window=timed)
        begin, end = fed_wall[0]
        fed_rate, wait_s = self._rate(begin, end, batch, threshold_s=max(1e-3, 0.05 * compute.step_time_ms / 1e3))
        m = dataclasses.replace(m, compile_s=compute.compile_s, num_setup_steps=compute.num_setup_steps,
                                warmup_s=compute.warmup_s + compute.measure_s + m.warmup_s)
        wait_share = min(1.0, wait_s / max(end - begin, 1e-9))
        figures = {
            "samples_per_s": fed_rate,
            "loader_fed_samples_per_s": fed_rate,
            "compute_only_samples_per_s": compute_rate,
            "compute_only_step_time_ms": compute.step_time_ms,
            "loader_wait_share": wait_share,
            "data_bound": is_data_bound(fed_rate, compute_rate, wait_share),
        }
        return m, fed_step, figures

    def _rate(self, begin: float, end: float, batch: int, *, threshold_s: float) -> tuple[float, float]:
        """Samples per second the loader-fed steps ran at between ``begin`` and ``end``, and the
        seconds they waited for batches there.

        Where steps waited for their batch (``threshold_s`` or more) at least twice, the rate is
        taken between the first and the last wait: the loader's queue is empty at both ends, so
        a wave of batches that workers finished together is neither counted without its wait
        nor cut in half by the window. Otherwise the loader was never behind, and the whole
        window counts."""
        inside = [(t, w) for t, w in self.log if begin <= t <= end]
        waited = sum(w for _, w in inside)
        waits = [i for i, (_, w) in enumerate(inside) if w >= threshold_s]
        if len(waits) >= 2:
            first, last = waits[0], waits[-1]
            return (last - first) * batch / max(inside[last][0] - inside[first][0], 1e-9), waited
        return len(inside) * batch / max(end - begin, 1e-9), waited

    def close(self) -> None:
        """Shut the loader's workers down (deleting its iterator does)."""
        self.iterator = None


@contextlib.contextmanager
def _wall(into: list[tuple[float, float]]) -> Iterator[None]:
    """Record the (start, end) wall-clock times of a timed window; measure() synchronizes the
    GPU before and at the end of it, so the time is the device's too."""
    start = time.perf_counter()
    try:
        yield
    finally:
        into.append((start, time.perf_counter()))


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
    data_spec = cfg.info.get("data") if request.get("config_path") else request.get("data")
    limit = request.get("memory_limit_bytes")
    if limit and device == "cuda":
        cap_memory(int(limit))
    torch.manual_seed(seed)
    workload = build(spec)
    model = workload.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    model, optimizer = cfg.prepare(model, optimizer)
    step = cfg.train_step(model, optimizer, workload.loss_fn)
    feed = _LoaderFeed(data_spec, workload, cfg, seed) if data_spec else None
    if feed is None:
        batches = input_batches(workload, cfg.batch_size, device, input_on_device, seed)
    else:
        # the loader's first batches, cycled from memory: the same step with no loader to wait for
        batches = feed.first_batches()
    stream = iter(cfg.loader(itertools.cycle(batches)))
    last_loss: list[torch.Tensor] = []
    micro_steps = cfg.accumulation_steps

    def one_step() -> None:
        # one optimizer step: with --global-batch-size, its micro-batches (the step accumulates)
        for _ in range(micro_steps):
            x, y = next(stream)
            last_loss[:] = [step(x, y)]

    timings["build_s"] = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    monitor, windows = nvml_monitor(device, request), []
    nvml_window = (lambda: monitor.window_into(windows)) if monitor is not None else None

    loader_figures: dict[str, Any] = {}
    does_not_fit = None
    try:
        try:
            if feed is None:
                m = measure(one_step, device, settings, setup_steps=step.num_setup_steps,
                            timed_window=nvml_window)
            else:
                m, one_step, loader_figures = feed.measure(one_step, step, last_loss, settings,
                                                           nvml_window)
        finally:
            if monitor is not None:
                monitor.close()
            if feed is not None and device != "cuda":
                feed.close()  # on a GPU the profile window below still reads from it
    except Exception as exc:
        if not (request.get("fit_probe") and feed is None and is_out_of_memory(exc)):
            raise
        does_not_fit = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    if does_not_fit is not None:
        # outside the except block, so the failed step's frames (and tensors) are gone
        last_loss.clear()
        del stream, batches
        fit = largest_fit(step, workload, cfg, request["fit_probe"], seed)
        return {"status": "oom", "reason": does_not_fit, "fit": fit, "knobs": strategies.knobs_to_dict(cfg.knobs)}
    loss = float(last_loss[0].float().item())
    figures = m.to_dict()
    figures.update(memory_figures(device))
    if limit and device == "cuda" and figures["peak_memory_bytes"] > limit:
        # the allocator was capped, but memory outside it (context, library handles) grew past
        # (its peak, measured, still tells the search's memory model where the family stands)
        peak = figures["peak_memory_bytes"]
        return {"status": "oom", "reason": f"peak {peak / 2**30:.1f} GiB is over the memory limit of "
                                           f"{limit / 2**30:.1f} GiB", "fit": {"peaks": {str(cfg.batch_size): peak}}}
    figures["samples_per_s"] = cfg.batch_size * micro_steps * 1e3 / m.step_time_ms
    figures["accumulation_steps"] = micro_steps
    figures.update(loader_figures)  # with --data: the loader-fed rate is what the user gets
    figures["batch_size"] = cfg.batch_size
    figures["final_loss"] = loss
    figures["loss_finite"] = bool(torch.isfinite(torch.tensor(loss)))
    if cfg.recipe.compile_mode is not None:
        figures["compiled_graphs"] = compiled_graphs()
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
    if feed is not None:
        feed.close()
    figures.update(timings)
    return result


def cap_memory(limit_bytes: int) -> None:
    """Cap this process's CUDA memory at ``limit_bytes``, what lives outside the caching allocator
    (the CUDA context, library handles) included: the allocator gets the rest, and a step that
    needs more raises out-of-memory as on a GPU of that size (--memory-limit)."""
    free, total = torch.cuda.mem_get_info()  # makes the context, which is what lives outside
    outside = max(0, total - free - torch.cuda.memory_reserved())
    torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, (limit_bytes - outside) / total)))


def largest_fit(step, workload, cfg: TunedConfig, candidates: list[int], seed: int) -> dict[str, Any]:
    """After a step ran out of memory: the largest of ``candidates`` (smaller batches, ascending)
    at which two steps of the same configuration fit, found by bisection (a fit at b means a fit
    below b), with each fitting batch's peak. The search measures the configuration there next
    (autotune.search.memory); eager steps only, so no recompilation or graph capture is involved."""
    import gc

    device = cfg.device
    peaks: dict[int, int] = {}
    failed: list[int] = []

    def fits(batch: int) -> bool:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            stream = iter(cfg.loader(itertools.cycle(input_batches(workload, batch, device, False, seed))))
            for _ in range(cfg.accumulation_steps + 1):  # at least one optimizer step, and its state
                x, y = next(stream)
                loss = step(x, y)
            float(loss.float().item())  # waits for the GPU
        except Exception as exc:
            if is_out_of_memory(exc):
                return False
            raise
        peaks[batch] = memory_figures(device)["peak_memory_bytes"]
        return True

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


def _profile(one_step, request: dict[str, Any], batch_size: int, step_time_ms: float) -> dict[str, Any]:
    trace_path = request.get("trace_path")
    trace = record(one_step, int(request.get("profile_steps", 3)), device="cuda", chrome_trace=trace_path,
                   meta={"batch": batch_size, "step_time_ms": step_time_ms})
    if trace_path:
        _gzip_in_place(trace_path)
    return analyze(trace, step_time_ms=step_time_ms)


def nvml_monitor(device: str, request: dict[str, Any], cuda_index: int = 0):
    """An NVML monitor of this process's CUDA device ``cuda_index`` (a DDP rank's: its local rank),
    or None (CPU, or asked not to sample). NVML ignores CUDA_VISIBLE_DEVICES, so the device is
    found by its PCI bus id (autotune.trial.gpus.nvml_index)."""
    if device != "cuda" or not request.get("nvml", True):
        return None
    from autotune.trial.gpus import nvml_index
    from autotune.trial.nvml import NvmlMonitor

    return NvmlMonitor(device_index=nvml_index(cuda_index), interval_s=0.05)


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
            from autotune.accuracy.check import run_check

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
    result["preloaded"] = PRELOADED
    result["done_at"] = time.time()
    result["pid"] = os.getpid()
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, default=str)
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
