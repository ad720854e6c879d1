"""optimizer_state knob: 8-bit Adam/AdamW states through torchao, offered where they can work (an Adam
workload, torchao, a working torch.compile), rebuilt from the user's optimizer with its param groups,
hyperparameters and state, replayed by ``autotune.load`` and exported. torchao's 8-bit optimizers run
on a CPU too (their update is compiled by Inductor's C++ backend), so the steps here are real; the
tests that step them compile that update first (seconds to tens of seconds cold) and are slow."""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import sys
import warnings
from types import SimpleNamespace

import optuna
import pytest
import torch
from torch import nn

import strategies
from autotune.deploy import exports, runtime
from autotune.deploy.config import TunedConfig
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from strategies import optimizer_state
from strategies.optimizer_state import OptimizerState, rebuild

torchao = pytest.importorskip("torchao")
from torchao.optim import Adam8bit, AdamW8bit  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)

ADAMW = "torch.optim.adamw.AdamW"
WORKS = {"works": True, "reason": "", "seconds": 1.0}
CPU_SPACE = SearchSpace(device="cpu", batch_sizes=[8], base_batch_size=8, optimizer_implementations=["plain", "fused"],
                        choices={"optimizer_state": ["full", "8bit"]})
GPU_SPACE = SearchSpace(device="cuda", precisions=["fp32", "fp16", "bf16"], batch_sizes=[8], base_batch_size=8,
                        optimizer_implementations=["foreach", "fused"], cuda_graphs=[False, True],
                        compile_modes=["off", "default"], choices={"optimizer_state": ["full", "8bit"]})
# every parameter GPU_SPACE samples with 8-bit states (FixedTrial replays need them all)
GPU_PARAMS = {"optimizer_state.state": "8bit", "precision.mode": "bf16", "compile.mode": "off"}
SCALER = {"grad_scaler.init_scale": 1024.0, "grad_scaler.growth_factor": 2.0, "grad_scaler.backoff_factor": 0.5,
          "grad_scaler.growth_interval": 2000}


@pytest.fixture(autouse=True)
def _seeded(restore_backend_flags, monkeypatch):
    torch.manual_seed(0)
    # bitsandbytes installed or not, the offers below are torchao's (its own tests say otherwise)
    monkeypatch.setattr(optimizer_state, "bnb_version", lambda: None)


def net() -> nn.Module:
    """A 64x64 weight (4,096 values: torchao keeps its states in 8 bits) and small tensors it does not."""
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))


def adamw(model: nn.Module, **kwargs) -> torch.optim.AdamW:
    """Two groups with hyperparameters of their own, and a key of the user's (an LR scheduler's)."""
    return torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.02, "weight_decay": 0.1, "initial_lr": 0.02},
                              {"params": model[2].parameters()}], lr=0.01, betas=(0.8, 0.95), eps=1e-7, **kwargs)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 64, generator=g), torch.randint(0, 3, (16,), generator=g)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int = 1) -> float:
    x, y = batch(seed)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def offer(device: str = "cuda", **probe) -> dict:
    return OptimizerState().offer(SimpleNamespace(), device, {"optimizer_class": ADAMW, "compile": WORKS, **probe}, {})


# where it is offered -----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ["torch.optim.adamw.AdamW", "torch.optim.adam.Adam"])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_offered_for_adam_and_adamw_where_torchao_and_compile_work(cls: str, device: str) -> None:
    assert offer(device, optimizer_class=cls) == {"choices": {"optimizer_state": ["full", "8bit"]}}


def test_sgd_is_not_offered_and_says_why_without_a_line_at_search_start(recwarn) -> None:
    assert offer(optimizer_class="torch.optim.sgd.SGD") == {}
    assert not recwarn.list  # nothing the user could change: an SGD workload has no Adam states
    reason = optimizer_state.unavailable("cuda", {"optimizer_class": "torch.optim.sgd.SGD", "compile": WORKS})
    assert "torch.optim.sgd.SGD, not torch.optim.Adam or AdamW" in reason
    # a subclass may change the update: only the two classes themselves are replaced
    class MyAdamW(torch.optim.AdamW):
        pass

    name = optimizer_state.class_name(MyAdamW(net().parameters()))
    assert optimizer_state.unavailable("cuda", {"optimizer_class": name, "compile": WORKS}) is not None


def test_without_torchao_it_is_not_offered_and_the_line_names_the_extra(monkeypatch) -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "torchao":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.warns(UserWarning, match=r"8-bit optimizer states are not searched: they need torchao, which is "
                                         r"not installed; pip install 'autotune\[memory\]'"):
        assert offer() == {}
    monkeypatch.setattr(optimizer_state, "torchao_version", lambda: "0.10.0+cu126")
    with pytest.warns(UserWarning, match=r"torchao 0.10.0\+cu126 has no torchao.optim.AdamW8bit \(torchao 0.11"):
        assert offer() == {}


def test_without_a_working_compile_it_is_not_offered_and_says_why(recwarn) -> None:
    with pytest.warns(UserWarning, match=r"compiles its update with torch.compile, which does not work here "
                                         r"\(Triton is not installed"):
        assert offer(compile={"works": False, "reason": "Triton is not installed"}) == {}
    with pytest.warns(UserWarning, match=r"did not check on this GPU \(--no-compile\)"):
        assert offer(compile=None) == {}
    # a CPU search without compile: 8-bit states are for GPU memory, so it just is not searched, quietly
    recwarn.clear()
    assert OptimizerState().offer(SimpleNamespace(), "cpu", {"optimizer_class": ADAMW}, {}) == {}
    assert not recwarn.list
    assert "--compile" in optimizer_state.unavailable("cpu", {"optimizer_class": ADAMW})


def test_the_probe_reports_the_workloads_optimizer_class() -> None:
    from autotune.trial.work import probe
    from autotune.workload.models import WorkloadSpec

    spec = WorkloadSpec(model="fake_models:tiny_cnn", input_shape=(3, 16, 16), num_classes=10)
    found = probe({"device": "cpu", "workload": spec.to_dict()})
    assert found["optimizer_class"] == "torch.optim.sgd.SGD"  # a workload without make_optimizer: SGD
    assert optimizer_state.class_name(torch.optim.AdamW(net().parameters())) == ADAMW


# sampling, seeds and words -----------------------------------------------------------------------


def test_8bit_samples_no_implementation_nor_cuda_graphs_and_full_still_does() -> None:
    seen = {"full": set(), "8bit": set()}
    for seed in range(60):
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed)).ask()
        knobs = strategies.sample(trial, GPU_SPACE)
        state = knobs["optimizer_state"].state
        seen[state].add((knobs["optimizer"].implementation, knobs["cuda_graphs"].enabled))
        if state == "8bit":
            assert "optimizer.implementation" not in trial.params and "cuda_graphs.enabled" not in trial.params
        assert strategies.sample(optuna.trial.FixedTrial(dict(trial.params)), GPU_SPACE) == knobs  # replays
    assert seen["8bit"] == {("default", False)}
    assert {impl for impl, _ in seen["full"]} == {"foreach", "fused"} and (("foreach", True) in seen["full"])


def test_seeds_keep_the_users_optimizer_and_words_name_8bit() -> None:
    for tuned in (False, True):
        assert strategies.seed_params(CPU_SPACE, tuned=tuned)["optimizer_state.state"] == "full"
    assert "optimizer_state.state" not in strategies.seed_params(SearchSpace(device="cpu"), tuned=False)
    described = strategies.describe({"optimizer": {"implementation": "default"}, "optimizer_state": {"state": "8bit"},
                                     "compile": {"mode": "default"}})
    assert described.endswith(", 8-bit optimizer states, compile default")  # after the optimizer's words
    assert "8-bit" not in strategies.describe({"optimizer_state": {"state": "full"}})
    assert [k.key for k in OptimizerState().report_knobs()] == ["optimizer_state"]
    with pytest.raises(ValueError, match="choose from full, 8bit"):
        OptimizerState.Config(state="4bit")


# rebuilding the user's optimizer -----------------------------------------------------------------


def test_rebuild_keeps_the_parameters_and_every_groups_hyperparameters() -> None:
    model = net()
    old = adamw(model, amsgrad=True)
    new = rebuild(old, "8bit")
    assert type(new) is AdamW8bit and new.is_adamw
    assert len(new.param_groups) == 2
    for before, after in zip(old.param_groups, new.param_groups):
        assert [id(p) for p in after["params"]] == [id(p) for p in before["params"]]
        assert float(after["lr"]) == pytest.approx(before["lr"])  # torchao keeps lr as a tensor
        for key in ("betas", "eps", "weight_decay", "amsgrad"):
            assert after[key] == before[key], key
        assert not {"foreach", "fused", "capturable", "maximize"} & set(after)
    assert new.param_groups[0]["initial_lr"] == 0.02  # the user's own keys stay
    assert new.defaults["betas"] == (0.8, 0.95) and new.defaults["eps"] == 1e-7
    # Adam's L2 weight decay stays L2, and Adam with decoupled weight decay is AdamW
    assert type(rebuild(torch.optim.Adam(net().parameters(), weight_decay=0.1), "8bit")) is Adam8bit
    assert not rebuild(torch.optim.Adam(net().parameters()), "8bit").is_adamw
    assert rebuild(torch.optim.Adam(net().parameters(), decoupled_weight_decay=True), "8bit").is_adamw


def test_rebuild_quantises_a_resumed_runs_state_and_keeps_its_step_counts() -> None:
    model = net()
    old = adamw(model)
    for seed in range(3):
        step(model, old, seed)
    new = rebuild(old, "8bit")
    weight, bias = model[0].weight, model[0].bias
    state = new.state[weight]
    assert float(state["step"]) == 3.0 and state["step"].device.type == "cpu"  # as torchao counts
    for key in ("exp_avg", "exp_avg_sq"):
        assert isinstance(state[key], OptimState8bit)
        restored, original = state[key].dequantize(), old.state[weight][key]
        assert (restored - original).norm() / original.norm() < 0.02, key  # 8-bit codes, one scale per 256
    # a tensor under 4,096 values keeps its states as they were (torchao's rule)
    assert torch.equal(new.state[bias]["exp_avg"], old.state[bias]["exp_avg"])
    assert not isinstance(new.state[bias]["exp_avg"], OptimState8bit)
    # already 8-bit, or "full": the optimizer itself
    assert rebuild(new, "8bit") is new and rebuild(old, "full") is old


def test_rebuild_refuses_what_torchao_cannot_run_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"torch.optim.sgd.SGD, not torch.optim.Adam or AdamW.*'full'"):
        rebuild(torch.optim.SGD(net().parameters(), lr=0.1), "8bit")
    with pytest.raises(ConfigError, match="no maximize=True"):
        rebuild(torch.optim.AdamW(net().parameters(), maximize=True), "8bit")
    with pytest.raises(ConfigError, match="counts its steps on the host.*cuda_graphs off"):
        rebuild(adamw(net()), "8bit", cuda_graphs=True)
    with pytest.raises(ConfigError, match="fused implementation and 8-bit states"):
        rebuild(adamw(net()), "8bit", implementation="fused")
    with pytest.raises(ConfigError, match="choose from full, 8bit"):
        rebuild(adamw(net()), "4bit")
    mixed = torch.optim.Adam([{"params": net().parameters(), "decoupled_weight_decay": True},
                              {"params": net().parameters()}])
    with pytest.raises(ConfigError, match="mix decoupled"):
        rebuild(mixed, "8bit")


def test_without_torchao_prepare_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # `import torchao.optim` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'autotune\[memory\]'"):
        rebuild(adamw(net()), "8bit")


# replay and exports ------------------------------------------------------------------------------


def test_a_saved_config_replays_and_prepare_gives_adamw8bit(tmp_path) -> None:
    params = {"optimizer_state.state": "8bit", "optimizer.implementation": "fused", "optimizer.set_to_none": True}
    TunedConfig.from_params(params, CPU_SPACE).save(tmp_path / "config.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no provenance in this file: nothing to compare
        cfg = TunedConfig.load(tmp_path / "config.json")
    assert cfg.knobs["optimizer_state"].state == "8bit"
    assert cfg.knobs["optimizer"].implementation == "default"  # 8-bit replaces the implementation
    assert cfg.recipe.optimizer_state == "8bit" and any("torchao's 8-bit Adam" in n for n in cfg.notes)
    model = net()
    user = adamw(model)
    model, optimizer = cfg.prepare(model, user)
    assert type(optimizer) is AdamW8bit and optimizer.param_groups[0]["params"] == user.param_groups[0]["params"]
    assert cfg.train_step(model, optimizer, nn.CrossEntropyLoss()).num_setup_steps == 1  # the update's compile
    # "full" keeps the user's optimizer (its implementation as tuned)
    full = TunedConfig.from_params({**params, "optimizer_state.state": "full"}, CPU_SPACE)
    assert type(full.prepare(net(), adamw(net()))[1]) is torch.optim.AdamW


def test_exports_carry_8bit_to_hf_and_give_the_code_line_elsewhere() -> None:
    from transformers.training_args import OptimizerNames

    cfg = TunedConfig.from_params(GPU_PARAMS, GPU_SPACE)
    args, unsupported = exports.hf_training_args(cfg)
    assert args["optim"] == "adamw_torch_8bit" and "adamw_torch_8bit" in {o.value for o in OptimizerNames}
    assert "optimizer_state.state" not in {u["setting"] for u in unsupported}
    for settings in (exports.lightning_settings(cfg)["unsupported"], exports.accelerate_config(cfg).unsupported):
        (entry,) = [u for u in settings if u["setting"] == "optimizer_state.state"]
        assert entry["value"] == "8bit" and "strategies.optimizer_state.rebuild(optimizer, '8bit')" in entry["why"]
    full = TunedConfig.from_params({**GPU_PARAMS, "optimizer_state.state": "full", "optimizer.implementation": "fused",
                                    "cuda_graphs.enabled": False}, GPU_SPACE)
    assert exports.hf_training_args(full).training_args["optim"] == "adamw_torch_fused"
    assert "optimizer_state.state" not in {u["setting"] for u in exports.accelerate_config(full).unsupported}


def test_8bit_states_are_checked_for_accuracy_apart_from_full_ones() -> None:
    from autotune.accuracy.settings import describe_numerics, numerics_key

    bf16 = {"precision": {"mode": "bf16"}}
    eight = {**bf16, "optimizer_state": {"state": "8bit"}}
    assert numerics_key(eight) != numerics_key(bf16) == numerics_key({**bf16, "optimizer_state": {"state": "full"}})
    assert describe_numerics(eight) == "bf16, 8-bit optimizer states"


# steps (torchao compiles its update: slow) -------------------------------------------------------


@pytest.mark.slow
def test_a_step_of_adamw8bit_moves_the_parameters_as_adamw_does() -> None:
    model = net()
    start = [p.detach().clone() for p in model.parameters()]
    reference = copy.deepcopy(model)
    full, eight = adamw(reference), rebuild(adamw(model), "8bit")
    losses = [(step(reference, full, seed), step(model, eight, seed)) for seed in range(3)]
    for loss_full, loss_8bit in losses:
        assert loss_8bit == pytest.approx(loss_full, rel=1e-3)
    for p_full, p_8bit, p0 in zip(reference.parameters(), model.parameters(), start):
        moved_full, moved_8bit = (p_full - p0).flatten(), (p_8bit - p0).flatten()
        # the same direction (betas, lr, weight decay per group carried over), within 8-bit rounding
        assert nn.functional.cosine_similarity(moved_full, moved_8bit, dim=0) > 0.95
    # weight decay alone (a zero gradient): decoupled for AdamW, p * (1 - lr * wd), exactly as torch's
    decayed = net()
    for make in (lambda m: rebuild(adamw(m), "8bit"), adamw):
        m = copy.deepcopy(decayed)
        opt = make(m)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        assert torch.allclose(m[0].weight, decayed[0].weight * (1 - 0.02 * 0.1), rtol=0, atol=1e-7)


@pytest.mark.slow
def test_a_resumed_run_steps_from_its_quantised_state_and_grad_scaler_steps_it() -> None:
    model = net()
    old = adamw(model)
    for seed in range(3):
        step(model, old, seed)
    reference = copy.deepcopy(model)  # the run going on with its FP32 states
    full = adamw(reference)
    full.load_state_dict(old.state_dict())
    eight = rebuild(old, "8bit")
    # torch's AdamW from the very states the 8-bit optimizer holds, dequantised: the same update
    twin = copy.deepcopy(model)
    dequantised = adamw(twin)
    for p, q in zip(model.parameters(), twin.parameters()):
        dequantised.state[q] = {k: v.dequantize() if isinstance(v, OptimState8bit) else v.clone()
                                for k, v in eight.state[p].items()}
    step(reference, full, 3)
    step(twin, dequantised, 3)
    before = [p.detach().clone() for p in model.parameters()]
    # the 4th step through a GradScaler, as an fp16 configuration steps it: unscaled, checked, stepped
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = batch(3)
    eight.zero_grad()
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    scaler.step(eight)
    scaler.update()
    for p_8bit, p_twin, p_full, p0 in zip(model.parameters(), twin.parameters(), reference.parameters(), before):
        assert torch.allclose(p_8bit, p_twin, rtol=1e-5, atol=1e-6)  # step counts and moments carried over
        assert nn.functional.cosine_similarity((p_full - p0).flatten(), (p_8bit - p0).flatten(), dim=0) > 0.9
    # an inf gradient: GradScaler skips the step and the parameters stay
    kept = [p.detach().clone() for p in model.parameters()]
    eight.zero_grad()
    scaler.scale(nn.functional.cross_entropy(model(x), y) * float("inf")).backward()
    scaler.step(eight)
    scaler.update()
    assert all(torch.equal(p, k) for p, k in zip(model.parameters(), kept))


@pytest.mark.slow
def test_a_compiled_model_trains_with_8bit_states_through_the_tuned_step() -> None:
    space = SearchSpace(device="cpu", batch_sizes=[16], base_batch_size=16, compile_modes=["off", "default"],
                        choices={"optimizer_state": ["full", "8bit"]})
    cfg = TunedConfig.from_params({"optimizer_state.state": "8bit", "compile.mode": "default"}, space)
    model = net()
    model, optimizer = cfg.prepare(model, adamw(model))
    assert type(optimizer) is AdamW8bit and cfg.recipe.compile_mode == "default"
    train = cfg.train_step(model, optimizer, nn.CrossEntropyLoss())
    x, y = batch(1)
    losses = [float(train(x, y)) for _ in range(6)]
    assert losses[-1] < losses[0] and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.slow
def test_the_accuracy_check_trains_8bit_states(monkeypatch) -> None:
    from autotune.accuracy.settings import AccuracySettings
    from autotune.accuracy.worker.check import train_run
    from autotune.workload.data import load_data
    from autotune.workload.models import WorkloadSpec

    made: list[torch.optim.Optimizer] = []
    prepare = runtime.prepare_optimizer
    monkeypatch.setattr(runtime, "prepare_optimizer", lambda o, recipe: made.append(prepare(o, recipe)) or made[-1])
    spec = WorkloadSpec(model="fake_models:dropout_mlp", input_shape=(3, 8, 8), num_classes=10)  # a 64x192 weight
    settings = AccuracySettings(steps=10, batch_size=8, held_out_size=16)
    data = load_data(None, input_shape=(3, 8, 8), num_classes=10, train_size=80, held_out_size=16)
    run = train_run(spec, {"optimizer_state": {"state": "8bit"}}, CPU_SPACE, settings, data)
    assert [type(o) for o in made] == [AdamW8bit] and torch.isfinite(torch.tensor(run["final_loss"]))


# on the GPU --------------------------------------------------------------------------------------


def _state_bytes_and_losses(make_optimizer, steps: int = 20) -> tuple[int, list[float]]:
    """A 2-layer MLP of 4.2M parameters on CUDA: its optimizer's resident state after a step (memory
    allocated with gradients freed, less the parameters) and the losses of ``steps`` steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024)).cuda()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 1024, generator=g).cuda(), torch.randn(256, 1024, generator=g).cuda()
    optimizer = make_optimizer(model)
    torch.cuda.synchronize()
    params_only = torch.cuda.memory_allocated()
    losses, state_bytes = [], 0
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        if i == 0:
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            state_bytes = torch.cuda.memory_allocated() - params_only
    return state_bytes, losses


@pytest.mark.gpu
def test_on_cuda_8bit_states_take_under_40_percent_and_the_loss_falls_as_with_adamw() -> None:
    full_bytes, full = _state_bytes_and_losses(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    eight_bytes, eight = _state_bytes_and_losses(lambda m: rebuild(torch.optim.AdamW(m.parameters(), lr=1e-3), "8bit"))
    print(f"optimizer state: AdamW {full_bytes / 2**20:.1f} MiB, AdamW8bit {eight_bytes / 2**20:.1f} MiB; "
          f"losses {full[0]:.4f} -> {full[-1]:.4f} and {eight[0]:.4f} -> {eight[-1]:.4f}")
    assert full_bytes >= 8 * 4_000_000  # two FP32 states of 4.2M parameters
    assert eight_bytes < 0.4 * full_bytes
    assert eight[-1] < 0.25 * eight[0]
    assert abs(eight[-1] - full[-1]) < 0.1 * (full[0] - full[-1])


@pytest.mark.gpu
def test_on_cuda_8bit_composes_with_compile_and_fp16_grad_scaler_and_refuses_cuda_graphs() -> None:
    cfg = TunedConfig.from_params({**GPU_PARAMS, **SCALER, "precision.mode": "fp16", "compile.mode": "default"},
                                  GPU_SPACE)
    assert cfg.recipe.grad_scaler is not None and not cfg.recipe.cuda_graphs
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    model, optimizer = cfg.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert type(optimizer) is AdamW8bit
    train = cfg.train_step(model, optimizer, nn.CrossEntropyLoss())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 256, generator=g).cuda(), torch.randint(0, 10, (64,), generator=g).cuda()
    losses = [float(train(x, y)) for _ in range(10)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    graphs = TunedConfig.from_params({**GPU_PARAMS, "optimizer_state.state": "full", "cuda_graphs.enabled": True,
                                      "optimizer.implementation": "foreach"}, GPU_SPACE)
    assert graphs.recipe.cuda_graphs
    graphs.recipe.optimizer_state = "8bit"  # a recipe the search never makes
    layer = nn.Linear(64, 64)
    with pytest.raises(ConfigError, match="counts its steps on the host"):
        graphs.prepare(layer, torch.optim.AdamW(layer.parameters()))


# bitsandbytes' 8-bit Adam ---------------------------------------------------------------------------


def test_bitsandbytes_is_offered_on_a_gpu_beside_torchao_and_alone_without_it(monkeypatch):
    monkeypatch.setattr(optimizer_state, "bnb_version", lambda: "0.50.2")
    assert offer("cuda") == {"choices": {"optimizer_state": ["full", "8bit", "8bit-bnb"]}}
    assert offer("cpu") == {"choices": {"optimizer_state": ["full", "8bit"]}}  # its point is the fused CUDA kernel
    monkeypatch.setattr(optimizer_state, "torchao_missing", lambda: "no torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert offer("cuda") == {"choices": {"optimizer_state": ["full", "8bit-bnb"]}}
    assert offer("cuda", optimizer_class="torch.optim.sgd.SGD") == {}


def test_bitsandbytes_rebuild_keeps_groups_and_refuses_a_resumed_state():
    bnb = pytest.importorskip("bitsandbytes")
    model = net()
    new = optimizer_state.rebuild(adamw(model), "8bit-bnb")
    assert isinstance(new, bnb.optim.AdamW8bit) and optimizer_state.is_8bit(new)
    first, second = new.param_groups
    assert (first["lr"], first["weight_decay"], first["initial_lr"]) == (0.02, 0.1, 0.02)
    assert (second["lr"], tuple(second["betas"]), second["eps"]) == (0.01, (0.8, 0.95), 1e-7)
    before = [p.detach().clone() for p in model.parameters()]
    step(model, new)  # its CPU backend steps too
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    resumed = adamw(model)
    step(model, resumed)
    with pytest.raises(ConfigError, match="fresh optimizer"):
        optimizer_state.rebuild(resumed, "8bit-bnb")


def test_bitsandbytes_words_name_the_library():
    assert OptimizerState().words({"state": "8bit-bnb"}) == "8-bit optimizer states (bitsandbytes)"
    assert OptimizerState().words({"state": "8bit"}) == "8-bit optimizer states"


def test_the_bitsandbytes_states_export_as_hf_adamw_bnb_8bit() -> None:
    from transformers.training_args import OptimizerNames

    space = dataclasses.replace(GPU_SPACE, choices={**GPU_SPACE.choices, "optimizer_state": ["full", "8bit", "8bit-bnb"]})
    cfg = TunedConfig.from_params({**GPU_PARAMS, "optimizer_state.state": "8bit-bnb"}, space)
    args, _ = exports.hf_training_args(cfg)
    assert args["optim"] == "adamw_bnb_8bit" and "adamw_bnb_8bit" in {o.value for o in OptimizerNames}
    (entry,) = [u for u in exports.accelerate_config(cfg).unsupported if u["setting"] == "optimizer_state.state"]
    assert "rebuild(optimizer, '8bit-bnb')" in entry["why"]
