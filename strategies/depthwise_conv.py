"""depthwise_conv: a depthwise convolution's input gradient as a forward convolution of the output's gradient.

A depthwise convolution (one filter a channel: ``groups == in_channels == out_channels``, ConvNeXt's
7x7, MobileNet's and EfficientNet's 3x3 and 5x5) is memory-bound, and cuDNN's backward-data kernel
for it is slower than its forward kernel on the same shapes (a profile's ``dgrad2d`` against its
``conv2d`` kernels; reports/measurement-log.md has the figures).

For stride 1 and dilation 1 the input's gradient is itself a depthwise convolution: the output's
gradient convolved with each filter turned by 180 degrees, padded by ``kernel - 1 - padding``. With
``input_grad="flipped"`` the eligible layers compute it so, with the forward kernel; the weight's and
the bias's gradients stay the framework's (``aten.convolution_backward`` for the weight alone). The
result is the same sum taken in another order: equal up to rounding, which the accuracy check compares
with FP32 as it does a precision. What the move is hoped to give before a trial measures it is the
priors table's row (autotune.priors, measured by scripts/depthwise_bench.py); whether it pays on
a model is that model's trial to measure.

Eligible: exact ``nn.Conv2d`` modules with ``groups == in_channels == out_channels``, stride 1,
dilation 1, zero padding of at most ``kernel - 1`` on each side (``padding="same"`` included). The
module keeps its parameters, its state_dict and its class's other behaviour (the class is swapped for
:class:`FlippedGradConv2d`, as channel padding swaps classes): an unbatched (C, H, W) input, frozen
parameters and ``torch.func``'s transforms (``vmap``, ``grad``, ``jvp``) give ``nn.Conv2d``'s gradients. A
forward without gradients (``torch.no_grad``, inference) is the framework's, and so is one inside a
``torch.func`` transform that ``torch.compile`` traces. Offered on CUDA for a model the probe found such layers in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strategies.base import LayerSwap, swap_layers


def _padding(layer: nn.Conv2d) -> tuple[int, int] | None:
    """The layer's zero padding (top/bottom, left/right) as numbers; None where it is not symmetric
    numbers ("same" with an even kernel pads one side more)."""
    kh, kw = layer.kernel_size
    if layer.padding == "same":
        if kh % 2 == 0 or kw % 2 == 0:
            return None
        return (kh - 1) // 2, (kw - 1) // 2
    if isinstance(layer.padding, str):  # "valid"
        return 0, 0
    return int(layer.padding[0]), int(layer.padding[1])


def eligible(layer: nn.Module) -> bool:
    """Whether ``layer`` is a depthwise convolution whose input gradient this knob can compute."""
    if type(layer) is not nn.Conv2d:
        return False
    padding = _padding(layer)
    return (layer.groups == layer.in_channels == layer.out_channels and layer.groups > 1
            and tuple(layer.stride) == (1, 1) and tuple(layer.dilation) == (1, 1)
            and layer.padding_mode == "zeros" and padding is not None
            and all(0 <= p <= k - 1 for p, k in zip(padding, layer.kernel_size)))


def depthwise_layers(model: nn.Module) -> int:
    """How many eligible depthwise convolutions ``model`` has (what the probe reports)."""
    return sum(1 for m in model.modules() if eligible(m))


class _FlippedGrad(torch.autograd.Function):
    """A depthwise convolution (stride 1, dilation 1) of a batched (N, C, H, W) input whose input gradient is a
    forward convolution.

    Written in the ``setup_context`` style and only of PyTorch operations so that ``generate_vmap_rule``
    holds: ``torch.func``'s transforms (``vmap(grad(...))`` per-sample gradients as Opacus takes them,
    ``jacrev``; ``jvp`` with :class:`_FlippedGradJvp`) compose with it as they do with ``nn.Conv2d``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                padding: tuple[int, int]) -> torch.Tensor:
        return F.conv2d(x, weight, bias, 1, padding, 1, weight.shape[0])

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, weight, bias, padding = inputs
        ctx.save_for_backward(x, weight)
        ctx.padding, ctx.has_bias = padding, bias is not None

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        (ph, pw), (kh, kw), groups = ctx.padding, weight.shape[-2:], weight.shape[0]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = F.conv2d(grad, weight.flip(-2, -1), None, 1, (kh - 1 - ph, kw - 1 - pw), 1, groups)
        if ctx.needs_input_grad[1]:
            grad_w = torch.ops.aten.convolution_backward(
                grad, x, weight, None, [1, 1], [ph, pw], [1, 1], False, [0, 0], groups, [False, True, False])[1]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum((0, 2, 3))
        return grad_x, grad_w, grad_b, None


class _FlippedGradJvp(_FlippedGrad):
    """:class:`_FlippedGrad` with forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``hessian``), for eager use:
    Dynamo does not trace a Function with a custom ``jvp`` (it breaks the graph there)."""

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _FlippedGrad.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*inputs[:2])

    @staticmethod
    def jvp(ctx, x_t: torch.Tensor | None, weight_t: torch.Tensor | None, bias_t: torch.Tensor | None, _):
        """Linear in each argument: ``conv(x_t, w) + b_t + conv(x, w_t)``, the terms of ``nn.Conv2d``'s
        forward-mode rule; a missing tangent is a zero term."""
        x, weight = ctx.saved_tensors
        padding, groups = ctx.padding, weight.shape[0]
        if x_t is None and bias_t is not None:
            x_t = torch.zeros_like(x)  # the bias's tangent alone still fills the output's shape
        out_t = F.conv2d(x_t, weight, bias_t, 1, padding, 1, groups) if x_t is not None else None
        if weight_t is not None:
            term = F.conv2d(x, weight_t, None, 1, padding, 1, groups)
            out_t = term if out_t is None else out_t + term
        return out_t


def _in_func_transform() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jvp) is running. Constant within a compiled graph:
    Dynamo traces a transform together with its body, so where the call sits in the code decides it
    (marked so by _mark_constant when a layer is made)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _mark_constant() -> None:
    """Mark _in_func_transform's result constant for Dynamo. Done when a flipped layer is made, not at
    import: the marker imports torch._dynamo, 1.6 s that every process importing the knobs would pay."""
    torch.compiler.assume_constant_result(_in_func_transform)  # idempotent: it sets one attribute


class FlippedGradConv2d(nn.Conv2d):
    """:class:`torch.nn.Conv2d` (depthwise, stride 1) whose input gradient in training is a forward
    convolution of the output's gradient with the turned filters (:class:`_FlippedGrad`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _mark_constant()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return super().forward(input)
        function = _FlippedGradJvp
        if torch.compiler.is_compiling():
            # Dynamo neither traces a custom jvp nor vmaps a Function: inside a compiled torch.func
            # transform the convolution is the framework's, elsewhere the Function without its jvp
            if _in_func_transform():
                return super().forward(input)
            function = _FlippedGrad
        if input.dim() == 3:  # unbatched (C, H, W), as nn.Conv2d takes it: a batch of one to the Function
            return self._apply_flipped(function, input.unsqueeze(0)).squeeze(0)
        return self._apply_flipped(function, input)

    def _apply_flipped(self, function: type[_FlippedGrad], input: torch.Tensor) -> torch.Tensor:
        weight, bias, device_type = self.weight, self.bias, input.device.type
        if torch.is_autocast_enabled(device_type):
            # autocast's cast, made here: the backward's convolutions see the forward's dtypes
            dtype = torch.get_autocast_dtype(device_type)
            input, weight = input.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
            with torch.autocast(device_type, enabled=False):
                return function.apply(input, weight, bias, _padding(self))
        return function.apply(input, weight, bias, _padding(self))


def flip_input_grad(model: nn.Module) -> nn.Module:
    """Swap every eligible depthwise convolution of ``model`` to :class:`FlippedGradConv2d`, in place
    (the same module objects and parameters). Returns ``model``."""
    _mark_constant()
    return swap_layers(model, eligible, FlippedGradConv2d)


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
INPUT_GRAD_PARAM = "depthwise_conv.input_grad"


class DepthwiseConv(LayerSwap):
    """A depthwise convolution's input gradient: the framework's, or a flipped forward convolution."""

    name = "depthwise_conv"
    label = "depthwise input gradient"
    field, swapped, probe_key, words_swapped = "input_grad", "flipped", "depthwise_convs", "depthwise grad flipped"
    transform = staticmethod(flip_input_grad)

    @dataclass(kw_only=True, frozen=True)
    class Config:
        input_grad: str = "framework"
        """"framework" (the convolution's own backward) or "flipped" (see the module's docstring)."""
