"""strategies/stem_conv.py: a strided stem convolution computed as space-to-depth. On a CPU: the
outputs and gradients against nn.Conv2d's, which layers are eligible, what the search offers and
proposes, and (slow) the same compiled."""

from __future__ import annotations

import optuna
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import strategies
from autotune.search import queue
from autotune.space import SearchSpace
from autotune.search import neighbours, plain_recipe
from autotune.search.neighbours import Neighbours
from autotune.search.options import SearchConfig
from autotune.priors import prior
from autotune.workload.models import WorkloadSpec
from conftest import assert_compiles_as_eager, measured
from strategies.channel_alignment import align_channels
from strategies.stem_conv import (SpaceToDepthConv2d, StemConv, eligible, space_to_depth, space_to_depth_conv,
                                  stem_layers, stem_share)

IMAGE_SPACE = SearchSpace(device="cuda", precisions=["fp32", "fp16", "bf16"], batch_sizes=[256, 512, 1024],
                          base_batch_size=256, memory_formats=["contiguous", "channels_last"],
                          compile_modes=["off", "default"], optimizer_implementations=["foreach", "fused"],
                          cuda_graphs=[False], stream_counts=[1, 2], alignments=[1, 8],
                          choices={"stem_conv": ["framework", "space_to_depth"]})


def _info(**extra) -> dict:
    """What the probe finds on a GPU for an image model (tests/test_depthwise_conv.py's)."""
    return {"precisions": ["fp32", "tf32", "fp16", "bf16"], "input_dim": 4, "misaligned": {},
            "compile": {"works": True, "reason": ""}, **extra}


@pytest.mark.parametrize("size,kernel,stride,padding,channels", [
    ((224, 224), 7, 2, 3, 3),  # ResNet's stem
    ((32, 30), 7, 2, 3, 3),
    ((33, 31), 3, 2, 1, 3),  # odd sizes: the last block is cropped or padded
    ((20, 20), 4, 4, 0, 3),  # a ViT-like patchify at stride 4
    ((17, 19), 5, 3, 2, 1),
    ((16, 16), (3, 5), 2, (1, 2), 4),
])
@pytest.mark.parametrize("multiple", [1, 8])
def test_it_computes_the_convolution_and_its_gradients(size, kernel, stride, padding, channels, multiple) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, channels, *size, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, channels, *((kernel,) * 2 if isinstance(kernel, int) else kernel),
                         dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    pad = (padding,) * 2 if isinstance(padding, int) else padding
    ref = F.conv2d(x, weight, bias, stride, pad)
    out = space_to_depth_conv(x, weight, bias, stride, pad, multiple)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-11)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(ref, (x, weight, bias), grad), torch.autograd.grad(out, (x, weight, bias), grad)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def test_a_swapped_resnet_stem_keeps_its_parameters_state_dict_and_outputs() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18().double().eval()
    reference = torchvision.models.resnet18().double().eval()
    reference.load_state_dict(model.state_dict())
    assert stem_layers(model) == 1
    weight = model.conv1.weight
    space_to_depth(model)
    assert type(model.conv1) is SpaceToDepthConv2d and model.conv1.weight is weight
    assert list(model.state_dict()) == list(reference.state_dict())
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=1e-9)
    assert all(type(m) is nn.Conv2d for name, m in model.named_modules() if name != "conv1" and isinstance(m, nn.Conv2d))


def test_under_bf16_autocast_in_channels_last_it_matches_the_framework_to_rounding() -> None:
    torch.manual_seed(0)
    framework = nn.Conv2d(3, 16, 7, 2, 3, bias=False)
    swapped = nn.Conv2d(3, 16, 7, 2, 3, bias=False)
    swapped.load_state_dict(framework.state_dict())
    space_to_depth(swapped)
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    outs = []
    for model in (framework, swapped):
        with torch.autocast("cpu", torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()
        outs.append(out)
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16 and swapped.weight.grad.dtype == torch.float32
    assert outs[1].is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():  # a contiguous model's stays contiguous
        assert swapped(torch.randn(2, 3, 32, 32)).is_contiguous()
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(swapped.weight.grad, framework.weight.grad, rtol=2e-2, atol=2e-3)


def test_only_strided_stems_on_few_channels_are_eligible() -> None:
    assert eligible(nn.Conv2d(3, 64, 7, 2, 3, bias=False))
    assert eligible(nn.Conv2d(4, 32, 3, 2, 1))
    assert eligible(nn.Conv2d(3, 768, 16, 16))  # ViT's patchify
    for layer in (nn.Conv2d(3, 64, 7, 1, 3),  # stride 1: nothing to rearrange
                  nn.Conv2d(8, 64, 7, 2, 3),  # wide enough for cuDNN's kernels
                  nn.Conv2d(3, 64, 1, 2),  # a kernel smaller than the stride
                  nn.Conv2d(3, 64, 3, (2, 1), 1),
                  nn.Conv2d(3, 64, 3, 2, 2, dilation=2),
                  nn.Conv2d(3, 64, 3, 2, 1, padding_mode="reflect"),
                  nn.Conv2d(4, 4, 3, 2, 1, groups=2),
                  nn.Conv1d(3, 64, 7, 2, 3)):
        assert not eligible(layer), layer
    assert stem_layers(torchvision.models.resnet50()) == 1
    assert stem_layers(torchvision.models.convnext_tiny()) == 1  # the 4x4/4 patchify stem
    assert stem_layers(torchvision.models.mobilenet_v2()) == 1


def test_the_stems_share_of_the_work_is_counted_from_one_forward() -> None:
    x = torch.randn(1, 3, 224, 224)
    resnet = stem_share(torchvision.models.resnet50().eval(), x)
    assert resnet == pytest.approx(prior("stem_conv.stem", "space_to_depth", "measured stem share"), abs=5e-5)
    # by hand: 112 x 112 x 64 outputs of 3 x 7 x 7 multiply-adds each; the rest are larger
    assert resnet == pytest.approx(112 * 112 * 64 * 147 / 4.09e9, rel=0.02)
    assert 0.009 < stem_share(torchvision.models.vit_b_16().eval(), x) < 0.011  # attention's matmuls not counted
    assert stem_share(nn.Sequential(nn.Linear(4, 4)), torch.randn(1, 4)) == 0.0  # no stem, no forward

    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 7, 2, 3)

        def forward(self, x):
            raise RuntimeError("only on its GPU")

    assert stem_share(Fails(), x) is None


def test_the_moves_prior_follows_the_stems_share_and_never_passes_resnet50s() -> None:
    from autotune.search.planner import Planner

    assert neighbours.stem_speed({}) is None
    measured = prior("stem_conv.stem", "space_to_depth", "measured stem share")  # ResNet-50's
    assert neighbours.stem_speed({"stem_share": measured}) == pytest.approx(1.037)
    assert neighbours.stem_speed({"stem_share": 0.065}) == pytest.approx(1.037)  # ResNet-18's: not measured
    assert neighbours.stem_speed({"stem_share": 0.0103}) == pytest.approx(1.0132, abs=1e-3)  # ViT-B/16's
    assert neighbours.stem_speed({"stem_share": 0.0}) == 1.0
    gains = {"stem speed": 1.013}
    framework, moved = {"stem_conv.stem": "framework"}, {"stem_conv.stem": "space_to_depth"}
    assert Planner._factor("stem_conv.stem", framework, moved, gains) == 1.013
    assert Planner._factor("stem_conv.stem", moved, {}, gains) == pytest.approx(1 / 1.013)  # absent: the framework's
    assert Planner._factor("stem_conv.stem", framework, moved, {}) == 1.037  # no share measured: the prior


def test_the_probe_counts_the_models_stems() -> None:
    from autotune.trial.work import probe

    found = probe({"device": "cpu", "workload": WorkloadSpec(model="resnet18", num_classes=10,
                                                             input_shape=(3, 32, 32)).to_dict()})
    assert found["stem_convs"] == 1 and 0.05 < found["stem_share"] < 0.2
    found = probe({"device": "cpu", "workload": WorkloadSpec(model="fake_models:tiny_cnn", num_classes=10).to_dict()})
    assert found["stem_convs"] == sum(eligible(m) for m in __import__("fake_models").tiny_cnn().modules())


def test_it_is_offered_on_a_gpu_for_a_model_with_a_stem_and_the_plain_recipe_keeps_the_framework() -> None:
    knob = StemConv()
    options = SearchConfig(workload=WorkloadSpec(model="resnet50"))
    assert knob.offer(options, "cuda", {"stem_convs": 1}, {}) == {"choices": {"stem_conv": ["framework", "space_to_depth"]}}
    assert knob.offer(options, "cuda", {"stem_convs": 0}, {}) == {}
    assert knob.offer(options, "cpu", {"stem_convs": 1}, {}) == {}
    space = strategies.offer(options, "cuda", _info(stem_convs=1))
    assert knob.applies(space)
    assert plain_recipe.params(space, 256)["stem_conv.stem"] == "framework"
    assert strategies.seed_params(space, tuned=False)["stem_conv.stem"] == "framework"
    knobs = strategies.knobs_of({**plain_recipe.params(space, 256), "stem_conv.stem": "space_to_depth"}, space)
    assert knobs["stem_conv"] == {"stem": "space_to_depth"}
    assert "stem space-to-depth" in strategies.describe(knobs)
    recipe = strategies.build_recipe(strategies.knobs_from_dict(knobs, fill_missing=True), "cuda")
    assert space_to_depth in recipe.model_transforms
    assert space_to_depth not in strategies.build_recipe(
        strategies.knobs_from_dict({"stem_conv": {"stem": "framework"}}, fill_missing=True), "cuda").model_transforms
    with pytest.raises(ValueError, match="framework, space_to_depth"):
        knob.apply(knob.Config(stem="s2d"), recipe)
    absent = strategies.offer(options, "cuda", _info())
    assert not knob.applies(absent) and "stem_conv.stem" not in plain_recipe.params(absent, 256)


def test_the_stem_is_swapped_before_channel_padding_which_then_leaves_it() -> None:
    """The registry applies stem_conv's transform before channel_alignment's: a stem padded to 8 is no
    plain nn.Conv2d any more, and space-to-depth pads its own channels."""
    names = [s.name for s in strategies.REGISTRY]
    assert names.index("stem_conv") < names.index("channel_alignment")
    knobs = strategies.knobs_from_dict({"stem_conv": {"stem": "space_to_depth"}, "channel_alignment": {"multiple": 8}},
                                       fill_missing=True)
    model = torchvision.models.resnet18()
    for transform in strategies.build_recipe(knobs, "cuda").model_transforms:
        model = transform(model)
    assert type(model.conv1) is SpaceToDepthConv2d
    assert type(align_channels(torchvision.models.resnet18(), 8).conv1) is not nn.Conv2d  # why the order matters


def test_an_export_to_a_framework_says_how_to_swap_the_stem_itself() -> None:
    from autotune.deploy.config import TunedConfig

    params = {**plain_recipe.params(IMAGE_SPACE, 256), "stem_conv.stem": "space_to_depth"}
    _, unsupported = TunedConfig.from_params(params, IMAGE_SPACE).hf_training_args()
    [entry] = [u for u in unsupported if u["setting"] == "stem_conv.stem"]
    assert entry["value"] == "space_to_depth" and "space_to_depth" in entry["why"]
    framework = TunedConfig.from_params(plain_recipe.params(IMAGE_SPACE, 256), IMAGE_SPACE)
    assert not [u for u in framework.hf_training_args()[1] if u["setting"] == "stem_conv.stem"]


def test_the_measured_plain_recipe_gets_space_to_depth_as_a_one_knob_move() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    bar = measured(study, IMAGE_SPACE, plain_recipe.params(IMAGE_SPACE, 1024), 5774.0, role=plain_recipe.ROLE)
    queue.put(study, Neighbours(IMAGE_SPACE, limit_bytes=None)(study, bar))
    changes = [{k: v for k, v in t.system_attrs["fixed_params"].items() if bar.params.get(k) != v}
               for t in queue.queued(study)]
    assert {"stem_conv.stem": "space_to_depth"} in changes
    assert neighbours.PRIORS[("stem_conv.stem", "space_to_depth")] == 1.037  # ResNet-50 on the H100


@pytest.mark.slow
def test_compiled_it_traces_in_one_graph_and_gives_the_eager_gradients() -> None:
    torch.manual_seed(0)
    framework = nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    swapped = nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    swapped.load_state_dict(framework.state_dict())
    space_to_depth(swapped)
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)

    def loss(model, inputs):
        return model(inputs).square().mean()

    assert_compiles_as_eager(framework, swapped, x, loss, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_on_the_gpu_in_bf16_channels_last_compiled_it_matches_cudnns_stem() -> None:
    """ResNet's stem shape (3 to 64 channels, 7x7/2, 224x224) through cuDNN both ways, compiled."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    framework = nn.Conv2d(3, 64, 7, 2, 3, bias=False).cuda().to(memory_format=torch.channels_last)
    swapped = nn.Conv2d(3, 64, 7, 2, 3, bias=False).cuda().to(memory_format=torch.channels_last)
    swapped.load_state_dict(framework.state_dict())
    space_to_depth(swapped)
    x = torch.randn(32, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    grad = torch.randn(32, 64, 112, 112, device="cuda")

    def run(module):
        with torch.autocast("cuda", torch.bfloat16):
            out = torch.compile(module)(x)
        out.backward(grad.to(out.dtype))
        return out, module.weight.grad

    (out_a, gw_a), (out_b, gw_b) = run(framework), run(swapped)
    assert out_b.dtype == torch.bfloat16 and out_b.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out_b.float(), out_a.float(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(gw_b, gw_a, rtol=2e-2, atol=2.0)  # sums over 32 x 112 x 112 terms in bf16
    assert (gw_b - gw_a).norm() / gw_a.norm() < 5e-3


def test_the_accuracy_check_judges_a_swapped_stem_or_depthwise_gradient_on_its_own() -> None:
    """Both compute the same sums in another order: a configuration with one is checked against FP32 apart
    from the same precision without it, and the check's recipe swaps the layers as the trial did."""
    from autotune.accuracy.settings import describe_numerics, numerics_key
    from autotune.accuracy.worker.parity import parity_recipe

    bf16 = {"precision": {"mode": "bf16"}}
    stem = {**bf16, "stem_conv": {"stem": "space_to_depth"}}
    flipped = {**bf16, "depthwise_conv": {"input_grad": "flipped"}}
    assert len({numerics_key(bf16), numerics_key(stem), numerics_key(flipped)}) == 3
    assert numerics_key({**bf16, "stem_conv": {"stem": "framework"}}) == numerics_key(bf16)  # studies from before
    assert describe_numerics(stem) == "bf16, stem space-to-depth"
    assert describe_numerics(flipped) == "bf16, depthwise grad flipped"
    assert space_to_depth in parity_recipe(stem, "cpu").model_transforms
