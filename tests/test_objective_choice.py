"""--objective throughput|energy|memory: the study's direction and each trial's value, energy
refused without NVML before any trial, a resumed study kept to its own objective, and the best
configuration (best_trial, config.json, report, compare) ranked by the objective chosen."""

from __future__ import annotations

import json

import optuna
import pytest

import autotune.search.objective
import autotune.cli.run
from autotune.errors import ConfigError
from autotune.search.goal import GOALS, OBJECTIVE_ATTR, goal, goal_of, goal_of_config, nvml_refusal
from autotune.search.storage import open_storage
from autotune.search.options import SearchConfig
from autotune.cli.run import run_search
from autotune.search.study import open_study
from autotune.search.trials import best_trial
from autotune.workload.models import WorkloadSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)
SPEC = WorkloadSpec(model="resnet18", num_classes=10)


def test_each_objective_has_its_direction_and_value():
    figures = {"samples_per_s": 1200.0, "peak_memory_bytes": 3 * 2**30}
    energy = {"joules_per_sample": 0.25}
    assert (goal("throughput").direction, goal("throughput").value(figures, energy)) == ("maximize", 1200.0)
    assert (goal("energy").direction, goal("energy").value(figures, energy)) == ("minimize", 0.25)
    assert (goal("memory").direction, goal("memory").value(figures, energy)) == ("minimize", 3 * 2**30)
    assert goal("energy").value(figures, None) is None  # not measured: no value, never a made-up one
    assert goal(None) is GOALS["throughput"]
    with pytest.raises(ConfigError, match="choose throughput"):
        goal("speed")
    with pytest.raises(ConfigError, match="choose throughput"):
        SearchConfig(workload=SPEC, objective="latency")


def test_a_config_json_without_an_objective_meant_throughput():
    assert goal_of_config({}).name == "throughput"
    assert goal_of_config({"objective": {"name": "memory"}}).name == "memory"


@pytest.mark.parametrize("name", ["throughput", "energy", "memory"])
def test_the_study_is_created_for_the_objective(tmp_path, name):
    study = open_study(open_storage(f"sqlite:///{tmp_path / 'study.db'}"), "s", 0, name)
    assert study.direction.name.lower() == GOALS[name].direction
    assert study.user_attrs[OBJECTIVE_ATTR] == name and goal_of(study).name == name


def test_resuming_with_another_objective_is_refused(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path / 'study.db'}")
    study = open_study(storage, "s", 0, "memory")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    assert open_study(storage, "s", 1, "memory").direction == optuna.study.StudyDirection.MINIMIZE
    with pytest.raises(ConfigError, match="created with --objective memory.*Resume it with --objective memory"):
        open_study(storage, "s", 1, "throughput")


def test_a_study_older_than_the_option_is_a_throughput_study(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path / 'study.db'}")
    old = optuna.create_study(storage=storage, study_name="old", direction="maximize")
    old.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    assert goal_of(open_study(storage, "old", 0, "throughput")).name == "throughput"
    with pytest.raises(ConfigError, match="created with --objective throughput"):
        open_study(storage, "old", 0, "energy")


def test_energy_is_refused_without_nvml_before_any_trial(tmp_path, monkeypatch):
    def no_worker(*args, **kwargs):
        raise AssertionError("no worker may start")

    monkeypatch.setattr(autotune.search.objective, "run_worker", no_worker)
    monkeypatch.setattr(autotune.cli.run, "probe", no_worker)
    # a CPU search: refused before even the probe
    with pytest.raises(ConfigError, match="NVML.*use --objective throughput or --objective memory"):
        run_search(SearchConfig(workload=SPEC, device="cpu", out_dir=tmp_path / "cpu", trials=2,
                                accuracy_check=False, objective="energy"))
    # a GPU whose driver has no usable NVML: refused after the probe says so
    monkeypatch.setattr(autotune.cli.run, "resolve_device", lambda requested: "cuda")
    monkeypatch.setattr(autotune.cli.run, "probe", lambda config, device, list_devices=False, spare=False: {
        "provenance": {"gpu": "Test GPU"}, "precisions": ["fp32"],
        "nvml": {"available": False, "reason": "NVML Shared Library Not Found"}})
    with pytest.raises(ConfigError, match="NVML Shared Library Not Found.*nvidia-ml-py"):
        run_search(SearchConfig(workload=SPEC, device="cuda", out_dir=tmp_path / "gpu", trials=2,
                                accuracy_check=False, objective="energy"))
    assert not (tmp_path / "gpu" / "study.db").exists()
    assert nvml_refusal("cuda", {"available": True}) is None


# a search whose worker is replaced by figures that depend on the batch size: larger batches are
# faster, use more memory and less energy per sample ---------------------------------------------


def fake_probe(config, device, list_devices=False, spare=False):
    return {"status": "ok", "provenance": {"torch": "test", "num_cpus": 2}, "precisions": ["fp32"], "input_dim": 2,
            "input_shape": [8], "num_parameters": 10}


def fake_worker(request, timeout_s=None, log_path=None, spare=False, on_progress=None):
    knobs = request["knobs"]
    batch = knobs["batch_size"]["batch_size"]
    rate = 100.0 * batch
    figures = {"samples_per_s": rate, "step_time_ms": batch * 1e3 / rate, "peak_memory_bytes": batch * 2**20,
               "spread": 0.01, "warmup_s": 0.0, "measure_s": 0.1, "build_s": 0.0, "loss_finite": True,
               "final_loss": 1.0}
    return {"status": "ok", "figures": figures, "knobs": knobs, "wall_s": 0.1, "worker_start_s": 0.0,
            "energy": {"joules_per_sample": 1.0 / batch, "avg_power_w": 100.0}}


def fake_search(tmp_path, monkeypatch, objective: str):
    monkeypatch.setattr(autotune.search.objective, "run_worker", fake_worker)
    device = "cuda" if objective == "energy" else "cpu"  # the energy objective needs a GPU with NVML
    monkeypatch.setattr(autotune.cli.run, "resolve_device", lambda requested: device)
    monkeypatch.setattr(autotune.cli.run, "probe", lambda config, device, list_devices=False, spare=False: {
        **fake_probe(config, device), "nvml": {"available": True, "reason": ""}})
    config = SearchConfig(workload=SPEC, device=device, out_dir=tmp_path / objective, trials=6, min_batch_size=4,
                          max_batch_size=32, base_batch_size=16, accuracy_check=False, objective=objective, seed=0,
                          compile=False)
    return run_search(config)


FIGURE = {"throughput": lambda t: t.user_attrs["figures"]["samples_per_s"],
          "memory": lambda t: t.user_attrs["figures"]["peak_memory_bytes"],
          "energy": lambda t: t.user_attrs["energy"]["joules_per_sample"]}


@pytest.mark.slow  # a whole run_search (probe and workers faked): ~10 s on 2 cores
@pytest.mark.parametrize("objective", ["throughput", "memory", "energy"])
def test_the_best_and_the_export_rank_by_the_objective(tmp_path, monkeypatch, objective):
    result = fake_search(tmp_path, monkeypatch, objective)
    study = result.study
    measured = [t for t in study.trials if t.value is not None]
    batches = {t.user_attrs["knobs"]["batch_size"]["batch_size"] for t in measured}
    assert len(batches) >= 2, batches  # else the ranking says nothing
    # each trial's value is the objective's figure
    assert all(t.value == FIGURE[objective](t) for t in measured)
    best = best_trial(study)
    # larger batches: faster, and less energy per sample, but more memory
    best_batch = min(batches) if objective == "memory" else max(batches)
    assert best.user_attrs["knobs"]["batch_size"]["batch_size"] == best_batch
    exported = json.loads((result.out_dir / "config.json").read_text())
    assert exported["objective"]["name"] == objective and exported["objective"]["value"] == best.value
    assert exported["study"]["trial_number"] == best.number
    # the FP32 baseline and the speed-up lines stay
    assert exported["baseline"] is not None and "speedup_vs_baseline" in exported
    report = (result.out_dir / "report.md").read_text()
    assert f"**Objective:** {objective} (" in report
    top = report.split("## Top 10 configurations")[1].split("##")[0]
    first_row = [line for line in top.splitlines() if line.startswith("| 1 |")][0]
    assert f"batch {best_batch}" in first_row


@pytest.mark.slow
def test_compare_says_which_objective_each_run_used(tmp_path, monkeypatch):
    from autotune.report.compare import compare

    a = fake_search(tmp_path, monkeypatch, "throughput").out_dir
    b = fake_search(tmp_path, monkeypatch, "memory").out_dir
    result = compare([a, b], tmp_path / "cmp")
    md = result.markdown.read_text()
    assert "| objective | throughput: 3,200 samples/s | memory: 0.00 GiB |" in md
    assert "the runs optimized different objectives (throughput, memory)" in md
