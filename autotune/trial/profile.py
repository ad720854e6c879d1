"""The torch.profiler window of a trial and its analysis: where the GPU's time goes, and why.

A trial is profiled in its own short window after the timed one (the profiler slows every op it
records, so no reported time ever includes it). The window's GPU activity is read through the
profiler's own event API (Kineto events: kernels, memcpys and memsets with their streams and
timestamps; CUDA runtime calls for launches), kept as a small list of :class:`GpuEvent` that is
JSON-serialisable, so the same analysis runs on a live window and on a trace committed as a test
fixture. The Chrome trace of the window can be written too (it opens in Perfetto).

The analysis answers what the findings need:

* the share of the window's wall time spent in Tensor Core GEMM/conv kernels, in other GEMM/conv
  kernels, in elementwise/normalization kernels, in layout conversions (NCHW<->NHWC, transposes,
  copies), in exposed memcpy, and idle (no kernel or copy on any stream: CPU or launch bound);
* kernels launched per step, and the host->device copy time that overlaps compute on another
  stream (what decides whether the stream knob pays);
* the top kernels by time;
* the GEMMs and convolutions on widths that are not multiples of 8 (``autotune.trial.gemm_shapes``):
  which layers, their dimensions and their share of the step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from autotune.trial import gemm_shapes

# kernel name -> category. Kernel names are the libraries' own (cuDNN, cuBLAS/cuBLASLt, CUTLASS,
# PyTorch's ATen, Triton from torch.compile); the patterns are checked against recorded traces
# (tests/fixtures/profile-*.json.gz). A Tensor Core kernel names its MMA instruction
# (hmma, wgmma/gmma, imma, tensorop, an MMA shape such as 16816 or tensor16x8x16) or a half/tf32
# operand type (f16, bf16, tf32); cuDNN's and cuBLAS's FP32 kernels are "xmma" kernels too, but
# they say ffma (SIMT fused multiply-add) and f32 operands, and are not. cuBLASLt's Hopper GEMMs
# ("nvjet_sm90_...") carry no type in their name; they are its Tensor Core kernels.
_TENSOR_CORE = re.compile(r"(hmma|wgmma|gmma|imma|tensorop|tensor_op|tensor\d+x\d+x\d+|16816|1688|884|_tc_|nvjet|"
                          r"(?<![a-z])(f16|bf16|tf32|h16|fp16|e4m3|e5m2)|half|bfloat16)", re.I)
_SIMT = re.compile(r"ffma|sgemm|f32f32_f32f32_f32", re.I)
_GEMM_CONV = re.compile(r"(gemm|conv(?!ert)|convolve|fprop|dgrad|wgrad|cublas|cutlass|winograd|implicit|matmul|"
                        r"xmma|triton_tem|bmm|mm_kernel|splitk|fft2d|nvjet|sdpa|flash|fmha|attention)", re.I)
_LAYOUT = re.compile(r"(nchwtonhwc|nhwctonchw|nchw_to_nhwc|nhwc_to_nchw|transpose|(?<!No)permute|flip_filter|"
                     r"reorder|nchw2nhwc|nhwc2nchw|region_transform|foldednchw|nchwtofolded|addpadding)", re.I)
_ELEMENTWISE = re.compile(r"(elementwise|vectorized|bn_|batch_?norm|layer_?norm|group_?norm|norm|gammabeta|softmax|relu|"
                          r"gelu|silu|sigmoid|tanh|dropout|reduce|welford|scale|add|mul|fill|copy|cast|foreach|"
                          r"multi_tensor|fused|adam|sgd|pool|triton_(poi|per|red))", re.I)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaGraphLaunch", "cuGraphLaunch")

CATEGORIES = ("tensor_core", "other_gemm_conv", "layout", "elementwise", "other_kernel")


def classify(name: str) -> str:
    """The category of one GPU kernel, from its name: tensor_core, other_gemm_conv, layout,
    elementwise (normalization, activations, pooling, casts, optimizer updates) or other_kernel."""
    if re.match(r"triton_(poi|per|red)_", name):
        return "elementwise"  # Triton's fused pointwise/reduction kernels, though named after the ops they fuse
    if _LAYOUT.search(name):
        return "layout"
    if re.search(r"cudnn::(bn_|batchnorm)|bn_fw|bn_bw", name, re.I):
        return "elementwise"  # cuDNN's batch-norm kernels live in its namespace, next to its convs
    if _GEMM_CONV.search(name):
        return "tensor_core" if _TENSOR_CORE.search(name) and not _SIMT.search(name) else "other_gemm_conv"
    if _ELEMENTWISE.search(name):
        return "elementwise"
    return "other_kernel"


@dataclass(frozen=True)
class GpuEvent:
    """One kernel, memcpy or memset on the GPU's timeline."""

    name: str
    kind: str
    """"kernel", "memcpy" or "memset"."""
    stream: int
    start_ns: int
    dur_ns: int

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.dur_ns


@dataclass
class ProfileTrace:
    """The GPU activity of a profiled window of ``steps`` training steps."""

    steps: int
    events: list[GpuEvent] = field(default_factory=list)
    launches: int = 0
    """CUDA kernel (and graph) launch calls made by the host during the window."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Where it was recorded: GPU, torch, the configuration."""
    ops: list[list[Any]] | None = None
    """The window's GEMM/conv ops, ``[op, input shapes, time_ns, calls]`` (``gemm_shapes.collect``);
    None when shapes were not recorded."""
    layers: list[list[Any]] = field(default_factory=list)
    """The model's layers and their widths (``gemm_shapes.model_layers``), to name the ops' layers."""
    host_ns: int = 0
    """The host time of the window's steps: what the ops' CPU time is a share of on a CPU."""

    def to_dict(self) -> dict[str, Any]:
        shapes = {"ops": self.ops, "layers": self.layers, "host_ns": self.host_ns} if self.ops is not None else {}
        return {"steps": self.steps, "launches": self.launches, "meta": self.meta, **shapes,
                "events": [[e.name, e.kind, e.stream, e.start_ns, e.dur_ns] for e in self.events]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ProfileTrace":
        return cls(steps=int(data["steps"]), launches=int(data.get("launches", 0)), meta=dict(data.get("meta", {})),
                   events=[GpuEvent(str(n), str(k), int(s), int(t), int(d)) for n, k, s, t, d in data["events"]],
                   ops=data.get("ops"), layers=list(data.get("layers", [])), host_ns=int(data.get("host_ns", 0)))


def _kind(name: str) -> str:
    if name.startswith("Memcpy"):
        return "memcpy"
    if name.startswith("Memset"):
        return "memset"
    return "kernel"


def _is_annotation(ev: Any, host_names: set[str]) -> bool:
    """Whether a GPU-side event is a range (``ProfilerStep#N``, ``Optimizer.step#SGD.step``), not work.

    Kineto says so itself (``is_user_annotation``). Only where torch does not expose that is the
    name used: a GPU range shares its name with the host-side range that opened it. Names alone are
    not enough where both exist: inductor wraps every Triton kernel launch in a host-side range
    named like the kernel, and those kernels are half of a compiled step's GPU time."""
    if hasattr(ev, "is_user_annotation"):
        return bool(ev.is_user_annotation())
    return ev.name() in host_names or ev.name().startswith("ProfilerStep#")


def from_profiler(prof: Any, steps: int, meta: dict[str, Any] | None = None, *, device: str = "cuda",
                  layers: list[list[Any]] | None = None) -> ProfileTrace:
    """Read a finished ``torch.profiler.profile`` through its Kineto event API.

    GPU-side user annotations are ranges, not work, and are left out (:func:`_is_annotation`).
    A window recorded with shapes keeps its GEMM/conv ops (their GPU time on ``device`` "cuda",
    their CPU time otherwise) and ``layers``, the model's, to name them."""
    from torch.autograd import DeviceType

    raw = list(prof.profiler.kineto_results.events())
    host_names = {ev.name() for ev in raw if ev.device_type() != DeviceType.CUDA}
    events: list[GpuEvent] = []
    launches = 0
    for ev in raw:
        name = ev.name()
        if ev.device_type() == DeviceType.CUDA:
            if not _is_annotation(ev, host_names) and ev.duration_ns() > 0:
                events.append(GpuEvent(name, _kind(name), int(ev.device_resource_id()), int(ev.start_ns()),
                                       int(ev.duration_ns())))
        elif name in LAUNCH_CALLS:
            launches += 1
    events.sort(key=lambda e: e.start_ns)
    trace = ProfileTrace(steps=steps, events=events, launches=launches, meta=dict(meta or {}))
    if getattr(prof, "record_shapes", False):  # a window recorded with shapes
        trace.ops, trace.host_ns = gemm_shapes.collect(raw, on_gpu=device == "cuda")
        trace.layers = list(layers or [])
    return trace


def record(step: Callable[[], Any], steps: int, *, device: str = "cuda", warmup: int = 1,
           chrome_trace: str | Path | None = None, meta: dict[str, Any] | None = None,
           shapes: bool = True, model: Any = None) -> ProfileTrace:
    """Profile ``steps`` calls of ``step`` (after ``warmup`` unrecorded ones) with torch.profiler,
    optionally writing the Chrome trace. With ``shapes``, the ops' input shapes are recorded, and the
    GEMMs and convolutions kept with the layers of ``model`` (the step's) that they compute."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
                 record_shapes=shapes, with_stack=False) as prof:
        for _ in range(warmup + steps):
            step()
            sync()
            prof.step()
    if chrome_trace is not None:
        prof.export_chrome_trace(str(chrome_trace))
    layers = gemm_shapes.model_layers(model) if shapes and model is not None else None
    return from_profiler(prof, steps, meta, device=device, layers=layers)


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in intervals)


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def analyze(trace: ProfileTrace, top: int = 10, *, step_time_ms: float | None = None,
            multiple: int = 8) -> dict[str, Any]:
    """Shares of the GPU's wall time per step and the figures the findings use (JSON-ready).

    ``step_time_ms``: the step time measured without the profiler (CUDA events). The profiler
    slows the host, so under it the gaps between kernels grow while the kernels themselves keep
    their durations; with the timed step as the denominator, the idle share is the one of the
    real step, not of the profiled one. Without it, shares are of the profiled window's span.

    A window recorded with shapes also gives the GEMMs and convolutions whose widths are not
    multiples of ``multiple`` (:func:`gemm_shapes.misaligned`), as shares of the same span; on a
    CPU (no GPU activity), as shares of the steps' host time.
    """
    if not trace.events:
        result = {"steps": trace.steps, "gpu_events": 0, "note": "no GPU activity was recorded"}
        if trace.ops is not None and trace.host_ns:
            result.update(gemm_shapes.misaligned(trace.ops, trace.layers, multiple, trace.host_ns))
        return result
    start = min(e.start_ns for e in trace.events)
    end = max(e.end_ns for e in trace.events)
    span = max(1, end - start)
    profiled_span = span
    kernels = [e for e in trace.events if e.kind == "kernel"]
    copies = [e for e in trace.events if e.kind in ("memcpy", "memset")]
    kernel_busy = _union((e.start_ns, e.end_ns) for e in kernels)
    busy = _union([(e.start_ns, e.end_ns) for e in trace.events])
    per_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    per_kernel: dict[str, list[int]] = {}
    for e in kernels:
        per_category[classify(e.name)] += e.dur_ns
        stats = per_kernel.setdefault(e.name, [0, 0])
        stats[0] += e.dur_ns
        stats[1] += 1
    kernel_time = max(1, sum(per_category.values()))
    if step_time_ms is not None:
        # never below the busy time: a step cannot be shorter than its GPU work
        span = max(_length(busy), int(step_time_ms * 1e6 * trace.steps), 1)
    # kernels of one stream never overlap, so category time is wall time unless several streams
    # compute at once; scale so the kernel shares add up to the kernels' union, never above it
    scale = _length(kernel_busy) / kernel_time
    h2d = [e for e in copies if "htod" in e.name.lower().replace(" ", "") or "host to device" in e.name.lower()]
    h2d_union = _union((e.start_ns, e.end_ns) for e in h2d)
    copy_union = _union((e.start_ns, e.end_ns) for e in copies)
    exposed_copy = _length(copy_union) - _overlap(copy_union, kernel_busy)
    compute_streams = {e.stream for e in kernels}
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    result: dict[str, Any] = {
        "steps": trace.steps,
        "gpu_time_per_step_ms": span / trace.steps / 1e6,
        "profiled_step_ms": profiled_span / trace.steps / 1e6,
        "busy_ms_per_step": _length(busy) / trace.steps / 1e6,
        "timed": step_time_ms is not None,
        "tensor_core_share": per_category["tensor_core"] * scale / span,
        "other_gemm_conv_share": per_category["other_gemm_conv"] * scale / span,
        "elementwise_share": per_category["elementwise"] * scale / span,
        "layout_share": per_category["layout"] * scale / span,
        "other_kernel_share": per_category["other_kernel"] * scale / span,
        "memcpy_share": exposed_copy / span,
        "idle_share": 1 - _length(busy) / span,
        "tensor_core_of_gemm_conv": (per_category["tensor_core"]
                                     / max(1, per_category["tensor_core"] + per_category["other_gemm_conv"])),
        "kernels_per_step": len(kernels) / trace.steps,
        "launches_per_step": trace.launches / trace.steps,
        "h2d_ms_per_step": _length(h2d_union) / trace.steps / 1e6,
        "copy_overlap": (_overlap(h2d_union, kernel_busy) / _length(h2d_union)) if h2d_union else None,
        "streams": len(compute_streams | {e.stream for e in copies}),
        "top_kernels": [{"name": name, "category": classify(name), "share": t * scale / span,
                         "calls_per_step": n / trace.steps, "ms_per_step": t / trace.steps / 1e6}
                        for name, (t, n) in ranked],
    }
    if trace.ops is not None:
        result.update(gemm_shapes.misaligned(trace.ops, trace.layers, multiple, span))
    return result


def save_fixture(trace: ProfileTrace, path: str | Path) -> None:
    """Write a trace as (gzipped, when the name ends in .gz) JSON."""
    import gzip
    import json

    text = json.dumps(trace.to_dict(), separators=(",", ":")) + "\n"
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        Path(path).write_text(text)


def load_fixture(path: str | Path) -> ProfileTrace:
    import gzip
    import json

    if str(path).endswith(".gz"):
        with gzip.open(path, "rt") as f:
            return ProfileTrace.from_dict(json.load(f))
    return ProfileTrace.from_dict(json.loads(Path(path).read_text()))
