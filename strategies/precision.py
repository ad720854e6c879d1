"""precision: FP32, TF32, automatic mixed precision (fp16 / bf16 autocast), or FP8 training.

Only modes the device supports are offered (TF32 needs Ampere or newer, bf16 needs hardware
bf16: Ampere or newer on CUDA, AVX512-BF16 or AMX on a CPU; FP8 needs FP8 Tensor Cores, compute
capability 8.9 or newer: Ada, e.g. the RTX 4090, and Hopper, and torchao; ``--precisions``
overrides). "fp8" is bf16 autocast with the Linear layers whose widths are multiples of 16
trained in float8 through torchao (``torchao.float8.convert_to_float8_training``: dynamic
tensorwise scaling, e4m3 forward, e5m2 gradients); the accuracy check gates it like every mode. "fp32" really is FP32: PyTorch lets cuDNN use TF32 for convolutions by
default, so the baseline switches TF32 off explicitly. Under autocast, the ops that stay in
float32 may use TF32 where the device has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from strategies.base import ReportKnob, Strategy

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


MODES = ("fp32", "tf32", "fp16", "bf16", "fp8")
FP8_EXTRA = "pip install 'autotune[fp8]' (torchao)"


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
MODE_PARAM = "precision.mode"


class Precision(Strategy):
    name = "precision"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        mode: str = "fp32"
        """fp32 | tf32 | fp16 | bf16 | fp8 (the last three autocast; fp8's Linear layers in float8)."""

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        precisions = probe["precisions"]
        if options.precisions is not None:
            # bf16 on a CPU without native bf16 is emulated: slow, but the user may want to see it
            # and FP8 on a CPU too, where torchao emulates it (a check of the numerics, not a speed)
            unsupported = [m for m in options.precisions if m not in precisions
                           and not (m in ("bf16", "fp8") and device != "cuda")]
            if "fp8" in options.precisions and not torchao_installed():
                raise ConfigError(f"--precisions {','.join(options.precisions)}: fp8 trains through torchao, "
                                  f"which is not installed; {FP8_EXTRA}")
            if unsupported:
                raise ConfigError(f"--precisions {','.join(options.precisions)}: this device does not support "
                                  f"{', '.join(unsupported)} (it supports {', '.join(precisions)}"
                                  + ("; fp8 needs compute capability 8.9 or newer" if "fp8" in unsupported else "")
                                  + ")")
            precisions = [m for m in MODES if m in options.precisions]
        if "fp8" in precisions and probe.get("fp8_eligible_share", 1.0) == 0:
            if options.precisions is not None:
                raise ConfigError(f"--precisions {','.join(options.precisions)}: no Linear layer of this model has "
                                  "both widths a multiple of 16, so fp8 would train nothing in float8; leave fp8 out")
            precisions = [m for m in precisions if m != "fp8"]  # a ResNet's one 2048 -> 1000 head, say
        return {"precisions": precisions}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        return {} if tuned else {MODE_PARAM: "fp32"}  # the known-good ones name their mode

    def words(self, values: Mapping[str, Any]) -> str:
        return values.get("mode", "fp32")

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("precision", "precision", self.name, "mode", "fp32")]

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(mode=self.choose(trial, "mode", space.precisions))

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.autocast_dtype = AUTOCAST_DTYPES.get(config.mode)
        if config.mode == "fp8":
            recipe.model_transforms.append(to_float8_training)
        if recipe.device == "cuda":
            # a recipe depends on its knobs alone: on a GPU without TF32 the switch does nothing
            fp32_math = "ieee" if config.mode == "fp32" else "tf32"
            recipe.backend_flags["matmul_fp32_precision"] = fp32_math
            recipe.backend_flags["conv_fp32_precision"] = fp32_math


def fp8_eligible(module: torch.nn.Module, fqn: str = "") -> bool:
    """A Linear that float8 matmuls can run: both widths multiples of 16 (torch._scaled_mm's rule)."""
    return (isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0
            and module.out_features % 16 == 0)


FEED_FORWARD = frozenset({"mlp", "ffn", "feed_forward", "feedforward"})
"""Parts of a Linear layer's qualified name that put it in a feed-forward block (strategies.fp8_layers)."""


def feed_forward(fqn: str) -> bool:
    """A layer of a transformer's feed-forward block, by its qualified name ("model.layers.0.mlp.up_proj")."""
    return bool(FEED_FORWARD & set(fqn.split(".")))


def fp8_layer_filter(layers: str = "all"):
    """torchao's module_filter_fn for fp8_layers' value: the eligible Linear layers, all or the feed-forward ones."""
    if layers == "all":
        return fp8_eligible
    return lambda module, fqn="": fp8_eligible(module, fqn) and feed_forward(fqn)


def _eligible_layers(model: torch.nn.Module, layers: str) -> list[torch.nn.Linear]:
    keep = fp8_layer_filter(layers)
    return [m for fqn, m in model.named_modules() if keep(m, fqn)]


def fp8_eligible_share(model: torch.nn.Module, layers: str = "all") -> float:
    """The share of the model's parameters in Linear layers fp8 can run (0: fp8 would change nothing);
    ``layers`` "feed-forward": in those of the feed-forward blocks."""
    total = sum(p.numel() for p in model.parameters())
    eligible = sum(m.weight.numel() for m in _eligible_layers(model, layers))
    return eligible / total if total else 0.0


def fp8_width(model: torch.nn.Module, layers: str = "all") -> float:
    """The eligible Linear layers' narrower width (min of in and out features), averaged over their
    parameters: how large the matmuls fp8 would speed up are (0 where none is eligible)."""
    found = _eligible_layers(model, layers)
    total = sum(m.weight.numel() for m in found)
    return sum(m.weight.numel() * min(m.in_features, m.out_features) for m in found) / total if total else 0.0


def to_float8_training(model: torch.nn.Module, layers: str = "all") -> torch.nn.Module:
    """Swap the eligible Linear layers (``layers``: all, or the feed-forward blocks' ones:
    strategies.fp8_layers) for torchao's Float8Linear, in place (same parameters, so an optimizer
    built before still steps them, and checkpoints keep their keys)."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as exc:
        raise ConfigError(f"this configuration trains in fp8 through torchao, which is not installed "
                          f"({exc}); {FP8_EXTRA}") from exc
    if not _eligible_layers(model, layers):
        which = "" if layers == "all" else f"{layers} "
        raise ConfigError(f"fp8: no {which}Linear layer of this model has both widths a multiple of 16, so none can "
                          "train in float8; search without fp8 (--precisions)")
    converted = convert_to_float8_training(model, module_filter_fn=fp8_layer_filter(layers))
    if converted is not model:  # the model is itself one Linear: swap its parameters into a wrapper
        raise ConfigError("fp8: the model is a single Linear layer, which torchao replaces rather than converts "
                          "in place; wrap it in an nn.Sequential")
    return model


def torchao_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def fp8_supported() -> bool:
    """FP8 Tensor Cores exist from compute capability 8.9 (Ada) on; training them needs torchao."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and torchao_installed()


def tf32_supported() -> bool:
    """TF32 Tensor Cores exist from compute capability 8.0 (Ampere) on."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def cpu_has_bf16() -> bool:
    """Native bf16 arithmetic (AVX512-BF16 or AMX); without it bf16 is emulated and slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def supported_modes(device: str) -> list[str]:
    """The precision modes this device runs natively, fp32 first."""
    if device == "cpu":
        return ["fp32", "bf16"] if cpu_has_bf16() else ["fp32"]
    modes = ["fp32"]
    if tf32_supported():
        modes.append("tf32")
    modes.append("fp16")
    if torch.cuda.is_bf16_supported(including_emulation=False):
        modes.append("bf16")
    if fp8_supported():
        modes.append("fp8")
    return modes
