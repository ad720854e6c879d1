"""What an accuracy check is run with (AccuracySettings) and which knobs it is about: the
numerics knobs, whose values make up a configuration's numerics key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

NUMERICS_KNOBS = ("precision", "grad_scaler", "fp8_layers", "fp32_layers", "loss_kernel", "optimizer_state",
                  "llm_kernels", "activation_checkpointing", "depthwise_conv", "stem_conv")
"""The knobs that change the arithmetic; every other knob only changes speed and memory. Recomputed
activations are among them (issue 36): the recompute runs the forward again, which a compiled step
partitions and fuses apart from the first, and non-deterministic kernels need not repeat themselves.
So are the convolutions computed another way (a depthwise input gradient by the forward kernel, a stem
as space-to-depth): the same sums in another order, which their modules promise the check compares."""
NEAR_FRONTIER = 0.9
"""A trial at or above this fraction of the fastest throughput so far is checked."""
UNSTABLE_CONSTRAINT = 100.0
"""Optuna constraint value of an unstable configuration (feasible is <= 0)."""
MAX_SKIPPED_FRACTION = 0.5
"""A GradScaler that skips more than this fraction of the steps does not train: unstable."""
DIVERGED_FACTOR = 1.5
"""Final training loss above this multiple of the initial loss: the run diverged."""
MIN_STEPS = 10
"""The fewest steps of a check's training run: a shorter run says nothing."""


@dataclass(kw_only=True)
class AccuracySettings:
    """How the accuracy check runs and what it accepts; fixed per study so results compare."""

    steps: int = 300
    """Optimizer steps of the short training run."""
    batch_size: int = 64
    """The check's own batch size, the same for every configuration."""
    held_out_size: int = 1024
    """Held-out samples of the synthetic data (an ImageFolder's split is its own)."""
    lr: float = 3e-3
    """Peak AdamW learning rate of the short run, reached after a linear warm-up over the first
    tenth of the steps (robust across CNNs and transformers trained from scratch)."""
    seed: int = 0
    """Initial weights, data and data order."""
    data: str | None = None
    """None: synthetic; a folder in ImageFolder layout; or package.module:factory."""
    max_accuracy_drop: float = 0.5
    """Largest accepted drop of held-out accuracy versus FP32, in percentage points."""
    max_loss_drift: float = 0.1
    """Without a held-out set: largest accepted loss drift, the fraction of FP32's loss decrease lost."""
    fp64: bool = True
    """Also compare one step against FP64 (cheap: one step)."""

    def __post_init__(self) -> None:
        from autotune.errors import ConfigError

        if self.steps < MIN_STEPS:
            raise ConfigError(f"--accuracy-steps must be at least {MIN_STEPS} (a shorter run says nothing), "
                              f"got {self.steps}")
        if self.batch_size < 2:
            raise ConfigError(f"the accuracy check's batch size must be at least 2, got {self.batch_size}")
        if self.held_out_size < 1:
            raise ConfigError(f"the held-out set needs at least one sample, got {self.held_out_size}")
        if not self.lr > 0:
            raise ConfigError(f"the accuracy check's learning rate must be positive, got {self.lr}")
        if not 0 <= self.max_accuracy_drop <= 100:
            raise ConfigError(f"--max-accuracy-drop is in percentage points (0 to 100), got {self.max_accuracy_drop}")
        if not self.max_loss_drift >= 0:
            raise ConfigError(f"--max-loss-drift must be 0 or more, got {self.max_loss_drift}")

    @classmethod
    def for_device(cls, device: str, **overrides: Any) -> "AccuracySettings":
        """A few hundred steps on a GPU; far fewer, smaller ones on a CPU so CI stays fast."""
        defaults: dict[str, Any] = {} if device == "cuda" else {"steps": 100, "batch_size": 16, "held_out_size": 512}
        defaults.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**defaults)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AccuracySettings":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def fingerprint(self) -> str:
        """What makes two runs comparable (not the thresholds, which only judge them)."""
        run = {k: v for k, v in self.to_dict().items() if k not in ("max_accuracy_drop", "max_loss_drift")}
        return hashlib.sha1(json.dumps(run, sort_keys=True).encode()).hexdigest()[:10]


def numerics_knobs(knobs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The knobs (as dicts) that change the arithmetic; the others are left at their defaults."""
    return {name: dict(knobs[name]) for name in NUMERICS_KNOBS if name in knobs}


def numerics_key(knobs: Mapping[str, Mapping[str, Any]]) -> str:
    """One string per distinct arithmetic: configurations that share it share their check.
    A knob at its default is left out, so a study from before a knob existed keys the same."""
    import strategies

    present, untuned = {}, strategies.untuned_values()
    for name, values in numerics_knobs(knobs).items():
        if values != untuned[name]:
            present[name] = values
    return json.dumps(present, sort_keys=True)


def describe_numerics(knobs: Mapping[str, Mapping[str, Any]]) -> str:
    """'fp16, GradScaler init 65536, fp32 norm+head', for tables."""
    mode = knobs.get("precision", {}).get("mode", "fp32")
    parts = [mode]
    scaler = knobs.get("grad_scaler", {})
    if mode == "fp16":
        parts.append(f"GradScaler init {scaler.get('init_scale', 0):g}" if scaler.get("enabled") else "no GradScaler")
    layers = knobs.get("fp32_layers", {}).get("layers", "none")
    if layers != "none":
        parts.append(f"fp32 {layers}")
    if knobs.get("loss_kernel", {}).get("kernel", "framework") != "framework":
        parts.append("fused linear CE")
    if knobs.get("optimizer_state", {}).get("state", "full") != "full":
        parts.append("8-bit optimizer states")
    if knobs.get("llm_kernels", {}).get("kernels", "framework") != "framework":
        parts.append("liger kernels")
    import strategies

    # the convolutions computed another way: their knobs' own words, as a configuration's description has them
    for name in ("depthwise_conv", "stem_conv"):
        if words := strategies.BY_NAME[name].words(knobs.get(name, {})):
            parts.append(words)
    every = knobs.get("activation_checkpointing", {}).get("every", 0)
    if every:
        parts.append("checkpointing every block" if every == 1 else f"checkpointing every {every} blocks")
    return ", ".join(parts)
