"""The models of the numerics parity check's must-pass and must-fail cases (tests/test_parity.py,
scripts/parity_calibration.py), importable as ``--model parity_models:NAME`` with scripts/ on
PYTHONPATH. Each is a Workload whose batches are Gaussian inputs labelled by a fixed random linear
teacher (learnable), small enough for a 2-core CPU:

- ``mlp``: well conditioned: a LayerNorm'd input layer, two residual blocks of one class in an
  nn.ModuleList (repeated blocks, for activation checkpointing), a head. FP32, bf16 autocast, fp16
  with or without a GradScaler all train it alike.
- ``underflow_mlp``: the same model, its loss weighted 2**-22 (an auxiliary loss's weight, or a sum
  normalised by some four million tokens): every gradient of its logits is below 2**-25, half of fp16's
  smallest subnormal, so under fp16 autocast without a GradScaler all its gradients round to zero;
  AdamW, invariant to the gradients' scale, trains it in FP32 as the plain mlp, and so does fp16 with
  the GradScaler (65,536 x brings them back into fp16's range).
- ``overflow_mlp``: the same model reading inputs in raw units, 2**17 times the mlp's (sensor counts,
  pixel sums): its first layer's fp16 inputs and outputs pass 65,504, fp16's largest finite value, and
  turn to inf; the LayerNorm after it makes FP32 (and bf16, whose range is FP32's) train it as the mlp.
  A GradScaler cannot help: the overflow is in the forward pass.
- ``wide_linear``: a linear classifier over 16,384 inputs whose weights are all 1 to 2 in magnitude:
  there bf16's spacing is 2**-7, so an AdamW update of lr 1e-3 or less (a few lr at most) is less than half
  of it and rounds away from bf16 weights; with FP32 master weights (bf16 autocast) it is kept.

``bf16_weights`` is the model transform of a precision no knob offers: weights (and so the optimizer's
update) in bf16, with no FP32 master copy.
"""

from __future__ import annotations

import torch
from torch import nn

import autotune

DIM, CLASSES = 32, 10
WIDE = 16384
UNDERFLOW_LOSS_WEIGHT = 2.0 ** -22
OVERFLOW_INPUT_GAIN = 2.0 ** 17


def _teacher_batches(dim: int):
    """Gaussian inputs, labelled by a fixed random linear teacher (the same for every seed)."""
    teacher = torch.randn(dim, CLASSES, generator=torch.Generator().manual_seed(1234))

    def make_batch(batch_size: int, generator: torch.Generator):
        x = torch.randn(batch_size, dim, generator=generator)
        return x, (x @ teacher).argmax(dim=1)

    return make_batch


class Block(nn.Module):
    """A residual MLP block: x + W2 relu(W1 norm(x))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, *, width: int = 64, gain: float = 1.0) -> None:
        super().__init__()
        self.gain = gain
        self.inp = nn.Linear(DIM, width)
        self.norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x * self.gain)) if self.gain != 1.0 else self.norm(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def mlp() -> autotune.Workload:
    return autotune.Workload(model=MLP(), make_batch=_teacher_batches(DIM), input_shape=(DIM,), num_classes=CLASSES)


def underflow_mlp() -> autotune.Workload:
    ce = nn.CrossEntropyLoss()

    def weighted(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return ce(logits, targets) * UNDERFLOW_LOSS_WEIGHT

    return autotune.Workload(model=MLP(), make_batch=_teacher_batches(DIM), loss_fn=weighted, input_shape=(DIM,),
                             num_classes=CLASSES)


def overflow_mlp() -> autotune.Workload:
    return autotune.Workload(model=MLP(gain=OVERFLOW_INPUT_GAIN), make_batch=_teacher_batches(DIM),
                             input_shape=(DIM,), num_classes=CLASSES)


class WideLinear(nn.Module):
    """logits = W x / (1.5 sqrt(d)), every |W_ij| in [1, 2): logits of about unit scale."""

    def __init__(self, dim: int = WIDE) -> None:
        super().__init__()
        self.dim = dim
        magnitude = 1 + torch.rand(CLASSES, dim)
        sign = torch.where(torch.rand(CLASSES, dim) < 0.5, -1.0, 1.0)
        self.weight = nn.Parameter(magnitude * sign)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight) / (1.5 * self.dim ** 0.5)


def wide_linear() -> autotune.Workload:
    return autotune.Workload(model=WideLinear(), make_batch=_teacher_batches(WIDE), input_shape=(WIDE,),
                             num_classes=CLASSES)


def bf16_weights(model: nn.Module) -> nn.Module:
    """The model's weights in bf16, in place (its parameters keep their identity, so the optimizer
    steps bf16 weights with bf16 states): training with no FP32 master copy. Used with bf16 autocast,
    which feeds the layers bf16 inputs."""
    return model.to(torch.bfloat16)
