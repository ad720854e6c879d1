"""`autotune verify --memory-knobs`: each memory knob of a configuration turned off in turn, at the same
batch, measured alternately with the configuration as exported: what each bought in speed and peak
memory, paired (issue 36), written beside config.json for the report."""

from __future__ import annotations

import json

import pytest

from autotune.deploy.config import TunedConfig
from autotune.space import SearchSpace
from autotune.search.verify import MEMORY_KNOB_PAIRS
from autotune.search import plain_recipe, verify
from autotune.search.steering import complete_params

GIB = 2**30
SPACE = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[1, 2, 4, 8, 16], base_batch_size=16,
                    memory_formats=["contiguous"], compile_modes=["off", "default"],
                    optimizer_implementations=["foreach", "fused"], cuda_graphs=[False], stream_counts=[1],
                    choices={"optimizer_state": ["full", "8bit", "8bit-bnb"], "activation_checkpointing": [0, 1, 2],
                             "loss_kernel": ["framework", "fused_linear"]})
INFO = {"workload": {"model": "hf:llama"}, "figures": {"samples_per_s": 50.0},
        "memory": {"limit_bytes": 24 * GIB}, "units": {"sample_unit": "sequence", "tokens_per_sample": 1024}}


def _config(tmp_path, **changes):
    params = complete_params({**plain_recipe.params(SPACE, 16), **changes}, SPACE)
    path = tmp_path / "config.json"
    TunedConfig.from_params(params, SPACE, info=INFO).save(path)
    return path


def test_each_memory_knob_is_turned_off_alone_and_what_it_brings_back_is_the_plain_recipes(tmp_path):
    path = _config(tmp_path, **{"optimizer_state.state": "8bit-bnb", "activation_checkpointing.every": 1})
    cfg = TunedConfig.load(path, here=False)
    assert verify.memory_knob_changes(cfg) == [
        # 8-bit states off: the optimizer's implementation comes back, as the plain recipe runs it
        ("optimizer_state.state=8bit-bnb", {"optimizer_state.state": "full", "optimizer.implementation": "fused"}),
        ("activation_checkpointing.every=1", {"activation_checkpointing.every": 0}),
    ]
    assert verify.memory_knob_changes(TunedConfig.load(_config(tmp_path), here=False)) == []


def test_the_pairs_say_speed_and_memory_with_and_without_each_knob_and_are_kept_beside_the_config(tmp_path, monkeypatch):
    """The workers scripted: the exported configuration (8-bit states, every block checkpointed, batch 16)
    at 50 sequences/s and 18 GiB; without checkpointing 58/s at 31 GiB (over the 24 GiB the search had);
    without 8-bit states it does not fit the card."""
    path = _config(tmp_path, **{"optimizer_state.state": "8bit-bnb", "activation_checkpointing.every": 1})
    order = []

    def worker(request, *, timeout_s):
        params = json.loads(open(request["config_path"]).read())["params"]
        arm = ("exported" if params.get("optimizer_state.state") == "8bit-bnb" and params.get("activation_checkpointing.every")
               else "no states" if params.get("optimizer_state.state") == "full" else "no recompute")
        order.append(arm)
        if arm == "no states":
            return {"status": "oom", "reason": "OutOfMemoryError: CUDA out of memory"}
        rate, peak = {"exported": (50.0, 18 * GIB), "no recompute": (58.0, 31 * GIB)}[arm]
        return {"status": "ok", "figures": {"samples_per_s": rate, "peak_memory_bytes": peak}}

    monkeypatch.setattr(verify, "run_worker", worker)
    said = []
    status, out = verify.verify(path, repeat=2, sets={}, memory_knobs=True, say=said.append, rate=lambda r: f"{r:g}/s")
    assert status == 0
    # alternating; the knob whose absence did not run is not asked again
    assert order == ["exported", "no states", "no recompute", "exported", "no recompute"]
    lines = out["memory_knobs"]["lines"]
    assert lines[0].startswith("optimizer_state.state=8bit-bnb: without it the configuration did not run (oom")
    assert lines[1] == ("activation_checkpointing.every=1: 0.862x the speed of the same configuration without it; "
                        "peak 18.00 GiB against 31.00 GiB without it (over the search's --memory-limit of 24.0 GiB)")
    assert all(line in said for line in lines)
    kept = json.loads((tmp_path / MEMORY_KNOB_PAIRS).read_text())
    assert kept["lines"] == lines and kept["exported"]["median"] == 50.0


def test_a_configuration_without_memory_knobs_says_there_is_nothing_to_pair(tmp_path, monkeypatch):
    path = _config(tmp_path)
    monkeypatch.setattr(verify, "run_worker", lambda request, *, timeout_s: {
        "status": "ok", "figures": {"samples_per_s": 49.0, "peak_memory_bytes": 20 * GIB}})
    said = []
    status, out = verify.verify(path, repeat=1, sets={}, memory_knobs=True, say=said.append, rate=str)
    assert status == 0 and out["memory_knobs"]["lines"] == []
    assert "this configuration has no memory knob on: nothing to pair" in said
    assert out["relative_difference"] == pytest.approx(-0.02)


@pytest.mark.slow
def test_the_cli_measures_a_cpu_config_and_says_it_has_no_memory_knob_to_pair(tmp_path):
    """The command as a user runs it, on a CPU configuration (no memory knob is offered on a CPU): the
    re-measurement, its peak memory in the JSON, and one line saying there is nothing to pair."""
    from autotune.trial.measure import MeasureSettings
    from conftest import run_cli

    space = SearchSpace(device="cpu", precisions=["fp32", "bf16"], batch_sizes=[4, 8], base_batch_size=8,
                        memory_formats=["contiguous"], thread_counts=[1])
    info = {"workload": {"model": "fake_models:tiny_cnn", "input_shape": [3, 32, 32], "num_classes": 10},
            "figures": {"samples_per_s": 1000.0},
            "measure": MeasureSettings(min_warmup_steps=2, max_warmup_s=2, min_steps=5, min_time_s=0.2).to_dict()}
    params = {"precision.mode": "fp32", "batch_size.batch_size": 8, "memory_format.format": "contiguous",
              "threads.num_threads": 1}
    TunedConfig.from_params(params, space, info=info).save(tmp_path / "config.json")
    proc = run_cli("verify", str(tmp_path), "--memory-knobs")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["median"] > 0 and result["memory_knobs"]["lines"] == [] and result["peak_memory_bytes"] > 0
    assert "nothing to pair" in " ".join(proc.stderr.split())
    assert (tmp_path / MEMORY_KNOB_PAIRS).exists()


def test_a_variant_whose_worker_gives_no_reason_is_recorded_not_a_crash(tmp_path, monkeypatch):
    path = _config(tmp_path, **{"activation_checkpointing.every": 1})

    def worker(request, *, timeout_s):
        params = json.loads(open(request["config_path"]).read())["params"]
        if params.get("activation_checkpointing.every"):
            return {"status": "ok", "figures": {"samples_per_s": 50.0, "peak_memory_bytes": 18 * GIB}}
        return {"status": "crashed"}

    monkeypatch.setattr(verify, "run_worker", worker)
    status, out = verify.verify(path, repeat=1, sets={}, memory_knobs=True, say=lambda line: None, rate=str)
    assert status == 0
    assert out["memory_knobs"]["lines"] == ["activation_checkpointing.every=1: without it the configuration did not "
                                            "run (crashed: )"]
