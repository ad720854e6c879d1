"""GPU tests: run on the GPU machine with `pytest -m gpu` (skipped where there is no CUDA)."""

from __future__ import annotations

import copy
import json

import pandas as pd
import pytest
import torch

import strategies
from autotune.deploy.config import TunedConfig
from autotune.trial.measure import MeasureSettings
from autotune.recipe import BACKEND_FLAGS, backend_flags
from autotune.trial import runner
from autotune.trial.runner import run_worker
from autotune.space import SearchSpace
from conftest import run_cli, wait_ready
from strategies.channel_alignment import align_channels
from strategies.streams import device_batches

pytestmark = pytest.mark.gpu

SPACE = SearchSpace(device="cuda", precisions=["fp32", "tf32", "fp16", "bf16"], batch_sizes=[8, 16],
                    base_batch_size=8, alignments=[1, 8], memory_formats=["contiguous", "channels_last"],
                    stream_counts=[1, 2], cudnn_benchmark=[False, True])


def _cfg(**params):
    full = {"precision.mode": "fp32", "batch_size.batch_size": 8, "channel_alignment.multiple": 1,
            "memory_format.format": "contiguous", "cudnn.benchmark": False, "streams.num_streams": 1}
    full.update(params)
    if full["precision.mode"] == "fp16":
        full.update({"grad_scaler.init_scale": 2.0**16, "grad_scaler.growth_factor": 2.0,
                     "grad_scaler.backoff_factor": 0.5, "grad_scaler.growth_interval": 2000})
    return TunedConfig.from_params(full, SPACE)


def test_precision_modes_reach_the_kernels():
    x = torch.randn(64, 256, device="cuda")
    layer = torch.nn.Linear(256, 256).cuda()
    for mode, dtype in [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)]:
        cfg = _cfg(**{"precision.mode": mode})
        with cfg.backend_flags(), cfg.autocast():
            assert layer(x).dtype == dtype
    fp32 = _cfg(**{"precision.mode": "fp32"})
    with fp32.backend_flags():
        # true FP32: PyTorch would otherwise let cuDNN use TF32 for convolutions
        assert BACKEND_FLAGS["conv_fp32_precision"][0]() == "ieee"
        assert BACKEND_FLAGS["matmul_fp32_precision"][0]() == "ieee"
    with _cfg(**{"precision.mode": "tf32"}).backend_flags():
        assert BACKEND_FLAGS["matmul_fp32_precision"][0]() == "tf32"
    assert _cfg(**{"precision.mode": "fp16"}).grad_scaler().is_enabled()
    assert not _cfg(**{"precision.mode": "bf16"}).grad_scaler().is_enabled()


def test_backend_flags_are_restored_on_cuda():
    before = {name: get() for name, (get, _) in BACKEND_FLAGS.items()}
    with backend_flags({"cudnn_benchmark": not before["cudnn_benchmark"], "matmul_fp32_precision": "tf32",
                        "conv_fp32_precision": "ieee"}):
        assert torch.backends.cudnn.benchmark is (not before["cudnn_benchmark"])
    assert {name: get() for name, (get, _) in BACKEND_FLAGS.items()} == before


@pytest.mark.parametrize("num_streams", [1, 2])
def test_stream_prefetch_delivers_every_batch_intact(num_streams):
    # a race between the side-stream copy and the compute stream would corrupt these sums
    host = [(torch.full((256, 3, 64, 64), float(i)).pin_memory(), torch.tensor([i])) for i in range(20)]
    conv = torch.nn.Conv2d(3, 64, 3).cuda().to(memory_format=torch.channels_last)
    seen = []
    for x, y in device_batches(host, "cuda", num_streams=num_streams, memory_format=torch.channels_last):
        assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last)
        conv(x).sum()  # keep the compute stream busy while the next copy is in flight
        seen.append((x.mean().item(), y.item()))
    assert seen == [(float(i), i) for i in range(20)]


def test_padding_keeps_the_function_under_fp16():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1001, 4097), torch.nn.ReLU(), torch.nn.Linear(4097, 10)).cuda()
    padded = align_channels(copy.deepcopy(model), 8)
    x = torch.randn(64, 1001, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        torch.testing.assert_close(padded(x), model(x), rtol=2e-3, atol=2e-3)


def test_trial_measures_on_cuda_with_memory_outside_the_allocator():
    knobs = strategies.knobs_to_dict(_cfg(**{"precision.mode": "bf16", "memory_format.format": "channels_last",
                                             "cudnn.benchmark": True, "streams.num_streams": 2}).knobs)
    settings = MeasureSettings(min_warmup_steps=3, max_warmup_s=10, min_steps=10, min_time_s=0.5)
    result = run_worker({"mode": "trial", "space": SPACE.to_dict(), "knobs": knobs, "seed": 0,
                         "workload": {"model": "resnet18", "input_shape": [3, 64, 64], "num_classes": 10},
                         "measure": settings.to_dict()}, timeout_s=300)
    assert result["status"] == "ok", result
    f = result["figures"]
    assert f["samples_per_s"] > 0 and f["num_steps"] >= 10
    assert f["outside_allocator_bytes"] > 0  # the CUDA context is real memory the GPU needs
    assert f["peak_memory_bytes"] >= f["peak_reserved_bytes"] >= f["peak_allocated_bytes"] > 0


def test_a_spare_for_a_gpu_trial_has_its_model_imported_and_cuda_context_made_before_the_request():
    knobs = strategies.knobs_to_dict(_cfg(**{"precision.mode": "bf16", "memory_format.format": "channels_last"}).knobs)
    settings = MeasureSettings(min_warmup_steps=3, max_warmup_s=10, min_steps=10, min_time_s=0.5)
    request = {"mode": "trial", "space": SPACE.to_dict(), "knobs": knobs, "seed": 0,
               "workload": {"model": "resnet18", "input_shape": [3, 64, 64], "num_classes": 10},
               "measure": settings.to_dict(), "profile": False}
    try:
        first = run_worker(request, timeout_s=300, spare=True)
        (spare,) = runner._spares.values()
        wait_ready(spare)
        second = run_worker(request, timeout_s=300)
    finally:
        runner.discard_spares()
    assert first["status"] == second["status"] == "ok", (first, second)
    assert second["pid"] == spare.proc.pid
    assert first["preloaded"] == second["preloaded"] == ["torchvision", "torch._dynamo", "torch._inductor", "cuda"]
    # the spare did all of it while the first trial ran: the second waited for nothing
    assert first["worker_start_s"] > 1.0 and second["worker_start_s"] < 0.5, (first["worker_start_s"],
                                                                             second["worker_start_s"])
    # the context made ahead holds no allocator memory: both measure the same peak
    a, b = first["figures"], second["figures"]
    assert b["peak_allocated_bytes"] == pytest.approx(a["peak_allocated_bytes"], rel=0.05)
    assert b["outside_allocator_bytes"] > 0


def test_a_real_out_of_memory_is_reported_as_does_not_fit():
    knobs = strategies.knobs_to_dict(_cfg().knobs)
    knobs["batch_size"]["batch_size"] = 32768  # about 3 TB of fp32 ResNet-50 activations
    result = run_worker({"mode": "trial", "space": SPACE.to_dict(), "knobs": knobs, "seed": 0,
                         "input_on_device": True,
                         "workload": {"model": "resnet50", "input_shape": [3, 224, 224], "num_classes": 1000},
                         "measure": MeasureSettings().to_dict()}, timeout_s=300)
    assert result["status"] == "oom", result


def test_gpu_search_isolates_a_sticky_cuda_error_and_exports(tmp_path):
    out = tmp_path / "out"
    run_cli("search", "--model", "fake_models:device_assert_under_autocast", "--device", "cuda",
            "--input-shape", "3x32x32", "--num-classes", "10", "--trials", "8", "--min-measure-time", "0.3",
            "--max-batch-size", "256", "--no-compile", "--no-accuracy-check",
            "--early-stop-below", "0",  # its assertions count completed trials: none stopped early
            "--out", str(out))
    trials = pd.read_csv(out / "trials.csv")
    amp = trials[trials["param.precision.mode"].isin(["fp16", "bf16"])]
    assert len(amp) >= 1 and (amp["state"] == "FAIL").all()
    # every trial after a device-side assert got a healthy worker
    later_fp32 = trials[(trials["param.precision.mode"].isin(["fp32", "tf32"]))]
    assert (later_fp32["state"] == "COMPLETE").all() and len(later_fp32) >= 1
    assert later_fp32["number"].max() > amp["number"].min()
    data = json.loads((out / "config.json").read_text())
    assert data["provenance"]["gpu"] and data["provenance"]["cudnn"]


def test_exported_gpu_config_trains_through_load(tmp_path):
    out = tmp_path / "out"
    run_cli("search", "--model", "fake_models:odd_widths", "--device", "cuda", "--input-shape", "3x8x8",
            "--num-classes", "10", "--trials", "5", "--min-measure-time", "0.3", "--out", str(out))
    cfg = TunedConfig.load(out)
    import fake_models

    torch.manual_seed(0)
    model = fake_models.odd_widths(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.scaled_lr(0.01), momentum=0.9)
    model, optimizer = cfg.prepare(model, optimizer)
    step = cfg.train_step(model, optimizer, torch.nn.CrossEntropyLoss())
    x, y = torch.randn(cfg.batch_size, 3, 8, 8).pin_memory(), torch.randint(0, 10, (cfg.batch_size,)).pin_memory()
    losses = [step(xb, yb).item() for xb, yb in cfg.loader([(x, y)] * 20)]
    assert losses[-1] < losses[0]
