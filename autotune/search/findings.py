"""Findings: plain-language explanations of a trial's profile and NVML figures, each with the
configuration change it suggests.

Every rule reads only measured figures (the profile analysis of ``autotune.trial.profile``, the NVML
window of ``autotune.trial.nvml``, the layers the probe found misaligned) and the trial's own knobs; it
fires only past a threshold that makes the effect worth a trial, and names the change (as Optuna
parameters) that would remove the cause. The search queues those suggestions (the steering), the
report prints the texts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from autotune.trial.measure import DATA_WAIT_SHARE

# thresholds: a share of the window's GPU wall time (or of NVML samples) worth acting on
LAYOUT_SHARE = 0.05
IDLE_SHARE = 0.15
EXPOSED_COPY_SHARE = 0.05
NON_TENSOR_CORE_SHARE = 0.20
ELEMENTWISE_SHARE = 0.30
POWER_CAP_SHARE = 0.20
THERMAL_SHARE = 0.05
DDP_EFFICIENCY = 0.90
"""A DDP step whose per-GPU rate is below this share of the same step alone on one GPU spends
enough on its gradient all-reduces to try DDP's own settings (on two H200s, ResNet-18 at batch
128 ran at 70% with PyTorch's defaults and 89% with 100 MB buckets, bucket views and static_graph)."""
CONTENTION_WAIT_SHARE = DATA_WAIT_SHARE
"""A data-bound step with workers that waited for its batches less than this share of the time
was slowed by the workers' CPU use, not by their pace: the remedy is fewer of them."""


@dataclass(frozen=True)
class Finding:
    rule: str
    """Which rule fired (stable id, for tests and for counting)."""
    text: str
    """One sentence for the report."""
    suggest: dict[str, Any] = field(default_factory=dict)
    """Optuna parameters to change (on top of the trial's own) to try the remedy; empty when the
    finding explains but has no knob to turn (thermal throttling, say)."""

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "text": self.text, "suggest": dict(self.suggest)}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def derive(profile: Mapping[str, Any] | None, energy: Mapping[str, Any] | None, knobs: Mapping[str, Any],
           *, misaligned: list[str] | None = None, offered: Mapping[str, list[Any]] | None = None,
           figures: Mapping[str, Any] | None = None) -> list[Finding]:
    """The findings of one trial.

    ``profile``: ``autotune.trial.profile.analyze`` output; ``energy``: an ``NvmlWindow.to_dict()``;
    ``knobs``: the trial's knob dicts (strategy -> fields); ``misaligned``: layers whose widths are
    not multiples of 8 (from the probe); ``offered``: parameter -> the values the search space
    offers, so a suggestion never names a value the space does not have; ``figures``: the
    worker's figures (with --data, the loader-fed and compute-only rates).
    """
    offered = offered or {}

    def can(param: str, value: Any) -> bool:
        return param not in offered or value in offered[param]

    def knob(strategy: str, key: str, default: Any = None) -> Any:
        return (knobs.get(strategy) or {}).get(key, default)

    precision = knob("precision", "mode", "fp32")
    memory_format = knob("memory_format", "format", "contiguous")
    streams = knob("streams", "num_streams", 1)
    batch = knob("batch_size", "batch_size")
    graphs = knob("cuda_graphs", "enabled", False)
    compile_mode = knob("compile", "mode", "off")
    out: list[Finding] = []
    f = figures or {}
    if compile_mode != "off" and f.get("compiled_graphs") == 0:
        out.append(Finding("compile-inert", f"torch.compile ({compile_mode}) compiled no graph in this trial: the "
                                            "model ran eagerly, so these are eager figures "
                                            "(TORCH_LOGS=graph_breaks,recompiles says why)"))
    if f.get("data_bound"):
        # first: while the loader starves the step, no other remedy shows in the throughput
        workers = knob("dataloader", "num_workers", 0)
        fed, compute = f.get("loader_fed_samples_per_s"), f.get("compute_only_samples_per_s")
        more = sorted(w for w in offered.get("dataloader.num_workers", []) if w > workers)
        if more and fed and compute:
            # each process decodes about fed / max(workers, 1) samples/s: enough of them for the
            # compute-only rate, or as many as the space offers
            needed = math.ceil(max(workers, 1) * compute / fed)
            more = [next((w for w in more if w >= needed), more[-1])]
        rates = (f" ({fed:,.0f} samples/s delivered, {compute:,.0f} samples/s possible)"
                 if fed is not None and compute is not None else "")
        wait = f.get("loader_wait_share")
        waited = ""
        if wait is not None:
            waited = f"; the step waits for its next batch {_pct(wait)} of the time"
            if wait < 0.5 and workers:
                # the rest of the loss is CPU time the loader's processes take from the step itself
                waited += ", and the loader's workers compete with it for the CPUs"
        fewer = sorted(w for w in offered.get("dataloader.num_workers", []) if 0 < w < workers)
        if workers and wait is not None and wait < CONTENTION_WAIT_SHARE and fewer:
            # batches were ready, yet the step ran slower than fed from memory: the workers' decoding
            # takes the CPU time the training process needs (on the H200 host, 32 workers on 32 cores
            # waited 0.4% and delivered 3,211 of 5,485 samples/s); try half as many
            half = next((w for w in reversed(fewer) if w <= workers // 2), fewer[0])
            out.append(Finding("data-bound", f"data-bound: the DataLoader slows the step{rates}; the step waits "
                                             f"for its next batch {_pct(wait)} of the time, so its {workers} "
                                             "workers take CPU time from the training process: "
                                             f"{half} workers would leave it more",
                               {"dataloader.num_workers": half}))
        elif more:
            out.append(Finding("data-bound", f"data-bound: the DataLoader slows the step{rates}{waited}; "
                                             f"{more[0]} loader workers would decode more in parallel",
                               {"dataloader.num_workers": more[0]}))
        else:
            out.append(Finding("data-bound", f"data-bound: the DataLoader slows the step{rates}{waited}, "
                                             f"even with {workers} workers: a faster decode (DALI, smaller or "
                                             "pre-resized images) would help"))
    efficiency = f.get("scaling_efficiency")
    if efficiency is not None and (f.get("ddp_world_size") or 1) > 1 and efficiency < DDP_EFFICIENCY:
        # the all-reduces are not hidden behind the backward pass: DDP's own settings cut their cost
        suggest = {}
        buckets = sorted(offered.get("ddp.bucket_cap_mb", []))
        if buckets and knob("ddp", "bucket_cap_mb", 25) < buckets[-1]:
            suggest["ddp.bucket_cap_mb"] = buckets[-1]  # fewer, larger all-reduces
        if not knob("ddp", "gradient_as_bucket_view", False) and True in offered.get("ddp.gradient_as_bucket_view", []):
            suggest["ddp.gradient_as_bucket_view"] = True  # no gradient copy into the buckets
        if (not knob("ddp", "static_graph", False) and compile_mode == "off"
                and True in offered.get("ddp.static_graph", [])):
            suggest["ddp.static_graph"] = True  # no per-step search for unused parameters
        words = {"ddp.bucket_cap_mb": f"{suggest.get('ddp.bucket_cap_mb')} MB buckets",
                 "ddp.gradient_as_bucket_view": "gradient_as_bucket_view", "ddp.static_graph": "static_graph"}
        per, single = f.get("per_gpu_samples_per_s"), f.get("single_gpu_samples_per_s")
        rates = f" ({per:,.0f} vs {single:,.0f} samples/s)" if per and single else ""
        out.append(Finding("ddp-scaling", f"each GPU trains at {_pct(efficiency)} of its speed alone under DDP"
                                          f"{rates}: the gradient all-reduces are not hidden behind the backward "
                                          "pass" + (f"; {', '.join(words[k] for k in suggest)} would cut DDP's "
                                                    "overhead" if suggest else
                                                    "; a larger batch per GPU would hide more of them"),
                           suggest))
    p = profile or {}
    if p.get("steps"):
        layout = p.get("layout_share") or 0.0
        if layout >= LAYOUT_SHARE:
            if memory_format == "contiguous" and can("memory_format.format", "channels_last"):
                out.append(Finding("layout", f"{_pct(layout)} of GPU time is in layout conversions (NCHW<->NHWC, "
                                             "transposes): channels_last removes most of them",
                                   {"memory_format.format": "channels_last"}))
            else:
                out.append(Finding("layout", f"{_pct(layout)} of GPU time is still in layout conversions with "
                                             f"{memory_format}: some layers take the other layout"))
        idle = p.get("idle_share") or 0.0
        if idle >= IDLE_SHARE:
            suggest: dict[str, Any] = {}
            remedies = []
            if batch and can("batch_size.batch_size", batch * 2) and "batch_size.batch_size" in offered:
                suggest["batch_size.batch_size"] = batch * 2
                remedies.append(f"batch {batch * 2}")
            if not graphs and compile_mode == "off" and can("cuda_graphs.enabled", True) and "cuda_graphs.enabled" in offered:
                suggest["cuda_graphs.enabled"] = True
                remedies.append("CUDA graphs")
            launches = p.get("launches_per_step")
            per = f" ({launches:.0f} launches per step)" if launches else ""
            out.append(Finding("idle", f"the GPU is idle {_pct(idle)} of each step{per}: the host cannot keep it "
                                       "fed (launch or CPU bound)" + (f"; {' or '.join(remedies)} would help"
                                                                      if remedies else ""), suggest))
        exposed = p.get("memcpy_share") or 0.0
        overlap = p.get("copy_overlap")
        if exposed >= EXPOSED_COPY_SHARE:
            if streams == 1 and can("streams.num_streams", 2) and "streams.num_streams" in offered:
                out.append(Finding("copies", f"host-to-device copies take {_pct(exposed)} of the step in series with "
                                             "compute: a side stream (2 streams) would overlap them",
                                   {"streams.num_streams": 2}))
            else:
                shown = f", {_pct(overlap)} of them overlapped" if overlap is not None else ""
                out.append(Finding("copies", f"host-to-device copies still cost {_pct(exposed)} of the step{shown}: "
                                             "time the side stream does not hide; smaller inputs (uint8 images, "
                                             "normalised on the GPU) would cut it"))
        elif streams > 1 and overlap is not None and overlap >= 0.5:
            out.append(Finding("copies-hidden", f"{_pct(overlap)} of the host-to-device copy time runs under "
                                                "compute on the side stream"))
        simt = p.get("other_gemm_conv_share") or 0.0
        if simt >= NON_TENSOR_CORE_SHARE:
            if precision == "fp32":
                mode = next((m for m in ("bf16", "fp16", "tf32") if can("precision.mode", m)), None)
                out.append(Finding("no-tensor-cores", f"{_pct(simt)} of GPU time is in FP32 GEMM/conv kernels "
                                                      "without Tensor Cores" + (f": {mode} would use them" if mode else ""),
                                   {"precision.mode": mode} if mode else {}))
            elif misaligned:
                shown = ", ".join(misaligned[:3]) + (f" and {len(misaligned) - 3} more" if len(misaligned) > 3 else "")
                suggest = {"channel_alignment.multiple": 8} if can("channel_alignment.multiple", 8) else {}
                out.append(Finding("misaligned", f"{_pct(simt)} of GPU time is in GEMM/conv kernels without Tensor "
                                                 f"Cores under {precision}: {shown} have widths that are not multiples "
                                                 "of 8; padding them lets Tensor Cores run", suggest))
        elementwise = p.get("elementwise_share") or 0.0
        if elementwise >= ELEMENTWISE_SHARE and compile_mode == "off":
            suggest = {"compile.mode": "default"} if can("compile.mode", "default") and "compile.mode" in offered else {}
            out.append(Finding("elementwise", f"{_pct(elementwise)} of GPU time is in elementwise and normalization "
                                              "kernels (memory bound)" + ("; torch.compile fuses them" if suggest else ""),
                               suggest))
    e = energy or {}
    throttle = e.get("throttle") or {}
    cap = throttle.get("power_cap", 0.0)
    if cap >= POWER_CAP_SHARE:
        watts = e.get("avg_power_w")
        at = f" at {watts:.0f} W" if watts else ""
        clocks = e.get("avg_sm_clock_mhz")
        clock = f" (SM clock {clocks:,.0f} MHz on average)" if clocks else ""
        out.append(Finding("power-cap", f"power-capped{at} for {_pct(cap)} of the measured window{clock}: the GPU "
                                        "runs at its power limit, so work that moves or computes less per sample "
                                        "(lower precision, fused kernels) is what speeds it up and saves energy"))
    thermal = max(throttle.get(k, 0.0) for k in ("hw_thermal", "sw_thermal", "hw_slowdown")) if throttle else 0.0
    if thermal >= THERMAL_SHARE:
        temp = e.get("max_temperature_c")
        out.append(Finding("thermal", f"thermally throttled for {_pct(thermal)} of the measured window"
                                      + (f" (up to {temp:.0f} C)" if temp else "") + ": the figures of this trial "
                                      "understate what a cool GPU does"))
    return out
