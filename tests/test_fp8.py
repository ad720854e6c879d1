"""FP8 training as a precision mode (issue 19): offered on GPUs with FP8 Tensor Cores when torchao is
installed, the eligible Linear layers converted in place, the exports honest about it, and a CPU search
(torchao emulates float8 there) that measures and exports it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import strategies
import strategies.precision as precision
from autotune.deploy.config import TunedConfig
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from conftest import run_cli

torchao = pytest.importorskip("torchao")


def mlp16(num_classes: int = 10) -> nn.Module:
    """Two Linear layers fp8 can run (widths multiples of 16) and a head of 10 it cannot."""
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                         nn.Linear(32, num_classes))


def fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **k: capability >= (8, 0))


@pytest.mark.parametrize("capability, offered", [((9, 0), True), ((8, 9), True), ((8, 6), False), ((7, 0), False)])
def test_fp8_is_offered_from_compute_capability_8_9_on(monkeypatch, capability, offered):
    fake_gpu(monkeypatch, capability)
    assert ("fp8" in precision.supported_modes("cuda")) is offered
    assert "fp8" not in precision.supported_modes("cpu")  # emulated there: only when asked for


def test_without_torchao_fp8_is_not_offered_and_asking_for_it_names_the_extra(monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(precision, "torchao_installed", lambda: False)
    assert "fp8" not in precision.supported_modes("cuda")
    options = SimpleNamespace(precisions=["fp32", "fp8"])
    with pytest.raises(ConfigError, match=r"pip install 'autotune\[fp8\]'"):
        precision.Precision().offer(options, "cuda", {"precisions": ["fp32", "tf32", "fp16", "bf16"]}, {})


def test_fp8_on_an_older_gpu_says_what_it_needs(monkeypatch):
    options = SimpleNamespace(precisions=["fp32", "fp8"])
    with pytest.raises(ConfigError, match="compute capability 8.9"):
        precision.Precision().offer(options, "cuda", {"precisions": ["fp32", "tf32", "fp16", "bf16"]}, {})


def test_on_a_cpu_fp8_is_searched_when_asked_for():
    options = SimpleNamespace(precisions=["fp32", "fp8"])
    assert precision.Precision().offer(options, "cpu", {"precisions": ["fp32"]}, {}) == {"precisions": ["fp32", "fp8"]}


def test_the_eligible_linears_train_in_float8_with_their_own_parameters():
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model = mlp16()
    before = [id(p) for p in model.parameters()]
    reference = mlp16()
    reference.load_state_dict(model.state_dict())
    assert precision.to_float8_training(model) is model
    kinds = [type(m).__name__ for m in model if isinstance(m, nn.Linear)]
    assert kinds == ["Float8Linear", "Float8Linear", "Linear"]  # the 32 -> 10 head stays
    assert [id(p) for p in model.parameters()] == before  # an optimizer built before still steps them
    assert set(model.state_dict()) == set(reference.state_dict())  # checkpoints keep their keys
    x, y = torch.randn(64, 3, 4, 4), torch.randint(0, 10, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x).float(), y)
        expected = nn.functional.cross_entropy(reference(x).float(), y)
    loss.backward()
    assert isinstance(model[1], Float8Linear) and model[1].weight.grad is not None
    assert torch.isfinite(loss) and abs(loss.item() - expected.item()) < 0.05 * expected.item()


def test_a_model_with_no_linear_fp8_can_run_is_refused_with_the_fix():
    model = nn.Sequential(nn.Linear(10, 30), nn.ReLU(), nn.Linear(30, 7))
    with pytest.raises(ConfigError, match="multiple of 16.*--precisions"):
        precision.to_float8_training(model)


def fp8_config() -> TunedConfig:
    space = SearchSpace(device="cuda", precisions=["fp32", "bf16", "fp8"], batch_sizes=[64], base_batch_size=64)
    return TunedConfig.from_params({**strategies.seed_params(space, tuned=True), "precision.mode": "fp8"}, space)


def test_exports_say_fp8_where_the_framework_cannot_and_lightning_converts_through_its_callback():
    cfg = fp8_config()
    hf, hf_unsupported = cfg.hf_training_args()
    assert hf["bf16"] is True and hf["fp16"] is False
    assert "precision.mode" in {u["setting"] for u in hf_unsupported}
    acc = cfg.accelerate_config()
    assert acc.config["mixed_precision"] == "bf16" and "precision.mode" in {u["setting"] for u in acc.unsupported}
    pytest.importorskip("lightning.pytorch")
    exp = cfg.lightning()
    assert exp.precision == "bf16-mixed" and "precision.mode" not in {u["setting"] for u in exp.unsupported}
    assert precision.to_float8_training in exp.callback.recipe.model_transforms


@pytest.mark.slow
def test_a_cpu_search_measures_fp8_and_exports_a_config_that_trains_in_float8(tmp_path: Path):
    import optuna
    import pandas as pd
    from torchao.float8.float8_linear import Float8Linear

    import autotune

    out = tmp_path / "fp8"
    run_cli("search", "--model", "test_fp8:mlp16", "--device", "cpu", "--input-shape", "3x4x4", "--num-classes", "10",
            "--precisions", "fp32,fp8", "--trials", "3", "--batch-size", "64", "--min-measure-time", "0.2",
            "--early-stop-below", "0", "--accuracy-steps", "30", "--out", str(out), timeout=400)
    table = pd.read_csv(out / "trials.csv")
    fp8 = table[(table["param.precision.mode"] == "fp8") & (table["state"] == "COMPLETE")]
    assert len(fp8) >= 1 and (fp8["samples_per_s"] > 0).all()
    data = json.loads((out / "config.json").read_text())
    assert data["accuracy"]["verdict"] in ("passed", "violated", "unstable", "not checked")
    best = autotune.load(out / "config.json")
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    measured = next(t for t in study.trials if t.number == int(fp8["number"].iloc[0]))
    cfg = TunedConfig.from_params(measured.params, best.space)  # as `autotune.load` rebuilds a trial
    model = mlp16()
    model, optimizer = cfg.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 2
    step = cfg.train_step(model, optimizer, nn.functional.cross_entropy)
    x, y = torch.randn(64, 3, 4, 4), torch.randint(0, 10, (64,))
    assert all(torch.isfinite(step(x, y)) for _ in range(3))


def test_fp8_is_not_offered_for_a_model_with_no_linear_it_can_run(monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    offered = ["fp32", "tf32", "fp16", "bf16", "fp8"]
    p = precision.Precision()
    none_eligible = {"precisions": offered, "fp8_eligible_share": 0.0}
    assert p.offer(SimpleNamespace(precisions=None), "cuda", none_eligible, {})["precisions"] == offered[:-1]
    with pytest.raises(ConfigError, match="leave fp8 out"):
        p.offer(SimpleNamespace(precisions=["fp32", "fp8"]), "cuda", none_eligible, {})
    some = {"precisions": offered, "fp8_eligible_share": precision.fp8_eligible_share(mlp16())}
    assert 0.5 < some["fp8_eligible_share"] < 1
    assert p.offer(SimpleNamespace(precisions=None), "cuda", some, {})["precisions"] == offered


@pytest.mark.parametrize("compile_mode", ["off", pytest.param("default", marks=pytest.mark.slow)])
def test_fp8_trains_with_the_memory_knobs_the_planner_puts_on_its_twin(monkeypatch, compile_mode):
    """Under a memory cap the planner queues the fp8 twin of the plain recipe with the fused loss and
    every block checkpointed first (a 1B Llama under 24 GiB): the three compose in one training step,
    the tied head handing its hidden states to the loss while its Linear layers run in float8
    (emulated on a CPU; liger's kernel replaced by the reference of tests/test_loss_kernel.py)."""
    from torchao.float8.float8_linear import Float8Linear

    from autotune.workload.models import WorkloadSpec, build
    from strategies import loss_kernel
    from test_loss_kernel import reference

    monkeypatch.setitem(loss_kernel.IMPLEMENTATIONS, "fused_linear", reference)
    space = SearchSpace(device="cpu", precisions=["fp32", "bf16", "fp8"], batch_sizes=[4], base_batch_size=4,
                        compile_modes=["off", "default"],
                        choices={"loss_kernel": ["framework", "fused_linear"], "activation_checkpointing": [0, 1, 2]})
    cfg = TunedConfig.from_params({"precision.mode": "fp8", "batch_size.batch_size": 4, "compile.mode": compile_mode,
                                   "loss_kernel.kernel": "fused_linear", "activation_checkpointing.every": 1}, space)
    torch.manual_seed(0)
    workload = build(WorkloadSpec(model="hf:llama", seq_len=32, model_config={
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1024, "tie_word_embeddings": True}))
    model, optimizer = cfg.prepare(workload.model, workload.optimizer(workload.model))
    step = cfg.train_step(model, optimizer, workload.loss_fn)
    x, y = workload.batch(4, torch.Generator().manual_seed(1))
    losses = [float(step(x, y)) for _ in range(6)]
    assert isinstance(model.lm_head, Float8Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 2 * 7 + 1
    assert getattr(model.model, "is_activation_checkpointing", None) or model.model.is_gradient_checkpointing
    assert all(map(lambda v: v == v, losses)) and losses[-1] < losses[0] - 0.2  # it learns the batch
