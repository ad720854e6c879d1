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
* the top kernels by time.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

# kernel name -> category. Kernel names are the libraries' own (cuDNN, cuBLAS/cuBLASLt, CUTLASS,
# PyTorch's ATen, Triton from torch.compile); the patterns were checked against traces recorded on
# an H200 (tests/fixtures/profile-*.json) and follow the libraries' naming conventions:
# Hopper/Ampere Tensor Core kernels carry xmma/hmma/wgmma/tensorop/gmma or an MMA shape such as
# 16816 in their names, with an fp16/bf16/tf32 type tag; FP32 SIMT kernels say sgemm or "fprop"
# without a Tensor Core tag.
_TENSOR_CORE = re.compile(
    r"(xmma|hmma|wgmma|gmma|tensorop|tensor_op|s16816|h16816|s1688|h1688|i8816|16x8x16|_tc_|"
    r"sm\d+_.*(f16|bf16|tf32|h16|b16)|cutlass.*(f16|bf16|tf32|half|bfloat16))", re.I)
_GEMM_CONV = re.compile(r"(gemm|conv|fprop|dgrad|wgrad|cudnn|cublas|cutlass|winograd|implicit|matmul|mm_|_mm\b|"
                        r"triton_tem|bmm)", re.I)
_LAYOUT = re.compile(r"(nchwtonhwc|nhwctonchw|nchw.*nhwc|nhwc.*nchw|transpose|permute|convert_?tensor|"
                     r"copy_kernel|direct_copy|unrolled_elementwise_kernel.*copy|contiguous|"
                     r"cudnn::.*(transform|convert)|layout|reorder)", re.I)
_ELEMENTWISE = re.compile(r"(elementwise|vectorized|batch_?norm|bn_|layer_?norm|group_?norm|softmax|relu|gelu|"
                          r"silu|sigmoid|tanh|dropout|reduce|welford|norm|add|mul|fill|foreach|fused|adam|sgd|"
                          r"triton_(poi|per|red))", re.I)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaGraphLaunch", "cuGraphLaunch")

CATEGORIES = ("tensor_core", "other_gemm_conv", "layout", "elementwise", "other_kernel")


def classify(name: str) -> str:
    """The category of one GPU kernel, from its name."""
    if _LAYOUT.search(name):
        return "layout"
    if _GEMM_CONV.search(name):
        return "tensor_core" if _TENSOR_CORE.search(name) else "other_gemm_conv"
    if _TENSOR_CORE.search(name):
        return "tensor_core"
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

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "launches": self.launches, "meta": self.meta,
                "events": [[e.name, e.kind, e.stream, e.start_ns, e.dur_ns] for e in self.events]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ProfileTrace":
        return cls(steps=int(data["steps"]), launches=int(data.get("launches", 0)), meta=dict(data.get("meta", {})),
                   events=[GpuEvent(str(n), str(k), int(s), int(t), int(d)) for n, k, s, t, d in data["events"]])


def _kind(activity: str, name: str) -> str | None:
    activity = activity.lower()
    if "memcpy" in activity or name.startswith("Memcpy"):
        return "memcpy"
    if "memset" in activity or name.startswith("Memset"):
        return "memset"
    if "kernel" in activity or "concurrent_kernel" in activity:
        return "kernel"
    return None


def from_profiler(prof: Any, steps: int, meta: dict[str, Any] | None = None) -> ProfileTrace:
    """Read a finished ``torch.profiler.profile`` through its Kineto event API."""
    from torch.autograd import DeviceType

    events: list[GpuEvent] = []
    launches = 0
    for ev in prof.profiler.kineto_results.events():
        name = ev.name()
        if ev.device_type() == DeviceType.CUDA:
            kind = _kind(str(ev.activity_type()), name)
            if kind is not None and ev.duration_ns() > 0:
                events.append(GpuEvent(name, kind, int(ev.device_resource_id()), int(ev.start_ns()),
                                       int(ev.duration_ns())))
        elif name in LAUNCH_CALLS:
            launches += 1
    events.sort(key=lambda e: e.start_ns)
    return ProfileTrace(steps=steps, events=events, launches=launches, meta=dict(meta or {}))


def record(step: Callable[[], Any], steps: int, *, device: str = "cuda", warmup: int = 1,
           chrome_trace: str | Path | None = None, meta: dict[str, Any] | None = None) -> ProfileTrace:
    """Profile ``steps`` calls of ``step`` (after ``warmup`` unrecorded ones) with torch.profiler,
    optionally writing the Chrome trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
                 record_shapes=False, with_stack=False) as prof:
        for _ in range(warmup + steps):
            step()
            sync()
            prof.step()
    if chrome_trace is not None:
        prof.export_chrome_trace(str(chrome_trace))
    return from_profiler(prof, steps, meta)


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


def analyze(trace: ProfileTrace, top: int = 10) -> dict[str, Any]:
    """Shares of the window's GPU wall time and the figures the findings use (JSON-ready)."""
    if not trace.events:
        return {"steps": trace.steps, "gpu_events": 0, "note": "no GPU activity was recorded"}
    start = min(e.start_ns for e in trace.events)
    end = max(e.end_ns for e in trace.events)
    span = max(1, end - start)
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
    return result


def save_fixture(trace: ProfileTrace, path: str | Path) -> None:
    import json

    Path(path).write_text(json.dumps(trace.to_dict(), separators=(",", ":")) + "\n")


def load_fixture(path: str | Path) -> ProfileTrace:
    import json

    return ProfileTrace.from_dict(json.loads(Path(path).read_text()))


def as_dict(event: GpuEvent) -> dict[str, Any]:
    return asdict(event)
