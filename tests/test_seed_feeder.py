"""Seeds serve the search instead of replacing it: the FP32 baseline and the guides' best two are
queued at once, the other known-good configurations one per trial of the search's own, except the
first seed of a precision mode nothing has run yet, which is queued at once."""

from __future__ import annotations

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autotune.search.queue import Candidate, feed, put, queued, waiting
from autotune.search.seeds import BACKLOG_ATTR, SEEDS_UPFRONT, SeedFeeder, seed_candidates

SPACE = {"precision.mode": CategoricalDistribution(["fp32", "fp16", "bf16", "fp8"]),
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
    feed(study)
    if not waiting(study):
        study.enqueue_trial({"precision.mode": "fp32", "batch_size.batch_size": 64})
    trial = study.ask(SPACE)
    if unstable:
        trial.set_user_attr("unstable", True)
    study.tell(trial, value)
    put(study, feeder(study, study.trials[trial.number]))  # the queue's Feeder puts what it proposes
    return study.trials[trial.number]


def test_the_baseline_and_the_best_two_are_queued_and_the_rest_kept_back():
    study = _study()
    proposed = seed_candidates(study, _seeds())
    assert queued(study) == []  # proposed, not queued: the queue puts them
    put(study, proposed)
    waiting = queued(study)
    assert [t.user_attrs["role"] for t in waiting] == ["baseline"] + ["known-good"] * SEEDS_UPFRONT
    assert len(study.user_attrs[BACKLOG_ATTR]) == len(_seeds()) - 1 - SEEDS_UPFRONT
    replay = _study()
    put(replay, seed_candidates(replay, _seeds(), all_now=True))  # --replay keeps the earlier search's order
    assert len(queued(replay)) == len(_seeds())
    assert replay.user_attrs[BACKLOG_ATTR] == []


def _waiting(study):
    return [t.system_attrs["fixed_params"] for t in queued(study)]


def test_seeds_alternate_with_the_searchs_own_trials():
    study, feeder = _study(), SeedFeeder()
    put(study, seed_candidates(study, _seeds()))
    roles = [_run_one(study, feeder).user_attrs.get("role", "search") for _ in range(12)]
    # the first fp16 seed is queued after the baseline (no fp16 trial yet) and takes a seed's turn
    assert roles[:4] == ["baseline", "known-good", "known-good", "known-good"]
    assert study.trials[3].params == {"precision.mode": "fp16", "batch_size.batch_size": 256}
    # then the search's own trials catch up, and one seed follows each of them until the backlog is empty
    assert roles[4:11] == ["search", "search", "known-good", "search", "known-good", "search", "known-good"]
    assert roles[11] == "search" and study.user_attrs[BACKLOG_ATTR] == []
    searched = sum(r == "search" for r in roles)
    assert searched >= len(roles) // 2 - SEEDS_UPFRONT


def test_the_first_seed_of_a_precision_nothing_ran_is_queued_at_once():
    # hf:llama on an H200 (2026-12-03): the fp8 seed, last in the backlog, was still queued when
    # the 6-minute budget ran out, though fp8 measured 1.51x the best bf16
    study, feeder = _study(), SeedFeeder()
    seeds = _seeds() + [("known-good", {"precision.mode": "fp8", "batch_size.batch_size": 512})]
    put(study, seed_candidates(study, seeds))
    _run_one(study, feeder)  # the baseline: fp16 is the first new mode in the backlog
    assert _waiting(study)[-1] == {"precision.mode": "fp16", "batch_size.batch_size": 256}
    _run_one(study, feeder)  # bf16 at 256: fp8, at the end of the backlog, is next, not fp16 at 512
    assert _waiting(study)[-1] == {"precision.mode": "fp8", "batch_size.batch_size": 512}
    backlog = study.user_attrs[BACKLOG_ATTR]
    assert {"precision.mode": "fp8", "batch_size.batch_size": 512} not in backlog
    assert backlog[0] == {"precision.mode": "fp16", "batch_size.batch_size": 512}
    # every mode has a trial now: the rest wait for the search's own trials as before
    for _ in range(3):
        _run_one(study, feeder)
    assert not _waiting(study) and len(study.user_attrs[BACKLOG_ATTR]) == len(backlog)
    # a mode the search sampled itself is not new: its seed waits its turn
    sampled = _study()
    put(sampled, seed_candidates(sampled, seeds))
    put(sampled, Candidate.of({"precision.mode": "fp8", "batch_size.batch_size": 64}))
    _run_one(sampled, feeder)  # the baseline: fp16 is fed; fp8 has a trial queued by the search
    _run_one(sampled, feeder)
    assert {"precision.mode": "fp8", "batch_size.batch_size": 512} in sampled.user_attrs[BACKLOG_ATTR]


def test_a_seed_that_measurements_already_answer_is_dropped():
    study, feeder = _study(), SeedFeeder()
    seeds = _seeds()
    put(study, seed_candidates(study, seeds))
    _run_one(study, feeder)  # the baseline; fp16 at 256 is queued at once (the first fp16)
    _run_one(study, feeder, unstable=True)  # bf16 at 256: the loss went NaN
    _run_one(study, feeder)  # bf16 at 512
    _run_one(study, feeder)  # fp16 at 256
    # the sampler's trial measures fp16 at 512, the next seed's configuration
    study.enqueue_trial({"precision.mode": "fp16", "batch_size.batch_size": 512})
    _run_one(study, feeder)
    assert not _waiting(study)  # one trial of the search's own against three seeds after the first two
    _run_one(study, feeder)
    # fp16 at 512 was measured already: the next one, fp16 at 1024, is queued instead
    assert _waiting(study) == [{"precision.mode": "fp16", "batch_size.batch_size": 1024}]
    assert {"precision.mode": "bf16", "batch_size.batch_size": 1024} in study.user_attrs[BACKLOG_ATTR]
    # once the queue is served and another trial of the search's own ran, bf16 (unstable) is skipped
    for _ in range(6):
        _run_one(study, feeder)
    seeded = [t.params for t in study.trials if t.user_attrs.get("role") == "known-good"]
    assert {"precision.mode": "bf16", "batch_size.batch_size": 1024} not in seeded
    assert study.user_attrs[BACKLOG_ATTR] == []
