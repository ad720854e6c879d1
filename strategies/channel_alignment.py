"""Pad Conv and Linear widths to a multiple of 8 or 16 with zeros.

Tensor Cores run fp16/bf16 GEMMs and convolutions only when the channel/feature dimensions
are multiples of 8 (16 helps some kernels); otherwise cuBLAS/cuDNN fall back to slower kernels
or pad internally. The padded layers compute exactly the same function, but padding costs an
extra copy per call, so whether it pays off is measured by the study, not assumed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.conv import _ConvNd

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy

__all__ = [
    "AlignedConv1d",
    "AlignedConv2d",
    "AlignedConv3d",
    "AlignedLinear",
    "ChannelAlignment",
    "align_channels",
    "misaligned_layers",
]


def _round_up(width: int, multiple: int) -> int:
    return -(-width // multiple) * multiple


class _AlignedConvNd(_ConvNd):
    """A Conv whose forward runs on zero-padded widths ``aligned_to = (in_p, out_p)``.

    The parameters keep their original shapes; the padded weight is rebuilt on every call so
    gradients land on the original parameters and checkpoints stay interchangeable.
    """

    aligned_to: tuple[int, int]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        in_p, out_p = self.aligned_to
        extra_in, extra_out = in_p - self.in_channels, out_p - self.out_channels
        # Python ints only (no tensor.dim()), so FX tracing and torch.compile see static shapes.
        spatial = [0, 0] * len(self.kernel_size)
        weight = self.weight
        if extra_in or extra_out:
            weight = F.pad(weight, spatial + [0, extra_in, 0, extra_out])
        bias = self.bias
        if bias is not None and extra_out:
            bias = F.pad(bias, [0, extra_out])
        if extra_in:
            # Zero channels meet zero weights; reflect/circular padding of zeros is still zero.
            input = F.pad(input, spatial + [0, extra_in])
        out = self._conv_forward(input, weight, bias)
        if extra_out:
            # Channels sit before the spatial dims in batched and unbatched inputs alike.
            out = out.narrow(-len(self.kernel_size) - 1, 0, self.out_channels)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, aligned_to={self.aligned_to}"


class AlignedConv1d(_AlignedConvNd, nn.Conv1d):
    """:class:`torch.nn.Conv1d` computing on channel widths padded to ``aligned_to``."""


class AlignedConv2d(_AlignedConvNd, nn.Conv2d):
    """:class:`torch.nn.Conv2d` computing on channel widths padded to ``aligned_to``."""


class AlignedConv3d(_AlignedConvNd, nn.Conv3d):
    """:class:`torch.nn.Conv3d` computing on channel widths padded to ``aligned_to``."""


class AlignedLinear(nn.Linear):
    """:class:`torch.nn.Linear` computing on feature widths padded to ``aligned_to``."""

    aligned_to: tuple[int, int]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        in_p, out_p = self.aligned_to
        extra_in, extra_out = in_p - self.in_features, out_p - self.out_features
        weight = self.weight
        if extra_in or extra_out:
            weight = F.pad(weight, [0, extra_in, 0, extra_out])
        bias = self.bias
        if bias is not None and extra_out:
            bias = F.pad(bias, [0, extra_out])
        if extra_in:
            input = F.pad(input, [0, extra_in])
        out = F.linear(input, weight, bias)
        if extra_out:
            out = out.narrow(-1, 0, self.out_features)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, aligned_to={self.aligned_to}"


# Exact types only: subclasses (NonDynamicallyQuantizableLinear, QAT and parametrized modules,
# user layers) may not call their own forward the standard way, so they are left alone.
_ALIGNED: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: AlignedConv1d,
    nn.Conv2d: AlignedConv2d,
    nn.Conv3d: AlignedConv3d,
    nn.Linear: AlignedLinear,
}
_ALIGNED_TYPES = frozenset(_ALIGNED.values())


def _widths(layer: nn.Module) -> tuple[int, int] | None:
    """The layer's (in, out) widths if it is eligible for padding, else None."""
    kind = type(layer)
    if kind not in _ALIGNED and kind not in _ALIGNED_TYPES:
        return None
    if isinstance(layer.weight, nn.parameter.UninitializedParameter):
        return None
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    assert isinstance(layer, _ConvNd)
    # Grouped/depthwise convs would need per-group padding; not worth it.
    if layer.groups != 1:
        return None
    return layer.in_channels, layer.out_channels


def _effective_widths(layer: nn.Module, widths: tuple[int, int]) -> tuple[int, int]:
    """The widths the layer actually computes on."""
    return layer.aligned_to if type(layer) in _ALIGNED_TYPES else widths


def _check_multiple(multiple: int) -> None:
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple must be a positive integer, got {multiple!r}")


def align_channels(model: nn.Module, multiple: int) -> nn.Module:
    """Make every eligible Conv/Linear layer of ``model`` compute on widths padded to ``multiple``.

    Eligible: exact ``nn.Conv1d/2d/3d`` with ``groups == 1`` and ``nn.Linear``. A layer whose
    in or out width is not a multiple is turned, in place, into its ``Aligned*`` subclass: the
    same module object with the same Parameters, buffers, hooks, attributes, mode and device,
    so optimizers built earlier and existing checkpoints keep working. Calling it again
    re-targets aligned layers to the new multiple instead of wrapping twice; ``multiple == 1``
    changes nothing. Returns ``model``.
    """
    _check_multiple(multiple)
    if multiple == 1:
        return model
    for layer in model.modules():
        widths = _widths(layer)
        if widths is None:
            continue
        padded = (_round_up(widths[0], multiple), _round_up(widths[1], multiple))
        if type(layer) in _ALIGNED_TYPES:
            layer.aligned_to = padded
        elif padded != widths:
            # Swapping the class (as torch.nn.utils.parametrize does) keeps the module object
            # itself, so shared layers and references held outside the module tree stay valid.
            layer.__class__ = _ALIGNED[type(layer)]
            layer.aligned_to = padded
    return model


def misaligned_layers(model: nn.Module, multiple: int) -> list[str]:
    """Qualified names of eligible layers whose computed widths are not multiples of ``multiple``."""
    _check_multiple(multiple)
    names = []
    for name, layer in model.named_modules():
        widths = _widths(layer)
        if widths is None:
            continue
        if any(w % multiple for w in _effective_widths(layer, widths)):
            names.append(name)
    return names


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
MULTIPLE_PARAM = "channel_alignment.multiple"


class ChannelAlignment(Strategy):
    """Pad Conv/Linear widths to a channel multiple (see :func:`align_channels`)."""

    name = "channel_alignment"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        multiple: int = 1
        """Pad layer widths up to a multiple of this (1 = no padding)."""

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        # padding pays on Tensor Cores only, and only for the multiples the probe found layers off
        misaligned = probe.get("misaligned", {})
        return {"alignments": [1] + ([m for m in (8, 16) if misaligned.get(str(m))] if device == "cuda" else [])}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        return {MULTIPLE_PARAM: 1}

    def words(self, values: Mapping[str, Any]) -> str:
        return f"pad x{values['multiple']}" if values.get("multiple", 1) > 1 else ""

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("channel_alignment", "channel padding (multiple)", self.name, "multiple", 1)]

    def suggest(self, trial: optuna.trial.BaseTrial, space: SearchSpace,
                chosen: Mapping[str, Any]) -> Config:
        return self.Config(
            multiple=self.choose(trial, "multiple", space.alignments))

    def apply(self, config: Config, recipe: Recipe) -> None:
        if config.multiple > 1:
            recipe.model_transforms.append(
                functools.partial(align_channels, multiple=config.multiple))
