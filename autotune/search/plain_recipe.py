"""The plain recipe: what a user writes in five lines, and the bar every recommendation must clear.

bf16 autocast where the device has it (fp16 with torch.amp.GradScaler where not), TF32 for what
stays in float32, channels_last for an image model, cudnn.benchmark, the fused optimizer,
torch.compile's default mode, and the largest batch that fits (the GPU, or --memory-limit), up to
four times the base batch. Every search measures it early, as a trial of its own role
("plain-recipe"), and the recommendation is never slower than it: a user compares this tool with
that recipe, not with FP32.

Only the knobs a user of the recipe sets are set; the rest stay at what a plain training loop has
(one CUDA stream, no CUDA graphs, no padding, PyTorch's own attention choice).
"""

from __future__ import annotations

from typing import Any, Callable

import strategies
from autotune.space import SearchSpace

ROLE = "plain-recipe"
MAX_BATCH_FACTOR = 4
"""The recipe's batch is at most this many times the base batch: "the largest batch that fits",
within what a user would still train with at the learning rate they tuned (scaled linearly)."""


def precision(space: SearchSpace) -> str | None:
    """The recipe's precision on this device: bf16, else fp16 (with a GradScaler), else None."""
    return next((mode for mode in ("bf16", "fp16") if mode in space.precisions), None)


def fixed_knobs(space: SearchSpace, batch: int) -> dict[str, Any] | None:
    """The recipe's Optuna parameters that it sets itself (precision, batch and the step's lines), for
    the knobs this space offers; None where the device has neither bf16 nor fp16."""
    mode = precision(space)
    if mode is None:
        return None
    fixed: dict[str, Any] = {strategies.precision.MODE_PARAM: mode, strategies.batch_size.BATCH_SIZE_PARAM: batch}
    if "fused" in space.optimizer_implementations:
        fixed[strategies.optimizer.IMPLEMENTATION_PARAM] = "fused"
    if "default" in space.compile_modes:
        fixed[strategies.compile.MODE_PARAM] = "default"
    if 1 in space.stream_counts:
        fixed[strategies.streams.NUM_STREAMS_PARAM] = 1
    if False in space.cuda_graphs:
        fixed[strategies.cuda_graphs.ENABLED_PARAM] = False
    if 1 in space.choices.get("vocab_padding", ()):
        fixed[strategies.vocab_padding.MULTIPLE_PARAM] = 1  # the model's own vocabulary, as the user built it
    if "framework" in space.choices.get("depthwise_conv", ()):
        fixed[strategies.depthwise_conv.INPUT_GRAD_PARAM] = "framework"  # the convolution's own backward
    if "framework" in space.choices.get("stem_conv", ()):
        fixed[strategies.stem_conv.STEM_PARAM] = "framework"  # the stem convolution as the model writes it
    return fixed


def params(space: SearchSpace, batch: int) -> dict[str, Any] | None:
    """The plain recipe at ``batch`` as a complete parameter set (as a trial records it); None where
    the device has no 16-bit autocast (the FP32 baseline is then the plain recipe)."""
    from autotune.search.steering import complete_params

    fixed = fixed_knobs(space, batch)
    if fixed is None:
        return None
    return complete_params(strategies.seed_params(space, tuned=True, fixed=fixed), space)


def batch(space: SearchSpace, fits: Callable[[int], bool] | None = None) -> int:
    """The largest offered batch up to MAX_BATCH_FACTOR x the base batch that ``fits`` (the memory
    model's prediction: autotune.search.memory), else the smallest offered; the base batch where
    nothing predicts memory (a CPU)."""
    from strategies.batch_size import nearest

    base = nearest(space.batch_sizes, space.base_batch_size)
    if fits is None:
        return base
    allowed = [b for b in space.batch_sizes if b <= MAX_BATCH_FACTOR * space.base_batch_size]
    fitting = [b for b in allowed if fits(b)]
    return max(fitting) if fitting else min(space.batch_sizes)


def describe(space: SearchSpace) -> str:
    """The recipe in words, for the start of a search: "bf16 autocast, TF32, channels_last, ..."."""
    mode = precision(space)
    parts = [f"{mode} autocast" + (" + GradScaler" if mode == "fp16" else "") if mode else "fp32"]
    if space.device == "cuda":
        parts.append("TF32")
    if "channels_last" in space.memory_formats:
        parts.append("channels_last")
    if space.device == "cuda":
        parts.append("cudnn.benchmark")
    if "fused" in space.optimizer_implementations:
        parts.append("fused optimizer")
    if "default" in space.compile_modes:
        parts.append("torch.compile")
    return ", ".join(parts)


class GrowToFit:
    """A proposer after each trial (autotune.search.queue.Feeder): the plain recipe, measured at the
    batch the eager memory probe sized it to, is proposed once at the largest batch (up to
    MAX_BATCH_FACTOR x the base) at which what it allocated, plus a compiled sample's bytes for each
    sample more, stays within the memory model's fill of the limit. A compiled sample is what the
    measured step held above the probe's fixed part (MemoryModel.one_point_per_sample), where its
    activations set its peak; else (a 1B Llama at batch 1) the "compiled sample share" prior of the
    probe's (autotune.priors). A compiled step holds less per sample than the eager probe measured (a
    third of it, for a GPT-2), so "the largest batch that fits" is found by measuring it, as a user
    would, in one trial rather than one batch a trial."""

    def __init__(self, space: SearchSpace, limit_bytes: float | None) -> None:
        self.space = space
        self.limit_bytes = limit_bytes

    def __call__(self, study, trial):
        """The plain recipe grown from ``trial`` (a candidate of role ROLE), or None where it does not grow
        or the study has measured, runs or queued it."""
        from autotune.search.queue import Candidate, trials
        from autotune.search.trials import planned_params

        grown = grown_batch(study, trial, self.space, self.limit_bytes)
        if grown is None:
            return None
        params = {**trial.params, strategies.batch_size.BATCH_SIZE_PARAM: grown}
        if any(planned_params(t) == params for t in trials(study)):
            return None
        return Candidate.of(params, role=ROLE, grown_from=trial.number)


def grown_batch(study, trial, space: SearchSpace, limit_bytes: float | None) -> int | None:
    """GrowToFit's batch for ``trial``, a measured plain recipe: the largest offered batch above its own,
    up to MAX_BATCH_FACTOR x the base, at which what it allocated plus a compiled sample's bytes for each
    sample more stays within the memory model's fill of the limit; None where there is none (or no
    limit, no memory probe, or ``trial`` is not a completed plain recipe)."""
    from optuna.trial import TrialState

    from autotune.search.memory import BACKOFF_FILL, MemoryModel
    from autotune.trial.record import TrialRecord

    record = TrialRecord.of(trial)
    if record.role != ROLE or trial.state != TrialState.COMPLETE or not limit_bytes:
        return None
    model = MemoryModel.from_study(study, limit_bytes)
    allocated = record.figures.get("peak_allocated_bytes")
    batch = int(trial.params.get(strategies.batch_size.BATCH_SIZE_PARAM, 0))
    larger = [b for b in space.batch_sizes if batch < b <= MAX_BATCH_FACTOR * space.base_batch_size]
    if model.prior is None or not allocated or not larger:
        return None
    per_sample = model.one_point_per_sample(strategies.knobs_of(trial.params, space), batch, allocated)
    fits = [b for b in larger if allocated + (b - batch) * per_sample <= limit_bytes * BACKOFF_FILL]
    return max(fits, default=None)
