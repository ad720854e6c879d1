"""Issue 3 on a GPU: every trial carries its NVML window and profile, the Chrome trace is written,
and a search keeps the baseline's and the best's traces.

    python3 -m pytest -q -s tests/test_gpu_profile.py
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

import strategies
from autotune.trial.measure import MeasureSettings
from autotune.trial.runner import run_worker
from autotune.space import SearchSpace
from conftest import run_cli

pytestmark = pytest.mark.gpu

SPACE = SearchSpace(device="cuda", precisions=["fp32", "fp16", "bf16"], batch_sizes=[64], base_batch_size=64,
                    memory_formats=["contiguous", "channels_last"], stream_counts=[1, 2], cudnn_benchmark=[True])


def test_a_trial_carries_energy_profile_and_its_trace(tmp_path):
    import optuna

    knobs = strategies.sample(optuna.trial.FixedTrial({"precision.mode": "bf16", "memory_format.format": "contiguous",
                                                       "streams.num_streams": 1}), SPACE)
    trace = tmp_path / "trace-0001.json"
    result = run_worker({"mode": "trial", "space": SPACE.to_dict(), "knobs": strategies.knobs_to_dict(knobs),
                         "workload": {"model": "resnet18", "input_shape": [3, 64, 64], "num_classes": 10},
                         "measure": MeasureSettings(min_steps=20, min_time_s=1.0).to_dict(), "seed": 0,
                         "profile": True, "trace_path": str(trace)}, timeout_s=300)
    assert result["status"] == "ok", result.get("reason") or result.get("log_tail")
    energy, profile, figures = result["energy"], result["profile"], result["figures"]
    print(f"\nenergy {energy['joules_per_sample']:.4f} J/sample at {energy['avg_power_w']:.0f} W, "
          f"SM {energy['avg_sm_clock_mhz']:.0f} MHz; profile {json.dumps({k: round(v, 3) for k, v in profile.items() if k.endswith('share')})}")
    assert energy["energy_j"] > 0 and energy["joules_per_sample"] > 0 and energy["num_samples"] > 5
    assert abs(energy["duration_s"] - figures["measure_s"]) < 0.5 * figures["measure_s"] + 0.2
    assert profile["timed"] and profile["kernels_per_step"] > 50 and profile["tensor_core_share"] > 0
    assert 0 <= profile["idle_share"] < 1 and profile["top_kernels"]
    assert (tmp_path / "trace-0001.json.gz").exists() and not trace.exists()
    assert figures["profile_s"] > 0  # timed apart: never part of warm-up or measuring


def test_a_search_records_findings_and_keeps_two_traces(tmp_path):
    out = tmp_path / "out"
    run_cli("search", "--model", "resnet18", "--device", "cuda", "--input-shape", "3x64x64", "--num-classes", "10",
            "--trials", "4", "--min-measure-time", "0.5", "--max-batch-size", "128", "--no-compile",
            "--early-stop-below", "0",  # its assertions count completed trials: none stopped early
            "--no-accuracy-check", "--out", str(out), timeout=900)
    assert (out / "trace-baseline.json.gz").exists() and (out / "trace-best.json.gz").exists()
    trials = pd.read_csv(out / "trials.csv")
    assert (trials["state"] == "COMPLETE").sum() >= 3
    import optuna

    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert all("profile" in t.user_attrs and "energy" in t.user_attrs for t in done)
    baseline = next(t for t in done if t.user_attrs.get("role") == "baseline")
    print("\nbaseline findings:", baseline.user_attrs.get("findings"))
    assert baseline.user_attrs.get("findings")  # true FP32 at least runs without Tensor Cores
    assert "Findings" in (out / "report.md").read_text() or "findings" in (out / "report.html").read_text()


def test_a_profile_window_that_fails_costs_only_the_explanation(tmp_path):
    import optuna

    knobs = strategies.sample(optuna.trial.FixedTrial({"precision.mode": "fp16", "memory_format.format": "contiguous",
                                                       "streams.num_streams": 1, "grad_scaler.init_scale": 2.0**16,
                                                       "grad_scaler.growth_factor": 2.0,
                                                       "grad_scaler.backoff_factor": 0.5,
                                                       "grad_scaler.growth_interval": 2000}), SPACE)
    result = run_worker({"mode": "trial", "space": SPACE.to_dict(), "knobs": strategies.knobs_to_dict(knobs),
                         "workload": {"model": "resnet18", "input_shape": [3, 64, 64], "num_classes": 10},
                         "measure": MeasureSettings(min_steps=10, min_time_s=0.3).to_dict(), "seed": 0,
                         "profile": True, "profile_steps": -1}, timeout_s=300)
    assert result["status"] == "ok" and result["figures"]["samples_per_s"] > 0
    assert "profile" not in result and result["profile_error"]
