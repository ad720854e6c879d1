"""What a worker does for a trial's request, the probe's and the memory probe's (autotune.worker.serve
answers each in a process of its own): build the model as configured, run and time its steps, profile
them, watch the GPU (NVML), and return the figures; the probe finds what the model offers the knobs, the
memory probe the largest batch that fits."""

from __future__ import annotations

import importlib.metadata
import itertools
import os
import platform
import time
from typing import Any

import torch

import strategies
from autotune.deploy.compile_cache import save as save_compile_cache
from autotune.deploy.config import TunedConfig
from autotune.trial.batches import input_batches
from autotune.trial.instruments import compile_cache, compiled_graphs, nvml_monitor, profile_window
from autotune.trial.loader_feed import LoaderFeed
from autotune.trial.measure import Measurement, MeasureSettings, TooSlow, measure, memory_figures
from autotune.trial.memory_fit import cap_memory, forward_held, is_out_of_memory, largest_fit, peak_at
from autotune import progress
from autotune.trial.request import read_request
from autotune.workload.models import WorkloadSpec, build
from strategies.allocator import set_allocator

def provenance() -> dict[str, Any]:
    """Where a figure was measured: GPU, driver, CUDA, cuDNN, torch, CPU."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "num_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    for package in ("torchvision", "optuna"):  # their versions without importing them (torchvision: 1-3 s)
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
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
    from strategies.activation_checkpointing import num_blocks
    from strategies.attention import sdpa_calls
    from strategies.channel_alignment import misaligned_layers
    from strategies.depthwise_conv import depthwise_layers
    from strategies.fp32_layers import kinds_present
    from strategies.loss_kernel import probe as lm_head
    from strategies.optimizer_state import class_name
    from strategies.precision import fp8_eligible_share, fp8_width, supported_modes
    from strategies.stem_conv import stem_layers, stem_share
    from strategies.vocab_padding import vocab_size

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
    started = time.perf_counter()
    # an hf: model is built on the GPU, as its trials build it: a billion parameters take tens of
    # seconds to initialise on a CPU
    workload = build(WorkloadSpec.from_dict(request["workload"]), init_device=device)
    x, _ = workload.batch(2, torch.Generator().manual_seed(0))
    x = on_device_of(workload.model, x)
    seconds = {"build": time.perf_counter() - started}
    result["input_dim"] = x.dim() if isinstance(x, torch.Tensor) else None
    result["input_shape"] = list(workload.input_shape)
    result["num_parameters"] = sum(p.numel() for p in workload.model.parameters())
    # what a first torch.compile is expected to cost grows with them (autotune.search.budget)
    result["num_leaf_modules"] = sum(1 for m in workload.model.modules() if next(m.children(), None) is None)
    # what one sample is: a language model's tokens/s is samples/s times tokens_per_sample
    result.update(sample_unit=workload.sample_unit, tokens_per_sample=workload.tokens_per_sample)
    # a workload that makes its own batches (a language model's random tokens) has no held-out set
    # to evaluate in the accuracy check unless --data gives one (autotune.accuracy.study.plan)
    result["own_batches"] = workload.make_batch is not None
    result["misaligned"] = {str(m): misaligned_layers(workload.model, m) for m in (8, 16)}
    result["fp32_layer_kinds"] = kinds_present(workload.model)
    result["depthwise_convs"] = depthwise_layers(workload.model)  # the depthwise_conv knob's question
    result["stem_convs"] = stem_layers(workload.model)  # and the stem_conv knob's
    result["fp8_eligible_share"] = fp8_eligible_share(workload.model)
    result["fp8_width"] = fp8_width(workload.model)  # with the share, the planner's prior on fp8's speed
    # and on the feed-forward layers alone (strategies.fp8_layers)
    result["fp8_ff_share"] = fp8_eligible_share(workload.model, "feed-forward")
    result["fp8_ff_width"] = fp8_width(workload.model, "feed-forward")
    if request.get("forward", True):  # off when a first probe's forward killed its process
        result.update(sdpa_calls(workload.model, x))  # the attention knob's question
        if result["stem_convs"]:  # what the stem_conv move is hoped to give follows from it
            result["stem_share"] = stem_share(workload.model, x)
    # the fused loss's: an LM head whose logits the model returns as they are, the loss its cross-entropy
    result["lm_head"] = lm_head(workload, x, device=device, forward=request.get("forward", True))
    result["vocab_size"] = vocab_size(workload.model)  # language models' knobs
    result["checkpoint_blocks"] = num_blocks(workload.model)  # activation checkpointing's repeated blocks
    result["optimizer_class"] = class_name(workload.optimizer(workload.model))  # 8-bit states for Adam/AdamW only
    result["llm_kernels"] = strategies.llm_kernels.probe(workload.model, device=device)  # liger's model types
    seconds["forward"] = time.perf_counter() - started - seconds["build"]
    if request.get("check_compile"):
        from strategies.compile import check_compile

        result["compile"] = check_compile(device)
        seconds["compile_check"] = result["compile"].get("seconds")
    result["seconds"] = seconds  # where the probe's time went (the search's "probe" phase)
    return result


def on_device_of(model: torch.nn.Module, inputs: Any) -> Any:
    """``inputs`` (a tensor, or tensors in lists, tuples and dicts) on the device of ``model``'s first
    parameter: the probe's forwards run where its model was built."""
    from strategies.streams import to_device

    param = next(model.parameters(), None)
    return inputs if param is None or param.device.type == "cpu" else to_device(inputs, param.device)


class _Steps:
    """The trial's model built through TunedConfig (as user code builds it), its train step, and the
    batches that feed it: synthetic ones or, with --data, the loader's first ones, cycled from memory."""

    def __init__(self, cfg: TunedConfig, spec: WorkloadSpec, *, data_spec: Any, input_on_device: bool,
                 seed: int) -> None:
        t0 = time.perf_counter()
        torch.manual_seed(seed)
        self.workload = build(spec, init_device=cfg.device)
        if cfg.device == "cuda":
            # what building on the GPU freed goes back: kept in the pool, it raises the step's peak (half
            # a GiB for a 1B model), enough to run out of memory under a cap
            torch.cuda.empty_cache()
        model = self.workload.model
        optimizer = self.workload.optimizer(model)
        t1 = time.perf_counter()
        self.model, self.optimizer = cfg.prepare(model, optimizer)
        self.step = cfg.train_step(self.model, self.optimizer, self.workload.loss_fn)
        t2 = time.perf_counter()
        self.feed = LoaderFeed(data_spec, self.workload, cfg, seed) if data_spec else None
        if self.feed is None:
            self.batches = input_batches(self.workload, cfg.batch_size, cfg.device, input_on_device, seed)
        else:
            # the loader's first batches, cycled from memory: the same step with no loader to wait for
            self.batches = self.feed.first_batches()
        self.stream = iter(cfg.loader(itertools.cycle(self.batches)))
        # where a build's seconds go: the model and its optimizer as
        # the workload makes them, the tuned config's preparation of both (device, memory format,
        # compile wrapper) and its train step, the input batches
        self.build_parts = {"build_model_s": t1 - t0, "build_prepare_s": t2 - t1,
                            "build_batches_s": time.perf_counter() - t2}
        self.last_loss: list[torch.Tensor] = []
        self.micro_steps = cfg.accumulation_steps

    def one_step(self) -> None:
        # one optimizer step: with --global-batch-size, its micro-batches (the step accumulates)
        for _ in range(self.micro_steps):
            x, y = next(self.stream)
            self.last_loss[:] = [self.step(x, y)]

    def drop_batches(self) -> None:
        """Let the batches and the last loss go (before probing smaller batches for a fit)."""
        self.last_loss.clear()
        self.stream = self.batches = None


def run_trial(request: dict[str, Any]) -> dict[str, Any]:
    """Build the model through TunedConfig (what user code does), warm up, measure."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    trial = read_request(request)
    cfg = trial.cfg
    device = cfg.device
    seed = int(request.get("seed", 0))
    data_spec = cfg.info.get("data") if request.get("config_path") else request.get("data")
    limit = request.get("memory_limit_bytes")
    if limit and device == "cuda":
        cap_memory(int(limit))
    set_allocator(cfg.recipe)  # expandable segments before the model is built (on the GPU, for an hf: model)
    progress.say("building the model")
    t_request = time.perf_counter() - t0
    run = _Steps(cfg, trial.spec, data_spec=data_spec, input_on_device=trial.input_on_device, seed=seed)
    timings["build_s"] = time.perf_counter() - t0
    timings.update(run.build_parts, build_request_s=t_request)  # the request read, the memory cap set
    progress.say("compiling, then warming up" if run.step.num_setup_steps else "warming up and measuring")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    monitor, windows = nvml_monitor(device, request), []
    nvml_window = (lambda: monitor.window_into(windows)) if monitor is not None else None

    does_not_fit = None
    try:
        m, one_step, loader_figures = _measure(run, cfg, trial.settings, monitor, nvml_window,
                                               give_up=_give_up(request, cfg, run))
    except TooSlow as slow:
        return _screened_out(slow, request["prune_below"], cfg, run, timings)
    except Exception as exc:
        if not (request.get("fit_probe") and run.feed is None and is_out_of_memory(exc)):
            raise
        does_not_fit = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    if does_not_fit is not None:
        # outside the except block, so the failed step's frames (and tensors) are gone
        run.drop_batches()
        fit = largest_fit(run.step, run.workload, cfg, request["fit_probe"], seed)
        return {"status": "oom", "reason": does_not_fit, "fit": fit, "knobs": strategies.knobs_to_dict(cfg.knobs)}
    loss = float(run.last_loss[0].float().item())
    figures = m.to_dict()
    figures.update(memory_figures(device))
    if limit and device == "cuda" and figures["peak_memory_bytes"] > limit:
        # the allocator was capped, but memory outside it (context, library handles) grew past
        # (its peak, measured, still tells the search's memory model where the family stands)
        peak = figures["peak_memory_bytes"]
        return {"status": "oom", "reason": f"peak {peak / 2**30:.1f} GiB is over the memory limit of "
                                           f"{limit / 2**30:.1f} GiB", "fit": {"peaks": {str(cfg.batch_size): peak}}}
    _add_rate_and_loss(figures, run, cfg, m, loader_figures, loss)
    result: dict[str, Any] = {"status": "ok", "figures": figures, "knobs": strategies.knobs_to_dict(cfg.knobs)}
    if windows and windows[0] is not None:
        energy = windows[0].to_dict()
        energy["joules_per_sample"] = windows[0].joules_per_sample(m.num_timed_steps_total * cfg.batch_size)
        result["energy"] = energy
    if device == "cuda" and request.get("profile", True):
        # its own short window after the timed one: the profiler slows the host, so no reported
        # time includes it; shares are taken of the step time measured above
        t1 = time.perf_counter()
        progress.say("profiling")
        try:
            # FP8 GEMMs need widths in multiples of 16 elements, fp16/bf16 ones multiples of 8
            multiple = 16 if str(getattr(cfg.knobs.get("precision"), "mode", "")).startswith("fp8") else 8
            result["profile"] = profile_window(one_step, request, cfg.batch_size, m.step_time_ms, model=run.model,
                                               multiple=multiple)
        except Exception as exc:  # the measurement stands; only its explanation is missing
            first_line = str(exc).splitlines()[0][:300] if str(exc) else ''
            result["profile_error"] = f"{type(exc).__name__}: {first_line}"
        timings["profile_s"] = time.perf_counter() - t1
    if cfg.recipe.compile_mode is not None and request.get("compile_cache_path"):
        # after every step this process compiles: what the search keeps beside config.json if this
        # trial is recommended (autotune.search.outputs)
        t1 = time.perf_counter()
        figures["compile_archive"] = _save_compile_archive(request["compile_cache_path"], device)
        timings["compile_archive_s"] = time.perf_counter() - t1
    if run.feed is not None:
        run.feed.close()
    figures.update(timings)
    return result


def _save_compile_archive(path: str, device: str) -> dict[str, Any] | None:
    """This trial's compile artifacts saved to ``path`` (autotune.deploy.compile_cache): the
    archive's file name and size, or why it could not be saved (the measurement stands without
    it), or None where torch recorded no compile."""
    try:
        meta = save_compile_cache(path, device)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return None if meta is None else {"file": os.path.basename(path), "bytes": meta["bytes"]}


def probe_memory(request: dict[str, Any]) -> dict[str, Any]:
    """What a configuration needs at a few small batches, before any trial: two eager steps at each
    of the request's ``batches`` (ascending; the first that runs out of memory ends it, after the powers
    of two between it and the last that fit), under the memory limit. Their peaks put a line through
    the fixed part (weights, gradients, optimizer state, the CUDA context) and the per-sample part,
    which the search's memory model sizes every trial by (autotune.search.memory)."""
    t0 = time.perf_counter()
    trial = read_request(request)
    cfg = trial.cfg
    limit = request.get("memory_limit_bytes")
    if limit and cfg.device == "cuda":
        cap_memory(int(limit))
    set_allocator(cfg.recipe)  # before the model is built, as in a trial
    seed = int(request.get("seed", 0))
    batches = [int(b) for b in request["batches"]]
    peaks: dict[str, int] = {}
    try:
        run = _Steps(cfg, trial.spec, data_spec=None, input_on_device=False, seed=seed)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        return {"status": "ok", "peaks": {}, "does_not_fit_at": batches[0], "build_oom": True,
                "seconds": time.perf_counter() - t0}
    run.drop_batches()

    def step_up(sizes) -> int | None:
        """Peaks at ``sizes`` into ``peaks``, ascending; the first that does not fit ends it (returned)."""
        for batch in sizes:
            peak = peak_at(run.step, run.workload, cfg, batch, seed)
            if peak is None:
                return batch
            peaks[str(batch)] = peak
        return None

    does_not_fit_at = step_up(batches)
    if peaks and does_not_fit_at is not None:
        # the powers of two between the last that fit and the first that did not, up to the next
        # that does not either: where the base batch does not fit, the batch that does is what counts
        last = max(map(int, peaks))
        does_not_fit_at = step_up([b for b in (2 ** k for k in range(1, 12)) if last < b < does_not_fit_at]) \
            or does_not_fit_at
    result = {"status": "ok", "peaks": peaks, "does_not_fit_at": does_not_fit_at}
    if peaks and does_not_fit_at is not None:
        # the memory runs out: one batch fits (no line through the peaks), or the smaller batch's peak is
        # the optimizer's phase and the line is too flat (a large model's at 1 and 2 under a cap: about
        # half of what its forward keeps a sample), so a sample's activations are measured
        # apart, over a wider span than the peaks' (the optimizer's state and gradients are let go first)
        low, high = min(map(int, peaks)), max(map(int, peaks))
        result["forward_held"] = forward_held(run.step, run.workload, cfg, [low, 2 * high], seed)
    return {**result, "seconds": time.perf_counter() - t0}


def _give_up(request: dict[str, Any], cfg: TunedConfig, run: _Steps):
    """The warm-up's test of a window (``measure``'s ``give_up``): its samples/s below the request's
    ``prune_below`` (a share of the best so far). None without one, and with --data, whose
    loader-fed rate is only known after its own window."""
    below = request.get("prune_below")
    if not below or run.feed is not None:
        return None
    samples_ms = cfg.batch_size * run.micro_steps * 1e3
    return lambda step_ms: samples_ms / step_ms < below


def _screened_out(slow: TooSlow, below: float, cfg: TunedConfig, run: _Steps, timings: dict[str, float]
                  ) -> dict[str, Any]:
    """The result of a trial stopped in its warm-up, clearly slower than the best so far."""
    rates = [cfg.batch_size * run.micro_steps * 1e3 / ms for ms in slow.windows_ms]
    return {"status": "pruned", "knobs": strategies.knobs_to_dict(cfg.knobs),
            "reason": f"stopped early: {max(rates[-2:]):,.0f} samples/s in its last warm-up windows, below "
                      f"{below:,.0f} (clearly slower than the best so far)",
            "screening": {"windows": rates, "below": below, "warmup_s": slow.elapsed_s, **timings}}


def _measure(run: _Steps, cfg: TunedConfig, settings: MeasureSettings, monitor, nvml_window, give_up=None):
    """Time the trial's steps (with --data: fed from memory, then by the loader); returns the
    Measurement, the step the profile window repeats, and the loader figures (none without --data)."""
    device = cfg.device
    try:
        if run.feed is None:
            m = measure(run.one_step, device, settings, setup_steps=run.step.num_setup_steps,
                        timed_window=nvml_window, give_up=give_up)
            return m, run.one_step, {}
        return run.feed.measure(run.one_step, run.step, run.last_loss, settings, nvml_window)
    finally:
        if monitor is not None:
            monitor.close()
        if run.feed is not None and device != "cuda":
            run.feed.close()  # on a GPU the profile window below still reads from it


def _add_rate_and_loss(figures: dict[str, Any], run: _Steps, cfg: TunedConfig, m: Measurement,
                       loader_figures: dict[str, Any], loss: float) -> None:
    """Add the rate, the batch, the final loss and (compiled) the graphs count to the trial's figures."""
    figures["samples_per_s"] = cfg.batch_size * run.micro_steps * 1e3 / m.step_time_ms
    figures["accumulation_steps"] = run.micro_steps
    figures.update(loader_figures)  # with --data: the loader-fed rate is what the user gets
    figures["batch_size"] = cfg.batch_size
    figures["final_loss"] = loss
    figures["loss_finite"] = bool(torch.isfinite(torch.tensor(loss)))
    if cfg.recipe.compile_mode is not None:
        figures["compiled_graphs"] = compiled_graphs()
        figures["compile_cache"] = compile_cache()
