"""Tuning for DDP on GPUs (issue 8): real 2-rank NCCL trials, a short ``--ddp 2`` search, and its
exported config run by torchrun in user code (figures printed: -s).

    python3 -m pytest -q -s tests/test_gpu_ddp.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import optuna
import pandas as pd
import pytest
import torch

import strategies
from autotune.trial.measure import MeasureSettings
from autotune.trial.runner import run_worker
from autotune.space import SearchSpace
from conftest import run_cli, subprocess_env

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for a 2-rank DDP step")]

SPACE = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[128], base_batch_size=128,
                    memory_formats=["contiguous", "channels_last"], cudnn_benchmark=[False, True],
                    optimizer_implementations=["foreach", "fused"], compile_modes=["off", "default"],
                    ddp_world_size=2, ddp_bucket_caps_mb=[10, 25, 100], ddp_gradient_as_bucket_view=[False, True],
                    ddp_static_graph=[False, True])
WORKLOAD = {"model": "resnet18", "num_classes": 1000, "input_shape": [3, 112, 112]}


def trial(**params) -> dict:
    base = {"precision.mode": "bf16", "memory_format.format": "channels_last", "cudnn.benchmark": True,
            "optimizer.implementation": "fused", "compile.mode": "off", "ddp.bucket_cap_mb": 25,
            "ddp.gradient_as_bucket_view": False, "ddp.static_graph": False}
    base.update(params)
    knobs = strategies.sample(optuna.trial.FixedTrial(base), SPACE)
    request = {"mode": "trial", "space": SPACE.to_dict(), "knobs": strategies.knobs_to_dict(knobs),
               "workload": WORKLOAD, "measure": MeasureSettings.for_device("cuda").to_dict(), "seed": 0}
    result = run_worker(request, timeout_s=900)
    assert result["status"] == "ok", result.get("reason", "") + "\n" + result.get("log_tail", "")
    f = result["figures"]
    print(f"\n  resnet18 bf16 channels_last batch 128/GPU {params}: {f['samples_per_s']:,.0f} samples/s on 2 GPUs, "
          f"{f['per_gpu_samples_per_s']:,.0f} per GPU, one GPU alone {f['single_gpu_samples_per_s']:,.0f}, "
          f"scaling efficiency {f['scaling_efficiency']:.1%}, step {f['step_time_ms']:.1f} ms "
          f"(ranks {[round(x, 1) for x in f['rank_step_time_ms']]}), compile {f['compile_s']:.1f} s, "
          f"trial {result['wall_s']:.0f} s")
    assert f["ddp_world_size"] == 2 and f["samples_per_s"] == pytest.approx(2 * f["per_gpu_samples_per_s"])
    assert 0 < f["scaling_efficiency"] <= 1.5
    # NVML on both GPUs over the timed DDP steps: the group's energy per sample
    e = result["energy"]
    print(f"  NVML: {e['joules_per_sample']:.4f} J/sample, {e['per_gpu_avg_power_w']} W per GPU, "
          f"SM clock {e['avg_sm_clock_mhz']:,.0f} MHz, throttle {e['throttle']}")
    assert e["num_gpus"] == 2 and e["joules_per_sample"] > 0
    assert all(100 < w < 1500 for w in e["per_gpu_avg_power_w"])  # both GPUs busy (an H200 idles near 80 W)
    return f


@pytest.mark.parametrize("params", [
    {},
    {"ddp.bucket_cap_mb": 100, "ddp.gradient_as_bucket_view": True, "ddp.static_graph": True},
], ids=["pytorch-defaults", "one-bucket-views-static"])
def test_two_rank_nccl_trial(params):
    trial(**params)


def test_two_rank_nccl_trial_compiled():
    """torch.compile of the DDP-wrapped model (DDPOptimizer), and of the single-GPU model."""
    f = trial(**{"compile.mode": "default", "ddp.gradient_as_bucket_view": True})
    assert f["compile_s"] > 0 and f["compiled_graphs"] > 0


def test_short_ddp_search_and_torchrun_user_code(tmp_path):
    out = tmp_path / "ddp"
    proc = run_cli("search", "--model", "resnet18", "--input-shape", "3x112x112", "--ddp", "2", "--trials", "5",
                   "--no-compile", "--no-accuracy-check", "--out", str(out), timeout=1200)
    print(proc.stderr[-3000:])
    trials = pd.read_csv(out / "trials.csv")
    done = trials[trials["state"] == "COMPLETE"]
    assert len(done) >= 3 and (done["ddp_world_size"] == 2).all()
    assert ((done["scaling_efficiency"] > 0) & (done["scaling_efficiency"] <= 1.5)).all()
    report = (out / "report.md").read_text()
    assert "**Data parallel (DDP):** 2 processes" in report and "samples/s per GPU" in report
    config = json.loads((out / "config.json").read_text())
    tuned = config["knobs"]["ddp"]

    # the README's user code, launched the way the README says
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import os, torch, torch.distributed as dist, torchvision, autotune
        dist.init_process_group("nccl")
        cfg = autotune.load({str(out / "config.json")!r})
        model = torchvision.models.resnet18()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = cfg.prepare(model, optimizer)
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
        assert model.device_ids == [int(os.environ["LOCAL_RANK"])]
        assert model.bucket_bytes_cap == {tuned["bucket_cap_mb"]} * 1024 * 1024
        step = cfg.train_step(model, optimizer, torch.nn.CrossEntropyLoss())
        for _ in range(5):
            x = torch.randn(cfg.batch_size, 3, 112, 112)
            y = torch.randint(0, 1000, (cfg.batch_size,))
            x, y = next(iter(cfg.loader([(x, y)])))
            loss = step(x, y)
        w = model.module.fc.weight.detach().clone()
        others = [torch.empty_like(w) for _ in range(dist.get_world_size())]
        dist.all_gather(others, w)
        assert all(torch.equal(w, o) for o in others), "DDP replicas diverged"
        print("rank", dist.get_rank(), "loss", float(loss))
        dist.destroy_process_group()
    """))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                         env=subprocess_env(), capture_output=True, text=True, timeout=600)
    print(run.stdout[-2000:])
    assert run.returncode == 0, run.stderr[-8000:]
    assert "rank 0 loss" in run.stdout and "rank 1 loss" in run.stdout
