"""A second search starts warm (autotune.search.warm): the trials a search measured are kept under
autotune's cache, and a new search of the same workload on the same kind of machine starts with them
as evidence, runs none of the configurations they measured again, and queues what they would have
proposed; another torch, GPU or space starts cold, and --fresh starts without them. The cache is
bounded (autotune.cache.trim_cache)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

from autotune.search import queue
from autotune.cache import cache_root, trim_cache
from autotune.deploy import compile_cache
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from autotune.search import warm
from autotune.search.neighbours import Neighbours
from autotune.search.options import SearchConfig
from autotune.search.outputs import keep_compile_cache
from autotune.search.steering import complete_params
from autotune.search.trials import baseline_trial, best_trial, counted_trials, plain_recipe_trial
from autotune.trial.record import TrialRecord
from autotune.workload.models import WorkloadSpec
from conftest import ROOT, measured, run_cli

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPACE = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[32, 64, 128], base_batch_size=64,
                    memory_formats=["contiguous", "channels_last"], compile_modes=["off", "default"],
                    optimizer_implementations=["foreach", "fused"], cuda_graphs=[False], stream_counts=[1])
KEY = {"workload": {"model": "resnet50"}, "device": "cuda", "hardware": "NVIDIA H100 80GB HBM3",
       "torch": "2.14.1+cu130", "objective": "throughput", "memory_limit_bytes": None}
JUDGED = {"check": True, "method": "parity"}


def _params(mode="bf16", batch=64, compile_mode="default", fmt="contiguous"):
    return complete_params({"precision.mode": mode, "batch_size.batch_size": batch, "compile.mode": compile_mode,
                            "memory_format.format": fmt, "optimizer.implementation": "fused"}, SPACE)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test's own cache folder: the kept searches of one test are not another's evidence."""
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))


def _ran(study, params, value, figures=None, **attrs):
    """A measured trial with its outcome recorded, as the objective records one."""
    import strategies

    return measured(study, SPACE, params, value, status="ok", figures={"samples_per_s": value, **(figures or {})},
                    timing={"wall_s": 40.0, "compile_s": 30.0}, knobs=strategies.knobs_of(params, SPACE), **attrs)


def _first_search(tmp_path, accuracy=None):
    """A finished search's study, kept with warm.remember; its folder."""
    study = optuna.create_study(direction="maximize")
    _ran(study, _params("fp32", 64, "off"), 1000.0, role="baseline")
    _ran(study, _params("bf16", 64, "default"), 2000.0, role="plain-recipe", accuracy=accuracy)
    # its worker saved its compile as logs/compile-0002.zip (kept as compile-cache.zip where it is the best)
    archive = {"compile_archive": {"file": "compile-0002.zip"}}
    _ran(study, _params("bf16", 64, "default", "channels_last"), 2400.0, archive, role="steered")
    _ran(study, _params("bf16", 64, "default", "channels_last"), 2400.0, archive, duplicate_of=2)  # a copy: not kept
    out = tmp_path / "first"
    out.mkdir()
    assert warm.remember(study, out, KEY, JUDGED) is not None
    return study, out


def test_a_new_search_of_the_same_key_starts_with_the_trials_the_first_one_measured(tmp_path):
    first, out = _first_search(tmp_path)
    second = optuna.create_study(direction="maximize")
    used = warm.warm_start(second, SPACE, KEY, JUDGED)
    assert used == [{"out_dir": str(out.resolve()), "study": first.study_name, "finished": used[0]["finished"],
                     "trials": 3}]
    assert second.user_attrs[warm.ATTR] == used
    # the measured trials, not the copy, with their figures and roles: the baseline and the plain recipe stand
    assert [(t.params, t.value) for t in second.trials] == [(t.params, t.value) for t in first.trials[:3]]
    assert [TrialRecord.of(t).warm_from["number"] for t in second.trials] == [0, 1, 2]
    assert baseline_trial(second).value == 1000.0 and plain_recipe_trial(second).value == 2000.0
    assert best_trial(second).value == 2400.0
    # evidence, not this search's trials: --trials and the search's cost count only what it runs
    assert counted_trials(second) == []
    # the seeds they measured are not queued again
    seeds = [("baseline", _params("fp32", 64, "off")), ("plain-recipe", _params("bf16", 64, "default")),
             ("known-good", _params("bf16", 128, "default"))]
    assert warm.unmeasured(second, seeds) == seeds[2:]
    # the stop rule knows what a trial costs here from the start
    assert warm.warm_walls(second) == [(40.0, False), (40.0, True), (40.0, True)]
    # and the next search keeps only what this one measured itself
    warm.remember(second, tmp_path / "second", KEY, JUDGED)
    data = json.loads(warm.evidence_path(KEY).read_text())
    assert [len(run["trials"]) for run in data["runs"]] == [3]


def test_a_resumed_search_replaces_its_record_and_a_new_study_in_the_same_folder_keeps_the_older_one(tmp_path):
    first, out = _first_search(tmp_path)
    _ran(first, _params("bf16", 128, "default"), 2600.0)  # resumed: one trial more
    warm.remember(first, out, KEY, JUDGED)
    assert [len(run["trials"]) for run in json.loads(warm.evidence_path(KEY).read_text())["runs"]] == [4]
    again = optuna.create_study(direction="maximize")  # the folder deleted and searched again
    warm.warm_start(again, SPACE, KEY, JUDGED)
    _ran(again, _params("fp32", 128, "off"), 1100.0)
    warm.remember(again, out, KEY, JUDGED)
    assert [len(run["trials"]) for run in json.loads(warm.evidence_path(KEY).read_text())["runs"]] == [4, 1]


def test_another_torch_gpu_or_objective_starts_cold(tmp_path):
    _first_search(tmp_path)
    for change in ({"torch": "2.15.0+cu130"}, {"hardware": "NVIDIA H200"}, {"objective": "energy"},
                   {"memory_limit_bytes": 24 * 2**30}):
        study = optuna.create_study(direction="maximize")
        assert warm.warm_start(study, SPACE, {**KEY, **change}, JUDGED) == []
        assert study.trials == [] and warm.ATTR not in study.user_attrs


def test_a_configuration_this_space_does_not_offer_is_left_out(tmp_path):
    _first_search(tmp_path)
    narrower = SearchSpace(**{**SPACE.to_dict(), "batch_sizes": [32, 128]})
    study = optuna.create_study(direction="maximize")
    assert warm.warm_start(study, narrower, KEY, JUDGED) == []  # every trial ran at batch 64
    wider = SearchSpace(**{**SPACE.to_dict(), "batch_sizes": [32, 64, 128, 256]})
    study = optuna.create_study(direction="maximize")
    warm.warm_start(study, wider, KEY, JUDGED)
    assert len(study.trials) == 3
    # the study's own trials then suggest from the same distributions: no clash with the imported ones
    trial = study.ask()
    import strategies

    strategies.sample(trial, wider)
    study.tell(trial, 1.0)


def test_a_verdict_reached_under_other_accuracy_settings_is_dropped_and_the_figures_kept(tmp_path):
    verdict = {"verdict": "passed", "constraint": -1.0}
    _first_search(tmp_path, accuracy=verdict)
    same = optuna.create_study(direction="maximize")
    warm.warm_start(same, SPACE, KEY, JUDGED)
    assert TrialRecord.of(same.trials[1]).accuracy == verdict
    other = optuna.create_study(direction="maximize")
    warm.warm_start(other, SPACE, KEY, {**JUDGED, "method": "held-out"})
    assert TrialRecord.of(other.trials[1]).accuracy is None and other.trials[1].value == 2000.0


def test_a_corrupt_or_foreign_evidence_file_starts_cold_without_an_error(tmp_path):
    path = warm.evidence_path(KEY)
    path.parent.mkdir(parents=True, exist_ok=True)
    for text in ("{not json", json.dumps({"format": warm.FORMAT, "key": {**KEY, "torch": "1.0"}, "runs": []}),
                 json.dumps({"format": 999, "key": KEY, "runs": []})):
        path.write_text(text)
        study = optuna.create_study(direction="maximize")
        assert warm.warm_start(study, SPACE, KEY, JUDGED) == []
    path.unlink()


def test_fresh_the_environment_and_replay_start_cold(tmp_path, monkeypatch):
    spec = WorkloadSpec(model="resnet18")
    monkeypatch.delenv(warm.FRESH_ENV, raising=False)
    assert warm.starts_warm(SearchConfig(workload=spec))
    assert not warm.starts_warm(SearchConfig(workload=spec, fresh=True))
    (tmp_path / "study.db").touch()
    assert not warm.starts_warm(SearchConfig(workload=spec, replay=tmp_path))
    monkeypatch.setenv(warm.FRESH_ENV, "1")
    assert not warm.starts_warm(SearchConfig(workload=spec))


def test_the_evidence_gets_what_it_would_have_proposed_queued(tmp_path):
    """The plain recipe measured by an earlier search: its neighbours are queued before the first trial,
    except the one that search measured."""
    _first_search(tmp_path)
    study = optuna.create_study(direction="maximize")
    warm.warm_start(study, SPACE, KEY, JUDGED)
    # the search queues its seeds before it starts (autotune.search.seeds): a queued seed is not a trial run
    seed = _params("fp32", 128, "off")
    study.enqueue_trial(seed, user_attrs={"role": "known-good"})
    assert warm.propose_from_evidence(study, queue.Feeder(proposers=[Neighbours(SPACE, None)]).propose) == 3
    queued = [t.system_attrs["fixed_params"] for t in queue.queued(study)]
    assert len(queued) > 1 and _params("bf16", 64, "default", "channels_last") not in queued
    assert all(TrialRecord.of(t).role == "steered" for t in queue.queued(study)
               if t.system_attrs["fixed_params"] != seed)
    # a study that has run a trial of its own has had its proposals
    trial = study.ask()
    study.tell(trial, 1500.0)
    assert warm.propose_from_evidence(study, queue.Feeder(proposers=[Neighbours(SPACE, None)]).propose) == 0


def test_the_recommendation_an_earlier_search_measured_keeps_that_searchs_compile(tmp_path):
    first, out = _first_search(tmp_path)
    (out / compile_cache.ARCHIVE).write_bytes(b"zip")
    (out / "config.json").write_text(json.dumps({"study": {"trial_number": 2}}))
    study = optuna.create_study(direction="maximize")
    warm.warm_start(study, SPACE, KEY, JUDGED)
    assert TrialRecord.of(best_trial(study)).warm_from["number"] == 2
    second = tmp_path / "second"
    (second / "logs").mkdir(parents=True)
    assert keep_compile_cache(study, second) == {compile_cache.ARCHIVE: second / compile_cache.ARCHIVE}
    assert (second / compile_cache.ARCHIVE).read_bytes() == b"zip"
    # not where the earlier folder recommends another trial
    (out / "config.json").write_text(json.dumps({"study": {"trial_number": 1}}))
    assert keep_compile_cache(study, second) == {}


def test_the_cache_is_trimmed_least_recently_used_first_and_keeps_the_searches(tmp_path):
    root = cache_root()
    entries = []
    for i in range(4):  # four compiles of 1 MiB, used one after another
        folder = root / "compile" / "fxgraph" / f"k{i}"
        folder.mkdir(parents=True, exist_ok=True)
        for part in ("a", "b"):
            (folder / part).write_bytes(b"x" * 2**19)
            os.utime(folder / part, (time.time() - 1000 + i, time.time() - 1000 + i))
        entries.append(folder)
    searches = root / "searches" / "kept.json"
    searches.parent.mkdir(parents=True, exist_ok=True)
    searches.write_text("{}")
    before = trim_cache(10 * 2**30)
    assert before["freed_bytes"] == 0 and before["bytes"] >= 4 * 2**20
    after = trim_cache(before["bytes"] - 2**20 - 1)  # one entry's worth and a byte less: two go, the oldest
    assert after["freed_bytes"] == 2 * 2**20 and after["bytes"] == before["bytes"] - 2 * 2**20
    assert [e.exists() for e in entries] == [False, False, True, True]
    assert searches.exists()
    for folder in entries[2:]:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def test_cache_limit_is_a_size_or_a_clear_error():
    spec = WorkloadSpec(model="resnet18")
    assert SearchConfig(workload=spec, cache_limit="5GiB").cache_limit == 5 * 2**30
    with pytest.raises(ConfigError, match="--cache-limit '5 potatoes': write a size like"):
        SearchConfig(workload=spec, cache_limit="5 potatoes")


TINY = ["--model", "fake_models:tiny_cnn", "--device", "cpu", "--input-shape", "3x32x32", "--num-classes", "10",
        "--min-measure-time", "0.3", "--early-stop-below", "0", "--precisions", "fp32,bf16", "--trials", "3"]


@pytest.mark.slow
def test_a_second_search_runs_none_of_what_the_first_measured_and_fresh_starts_over(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(warm.FRESH_ENV)
    run_cli("search", *TINY, "--out", str(tmp_path / "first"))
    proc = run_cli("search", *TINY, "--out", str(tmp_path / "second"))
    assert "warm start: 3 trials measured by an earlier search" in " ".join(proc.stderr.split())
    first = pd.read_csv(tmp_path / "first" / "trials.csv")
    second = pd.read_csv(tmp_path / "second" / "trials.csv")
    imported = second[second["warm_from"].notna()]
    assert len(imported) == 3 and imported["warm_from"].str.startswith(str(tmp_path / "first")).all()
    assert sorted(imported["samples_per_s"]) == sorted(first["samples_per_s"].dropna())
    # the baseline and the plain recipe are the first search's: none of its own has those roles
    own = second[second["warm_from"].isna()]
    assert not own["role"].isin(["baseline", "plain-recipe"]).any()
    assert len(own[own["duplicate_of"].isna()]) >= 1  # it measured something new
    assert "**Earlier searches:** warm start: 3 trials" in (tmp_path / "second" / "report.md").read_text()
    data = json.loads((tmp_path / "second" / "config.json").read_text())
    assert data["figures"]["samples_per_s"] >= first["samples_per_s"].max()
    # --fresh: the baseline is measured again
    run_cli("search", *TINY, "--out", str(tmp_path / "third"), "--fresh")
    third = pd.read_csv(tmp_path / "third" / "trials.csv")
    assert third["warm_from"].isna().all() and third.loc[0, "role"] == "baseline"
    assert "cache:" in proc.stderr


@pytest.mark.gpu
@pytest.mark.slow
def test_on_a_gpu_the_second_search_loads_the_first_ones_compiles_and_measures_something_new(tmp_path, monkeypatch):
    """Two short compiled searches of a small ResNet on the GPU: the second starts with the first's
    trials, runs neither its baseline nor its plain recipe, and measures configurations the first did not."""
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(warm.FRESH_ENV)
    small = ["--model", "resnet18", "--input-shape", "3x64x64", "--device", "cuda", "--batch-size", "64",
             "--trials", "4", "--no-accuracy-check"]
    run_cli("search", *small, "--out", str(tmp_path / "first"))
    proc = run_cli("search", *small, "--out", str(tmp_path / "second"))
    first = pd.read_csv(tmp_path / "first" / "trials.csv")
    second = pd.read_csv(tmp_path / "second" / "trials.csv")
    own = second[second["warm_from"].isna() & second["duplicate_of"].isna() & second["status"].eq("ok")]
    print(f"\nfirst: {first[['number', 'role', 'config', 'samples_per_s', 'compile_s']].to_string()}\n"
          f"second: {second[['number', 'role', 'warm_from', 'config', 'samples_per_s', 'compile_s']].to_string()}")
    assert "warm start:" in proc.stderr
    kept = first[first["duplicate_of"].isna() & first["state"].isin(["COMPLETE", "PRUNED"])]
    assert second["warm_from"].notna().sum() == len(kept)
    assert not own["role"].isin(["baseline", "plain-recipe"]).any() and len(own) >= 1
    assert not set(own["config"]) & set(first["config"])


def test_replayed_from_the_h100_second_search_a_compile_that_cannot_finish_is_not_started():
    """reports/warm-start-h100-e2adee6/r50-second: a second 5-minute ResNet-50 search started with the
    first's five trials and 270 s left, and ran max-autotune on the first's best (predicted 207 s); it was
    still compiling when the budget cut it at 262 s. Replayed from its study: with 270 s left the planner
    runs a neighbour that fits, and with 560 s the max-autotune compile."""
    from optuna.trial import create_trial

    from autotune.search.planner import Planner
    from autotune.search.plain_recipe import GrowToFit

    db = ROOT / "reports" / "warm-start-h100-e2adee6" / "r50-second" / "study.db"
    src = optuna.load_study(study_name=None, storage=f"sqlite:///{db}")
    space = SearchSpace.from_dict(src.user_attrs["space"])
    study = optuna.create_study(direction="maximize")
    for t in src.trials:
        if TrialRecord.of(t).warm_from is not None:
            study.add_trial(create_trial(state=t.state, params=t.params, distributions=t.distributions,
                                         values=t.values, user_attrs=t.user_attrs, system_attrs=t.system_attrs))
    feeder = queue.Feeder(proposers=[GrowToFit(space, None), Neighbours(space, None)])
    assert warm.propose_from_evidence(study, feeder.propose) == 5
    planner = Planner(space, walls=warm.warm_walls(study))
    chosen = {left: planner.choose(study, left_s=left) for left in (270.0, 560.0)}
    modes = {left: queue.queued_trial(study, plan.number).system_attrs["fixed_params"]["compile.mode"]
             for left, plan in chosen.items()}
    assert modes[560.0] == "max-autotune-no-cudagraphs" and 270.0 < chosen[560.0].cost_s < 560.0
    assert modes[270.0] != "max-autotune-no-cudagraphs" and chosen[270.0].cost_s < 270.0


def test_replayed_from_the_second_h100_run_a_compile_the_budget_cut_is_not_started_again_where_it_cannot_finish():
    """reports/warm-start-h100-df7a3cd/r50-second: with max-autotune's 7x prior the second ResNet-50 search
    still predicted the first's best compiled in max-autotune at 234 s (its default compile took 35 s) with
    270 s left, and the budget cut it after 267 s, compiling. Replayed from its study: without that cut the
    planner picks it again; with the cut trial as evidence (kept for the next search), max-autotune is
    expected to take at least twice the 267 s, and the planner runs a candidate that fits."""
    from optuna.trial import create_trial

    from autotune.search.planner import Planner
    from autotune.search.plain_recipe import GrowToFit
    from autotune.priors import prior

    db = ROOT / "reports" / "warm-start-h100-df7a3cd" / "r50-second" / "study.db"
    src = optuna.load_study(study_name=None, storage=f"sqlite:///{db}")
    space = SearchSpace.from_dict(src.user_attrs["space"])
    cut = src.trials[15]
    assert cut.state == TrialState.FAIL and "ran out 267 s into this trial" in cut.user_attrs["reason"]

    def replay(with_cut: bool):
        study = optuna.create_study(direction="maximize")
        for t in src.trials:
            if TrialRecord.of(t).warm_from is not None:
                study.add_trial(create_trial(state=t.state, params=t.params, distributions=t.distributions,
                                             values=t.values, user_attrs=t.user_attrs, system_attrs=t.system_attrs))
        if with_cut:  # as the objective now records it, and warm.remember keeps it for the next search
            study.add_trial(create_trial(state=TrialState.FAIL, params=cut.params, distributions=cut.distributions,
                                         user_attrs={**cut.user_attrs, "cut_after_s": 267.0, "warm_from": {
                                             "out_dir": "r50-second", "study": src.study_name, "number": 15,
                                             "finished": "2026-12-07T14:47:00"}}))
        feeder = queue.Feeder(proposers=[GrowToFit(space, None), Neighbours(space, None)])
        warm.propose_from_evidence(study, feeder.propose)
        plan = Planner(space, walls=warm.warm_walls(study)).choose(study, left_s=270.0)
        return queue.queued_trial(study, plan.number).system_attrs["fixed_params"]["compile.mode"], plan

    mode, plan = replay(with_cut=False)
    assert mode == "max-autotune-no-cudagraphs" and plan.cost_s < 270.0  # what the GPU run did
    mode, plan = replay(with_cut=True)
    assert mode != "max-autotune-no-cudagraphs" and plan.cost_s < 270.0
    assert prior("trial", "cut", "cost over its seconds") * 267.0 > 270.0


def test_a_trial_the_budget_cut_is_kept_for_the_next_search_as_a_bound_on_its_cost(tmp_path):
    import strategies
    from autotune.search.walls import cut_floors

    study, out = _first_search(tmp_path)
    fixed = optuna.trial.FixedTrial(_params("bf16", 128, "default", "channels_last"))
    knobs = strategies.sample(fixed, SPACE)
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.FAIL, params=dict(fixed.params), distributions=dict(fixed.distributions),
        user_attrs={"reason": "the search budget ran out 267 s into this trial", "cut_after_s": 267.0,
                    "knobs": strategies.knobs_to_dict(knobs)}))
    assert cut_floors(study.trials) == {"default": 534.0}
    warm.remember(study, out, KEY, JUDGED)
    second = optuna.create_study(direction="maximize")
    used = warm.warm_start(second, SPACE, KEY, JUDGED)
    assert used[0]["trials"] == 3  # measured; the cut one is evidence of a cost, not a measurement
    (failed,) = [t for t in second.trials if t.state == TrialState.FAIL]
    assert TrialRecord.of(failed).cut_after_s == 267.0 and TrialRecord.of(failed).warm_from is not None
    assert cut_floors(second.trials) == {"default": 534.0}
