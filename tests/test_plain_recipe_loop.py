"""scripts/plain_recipe_loop.py, the plain recipe as a hand-written loop (issue 35): it trains a timm
ConvNet, a torchvision model and a tiny GPT-2 on the CPU and prints one JSON line of what it timed,
and its search for the largest batch takes the largest candidate that does not run out of memory."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, subprocess_env


def _script():
    spec = importlib.util.spec_from_file_location("plain_recipe_loop", ROOT / "scripts" / "plain_recipe_loop.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


loop = _script()
QUICK = ["--device", "cpu", "--steps", "2", "--warmup", "1"]


def _printed(capsys) -> dict:
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return json.loads(line)


def test_the_candidates_go_from_four_times_the_base_down_to_one():
    assert loop.candidates(256)[:6] == [1024, 768, 512, 384, 256, 192]
    assert loop.candidates(16) == [64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1]
    assert loop.candidates(10)[:2] == [40, 32]  # 4x the base itself, then the grid below it


def test_the_largest_batch_is_the_largest_candidate_that_does_not_run_out_of_memory():
    ran, freed = [], []

    def attempt(batch):
        ran.append(batch)
        if batch > 100:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch} MiB")
        return {"samples_per_s": 10.0 * batch}

    batch, result, tried = loop.largest_batch(loop.candidates(256), attempt, lambda: freed.append(True))
    assert batch == 96 and result == {"samples_per_s": 960.0}
    # the largest first, then a bisection of the 19 below it: 6 compiles where going down took 8
    assert ran == [1024, 32, 192, 64, 96, 128]
    assert [t["outcome"] for t in tried] == ["oom", "ok", "oom", "ok", "ok", "oom"] and len(freed) == 3
    assert tried[0]["batch"] == 1024 and "out of memory" in tried[0]["error"]
    assert loop.largest_batch(loop.candidates(256), lambda b: {"b": b})[0] == 1024  # ample memory: one try

    # an allocation failure wrapped in another error (torch.compile's, cuDNN's) is one too
    def wrapped(batch):
        if batch > 2:
            try:
                raise torch.OutOfMemoryError("CUDA out of memory")
            except torch.OutOfMemoryError as exc:
                raise RuntimeError("backend compiler failed") from exc
        return {}

    assert loop.largest_batch([4, 3, 2, 1], wrapped)[0] == 2
    # nothing fits: no batch, every one tried
    batch, result, tried = loop.largest_batch([2, 1], lambda b: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
    assert (batch, result, sorted(t["batch"] for t in tried)) == (None, None, [1, 2])

    # any other error ends the search: an illegal memory access leaves the process unusable
    def broken(batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        loop.largest_batch([4, 2], broken)


@pytest.mark.slow
def test_a_timm_convnet_trains_channels_last_and_the_json_follows_from_its_step_time(capsys):
    assert loop.main(["--model", "timm:test_resnet", "--input-shape", "3x32x32", "--num-classes", "10",
                      "--base-batch-size", "2", *QUICK]) == 0
    out = _printed(capsys)
    assert out["model"] == "timm:test_resnet" and out["batch"] == 8 and out["base_batch"] == 2
    assert out["tried"] == [{"batch": 8, "outcome": "ok"}]
    assert out["channels_last"] is True and out["precision"] == "bf16" and out["compile"] is False
    assert out["samples_per_s"] == pytest.approx(8 / (out["step_ms"] / 1e3)) and out["tokens_per_s"] is None
    assert out["final_loss"] > 0 and out["device"] == "cpu" and out["optimizer"] == "adamw"


@pytest.mark.slow
def test_a_torchvision_model_trains_and_its_inputs_are_random(monkeypatch, capsys):
    args = loop.parse_args(["--model", "resnet18", "--input-shape", "3x32x32", "--num-classes", "10", *QUICK])
    workload = loop.build(args)
    x, y = workload.make_batch(4, torch.Generator().manual_seed(0))
    assert x.shape == (4, 3, 32, 32) and x.std() > 0.5 and y.min() >= 0 and y.max() < 10 and len(set(y.tolist())) > 1
    before = workload.model.fc.weight.detach().clone()
    monkeypatch.setattr(loop, "build", lambda a: workload)
    assert loop.main(["--model", "resnet18", "--batch-size", "3", "--optimizer", "sgd", *QUICK]) == 0
    out = _printed(capsys)
    assert out["batch"] == 3 and out["tried"] == [{"batch": 3, "outcome": "ok"}] and out["optimizer"] == "sgd"
    assert not workload.model.fc.weight.detach().equal(before)  # the optimizer stepped
    assert workload.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)


def test_a_tiny_gpt2_trains_on_next_tokens_and_reports_tokens_per_second(tmp_path, capsys):
    argv = ["--model", "hf:gpt2", "--model-config", "n_layer=1,n_embd=32,n_head=2,vocab_size=1000",
            "--seq-len", "16", "--base-batch-size", "1", "--out", str(tmp_path / "plain.json"), *QUICK]
    args = loop.parse_args(argv)
    workload = loop.build(args)
    x, y = workload.make_batch(2, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])  # the targets: the next tokens
    loss = workload.loss(workload.model(x), y)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(1000.0)).item(), rel=0.1)  # a fresh model guesses
    assert loop.main(argv) == 0
    out = _printed(capsys)
    assert out == json.loads((tmp_path / "plain.json").read_text())
    assert out["seq_len"] == 16 and out["batch"] == 4 and out["channels_last"] is False
    assert out["tokens_per_s"] == pytest.approx(out["samples_per_s"] * 16)
    assert out["model_config"] == "n_layer=1,n_embd=32,n_head=2,vocab_size=1000" and out["parameters"] < 200_000


@pytest.mark.slow
def test_the_loop_runs_out_of_memory_above_a_batch_and_reports_what_it_tried(monkeypatch, capsys):
    """The real loop with a loss that runs out of memory above 5 samples, as a GPU would."""
    args = loop.parse_args(["--model", "timm:test_resnet", "--input-shape", "3x16x16", "--num-classes", "10", *QUICK])
    workload = loop.build(args)
    real = workload.loss

    def loss(out, y):
        if y.shape[0] > 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(out, y)

    workload.loss = loss
    monkeypatch.setattr(loop, "build", lambda a: workload)
    assert loop.main(["--model", "timm:test_resnet", "--base-batch-size", "2", *QUICK]) == 0
    out = _printed(capsys)
    # the largest first, then a bisection of the rest
    assert [(t["batch"], t["outcome"]) for t in out["tried"]] == [(8, "oom"), (3, "ok"), (4, "ok"), (6, "oom")]
    assert out["batch"] == 4 and out["samples_per_s"] > 0
    assert all(p.grad is None for p in workload.model.parameters())  # an attempt leaves no gradients behind

    workload.loss = lambda out, y: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory"))
    assert loop.main(["--model", "timm:test_resnet", "--batch-size", "2", *QUICK]) == 1  # nothing fits
    out = _printed(capsys)
    assert out["batch"] is None and out["samples_per_s"] is None and "no batch fitted" in out["error"]


def test_options_that_do_not_apply_are_refused(capsys):
    with pytest.raises(SystemExit):
        loop.parse_args(["--model", "resnet50", "--device", "cpu", "--memory-limit", "24GiB"])
    assert "cap a GPU's memory" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="hf: model"):
        loop.build(loop.parse_args(["--model", "resnet18", "--seq-len", "16", "--device", "cpu"]))
    args = loop.parse_args(["--model", "resnet50", "--device", "cpu"])
    assert args.compile is False and loop.base_batch(args, loop.Workload(None, None, None)) == 16
    args = loop.parse_args(["--model", "resnet50", "--device", "cuda", "--no-compile"])
    assert args.compile is False and loop.base_batch(args, loop.Workload(None, None, None)) == 256
    assert loop.base_batch(args, loop.Workload(None, None, None, tokens_per_sample=1024)) == 16  # 16,384 tokens


@pytest.mark.slow
def test_the_script_compiles_a_tiny_gpt2_on_the_cpu_and_prints_one_json_line(tmp_path):
    """As search_yield.py runs it: a subprocess, torch.compile on (--compile on a CPU)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "plain_recipe_loop.py"), "--model", "hf:gpt2",
                           "--model-config", "n_layer=1,n_embd=32,n_head=2,vocab_size=1000", "--seq-len", "16",
                           "--base-batch-size", "1", "--compile", *QUICK],
                          cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = proc.stdout.splitlines()
    out = json.loads(line)
    assert out["compile"] is True and out["batch"] == 4 and out["tokens_per_s"] > 0
