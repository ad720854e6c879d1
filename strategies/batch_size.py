"""batch_size: samples per optimizer step.

A batch that does not fit in memory is a result ("does not fit"), recorded by the trial, never a
crash. When the chosen batch differs from the user's own, the recipe says how to scale the
learning rate (the linear scaling rule of Goyal et al., 2017), since a larger batch takes
fewer, larger steps per epoch.

With ``--global-batch-size N`` the user's batch is kept instead: the knob is the micro-batch (a
divisor of N), and ``N / micro-batch`` micro-batches accumulate their gradients into each
optimizer step (as DeepSpeed's autotuner searches micro-batch x accumulation), so the learning
rate stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from strategies.base import ReportKnob, Strategy

LM_BASE_TOKENS = 16_384
"""A language model's default batch on a GPU, in tokens: nanoGPT's micro-batch (12 x 1,024 tokens
on a 40 GB A100; 16 in scripts/lm_baseline.py). The image default, 256 samples, is 262,144 tokens of
GPT-2 at 1,024: its FP32 step does not fit in 141 GB."""

# multiples of 8 (Tensor-Core friendly), roughly geometric
CANDIDATES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]


def candidates(low: int, high: int) -> list[int]:
    """Candidate batch sizes in [low, high]; the bounds themselves are always included."""
    values = sorted({v for v in CANDIDATES if low <= v <= high} | {low, high})
    return values


def nearest(values: list[int], target: int) -> int:
    """The value closest to ``target`` (the smaller one on a tie)."""
    return min(values, key=lambda v: (abs(v - target), v))


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
BATCH_SIZE_PARAM = "batch_size.batch_size"


class BatchSize(Strategy):
    name = "batch_size"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        batch_size: int = 32
        """Samples per optimizer step."""
        base_batch_size: int = 32
        """The user's batch size, that the learning rate is tuned for."""
        accumulation_steps: int = 1
        """Micro-batches per optimizer step: the global batch is batch_size x accumulation_steps."""

        @property
        def global_batch_size(self) -> int:
            return self.batch_size * self.accumulation_steps

        @property
        def lr_scale(self) -> float:
            """Linear scaling rule: multiply the learning rate by this."""
            return self.global_batch_size / self.base_batch_size

    def default(self) -> Config:
        return self.Config()

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        cuda = device == "cuda"
        low = options.min_batch_size or (16 if cuda else 4)
        high = options.max_batch_size or (1024 if cuda else 32)
        if options.batch_size:
            batches = [options.batch_size]
        else:
            if low > high:
                raise ConfigError(f"batch range {low}..{high} is empty; set --min-batch-size/--max-batch-size")
            batches = candidates(low, high)
        wanted = options.global_batch_size
        if wanted:
            # micro-batches that divide the global batch; the baseline is one plain step over all of it
            # when that fits (else the largest micro-batch, after the out-of-memory back-off)
            batches = sorted({b for b in batches if wanted % b == 0} | ({wanted} if low <= wanted <= high else set()))
            if not batches:
                raise ConfigError(f"no batch in {low}..{high} divides --global-batch-size {wanted}; give a global "
                                  "batch with small divisors (a power of two, say) or widen --min/--max-batch-size")
        tokens = probe.get("tokens_per_sample")
        default = (max(1, LM_BASE_TOKENS // tokens) if tokens else 256) if cuda else 16
        base = wanted or options.base_batch_size or options.batch_size or nearest(batches, default)
        if not wanted and base not in batches:  # the global batch itself need not be a micro-batch
            base = min(max(base, batches[0]), batches[-1])
            if base not in batches:
                batches = sorted(set(batches) | {base})
        return {"batch_sizes": batches, "base_batch_size": base, "global_batch_size": wanted}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        # the known-good ones name their batch; the baseline runs the user's (under
        # --global-batch-size: the global batch's largest micro-batch)
        return {} if tuned else {BATCH_SIZE_PARAM: nearest(space.batch_sizes, space.base_batch_size)}

    def words(self, values: Mapping[str, Any]) -> str:
        steps = values.get("accumulation_steps", 1)
        return f"batch {values.get('batch_size')}" + (f" x {steps} accumulated" if steps > 1 else "")

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("batch_size", "batch size", self.name, "batch_size")]

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        value = self.choose(trial, "batch_size", space.batch_sizes)
        # derived, not sampled: replaying the batch gives the same accumulation
        steps = space.global_batch_size // value if space.global_batch_size else 1
        return self.Config(batch_size=value, base_batch_size=space.base_batch_size, accumulation_steps=steps)

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.batch_size = config.batch_size
        recipe.accumulation_steps = config.accumulation_steps
        recipe.base_batch_size = config.base_batch_size
        if config.accumulation_steps > 1:
            recipe.notes.append(
                f"micro-batch {config.batch_size} x {config.accumulation_steps} accumulation steps = "
                f"{config.global_batch_size} samples per optimizer step: cfg.train_step accumulates; in your "
                f"own loop, divide the loss by cfg.accumulation_steps and step the optimizer every "
                f"{config.accumulation_steps} micro-batches")
        if config.global_batch_size != config.base_batch_size:
            recipe.notes.append(
                f"batch size {config.global_batch_size} instead of {config.base_batch_size}: scale the learning "
                f"rate by {config.lr_scale:g} (linear scaling rule; cfg.scaled_lr(base_lr) does it), "
                f"with a few epochs of warm-up when the factor is large"
            )
