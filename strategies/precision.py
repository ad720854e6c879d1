"""precision: FP32, TF32, or automatic mixed precision (fp16 / bf16 autocast).

Only modes the device supports are offered (TF32 needs Ampere or newer, bf16 needs hardware
bf16: Ampere or newer on CUDA, AVX512-BF16 or AMX on a CPU; ``--precisions`` overrides). "fp32" really is FP32: PyTorch lets cuDNN use TF32 for convolutions by
default, so the baseline switches TF32 off explicitly. Under autocast, the ops that stay in
float32 may use TF32 where the device has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from autotune.deploy.recipe import Recipe
from autotune.deploy.space import SearchSpace
from autotune.errors import ConfigError
from strategies.base import ReportKnob, Strategy

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


MODES = ("fp32", "tf32", "fp16", "bf16")


class Precision(Strategy):
    name = "precision"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        mode: str = "fp32"
        """fp32 | tf32 | fp16 | bf16 (the last two are autocast modes)."""

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        precisions = probe["precisions"]
        if options.precisions is not None:
            # bf16 on a CPU without native bf16 is emulated: slow, but the user may want to see it
            unsupported = [m for m in options.precisions
                           if m not in precisions and not (m == "bf16" and device != "cuda")]
            if unsupported:
                raise ConfigError(f"--precisions {','.join(options.precisions)}: this device does not support "
                                  f"{', '.join(unsupported)} (it supports {', '.join(precisions)})")
            precisions = [m for m in MODES if m in options.precisions]
        return {"precisions": precisions}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        return {} if tuned else {"precision.mode": "fp32"}  # the known-good ones name their mode

    def words(self, values: Mapping[str, Any]) -> str:
        return values.get("mode", "fp32")

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("precision", "precision", self.name, "mode", "fp32")]

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(mode=self.choose(trial, "mode", space.precisions))

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.autocast_dtype = AUTOCAST_DTYPES.get(config.mode)
        if recipe.device == "cuda":
            # a recipe depends on its knobs alone: on a GPU without TF32 the switch does nothing
            fp32_math = "ieee" if config.mode == "fp32" else "tf32"
            recipe.backend_flags["matmul_fp32_precision"] = fp32_math
            recipe.backend_flags["conv_fp32_precision"] = fp32_math


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
    return modes
