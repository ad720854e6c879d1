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

The calibration's three real networks, small enough for a 2-core CPU, each learning a teacher's task
(autotune.workload.data: teacher-labelled images, a Markov teacher's tokens):

- ``resnet18``: torchvision's ResNet-18 (BatchNorm) at 16x16 inputs, 10 classes.
- ``convnext``: a ConvNeXt built by timm (LayerNorm, depthwise 7x7 convolutions, layer scale) with
  few channels, at 32x32 inputs.
- ``llama``: transformers' Llama with 2 layers, hidden size 64, a vocabulary of 1,000, sequences of 32.

And for tests, ``bn_cnn``: two convolutions with BatchNorm at 8x8 inputs, small enough for a unit test.

Each also as ``NAME_underflow`` (its loss weighted UNDERFLOW_LOSS_WEIGHT) and ``NAME_loss_2m14`` (its
loss weighted 2**-14: fp16's smallest normal number, so that without loss scaling part of its
gradients, not all, fall below fp16's range).

The faults no knob offers, as model transforms (``Recipe.model_transforms``): ``bf16_weights``,
``weights_in_mantissa(bits)`` (weights kept in a float format of ``bits`` mantissa bits, no master
copy), ``zero_grad_of(pick)`` (one tensor's gradient zeroed: a frozen norm gain), and
``coarse_optimizer_states(bits)`` (Adam's moments rounded to ``bits`` bits a block after every step).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

import autotune

DIM, CLASSES = 32, 10
WIDE = 16384
UNDERFLOW_LOSS_WEIGHT = 2.0 ** -22
FP16_TINY_LOSS_WEIGHT = 2.0 ** -14
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


# ---------------------------------------------------------------------------------------------
# real networks


IMAGE_SIDE = {"resnet18": 16, "convnext": 32}
LLAMA = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}
LLAMA_SEQ_LEN = 32


def _weighted(workload: autotune.Workload, weight: float) -> autotune.Workload:
    """``workload`` with its loss multiplied by ``weight`` (an auxiliary loss's weight, or a sum
    normalised by many tokens): the same training under AdamW down to its eps, smaller gradients."""
    loss_fn = workload.loss_fn

    def weighted(output, targets):
        return loss_fn(output, targets) * weight

    workload.loss_fn = weighted
    return workload


def _resnet18() -> autotune.Workload:
    import torchvision

    side = IMAGE_SIDE["resnet18"]
    return autotune.Workload(model=torchvision.models.resnet18(num_classes=CLASSES), input_shape=(3, side, side),
                             num_classes=CLASSES)


def _convnext() -> autotune.Workload:
    from timm.models.convnext import ConvNeXt

    side = IMAGE_SIDE["convnext"]
    model = ConvNeXt(num_classes=CLASSES, depths=(1, 1, 2, 1), dims=(16, 32, 64, 128))
    return autotune.Workload(model=model, input_shape=(3, side, side), num_classes=CLASSES)


def _llama() -> autotune.Workload:
    from autotune.workload.hub import build_hf

    return autotune.Workload(**build_hf("hf:llama", dict(LLAMA), LLAMA_SEQ_LEN))


class BatchNormCNN(nn.Module):
    """conv-BN-ReLU twice (the second strided), global mean, a head: BatchNorm's amplification of a
    rounding-sized difference in a test's few seconds."""

    def __init__(self, num_classes: int = CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32),
                                      nn.ReLU())
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def bn_cnn() -> autotune.Workload:
    return autotune.Workload(model=BatchNormCNN(), input_shape=(3, 8, 8), num_classes=CLASSES)


def resnet18() -> autotune.Workload:
    return _resnet18()


def resnet18_underflow() -> autotune.Workload:
    return _weighted(_resnet18(), UNDERFLOW_LOSS_WEIGHT)


def resnet18_loss_2m14() -> autotune.Workload:
    return _weighted(_resnet18(), FP16_TINY_LOSS_WEIGHT)


def convnext() -> autotune.Workload:
    return _convnext()


def convnext_underflow() -> autotune.Workload:
    return _weighted(_convnext(), UNDERFLOW_LOSS_WEIGHT)


def convnext_loss_2m14() -> autotune.Workload:
    return _weighted(_convnext(), FP16_TINY_LOSS_WEIGHT)


def llama() -> autotune.Workload:
    return _llama()


def llama_underflow() -> autotune.Workload:
    return _weighted(_llama(), UNDERFLOW_LOSS_WEIGHT)


def llama_loss_2m14() -> autotune.Workload:
    return _weighted(_llama(), FP16_TINY_LOSS_WEIGHT)


# ---------------------------------------------------------------------------------------------
# faults no knob offers


def round_mantissa_(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``t`` (FP32, in place) rounded to nearest, ties to even, at ``bits`` bits of mantissa."""
    drop = 23 - bits
    i = t.view(torch.int32)
    lsb = (i >> drop) & 1
    i.add_((1 << (drop - 1)) - 1).add_(lsb).bitwise_and_(~((1 << drop) - 1))
    return t


def _after_each_step(model: nn.Module, act) -> None:
    """Call ``act(optimizer, parameters)`` after every optimizer step that steps any of ``model``'s
    parameters (a global optimizer hook, removed with the model): how a transform of the model reaches
    what the optimizer keeps."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    ids = {id(p) for p in model.parameters()}
    alive = weakref.ref(model)

    def hook(optimizer, args, kwargs) -> None:
        if alive() is None:
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if id(p) in ids]
        if params:
            act(optimizer, params)

    weakref.finalize(model, register_optimizer_step_post_hook(hook).remove)


def weights_in_mantissa(bits: int):
    """A model transform: every FP32 weight rounded to ``bits`` mantissa bits, at the start and after
    every optimizer step, so an update is kept only where it moves a weight to another such value:
    weights stored in a narrow float format with no master copy (3 bits: fp8 e4m3's mantissa)."""

    def rounded(optimizer, params) -> None:
        with torch.no_grad():
            for p in params:
                if p.dtype == torch.float32:
                    round_mantissa_(p.data, bits)

    def transform(model: nn.Module) -> nn.Module:
        rounded(None, list(model.parameters()))
        _after_each_step(model, rounded)
        return model

    return transform


def first_norm_gain(model: nn.Module) -> tuple[str, nn.Parameter]:
    """The gain of the model's first normalisation layer (BatchNorm, LayerNorm, RMSNorm)."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if "norm" in type(module).__name__.lower() and isinstance(weight, nn.Parameter) and weight.requires_grad:
            return f"{name}.weight", weight
    raise ValueError(f"{type(model).__name__} has no normalisation layer with a gain")


def zero_grad_of(pick=first_norm_gain):
    """A model transform: the gradient of the tensor ``pick(model)`` names is replaced by zeros
    (a norm gain frozen by mistake, or its gradient lost)."""

    def transform(model: nn.Module) -> nn.Module:
        _, param = pick(model)
        param.register_hook(torch.zeros_like)
        return model

    return transform


def _quantised_(t: torch.Tensor, bits: int, *, signed: bool, block: int = 256) -> None:
    """``t`` rounded in place to ``bits``-bit linear codes with one absmax scale per ``block`` values."""
    flat = t.view(-1)
    n = flat.numel()
    x = torch.cat([flat, flat.new_zeros((-n) % block)]).view(-1, block)
    scale = x.abs().amax(1, keepdim=True).clamp_min(torch.finfo(t.dtype).tiny)
    levels = 2 ** (bits - 1) - 1 if signed else 2 ** bits - 1
    flat.copy_((torch.round(x / scale * levels) / levels * scale).view(-1)[:n])


def coarse_optimizer_states(bits: int):
    """A model transform: after every optimizer step, Adam's moments of this model's parameters are
    rounded to ``bits``-bit linear codes a block of 256 (far coarser than 8-bit optimizers' block-wise
    dynamic codes, arXiv 2110.02861: a second moment rounded to zero turns its update into m / eps)."""

    def rounded(optimizer, params) -> None:
        for p in params:
            state = optimizer.state.get(p)
            if state and "exp_avg" in state:
                _quantised_(state["exp_avg"], bits, signed=True)
                _quantised_(state["exp_avg_sq"], bits, signed=False)

    def transform(model: nn.Module) -> nn.Module:
        _after_each_step(model, rounded)
        return model

    return transform
