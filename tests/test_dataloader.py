"""The dataloader knob: offered only with --data, replayed from config.json, handed to user code
as DataLoader arguments; and a trial fed by a real DataLoader says whether it is data-bound."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import optuna
import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import autotune
import strategies
from autotune.deploy.config import TunedConfig
from autotune.search.findings import derive
from autotune.trial.measure import is_data_bound
from autotune.trial.measure import MeasureSettings
from autotune.space import SearchSpace
from autotune.search.steering import complete_params
from autotune.search.options import SearchConfig
from autotune.cli.run import run_search
from autotune.search.seeds import seed_configurations
from autotune.search.space import build_space, same_space
from autotune.workload.models import WorkloadSpec
from conftest import ROOT
from strategies import dataloader as dataloader_strategy

optuna.logging.set_verbosity(optuna.logging.WARNING)

INFO = {"precisions": ["fp32", "bf16"], "input_dim": 4, "misaligned": {}, "fp32_layer_kinds": []}
SPEC = WorkloadSpec(model="fake_models:tiny_cnn", input_shape=(3, 32, 32), num_classes=10)
SHAPE = (3, 32, 32)


def make_jpegs(out, *args: str) -> str:
    """scripts/make_jpegs.py, run as a user runs it."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_jpegs.py"), str(out), *args],
                          capture_output=True, text=True, timeout=120, check=True)
    return proc.stdout


# datasets for --data package.module:factory (this module is importable: tests/ is on the path) ---


class _Images(Dataset):
    """Random images made once; ``delay_s`` sleeps in every __getitem__, as a slow decode would."""

    def __init__(self, n: int, delay_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn((n, *SHAPE), generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


def slow_data():
    return _Images(64, delay_s=0.004), None


def fast_data():
    return _Images(64, delay_s=0.0), None


# the knob and its space ----------------------------------------------------------------------


def test_offered_only_with_data_and_bounded_by_the_cpus(tmp_path):
    without = build_space(SearchConfig(workload=SPEC, device="cpu", accuracy_check=False), "cpu", INFO)
    assert without.dataloader_workers == [] and not strategies.BY_NAME["dataloader"].applies(without)
    baseline = seed_configurations(without)[0][1]
    assert not any(k.startswith("dataloader.") for k in baseline)
    knobs = strategies.sample(optuna.trial.FixedTrial(baseline), without)
    assert knobs["dataloader"] == dataloader_strategy.DataLoaderStrategy.Config()  # the untuned DataLoader
    # an old config.json's space has no dataloader fields: same as not offered
    old = {k: v for k, v in without.to_dict().items() if not k.startswith("dataloader")}
    assert SearchSpace.from_dict(old) == without
    assert same_space(old, without)  # so a study made before the knob existed resumes

    (tmp_path / "imgs" / "a").mkdir(parents=True)
    torch.save(torch.zeros(1), tmp_path / "imgs" / "a" / "not-an-image.pt")
    with pytest.raises(autotune.ConfigError, match="hold no images"):
        SearchConfig(workload=SPEC, device="cpu", accuracy_check=False, data=str(tmp_path / "imgs"))
    with pytest.raises(autotune.ConfigError, match="--input-on-device"):
        SearchConfig(workload=SPEC, accuracy_check=False, data="test_dataloader:fast_data", input_on_device=True)
    config = SearchConfig(workload=SPEC, device="cpu", accuracy_check=False, data="test_dataloader:fast_data")
    space = build_space(config, "cpu", INFO)
    assert not same_space(old, space)  # ... but not as a search with --data
    cpus = dataloader_strategy.num_cpus()
    assert space.dataloader_workers[0] == 0 and max(space.dataloader_workers) == cpus
    assert space.dataloader_pin_memory == [False]  # nothing to pin for on a CPU
    assert dataloader_strategy.candidates(16) == [0, 1, 2, 4, 8, 16]
    assert dataloader_strategy.candidates(6) == [0, 1, 2, 4, 6]
    # the baseline is the untuned DataLoader, the known-good seeds use every CPU
    seeds = seed_configurations(space)
    assert seeds[0][0] == "baseline" and seeds[0][1]["dataloader.num_workers"] == 0
    assert all(p["dataloader.num_workers"] == cpus for role, p in seeds[1:])


def test_prefetch_only_with_workers_and_fixed_trial_replay():
    space = SearchSpace(device="cuda", batch_sizes=[8], base_batch_size=8, dataloader_workers=[0, 2, 4],
                        dataloader_pin_memory=[False, True], dataloader_prefetch_factors=[2, 4])
    seen = set()
    for seed in range(20):
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed)).ask()
        knobs = strategies.sample(trial, space)
        loader = knobs["dataloader"]
        assert ("dataloader.prefetch_factor" in trial.params) == (loader.num_workers > 0)
        replayed = strategies.sample(optuna.trial.FixedTrial(json.loads(json.dumps(trial.params))), space)
        assert replayed == knobs
        seen.add((loader.num_workers, loader.pin_memory))
    assert {w for w, _ in seen} == {0, 2, 4} and {p for _, p in seen} == {False, True}


def test_dataloader_kwargs_round_trip_through_config_json(tmp_path):
    space = SearchSpace(device="cpu", batch_sizes=[8], base_batch_size=8, dataloader_workers=[0, 1, 2],
                        dataloader_prefetch_factors=[2, 4])
    cfg = TunedConfig.from_params({"dataloader.num_workers": 2, "dataloader.prefetch_factor": 4}, space)
    cfg.save(tmp_path / "config.json")
    loaded = autotune.load(tmp_path / "config.json")
    kwargs = loaded.dataloader_kwargs()
    assert kwargs == {"num_workers": 2, "pin_memory": False, "prefetch_factor": 4, "persistent_workers": True,
                      "drop_last": True}
    assert loaded.dataloader_kwargs(num_workers=8, timeout=30) == {**kwargs, "timeout": 30}  # tuned values win
    # the DataLoader takes them as they are, and every batch has the tuned shape
    loader = DataLoader(_Images(20, 0.0), batch_size=loaded.batch_size, shuffle=True, **kwargs)
    assert [len(x) for x, _ in loader] == [8, 8]
    # tuned to no workers: the arguments the DataLoader refuses without workers are left out
    none = TunedConfig.from_params({"dataloader.num_workers": 0}, space)
    assert none.dataloader_kwargs(prefetch_factor=4, persistent_workers=True) == {
        "num_workers": 0, "pin_memory": False, "drop_last": True}
    # a search without --data did not tune the loader: the user's own values, pinned memory on a GPU
    untuned = TunedConfig.from_params({}, SearchSpace(device="cuda", batch_sizes=[8], base_batch_size=8))
    assert untuned.dataloader_kwargs(num_workers=4) == {"num_workers": 4, "pin_memory": True, "drop_last": True}


def test_data_bound_finding_suggests_more_workers_and_steering_completes_it():
    space = SearchSpace(device="cpu", batch_sizes=[8], base_batch_size=8, dataloader_workers=[0, 1, 2],
                        dataloader_prefetch_factors=[2, 4])
    offered = {"dataloader.num_workers": [0, 1, 2]}
    figures = {"data_bound": True, "loader_fed_samples_per_s": 400.0, "compute_only_samples_per_s": 1800.0,
               "loader_wait_share": 0.7}
    [finding] = derive(None, None, {"dataloader": {"num_workers": 0}}, offered=offered,
                       figures={**figures, "compute_only_samples_per_s": 700.0})
    # one process decodes 400 samples/s, the step takes 700: two workers
    assert finding.rule == "data-bound" and finding.suggest == {"dataloader.num_workers": 2}
    assert "400 samples/s delivered, 700 samples/s possible" in finding.text and "70%" in finding.text
    [finding] = derive(None, None, {"dataloader": {"num_workers": 0}}, offered={"dataloader.num_workers": [0, 1, 8, 16]},
                       figures=figures)
    assert finding.suggest == {"dataloader.num_workers": 8}  # 1800 / 400: five workers, eight offered
    finding = derive(None, None, {"dataloader": {"num_workers": 0}}, offered=offered, figures=figures)[0]
    assert finding.suggest == {"dataloader.num_workers": 2}  # more than the space has: its largest
    # the completed remedy brings the prefetch parameter that workers make meaningful
    params = complete_params({"dataloader.num_workers": 0, **finding.suggest}, space)
    assert params["dataloader.num_workers"] == 2 and params["dataloader.prefetch_factor"] == 2
    [at_max] = derive(None, None, {"dataloader": {"num_workers": 2}}, offered=offered, figures=figures)
    assert at_max.suggest == {} and "DALI" in at_max.text
    assert derive(None, None, {}, offered=offered, figures={**figures, "data_bound": False}) == []
    # below 90% of compute-only with the step waiting for data, or far below it without waits
    assert is_data_bound(800, 1000, 0.10) and is_data_bound(700, 1000, 0.0)
    assert not is_data_bound(950, 1000, 0.5) and not is_data_bound(850, 1000, 0.01)


# trials fed by a real DataLoader -------------------------------------------------------------------


def _fed_trial(data: str, workers: int = 0) -> dict:
    from autotune.trial.work import run_trial

    space = SearchSpace(device="cpu", batch_sizes=[16], base_batch_size=16, thread_counts=[1],
                        dataloader_workers=[0, 1])
    knobs = strategies.sample(optuna.trial.FixedTrial({"dataloader.num_workers": workers}), space)
    settings = MeasureSettings(min_warmup_steps=2, max_warmup_s=1.0, steady_tolerance=0.1, min_steps=10,
                               min_time_s=0.5, max_steps=200, spread_tolerance=0.15, max_remeasure=1)
    result = run_trial({"space": space.to_dict(), "knobs": strategies.knobs_to_dict(knobs), "workload": SPEC.to_dict(),
                        "measure": settings.to_dict(), "data": data, "seed": 0})
    assert result["status"] == "ok", result
    return result["figures"]


@pytest.mark.slow
@pytest.mark.usefixtures("restore_backend_flags")
def test_a_slow_dataset_is_data_bound_and_a_fast_one_is_not():
    slow = _fed_trial("test_dataloader:slow_data")
    # 16 items x 4 ms of "decoding" per step in the training process: the step waits for data
    assert slow["data_bound"] is True, slow
    assert slow["samples_per_s"] == slow["loader_fed_samples_per_s"] < 0.9 * slow["compute_only_samples_per_s"]
    assert slow["samples_per_s"] < 16 / 0.064 * 1.1, slow  # the sleeps alone cap it at 250 samples/s
    assert slow["loader_wait_share"] > 0.5, slow
    # a dataset that only indexes memory: the step never waits. Two separate windows on a shared
    # CPU can differ by more than 10% (0.79x to 1.1x here on a quiet machine), so further trials
    # settle a noisy first one
    for attempt in range(3):
        fast = _fed_trial("test_dataloader:fast_data")
        assert fast["loader_wait_share"] < 0.2, fast  # indexing and collating only
        if not fast["data_bound"]:
            break
    assert fast["data_bound"] is False, fast


@pytest.mark.slow
def test_cpu_search_on_jpegs_records_the_loader_and_reports_it(tmp_path):
    data = tmp_path / "jpegs"
    said = make_jpegs(data, "--num-images", "160", "--classes", "4", "--size", "96", "--jobs", "2")
    assert said.startswith("wrote 160 JPEGs in 4 classes")
    assert sorted(p.name for p in data.iterdir()) == ["class00", "class01", "class02", "class03"]
    out = tmp_path / "out"
    # in process (each trial still in its own worker), with short warm-ups: a shared CPU is noisy
    measure = MeasureSettings(min_warmup_steps=1, max_warmup_s=2.0, steady_tolerance=0.15, min_steps=3,
                              min_time_s=0.3, max_steps=100, spread_tolerance=0.3, max_remeasure=0)
    run_search(SearchConfig(workload=SPEC, device="cpu", trials=2, accuracy_check=False, data=str(data),
                            out_dir=out, measure=measure))
    trials = pd.read_csv(out / "trials.csv")
    trials = trials[trials["state"] == "COMPLETE"]  # a data-bound finding may have queued one more
    assert len(trials) == 2
    assert trials.loc[0, "role"] == "baseline" and trials.loc[0, "param.dataloader.num_workers"] == 0
    for column in ("loader_fed_samples_per_s", "compute_only_samples_per_s", "loader_wait_share"):
        assert (trials[column] > 0).all(), column
    assert (trials["samples_per_s"] == trials["loader_fed_samples_per_s"]).all()
    assert set(trials["data_bound"]) <= {True, False}
    flagged = [is_data_bound(fed, compute, wait) for fed, compute, wait in
               zip(trials["loader_fed_samples_per_s"], trials["compute_only_samples_per_s"], trials["loader_wait_share"])]
    assert list(trials["data_bound"]) == flagged
    for findings, bound in zip(trials["findings"], trials["data_bound"]):
        assert ("data-bound:" in (findings if isinstance(findings, str) else "")) == bool(bound)

    config = json.loads((out / "config.json").read_text())
    assert config["data"] == str(data) and "dataloader" in config["knobs"]
    best = config["figures"]
    cfg = autotune.load(out)
    assert cfg.dataloader_kwargs()["num_workers"] == config["knobs"]["dataloader"]["num_workers"]
    report = (out / "report.md").read_text()
    fed = f"{best['loader_fed_samples_per_s']:,.0f}"
    if best["data_bound"]:
        assert f"data-bound: the data pipeline delivers {fed} samples/s, the CPU could train" in report
    else:
        assert f"the data pipeline keeps the CPU busy (loader-fed {fed} samples/s" in report


def test_a_data_bound_step_that_seldom_waited_is_told_to_try_fewer_workers():
    """The H200 JPEG search's best: 32 workers on 32 cores, the step waited for 0.4% of its batches
    yet delivered 3,211 of a possible 5,485 samples/s; more workers cannot help, fewer may."""
    offered = {"dataloader.num_workers": [0, 1, 2, 4, 8, 16, 32]}
    figures = {"data_bound": True, "loader_fed_samples_per_s": 3211.4, "compute_only_samples_per_s": 5484.7,
               "loader_wait_share": 0.004}
    [finding] = derive(None, None, {"dataloader": {"num_workers": 32}}, offered=offered, figures=figures)
    assert finding.rule == "data-bound" and finding.suggest == {"dataloader.num_workers": 16}
    assert "its 32 workers take CPU time from the training process: 16 workers would leave it more" in finding.text
    [finding] = derive(None, None, {"dataloader": {"num_workers": 8}}, offered={"dataloader.num_workers": [0, 6, 8]},
                       figures=figures)
    assert finding.suggest == {"dataloader.num_workers": 6}  # nothing at half: the next fewer
    # a step that waited is short of workers, not of CPU: more of them, as before
    [finding] = derive(None, None, {"dataloader": {"num_workers": 8}}, offered=offered,
                       figures={**figures, "loader_wait_share": 0.6})
    assert finding.suggest == {"dataloader.num_workers": 16}
    # one worker and still no wait: nothing fewer to try, a cheaper decode is what is left
    [finding] = derive(None, None, {"dataloader": {"num_workers": 1}}, offered={"dataloader.num_workers": [0, 1]},
                       figures=figures)
    assert finding.suggest == {} and "DALI" in finding.text
