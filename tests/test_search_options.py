"""SearchConfig is resolved once and frozen: the defaults that follow from the options alone are set on
creation, and nothing changes it afterwards (what a search learns lives in its study)."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.search.options import DEFAULT_BUDGET_S, SearchConfig
from autotune.trial.measure import MeasureSettings
from autotune.workload.models import WorkloadSpec

SPEC = WorkloadSpec(model="resnet18")


def test_the_budget_is_resolved_on_creation() -> None:
    assert SearchConfig(workload=SPEC).budget_s == DEFAULT_BUDGET_S  # neither --trials nor --budget
    assert SearchConfig(workload=SPEC, trials=3).budget_s is None  # --trials alone: no time limit
    assert SearchConfig(workload=SPEC, trials=3, budget_s=60).budget_s == 60


def test_the_options_are_parsed_once_and_cannot_change() -> None:
    config = SearchConfig(workload=SPEC, memory_limit="24GiB", gpus="0,1", device="cuda")
    assert config.memory_limit == 24 * 2**30 and config.gpus == [0, 1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.budget_s = 10.0
    # a variant is a new config, validated as the first was
    assert dataclasses.replace(config, min_batch_size=1).min_batch_size == 1 and config.min_batch_size is None


def test_the_trials_timing_is_the_devices_unless_given() -> None:
    assert SearchConfig(workload=SPEC).measure_settings("cpu") == MeasureSettings.for_device("cpu")
    given = dataclasses.replace(MeasureSettings.for_device("cpu"), min_time_s=0.3)
    assert SearchConfig(workload=SPEC, measure=given).measure_settings("cuda") == given
