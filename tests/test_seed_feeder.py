"""Seeds serve the search instead of replacing it: the FP32 baseline and the guides' best two are
queued at once, the other known-good configurations one per trial of the search's own."""

from __future__ import annotations

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autotune.search.seeds import BACKLOG_ATTR, SEEDS_UPFRONT, SeedFeeder, enqueue_seeds

SPACE = {"precision.mode": CategoricalDistribution(["fp32", "fp16", "bf16"]),
         "batch_size.batch_size": CategoricalDistribution([64, 128, 256, 512, 1024])}


def _seeds():
    seeds = [("baseline", {"precision.mode": "fp32", "batch_size.batch_size": 256})]
    for mode, batch in [("bf16", 256), ("bf16", 512), ("fp16", 256), ("fp16", 512), ("fp16", 1024), ("bf16", 1024)]:
        seeds.append(("known-good", {"precision.mode": mode, "batch_size.batch_size": batch}))
    return seeds


def _study():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(direction="maximize")


def _run_one(study, feeder, value=1.0, unstable=False):
    """One trial the way study.optimize runs it: the queue first, else the sampler's choice (here
    always fp32 at batch 64, which no seed is); then the callback."""
    if not study.get_trials(states=(TrialState.WAITING,)):
        study.enqueue_trial({"precision.mode": "fp32", "batch_size.batch_size": 64})
    trial = study.ask(SPACE)
    if unstable:
        trial.set_user_attr("unstable", True)
    study.tell(trial, value)
    feeder(study, study.trials[trial.number])
    return study.trials[trial.number]


def test_the_baseline_and_the_best_two_are_queued_and_the_rest_kept_back():
    study = _study()
    enqueue_seeds(study, _seeds())
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert [t.user_attrs["role"] for t in waiting] == ["baseline"] + ["known-good"] * SEEDS_UPFRONT
    assert len(study.user_attrs[BACKLOG_ATTR]) == len(_seeds()) - 1 - SEEDS_UPFRONT
    replay = _study()
    enqueue_seeds(replay, _seeds(), all_now=True)  # --replay keeps the earlier search's order
    assert len(replay.get_trials(states=(TrialState.WAITING,))) == len(_seeds())
    assert replay.user_attrs[BACKLOG_ATTR] == []


def test_seeds_alternate_with_the_searchs_own_trials():
    study, feeder = _study(), SeedFeeder()
    enqueue_seeds(study, _seeds())
    roles = [_run_one(study, feeder).user_attrs.get("role", "search") for _ in range(12)]
    assert roles[:3] == ["baseline", "known-good", "known-good"]
    # then one of the search's own, one seed, ... until the backlog is empty
    assert roles[3:11] == ["search", "known-good"] * 4
    assert roles[11] == "search" and study.user_attrs[BACKLOG_ATTR] == []
    searched = sum(r == "search" for r in roles)
    assert searched >= len(roles) // 2 - SEEDS_UPFRONT


def test_a_seed_that_measurements_already_answer_is_dropped():
    study, feeder = _study(), SeedFeeder()
    seeds = _seeds()
    enqueue_seeds(study, seeds)
    _run_one(study, feeder)  # the baseline
    _run_one(study, feeder, unstable=True)  # bf16 at 256: the loss went NaN
    _run_one(study, feeder)  # bf16 at 512
    # the sampler's trial measures fp16 at 256, the next seed's configuration
    study.enqueue_trial({"precision.mode": "fp16", "batch_size.batch_size": 256})
    _run_one(study, feeder)
    queued = study.get_trials(states=(TrialState.WAITING,))
    # fp16 at 256 was measured already: the next one, fp16 at 512, is queued instead
    assert [t.system_attrs["fixed_params"] for t in queued] == [{"precision.mode": "fp16", "batch_size.batch_size": 512}]
    assert {"precision.mode": "bf16", "batch_size.batch_size": 1024} in study.user_attrs[BACKLOG_ATTR]
    # once the queue is served and another trial of the search's own ran, bf16 (unstable) is skipped
    for _ in range(6):
        _run_one(study, feeder)
    seeded = [t.params for t in study.trials if t.user_attrs.get("role") == "known-good"]
    assert {"precision.mode": "bf16", "batch_size.batch_size": 1024} not in seeded
    assert study.user_attrs[BACKLOG_ATTR] == []
