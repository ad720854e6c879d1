"""What the stem_conv knob, and two other backwards of the max pooling after it, do on a GPU: ResNet-50's
stem (the 7x7/2 convolution on 3 channels and the 3x3/2 max pooling), alone and in torchvision's ResNet-50's compiled plain-recipe
training step (bf16 autocast, TF32, channels_last, cudnn.benchmark, fused SGD with momentum,
torch.compile), the arms alternating so that clocks and heat treat them alike.

    python3 scripts/stem_bench.py --batch 1024 --rounds 3

Parts, each printing one JSON line per round and arm (median milliseconds by CUDA events) and one
summary line (each arm's median, and its speed over the first arm):

* ``stem``: the stem convolution's forward and weight gradient, compiled, its input in bf16
  channels_last: ``pad8`` (the input padded to 8 channels, channel_alignment's ``pad x8``),
  ``pad4``, ``none`` (3 channels), ``s2d`` (strategies.stem_conv, 12 channels padded to 16) and
  ``s2d12`` (12, unpadded);
* ``pool``: a ReLU then the max pooling, forward and backward, compiled: ``framework`` (Inductor's
  lowering), ``phases`` (:class:`PhaseMaxPool2d`: which of the nine window positions won, kept as an
  int8, and the input's gradient as four dense phases of shifted, masked output gradients, interleaved)
  and ``aten`` (ATen's own kernels as an opaque operator the compiler does not lower);
* ``model``: the whole training step with the stem padded to 8 (the H100 search's best), then with
  the fastest pooling of the ``pool`` part, then with the fastest stem of the ``stem`` part as well
  (the knobs' own model transforms), and a profile of each arm's step: the kernels over 1 ms.

GPU only. On the H100 (torch 2.11.0+cu130, batch 1,024): the stem 2.11x faster as space-to-depth
(5.30 against 11.20 ms), the pooling 1.52x with phases and 0.60x with ATen's kernels, and the whole step
0.996x with phases and 1.033x with phases and space-to-depth (162.09 against 167.36 ms): reports/stem-h100.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import strategies.stem_conv as stem_conv  # noqa: E402
from memory_parts_bench import alternate, image_step  # noqa: E402  (this script's folder is on sys.path)
from strategies.channel_alignment import align_channels  # noqa: E402


# The pooling alternatives. Not a knob: in the whole compiled step the phases' backward (3.8 ms against
# Inductor's 5.9) came with a forward that materialises the padded activation, and the step ran 0.4%
# slower (reports/stem-h100); ATen's kernels ran 0.60x Inductor's alone.


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


def eligible(layer: nn.Module) -> bool:
    """Whether ``layer`` is a 3x3/2 max pooling padded by 1 (ResNet's)."""
    return (type(layer) is nn.MaxPool2d and _pair(layer.kernel_size) == (3, 3) and _pair(layer.stride) == (2, 2)
            and _pair(layer.padding) == (1, 1) and _pair(layer.dilation) == (1, 1) and not layer.ceil_mode
            and not layer.return_indices)


def _windows(x: torch.Tensor) -> list[torch.Tensor]:
    """The nine 3x3/2 window positions' values of ``x`` (even H, W; padded by 1 with -inf), row-major."""
    h, w = x.shape[-2:]
    xp = F.pad(x, (1, 1, 1, 1), value=float("-inf"))
    return [xp[..., kh:kh + h:2, kw:kw + w:2] for kh in range(3) for kw in range(3)]


def _shift(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` moved one place towards the start along ``dim`` (-1 or -2), a zero entering at the end."""
    t = t.narrow(dim, 1, t.shape[dim] - 1)
    return F.pad(t, (0, 1) if dim == -1 else (0, 0, 0, 1))


class _PhaseMaxPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        windows = _windows(x)
        best, won = windows[0], torch.zeros_like(windows[0], dtype=torch.int8)
        for k, value in enumerate(windows[1:], 1):
            take = (value > best) | value.isnan()  # the first maximum wins, NaN propagates: PyTorch's rule
            best = torch.where(take, value, best)
            won = torch.where(take, k, won)
        ctx.save_for_backward(won)
        ctx.input_shape = x.shape
        return best

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (won,) = ctx.saved_tensors
        zero = grad.new_zeros(())

        def part(kh: int, kw: int) -> torch.Tensor:
            """The output gradient of the windows whose (kh, kw) position won, placed on that position's
            input pixels: row 2*oh - 1 + kh, column 2*ow - 1 + kw."""
            t = torch.where(won == kh * 3 + kw, grad, zero)
            if kh == 0:
                t = _shift(t, -2)
            if kw == 0:
                t = _shift(t, -1)
            return t

        # input row 2i: centre row (kh 1) of window i; row 2i+1: last row (kh 2) of window i, first (kh 0) of i+1
        rows = ((1,), (2, 0))
        phases = [sum(part(kh, kw) for kh in rows[ph] for kw in rows[pw]) for ph in (0, 1) for pw in (0, 1)]
        n, c, h, w = ctx.input_shape
        out = torch.stack(phases, dim=-1).reshape(n, c, h // 2, w // 2, 2, 2)
        out = out.permute(0, 1, 2, 4, 3, 5).reshape(n, c, h, w)
        return out.contiguous(memory_format=torch.channels_last) if grad.is_contiguous(
            memory_format=torch.channels_last) else out.contiguous()


@torch.library.custom_op("stem_bench::max_pool2d_3x3s2", mutates_args=())
def _aten_pool(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, indices = torch.ops.aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1])
    return out, indices


@_aten_pool.register_fake
def _(x):
    return torch.ops.aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1])


@torch.library.custom_op("stem_bench::max_pool2d_3x3s2_backward", mutates_args=())
def _aten_pool_backward(grad: torch.Tensor, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.max_pool2d_with_indices_backward(grad, x, [3, 3], [2, 2], [1, 1], [1, 1], False, indices)


@_aten_pool_backward.register_fake
def _(grad, x, indices):
    return torch.empty_like(x)


def _aten_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])


def _aten_backward(ctx, grad, _grad_indices):
    x, indices = ctx.saved_tensors
    return _aten_pool_backward(grad.contiguous(memory_format=torch.channels_last)
                               if x.is_contiguous(memory_format=torch.channels_last) else grad.contiguous(), x, indices)


_aten_pool.register_autograd(_aten_backward, setup_context=_aten_setup)


class PhaseMaxPool2d(nn.MaxPool2d):
    """:class:`torch.nn.MaxPool2d` (an eligible one) whose backward is :class:`_PhaseMaxPool`'s."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or input.dim() != 4 or input.shape[-1] % 2 or input.shape[-2] % 2:
            return super().forward(input)
        return _PhaseMaxPool.apply(input)


class AtenMaxPool2d(nn.MaxPool2d):
    """:class:`torch.nn.MaxPool2d` (an eligible one) run by ATen's kernels as an opaque operator."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or input.dim() != 4:
            return super().forward(input)
        return _aten_pool(input)[0]


_CLASSES = {"phases": PhaseMaxPool2d, "aten": AtenMaxPool2d}


def swap_pools(model: nn.Module, backward: str) -> nn.Module:
    """Swap every eligible max pooling of ``model`` to ``backward``'s class (phases or aten), in place."""
    for module in model.modules():
        if eligible(module):
            module.__class__ = _CLASSES[backward]
    return model


def summary(part: str, medians: dict[str, float], **extra) -> dict:
    first = next(iter(medians.values()))
    line = {"part": part, "median_ms": medians, "speed_over_first": {k: round(first / v, 4) for k, v in medians.items()},
            **extra}
    print(json.dumps(line), flush=True)
    return line


def stem_arm(name: str, batch: int) -> Callable[[], None]:
    torch.manual_seed(0)
    weight = torch.randn(64, 3, 7, 7, device="cuda", requires_grad=True)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)

    def conv(x, w):
        with torch.autocast("cuda", torch.bfloat16):
            if name.startswith("s2d"):
                return stem_conv.space_to_depth_conv(x, w, None, 2, (3, 3), 8 if name == "s2d" else 1)
            extra = {"pad8": 5, "pad4": 1, "none": 0}[name]
            return F.conv2d(F.pad(x, (0, 0, 0, 0, 0, extra)), F.pad(w, (0, 0, 0, 0, 0, extra)), None, 2, 3)

    compiled = torch.compile(conv)
    out = compiled(x, weight)
    grad = torch.randn_like(out)

    def step():
        weight.grad = None
        compiled(x, weight).backward(grad)

    for _ in range(3):
        step()
    return step


def pool_arm(name: str, batch: int) -> Callable[[], None]:
    torch.manual_seed(0)
    pool = torch.nn.MaxPool2d(3, 2, 1)
    if name != "framework":
        swap_pools(pool, name)
    x = torch.randn(batch, 64, 112, 112, device="cuda", dtype=torch.bfloat16).to(
        memory_format=torch.channels_last).requires_grad_()
    compiled = torch.compile(lambda t: pool(torch.relu(t)))
    grad = torch.randn_like(compiled(x))

    def step():
        x.grad = None
        compiled(x).backward(grad)

    for _ in range(3):
        step()
    return step


def model_arm(pool: str, stem: str, batch: int) -> tuple[Callable[[], None], float]:
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    if stem == "s2d":
        stem_conv.space_to_depth(model)
    if pool != "framework":
        swap_pools(model, pool)
    align_channels(model, 8)  # the search's best pads the stem's input to 8: a no-op on a swapped stem
    model = model.cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4, fused=True)
    step = image_step(model, optimizer, batch)
    began = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    return step, time.perf_counter() - began


def kernels(step: Callable[[], None], steps: int = 3, over_ms: float = 1.0) -> list:
    """The kernels of ``steps`` profiled steps taking over ``over_ms`` a step: [ms a step, calls a step, name]."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total, calls = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time
            calls[event.name] += 1
    return [[round(us / steps / 1e3, 2), calls[name] // steps, name[:110]]
            for name, us in total.most_common() if us / steps / 1e3 > over_ms]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--parts", default="stem,pool,model")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    parts = args.parts.split(",")
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "cudnn": torch.backends.cudnn.version(), "batch": args.batch}), flush=True)
    best_stem, best_pool = "pad8", "framework"
    if "stem" in parts:
        arms = {name: stem_arm(name, args.batch) for name in ("pad8", "pad4", "none", "s2d", "s2d12")}
        medians = alternate(arms, args.rounds, args.steps, args.batch)
        summary("stem", medians)
        best_stem = "s2d" if medians["s2d"] < medians["pad8"] else "pad8"
        del arms
    if "pool" in parts:
        arms = {name: pool_arm(name, args.batch) for name in ("framework", *_CLASSES)}
        medians = alternate(arms, args.rounds, args.steps, args.batch)
        summary("pool", medians)
        best_pool = min(medians, key=medians.get)
        del arms
    if "model" in parts:
        torch.compiler.reset()
        wanted = {"pad8": ("framework", "pad8")}
        if best_pool != "framework":
            wanted[f"pool={best_pool}"] = (best_pool, "pad8")
        if best_stem == "s2d":
            wanted[f"pool={best_pool},stem=s2d"] = (best_pool, "s2d")
        arms = {}
        for name, (pool, stem) in wanted.items():
            arms[name], compile_s = model_arm(pool, stem, args.batch)
            print(json.dumps({"arm": name, "compile_and_5_steps_s": round(compile_s, 1),
                              "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)
        medians = alternate(arms, args.rounds, args.steps, args.batch)
        summary("model", medians, images_per_s={k: round(args.batch * 1e3 / v, 1) for k, v in medians.items()})
        for name, step in arms.items():
            print(json.dumps({"profile": name, "kernels_over_1ms": kernels(step)}), flush=True)


if __name__ == "__main__":
    main()
