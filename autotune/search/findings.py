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
from typing import Any, Callable, Mapping

import strategies


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
enough on its gradient all-reduces to try DDP's own settings (larger buckets, bucket views and
static_graph can take a small model on two GPUs from about 70% to about 90%)."""
MISALIGNED_SHARE = 0.05
"""A share of the step in GEMMs and convolutions on widths off the Tensor Cores' multiple worth a padded trial."""
TENSOR_CORE_MULTIPLE = {"fp16": 8, "bf16": 8, "fp8": 16}
"""The width multiple (in elements) each precision's Tensor Core GEMMs need: 16 bytes of fp16/bf16,
16 of FP8 (torch._scaled_mm's rule)."""
VOCAB_MULTIPLE = 64
"""What vocab_padding pads a vocabulary to (nanoGPT's 50,257 -> 50,304)."""
CONTENTION_WAIT_SHARE = 0.05
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


@dataclass(frozen=True)
class Evidence:
    """What the rules read of one trial (see ``derive`` for each field); every rule takes it."""

    profile: Mapping[str, Any]
    energy: Mapping[str, Any]
    knobs: Mapping[str, Any]
    misaligned: list[str] | None
    offered: Mapping[str, list[Any]]
    figures: Mapping[str, Any]

    def can(self, param: str, value: Any) -> bool:
        """Whether a suggestion may name ``value``: the space offers it, or the parameter is not offered at all."""
        return param not in self.offered or value in self.offered[param]

    def knob(self, strategy: str, key: str, default: Any = None) -> Any:
        return (self.knobs.get(strategy) or {}).get(key, default)


def compile_inert(x: Evidence) -> list[Finding]:
    compile_mode = x.knob("compile", "mode", "off")
    if compile_mode != "off" and x.figures.get("compiled_graphs") == 0:
        return [Finding("compile-inert", f"torch.compile ({compile_mode}) compiled no graph in this trial: the "
                                         "model ran eagerly, so these are eager figures "
                                         "(TORCH_LOGS=graph_breaks,recompiles says why)")]
    return []


def data_bound(x: Evidence) -> list[Finding]:
    # first after compile-inert: while the loader starves the step, no other remedy shows in the throughput
    f, offered = x.figures, x.offered
    if not f.get("data_bound"):
        return []
    workers = x.knob("dataloader", "num_workers", 0)
    fed, compute = f.get("loader_fed_samples_per_s"), f.get("compute_only_samples_per_s")
    more = sorted(w for w in offered.get(strategies.dataloader.NUM_WORKERS_PARAM, []) if w > workers)
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
    fewer = sorted(w for w in offered.get(strategies.dataloader.NUM_WORKERS_PARAM, []) if 0 < w < workers)
    if workers and wait is not None and wait < CONTENTION_WAIT_SHARE and fewer:
        # batches were ready, yet the step ran slower than fed from memory: the workers' decoding
        # takes the CPU time the training process needs (as many workers as cores can deliver little
        # more than half of what the step takes); try half as many
        half = next((w for w in reversed(fewer) if w <= workers // 2), fewer[0])
        return [Finding("data-bound", f"data-bound: the DataLoader slows the step{rates}; the step waits "
                                      f"for its next batch {_pct(wait)} of the time, so its {workers} "
                                      "workers take CPU time from the training process: "
                                      f"{half} workers would leave it more",
                        {strategies.dataloader.NUM_WORKERS_PARAM: half})]
    if more:
        return [Finding("data-bound", f"data-bound: the DataLoader slows the step{rates}{waited}; "
                                      f"{more[0]} loader workers would decode more in parallel",
                        {strategies.dataloader.NUM_WORKERS_PARAM: more[0]})]
    return [Finding("data-bound", f"data-bound: the DataLoader slows the step{rates}{waited}, "
                                  f"even with {workers} workers: a faster decode (DALI, smaller or "
                                  "pre-resized images) would help")]


def ddp_scaling(x: Evidence) -> list[Finding]:
    f, offered = x.figures, x.offered
    efficiency = f.get("scaling_efficiency")
    if not (efficiency is not None and (f.get("ddp_world_size") or 1) > 1 and efficiency < DDP_EFFICIENCY):
        return []
    # the all-reduces are not hidden behind the backward pass: DDP's own settings cut their cost
    suggest = {}
    bucket, view, static = (strategies.ddp.BUCKET_CAP_MB_PARAM, strategies.ddp.GRADIENT_AS_BUCKET_VIEW_PARAM,
                            strategies.ddp.STATIC_GRAPH_PARAM)
    buckets = sorted(offered.get(bucket, []))
    if buckets and x.knob("ddp", "bucket_cap_mb", 25) < buckets[-1]:
        suggest[bucket] = buckets[-1]  # fewer, larger all-reduces
    if not x.knob("ddp", "gradient_as_bucket_view", False) and True in offered.get(view, []):
        suggest[view] = True  # no gradient copy into the buckets
    if (not x.knob("ddp", "static_graph", False) and x.knob("compile", "mode", "off") == "off"
            and True in offered.get(static, [])):
        suggest[static] = True  # no per-step search for unused parameters
    words = {bucket: f"{suggest.get(bucket)} MB buckets", view: "gradient_as_bucket_view", static: "static_graph"}
    per, single = f.get("per_gpu_samples_per_s"), f.get("single_gpu_samples_per_s")
    rates = f" ({per:,.0f} vs {single:,.0f} samples/s)" if per and single else ""
    return [Finding("ddp-scaling", f"each GPU trains at {_pct(efficiency)} of its speed alone under DDP"
                                   f"{rates}: the gradient all-reduces are not hidden behind the backward "
                                   "pass" + (f"; {', '.join(words[k] for k in suggest)} would cut DDP's "
                                             "overhead" if suggest else
                                             "; a larger batch per GPU would hide more of them"),
                    suggest)]


# the profile's rules (layout to elementwise) read a profiled window: nothing without its steps


def layout(x: Evidence) -> list[Finding]:
    p = x.profile
    if not p.get("steps"):
        return []
    share = p.get("layout_share") or 0.0
    if not share >= LAYOUT_SHARE:  # `not >=`, not `<` (here and below): a NaN share fires no rule
        return []
    memory_format = x.knob("memory_format", "format", "contiguous")
    if memory_format == "contiguous" and x.can(strategies.memory_format.FORMAT_PARAM, "channels_last"):
        return [Finding("layout", f"{_pct(share)} of GPU time is in layout conversions (NCHW<->NHWC, "
                                  "transposes): channels_last removes most of them",
                        {strategies.memory_format.FORMAT_PARAM: "channels_last"})]
    return [Finding("layout", f"{_pct(share)} of GPU time is still in layout conversions with "
                              f"{memory_format}: some layers take the other layout")]


def idle(x: Evidence) -> list[Finding]:
    p, offered = x.profile, x.offered
    if not p.get("steps"):
        return []
    share = p.get("idle_share") or 0.0
    if not share >= IDLE_SHARE:
        return []
    batch = x.knob("batch_size", "batch_size")
    suggest: dict[str, Any] = {}
    remedies = []
    size, graphs = strategies.batch_size.BATCH_SIZE_PARAM, strategies.cuda_graphs.ENABLED_PARAM
    if batch and x.can(size, batch * 2) and size in offered:
        suggest[size] = batch * 2
        remedies.append(f"batch {batch * 2}")
    if (not x.knob("cuda_graphs", "enabled", False) and x.knob("compile", "mode", "off") == "off"
            and x.can(graphs, True) and graphs in offered):
        suggest[graphs] = True
        remedies.append("CUDA graphs")
    launches = p.get("launches_per_step")
    per = f" ({launches:.0f} launches per step)" if launches else ""
    return [Finding("idle", f"the GPU is idle {_pct(share)} of each step{per}: the host cannot keep it "
                            "fed (launch or CPU bound)" + (f"; {' or '.join(remedies)} would help"
                                                           if remedies else ""), suggest)]


def copies(x: Evidence) -> list[Finding]:
    p = x.profile
    if not p.get("steps"):
        return []
    streams = x.knob("streams", "num_streams", 1)
    exposed = p.get("memcpy_share") or 0.0
    overlap = p.get("copy_overlap")
    if exposed >= EXPOSED_COPY_SHARE:
        side = strategies.streams.NUM_STREAMS_PARAM
        if streams == 1 and x.can(side, 2) and side in x.offered:
            return [Finding("copies", f"host-to-device copies take {_pct(exposed)} of the step in series with "
                                      "compute: a side stream (2 streams) would overlap them",
                            {side: 2})]
        shown = f", {_pct(overlap)} of them overlapped" if overlap is not None else ""
        return [Finding("copies", f"host-to-device copies still cost {_pct(exposed)} of the step{shown}: "
                                  "time the side stream does not hide; smaller inputs (uint8 images, "
                                  "normalised on the GPU) would cut it")]
    if streams > 1 and overlap is not None and overlap >= 0.5:
        return [Finding("copies-hidden", f"{_pct(overlap)} of the host-to-device copy time runs under "
                                         "compute on the side stream")]
    return []


def without_tensor_cores(x: Evidence) -> list[Finding]:
    p, misaligned = x.profile, x.misaligned
    if not p.get("steps"):
        return []
    simt = p.get("other_gemm_conv_share") or 0.0
    if not simt >= NON_TENSOR_CORE_SHARE:
        return []
    precision = x.knob("precision", "mode", "fp32")
    if precision == "fp32":
        mode = next((m for m in ("bf16", "fp16", "tf32") if x.can(strategies.precision.MODE_PARAM, m)), None)
        return [Finding("no-tensor-cores", f"{_pct(simt)} of GPU time is in FP32 GEMM/conv kernels "
                                           "without Tensor Cores" + (f": {mode} would use them" if mode else ""),
                        {strategies.precision.MODE_PARAM: mode} if mode else {})]
    if misaligned:
        shown = ", ".join(misaligned[:3]) + (f" and {len(misaligned) - 3} more" if len(misaligned) > 3 else "")
        multiple = strategies.channel_alignment.MULTIPLE_PARAM
        suggest = {multiple: 8} if x.can(multiple, 8) else {}
        return [Finding("misaligned", f"{_pct(simt)} of GPU time is in GEMM/conv kernels without Tensor "
                                      f"Cores under {precision}: {shown} have widths that are not multiples "
                                      "of 8; padding them lets Tensor Cores run", suggest)]
    return []


def _shown(record: Mapping[str, Any]) -> str:
    dims = "x".join(str(d) for d in record.get("dims", []))
    what = f"{record['layer']} ({dims})" if record.get("layer") else f"{record.get('op')} {dims}"
    return f"{what} {_pct(record.get('share') or 0.0)}"


def misaligned_gemms(x: Evidence) -> list[Finding]:
    """The profile's GEMMs and convolutions on widths that are not multiples of what the trial's
    precision needs, by layer (``autotune.trial.gemm_shapes``), and the padding that fixes them:
    channel_alignment for Conv/Linear widths, vocab_padding for a vocabulary's head or embedding."""
    p = x.profile
    precision = x.knob("precision", "mode", "fp32")
    needed = TENSOR_CORE_MULTIPLE.get(precision)
    share = p.get("misaligned_share") or 0.0
    records = p.get("misaligned_gemms") or []
    if not (p.get("steps") and needed and records and share >= MISALIGNED_SHARE):
        return []
    suggest: dict[str, Any] = {}
    fixes = []
    if (any(r.get("kind") in ("linear", "conv") for r in records)
            and x.knob("channel_alignment", "multiple", 1) < needed
            and needed in x.offered.get(strategies.channel_alignment.MULTIPLE_PARAM, [])):
        suggest[strategies.channel_alignment.MULTIPLE_PARAM] = needed
        fixes.append(f"Conv/Linear widths padded to {needed} (channel_alignment)")
    if (any(r.get("vocab") for r in records) and x.knob("vocab_padding", "multiple", 1) < VOCAB_MULTIPLE
            and VOCAB_MULTIPLE in x.offered.get(strategies.vocab_padding.MULTIPLE_PARAM, [])):
        suggest[strategies.vocab_padding.MULTIPLE_PARAM] = VOCAB_MULTIPLE
        fixes.append(f"the vocabulary padded to {VOCAB_MULTIPLE} (vocab_padding)")
    shown = ", ".join(_shown(r) for r in records[:3]) + (f" and {len(records) - 3} more" if len(records) > 3 else "")
    text = (f"{_pct(share)} of GPU time is in GEMMs/convolutions whose widths are not multiples of {needed}, "
            f"which {precision} Tensor Cores need: {shown}")
    text += f"; {' and '.join(fixes)} would align them" if fixes else "; no knob of this search pads them"
    return [Finding("misaligned-gemms", text, suggest)]


def elementwise(x: Evidence) -> list[Finding]:
    p = x.profile
    if not p.get("steps"):
        return []
    share = p.get("elementwise_share") or 0.0
    if not (share >= ELEMENTWISE_SHARE and x.knob("compile", "mode", "off") == "off"):
        return []
    mode = strategies.compile.MODE_PARAM
    suggest = {mode: "default"} if x.can(mode, "default") and mode in x.offered else {}
    return [Finding("elementwise", f"{_pct(share)} of GPU time is in elementwise and normalization "
                                   "kernels (memory bound)" + ("; torch.compile fuses them" if suggest else ""),
                    suggest)]


def power_cap(x: Evidence) -> list[Finding]:
    e = x.energy
    throttle = e.get("throttle") or {}
    cap = throttle.get("power_cap", 0.0)
    if not cap >= POWER_CAP_SHARE:
        return []
    watts = e.get("avg_power_w")
    at = f" at {watts:.0f} W" if watts else ""
    clocks = e.get("avg_sm_clock_mhz")
    clock = f" (SM clock {clocks:,.0f} MHz on average)" if clocks else ""
    return [Finding("power-cap", f"power-capped{at} for {_pct(cap)} of the measured window{clock}: the GPU "
                                 "runs at its power limit, so work that moves or computes less per sample "
                                 "(lower precision, fused kernels) is what speeds it up and saves energy")]


def thermal(x: Evidence) -> list[Finding]:
    e = x.energy
    throttle = e.get("throttle") or {}
    share = max(throttle.get(k, 0.0) for k in ("hw_thermal", "sw_thermal", "hw_slowdown")) if throttle else 0.0
    if not share >= THERMAL_SHARE:
        return []
    temp = e.get("max_temperature_c")
    return [Finding("thermal", f"thermally throttled for {_pct(share)} of the measured window"
                               + (f" (up to {temp:.0f} C)" if temp else "") + ": the figures of this trial "
                               "understate what a cool GPU does")]


RULES: list[Callable[[Evidence], list[Finding]]] = [
    compile_inert, data_bound, ddp_scaling, layout, idle, copies, without_tensor_cores, misaligned_gemms, elementwise,
    power_cap, thermal,
]
"""The rules in the order their findings are listed (the report's order, and the steering's)."""


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
    evidence = Evidence(profile=profile or {}, energy=energy or {}, knobs=knobs, misaligned=misaligned,
                        offered=offered or {}, figures=figures or {})
    return [finding for rule in RULES for finding in rule(evidence)]
