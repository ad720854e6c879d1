"""Knobs shown to have no effect stop being explored: matched pairs of trials that differ only in
a knob decide it; a knob whose pairs stay within the noise is fixed through Optuna's
PartialFixedSampler, one with a large effect is not, and --no-steer never fixes anything."""

from __future__ import annotations

import optuna
import pytest

from autotune.search.knob_effects import (FIXED_ATTR, MIN_COMPLETED, NOISE_FLOOR, differs_only_in, fix_no_effect_knobs,
                                   no_effect_knobs)

optuna.logging.set_verbosity(optuna.logging.WARNING)

A = ["x", "y"]  # a knob with no effect
B = [1, 2, 4]   # a knob that scales the result


def value_of(params: dict) -> float:
    return 1000.0 * params["b"]


def grid_study(values=value_of, spread: float = 0.01) -> optuna.Study:
    """Every (a, b) combination measured once: matched pairs for both knobs, all values covered."""
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for b in B:
        for a in A:
            study.enqueue_trial({"a": a, "b": b})

    def objective(trial: optuna.Trial) -> float:
        params = {"a": trial.suggest_categorical("a", A), "b": trial.suggest_categorical("b", B)}
        trial.set_user_attr("figures", {"spread": spread})
        return values(params)

    study.optimize(objective, n_trials=len(A) * len(B))
    return study


def test_pairs_are_trials_that_differ_in_one_shared_parameter():
    assert differs_only_in({"a": 1, "b": 2}, {"a": 1, "b": 3}) == "b"
    assert differs_only_in({"a": 1, "b": 2}, {"a": 2, "b": 3}) is None
    assert differs_only_in({"a": 1, "b": 2}, {"a": 1, "b": 2}) is None
    # parameters in only one of them are the differing knob's conditional ones
    assert differs_only_in({"p": "fp16", "scale": 4}, {"p": "bf16"}) == "p"
    # a knob already fixed does not count as a difference
    assert differs_only_in({"a": 1, "b": 2}, {"a": 2, "b": 3}, ignore={"a"}) == "b"


def test_a_knob_with_no_effect_is_fixed_and_one_with_a_large_effect_is_not():
    study = grid_study()
    found = fix_no_effect_knobs(study)
    assert set(found) == {"a"}
    entry = study.user_attrs[FIXED_ATTR]["a"]
    assert entry["value"] in A and entry["max_effect"] == 0.0 and len(entry["pairs"]) == len(B)
    assert "differ only in a" in entry["reason"]
    # Optuna's own mechanism: the study's sampler now holds the knob fixed, and further trials keep it
    assert isinstance(study.sampler, optuna.samplers.PartialFixedSampler)
    study.optimize(lambda t: value_of({"a": t.suggest_categorical("a", A), "b": t.suggest_categorical("b", B)}),
                   n_trials=8)
    assert {t.params["a"] for t in study.trials[len(A) * len(B):]} == {entry["value"]}
    # judged again later, nothing new; the fixed knob is not fixed twice
    assert fix_no_effect_knobs(study) == {}


def test_an_effect_above_the_noise_keeps_the_knob_searched():
    study = grid_study(lambda p: 1000.0 * p["b"] * (1.10 if p["a"] == "y" else 1.0))
    assert no_effect_knobs(study) == {}


def test_noisy_trials_widen_what_counts_as_no_effect():
    values = lambda p: 1000.0 * p["b"] * (1.05 if p["a"] == "y" else 1.0)  # noqa: E731
    assert "a" not in no_effect_knobs(grid_study(values, spread=0.01))  # 5% > the 3% floor
    assert "a" in no_effect_knobs(grid_study(values, spread=0.12))       # within half a 12% spread


def test_too_few_trials_or_uncovered_values_fix_nothing():
    study = optuna.create_study(direction="maximize")
    for a in A:
        study.enqueue_trial({"a": a, "b": 1})
    study.optimize(lambda t: value_of({"a": t.suggest_categorical("a", A), "b": t.suggest_categorical("b", B)}),
                   n_trials=2)
    assert len(study.trials) < MIN_COMPLETED and no_effect_knobs(study) == {}
    # plenty of pairs for "a", but only two of the three values of "b" were ever compared
    study = optuna.create_study(direction="maximize")
    for b in (1, 2, 1, 2):
        for a in A:
            study.enqueue_trial({"a": a, "b": b})
    study.optimize(lambda t: 1000.0 + 0 * len(t.suggest_categorical("a", A)) + 0 * t.suggest_categorical("b", B),
                   n_trials=8)
    found = no_effect_knobs(study)
    assert "a" in found and "b" not in found


def test_the_fixed_value_is_the_best_trials_under_a_minimized_objective():
    study = optuna.create_study(direction="minimize")
    for b in B:
        for a in A:
            study.enqueue_trial({"a": a, "b": b})
    study.optimize(lambda t: 10.0 * t.suggest_categorical("b", B) + (0.01 if t.suggest_categorical("a", A) == "x"
                                                                     else 0.0), n_trials=6)
    found = no_effect_knobs(study)
    assert found["a"]["value"] == "y"  # the best (lowest) trial has a = "y"
    assert study.trials[found["a"]["best_trial"]].params == {"b": 1, "a": "y"}


# the whole search, with the probe and the worker replaced by figures that depend on the knobs ----


def fake_probe(config, device, list_devices=False, spare=False):
    return {"status": "ok", "provenance": {"torch": "test", "num_cpus": 2}, "precisions": ["fp32"], "input_dim": 4,
            "input_shape": [3, 8, 8], "num_parameters": 10}


def fake_worker(request, timeout_s=None, log_path=None, spare=False, on_progress=None):
    knobs = request["knobs"]
    # the optimizer implementation matters (25%); memory format and threads do not
    rate = 1000.0 * (1.25 if knobs["optimizer"]["implementation"] == "fused" else 1.0)
    batch = knobs["batch_size"]["batch_size"]
    figures = {"samples_per_s": rate, "step_time_ms": batch * 1e3 / rate, "peak_memory_bytes": 2**20,
               "spread": 0.01, "warmup_s": 0.0, "measure_s": 0.1, "build_s": 0.0, "loss_finite": True,
               "final_loss": 1.0}
    return {"status": "ok", "figures": figures, "knobs": knobs, "wall_s": 0.1, "worker_start_s": 0.0}


@pytest.mark.slow  # a whole run_search (probe and workers faked): ~10 s on 2 cores
@pytest.mark.parametrize("steer", [True, False])
def test_only_a_steered_search_fixes_knobs(tmp_path, monkeypatch, steer):
    import autotune.search.objective
    import autotune.cli.run
    from autotune.search.options import SearchConfig
    from autotune.cli.run import run_search
    from autotune.workload.models import WorkloadSpec

    monkeypatch.setattr(autotune.cli.run, "probe", fake_probe)
    monkeypatch.setattr(autotune.search.objective, "run_worker", fake_worker)
    events = []
    config = SearchConfig(workload=WorkloadSpec(model="resnet18", num_classes=10), device="cpu", out_dir=tmp_path,
                          trials=16, batch_size=8, accuracy_check=False, steer=steer, seed=3)
    result = run_search(config, on_event=lambda kind, payload: events.append((kind, payload)))
    fixed = result.study.user_attrs.get(FIXED_ATTR, {})
    if not steer:
        assert fixed == {} and not any(kind == "fixed" for kind, _ in events)
        assert not isinstance(result.study.sampler, optuna.samplers.PartialFixedSampler)
        return
    assert "optimizer.implementation" not in fixed  # 25% is an effect
    assert set(fixed) & {"memory_format.format", "threads.num_threads"}, fixed
    assert any(kind == "fixed" for kind, _ in events)
    for entry in fixed.values():
        assert entry["max_effect"] <= NOISE_FLOOR
    # recorded for the report and config.json
    import json

    exported = json.loads((tmp_path / "config.json").read_text())
    assert exported["fixed_knobs"].keys() == fixed.keys()
    assert "Knobs no longer explored" in (tmp_path / "report.md").read_text()


# the steering never queues what was measured, nor a change to a knob found to have no effect ------


def test_steering_skips_a_measured_configuration_queued_with_fewer_parameters():
    from autotune.search.findings import Finding
    from autotune.space import SearchSpace
    from autotune.search.steering import complete_params, steer
    from autotune.search.queue import put

    space = SearchSpace(device="cuda", precisions=["fp32", "fp16"], batch_sizes=[64, 128], base_batch_size=64,
                        memory_formats=["contiguous", "channels_last"], stream_counts=[1, 2])
    base = complete_params({"precision.mode": "fp16", "batch_size.batch_size": 64}, space)
    # the channels_last variant waits in the queue with only the parameters it changes (as a seed
    # may): its completed form is what the remedy would queue
    study = optuna.create_study(direction="maximize")
    trial = study.ask(fixed_distributions=None)
    for name, value in base.items():
        trial.suggest_categorical(name, [value])
    study.enqueue_trial({"precision.mode": "fp16", "batch_size.batch_size": 64, "memory_format.format": "channels_last"})
    layout = Finding("layout", "x", {"memory_format.format": "channels_last"})
    assert steer(study, trial, [layout], space) == []
    copies = Finding("copies", "y", {"streams.num_streams": 2})
    queued = put(study, steer(study, trial, [copies], space))
    assert [c.params for c in queued] == [{**base, "streams.num_streams": 2}]
    # streams found to have no effect: its remedy is not queued any more
    study.set_user_attr(FIXED_ATTR, {"streams.num_streams": {"value": 1, "reason": "test"}})
    other = Finding("copies", "y", {"streams.num_streams": 2, "batch_size.batch_size": 128})
    assert steer(study, trial, [other], space) == []
