"""scripts/stem_bench.py's other backwards of a 3x3/2 max pooling (four dense phases, ATen's kernels):
the benchmark's arms compute nn.MaxPool2d's outputs and gradients (ties included). On a CPU; (slow) the
same compiled."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from conftest import ROOT, assert_compiles_as_eager

_spec = importlib.util.spec_from_file_location("stem_bench", ROOT / "scripts" / "stem_bench.py")
stem_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stem_bench)
AtenMaxPool2d, PhaseMaxPool2d, eligible, swap_pools = (stem_bench.AtenMaxPool2d, stem_bench.PhaseMaxPool2d,
                                                       stem_bench.eligible, stem_bench.swap_pools)


def _grads(module: nn.Module, x: torch.Tensor, grad: torch.Tensor | None = None):
    x = x.detach().clone().requires_grad_()
    out = module(x)
    grad = torch.randn_like(out) if grad is None else grad
    out.backward(grad)
    return out, x.grad, grad


@pytest.mark.parametrize("backward", ["phases", "aten"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_output_and_gradient_are_the_frameworks_ties_included(backward, dtype, channels_last) -> None:
    torch.manual_seed(0)
    # rounded ReLU outputs: many windows tie, at zero and above it, as after ResNet's stem
    x = torch.relu(torch.randn(2, 3, 12, 10, dtype=torch.float64)).round().to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    pool = swap_pools(nn.MaxPool2d(3, 2, 1), backward)
    assert type(pool) is {"phases": PhaseMaxPool2d, "aten": AtenMaxPool2d}[backward]
    out_a, gx_a, grad = _grads(nn.MaxPool2d(3, 2, 1), x)
    out_b, gx_b, _ = _grads(pool, x, grad)
    assert torch.equal(out_a, out_b) and torch.equal(gx_a, gx_b)
    assert gx_b.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_nan_propagates_and_its_window_sends_the_gradient_to_it() -> None:
    x = torch.arange(36, dtype=torch.float64).reshape(1, 1, 6, 6)
    x[0, 0, 2, 3] = float("nan")
    out_a, gx_a, grad = _grads(nn.MaxPool2d(3, 2, 1), x)
    out_b, gx_b, _ = _grads(swap_pools(nn.MaxPool2d(3, 2, 1), "phases"), x, grad)
    assert torch.equal(out_a.isnan(), out_b.isnan()) and out_b.isnan().any()
    torch.testing.assert_close(gx_b, gx_a, equal_nan=True)


def test_odd_sizes_and_no_grad_run_the_framework_and_the_state_dict_is_unchanged() -> None:
    pool = swap_pools(nn.MaxPool2d(3, 2, 1), "phases")
    x = torch.randn(1, 2, 7, 9, dtype=torch.float64)
    out_a, gx_a, grad = _grads(nn.MaxPool2d(3, 2, 1), x)
    out_b, gx_b, _ = _grads(pool, x, grad)
    assert torch.equal(out_a, out_b) and torch.equal(gx_a, gx_b)
    with torch.no_grad():
        assert torch.equal(pool(x), F.max_pool2d(x, 3, 2, 1))
    model = torchvision.models.resnet18()
    names = list(model.state_dict())
    swap_pools(model, "phases")
    assert list(model.state_dict()) == names and type(model.maxpool) is PhaseMaxPool2d


def test_only_3x3_stride_2_poolings_padded_by_1_are_eligible() -> None:
    assert eligible(nn.MaxPool2d(3, 2, 1)) and eligible(nn.MaxPool2d((3, 3), (2, 2), (1, 1)))
    for layer in (nn.MaxPool2d(2), nn.MaxPool2d(3, 2), nn.MaxPool2d(3, 1, 1), nn.MaxPool2d(3, 2, 1, ceil_mode=True),
                  nn.MaxPool2d(3, 2, 1, return_indices=True), nn.MaxPool2d(3, 2, 1, dilation=2),
                  nn.AvgPool2d(3, 2, 1), nn.MaxPool1d(3, 2, 1)):
        assert not eligible(layer), layer
    assert sum(eligible(m) for m in torchvision.models.resnet50().modules()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("backward", ["phases", "aten"])
def test_compiled_it_traces_in_one_graph_and_gives_the_eager_gradients(backward) -> None:
    torch.manual_seed(0)

    def net() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Conv2d(8, 4, 1))

    framework, swapped = net(), net()
    swapped.load_state_dict(framework.state_dict())
    swap_pools(swapped, backward)
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)

    def loss(model, inputs):
        return model(inputs).square().mean()

    assert_compiles_as_eager(framework, swapped, x, loss, rtol=1e-5, atol=1e-6)
