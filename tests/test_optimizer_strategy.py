"""optimizer knob: which implementations are offered, replay, and ``prepare`` rebuilding the user's
optimizer with the same hyperparameters and state (CPU; fused SGD/Adam/AdamW exist on CPU too)."""

from __future__ import annotations

import copy
import json

import optuna
import pytest
import torch
from torch import nn

import strategies
from autotune.deploy.config import TunedConfig
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from strategies import describe
from strategies import optimizer as optimizer_strategy
from strategies.optimizer import Optimizer, rebuild

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPACE = SearchSpace(device="cpu", batch_sizes=[8], base_batch_size=8,
                    optimizer_implementations=["plain", "fused"], zero_grad_set_to_none=[True, False])


@pytest.fixture(autouse=True)
def _seeded(restore_backend_flags):
    torch.manual_seed(0)


def small_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def trained(optimizer_cls, steps: int = 3, **kwargs):
    """A model and its optimizer after a few steps, so the optimizer has state to carry over."""
    torch.manual_seed(0)
    model = small_net()
    optimizer = optimizer_cls([{"params": model[0].parameters(), "lr": 0.05},
                               {"params": model[2].parameters()}], **kwargs)
    for _ in range(steps):
        train_step(model, optimizer)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int = 1) -> float:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def without_flags(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "foreach", "fused", "capturable")}


# which choices, sampling and replay --------------------------------------------------------------


def test_candidates_leave_out_what_never_pays() -> None:
    assert optimizer_strategy.candidates("cuda") == ["foreach", "fused"]  # plain: more launches, same math
    assert optimizer_strategy.candidates("cpu") == ["plain", "fused"]
    # the untuned one (PyTorch's default on that device) comes first: the baseline uses it
    for device in ("cuda", "cpu"):
        assert optimizer_strategy.candidates(device)[0] == optimizer_strategy.UNTUNED[device]


def test_default_space_samples_nothing_and_keeps_the_users_optimizer() -> None:
    trial = optuna.create_study().ask()
    config = Optimizer().suggest(trial, SearchSpace(device="cuda"), {})
    assert trial.params == {}
    assert config == Optimizer.Config(implementation="default", set_to_none=True)
    model, optimizer = trained(torch.optim.SGD, momentum=0.9)
    assert rebuild(optimizer, "default") is optimizer


def test_bad_implementation_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="choose from default, plain, foreach, fused"):
        Optimizer.Config(implementation="apex")


def test_sampled_values_come_from_the_space_and_replay() -> None:
    seen = set()
    for seed in range(30):
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed)).ask()
        knobs = strategies.sample(trial, SPACE)
        config = knobs["optimizer"]
        seen.add((config.implementation, config.set_to_none))
        assert trial.params["optimizer.implementation"] == config.implementation
        again = strategies.sample(optuna.trial.FixedTrial(json.loads(json.dumps(trial.params))), SPACE)
        assert again == knobs
        recipe = strategies.build_recipe(knobs, "cpu")
        assert (recipe.optimizer_implementation, recipe.zero_grad_set_to_none) == (config.implementation,
                                                                                   config.set_to_none)
    assert seen == {("plain", True), ("plain", False), ("fused", True), ("fused", False)}


def test_describe_names_the_implementation() -> None:
    knobs = {"precision": {"mode": "bf16"}, "optimizer": {"implementation": "fused", "set_to_none": False}}
    text = describe(knobs)
    assert "fused optimizer" in text and "zero_grad in place" in text
    assert "optimizer" not in describe({"precision": {"mode": "fp32"}})  # configs written before the knob


# rebuilding the user's optimizer -----------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["plain", "foreach", "fused"])
@pytest.mark.parametrize(("optimizer_cls", "kwargs"), [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": True}),
    (torch.optim.AdamW, {"lr": 1e-3, "betas": (0.8, 0.95), "weight_decay": 0.05}),
    (torch.optim.Adam, {"lr": 2e-3, "amsgrad": True}),
])
def test_rebuild_keeps_hyperparameters_state_and_updates(optimizer_cls, kwargs, implementation: str) -> None:
    model, optimizer = trained(optimizer_cls, **kwargs)
    reference_model, reference = copy.deepcopy((model, optimizer))
    new = rebuild(optimizer, implementation)

    assert type(new) is optimizer_cls
    flags = {"plain": (False, False), "foreach": (True, False), "fused": (False, True)}[implementation]
    for old_group, group in zip(optimizer.param_groups, new.param_groups):
        assert group["params"] == old_group["params"]  # the model's own parameter objects
        assert all(a is b for a, b in zip(group["params"], old_group["params"]))
        assert without_flags(group) == without_flags(old_group)  # lr per group, momentum, betas...
        assert (bool(group["foreach"]), bool(group["fused"])) == flags
    assert new.param_groups[0]["lr"] == 0.05  # the per-group value, not the default
    for p in model.parameters():
        old_state, state = optimizer.state[p], new.state[p]
        assert old_state.keys() == state.keys() and state
        for key, value in old_state.items():
            assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(value)), key

    # and the next steps move the weights as the original implementation does
    for seed in (5, 6):
        loss = train_step(model, new, seed)
        reference_loss = train_step(reference_model, reference, seed)
        assert loss == pytest.approx(reference_loss, rel=1e-5)
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_rebuild_refuses_an_optimizer_without_that_implementation() -> None:
    model = small_net()
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ConfigError, match=r"LBFGS has none \(no 'fused' argument\).*implementation 'default'"):
        rebuild(lbfgs, "fused")
    with pytest.raises(ConfigError, match="LBFGS has none"):
        rebuild(lbfgs, "foreach")
    assert rebuild(lbfgs, "default") is lbfgs


def test_rebuild_for_graph_capture_makes_adam_capturable_and_refuses_lbfgs() -> None:
    _, adam = trained(torch.optim.AdamW, lr=1e-3)
    graphed = rebuild(adam, "default", capturable=True)
    assert graphed is not adam and all(g["capturable"] for g in graphed.param_groups)
    _, sgd = trained(torch.optim.SGD, momentum=0.9, lr=0.1)
    assert rebuild(sgd, "default", capturable=True) is sgd  # SGD keeps no host-side step state
    with pytest.raises(ConfigError, match="CUDA graph.*LBFGS has no capturable=True option"):
        rebuild(torch.optim.LBFGS(small_net().parameters()), "default", capturable=True)


# through TunedConfig, as user code does ----------------------------------------------------------


def _params(implementation: str, set_to_none: bool = True) -> dict:
    return {"optimizer.implementation": implementation, "optimizer.set_to_none": set_to_none}


def test_prepare_returns_the_tuned_implementation_and_trains_the_same() -> None:
    losses = {}
    for implementation in ("plain", "fused"):
        cfg = TunedConfig.from_params(_params(implementation), SPACE)
        torch.manual_seed(0)
        model = small_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, prepared = cfg.prepare(model, optimizer)
        assert prepared.param_groups[0]["fused"] is (implementation == "fused")
        assert prepared.param_groups[0]["params"][0] is next(model.parameters())
        step = cfg.train_step(model, prepared, nn.functional.cross_entropy)
        g = torch.Generator().manual_seed(3)
        batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
        losses[implementation] = [float(step(x, y)) for x, y in batches]
    assert losses["fused"] == pytest.approx(losses["plain"], rel=1e-5)
    assert losses["plain"][-1] < losses["plain"][0]  # it trains


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_set_to_none_is_what_the_step_does(set_to_none: bool) -> None:
    cfg = TunedConfig.from_params(_params("plain", set_to_none), SPACE)
    model = small_net()
    model, optimizer = cfg.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = cfg.train_step(model, optimizer, nn.functional.cross_entropy)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    step(x, y)
    first = [p.grad for p in model.parameters()]
    step(x, y)
    same = [a is b for a, b in zip(first, (p.grad for p in model.parameters()))]
    # zeroed in place: the same gradient tensors every step; set to None: backward makes new ones
    assert all(same) if not set_to_none else not any(same)


def _overflowing_first_step(optimizer: torch.optim.Optimizer, model: nn.Module, scaler) -> None:
    """One GradScaler step whose gradients overflow (so the scaler skips it), as fp16's first
    steps usually do."""
    optimizer.zero_grad()
    x = torch.full((8, 6), 1e37)  # x 65536 (the scale) overflows fp32 in the gradients
    scaler.scale(model(x).sum()).backward()
    scaler.step(optimizer)
    scaler.update()


def test_a_skipped_first_step_leaves_fused_sgd_where_plain_sgd_is() -> None:
    """Fused SGD makes its momentum buffers with empty_like on the first step and its kernel fills
    them; a GradScaler-skipped first step used to leave them uninitialized (NaN weights on the
    H200). prepare() gives them zeros first, and training after a skip matches plain SGD."""
    implementation, results = "fused", {}
    for impl in ("plain", implementation):
        cfg = TunedConfig.from_params(_params(impl), SPACE)
        torch.manual_seed(0)
        model = small_net()
        model, optimizer = cfg.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        if impl == "fused":
            buffers = [optimizer.state[p].get("momentum_buffer") for p in model.parameters()]
            assert all(b is not None and not b.any() for b in buffers)  # zeros before any step
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        before = [p.detach().clone() for p in model.parameters()]
        _overflowing_first_step(optimizer, model, scaler)
        assert scaler.get_scale() == 2.0**15  # skipped, and the scale backed off
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        for p in model.parameters():
            buffer = optimizer.state[p].get("momentum_buffer")
            assert buffer is None or not buffer.any()  # no garbage to multiply in next time
        losses = []
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
        results[impl] = (losses, [p.detach().clone() for p in model.parameters()])
    assert results[implementation][0] == pytest.approx(results["plain"][0], rel=1e-5)
    for a, b in zip(results[implementation][1], results["plain"][1]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_priming_leaves_other_optimizers_and_dampened_sgd_alone() -> None:
    model = small_net()
    adam = torch.optim.Adam(model.parameters(), fused=True)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dampened = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1, fused=True)
    no_momentum = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    for optimizer in (adam, plain, dampened, no_momentum):
        assert optimizer_strategy.prime_fused_sgd(optimizer) is False
        assert not optimizer.state
    fused = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    assert optimizer_strategy.prime_fused_sgd(fused) is True
    assert optimizer_strategy.prime_fused_sgd(fused) is False  # buffers that exist are kept
