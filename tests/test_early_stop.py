"""Multi-fidelity screening: a trial whose warm-up runs clearly below the best so far is stopped
there, recorded as pruned with its warm-up windows as Optuna intermediate values."""

from __future__ import annotations

import json
import time

import optuna
import pytest

from autotune.trial.measure import MeasureSettings, TooSlow, measure
from conftest import run_cli

SETTINGS = MeasureSettings(min_warmup_steps=2, max_warmup_s=5.0, steady_tolerance=0.5, min_steps=3,
                           min_time_s=0.05, max_steps=20, spread_tolerance=1.0, max_remeasure=0)


def _sleep_step(seconds: float):
    return lambda: time.sleep(seconds)


@pytest.mark.slow
def test_two_slow_warm_up_windows_stop_the_measurement():
    judged = []

    def give_up(step_ms):
        judged.append(step_ms)
        return True

    with pytest.raises(TooSlow) as stopped:
        measure(_sleep_step(0.01), "cpu", SETTINGS, give_up=give_up)
    assert len(stopped.value.windows_ms) == 2 == len(judged)
    assert all(8 < ms < 40 for ms in stopped.value.windows_ms)
    assert stopped.value.elapsed_s > 0


def test_a_cold_first_window_alone_does_not_stop_it():
    calls = []

    def give_up(step_ms):  # only the first window is slow: a cold start, not a slow configuration
        calls.append(step_ms)
        return len(calls) == 1

    m = measure(_sleep_step(0.005), "cpu", SETTINGS, give_up=give_up)
    assert m.num_steps >= 3 and len(calls) >= 2


def _study(out):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")


@pytest.mark.slow
def test_a_search_stops_clearly_slower_trials_and_the_sampler_sees_their_windows(tmp_path):
    # slow_cnn sleeps 50 ms a step whatever the batch, so a smaller batch is slower per sample;
    # at 0.95 of the best nearly every trial that does not beat the best is stopped early
    out = tmp_path / "out"
    run_cli("search", "--model", "fake_models:slow_cnn", "--device", "cpu", "--input-shape", "3x32x32",
            "--num-classes", "10", "--min-measure-time", "1.0", "--no-accuracy-check", "--trials", "7",
            "--precisions", "fp32,bf16",  # the plain recipe on every CPU, native bf16 or not
            "--early-stop-below", "0.95", "--out", str(out))
    trials = _study(out).trials
    stopped = [t for t in trials if t.user_attrs.get("status") == "pruned"]
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert stopped and done
    best_before = {}
    for t in stopped:
        assert t.state == optuna.trial.TrialState.PRUNED
        assert "stopped early" in t.user_attrs["reason"]
        windows = t.user_attrs["screening"]["windows"]
        assert len(windows) >= 2 and list(t.intermediate_values.values()) == pytest.approx(windows)
        bar = t.user_attrs["screening"]["below"]
        assert all(rate < bar for rate in windows[-2:])
        # the bar was 0.95 of the best measured before it (in time: the planner runs the queue out of order)
        first = trials[t.user_attrs["duplicate_of"]] if "duplicate_of" in t.user_attrs else t  # a repeat's is copied
        earlier = [d.value for d in done if d.datetime_complete <= first.datetime_start]
        assert bar == pytest.approx(0.95 * max(earlier))
        best_before[t.number] = max(earlier)
    # the baseline and the plain recipe are never screened (the bars the best is held against), and a
    # screened trial cost less than a measured one
    assert all(t.user_attrs.get("role") not in ("baseline", "plain-recipe") for t in stopped)
    assert any(t.user_attrs.get("role") == "plain-recipe" for t in done)
    median = sorted(t.user_attrs["timing"]["wall_s"] for t in done)[len(done) // 2]
    assert min(t.user_attrs["timing"]["wall_s"] for t in stopped) < median
    # counted as configurations the search looked at (--trials 7 finished with them), and said so
    assert sum("status" in t.user_attrs for t in trials) == 7
    cost = json.loads((out / "config.json").read_text())["search"]
    # a repeat of a stopped configuration (its result copied) is a repeat, not one more stopped
    ran = [t for t in stopped if "duplicate_of" not in t.user_attrs]
    assert cost["num_trials"] == 7 and cost["num_stopped_early"] == len(ran)
    report = (out / "report.md").read_text()
    assert f"{len(ran)} stopped early in their warm-up" in report
    assert all(f"| #{t.number} | stopped early |" in report for t in stopped)


def test_the_share_is_checked(cli_main):
    proc = cli_main("search", "--model", "fake_models:tiny_cnn", "--device", "cpu", "--early-stop-below", "1.5",
                    "--trials", "1")
    assert proc.returncode == 2 and "--early-stop-below 1.5" in proc.stdout + proc.stderr


def test_the_bars_are_measured_in_full():
    """The FP32 baseline and the plain recipe are what the best is held against: never stopped early
    (on a 2-core CPU a plain recipe in emulated bf16 was stopped below half the FP32 baseline, and
    the summary had no plain recipe to compare with)."""
    from autotune.space import SearchSpace
    from autotune.search.objective import Objective

    space = SearchSpace(device="cpu", batch_sizes=[8], base_batch_size=8)
    objective = Objective(space=space, workload={}, measure={}, input_on_device=False, seed=0, trial_timeout_s=10.0,
                          early_stop_below=0.5)
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=100.0))
    bars = {}
    for role in ("baseline", "plain-recipe", "known-good"):
        study.enqueue_trial({}, user_attrs={"role": role})
        trial = study.ask()
        bars[role] = objective._early_stop_bar(trial)
        study.tell(trial, 1.0)
    assert bars == {"baseline": None, "plain-recipe": None, "known-good": 50.0}
