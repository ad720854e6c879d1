"""Findings steer the search: a trial's profile (here a real H200 window) becomes findings on the
trial and queued configurations that replay through the strategies; the best and baseline traces
are kept next to the report."""

from __future__ import annotations

import optuna
import pytest

import strategies
from autotune.search import queue
from autotune.deploy.config import TunedConfig
from autotune.search.findings import Finding
from autotune.search.objective import Objective
from autotune.trial.profile import analyze, load_fixture
from autotune.space import SearchSpace
from autotune.search.steering import complete_params, steer
from autotune.search.outputs import keep_traces
from conftest import ROOT

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPACE = SearchSpace(device="cuda", precisions=["fp32", "tf32", "fp16", "bf16"], batch_sizes=[64, 128, 256],
                    base_batch_size=128, memory_formats=["contiguous", "channels_last"], stream_counts=[1, 2],
                    cudnn_benchmark=[False, True], optimizer_implementations=["foreach", "fused"],
                    compile_modes=["off", "default"], cuda_graphs=[False, True])
FP16_NCHW = {"precision.mode": "fp16", "grad_scaler.init_scale": 2.0**16, "grad_scaler.growth_factor": 2.0,
             "grad_scaler.backoff_factor": 0.5, "grad_scaler.growth_interval": 2000, "batch_size.batch_size": 128,
             "memory_format.format": "contiguous", "cudnn.benchmark": True, "streams.num_streams": 1,
             "optimizer.implementation": "foreach", "compile.mode": "off"}  # cuda_graphs: not legal here


def test_a_switch_to_fp16_brings_the_scaler_at_its_defaults_and_bf16_drops_it():
    fp32 = complete_params({"precision.mode": "fp32", "batch_size.batch_size": 64}, SPACE)
    assert not any(k.startswith("grad_scaler.") for k in fp32)
    fp16 = complete_params({**fp32, "precision.mode": "fp16"}, SPACE)
    assert fp16["grad_scaler.init_scale"] == 2.0**16 and fp16["grad_scaler.growth_interval"] == 2000
    bf16 = complete_params({**fp16, "precision.mode": "bf16"}, SPACE)
    assert not any(k.startswith("grad_scaler.") for k in bf16)
    # what is queued replays exactly, as autotune.load will replay it
    TunedConfig.from_params(fp16, SPACE)
    TunedConfig.from_params(bf16, SPACE)


def test_a_value_outside_the_space_falls_back_to_the_default():
    params = complete_params({"precision.mode": "fp8", "batch_size.batch_size": 3}, SPACE)
    assert params["precision.mode"] == "fp32" and params["batch_size.batch_size"] == 64


def _trial(study, params):
    trial = study.ask(fixed_distributions=None)
    for name, value in params.items():
        trial.suggest_categorical(name, [value])
    return trial


def test_remedies_are_queued_once_and_never_the_trial_itself():
    study = optuna.create_study(direction="maximize")
    trial = _trial(study, FP16_NCHW)
    findings = [Finding("layout", "x", {"memory_format.format": "channels_last"}),
                Finding("thermal", "no knob"),
                Finding("same", "y", {"memory_format.format": "contiguous"}),
                Finding("copies", "z", {"streams.num_streams": 2}),
                Finding("idle", "w", {"batch_size.batch_size": 256})]
    proposed = steer(study, trial, findings, SPACE)
    assert not queue.queued(study)  # proposed, not queued: the caller (the objective) puts them in the queue
    queued = [c.params for c in queue.put(study, proposed)]
    assert [q["memory_format.format"] for q in queued] == ["channels_last", "contiguous"]
    assert queued[1]["streams.num_streams"] == 2  # the limit (2) stops before the batch remedy
    again = [c.params for c in queue.put(study, steer(study, trial, findings, SPACE))]
    assert again == [{**FP16_NCHW, "batch_size.batch_size": 256}]  # the first two are already queued
    waiting = queue.queued(study)
    assert len(waiting) == 3 and all(t.user_attrs["role"] == "steered" for t in waiting)
    assert waiting[0].user_attrs["steered_by"] == {"trial": trial.number, "rule": "layout"}


def test_a_real_profile_becomes_findings_and_a_queued_channels_last_trial(tmp_path):
    trace = load_fixture(ROOT / "tests" / "fixtures" / "profile-resnet50-fp16-nchw.json.gz")
    profile = analyze(trace, step_time_ms=trace.meta["batch"] / trace.meta["timed_samples_per_s"] * 1e3)
    study = optuna.create_study(direction="maximize")
    trial = _trial(study, FP16_NCHW)
    trial.set_user_attr("knobs", strategies.knobs_to_dict(strategies.sample(optuna.trial.FixedTrial(FP16_NCHW), SPACE)))
    objective = Objective(space=SPACE, workload={}, measure={}, input_on_device=False, seed=0, trial_timeout_s=60)
    objective._explain(trial, {"status": "ok", "figures": {"loss_finite": True}, "profile": profile,
                               "energy": trace.meta["nvml"]})
    attrs = study.trials[trial.number].user_attrs
    assert attrs["profile"]["layout_share"] > 0.1 and attrs["energy"]["energy_source"] == "energy counter"
    assert any("layout conversions" in text for text in attrs["findings"])
    steered = queue.queued(study)
    fixed = steered[0].system_attrs["fixed_params"]  # what the trial will run with
    assert fixed["memory_format.format"] == "channels_last" and fixed["precision.mode"] == "fp16"


def test_no_profile_no_findings():
    study = optuna.create_study(direction="maximize")
    trial = _trial(study, FP16_NCHW)
    # Objective.__call__ records the trial's knobs before it explains the result
    trial.set_user_attr("knobs", {"precision": {"mode": "fp16"}, "memory_format": {"format": "contiguous"}})
    objective = Objective(space=SPACE, workload={}, measure={}, input_on_device=False, seed=0, trial_timeout_s=60)
    objective._explain(trial, {"status": "ok", "figures": {"loss_finite": True}})
    assert "findings" not in study.trials[0].user_attrs and not queue.queued(study)


def test_the_baseline_and_best_traces_are_kept_and_the_rest_deleted(tmp_path):
    study = optuna.create_study(direction="maximize")
    for n, (role, value) in enumerate([("baseline", 900.0), ("search", 5000.0), ("search", 6000.0)]):
        study.enqueue_trial({"x": n}, user_attrs={"role": role})
        study.optimize(lambda t: (t.suggest_int("x", 0, 9), value)[1], n_trials=1)
    logs = tmp_path / "logs"
    logs.mkdir()
    for n in range(3):
        (logs / f"trace-{n:04d}.json.gz").write_bytes(b"trace %d" % n)
    kept = keep_traces(study, tmp_path)
    assert sorted(kept) == ["trace-baseline.json.gz", "trace-best.json.gz"]
    assert (tmp_path / "trace-baseline.json.gz").read_bytes() == b"trace 0"
    assert (tmp_path / "trace-best.json.gz").read_bytes() == b"trace 2"
    assert sorted(p.name for p in logs.iterdir()) == ["trace-0000.json.gz", "trace-0002.json.gz"]


@pytest.mark.parametrize("steps", [1, 3])
def test_measure_enters_the_timed_window_once_around_every_timed_step(steps):
    from autotune.trial.measure import MeasureSettings, measure

    events: list[str] = []

    class Window:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    def step():
        events.append("step")

    settings = MeasureSettings(min_warmup_steps=2, max_warmup_s=0.2, min_steps=steps, min_time_s=0.0,
                               max_steps=steps, max_remeasure=0)
    m = measure(step, "cpu", settings, timed_window=Window)
    inside = events[events.index("enter") + 1:events.index("exit")]
    assert events.count("enter") == 1 and inside == ["step"] * m.num_timed_steps_total
    assert m.num_timed_steps_total == steps and "step" not in events[events.index("exit") + 1:]


def test_trials_csv_has_the_energy_profile_and_findings_columns():
    from autotune.report.export import trials_frame

    trace = load_fixture(ROOT / "tests" / "fixtures" / "profile-resnet50-fp16-nchw.json.gz")
    study = optuna.create_study(direction="maximize")
    trial = _trial(study, FP16_NCHW)
    trial.set_user_attr("knobs", strategies.knobs_to_dict(strategies.sample(optuna.trial.FixedTrial(FP16_NCHW), SPACE)))
    energy = dict(trace.meta["nvml"], joules_per_sample=0.171)
    Objective(space=SPACE, workload={}, measure={}, input_on_device=False, seed=0, trial_timeout_s=60)._explain(
        trial, {"status": "ok", "figures": {"loss_finite": True}, "energy": energy,
                "profile": analyze(trace, step_time_ms=47.2)})
    study.tell(trial, 2715.0)
    queue.feed(study)
    study.optimize(lambda t: 1.0, n_trials=1)  # runs the queued channels_last remedy
    frame = trials_frame(study).set_index("number")
    assert frame.loc[0, "joules_per_sample"] == pytest.approx(0.171)
    assert frame.loc[0, "layout_share"] > 0.1 and "layout conversions" in frame.loc[0, "findings"]
    assert frame.loc[1, "role"] == "steered" and frame.loc[1, "steered_by"] == "#0 layout"
