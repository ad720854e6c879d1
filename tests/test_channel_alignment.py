"""channel_alignment: padded layers compute the same function and keep the same parameters."""

from __future__ import annotations

import copy
import functools

import optuna
import pytest
import torch
from torch import nn

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.channel_alignment import (
    AlignedConv1d,
    AlignedConv2d,
    AlignedConv3d,
    AlignedLinear,
    ChannelAlignment,
    align_channels,
    misaligned_layers,
)

torchvision = pytest.importorskip("torchvision")


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 13, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(13)
        self.conv2 = nn.Conv2d(13, 30, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(30)
        self.depthwise = nn.Conv2d(30, 30, 3, padding=1, groups=30)
        self.pool = nn.AdaptiveAvgPool2d(3)
        self.fc1 = nn.Linear(30 * 3 * 3, 1001)
        self.fc2 = nn.Linear(1001, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = self.pool(self.depthwise(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


def _pair(model: nn.Module, multiple: int) -> tuple[nn.Module, nn.Module]:
    """(unpadded reference, aligned model) with identical weights."""
    reference = copy.deepcopy(model)
    return reference, align_channels(model, multiple)


def _assert_grads_match(reference: nn.Module, aligned: nn.Module) -> None:
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, param in aligned.named_parameters():
        assert param.grad is not None, name
        assert param.grad.shape == param.shape, name
        torch.testing.assert_close(param.grad, ref_grads[name], msg=name)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("multiple", [8, 16])
@pytest.mark.parametrize("train", [True, False])
def test_small_cnn_forward_and_grads_match(multiple: int, train: bool) -> None:
    reference, model = _pair(SmallCNN().double().train(train), multiple)
    x = torch.randn(4, 3, 12, 12, dtype=torch.float64)

    ref_out, out = reference(x), model(x)
    torch.testing.assert_close(out, ref_out)

    ref_out.square().sum().backward()
    out.square().sum().backward()
    _assert_grads_match(reference, model)


def test_small_cnn_layers_and_report() -> None:
    model = SmallCNN()
    before = misaligned_layers(model, 8)
    assert before == ["conv1", "conv2", "fc1", "fc2"]  # depthwise is never eligible
    align_channels(model, 8)

    assert type(model.conv1) is AlignedConv2d and model.conv1.aligned_to == (8, 16)
    assert type(model.conv2) is AlignedConv2d and model.conv2.aligned_to == (16, 32)
    assert type(model.fc1) is AlignedLinear and model.fc1.aligned_to == (272, 1008)
    assert type(model.fc2) is AlignedLinear and model.fc2.aligned_to == (1008, 16)
    assert type(model.depthwise) is nn.Conv2d
    assert not hasattr(model.depthwise, "aligned_to")
    assert misaligned_layers(model, 8) == []
    # Attributes other than the widths are untouched.
    assert model.conv2.stride == (2, 2) and model.conv2.padding == (1, 1)
    assert model.conv2.bias is None and model.conv2.in_channels == 13
    assert "aligned_to=(16, 32)" in repr(model.conv2)


@pytest.mark.parametrize("multiple", [8, 16])
@pytest.mark.slow
def test_resnet18_matches(multiple: int) -> None:
    net = torchvision.models.resnet18(weights=None, num_classes=10).double()
    reference, model = _pair(net, multiple)
    assert misaligned_layers(model, multiple) == []
    assert model.conv1.aligned_to == (multiple, 64) and model.fc.aligned_to == (512, 16)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)

    ref_out, out = reference(x), model(x)
    torch.testing.assert_close(out, ref_out)
    nn.functional.cross_entropy(ref_out, torch.tensor([1, 7])).backward()
    nn.functional.cross_entropy(out, torch.tensor([1, 7])).backward()
    _assert_grads_match(reference, model)


def test_optimizer_built_before_transform_keeps_working() -> None:
    model = SmallCNN()
    reference = copy.deepcopy(model)
    params_before = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)

    align_channels(model, 16)
    assert all(a is b for a, b in zip(model.parameters(), params_before, strict=True))

    for _ in range(3):
        x, y = torch.randn(8, 3, 12, 12), torch.randint(0, 10, (8,))
        for net, optimizer in ((reference, ref_opt), (model, opt)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=1e-6, msg=name)


def test_state_dict_unchanged_and_loads_both_ways() -> None:
    model = SmallCNN()
    reference = copy.deepcopy(model)
    align_channels(model, 8)
    ref_sd, sd = reference.state_dict(), model.state_dict()
    assert list(sd) == list(ref_sd)
    assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in ref_sd.items()}

    other = SmallCNN()
    model.load_state_dict(other.state_dict())
    SmallCNN().load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 12, 12)
    torch.testing.assert_close(model.eval()(x), other.eval()(x))


def test_idempotent_and_retargets() -> None:
    model = SmallCNN().double()
    reference = copy.deepcopy(model)
    align_channels(model, 8)
    align_channels(model, 8)
    assert type(model.conv1) is AlignedConv2d and model.conv1.aligned_to == (8, 16)
    assert type(model.depthwise) is nn.Conv2d
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    torch.testing.assert_close(model(x), reference(x))

    align_channels(model, 16)
    assert model.conv1.aligned_to == (16, 16)
    assert misaligned_layers(model, 16) == []
    torch.testing.assert_close(model(x), reference(x))


def test_multiple_one_is_noop() -> None:
    model = SmallCNN()
    types = [type(m) for m in model.modules()]
    assert align_channels(model, 1) is model
    assert [type(m) for m in model.modules()] == types
    assert misaligned_layers(model, 1) == []
    with pytest.raises(ValueError):
        align_channels(model, 0)


def test_other_layer_kinds_and_modes() -> None:
    cases = [
        (nn.Conv1d(5, 7, 3, padding=2, dilation=2), torch.randn(2, 5, 9), AlignedConv1d),
        (nn.Conv1d(5, 7, 3), torch.randn(5, 9), AlignedConv1d),  # unbatched
        (nn.Conv2d(3, 5, 3, padding=1, padding_mode="reflect"), torch.randn(2, 3, 6, 6),
         AlignedConv2d),
        (nn.Conv2d(3, 5, 3, padding="same"), torch.randn(3, 6, 6), AlignedConv2d),  # unbatched
        (nn.Conv3d(3, 6, 2, stride=2, padding_mode="circular", padding=1),
         torch.randn(1, 3, 4, 4, 4), AlignedConv3d),
        (nn.Linear(9, 11), torch.randn(2, 4, 9), AlignedLinear),  # extra leading dims
        (nn.Linear(9, 11), torch.randn(9), AlignedLinear),  # unbatched
    ]
    for layer, x, cls in cases:
        layer = layer.double()
        x = x.double()
        reference = copy.deepcopy(layer)
        aligned = align_channels(layer, 8)
        assert type(aligned) is cls and aligned is layer
        torch.testing.assert_close(aligned(x), reference(x), msg=repr(layer))


def test_channels_last_keeps_matching() -> None:
    model = SmallCNN().to(memory_format=torch.channels_last)
    reference, model = _pair(model, 8)
    x = torch.randn(2, 3, 12, 12).to(memory_format=torch.channels_last)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)


def test_mode_and_dtype_preserved() -> None:
    model = SmallCNN().double().eval()
    align_channels(model, 8)
    assert not model.conv1.training and model.conv1.weight.dtype == torch.float64
    model.train()
    assert model.conv1.training


def test_strategy_suggest_and_apply() -> None:
    strategy = ChannelAlignment()
    assert strategy.name == "channel_alignment"
    assert strategy.default() == ChannelAlignment.Config(multiple=1)
    # a single choice is taken without an Optuna parameter
    assert strategy.suggest(optuna.trial.FixedTrial({}), SearchSpace(device="cpu", alignments=[16]), {}) == \
        ChannelAlignment.Config(multiple=16)
    space = SearchSpace(device="cuda", alignments=[1, 8, 16])

    trial = optuna.trial.FixedTrial({"channel_alignment.multiple": 8})
    config = strategy.suggest(trial, space, {})
    assert config == ChannelAlignment.Config(multiple=8)
    assert strategy.from_dict(strategy.to_dict(config)) == config

    recipe = Recipe(device="cpu")
    strategy.apply(config, recipe)
    assert len(recipe.model_transforms) == 1
    transform = recipe.model_transforms[0]
    assert isinstance(transform, functools.partial) and transform.func is align_channels
    assert transform.keywords == {"multiple": 8}
    model = transform(SmallCNN())
    assert misaligned_layers(model, 8) == []

    untouched = Recipe(device="cpu")
    strategy.apply(ChannelAlignment.Config(multiple=1), untouched)
    assert untouched.model_transforms == []
