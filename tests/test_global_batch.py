"""--global-batch-size: the user's batch kept as micro-batch x gradient accumulation."""

from __future__ import annotations

import json

import optuna
import pytest
import torch
from optuna.trial import FixedTrial
from torch import nn

import strategies
from autotune.deploy.config import TunedConfig
from autotune.errors import ConfigError
from autotune.space import SearchSpace
from autotune.search.options import SearchConfig
from autotune.search.space import build_space
from autotune.workload.models import WorkloadSpec
from conftest import run_cli

RESNET50_PROBE = {"precisions": ["fp32", "tf32", "fp16", "bf16"], "input_dim": 4, "misaligned": {},
                  "provenance": {"gpu": "NVIDIA H200"}, "compile": {"works": True}}


def test_resnet50_at_a_global_batch_of_256_searches_micro_batches_that_make_256():
    config = SearchConfig(workload=WorkloadSpec(model="resnet50"), global_batch_size=256, accuracy_check=False)
    space = build_space(config, "cuda", RESNET50_PROBE)
    assert space.batch_sizes == [16, 32, 64, 128, 256] and space.base_batch_size == 256
    assert space.cuda_graphs == [False]  # a graph replays one optimizer step, not k micro-steps
    knob_of = strategies.BY_NAME["batch_size"]
    for micro in space.batch_sizes:
        knob = knob_of.suggest(FixedTrial({"batch_size.batch_size": micro}), space, {})
        assert knob.batch_size * knob.accumulation_steps == 256 and knob.lr_scale == 1.0


def test_bad_combinations_are_refused_with_the_fix():
    spec = WorkloadSpec(model="resnet50")
    with pytest.raises(ConfigError, match="does not go with --batch-size"):
        SearchConfig(workload=spec, global_batch_size=256, batch_size=64)
    with pytest.raises(ConfigError, match="drop --base-batch-size"):
        SearchConfig(workload=spec, global_batch_size=256, base_batch_size=128)
    with pytest.raises(ConfigError, match="divides --global-batch-size 7"):
        build_space(SearchConfig(workload=spec, global_batch_size=7, min_batch_size=16, accuracy_check=False),
                    "cuda", RESNET50_PROBE)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 5))  # nothing that depends on the batch


def test_an_accumulated_step_equals_one_plain_step_over_the_whole_batch():
    """Gradients of 4 micro-batches of 16, each loss divided by 4, are those of one batch of 64:
    the optimizer steps once, to the same weights. (BatchNorm would differ: its statistics are
    per micro-batch, as in any accumulation.)"""
    space = SearchSpace(device="cpu", precisions=["fp32"], batch_sizes=[16, 64], base_batch_size=64,
                        global_batch_size=64)
    cfg = TunedConfig.from_params({"batch_size.batch_size": 16}, space)
    assert cfg.batch_size == 16 and cfg.accumulation_steps == 4 and cfg.scaled_lr(0.1) == pytest.approx(0.1)
    x, y = torch.randn(64, 12, generator=torch.Generator().manual_seed(1)), torch.randint(0, 5, (64,))
    loss_fn = nn.CrossEntropyLoss()

    accumulated = _mlp()
    optimizer = torch.optim.SGD(accumulated.parameters(), lr=0.1)
    step = cfg.train_step(accumulated, optimizer, loss_fn)
    before = [p.detach().clone() for p in accumulated.parameters()]
    for i in range(3):
        step(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])
        assert all(torch.equal(a, b) for a, b in zip(accumulated.parameters(), before))  # no step yet
    step(x[48:], y[48:])

    plain = _mlp()
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    loss_fn(plain(x), y).backward()
    reference.step()
    for a, b in zip(accumulated.parameters(), plain.parameters()):
        assert torch.allclose(a, b, atol=1e-6)  # the same step
    assert not any(torch.equal(a, b) for a, b in zip(accumulated.parameters(), before))  # and a real one


@pytest.mark.slow
def test_a_cpu_search_keeps_the_global_batch_and_exports_the_accumulation(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("search", "--model", "fake_models:tiny_cnn", "--device", "cpu", "--input-shape", "3x32x32",
                   "--num-classes", "10", "--global-batch-size", "64", "--trials", "3", "--min-measure-time", "0.3",
                   "--no-accuracy-check", "--out", str(out))
    assert proc.returncode == 0
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    knobs = [t.user_attrs["knobs"]["batch_size"] for t in study.trials if "knobs" in t.user_attrs]
    assert len(knobs) >= 3 and all(k["batch_size"] * k["accumulation_steps"] == 64 for k in knobs)
    data = json.loads((out / "config.json").read_text())
    assert data["baseline"]["batch_size"] * data["baseline"]["accumulation_steps"] == 64
    assert "note" not in data["baseline"]  # the baseline kept the user's batch: one plain step of 64 samples
    import autotune

    cfg = autotune.load(out / "config.json")
    assert cfg.batch_size * cfg.accumulation_steps == 64 and cfg.scaled_lr(0.1) == pytest.approx(0.1)
