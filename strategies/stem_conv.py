"""stem_conv: a strided stem convolution on few input channels, rewritten as space-to-depth.

An image model's first convolution reads 3 channels (RGB) with a large stride-2 kernel: ResNet's
7x7 to 64 channels. Tensor Core convolution kernels want many input channels, so cuDNN runs this one
far from the GPU's peak: in ResNet-50's compiled bf16 step its forward and weight gradient take about
6% of the step's time for 0.6% of its FLOPs.

With ``stem="space_to_depth"`` an eligible layer computes the same function as a stride-1
convolution on a rearranged input, as MLPerf's TPU ResNet does: each ``s x s`` block of input pixels
(``s`` the stride) becomes ``s*s`` channels, and the kernel, zero-padded to a multiple of ``s``, is
rearranged alike. ResNet's 224x224x3 input becomes 115x115x12 (16 with the channel padding the layer
is given), its 7x7/2 kernel a 4x4/1 one. The rearranged weight is rebuilt from the layer's own on
every call, so gradients land on the original parameter and checkpoints stay interchangeable. The
result is the same sum of products taken in another order: equal up to rounding, which the accuracy
check compares with FP32 as it does a precision.

Eligible: exact ``nn.Conv2d`` with ``groups == 1``, dilation 1, a stride ``s > 1`` equal on both
axes, a kernel at least ``s`` on each axis, zero padding, and at most 4 input channels (a stem: on
wider inputs cuDNN's kernels are already efficient). Offered on CUDA for a model the probe found one in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.conv import _ConvNd

from strategies.base import LayerSwap, swap_layers

MAX_IN_CHANNELS = 4
CHANNEL_MULTIPLE = 8
"""The rearranged input's channels are zero-padded to a multiple of this, for Tensor Cores."""


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


def eligible(layer: nn.Module) -> bool:
    """Whether ``layer`` is a stem convolution :class:`SpaceToDepthConv2d` computes (see the module)."""
    if type(layer) is not nn.Conv2d or layer.groups != 1 or layer.in_channels > MAX_IN_CHANNELS:
        return False
    if isinstance(layer.padding, str) or layer.padding_mode != "zeros" or _pair(layer.dilation) != (1, 1):
        return False
    (sh, sw), (kh, kw) = _pair(layer.stride), _pair(layer.kernel_size)
    return sh == sw and sh > 1 and kh >= sh and kw >= sw


def stem_layers(model: nn.Module) -> int:
    """How many of ``model``'s layers are eligible."""
    return sum(eligible(m) for m in model.modules())


def stem_share(model: nn.Module, inputs: Any) -> float | None:
    """The eligible stems' share of the multiply-adds of ``model``'s convolutions and Linear layers in one
    forward on ``inputs`` (without gradients): what the planner scales the move's prior by (a stem the
    smaller share of a step has less to give). 0.0 without a stem; None where the forward fails."""
    if not stem_layers(model):
        return 0.0
    macs = {"stem": 0, "all": 0}

    def count(module: nn.Module, args: Any, out: Any) -> None:
        if not isinstance(out, torch.Tensor):
            return
        if isinstance(module, nn.Linear):
            made = out.numel() * module.in_features
        else:
            made = out.numel() * (module.in_channels // module.groups) * math.prod(module.kernel_size)
        macs["all"] += made
        macs["stem"] += made if eligible(module) else 0

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, (_ConvNd, nn.Linear))]
    try:
        with torch.no_grad():
            model(inputs)
    except Exception:  # the user's model, not ours: the move keeps its prior
        return None
    finally:
        for hook in hooks:
            hook.remove()
    return macs["stem"] / macs["all"] if macs["all"] else None


def space_to_depth_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        stride: int, padding: tuple[int, int], multiple: int = CHANNEL_MULTIPLE) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding)`` computed as a stride-1 convolution on ``x``
    rearranged into ``stride x stride`` blocks (see the module's docstring), whose channels are
    zero-padded to a multiple of ``multiple``. ``x`` is (N, C, H, W)."""
    s = stride
    # the rearranged input keeps the input's memory format (a channels_last model's convolutions run NHWC)
    layout = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() \
        else torch.contiguous_format
    out_c, in_c, kh, kw = weight.shape
    (ph, pw), (h, w) = padding, x.shape[-2:]
    oh, ow = (h + 2 * ph - kh) // s + 1, (w + 2 * pw - kw) // s + 1
    bh, bw = -(-kh // s), -(-kw // s)  # the rearranged kernel's extent, in blocks
    # pad (or crop) so that the blocks cover every window: s * (out + blocks - 1) input rows
    right, bottom = s * (ow + bw - 1) - w - pw, s * (oh + bh - 1) - h - ph
    x = F.pad(x, (pw, right, ph, bottom))
    hb, wb = x.shape[-2] // s, x.shape[-1] // s
    channels = in_c * s * s
    padded = -(-channels // multiple) * multiple
    x = x.reshape(x.shape[0], in_c, hb, s, wb, s).permute(0, 1, 3, 5, 2, 4).reshape(x.shape[0], channels, hb, wb)
    weight = F.pad(weight, (0, bw * s - kw, 0, bh * s - kh))
    weight = weight.reshape(out_c, in_c, bh, s, bw, s).permute(0, 1, 3, 5, 2, 4).reshape(out_c, channels, bh, bw)
    if padded != channels:
        x = F.pad(x, (0, 0, 0, 0, 0, padded - channels))
        weight = F.pad(weight, (0, 0, 0, 0, 0, padded - channels))
    return F.conv2d(x.contiguous(memory_format=layout), weight, bias)


class SpaceToDepthConv2d(nn.Conv2d):
    """:class:`torch.nn.Conv2d` (an eligible stem) computed by :func:`space_to_depth_conv`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() != 4:
            return super().forward(input)
        return space_to_depth_conv(input, self.weight, self.bias, _pair(self.stride)[0], _pair(self.padding))


def space_to_depth(model: nn.Module) -> nn.Module:
    """Swap every eligible stem convolution of ``model`` to :class:`SpaceToDepthConv2d`, in place
    (the same module objects and parameters). Returns ``model``."""
    return swap_layers(model, eligible, SpaceToDepthConv2d)


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
STEM_PARAM = "stem_conv.stem"


class StemConv(LayerSwap):
    """A stem convolution's formulation: the framework's, or space-to-depth."""

    name = "stem_conv"
    label = "stem convolution"
    field, swapped, probe_key, words_swapped = "stem", "space_to_depth", "stem_convs", "stem space-to-depth"
    transform = staticmethod(space_to_depth)

    @dataclass(kw_only=True, frozen=True)
    class Config:
        stem: str = "framework"
        """"framework" (the layer's own convolution) or "space_to_depth" (see the module's docstring)."""
