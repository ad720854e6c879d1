"""measure: warm-up until steady, a median step time close to the truth, noisy runs re-measured.

Steps are ``time.sleep`` calls of known length, so the expected figures are known; the settings
are small (0.1 s of timed steps) to keep each test well under a second or two.
"""

from __future__ import annotations

import time

import pytest

from autotune.trial.measure import Measurement, MeasureSettings, measure


def fast_settings(**overrides) -> MeasureSettings:
    values = dict(min_warmup_steps=2, max_warmup_s=5.0, steady_tolerance=0.2, min_steps=8, min_time_s=0.1,
                  max_steps=60, spread_tolerance=0.5, max_remeasure=2)
    values.update(overrides)
    return MeasureSettings(**values)


class SleepStep:
    """A step that sleeps ``durations_ms(i)`` milliseconds on its i-th call, and counts calls."""

    def __init__(self, durations_ms) -> None:
        self.durations_ms = durations_ms
        self.calls = 0

    def __call__(self) -> None:
        time.sleep(self.durations_ms(self.calls) / 1e3)
        self.calls += 1


@pytest.mark.slow
def test_median_of_a_known_step_time() -> None:
    settings = fast_settings()
    step = SleepStep(lambda i: 10.0)
    result = measure(step, "cpu", settings)

    assert isinstance(result, Measurement)
    assert result.step_time_ms == pytest.approx(10.0, rel=0.3)
    assert result.step_time_p10_ms <= result.step_time_ms <= result.step_time_p90_ms
    assert result.num_steps >= settings.min_steps
    # at least min_time_s of timed steps (max_steps does not cap it here)
    assert result.num_steps * result.step_time_ms >= 0.9 * settings.min_time_s * 1e3
    assert result.measure_s >= 0.9 * settings.min_time_s
    assert result.num_steps <= settings.max_steps
    assert result.steady and not result.noisy
    assert result.num_remeasured == 0
    # warm-up stops as soon as two windows (of at most 50 steps) agree
    assert settings.min_warmup_steps < result.num_warmup_steps <= settings.min_warmup_steps + 3 * 50
    assert result.warmup_s < settings.max_warmup_s
    # every call is accounted for as either warm-up or timed
    assert step.calls == result.num_warmup_steps + result.num_steps
    assert result.warmup_s >= result.num_warmup_steps * 0.009
    assert result.measure_s >= result.num_steps * 0.009
    assert result.measure_s < 5.0
    assert result.to_dict()["step_time_ms"] == result.step_time_ms


def test_slow_first_steps_are_warm_up() -> None:
    # the first 10 calls are slow (allocator, cudnn.benchmark, ...), then it is fast for good;
    # one minimal warm-up step, so the slow ones reach the windows that decide steadiness
    step = SleepStep(lambda i: 30.0 if i < 10 else 5.0)
    result = measure(step, "cpu", fast_settings(min_warmup_steps=1))

    assert result.steady
    assert result.num_warmup_steps >= 10  # all slow calls were absorbed by the warm-up
    assert result.step_time_ms == pytest.approx(5.0, rel=0.3)
    assert result.step_time_p90_ms < 15.0  # no slow step leaked into the timed window


def test_alternating_step_times_are_noisy_and_remeasured() -> None:
    # (the median of a two-valued window flips with its parity, so warm-up may never agree:
    # cap it short)
    settings = fast_settings(spread_tolerance=0.05, max_remeasure=2, max_warmup_s=0.5)
    step = SleepStep(lambda i: 5.0 if i % 2 else 15.0)
    result = measure(step, "cpu", settings)

    assert result.spread > settings.spread_tolerance
    assert result.noisy
    assert result.num_remeasured == settings.max_remeasure
    assert result.step_time_p10_ms < 8.0 and result.step_time_p90_ms > 12.0
    # the spread reported is that of the window kept
    expected = (result.step_time_p90_ms - result.step_time_p10_ms) / result.step_time_ms
    assert result.spread == pytest.approx(expected)
    # each of the 1 + max_remeasure windows was run
    assert step.calls >= result.num_warmup_steps + (1 + settings.max_remeasure) * result.num_steps


def test_noisy_window_is_measured_again_and_the_quiet_one_kept() -> None:
    # 5 ms steps: the first window is 2 steps, then windows of 50 until two agree (at once, with
    # this tolerance), so warm-up is 102 calls and the first timed window is calls 102..111
    settings = fast_settings(min_warmup_steps=2, steady_tolerance=1.0, min_steps=10, min_time_s=0.01,
                             max_steps=10, spread_tolerance=0.6, max_remeasure=2)
    first_window = range(102, 112)
    step = SleepStep(lambda i: (20.0 if i % 2 else 5.0) if i in first_window else 5.0)
    result = measure(step, "cpu", settings)

    assert result.num_warmup_steps == 102
    assert result.num_remeasured == 1
    assert not result.noisy
    assert result.step_time_ms == pytest.approx(5.0, rel=0.3)
    assert result.step_time_p90_ms < 10.0  # the noisy window was not kept
    assert step.calls == 102 + 2 * 10


def test_device_defaults_differ() -> None:
    cpu, cuda = MeasureSettings.for_device("cpu"), MeasureSettings.for_device("cuda")
    assert cpu != cuda
    assert cpu.to_dict() != cuda.to_dict()
    # CPU steps are slower and noisier: fewer steps, a wider tolerance
    assert cpu.max_steps <= cuda.max_steps
    assert cpu.spread_tolerance >= cuda.spread_tolerance


class FakeTimer:
    """A timer whose steps take ``step_ms`` each, instantly: counts the steps asked for."""

    def __init__(self, step_ms: float) -> None:
        self.step_ms, self.steps = step_ms, 0

    def run(self, step, num_steps: int) -> list[float]:
        self.steps += num_steps
        return [self.step_ms] * num_steps


@pytest.mark.parametrize("step_ms, windows_of", [(1200.0, 1), (900.0, 2)])
def test_steps_of_a_second_or_more_are_windows_of_their_own(step_ms, windows_of) -> None:
    """ResNet-50 on 2 CPU cores steps in 1.6-10 s: 2-step windows took 35 s to warm up its FP32
    baseline and 44 s to stop a clearly slower trial. A step of a second or more is its own window."""
    from autotune.trial.measure import TooSlow, _warm_up

    settings = MeasureSettings.for_device("cpu")  # one step before the windows
    timer = FakeTimer(step_ms)
    step_time, num_warmup, steady, _ = _warm_up(lambda: None, timer, settings, None)
    assert steady and step_time == step_ms
    assert num_warmup == timer.steps == settings.min_warmup_steps + 2 * windows_of  # two windows agreed
    timer = FakeTimer(step_ms)
    with pytest.raises(TooSlow) as stopped:  # two slow windows in a row stop it
        _warm_up(lambda: None, timer, settings, give_up=lambda ms: True)
    assert len(stopped.value.windows_ms) == 2 and timer.steps == settings.min_warmup_steps + 2 * windows_of


def test_a_trial_says_where_its_build_went(monkeypatch) -> None:
    # on the H200 the yield benchmark's MLP built in 4-6 s a trial and ResNet-50 in 1-2 s, with no
    # figure saying which part: the worker now records the request, the model and optimizer, their
    # preparation with the train step, and the batches
    import optuna

    import strategies
    from autotune.space import SearchSpace
    from autotune.trial import work as worker
    from autotune.workload.models import WorkloadSpec

    real_batches = worker.input_batches

    def batches_taking_a_while(*args, **kwargs):
        time.sleep(0.3)
        return real_batches(*args, **kwargs)

    monkeypatch.setattr(worker, "input_batches", batches_taking_a_while)
    space = SearchSpace(device="cpu", batch_sizes=[8], base_batch_size=8, thread_counts=[1])
    knobs = strategies.sample(optuna.trial.FixedTrial({}), space)
    settings = MeasureSettings(min_warmup_steps=1, max_warmup_s=0.5, steady_tolerance=0.5, min_steps=3,
                               min_time_s=0.05, max_steps=20, spread_tolerance=1.0, max_remeasure=0)
    spec = WorkloadSpec(model="fake_models:tiny_cnn", input_shape=(3, 16, 16), num_classes=10)
    result = worker.run_trial({"space": space.to_dict(), "knobs": strategies.knobs_to_dict(knobs),
                               "workload": spec.to_dict(), "measure": settings.to_dict(), "seed": 0})
    assert result["status"] == "ok", result
    figures = result["figures"]
    parts = ("build_request_s", "build_model_s", "build_prepare_s", "build_batches_s")
    assert all(figures[p] >= 0 for p in parts)
    assert figures["build_batches_s"] >= 0.3  # the slow part is named
    assert sum(figures[p] for p in parts) == pytest.approx(figures["build_s"], abs=0.01)
