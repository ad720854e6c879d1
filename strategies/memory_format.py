"""memory_format: contiguous (NCHW) or channels_last (NHWC) for the model and its 4-D inputs.

cuDNN's Tensor-Core convolutions work in NHWC; with NCHW tensors it inserts layout
conversions around them, which channels_last removes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy

FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
FORMAT_PARAM = "memory_format.format"


class MemoryFormat(Strategy):
    name = "memory_format"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        format: str = "contiguous"
        """contiguous | channels_last."""

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        image_like = probe.get("input_dim") == 4  # channels_last is a layout of 4-D tensors
        return {"memory_formats": ["contiguous", "channels_last"] if image_like else ["contiguous"]}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        fast = "channels_last" if "channels_last" in space.memory_formats else "contiguous"
        return {FORMAT_PARAM: fast if tuned else "contiguous"}

    def words(self, values: Mapping[str, Any]) -> str:
        return values.get("format", "contiguous")

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("memory_format", "memory format", self.name, "format", "contiguous")]

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(format=self.choose(trial, "format", space.memory_formats))

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.memory_format = FORMATS[config.format]
