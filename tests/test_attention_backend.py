"""attention: the SDPA backend a configuration pins runs in every training step's forward and backward
(TrainStep and a user's own loop under cfg.autocast()), is offered only for models that call SDPA, and a
backend that cannot run is a failed trial with its reason, not a crashed search. The end-to-end CPU search
of a tiny language model offers both language-model knobs (attention and vocab_padding)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import optuna
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fake_models
import strategies
from autotune.deploy.config import TunedConfig
from autotune.recipe import Recipe
from autotune.deploy.runtime import TrainStep
from autotune.space import SearchSpace
from autotune.trial.measure import MeasureSettings
from autotune.workload.models import WorkloadSpec
from conftest import ROOT, run_cli, subprocess_env
from strategies.attention import Attention, BackendFailed, PinnedBackend, cpu_backends, sdpa_calls

CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


class AtenOps(TorchDispatchMode):
    """The aten ops run inside the block, by name (the flash kernel shows as its own op; math as
    the matmuls and softmax it is made of)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else func))
        return func(*args, **(kwargs or {}))


def flash_ops(ops: list[str]) -> list[str]:
    return [op for op in ops if "scaled_dot_product_flash_attention_for_cpu" in op]


def lm_step(backend: str) -> tuple[TrainStep, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    workload = fake_models.tiny_lm()
    recipe = Recipe(device="cpu")
    Attention().apply(Attention.Config(backend=backend), recipe)
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    x, y = workload.batch(4, torch.Generator().manual_seed(0))
    return TrainStep(workload.model, optimizer, workload.loss_fn, recipe), x, y


@pytest.mark.parametrize("backend,forward_flash", [("flash", True), ("math", False)])
def test_train_step_runs_forward_and_backward_on_the_pinned_backend(backend, forward_flash):
    step, x, y = lm_step(backend)
    with AtenOps() as seen:
        loss = step(x, y)
    assert torch.isfinite(loss)
    flash = flash_ops(seen.ops)
    # the forward's kernel, and its backward (the flash backward op) only when flash was pinned
    assert bool([op for op in flash if "backward" not in op]) is forward_flash, flash
    assert bool([op for op in flash if "backward" in op]) is forward_flash, flash


def test_default_pins_nothing():
    recipe = Recipe(device="cpu")
    Attention().apply(Attention.Config(), recipe)
    assert recipe.step_contexts == []
    recipe = Recipe(device="cpu")
    Attention().apply(Attention.Config(backend="math"), recipe)
    assert recipe.step_contexts == [PinnedBackend("math")]  # a value: replayed recipes compare equal


def test_pinned_backends_give_the_same_loss_and_gradients():
    losses, grads = {}, {}
    for backend in ("default", "math", "flash"):
        step, x, y = lm_step(backend)
        step.optimizer.param_groups[0]["lr"] = 0.0  # keep the weights: compare one step's gradients
        losses[backend] = step(x, y)
        grads[backend] = step.model.qkv.weight.grad.clone()
    for backend in ("math", "flash"):
        torch.testing.assert_close(losses[backend], losses["default"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[backend], grads["default"], rtol=1e-4, atol=1e-6)


def test_a_backend_that_cannot_run_raises_a_clear_error():
    step, x, y = lm_step("efficient")  # CUDA-only kernel
    with pytest.raises(BackendFailed, match="the efficient attention backend cannot run .* 'default' lets PyTorch choose"):
        step(x, y)
    # and an error that is not about the kernel is not rewritten
    with pytest.raises(ValueError, match="not ours"), PinnedBackend("math")():
        raise ValueError("not ours")


def test_user_loop_under_cfg_autocast_gets_the_backend():
    space = SearchSpace(device="cpu", batch_sizes=[8], base_batch_size=8, thread_counts=[1],
                        choices={"attention": ["default", "math", "flash"]})
    params = {"threads.num_threads": 1, "attention.backend": "math"}
    cfg = TunedConfig.from_params(params, space)
    assert cfg.knobs["attention"] == Attention.Config(backend="math")
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with AtenOps() as default_ops:
        F.scaled_dot_product_attention(q, q, q)
    with AtenOps() as pinned_ops, cfg.autocast():
        F.scaled_dot_product_attention(q, q, q)
    assert flash_ops(default_ops.ops) and not flash_ops(pinned_ops.ops)
    with AtenOps() as after:  # only inside the block
        F.scaled_dot_product_attention(q, q, q)
    assert flash_ops(after.ops)


def test_offer_only_for_models_that_call_sdpa():
    strategy = Attention()
    assert strategy.offer(None, "cpu", {"sdpa_calls": 0}, {}) == {}
    assert strategy.offer(None, "cuda", {}, {}) == {}
    cpu = strategy.offer(None, "cpu", {"sdpa_calls": 2, "sdpa_head_dim": 16}, {})
    assert cpu == {"choices": {"attention": ["default", "math", "flash"]}} == {"choices": {"attention": list(cpu_backends())}}
    hopper = {"sdpa_calls": 1, "provenance": {"compute_capability": "9.0"}}
    ampere = {"sdpa_calls": 1, "provenance": {"compute_capability": "8.0"}}
    assert strategy.offer(None, "cuda", hopper, {})["choices"]["attention"] == ["default", "flash", "efficient",
                                                                               "cudnn", "math"]
    assert "cudnn" not in strategy.offer(None, "cuda", ampere, {})["choices"]["attention"]
    assert "cudnn" in strategy.offer(None, "cuda", {"sdpa_calls": 1}, {})["choices"]["attention"]  # unknown: tried
    space = SearchSpace(device="cpu", **cpu)
    assert strategy.seed(space, tuned=True, chosen={}) == strategy.seed(space, tuned=False, chosen={}) \
        == {"attention.backend": "default"}
    assert strategy.seed(SearchSpace(device="cpu"), tuned=True, chosen={}) == {}
    assert strategy.words({"backend": "flash"}) == "flash attention" and strategy.words({}) == ""
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        Attention.Config(backend="fast")


def test_probe_counts_sdpa_calls_direct_and_inside_torch_layers():
    x, _ = fake_models.tiny_lm().batch(2, torch.Generator().manual_seed(0))
    assert sdpa_calls(fake_models.TinyLM(), x) == {"sdpa_calls": 1, "sdpa_head_dim": 16}
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, batch_first=True), 2, enable_nested_tensor=False)
    assert sdpa_calls(encoder, torch.randn(2, 5, 32)) == {"sdpa_calls": 2, "sdpa_head_dim": 8}
    assert sdpa_calls(fake_models.tiny_cnn(), torch.randn(2, 3, 8, 8))["sdpa_calls"] == 0
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # put back
    failed = sdpa_calls(nn.Linear(3, 3), torch.randn(2, 4))  # a forward that fails: no knob, and why
    assert failed["sdpa_calls"] == 0 and failed["sdpa_probe_error"].startswith("RuntimeError")


def test_the_probe_reads_a_short_prefix_of_one_sequence_and_the_whole_batch_where_the_model_needs_it():
    """Attention's calls and head size do not depend on the length: a language model's probe forward
    reads 32 tokens of one sequence (GPT-2 over 2 x 1,024 took 8.7 s on 2 cores); a model that
    refuses them is counted on its whole batch."""
    seen = []

    class Recorded(fake_models.TinyLM):
        def __init__(self, fixed: bool) -> None:
            super().__init__(seq_len=64)
            self.fixed = fixed

        def forward(self, tokens):
            seen.append(tuple(tokens.shape))
            if self.fixed and tokens.shape[1] != 64:
                raise ValueError("this model reads 64 tokens")
            return super().forward(tokens)

    tokens = torch.randint(0, 1003, (2, 64))
    assert sdpa_calls(Recorded(fixed=False), tokens) == {"sdpa_calls": 1, "sdpa_head_dim": 16}
    assert seen == [(1, 32)]
    seen.clear()
    assert sdpa_calls(Recorded(fixed=True), tokens) == {"sdpa_calls": 1, "sdpa_head_dim": 16}  # counted once
    assert seen == [(1, 32), (2, 64)]
    seen.clear()
    short = torch.randint(0, 1003, (2, 16))  # no longer than the prefix: passed as it is
    assert sdpa_calls(Recorded(fixed=False), short)["sdpa_calls"] == 1 and seen == [(2, 16)]


@pytest.mark.slow
def test_a_trial_whose_backend_cannot_run_is_a_recorded_error(tmp_path):
    """The worker process reports the failure (status error, the reason) instead of dying."""
    space = SearchSpace(device="cpu", batch_sizes=[4], base_batch_size=4, thread_counts=[1],
                        choices={"attention": ["default", "efficient"]})
    knobs = strategies.sample(optuna.trial.FixedTrial({"threads.num_threads": 1, "attention.backend": "efficient"}), space)
    request = {"space": space.to_dict(), "knobs": strategies.knobs_to_dict(knobs),
               "workload": WorkloadSpec(model="fake_models:tiny_lm").to_dict(),
               "measure": MeasureSettings(min_warmup_steps=1, min_steps=1, min_time_s=0.0).to_dict(), "seed": 0}
    result_path = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "autotune.worker.serve", str(result_path), str(os.getpid())],
                          input=json.dumps(request), env=subprocess_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(result_path.read_text())
    assert result["status"] == "error", result
    assert result["reason"].startswith("BackendFailed: the efficient attention backend cannot run"), result["reason"]


LOAD_AND_STEP = """
import json, sys, torch, autotune, fake_models
cfg = autotune.load(sys.argv[1])
workload = fake_models.tiny_lm()
model, optimizer = cfg.prepare(workload.model, torch.optim.AdamW(workload.model.parameters(), lr=1e-3))
step = cfg.train_step(model, optimizer, workload.loss_fn)
x, y = workload.batch(cfg.batch_size, torch.Generator().manual_seed(0))
losses = [step(x, y).item() for _ in range(3)]
print(json.dumps({"embed": list(model.embed.weight.shape), "tied": model.head.weight is model.embed.weight,
                  "state": list(model.state_dict()["embed.weight"].shape), "losses": losses,
                  "logits": list(model(x).shape), "backend": cfg.knobs["attention"].backend}))
"""


@pytest.mark.slow
def test_cpu_search_of_a_language_model_offers_both_knobs_and_its_config_trains_padded(tmp_path):
    out = tmp_path / "out"
    run_cli("search", "--model", "fake_models:tiny_lm", "--device", "cpu", "--trials", "4", "--early-stop-below", "0",
            "--no-accuracy-check", "--min-measure-time", "0.2", "--batch-size", "8", "--precisions", "fp32",
            "--out", str(out), cwd=tmp_path)
    exported = json.loads((out / "config.json").read_text())
    assert exported["space"]["choices"]["attention"] == ["default", "math", "flash"]
    assert exported["space"]["choices"]["vocab_padding"] == [1, 64]
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    for trial in study.trials:  # every trial chose both knobs
        assert {"attention.backend", "vocab_padding.multiple"} <= set(trial.params), trial.params
    # the exported configuration, with the vocabulary padded (whatever the 4 trials found best), loads
    # through autotune.load and trains
    exported["params"]["vocab_padding.multiple"] = 64
    exported["knobs"]["vocab_padding"] = {"multiple": 64}
    padded = tmp_path / "padded.json"
    padded.write_text(json.dumps(exported))
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_STEP, str(padded)], env=subprocess_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = json.loads(proc.stdout.splitlines()[-1])
    assert trained["embed"] == [1024, 32] and trained["tied"] and trained["state"] == [1003, 32]
    assert trained["logits"] == [8, 16, 1003] and all(map(lambda v: v == v and v < 1e3, trained["losses"]))
    assert trained["backend"] == exported["knobs"]["attention"]["backend"]


def test_the_probe_reports_the_language_model_knobs_questions_and_skips_the_forward_when_asked():
    """worker.probe in this process: the attention calls, the vocabulary and the fp8-eligible share
    of a tiny LM; with "forward": False (a first probe's forward killed its process) the model is
    built and described but never run."""
    from autotune.trial.work import probe

    request = {"mode": "probe", "device": "cpu", "workload": {"model": "fake_models:tiny_lm"}}
    info = probe(request)
    assert info["sdpa_calls"] == 1 and info["sdpa_head_dim"] == 16
    assert info["vocab_size"] == 1003 and 0 <= info["fp8_eligible_share"] <= 1
    # its own random batches: no held-out set for the accuracy check to evaluate (an image model has one)
    assert info["own_batches"] is True
    assert probe({**request, "workload": {"model": "fake_models:tiny_cnn"}})["own_batches"] is False
    quiet = probe({**request, "forward": False})
    assert "sdpa_calls" not in quiet and quiet["vocab_size"] == 1003
    assert Attention().offer(None, "cpu", quiet, {}) == {}  # the knob is not offered without the count


# what cannot run is not run ---------------------------------------------------------------------

def test_attention_dtype_and_what_a_gpu_backend_cannot_run_before_it_runs():
    from strategies.attention import attention_dtype, cannot_run

    def knobs(mode, backend="flash", layers="none"):
        return {"precision": {"mode": mode}, "attention": {"backend": backend}, "fp32_layers": {"layers": layers}}

    assert [attention_dtype(knobs(m)) for m in ("fp32", "tf32", "fp16", "bf16", "fp8")] == [
        "fp32", "fp32", "fp16", "bf16", "bf16"]
    assert attention_dtype(knobs("bf16", layers="attention+head")) == "fp32"
    assert attention_dtype(knobs("bf16", layers="norm+head")) == "bf16"
    # on the H200: flash with tf32 (hf:gpt2) and cuDNN with FP32 attention layers (hf:llama) failed
    assert "flash attention takes only fp16 and bf16" in cannot_run(knobs("tf32"), "cuda")
    assert "computes attention in FP32" in cannot_run(knobs("bf16", "cudnn", "attention"), "cuda")
    assert cannot_run(knobs("bf16", "cudnn"), "cuda") is None
    assert cannot_run(knobs("fp32", "efficient"), "cuda") is None and cannot_run(knobs("fp32", "math"), "cuda") is None
    assert cannot_run(knobs("fp32"), "cpu") is None  # the CPU's flash kernel runs FP32


def test_a_backend_that_failed_is_not_run_again_with_attention_in_the_same_dtype(monkeypatch):
    """The search prunes, unstarted, what a pinned backend cannot run: a failure seen once for
    this model and attention dtype, or FP32 attention for a half-only backend."""
    from optuna.trial import TrialState

    from autotune.search.objective import Objective

    ran = []

    def fake_worker(request, *, timeout_s, log_path, spare=False, on_progress=None):
        knobs = request["knobs"]
        backend, mode = knobs["attention"]["backend"], knobs["precision"]["mode"]
        ran.append((mode, backend, knobs["batch_size"]["batch_size"]))
        if backend == "cudnn" and mode == "fp16":
            return {"status": "error", "wall_s": 1.0, "worker_start_s": 0.1,
                    "reason": "BackendFailed: the cudnn attention backend cannot run this model's attention"}
        figures = {"samples_per_s": 100.0, "step_time_ms": 80.0, "peak_memory_bytes": 1, "warmup_s": 1.0,
                   "measure_s": 2.0, "build_s": 0.5, "compile_s": 0.0, "loss_finite": True}
        return {"status": "ok", "figures": figures, "wall_s": 3.0, "worker_start_s": 0.1}

    monkeypatch.setattr("autotune.search.objective.run_worker", fake_worker)
    space = SearchSpace(device="cuda", precisions=["fp32", "tf32", "fp16", "bf16"], batch_sizes=[8, 16],
                        base_batch_size=8, choices={"attention": ["default", "flash", "cudnn"]})
    objective = Objective(space=space, workload={"model": "fake_models:tiny_lm"}, measure={}, input_on_device=False,
                          seed=0, trial_timeout_s=100.0, profile=False, early_stop_below=0.0)
    study = optuna.create_study(direction="maximize")
    for mode, backend, batch in [("fp16", "cudnn", 8), ("fp16", "cudnn", 16), ("bf16", "cudnn", 16),
                                 ("tf32", "flash", 8), ("fp16", "flash", 8)]:
        study.enqueue_trial({"precision.mode": mode, "attention.backend": backend, "batch_size.batch_size": batch})
    study.optimize(objective, n_trials=5, catch=(Exception,))
    failed, again, bf16, tf32_flash, fp16_flash = study.trials
    assert failed.state == TrialState.FAIL
    assert again.state == TrialState.PRUNED and "status" not in again.user_attrs
    assert again.user_attrs["reason"].startswith("not run: #0 pinned the same attention backend with attention in fp16")
    assert tf32_flash.state == TrialState.PRUNED and "takes only fp16 and bf16" in tf32_flash.user_attrs["reason"]
    assert bf16.state == fp16_flash.state == TrialState.COMPLETE
    assert ran == [("fp16", "cudnn", 8), ("bf16", "cudnn", 16), ("fp16", "flash", 8)]
