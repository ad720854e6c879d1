"""The Strategy contract, checked for every knob in ``strategies.REGISTRY``.

A strategy added to the registry is covered here without new test code: its parameters carry
its prefix, it samples nothing where it does not apply, replaying a trial's parameters with
``FixedTrial`` rebuilds the same configs and recipe, its config survives JSON, and the global
switches it sets are restored when the scope ends.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from typing import Any

import optuna
import pytest
import torch

import strategies
from autotune.recipe import BACKEND_FLAGS, Recipe, backend_flags
from autotune.space import SearchSpace
from strategies import batch_size as batch_size_strategy
from strategies import precision as precision_module
from strategies import threads as threads_strategy
from strategies.batch_size import BatchSize
from strategies.precision import Precision

optuna.logging.set_verbosity(optuna.logging.WARNING)

NUM_SEEDS = 40

SPACES = {
    "cuda": SearchSpace(
        device="cuda",
        precisions=["fp32", "tf32", "fp16", "bf16"],
        batch_sizes=[16, 32, 64, 128],
        base_batch_size=32,
        alignments=[1, 8, 16],
        memory_formats=["contiguous", "channels_last"],
        stream_counts=[1, 2],
        cudnn_benchmark=[False, True],
        thread_counts=[],
    ),
    "cpu": SearchSpace(
        device="cpu",
        precisions=["fp32", "bf16"],
        batch_sizes=[8, 16],
        base_batch_size=8,
        thread_counts=[1, 2],
    ),
    # nothing to choose but the (single) batch size: most knobs do not apply
    "pinned": SearchSpace(device="cpu", batch_sizes=[32], base_batch_size=32),
    # a search with --data: the DataLoader's settings are searched too
    "data": SearchSpace(
        device="cuda",
        precisions=["fp32", "bf16"],
        batch_sizes=[16, 32],
        base_batch_size=16,
        stream_counts=[1, 2],
        cudnn_benchmark=[False, True],
        dataloader_workers=[0, 1, 2, 4],
        dataloader_pin_memory=[False, True],
        dataloader_prefetch_factors=[2, 4],
    ),
}

# which SearchSpace list each space-driven parameter must take its values from
SPACE_FIELD = {
    "precision.mode": "precisions",
    "batch_size.batch_size": "batch_sizes",
    "channel_alignment.multiple": "alignments",
    "memory_format.format": "memory_formats",
    "cudnn.benchmark": "cudnn_benchmark",
    "streams.num_streams": "stream_counts",
    "threads.num_threads": "thread_counts",
    "dataloader.num_workers": "dataloader_workers",
    "dataloader.pin_memory": "dataloader_pin_memory",
}

STRATEGY_IDS = [s.name for s in strategies.REGISTRY]
SPACE_IDS = list(SPACES)


def _sampled(space: SearchSpace) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(params, distributions, knobs) of trials sampled with many different seeds."""
    out = []
    for seed in range(NUM_SEEDS):
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
        for _ in range(2):
            trial = study.ask()
            knobs = strategies.sample(trial, space)
            out.append((dict(trial.params), dict(trial.distributions), knobs))
    return out


_CACHE: dict[str, list] = {}


def sampled(space_id: str) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    if space_id not in _CACHE:
        _CACHE[space_id] = _sampled(SPACES[space_id])
    return _CACHE[space_id]


def own_params(strategy: strategies.Strategy, params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k.startswith(strategy.name + ".")}


def before(strategy: strategies.Strategy, knobs: dict[str, Any]) -> dict[str, Any]:
    """The configs a strategy's suggest may see: those of the strategies before it."""
    names = [s.name for s in strategies.REGISTRY]
    return {n: knobs[n] for n in names[: names.index(strategy.name)]}


def transform_key(transform: Any) -> Any:
    if isinstance(transform, functools.partial):
        return (transform.func, transform.args, tuple(sorted(transform.keywords.items())))
    return transform


def recipe_fields(recipe: Recipe) -> dict[str, Any]:
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}
    fields["model_transforms"] = [transform_key(t) for t in recipe.model_transforms]
    return fields


def global_flags() -> dict[str, Any]:
    """Every process-global switch a recipe may touch, read the way torch exposes it."""
    values = {name: getter() for name, (getter, _) in BACKEND_FLAGS.items()}
    values["torch.backends.cudnn.benchmark"] = torch.backends.cudnn.benchmark
    values["torch.get_num_threads"] = torch.get_num_threads()
    return values


pytestmark = pytest.mark.usefixtures("restore_backend_flags")


# the contract, for every strategy and space ------------------------------------------------------


@pytest.mark.parametrize("space_id", SPACE_IDS)
@pytest.mark.parametrize("strategy", strategies.REGISTRY, ids=STRATEGY_IDS)
def test_parameters_are_prefixed_fields(strategy: strategies.Strategy, space_id: str) -> None:
    space = SPACES[space_id]
    field_names = {f.name for f in dataclasses.fields(strategy.Config)}
    for params, _, knobs in sampled(space_id):
        # on a fresh trial, the strategy alone: every parameter it asks for is "<name>.<field>"
        trial = optuna.create_study().ask()
        if strategy.applies(space):
            strategy.suggest(trial, space, before(strategy, knobs))
        for name in trial.params:
            prefix, _, field = name.partition(".")
            assert prefix == strategy.name, f"{strategy.name} sampled {name!r}"
            assert field in field_names, f"{name!r} is not a field of {strategy.name}.Config"
        # and in a full sample, every parameter belongs to a registered strategy
        for name in params:
            assert name.split(".", 1)[0] in strategies.BY_NAME, name


@pytest.mark.parametrize("strategy", strategies.REGISTRY, ids=STRATEGY_IDS)
def test_its_module_names_each_parameter_once(strategy: strategies.Strategy) -> None:
    """Each knob's module defines the names of the parameters it samples (``<FIELD>_PARAM``, what the
    engine refers to them by), and each is ``Strategy.param`` of a field of its Config (issue 57)."""
    module = sys.modules[type(strategy).__module__]
    named = {value: attr for attr, value in vars(module).items()  # its own: not another knob's, imported
             if attr.endswith("_PARAM") and isinstance(value, str) and value.startswith(strategy.name + ".")}
    field_names = {f.name for f in dataclasses.fields(strategy.Config)}
    for value, attr in named.items():
        field = attr.removesuffix("_PARAM").lower()
        assert field in field_names and value == strategy.param(field), f"{module.__name__}.{attr} = {value!r}"
    for space_id in SPACE_IDS:
        for params, _, _ in sampled(space_id):
            own = {name for name in params if name.split(".", 1)[0] == strategy.name}
            assert own <= set(named), f"{module.__name__} does not name {sorted(own - set(named))}"


@pytest.mark.parametrize("space_id", SPACE_IDS)
@pytest.mark.parametrize("strategy", strategies.REGISTRY, ids=STRATEGY_IDS)
def test_values_come_from_the_space(strategy: strategies.Strategy, space_id: str) -> None:
    space = SPACES[space_id]
    seen: dict[str, set] = {}
    for params, distributions, knobs in sampled(space_id):
        config = knobs[strategy.name]
        for name, value in own_params(strategy, params).items():
            dist = distributions[name]
            assert isinstance(dist, optuna.distributions.CategoricalDistribution), name
            assert value in dist.choices, name
            if name in SPACE_FIELD:
                assert value in getattr(space, SPACE_FIELD[name]), f"{name}={value!r} not in the space"
                # the space's list is what the strategy offers, no more, no less
                assert list(dist.choices) == list(getattr(space, SPACE_FIELD[name])), name
            # the sampled value is what ends up in the config
            assert getattr(config, name.split(".", 1)[1]) == value, name
            seen.setdefault(name, set()).add(value)
    # with this many seeds, every choice of a space-driven parameter is reached
    for name, values in seen.items():
        if name in SPACE_FIELD:
            assert values == set(getattr(space, SPACE_FIELD[name])), name


@pytest.mark.parametrize("space_id", SPACE_IDS)
@pytest.mark.parametrize("strategy", strategies.REGISTRY, ids=STRATEGY_IDS)
def test_not_applying_means_default_and_no_parameters(strategy: strategies.Strategy, space_id: str) -> None:
    space = SPACES[space_id]
    for params, _, knobs in sampled(space_id):
        if not strategy.applies(space):
            assert own_params(strategy, params) == {}
            assert knobs[strategy.name] == strategy.default()
        assert isinstance(knobs[strategy.name], strategy.Config)


@pytest.mark.parametrize("space_id", SPACE_IDS)
@pytest.mark.parametrize("strategy", strategies.REGISTRY, ids=STRATEGY_IDS)
def test_fixed_trial_replay_gives_the_same_config(strategy: strategies.Strategy, space_id: str) -> None:
    space = SPACES[space_id]
    for params, _, knobs in sampled(space_id):
        # the strategy reads only its own parameters
        replayed = (strategy.suggest(optuna.trial.FixedTrial(own_params(strategy, params)), space,
                                     before(strategy, knobs))
                    if strategy.applies(space) else strategy.default())
        assert replayed == knobs[strategy.name]
        # and the whole chain replays, through JSON as config.json stores the parameters
        stored = json.loads(json.dumps(params))
        again = strategies.sample(optuna.trial.FixedTrial(stored), space)
        assert again[strategy.name] == knobs[strategy.name]


@pytest.mark.parametrize("space_id", SPACE_IDS)
def test_replayed_recipe_equals_the_sampled_one(space_id: str) -> None:
    space = SPACES[space_id]
    recipes = set()
    for params, _, knobs in sampled(space_id):
        again = strategies.sample(optuna.trial.FixedTrial(dict(params)), space)
        assert again == knobs
        original = recipe_fields(strategies.build_recipe(knobs, space.device))
        replayed = recipe_fields(strategies.build_recipe(again, space.device))
        assert replayed == original
        # a recipe is built fresh each time: nothing accumulates between builds
        assert recipe_fields(strategies.build_recipe(knobs, space.device)) == original
        recipes.add(repr(original))
    if len(space.batch_sizes) > 1:
        assert len(recipes) > 1, "every trial built the same recipe"


@pytest.mark.parametrize("space_id", SPACE_IDS)
@pytest.mark.parametrize("strategy", strategies.REGISTRY, ids=STRATEGY_IDS)
def test_config_round_trips_through_json(strategy: strategies.Strategy, space_id: str) -> None:
    for _, _, knobs in sampled(space_id):
        config = knobs[strategy.name]
        data = strategy.to_dict(config)
        assert strategy.from_dict(data) == config
        assert strategy.from_dict(json.loads(json.dumps(data))) == config
    all_knobs = sampled(space_id)[0][2]
    assert strategies.knobs_from_dict(json.loads(json.dumps(strategies.knobs_to_dict(all_knobs)))) == all_knobs


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("space_id", SPACE_IDS)
@pytest.mark.parametrize("strategy", strategies.REGISTRY, ids=STRATEGY_IDS)
def test_apply_sets_only_known_backend_flags(strategy: strategies.Strategy, space_id: str, device: str) -> None:
    for _, _, knobs in sampled(space_id):
        recipe = Recipe(device=device)
        strategy.apply(knobs[strategy.name], recipe)
        assert set(recipe.backend_flags) <= set(BACKEND_FLAGS), recipe.backend_flags


@pytest.mark.parametrize("space_id", SPACE_IDS)
@pytest.mark.parametrize("strategy", strategies.REGISTRY, ids=STRATEGY_IDS)
def test_global_flags_are_scoped_and_restored(strategy: strategies.Strategy, space_id: str) -> None:
    space = SPACES[space_id]
    changed_any = sets_flags = False
    for i, (_, _, knobs) in enumerate(sampled(space_id)):
        recipe = Recipe(device=space.device)
        strategy.apply(knobs[strategy.name], recipe)
        flags = recipe.backend_flags
        saved = global_flags()
        if i % 2:
            with backend_flags(flags):
                inside = {name: BACKEND_FLAGS[name][0]() for name in flags}
                changed_any |= global_flags() != saved
        else:  # leaving the block by an exception restores them too
            with pytest.raises(RuntimeError, match="trial failed"):
                with backend_flags(flags):
                    inside = {name: BACKEND_FLAGS[name][0]() for name in flags}
                    changed_any |= global_flags() != saved
                    raise RuntimeError("trial failed")
        assert inside == flags
        assert global_flags() == saved
        sets_flags |= bool(flags)
    if sets_flags:
        # the check above was not vacuous: some recipe really switched a global
        assert changed_any, f"{strategy.name}'s flags never differed from the process's own"


def test_whole_recipe_flags_are_restored_on_cuda_space() -> None:
    space = SPACES["cuda"]
    for _, _, knobs in sampled("cuda"):
        recipe = strategies.build_recipe(knobs, space.device)
        saved = global_flags()
        with pytest.raises(KeyboardInterrupt):
            with backend_flags(recipe.backend_flags):
                assert torch.backends.cudnn.benchmark is knobs["cudnn"].benchmark
                raise KeyboardInterrupt
        assert global_flags() == saved


# knob-specific behaviour -------------------------------------------------------------------------


@pytest.mark.parametrize("space_id", SPACE_IDS)
def test_grad_scaler_only_with_fp16(space_id: str) -> None:
    num_fp16 = 0
    for params, _, knobs in sampled(space_id):
        scaler_params = {k for k in params if k.startswith("grad_scaler.")}
        recipe = strategies.build_recipe(knobs, SPACES[space_id].device)
        if knobs["precision"].mode == "fp16":
            num_fp16 += 1
            assert scaler_params == {"grad_scaler.init_scale", "grad_scaler.growth_factor",
                                     "grad_scaler.backoff_factor", "grad_scaler.growth_interval"}
            assert knobs["grad_scaler"].enabled
            assert recipe.grad_scaler == {k.split(".", 1)[1]: params[k] for k in scaler_params}
        else:
            assert scaler_params == set()
            assert knobs["grad_scaler"] == strategies.BY_NAME["grad_scaler"].default()
            assert not knobs["grad_scaler"].enabled
            assert recipe.grad_scaler is None
    assert (num_fp16 > 0) == ("fp16" in SPACES[space_id].precisions)


def _precision_recipe(mode: str, device: str = "cuda") -> Recipe:
    recipe = Recipe(device=device)
    Precision().apply(Precision.Config(mode=mode), recipe)
    return recipe


@pytest.mark.parametrize("has_tf32", [True, False])
def test_fp32_on_cuda_is_true_fp32(has_tf32: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # PyTorch lets cuDNN use TF32 by default on Ampere and newer: fp32 must switch it off there too
    monkeypatch.setattr(precision_module, "tf32_supported", lambda: has_tf32)
    recipe = _precision_recipe("fp32")
    assert recipe.autocast_dtype is None
    assert recipe.backend_flags["matmul_fp32_precision"] == "ieee"
    assert recipe.backend_flags["conv_fp32_precision"] == "ieee"
    with backend_flags(recipe.backend_flags):
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"


def test_tf32_on_cuda_allows_tf32() -> None:
    recipe = _precision_recipe("tf32")
    assert recipe.autocast_dtype is None
    assert recipe.backend_flags == {"matmul_fp32_precision": "tf32", "conv_fp32_precision": "tf32"}


@pytest.mark.parametrize("mode", ["tf32", "fp32", "fp16"])
def test_the_legacy_matmul_query_agrees_with_the_flags_set(mode: str, restore_backend_flags) -> None:
    # Lightning's CUDA accelerator calls torch.get_float32_matmul_precision(), which raises when
    # CUDA's matmul says "tf32" and the legacy setting "highest" (seen on the H200 in the Lightning export)
    mkldnn = torch.backends.mkldnn.matmul.fp32_precision
    with backend_flags(_precision_recipe(mode).backend_flags):
        tf32 = torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
        assert torch.backends.mkldnn.matmul.fp32_precision == mkldnn  # the CPU's matmul left alone
    assert torch.get_float32_matmul_precision() in ("high", "highest")


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_autocast_float32_ops_may_use_tf32_whatever_gpu_builds_the_recipe(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a recipe depends on its knobs alone (on a GPU without TF32 the switch is a no-op)
    for has_tf32 in (True, False):
        monkeypatch.setattr(precision_module, "tf32_supported", lambda: has_tf32)
        assert _precision_recipe(mode).backend_flags == {"matmul_fp32_precision": "tf32", "conv_fp32_precision": "tf32"}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize(("mode", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_autocast_modes_set_the_dtype(mode: str, dtype: torch.dtype, device: str) -> None:
    assert _precision_recipe(mode, device).autocast_dtype is dtype


def test_precision_on_cpu_sets_no_cuda_flags() -> None:
    for mode in ("fp32", "bf16"):
        assert _precision_recipe(mode, "cpu").backend_flags == {}


@pytest.mark.parametrize(("batch", "base"), [(64, 32), (16, 32), (32, 32)])
def test_batch_size_lr_note(batch: int, base: int) -> None:
    config = BatchSize.Config(batch_size=batch, base_batch_size=base)
    assert config.lr_scale == pytest.approx(batch / base)
    recipe = Recipe(device="cuda")
    BatchSize().apply(config, recipe)
    assert recipe.batch_size == batch and recipe.base_batch_size == base
    lr_notes = [n for n in recipe.notes if "learning rate" in n]
    if batch != base:
        assert len(lr_notes) == 1
        assert f"{batch / base:g}" in lr_notes[0]
    else:
        assert lr_notes == []


def test_batch_size_sampled_from_space_records_base() -> None:
    space = SPACES["cuda"]
    for _, _, knobs in sampled("cuda"):
        config = knobs["batch_size"]
        assert config.base_batch_size == space.base_batch_size
        assert config.lr_scale == config.batch_size / space.base_batch_size


def test_threads_candidates() -> None:
    assert threads_strategy.candidates(6) == [1, 2, 4, 6]
    assert threads_strategy.candidates(8) == [1, 2, 4, 8]
    assert threads_strategy.candidates(1) == [1]
    assert threads_strategy.candidates()[-1] >= 1


def test_batch_size_candidates() -> None:
    values = batch_size_strategy.candidates(16, 100)
    assert 16 in values and 100 in values
    assert all(16 <= v <= 100 for v in values)
    assert values == sorted(set(values))
    assert len(values) > 2
