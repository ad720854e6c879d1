"""strategies/depthwise_conv.py: a depthwise convolution's input gradient as a forward convolution of the
output's gradient with the filters turned. On a CPU: the gradients against nn.Conv2d's, which layers
are eligible, what the search offers and proposes, and (slow) the same under torch.compile."""

from __future__ import annotations

import optuna
import pytest
import torch
import torchvision
from torch import nn

import strategies
from autotune.search import queue
from autotune.space import SearchSpace
from autotune.search import neighbours, plain_recipe
from autotune.search.neighbours import Neighbours
from autotune.search.options import SearchConfig
from autotune.workload.models import WorkloadSpec
from conftest import assert_compiles_as_eager, measured
from strategies.depthwise_conv import (DepthwiseConv, FlippedGradConv2d, depthwise_layers, eligible,
                                       flip_input_grad)

IMAGE_SPACE = SearchSpace(device="cuda", precisions=["fp32", "fp16", "bf16"], batch_sizes=[256, 512, 1024],
                          base_batch_size=256, memory_formats=["contiguous", "channels_last"],
                          compile_modes=["off", "default"], optimizer_implementations=["foreach", "fused"],
                          cuda_graphs=[False], stream_counts=[1, 2],
                          choices={"depthwise_conv": ["framework", "flipped"]})


def _info(**extra) -> dict:
    """What the probe finds on a GPU for an image model (tests/test_cuda_graphs.py's)."""
    return {"precisions": ["fp32", "tf32", "fp16", "bf16"], "input_dim": 4, "misaligned": {},
            "compile": {"works": True, "reason": ""}, **extra}


def _pair(channels: int, kernel, padding, bias: bool = True, dtype=torch.float64):
    """The same depthwise convolution twice: the framework's and the flipped one."""
    framework = nn.Conv2d(channels, channels, kernel, padding=padding, groups=channels, bias=bias).to(dtype)
    flipped = nn.Conv2d(channels, channels, kernel, padding=padding, groups=channels, bias=bias).to(dtype)
    flipped.load_state_dict(framework.state_dict())
    flip_input_grad(flipped)
    return framework, flipped


def _grads(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, autocast: bool = False):
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = module(x)
    out.backward(grad.to(out.dtype))
    return out, x.grad, [p.grad for p in module.parameters()]


@pytest.mark.parametrize("kernel,padding,bias", [(7, 3, True), (3, 1, False), (3, 0, True), (3, 2, True),
                                                 (5, "same", True), ((3, 5), (1, 2), True), (3, "valid", False)])
def test_the_gradients_are_the_convolutions_own(kernel, padding, bias) -> None:
    torch.manual_seed(0)
    framework, flipped = _pair(6, kernel, padding, bias)
    assert type(flipped) is FlippedGradConv2d
    x = torch.randn(2, 6, 11, 9, dtype=torch.float64)
    grad = torch.randn_like(framework(x))
    (out_a, gx_a, gp_a), (out_b, gx_b, gp_b) = _grads(framework, x, grad), _grads(flipped, x, grad)
    assert torch.equal(out_a, out_b)
    torch.testing.assert_close(gx_b, gx_a, rtol=0, atol=1e-12)
    for a, b in zip(gp_a, gp_b):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)



@pytest.mark.parametrize("bias,frozen", [(True, ()), (True, ("weight",)), (False, ("weight",)), (True, ("bias",))],
                         ids=["trainable", "frozen-weight", "frozen-weight-no-bias", "frozen-bias"])
def test_an_unbatched_input_gets_the_convolutions_gradients(bias, frozen) -> None:
    """nn.Conv2d takes a (C, H, W) input, with any of its parameters frozen."""
    torch.manual_seed(0)
    framework, flipped = _pair(6, 5, 2, bias)
    for module in (framework, flipped):
        for name in frozen:
            getattr(module, name).requires_grad_(False)
    x = torch.randn(6, 11, 9, dtype=torch.float64)
    grad = torch.randn_like(framework(x))
    (out_a, gx_a, gp_a), (out_b, gx_b, gp_b) = _grads(framework, x, grad), _grads(flipped, x, grad)
    assert out_b.shape == out_a.shape == (6, 11, 9) and torch.equal(out_a, out_b)
    torch.testing.assert_close(gx_b, gx_a, rtol=0, atol=1e-12)
    assert [g is None for g in gp_b] == [g is None for g in gp_a] == [
        name in frozen for name, _ in framework.named_parameters()]
    for a, b in zip(gp_a, gp_b):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=1e-12)

def _functional(module: nn.Module, batched: bool):
    """``module`` as a function of its parameters and one sample (unbatched, or as a batch of one)."""
    def loss(params: dict, x: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(module, params, (x.unsqueeze(0) if batched else x,))
        return (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).cos()).sum()
    return loss


@pytest.mark.parametrize("bias,batched", [(True, True), (False, True), (True, False)])
def test_per_sample_gradients_under_vmap_of_grad_are_the_convolutions(bias, batched) -> None:
    """Opacus's functorch path: ``vmap(grad(loss))`` over a batch, each sample's parameter and input gradients."""
    torch.manual_seed(0)
    framework, flipped = _pair(6, 3, 1, bias)
    params = {k: v.detach() for k, v in framework.named_parameters()}
    x = torch.randn(4, 6, 7, 5, dtype=torch.float64)
    per_sample = [torch.func.vmap(torch.func.grad(_functional(m, batched), argnums=(0, 1)),
                                  in_dims=(None, 0))(params, x) for m in (framework, flipped)]
    (gp_a, gx_a), (gp_b, gx_b) = per_sample
    assert gx_b.shape == x.shape and set(gp_b) == set(params)
    torch.testing.assert_close(gx_b, gx_a, rtol=0, atol=1e-12)
    for name in params:
        assert gp_b[name].shape == (4, *params[name].shape)
        torch.testing.assert_close(gp_b[name], gp_a[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("bias,batched", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("along", ["both", "parameters", "input"])
def test_forward_mode_jvp_is_the_convolutions(bias, batched, along) -> None:
    """``torch.func.jvp`` with tangents on the input, the parameters or both gives nn.Conv2d's output and tangent."""
    torch.manual_seed(0)
    framework, flipped = _pair(6, 7, 3, bias)
    params = {k: v.detach() for k, v in framework.named_parameters()}
    tangents = {k: torch.randn_like(v) for k, v in params.items()}
    x, tx = (torch.randn(6, 9, 8, dtype=torch.float64) for _ in range(2))

    def jvp(module):
        loss = _functional(module, batched)
        if along == "parameters":
            return torch.func.jvp(lambda p: loss(p, x), (params,), (tangents,))
        if along == "input":
            return torch.func.jvp(lambda x: loss(params, x), (x,), (tx,))
        return torch.func.jvp(loss, (params, x), (tangents, tx))

    (out_a, t_a), (out_b, t_b) = jvp(framework), jvp(flipped)
    assert torch.equal(out_b, out_a)
    torch.testing.assert_close(t_b, t_a, rtol=0, atol=1e-12)

def test_under_bf16_autocast_in_channels_last_the_dtypes_and_gradients_are_the_convolutions_own() -> None:
    torch.manual_seed(0)
    framework, flipped = _pair(8, 7, 3, dtype=torch.float32)
    framework, flipped = (m.to(memory_format=torch.channels_last) for m in (framework, flipped))
    x = torch.randn(2, 8, 14, 14).to(memory_format=torch.channels_last)
    grad = torch.randn(2, 8, 14, 14)
    (out_a, gx_a, gp_a), (out_b, gx_b, gp_b) = (_grads(m, x, grad, autocast=True) for m in (framework, flipped))
    assert out_a.dtype == out_b.dtype == torch.bfloat16 and torch.equal(out_a, out_b)
    assert gx_b.dtype == torch.float32 and all(g.dtype == torch.float32 for g in gp_b)  # the master weights' grads
    # the input's gradient against the exact one of the same bf16 operands, not against the framework's CPU
    # bf16 backward-data kernel, whose accumulation (and so its distance from the exact sum) varies by build
    exact = _pair(8, 7, 3)[0]
    exact.load_state_dict({k: v.bfloat16().double() for k, v in framework.state_dict().items()})
    gx_exact = _grads(exact, x.bfloat16().double(), grad.bfloat16().double())[1]
    torch.testing.assert_close(gx_b, gx_exact.float(), rtol=1e-2, atol=1e-2)
    for a, b in zip(gp_a, gp_b):
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)


def test_without_gradients_it_is_the_framework_forward_and_the_state_dict_is_unchanged() -> None:
    framework, flipped = _pair(4, 3, 1)
    assert list(flipped.state_dict()) == list(framework.state_dict())
    x = torch.randn(1, 4, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(flipped(x), framework(x))
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4))
    model.load_state_dict(nn.Sequential(flipped).state_dict())  # checkpoints load either way


def test_only_stride_1_depthwise_convolutions_with_zero_padding_within_the_kernel_are_eligible() -> None:
    assert eligible(nn.Conv2d(8, 8, 7, padding=3, groups=8))
    assert eligible(nn.Conv2d(8, 8, 3, padding="same", groups=8))
    for layer in (nn.Conv2d(8, 8, 3, padding=1),  # dense
                  nn.Conv2d(8, 8, 3, padding=1, groups=4),  # grouped, not depthwise
                  nn.Conv2d(8, 16, 3, padding=1, groups=8),  # a channel multiplier of 2
                  nn.Conv2d(8, 8, 3, padding=1, groups=8, stride=2),
                  nn.Conv2d(8, 8, 3, padding=2, groups=8, dilation=2),
                  nn.Conv2d(8, 8, 3, padding=1, groups=8, padding_mode="reflect"),
                  nn.Conv2d(8, 8, 3, padding=3, groups=8),  # padding past the kernel
                  nn.Conv2d(8, 8, 4, padding="same", groups=8),  # uneven "same"
                  nn.Conv1d(8, 8, 3, padding=1, groups=8),
                  nn.Conv2d(1, 1, 3, padding=1, groups=1)):
        assert not eligible(layer), layer
    # ConvNeXt-T: 18 blocks, each a 7x7 depthwise convolution; MobileNetV2's stride-2 ones are left
    assert depthwise_layers(torchvision.models.convnext_tiny()) == 18
    mobilenet = torchvision.models.mobilenet_v2()
    strided = [m for m in mobilenet.modules() if isinstance(m, nn.Conv2d) and m.groups > 1 and m.stride != (1, 1)]
    assert strided and depthwise_layers(mobilenet) == sum(
        1 for m in mobilenet.modules() if isinstance(m, nn.Conv2d) and m.groups > 1) - len(strided)
    flip_input_grad(mobilenet)
    assert all(type(m) is nn.Conv2d for m in strided)


def test_the_probe_counts_the_models_eligible_depthwise_convolutions() -> None:
    from autotune.trial.work import probe

    for model, count in (("fake_models:tiny_depthwise_cnn", 1), ("fake_models:tiny_cnn", 0)):
        found = probe({"device": "cpu", "workload": WorkloadSpec(model=model, num_classes=10).to_dict()})
        assert found["depthwise_convs"] == count, model


def test_it_is_offered_on_a_gpu_for_a_model_with_depthwise_convolutions_and_the_plain_recipe_keeps_the_framework():
    knob = DepthwiseConv()
    options = SearchConfig(workload=WorkloadSpec(model="convnext_tiny"))
    assert knob.offer(options, "cuda", {"depthwise_convs": 18}, {}) == {"choices": {"depthwise_conv": ["framework", "flipped"]}}
    assert knob.offer(options, "cuda", {"depthwise_convs": 0}, {}) == {}
    assert knob.offer(options, "cpu", {"depthwise_convs": 18}, {}) == {}
    space = strategies.offer(options, "cuda", _info(depthwise_convs=18))
    assert knob.applies(space)
    assert plain_recipe.params(space, 256)["depthwise_conv.input_grad"] == "framework"
    assert strategies.seed_params(space, tuned=False)["depthwise_conv.input_grad"] == "framework"
    knobs = strategies.knobs_of({**plain_recipe.params(space, 256), "depthwise_conv.input_grad": "flipped"}, space)
    assert knobs["depthwise_conv"] == {"input_grad": "flipped"}
    assert "depthwise grad flipped" in strategies.describe(knobs)
    recipe = strategies.build_recipe(strategies.knobs_from_dict(knobs, fill_missing=True), "cuda")
    assert flip_input_grad in recipe.model_transforms
    assert flip_input_grad not in strategies.build_recipe(
        strategies.knobs_from_dict({"depthwise_conv": {"input_grad": "framework"}}, fill_missing=True),
        "cuda").model_transforms
    with pytest.raises(ValueError, match="framework, flipped"):
        knob.apply(knob.Config(input_grad="cudnn"), recipe)
    absent = strategies.offer(options, "cuda", _info())
    assert not knob.applies(absent) and "depthwise_conv.input_grad" not in plain_recipe.params(absent, 256)


def test_an_export_to_a_framework_says_how_to_swap_the_layers_itself() -> None:
    from autotune.deploy.config import TunedConfig

    params = {**plain_recipe.params(IMAGE_SPACE, 256), "depthwise_conv.input_grad": "flipped"}
    cfg = TunedConfig.from_params(params, IMAGE_SPACE)
    _, unsupported = cfg.hf_training_args()
    [entry] = [u for u in unsupported if u["setting"] == "depthwise_conv.input_grad"]
    assert entry["value"] == "flipped" and "flip_input_grad" in entry["why"]
    framework = TunedConfig.from_params(plain_recipe.params(IMAGE_SPACE, 256), IMAGE_SPACE)
    assert not [u for u in framework.hf_training_args()[1] if u["setting"] == "depthwise_conv.input_grad"]


def test_the_measured_plain_recipe_gets_the_flipped_gradient_as_a_one_knob_move() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    bar = measured(study, IMAGE_SPACE, plain_recipe.params(IMAGE_SPACE, 512), 3922.0, role=plain_recipe.ROLE)
    queue.put(study, Neighbours(IMAGE_SPACE, limit_bytes=None)(study, bar))
    changes = [{k: v for k, v in t.system_attrs["fixed_params"].items() if bar.params.get(k) != v}
               for t in queue.queued(study)]
    assert {"depthwise_conv.input_grad": "flipped"} in changes
    assert neighbours.PRIORS[("depthwise_conv.input_grad", "flipped")] == 1.07  # ConvNeXt-T on the H100


@pytest.mark.slow
def test_compiled_it_traces_in_one_graph_and_gives_the_eager_gradients() -> None:
    torch.manual_seed(0)

    def net() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 7, padding=3, groups=8), nn.GELU(),
                             nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False))

    framework, flipped = net(), net()
    flipped.load_state_dict(framework.state_dict())
    flip_input_grad(flipped)
    x = torch.randn(4, 3, 16, 16)

    def loss(model, inputs):
        with torch.autocast("cpu", torch.bfloat16):
            return model(inputs).float().square().mean()

    assert_compiles_as_eager(framework, flipped, x, loss, rtol=1e-2, atol=1e-3)


@pytest.mark.slow
def test_compiled_torch_func_transforms_get_the_convolutions_numbers_and_a_plain_step_keeps_the_flip() -> None:
    """Dynamo traces neither a custom jvp nor a Function under vmap: inside a compiled transform the layer is
    the framework's convolution, in one graph; a compiled step outside one still applies the flipped gradient."""
    torch.manual_seed(0)
    framework, flipped = _pair(6, 3, 1)
    params = {k: v.detach() for k, v in framework.named_parameters()}
    tangents = {k: torch.randn_like(v) for k, v in params.items()}
    x = torch.randn(4, 6, 7, 5, dtype=torch.float64)
    sample, tx = (torch.randn(6, 7, 5, dtype=torch.float64) for _ in range(2))  # x[0], a view, fails nn.Conv2d too
    per_sample = lambda m: torch.func.vmap(torch.func.grad(_functional(m, True)), in_dims=(None, 0))(params, x)
    jvp = lambda m: torch.func.jvp(_functional(m, False), (params, sample), (tangents, tx))
    for transform in (per_sample, jvp):
        torch._dynamo.reset()
        assert torch._dynamo.explain(transform)(flipped).graph_break_count == 0
        torch._dynamo.reset()
        eager, compiled = transform(framework), torch.compile(transform)(flipped)
        torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-12)
    torch._dynamo.reset()
    [graph] = torch._dynamo.explain(lambda x: flipped(x).sum())(x.requires_grad_()).graphs
    assert "autograd_function_apply" in graph.code


@pytest.mark.gpu
def test_on_the_gpu_in_bf16_channels_last_compiled_the_gradients_are_cudnns() -> None:
    """ConvNeXt-T's depthwise shape (96 channels, 7x7, 56x56) through cuDNN both ways, compiled."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    framework, flipped = (m.cuda().to(memory_format=torch.channels_last)
                          for m in _pair(96, 7, 3, dtype=torch.float32))
    x = torch.randn(32, 96, 56, 56, device="cuda").to(memory_format=torch.channels_last)
    grad = torch.randn(32, 96, 56, 56, device="cuda")

    def run(module):
        inputs = x.detach().clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            out = torch.compile(module)(inputs)
        out.backward(grad.to(out.dtype))
        return out, inputs.grad, [p.grad for p in module.parameters()]

    (out_a, gx_a, gp_a), (out_b, gx_b, gp_b) = run(framework), run(flipped)
    assert out_b.dtype == torch.bfloat16 and torch.equal(out_a, out_b)
    torch.testing.assert_close(gx_b, gx_a, rtol=2e-2, atol=2e-2)
    for a, b in zip(gp_a, gp_b):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=5e-1)  # sums over 32 x 56 x 56 terms in bf16
