"""Tuning for DDP (``autotune search --ddp N``) on a CPU: gloo, 2 rank processes, a tiny model.

The knob samples and replays like every knob; the space offers it only with --ddp; a real
2-rank trial reports total and per-GPU throughput and a scaling efficiency; a rank that dies
ends its trial at once as a recorded failure; a --ddp search exports a config that refuses to
run outside a process group and wraps the model in DDP inside one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings

import optuna
import pandas as pd
import pytest
import torch
import torch.distributed as dist
from torch import nn

import autotune
import strategies
from autotune.errors import ConfigError
from autotune.trial.measure import MeasureSettings
from autotune.trial.runner import run_worker
from autotune.space import SearchSpace
from autotune.search import queue
from autotune.search.options import SearchConfig
from autotune.search.seeds import seed_configurations
from autotune.search.space import build_space, check_ddp
from autotune.workload.models import WorkloadSpec
from conftest import run_cli, subprocess_env
from strategies.ddp import DDP

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPEC = WorkloadSpec(model="fake_models:tiny_cnn", num_classes=10, input_shape=(3, 32, 32))
PROBE = {"precisions": ["fp32", "bf16"], "input_dim": 4, "misaligned": {}, "fp32_layer_kinds": []}


def crash_in_ddp_on_rank_1(num_classes: int = 10) -> nn.Module:
    """A tiny CNN whose rank 1 dies (SIGKILL, as the OOM killer or a segfault ends a process) in
    its first DDP forward, while rank 0 waits for it in the gradient all-reduce."""
    from fake_models import tiny_cnn

    class Crash(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_cnn(num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            from torch.nn.parallel import DistributedDataParallel

            if os.environ.get("RANK") == "1" and DistributedDataParallel._get_active_ddp_module() is not None:
                os.kill(os.getpid(), signal.SIGKILL)
            return self.net(x)

    return Crash()


def ddp_space(**overrides) -> SearchSpace:
    values = dict(device="cpu", batch_sizes=[8], base_batch_size=8, thread_counts=[1], ddp_world_size=2,
                  ddp_bucket_caps_mb=[10, 25, 100], ddp_gradient_as_bucket_view=[False, True],
                  ddp_static_graph=[False, True])
    values.update(overrides)
    return SearchSpace(**values)


# the knob ----------------------------------------------------------------------------------------

def test_ddp_knob_samples_applies_and_replays():
    space = ddp_space(compile_modes=["off", "default"])
    seen = set()
    for seed in range(30):
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed)).ask()
        knobs = strategies.sample(trial, space)
        ddp = knobs["ddp"]
        assert ddp.world_size == 2 and ddp.bucket_cap_mb in (10, 25, 100)
        if knobs["compile"].mode != "off":  # pytorch/pytorch#93672: no static graph under torch.compile
            assert ddp.static_graph is False and "ddp.static_graph" not in trial.params
        seen.add((ddp.bucket_cap_mb, ddp.gradient_as_bucket_view, ddp.static_graph))
        replayed = strategies.sample(optuna.trial.FixedTrial(dict(trial.params)), space)
        assert replayed == knobs
        recipe = strategies.build_recipe(knobs, "cpu")
        assert recipe.ddp == {"bucket_cap_mb": ddp.bucket_cap_mb, "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
                              "static_graph": ddp.static_graph}
        assert recipe.ddp_world_size == 2
    assert len(seen) >= 6  # every setting is really searched


def test_without_ddp_the_knob_is_absent_and_untuned():
    space = SearchSpace(device="cpu", batch_sizes=[8], base_batch_size=8)
    trial = optuna.create_study().ask()
    knobs = strategies.sample(trial, space)
    assert knobs["ddp"] == DDP.Config() and knobs["ddp"].world_size == 1
    assert not [p for p in trial.params if p.startswith("ddp.")]
    assert strategies.build_recipe(knobs, "cpu").ddp is None
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDP.Config(world_size=2, bucket_cap_mb=0)


def test_space_has_ddp_choices_only_with_ddp():
    plain = build_space(SearchConfig(workload=SPEC, device="cpu", accuracy_check=False), "cpu", PROBE)
    assert plain.ddp_world_size == 1 and plain.ddp_bucket_caps_mb == [25]
    assert plain.ddp_gradient_as_bucket_view == [False] and plain.ddp_static_graph == [False]
    ddp = build_space(SearchConfig(workload=SPEC, device="cpu", accuracy_check=False, ddp=2), "cpu", PROBE)
    assert ddp.ddp_world_size == 2 and len(ddp.ddp_bucket_caps_mb) > 1 and 25 in ddp.ddp_bucket_caps_mb
    assert ddp.ddp_gradient_as_bucket_view == [False, True] and ddp.ddp_static_graph == [False, True]
    cuda = build_space(SearchConfig(workload=SPEC, device="cpu", accuracy_check=False, ddp=2, compile=False),
                       "cuda", PROBE)
    assert cuda.cuda_graphs == [False]  # whole-step capture is refused under DDP
    # the baseline is DDP as a user builds it: PyTorch's defaults
    role, baseline = seed_configurations(ddp)[0]
    assert role == "baseline"
    assert baseline["ddp.bucket_cap_mb"] == 25 and baseline["ddp.gradient_as_bucket_view"] is False
    assert baseline["ddp.static_graph"] is False


def test_bad_ddp_options_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match="at least 2"):
        SearchConfig(workload=SPEC, device="cpu", ddp=1)
    with pytest.raises(ConfigError, match="--gpus"):
        SearchConfig(workload=SPEC, device="cuda", ddp=2, gpus="0,1")
    SearchConfig(workload=SPEC, device="cuda", ddp=2, objective="energy")  # every rank samples NVML
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="sees 1 CUDA GPU here; give --ddp 1 or less"):
        check_ddp(SearchConfig(workload=SPEC, device="cuda", ddp=2), "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(ConfigError, match="NCCL"):
        check_ddp(SearchConfig(workload=SPEC, device="cuda", ddp=2), "cuda")


def test_the_groups_energy_is_every_gpus_energy_over_every_gpus_samples():
    from autotune.trial.ddp_rank import combine_energy

    def window(energy_j, power, clock, temp, cap):
        return {"duration_s": 2.0, "energy_j": energy_j, "energy_source": "energy counter", "avg_power_w": power,
                "peak_power_w": power + 20, "avg_sm_clock_mhz": clock, "min_sm_clock_mhz": clock - 100,
                "avg_mem_clock_mhz": 3200.0, "max_temperature_c": temp, "avg_gpu_util_pct": 99.0,
                "avg_mem_util_pct": 60.0, "peak_memory_used_bytes": 10 * 2**30, "num_samples": 40,
                "throttle": {"power_cap": cap}, "throttled": cap >= 0.05, "unsupported": {}}

    e = combine_energy([window(1300.0, 650.0, 1800.0, 60.0, 0.0), window(1380.0, 690.0, 1700.0, 66.0, 0.8)],
                       samples=2 * 20 * 512)
    assert e["energy_j"] == 2680.0 and e["joules_per_sample"] == pytest.approx(2680.0 / 20480)
    assert e["avg_power_w"] == 670.0 and e["per_gpu_avg_power_w"] == [650.0, 690.0] and e["peak_power_w"] == 710.0
    assert e["avg_sm_clock_mhz"] == 1750.0 and e["min_sm_clock_mhz"] == 1600.0 and e["max_temperature_c"] == 66.0
    assert e["throttle"] == {"power_cap": 0.8} and e["throttled"] and e["num_gpus"] == 2
    # one GPU without a window (no NVML there): no group figure rather than half of it
    assert combine_energy([window(1300.0, 650.0, 1800.0, 60.0, 0.0), None], samples=100) is None
    no_counter = window(None, 650.0, 1800.0, 60.0, 0.0)
    assert combine_energy([no_counter, no_counter], samples=100)["joules_per_sample"] is None


# real rank processes ----------------------------------------------------------------------------

def _request(model: str, params: dict) -> dict:
    space = ddp_space()
    knobs = strategies.sample(optuna.trial.FixedTrial(params), space)
    settings = MeasureSettings(**{**MeasureSettings.for_device("cpu").to_dict(), "min_time_s": 0.2})
    return {"mode": "trial", "space": space.to_dict(), "knobs": strategies.knobs_to_dict(knobs),
            "workload": {**SPEC.to_dict(), "model": model}, "measure": settings.to_dict(), "seed": 0}


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_trial_at_once(tmp_path):
    request = _request("test_ddp:crash_in_ddp_on_rank_1",
                       {"ddp.bucket_cap_mb": 25, "ddp.gradient_as_bucket_view": False, "ddp.static_graph": False})
    started = time.time()
    # rank 0 would wait in its all-reduce for 10 minutes (gloo's timeout): it is killed instead
    result = run_worker(request, timeout_s=120, log_path=tmp_path / "trial.log")
    assert result["status"] == "crashed", result
    assert result["reason"].startswith("DDP rank 1 of 2: worker was killed by signal 9")
    assert time.time() - started < 60
    log = (tmp_path / "trial.log").read_text()
    assert "==== rank 0 ====" in log and "==== rank 1 ====" in log


# a whole --ddp search, and its exported config ----------------------------------------------------

@pytest.fixture(scope="module")
def ddp_search(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "out"
    proc = run_cli("search", "--model", "fake_models:tiny_cnn", "--device", "cpu", "--input-shape", "3x32x32",
                   "--num-classes", "10", "--min-measure-time", "0.2", "--batch-size", "8", "--ddp", "2",
                   "--trials", "2", "--no-accuracy-check", "--out", str(out))
    return out, proc


@pytest.mark.slow
def test_ddp_search_reports_per_gpu_throughput_and_scaling_efficiency(ddp_search):
    out, proc = ddp_search
    said = " ".join(proc.stderr.split())  # rich wraps long lines
    assert "DDP: 2 processes per trial" in said
    assert "per process, scaling efficiency" in said and "one GPU alone:" in said
    trials = pd.read_csv(out / "trials.csv")
    trials = trials[trials["state"] == "COMPLETE"]
    assert len(trials) == 2
    # a trial that scaled below 90% put DDP's own settings forward (the ddp-scaling finding): a candidate left
    # in the study's queue when its 2 trials were done (autotune.search.queue)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    steered = [str(t.user_attrs.get("steered_by")) for t in queue.queued(study)]
    assert (trials["scaling_efficiency"] < 0.9).any() == any("ddp-scaling" in s for s in steered)
    for _, row in trials.iterrows():
        assert row["ddp_world_size"] == 2
        assert row["samples_per_s"] == pytest.approx(2 * row["per_gpu_samples_per_s"])
        assert 0 < row["scaling_efficiency"] <= 1.5
        assert row["scaling_efficiency"] == pytest.approx(row["per_gpu_samples_per_s"] / row["single_gpu_samples_per_s"])
        assert "DDP x2, bucket" in row["config"]
    # the study's objective is the total throughput
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    for t in study.get_trials(states=[optuna.trial.TrialState.COMPLETE]):
        assert t.value == pytest.approx(t.user_attrs["figures"]["samples_per_s"])
        assert t.user_attrs["figures"]["batch_size"] == 8 and t.user_attrs["figures"]["global_batch_size"] == 16
    assert study.trials[0].user_attrs["knobs"]["ddp"] == {"world_size": 2, "bucket_cap_mb": 25,
                                                         "gradient_as_bucket_view": False, "static_graph": False}
    report = (out / "report.md").read_text()
    assert "**Data parallel (DDP):** 2 processes on the CPU" in report and "scaling efficiency is" in report
    assert "samples/s per GPU | scaling efficiency" in report
    html = (out / "report.html").read_text()
    assert "scaling efficiency" in html


@pytest.mark.slow
def test_the_reports_ddp_snippet_trains_under_torchrun(ddp_search, tmp_path):
    """The report's training loop for a --ddp config, run as it says: torchrun, one process group."""
    out, _ = ddp_search
    report = (out / "report.md").read_text()
    snippet = report.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'dist.init_process_group("gloo")  # launch: torchrun --nproc-per-node 2 train.py' in snippet
    assert "DistributedSampler(dataset)" in snippet and "shuffle=True" not in snippet
    script = tmp_path / "train.py"
    script.write_text("import torch\n"
                      "dataset = torch.utils.data.TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))\n"
                      + snippet + 'print("rank", dist.get_rank(), "loss", float(loss))\n')
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                         env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-6000:]
    assert "rank 0 loss" in run.stdout and "rank 1 loss" in run.stdout


@pytest.mark.slow
def test_ddp_study_is_not_resumed_without_ddp(ddp_search, tmp_path):
    out, _ = ddp_search
    (name,) = optuna.get_all_study_names(f"sqlite:///{out / 'study.db'}")
    assert name.endswith("-cpu-ddp2")  # by default a --ddp study has a name (and folder) of its own
    before = len(optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'study.db'}").trials)
    proc = run_cli("search", "--model", "fake_models:tiny_cnn", "--device", "cpu", "--input-shape", "3x32x32",
                   "--num-classes", "10", "--batch-size", "8", "--trials", "3", "--no-accuracy-check",
                   "--storage", f"sqlite:///{out / 'study.db'}", "--study-name", name, "--out", str(tmp_path / "other"),
                   check=False)
    assert proc.returncode != 0
    said = " ".join(proc.stderr.split())  # rich wraps long lines
    assert "holds 2-process DDP measurements and this search measures single-process" in said
    assert "Resume it with --ddp 2" in said
    assert len(optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'study.db'}").trials) == before


@pytest.mark.slow
def test_exported_ddp_config_needs_a_process_group(ddp_search):
    out, _ = ddp_search
    cfg = autotune.load(out / "config.json")
    assert cfg.recipe.ddp_world_size == 2 and cfg.recipe.ddp is not None
    from fake_models import tiny_cnn

    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2"):
        cfg.prepare(tiny_cnn(10))


@pytest.mark.slow
def test_exported_ddp_config_wraps_the_model_in_a_process_group(ddp_search, restore_backend_flags):
    out, _ = ddp_search
    cfg = autotune.load(out / "config.json")
    from fake_models import tiny_cnn

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = tiny_cnn(10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        with pytest.warns(UserWarning, match="measured with 2 DDP processes and runs with 1"):
            prepared, optimizer = cfg.prepare(model, optimizer)
        assert isinstance(prepared, nn.parallel.DistributedDataParallel) and prepared.module is model
        tuned = cfg.knobs["ddp"]
        assert prepared.bucket_bytes_cap == tuned.bucket_cap_mb * 1024 * 1024
        assert prepared.gradient_as_bucket_view == tuned.gradient_as_bucket_view
        assert prepared.static_graph == tuned.static_graph
        step = cfg.train_step(prepared, optimizer, nn.CrossEntropyLoss())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses = [float(step(torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))) for _ in range(3)]
        assert all(torch.isfinite(torch.tensor(losses)))
    finally:
        dist.destroy_process_group()
