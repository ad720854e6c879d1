"""memory_format: contiguous (NCHW) or channels_last (NHWC) for the model and its 4-D inputs.

cuDNN's Tensor-Core convolutions work in NHWC; with NCHW tensors it inserts layout
conversions around them, which channels_last removes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from autotune.deploy.recipe import Recipe
from autotune.deploy.space import SearchSpace
from strategies.base import Strategy

FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


class MemoryFormat(Strategy):
    name = "memory_format"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        format: str = "contiguous"
        """contiguous | channels_last."""

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(format=self.choose(trial, "format", space.memory_formats))

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.memory_format = FORMATS[config.format]
