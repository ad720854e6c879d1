"""fp32_layers: which layers it finds, what it does under autocast, and how it is searched."""

from __future__ import annotations

import optuna
import pytest
import torch
from torch import nn

import strategies
from autotune.deploy import runtime
from autotune.space import SearchSpace
from autotune.search.options import SearchConfig
from autotune.search.space import build_space
from autotune.workload.models import WorkloadSpec
from fake_models import tiny_cnn
from strategies.channel_alignment import align_channels
from strategies.fp32_layers import FP32Layers, combinations, keep_fp32, kinds_present, layers_of_kind, parse

optuna.logging.set_verbosity(optuna.logging.WARNING)


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(h.mean(dim=1))


def test_kinds_found_in_models():
    assert kinds_present(tiny_cnn(10)) == ["norm", "head"]
    assert kinds_present(_Attn()) == ["norm", "attention", "head"]
    assert kinds_present(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())) == []
    model = _Attn()
    assert layers_of_kind(model, "head") == [model.head]
    # attention: the outermost module only (its inner Linear layers run inside it)
    assert layers_of_kind(model, "attention") == [model.attn]


def test_combinations_and_parse():
    assert combinations(["head", "norm"]) == ["none", "norm", "head", "norm+head"]
    assert combinations([]) == ["none"]
    assert parse("head+norm") == ("norm", "head")
    assert parse("none") == ()
    with pytest.raises(ValueError, match="unknown kind.*'softmax'.*norm, attention, head"):
        parse("norm+softmax")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chosen_layers_run_in_fp32_under_autocast(dtype):
    torch.manual_seed(0)
    model = _Attn()
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=dtype):
        assert model(x).dtype == dtype
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    keep_fp32(model, ("head",))
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    assert out.dtype == torch.float32
    # the head's float32 result equals FP32 arithmetic on the (low-precision) features it was given
    seen = {}
    model.head.register_forward_hook(lambda m, inp, o: seen.update(inp=inp[0], out=o))
    with torch.autocast("cpu", dtype=dtype):
        model(x)
    expected = nn.functional.linear(seen["inp"].float(), model.head.weight, model.head.bias)
    torch.testing.assert_close(seen["out"], expected)
    # same parameters, same state_dict keys: optimizers and checkpoints are unaffected
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    # without autocast nothing changes
    model_ref = _Attn()
    model_ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), model_ref(x))


def test_norm_layers_output_fp32_and_wrapping_twice_is_harmless():
    model = tiny_cnn(10)
    bn = model[1]
    seen = {}
    bn.register_forward_hook(lambda m, inp, o: seen.update(dtype=o.dtype))
    keep_fp32(model, ("norm",))
    keep_fp32(model, ("norm",))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 3, 8, 8))
    assert seen["dtype"] == torch.float32


def test_composes_with_channel_padding_applied_before():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 30), nn.ReLU(), nn.Linear(30, 5))
    x = torch.randn(3, 12)
    expected = model(x)
    align_channels(model, 8)
    keep_fp32(model, ("head",))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert type(model[3]).__name__ == "AlignedLinear" and out.dtype == torch.float32
    torch.testing.assert_close(model(x), expected)  # padded layers still compute the same function


SPACE = SearchSpace(device="cpu", precisions=["fp32", "bf16"], fp32_layer_sets=["none", "norm", "head", "norm+head"])


def test_strategy_samples_only_under_autocast_and_replays():
    strategy = FP32Layers()
    assert strategy.applies(SPACE)
    assert not strategy.applies(SearchSpace(device="cpu"))  # an old space: only "none", nothing to sample
    seen = set()
    for seed in range(30):
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
        trial = study.ask()
        knobs = strategies.sample(trial, SPACE)
        layers = knobs["fp32_layers"].layers
        if knobs["precision"].mode == "fp32":
            assert layers == "none" and "fp32_layers.layers" not in trial.params
        else:
            assert trial.params["fp32_layers.layers"] == layers
            seen.add(layers)
        replayed = strategies.sample(optuna.trial.FixedTrial(dict(trial.params)), SPACE)
        assert replayed == knobs
        recipe = strategies.build_recipe(knobs, "cpu")
        assert len(recipe.model_transforms) == (0 if layers == "none" else 1)
    assert seen == set(SPACE.fp32_layer_sets)


def test_recipe_transform_keeps_the_head_in_fp32():
    knobs = strategies.sample(optuna.trial.FixedTrial({"precision.mode": "bf16", "fp32_layers.layers": "head",
                                                       "batch_size.batch_size": 32}),
                              SearchSpace(device="cpu", precisions=["fp32", "bf16"],
                                          fp32_layer_sets=["none", "head"]))
    recipe = strategies.build_recipe(knobs, "cpu")
    model = runtime.prepare_model(tiny_cnn(10), recipe, set_flags=False)
    with runtime.autocast(recipe):
        assert model(torch.randn(2, 3, 8, 8)).dtype == torch.float32


def _config(**kwargs):
    return SearchConfig(workload=WorkloadSpec(model="fake_models:tiny_cnn", num_classes=10), device="cpu", **kwargs)


def test_build_space_offers_the_kinds_the_probe_found():
    info = {"precisions": ["fp32"], "input_dim": 4, "fp32_layer_kinds": ["norm", "head"]}
    space = build_space(_config(precisions=["fp32", "bf16"]), "cpu", info)
    assert space.fp32_layer_sets == ["none", "norm", "head", "norm+head"]
    # no autocast mode searched, or no accuracy check to tell whether it is needed: not offered
    assert build_space(_config(precisions=["fp32"]), "cpu", info).fp32_layer_sets == ["none"]
    assert build_space(_config(precisions=["fp32", "bf16"], accuracy_check=False), "cpu",
                       info).fp32_layer_sets == ["none"]
    assert build_space(_config(precisions=["fp32", "bf16"]), "cpu",
                       {**info, "fp32_layer_kinds": []}).fp32_layer_sets == ["none"]


def test_a_space_stored_before_the_knob_existed_still_replays():
    old = SearchSpace(device="cpu", precisions=["fp32", "bf16"]).to_dict()
    del old["fp32_layer_sets"]
    space = SearchSpace.from_dict(old)
    knobs = strategies.sample(optuna.trial.FixedTrial({"precision.mode": "bf16", "batch_size.batch_size": 32}), space)
    assert knobs["fp32_layers"].layers == "none"
