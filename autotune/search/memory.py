"""What fits: a memory model fitted from the peaks the search measured, and out-of-memory back-off.

A configuration's peak memory is close to a fixed part (weights, gradients, optimizer state, the
CUDA context, workspaces) plus a per-sample part (activations), and both depend on the knobs that
change what is stored: precision, memory format, padding, kept-FP32 layers, compile, CUDA graphs,
the optimizer, streams. Trials that differ only in the batch size form a *family*; each family's
line ``peak = fixed + per_sample * batch`` is fitted from its measured peaks (and from the peaks
the worker measured while looking for the largest batch that fits, see autotune.trial.work).

The search uses it two ways (autotune.search.objective):

- before a trial runs, a configuration that surely does not fit is pruned with the reason: its
  family ran out of memory at this batch or a smaller one, or its line predicts more than the
  limit ("predicted not to fit: needs about 31 GiB of 24");
- a configuration that does not fit at batch N is queued again at the largest batch that can fit
  (the worker's own finding, else the family's line, else half of N or less where a family of the
  same precision and compile mode says so): the FP32 baseline too, which therefore always exists.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping

import optuna

import strategies
from autotune.errors import ConfigError
from autotune.search.levers import GAP_LEVERS, lever_bytes, levers_of, without_levers
from autotune.priors import prior, values
from autotune.trial.record import TrialRecord

PREDICT_MARGIN = 1.10
"""A prediction prunes only when it is this much over the limit: a line fitted from two or three
peaks is an estimate, and a configuration wrongly pruned is never measured. Not where the family's own
line predicts it (LINE_MARGIN): its own peaks measured at two batches predict the next one closely, and
a margin there lets a batch that does not fit run out of memory."""
LINE_MARGIN = 1.0
"""PREDICT_MARGIN for a configuration whose own family's measured peaks predict it."""
BACKOFF_FILL = 0.92
"""A back-off batch is one whose predicted (or probed) peak is within this share of the limit: a
probe's two steps near the limit can fit where the measured trial at that batch then runs out of
memory."""

PROBE_ATTR = "memory_probe"
"""The study's user attribute holding the memory probe's findings (autotune.search.fit): the family
it measured, its peaks at small batches and the batch that did not fit, if one did not."""
ADAM_CLASSES = ("torch.optim.adam.Adam", "torch.optim.adamw.AdamW")
"""The optimizer classes, as the probe names them, whose foreach step holds a tensor more a parameter
than their fused one (foreach_bytes)."""

SIBLING_KNOBS = frozenset({strategies.streams.NUM_STREAMS_PARAM, strategies.cuda_graphs.ENABLED_PARAM,
                           strategies.vocab_padding.MULTIPLE_PARAM, strategies.channel_alignment.MULTIPLE_PARAM,
                           strategies.cudnn.BENCHMARK_PARAM, strategies.compile.MODE_PARAM, strategies.precision.MODE_PARAM,
                           strategies.depthwise_conv.INPUT_GRAD_PARAM, strategies.stem_conv.STEM_PARAM})
"""Knobs that change a compiled 16-bit step's memory by a few percent at most (a prefetched batch, a
graph's pool, a padded row or channel, a workspace, another whole-model compile mode, fp16 for bf16, a
depthwise convolution's input gradient computed another way, from the same saved tensors, a stem
convolution on its input rearranged, which it saves in place of the input padded to 8 channels):
a configuration one of them away from a measured one is held to that one's peak (:meth:`MemoryModel.sibling_peak`)."""
SIBLING_FILL = 0.8
"""A measured sibling's peak, scaled to the batch, under this share of the limit overrides the memory
probe's prediction of does-not-fit: the eager probe's bytes per sample can predict a compiled step's
one-knob moves far over the limit where the compiled step itself peaked well under it."""

# knobs that do not change device memory: the batch is the model's variable, the rest act on the
# host (threads, the data loader) or only on the loss scale's arithmetic (GradScaler settings)
_NOT_MEMORY = ("batch_size", "threads", "dataloader", "grad_scaler")


def parse_size(text: str | int | float, option: str = "--memory-limit") -> int:
    """'24GiB', '24GB', '24G', '500MiB', or a number of bytes -> bytes (GB and G taken as GiB,
    as nvidia-smi and most guides mean them for GPU memory)."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not match:
        raise ConfigError(f"{option} {text!r}: write a size like 24GiB, 24GB or 500MiB")
    factor = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[match.group(2)]
    value = int(float(match.group(1)) * factor)
    if value <= 0:
        raise ConfigError(f"{option} {text!r}: give a positive size, e.g. 24GiB")
    return value


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def family(knobs: Mapping[str, Mapping[str, Any]]) -> str:
    """The configuration without its batch size (and the knobs that do not change memory). A knob or a
    field the configuration does not record takes its untuned value: a trial recorded before a knob
    existed ran without it, so it is in the same family as one that records the knob off (a study
    resumed by a newer autotune; its memory probe's family, kept as this string, alike)."""
    values = strategies.with_untuned(knobs)
    parts = [f"{name}.{key}={value}" for name, fields in sorted(values.items()) if name not in _NOT_MEMORY
             for key, value in sorted(fields.items())]
    return ",".join(parts)


def normalized_family(fam: str) -> str:
    """A family as an earlier autotune wrote it (missing the knobs added since), as :func:`family`
    writes it now; a name that is no family string (no "knob.field=value" part) as it is."""
    knobs: dict[str, dict[str, str]] = {}
    for part in fam.split(","):
        key, sep, value = part.partition("=")
        name, dot, field_ = key.partition(".")
        if not sep or not dot:
            return fam
        knobs.setdefault(name, {})[field_] = value
    return family(knobs)


def batch_of(knobs: Mapping[str, Mapping[str, Any]]) -> int:
    return int(knobs["batch_size"]["batch_size"])


@dataclass
class MemoryModel:
    """Measured peaks and out-of-memory batches per family, and the limit they are held against."""

    limit_bytes: float | None
    """The most a trial may use: --memory-limit, else the GPU's memory; None on a CPU."""
    peaks: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    """family -> batch -> peak bytes (the highest seen at that batch)."""
    ooms: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    """family -> (batch, trial number) of each measured out-of-memory trial (-1: the memory probe)."""
    prior: tuple[str, float, float] | None = None
    """(probed family, fixed bytes, bytes per sample) from the memory probe: what a family that has
    no line of its own is predicted by (:meth:`prior_predict`)."""
    sizes: dict[str, float] = field(default_factory=dict)
    """The workload's sizes the memory knobs' savings follow from (num_parameters, tokens_per_sample,
    vocab_size: the probe's), kept with the memory probe's findings."""
    probed: dict[str, Any] = field(default_factory=dict)
    """The memory probe's findings as the study keeps them (PROBE_ATTR)."""
    gaps: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    """family -> batch -> bytes the caching allocator reserved above its allocated peak (a measured
    trial's peak_reserved_bytes - peak_allocated_bytes): what expandable segments may save there."""

    @classmethod
    def from_study(cls, study: optuna.Study, limit_bytes: float | None) -> "MemoryModel":
        model = cls(limit_bytes)
        model.add_probe(study.user_attrs.get(PROBE_ATTR))
        for trial in map(TrialRecord.of, study.get_trials(deepcopy=False)):
            knobs = trial.knobs
            if not knobs or trial.duplicate_of is not None:
                continue
            fam = family(knobs)
            for batch, peak in (trial.fit_peaks or {}).items():
                model.add(fam, int(batch), peak)
            if trial.status == "ok" and trial.peak_memory_bytes:
                model.add(fam, batch_of(knobs), trial.peak_memory_bytes)
                reserved, allocated = (trial.figures.get(k) for k in ("peak_reserved_bytes", "peak_allocated_bytes"))
                if reserved is not None and allocated is not None:
                    model.gaps[fam][batch_of(knobs)] = max(0.0, float(reserved) - float(allocated))
            elif trial.status == "oom":
                model.ooms[fam].append((batch_of(knobs), trial.number))
            if trial.fit_oom_batch:  # the worker's search for a batch that fits failed here too
                model.ooms[fam].append((int(trial.fit_oom_batch), trial.number))
        return model

    def add_probe(self, probed: Mapping[str, Any] | None) -> None:
        """Take the memory probe's peaks as its family's, and its line as every family's prior."""
        if not probed or not probed.get("family"):
            return
        self.probed = dict(probed)
        self.sizes = dict(probed.get("sizes") or {})
        fam = normalized_family(probed["family"])
        for batch, peak in (probed.get("peaks") or {}).items():
            self.add(fam, int(batch), float(peak))
        if probed.get("does_not_fit_at"):
            self.ooms[fam].append((int(probed["does_not_fit_at"]), -1))
        points = sorted((int(b), float(p)) for b, p in (probed.get("peaks") or {}).items())
        fitted = self.line(fam)
        if fitted is not None:
            held = held_line(probed)[1]
            if held > fitted[1]:
                # under a cap the smaller batch's peak is the optimizer's phase, not its activations: the
                # line through the peaks is too flat, and a sample holds what its forward was measured to
                b, p = points[-1]
                fitted = (p - b * held, held)
            self.prior = (fam, *fitted)
        elif points and self.limit_bytes and probed.get("does_not_fit_at"):
            # one batch fitted and the next did not: each sample holds at least what was left, and
            # what its forward was measured to keep for the backward where the probe measured that
            (b, p), over = points[0], int(probed["does_not_fit_at"])
            per_sample = max(max(0.0, self.limit_bytes - p) / (over - b), held_line(probed)[1])
            self.prior = (fam, p - b * per_sample, per_sample)

    def prior_predict(self, knobs: Mapping[str, Mapping[str, Any]], batch: int | None = None) -> float | None:
        """Predicted peak bytes of a family with no line of its own: the probe's bytes per sample,
        scaled by the precision's "activation factor" prior (FP32 activations are twice bf16's; the fixed
        part, FP32 master weights, gradients and optimizer state, is the same in every mode, which keeps
        FP32 weights under autocast), from the family's one measured batch if it has
        one, else from the probe's fixed part. None without a probe."""
        if self.prior is None:
            return None
        _, fixed, per_sample = self.prior
        mode = (knobs.get("precision") or {}).get("mode", "fp32")
        activation = values(strategies.precision.MODE_PARAM, "activation factor")
        per_sample *= activation.get(mode, 1.0)
        batch = batch if batch is not None else batch_of(knobs)
        measured = sorted(self.peaks.get(family(knobs), {}).items())
        if measured:
            b, peak = measured[-1]
            return peak + per_sample * (batch - b)
        resident = fixed - held_line(self.probed)[0]  # without autocast's 16-bit copies of the weights
        forward = (resident if mode in activation else fixed) + per_sample * batch
        # a foreach step's temporaries come after the backward has let the activations and copies go
        return max(forward, resident + self.foreach_bytes(knobs))

    def foreach_bytes(self, knobs: Mapping[str, Mapping[str, Any]]) -> float:
        """What a foreach Adam/AdamW step holds on top of the probe's fused one: a new FP32 tensor a
        parameter (torch._foreach_sqrt of the second moments), which the fused kernel never makes:
        its "bytes per parameter" prior. Predicted as the fused probe's, such a step can run out of
        memory where the probe fitted."""
        probed = _parts(self.prior[0]) if self.prior else {}
        optimizer = knobs.get("optimizer") or {}
        if (optimizer.get("implementation") != "foreach"
                or probed.get(strategies.optimizer.IMPLEMENTATION_PARAM) != "fused"
                or (knobs.get("optimizer_state") or {}).get("state", "full") != "full"
                or self.sizes.get("optimizer_class") not in ADAM_CLASSES):
            return 0.0
        per_parameter = prior(strategies.optimizer.IMPLEMENTATION_PARAM, "foreach", "bytes per parameter")
        return per_parameter * float(self.sizes.get("num_parameters") or 0)

    def add(self, fam: str, batch: int, peak: float) -> None:
        self.peaks[fam][batch] = max(peak, self.peaks[fam].get(batch, 0.0))

    def line(self, fam: str) -> tuple[float, float] | None:
        """(fixed bytes, bytes per sample) by least squares over the family's batches; None with
        fewer than two batches measured."""
        points = sorted(self.peaks.get(fam, {}).items())
        if len(points) < 2:
            return None
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_p = sum(p for _, p in points) / n
        var = sum((b - mean_b) ** 2 for b, _ in points)
        slope = max(0.0, sum((b - mean_b) * (p - mean_p) for b, p in points) / var)
        return mean_p - slope * mean_b, slope

    def lever_predict(self, knobs: Mapping[str, Mapping[str, Any]], batch: int) -> float | None:
        """Predicted peak bytes of a configuration with memory knobs on (8-bit optimizer states, a fused
        loss, recomputed activations: autotune.search.neighbours.LEVERS) and no line of its own: the same
        configuration without them, as measured (its line, else its largest measured batch with the
        probe's bytes per sample, halved where it compiles), less what each knob saves. None where that
        configuration was not measured, or no memory knob is on."""
        levers = levers_of(knobs)
        if not levers:
            return None
        if any(lever.saves_gap for lever in levers):
            return self.gap_predict(knobs, batch)
        # the same configuration measured without them; its optimizer's implementation aside (8-bit
        # states have none to choose: recorded "default" where the plain recipe's is "fused")
        wanted = _but_implementation(family(without_levers(knobs)))
        same = [f for f in self.peaks if _but_implementation(f) == wanted]
        if not same:
            return None
        fam = max(same, key=lambda f: len(self.peaks[f]))
        fitted = self.line(fam)
        if fitted is None:
            measured = sorted(self.peaks.get(fam, {}).items())
            if not measured or self.prior is None:
                return None
            b, peak = measured[-1]
            per_sample = self.one_point_per_sample(knobs, b, peak)
            fitted = (peak - per_sample * b, per_sample)
        return lever_bytes(levers, self.sizes, *fitted, batch)

    def one_point_per_sample(self, knobs: Mapping[str, Mapping[str, Any]], batch: int, peak: float) -> float:
        """Bytes a sample holds in a family measured at one ``batch`` (its ``peak``): what that peak holds
        above the probe's fixed part, a sample's, where the probe's bytes per sample say the activations set
        it (a compiled step holds 0.74 to 1.0 of its eager sample there); else (the fixed part sets it: a 1B
        Llama's step at batch 1) the probe's, by the precision's "activation factor" prior, and the "compiled
        sample share" prior of it where it compiles (autotune.priors)."""
        mode = (knobs.get("precision") or {}).get("mode", "fp32")
        compiled = (knobs.get("compile") or {}).get("mode", "off") != "off"
        _, fixed, eager = self.prior
        eager *= values(strategies.precision.MODE_PARAM, "activation factor").get(mode, 1.0)
        if compiled and batch * eager > fixed and peak > fixed:
            return (peak - fixed) / batch
        return eager * (prior(strategies.compile.MODE_PARAM, None, "compiled sample share") if compiled else 1.0)

    def anchored(self, knobs: Mapping[str, Mapping[str, Any]], batch: int, levered: float) -> float:
        """A memory-knob configuration's prediction at ``batch`` from its own measured peak where it has
        one (a single batch: no line), with the knobs' predicted bytes per sample between the two
        batches; ``levered`` (lever_predict's) otherwise: its next batch starts from what it measured,
        not from the prediction it was queued by."""
        measured = sorted(self.peaks.get(family(knobs), {}).items())
        if not measured:
            return levered
        b, peak = measured[-1]
        at_b = self.lever_predict(knobs, b)
        return levered if at_b is None else peak + (levered - at_b)

    def gap_predict(self, knobs: Mapping[str, Mapping[str, Any]], batch: int) -> float | None:
        """Predicted peak bytes of a configuration with expandable segments (strategies.allocator) and no
        line of its own: the same configuration without them as predicted (its own line, the other memory
        knobs' prediction, or the probe's), less the gap between reserved and allocated memory measured
        on it (:meth:`measured_gap`), keeping the "gap slack" prior's share of what it allocates (pages are
        mapped 2 MiB at a time, each stream's pool keeps segments of its own, and a freed block stays mapped
        until the allocator runs short, so the gap does not close to nothing: a saving predicted too large
        queues a batch that runs out of memory, one too small only a smaller batch); no saving where no gap was
        measured. None where nothing predicts the configuration without them."""
        twin = without_levers(dict(knobs), GAP_LEVERS)
        base = self.predict(twin, batch)
        if base is None:
            return None
        gap = self.measured_gap(twin, batch)
        if gap is None:
            return base
        # what it allocates there: its predicted peak less the gap (and less what lies outside the
        # allocator, which the slack then over-counts a little)
        slack = prior(strategies.allocator.EXPANDABLE_SEGMENTS_PARAM, True, "gap slack")
        return base - max(0.0, gap - slack * max(0.0, base - gap))

    def measured_gap(self, knobs: Mapping[str, Mapping[str, Any]], batch: int) -> float | None:
        """Bytes reserved above the allocated peak, as measured on ``knobs``' family (at its measured batch
        nearest ``batch``, the larger on a tie), else on the same configuration without any memory knob
        (their gap taken as what the knobs leave: the 1B Llama's trial with 8-bit states, a fused loss and
        recompute still reserved 1.44 GiB above its allocated peak, the plain recipe 2.31); None where
        neither was measured. The optimizer's implementation aside, as for the other memory knobs."""
        for fam in (family(knobs), family(without_levers(dict(knobs)))):
            wanted = _but_implementation(fam)
            found = [(abs(b - batch), -b, gap) for f, gaps in self.gaps.items() if _but_implementation(f) == wanted
                     for b, gap in gaps.items()]
            if found:
                return min(found)[2]
        return None

    def predict(self, knobs: Mapping[str, Mapping[str, Any]], batch: int | None = None) -> float | None:
        """Predicted peak bytes of ``knobs`` (at ``batch`` instead of its own, if given), as its
        :meth:`analog`."""
        knobs = self.analog(knobs)
        fitted = self.line(family(knobs))
        if fitted is None:
            batch = batch if batch is not None else batch_of(knobs)
            levered = self.lever_predict(knobs, batch)
            if levered is None:
                return self.prior_predict(knobs, batch)
            return self.anchored(knobs, batch, levered)
        fixed, per_sample = fitted
        return fixed + per_sample * (batch if batch is not None else batch_of(knobs))

    def analog(self, knobs: Mapping[str, Mapping[str, Any]]) -> Mapping[str, Mapping[str, Any]]:
        """What ``knobs`` is predicted as: an fp8 configuration not measured yet as its bf16 twin (fp8
        is bf16 autocast with the eligible Linear layers' matmuls in float8, whose weight copies of 1
        byte a parameter take the place of autocast's bf16 ones of 2, on the same FP32 master weights
        and optimizer state); any other as it is."""
        if (knobs.get("precision") or {}).get("mode") == "fp8" and not self.peaks.get(family(knobs)):
            twin = {**knobs, "precision": {**knobs["precision"], "mode": "bf16"}}
            twin.pop("fp8_layers", None)  # the bf16 twin converts no layer
            return twin
        return knobs

    def verdict(self, knobs: Mapping[str, Mapping[str, Any]]) -> str | None:
        """Why ``knobs`` surely does not fit, or None when it may."""
        fam, batch = family(knobs), batch_of(knobs)
        failed = [(b, n) for b, n in self.ooms.get(fam, []) if b <= batch]
        if failed:
            b, n = min(failed)
            where = "in the memory probe" if n < 0 else f"(#{n})"
            return f"does not fit: the same configuration ran out of memory at batch {b} {where}"
        predicted = self.predict(knobs)
        analog = self.analog(knobs)
        fam = family(analog)  # the line its prediction came from, if one
        own_line = self.line(fam) is not None
        margin = LINE_MARGIN if own_line else PREDICT_MARGIN
        if self.limit_bytes and predicted is not None and predicted > self.limit_bytes * margin:
            sibling = None if own_line else self.sibling_peak(knobs, batch)
            if sibling is not None and sibling <= self.limit_bytes * SIBLING_FILL:
                return None
            twin = " of its bf16 twin" if analog is not knobs else ""
            source = (f"fitted from the peaks{twin} measured at batch "
                      f"{', '.join(str(b) for b in sorted(self.peaks[fam]))}"
                      if own_line else "from the memory probe's bytes per sample")
            return (f"predicted not to fit: needs about {predicted / 2**30:.0f} GiB of "
                    f"{self.limit_bytes / 2**30:.0f} (batch {batch}; {source})")
        return None

    def sibling_peak(self, knobs: Mapping[str, Mapping[str, Any]], batch: int) -> float | None:
        """The highest peak of a measured compiled 16-bit family ``knobs`` differs from in SIBLING_KNOBS
        only (whole-model compiles, 16-bit autocast, on both sides), scaled from its largest measured
        batch to ``batch`` in proportion (so from above: its fixed part grows with it); None without one."""
        own = _parts(family(knobs))
        if not _compiled_16bit(own):
            return None
        found = []
        for fam, peaks in self.peaks.items():
            other = _parts(fam)
            differ = {k for k in own.keys() | other.keys() if own.get(k) != other.get(k)}
            if peaks and differ and differ <= SIBLING_KNOBS and _compiled_16bit(other):
                b, peak = max(peaks.items())
                found.append(peak * max(1.0, batch / b))
        return max(found, default=None)

    def backoff_batch(self, knobs: Mapping[str, Mapping[str, Any]], candidates: list[int],
                      fits_at: int | None = None) -> int | None:
        """The batch to measure ``knobs`` at instead, after it did not (or would not) fit: the largest
        of ``candidates`` below every out-of-memory batch of its family whose predicted peak is
        within the limit; without a fitted line, the largest at most half of its batch, or lower where
        a sibling family's bytes per sample say so (:meth:`borrowed_per_sample`).
        ``fits_at``, the worker's own finding, is taken unless its probed peak is over BACKOFF_FILL
        of the limit: then the same rule holds below it (the probe's peaks are on the line)."""
        fam, batch = family(knobs), batch_of(knobs)
        if fits_at is not None:
            peak = self.peaks.get(fam, {}).get(fits_at)
            if not (self.limit_bytes and peak and peak > self.limit_bytes * BACKOFF_FILL):
                return fits_at
            batch = fits_at
        ceiling = min([batch] + [b for b, _ in self.ooms.get(fam, [])])
        below = [c for c in candidates if c < ceiling]
        if not below:
            return None
        if self.limit_bytes and (self.line(fam) is not None or self.prior is not None):
            fitting = [c for c in below if self.predict(knobs, c) <= self.limit_bytes * BACKOFF_FILL]
            if self.line(fam) is not None:
                return max(fitting) if fitting else None
            # sized by the memory probe, with what its memory knobs save (predict); where it predicts
            # nothing fits, the smallest is measured (an out-of-memory there is a result: the search
            # then says the model does not fit). After one ran out of memory where it was predicted to
            # fit, the prediction is short: at most half that batch
            if self.ooms.get(fam):
                fitting = [c for c in fitting if c <= ceiling // 2]
            return max(fitting) if fitting else min(below)
        half = max((c for c in below if c <= ceiling // 2), default=min(below))
        borrowed = self.borrowed_per_sample(knobs)
        if self.limit_bytes and borrowed:
            # no line of its own: what a sibling family (same precision, same compile) holds a sample
            # may send it further down than half, never less far (the sibling may hold less)
            fitting = [c for c in below if borrowed * c <= self.limit_bytes * BACKOFF_FILL]
            return min(max(fitting, default=min(below)), half)
        return half

    def borrowed_per_sample(self, knobs: Mapping[str, Mapping[str, Any]]) -> float | None:
        """Bytes per sample, fixed part included (so from above), of the hungriest measured family
        with ``knobs``' precision and compile mode; None without one. A family that only differs in
        knobs such as FP32 layers, CUDA graphs or padding holds about as much, where halving down from
        a batch far too large spends a trial on each batch that still does not fit."""
        own = family(knobs)
        rates = [peak / batch for fam, peaks in self.peaks.items() if fam != own and _kind(fam) == _kind(own)
                 for batch, peak in peaks.items() if batch > 0]
        return max(rates, default=None)


def held_line(probed: Mapping[str, Any]) -> tuple[float, float]:
    """(bytes whatever the batch, bytes per sample) of what the memory probe's forward kept at its two
    measured batches (autotune.trial.memory_fit.forward_held); (0, 0) where it measured fewer than two.
    Per sample: a sample's activations and logits. Whatever the batch: autocast's 16-bit copies of the
    weights, 2.3 GiB for the 1B Llama, which an FP32 step never makes and an optimizer step comes after.
    Under a cap where the step fits one sample only, what is left above it says too little about a
    sample: the memory knobs would be predicted to fit a batch that runs out of memory."""
    held = sorted((int(b), float(v)) for b, v in (probed.get("forward_held") or {}).items())
    if len(held) < 2:
        return 0.0, 0.0
    (b0, h0), (b1, h1) = held[0], held[-1]
    per_sample = max(0.0, (h1 - h0) / (b1 - b0))
    return max(0.0, h0 - b0 * per_sample), per_sample


def _kind(fam: str) -> tuple[str, str]:
    """A family's precision mode and compile mode, the knobs that change memory the most (compiled,
    GPT-2 at 64 sequences held 42 GiB; eager, 94)."""
    values = _parts(fam)
    return values.get(strategies.precision.MODE_PARAM, "fp32"), values.get(strategies.compile.MODE_PARAM, "off")


def _parts(fam: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in fam.split(",") if "=" in part)


def _compiled_16bit(values: Mapping[str, str]) -> bool:
    return (values.get(strategies.precision.MODE_PARAM) in ("bf16", "fp16")
            and values.get(strategies.compile.MODE_PARAM, "off") not in ("off", "regional"))


def _but_implementation(fam: str) -> str:
    return ",".join(part for part in fam.split(",") if not part.startswith("optimizer.implementation="))
