"""Accuracy checks that cost in proportion: steps planned from the measured step time and the share
of --budget they may spend, the FP32 reference kept across searches, and a recommendation whose
numerics were not checked within the budget saying so."""

from __future__ import annotations

import json
import time

import optuna
import pytest
from optuna.distributions import CategoricalDistribution

from autotune.accuracy.settings import AccuracySettings
from autotune.accuracy.study.gate import REFERENCE_ATTR, SETTINGS_ATTR, AccuracyGate
from autotune.accuracy.study.plan import PLAN_ATTR, describe, fitting_batch, plan, step_time
from autotune.accuracy.study.reference_cache import CACHE_ENV, ReferenceCache, cache_dir, reference_key
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from autotune.search.options import SearchConfig
from autotune.workload.models import WorkloadSpec
from conftest import ROOT, run_cli

optuna.logging.set_verbosity(optuna.logging.WARNING)

SETTINGS = AccuracySettings.for_device("cpu")  # 100 steps at batch 16, 512 held-out samples
SPACE = SearchSpace(device="cpu", precisions=["fp32", "bf16"])
TINY = {"model": "fake_models:tiny_cnn", "input_shape": [3, 32, 32], "num_classes": 10}
SMALL = ["--device", "cpu", "--input-shape", "3x32x32", "--num-classes", "10", "--min-measure-time", "0.3"]
# a check step at batch 16 taking 0.22 s: 45 s (25% of 3 min) / (4 runs x 0.22 s) less the held-out
# evaluation (32 batches, a third of a step each) leaves 40 steps
RATE_FOR_40_STEPS = 16 / 0.22


def _study_with_baseline(samples_per_s: float, worker_start_s: float = 0.0, figures: dict | None = None,
                         build_s: float = 0.0) -> optuna.Study:
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(
        params={"precision.mode": "fp32"}, distributions={"precision.mode": CategoricalDistribution(["fp32", "bf16"])},
        value=samples_per_s, user_attrs={"role": "baseline", "status": "ok", "knobs": {"precision": {"mode": "fp32"}},
                                         "figures": {"samples_per_s": samples_per_s, **(figures or {})},
                                         "timing": {"worker_start_s": worker_start_s, "build_s": build_s}}))
    return study


def test_a_check_worker_build_is_the_model_and_its_preparation_not_the_trial_batches():
    """yield_models:gpt_lm on the H200: its trials built in 4-6.5 s, the plan counted five of those a
    check worker (26.5 s), and its 3-minute search started no check; last session's check workers of
    the same model spent 3.4-5.0 s beside their training runs. A check makes its own data, so where a
    trial recorded its build's parts, only the model, its optimizer and their preparation count."""
    parts = {"build_model_s": 0.7, "build_prepare_s": 0.3, "build_batches_s": 3.5, "build_request_s": 0.5}
    with_parts = _study_with_baseline(150.0, worker_start_s=0.5, build_s=5.0, figures=parts)
    assert step_time(with_parts)["overhead_s"] == pytest.approx(0.5 + 5 * 1.0)
    # a study from before the parts were recorded plans with the whole build, as it did
    assert step_time(_study_with_baseline(150.0, worker_start_s=0.5, build_s=5.0))["overhead_s"] == 0.5 + 5 * 5.0


def _gate(cache_path, **options) -> AccuracyGate:
    return AccuracyGate(settings=SETTINGS, space=SPACE, workload=TINY, timeout_s=300,
                        cache=ReferenceCache(cache_path), **options)


# the plan ----------------------------------------------------------------------------------------

def test_steps_are_scaled_to_the_step_time_and_the_share_of_the_budget():
    measured = {"samples_per_s": RATE_FOR_40_STEPS, "overhead_s": 0.0, "trial": 0, "baseline": True}
    scaled = plan(SETTINGS, budget_s=180, share=0.25, measured=measured)
    assert scaled["steps"] == 40 and scaled["estimate_s"] <= 45
    assert describe(scaled) == "40 steps (scaled to 25% of the 3 min budget)"
    # a larger share, or a faster model, runs the full check
    assert plan(SETTINGS, budget_s=180, share=1.0, measured=measured)["steps"] == SETTINGS.steps
    fast = plan(SETTINGS, budget_s=600, share=0.25, measured={**measured, "samples_per_s": 1e5})
    assert describe(fast) == "100 steps (the full check fits in 25% of the 10 min budget)"
    # worker start-ups come off the share first; a model too slow for it still trains the fewest
    # steps that say anything, and the plan says what they will cost
    slow = plan(SETTINGS, budget_s=40, share=0.25, measured={**measured, "overhead_s": 3.0})
    assert slow["steps"] == 10 and slow["estimate_s"] > 10
    assert describe(slow).startswith("10 steps, the fewest that say anything (scaled to 25% of the 40 s budget")


def test_without_a_held_out_set_no_evaluation_is_counted(tmp_path):
    """hf:llama (2 layers) on the H200: 15 samples/s in FP32, a check batch of 32, and a plan that
    counted 32 held-out batches of evaluation a run (10.7 steps' worth) beside 10 training steps,
    though a language model's random tokens have no held-out set: twice the check's real cost."""
    measured = {"samples_per_s": 15.0, "overhead_s": 15.0, "trial": 0, "baseline": True}
    settings = AccuracySettings.for_device("cuda", batch_size=32)
    with_eval = plan(settings, budget_s=300, share=0.25, measured=measured)  # the default: held_out=True
    without = plan(settings, budget_s=300, share=0.25, measured=measured, held_out=False)
    step_s = 32 / 15.0
    assert with_eval["steps"] == without["steps"] == 10  # the fewest either way, at 2.1 s a step
    assert with_eval["estimate_s"] == pytest.approx(3 * 15.0 + 4 * (10 + 32 / 3) * step_s, abs=0.1)
    assert without["estimate_s"] == pytest.approx(3 * 15.0 + 4 * 10 * step_s, abs=0.1)
    # and it is what the gate plans with when the search tells it there is no held-out set
    study = _study_with_baseline(15.0, figures={"batch_size": 16})
    # a check worker builds the model about five times (its runs and its one-step comparisons)
    assert step_time(_study_with_baseline(15.0, worker_start_s=3.0, build_s=6.0))["overhead_s"] == 3.0 + 5 * 6.0
    estimates = {}
    for held_out in (True, False):
        study.set_user_attr("accuracy_plan", None)
        gate = AccuracyGate(settings=settings, space=SPACE, workload=TINY, timeout_s=300, budget_s=300,
                            scale_steps=True, cache=ReferenceCache(tmp_path), held_out=held_out)
        gate.attach(study)
        gate.settle(study)
        estimates[held_out] = study.user_attrs["accuracy_plan"]["estimate_s"]
    assert estimates[True] - estimates[False] == pytest.approx(4 * 32 / 3 * step_s, abs=0.1)


def test_the_gate_plans_once_from_the_baseline_and_a_resume_keeps_the_steps(tmp_path):
    study = _study_with_baseline(RATE_FOR_40_STEPS)
    assert step_time(study) == {"samples_per_s": RATE_FOR_40_STEPS, "trial": 0, "baseline": True, "overhead_s": 0.0,
                                "worker_start_s": 0.0, "build_s": 0.0, "batch_size": None, "peak_memory_bytes": None,
                                "limit_bytes": None}
    gate = _gate(tmp_path, budget_s=180, scale_steps=True)
    gate.attach(study)
    assert gate.pending and PLAN_ATTR not in study.user_attrs
    gate.settle(study)
    assert gate.settings.steps == 40 and not gate.pending
    assert study.user_attrs[PLAN_ATTR]["steps"] == 40 and study.user_attrs[SETTINGS_ATTR]["steps"] == 40
    # a resume with another budget keeps the study's steps, so its checks compare with the earlier ones
    again = _gate(tmp_path, budget_s=3600, scale_steps=True)
    again.attach(study)
    assert again.settings.steps == 40 and not again.pending
    # --accuracy-steps wins, and says so
    explicit = AccuracyGate(settings=AccuracySettings.for_device("cpu", steps=20), space=SPACE, workload=TINY,
                            timeout_s=300, budget_s=180, cache=ReferenceCache(tmp_path))
    explicit.attach(study)
    assert explicit.settings.steps == 20 and describe(study.user_attrs[PLAN_ATTR]) == "20 steps (--accuracy-steps)"


def test_the_checks_batch_fits_where_the_fp32_baseline_says_the_default_would_not(tmp_path):
    """hf:gpt2 at 1,024 tokens on the H200: the FP32 baseline peaked at 115.9 GiB for batch 64 of
    139.8 GiB, and the check at its default batch (64) ran out of memory. Its FP64 step holds about
    twice an FP32 step: batch 32 keeps it within 90% of the GPU."""
    GiB = 2**30
    settings = AccuracySettings.for_device("cuda")  # batch 64
    study = _study_with_baseline(50.0, figures={"batch_size": 64, "peak_memory_bytes": 115.86 * GiB,
                                                "device_total_bytes": 139.80 * GiB})
    measured = step_time(study)
    assert measured["limit_bytes"] == 139.80 * GiB
    assert fitting_batch(64, measured) == 32
    planned = plan(settings, budget_s=420, share=0.25, measured=measured)
    assert planned["batch_size"] == 32 and planned["default_batch_size"] == 64
    assert "batch 32 instead of 64, for the FP32 baseline's memory" in describe(planned)
    # --memory-limit is the limit where it is smaller; a model with room keeps the default batch
    study.set_user_attr("memory_limit_bytes", 70 * GiB)
    assert fitting_batch(64, step_time(study)) == 16
    roomy = {**measured, "peak_memory_bytes": 25 * GiB, "batch_size": 256}
    assert fitting_batch(64, roomy) == 64 and "batch_size" not in plan(settings, budget_s=420, share=0.25,
                                                                        measured=roomy)
    # a 16-bit trial, not the FP32 baseline, bounds FP32's bytes a sample at twice its own; a CPU (no
    # device memory) says nothing
    assert fitting_batch(64, {**measured, "baseline": False}) == 16
    assert fitting_batch(64, {**measured, "limit_bytes": None}) == 64
    # the gate checks at the planned batch, and a resume keeps it
    gate = AccuracyGate(settings=settings, space=SPACE, workload=TINY, timeout_s=300, budget_s=420,
                        scale_steps=True, cache=ReferenceCache(tmp_path))
    gate.attach(study)
    gate.settle(study)
    assert gate.settings.batch_size == 16 and study.user_attrs[SETTINGS_ATTR]["batch_size"] == 16
    again = AccuracyGate(settings=settings, space=SPACE, workload=TINY, timeout_s=300, budget_s=600,
                         scale_steps=True, cache=ReferenceCache(tmp_path))
    again.attach(study)
    assert again.settings.batch_size == 16 and again.settings.steps == gate.settings.steps


def test_without_a_budget_or_a_measured_trial_the_default_steps_are_kept(tmp_path):
    study = optuna.create_study(direction="maximize")
    gate = _gate(tmp_path, budget_s=None, scale_steps=True)
    gate.attach(study)
    assert not gate.pending and study.user_attrs[PLAN_ATTR] == {"how": "default", "steps": 100}
    empty = optuna.create_study(direction="maximize")
    due = _gate(tmp_path, budget_s=180, scale_steps=True)
    due.attach(empty)
    due.settle(empty)  # nothing measured, no check due: still open
    assert due.pending
    due.settle(empty, force=True)  # a check is due: the default, and why
    assert describe(empty.user_attrs[PLAN_ATTR]) == "100 steps (the default: no trial was measured to scale it by)"


def test_accuracy_share_is_validated(cli_main):
    spec = WorkloadSpec(model="fake_models:tiny_cnn")
    for share in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="--accuracy-share .*more than 0 and at most 1"):
            SearchConfig(workload=spec, accuracy_share=share)
    assert SearchConfig(workload=spec, accuracy_share=1.0).accuracy_share == 1.0
    proc = cli_main("search", "--model", "fake_models:tiny_cnn", "--accuracy-share", "2", "--trials", "1")
    assert proc.returncode != 0 and "--accuracy-share 2" in proc.stderr


# the FP32 reference, kept across searches ----------------------------------------------------------

REFERENCE = {"steps": 100, "initial_loss": 2.3, "final_loss": 0.3, "held_out_accuracy": 95.0,
             "nonfinite_losses": 0, "params_finite": True, "skipped_steps": 0, "device_name": "cpu", "torch": "2.x"}


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" / "accuracy"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_dir().parts[-3:] == (".cache", "autotune", "accuracy")


def test_the_key_covers_workload_settings_torch_device_and_the_model_source(tmp_path, monkeypatch):
    key = reference_key(TINY, SETTINGS, device_name="cpu", torch_version="2.x")
    assert key == reference_key(dict(TINY), SETTINGS, device_name="cpu", torch_version="2.x")
    others = [reference_key({**TINY, "input_shape": [3, 64, 64]}, SETTINGS, device_name="cpu", torch_version="2.x"),
              reference_key(TINY, AccuracySettings.for_device("cpu", seed=1), device_name="cpu", torch_version="2.x"),
              reference_key(TINY, AccuracySettings.for_device("cpu", steps=40), device_name="cpu", torch_version="2.x"),
              reference_key(TINY, SETTINGS, device_name="NVIDIA H200", torch_version="2.x"),
              reference_key(TINY, SETTINGS, device_name="cpu", torch_version="2.y")]
    assert len({key, *others}) == 6
    # thresholds only judge a run: the same reference serves them all
    assert key == reference_key(TINY, AccuracySettings.for_device("cpu", max_accuracy_drop=2.0), device_name="cpu",
                                torch_version="2.x")
    # an edited model file is another model
    module = tmp_path / "my_net.py"
    module.write_text("def build(num_classes=10):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = {**TINY, "model": "my_net:build"}
    before = reference_key(mine, SETTINGS, device_name="cpu", torch_version="2.x")
    module.write_text("def build(num_classes=10):\n    return 1\n")
    assert reference_key(mine, SETTINGS, device_name="cpu", torch_version="2.x") != before


def test_an_unreadable_file_is_a_miss_and_an_unwritable_folder_only_warns(tmp_path):
    cache = ReferenceCache(tmp_path / "accuracy")
    assert cache.load("k") is None
    assert cache.store("k", REFERENCE, {"model": "m"}) and cache.load("k") == REFERENCE
    cache.path("k").write_text("{not json")
    assert cache.load("k") is None
    cache.path("k").write_text(json.dumps({"key": "other", "reference": REFERENCE}))  # not this key's
    assert cache.load("k") is None
    (tmp_path / "a file").write_text("")
    blocked = ReferenceCache(tmp_path / "a file" / "accuracy")
    with pytest.warns(UserWarning, match="could not be kept .* AUTOTUNE_CACHE_DIR"):
        assert not blocked.store("k", REFERENCE, {})


def test_the_gate_takes_the_reference_from_the_cache_instead_of_training_it(tmp_path):
    """FP32's evidence is the reference itself: found in the cache, no worker runs at all."""
    import torch

    cache = ReferenceCache(tmp_path)
    cache.store(reference_key(TINY, SETTINGS, device_name="cpu", torch_version=torch.__version__), REFERENCE, {})
    study = optuna.create_study(direction="maximize")
    gate = _gate(tmp_path)
    gate.attach(study)
    started = time.time()
    judged = gate.evidence(study, {"precision": {"mode": "fp32"}}, check=True)
    assert time.time() - started < 2 and gate.spent_s == 0  # no worker was started
    assert judged["verdict"] == "passed" and judged["reference_source"] == "cache"
    kept = study.user_attrs[REFERENCE_ATTR.format(fingerprint=SETTINGS.fingerprint())]
    assert kept["reference_source"] == "cache"  # the study keeps it, for its export and its resumes
    # a corrupt file is trained again, not trusted
    for path in tmp_path.glob("*.json"):
        path.write_text("garbage")
    fresh = _gate(tmp_path)
    assert fresh._reference(optuna.create_study()) is None


def test_no_reference_is_trained_when_the_share_cannot_follow_it_with_a_check(tmp_path, monkeypatch):
    """hf:llama (2 layers) on the H200, --budget 6m: the FP32 reference took 94 s of the checks' 90 s
    share, and nothing was checked with it; the trials lost that time. The plan now says what a first
    verdict costs (the reference worker and one configuration's), and no reference is started that
    the share cannot follow with a check."""
    import autotune.trial.runner as runner

    started: list[dict] = []

    def fake_worker(request, **_):
        started.append(request)
        reference = {**REFERENCE, "device_name": "cpu", "torch": "x"}
        return {"status": "ok", "run": {**REFERENCE, "numerics_key": "k"}, "reference": reference}

    monkeypatch.setattr(runner, "run_worker", fake_worker)
    # the Llama's figures: 14.6 samples/s in FP32, a worker start of 12.6 s and builds of 6 s
    measured = {"samples_per_s": 14.6, "overhead_s": 12.6 + 5 * 6.0, "trial": 0, "baseline": True}
    planned = plan(SETTINGS, budget_s=360, share=0.25, measured=measured, held_out=False)
    run_s = planned["steps"] * 16 / 14.6
    assert planned["first_verdict_s"] == pytest.approx(2 * measured["overhead_s"] + 3 * run_s, abs=0.1)
    assert planned["first_verdict_s"] > 0.25 * 360 and planned["first_verdict_s"] < planned["estimate_s"]
    for share, runs in ((0.25, 0), (0.5, 1)):
        study = _study_with_baseline(14.6, worker_start_s=12.6, build_s=6.0)
        gate = _gate(tmp_path / str(share), budget_s=360, share=share, scale_steps=True, held_out=False)
        gate.attach(study)
        judged = gate.evidence(study, {"precision": {"mode": "bf16"}}, check=True)
        assert len(started) == runs and (judged is None) == (runs == 0), share
        assert gate.spent_s < 1
        started.clear()
    # a reference already there (the file cache: an earlier search's) needs one run: checked
    study = _study_with_baseline(14.6, worker_start_s=12.6, build_s=6.0)
    gate = _gate(tmp_path / "0.25", budget_s=360, share=0.25, scale_steps=True, held_out=False)
    gate.attach(study)
    gate.settle(study)
    study.set_user_attr(REFERENCE_ATTR.format(fingerprint=gate.settings.fingerprint()), REFERENCE)
    assert gate.evidence(study, {"precision": {"mode": "bf16"}}, check=True) is not None and len(started) == 1
    # after the search the recommendation may still take what is left of the budget (ensure_recommendation)
    late = _study_with_baseline(14.6, worker_start_s=12.6, build_s=6.0)
    gate = _gate(tmp_path / "late", budget_s=360, share=0.25, scale_steps=True, held_out=False)
    gate.attach(late)
    assert gate.evidence(late, {"precision": {"mode": "bf16"}}, check=True, within_share=False) is not None


# end to end ----------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("method", ["held-out", "parity"])
def test_a_second_search_reuses_the_fp32_reference(tmp_path, monkeypatch, method):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    search = ["search", "--model", "fake_models:tiny_cnn", *SMALL, "--trials", "2", "--accuracy-steps", "20",
              "--accuracy-method", method]
    run_cli(*search, "--out", str(tmp_path / "first"))
    first = json.loads((tmp_path / "first" / "config.json").read_text())["accuracy"]
    assert first["verdict"] == "passed" and first["reference_source"] == "trained"
    kept = list((tmp_path / "cache" / "accuracy").glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["about"]["model"] == "fake_models:tiny_cnn"

    run_cli(*search, "--out", str(tmp_path / "second"))
    second = json.loads((tmp_path / "second" / "config.json").read_text())["accuracy"]
    assert second["verdict"] == "passed" and second["reference_source"] == "cache"
    # the held-out check's evidence names the reference's final loss (a parity verdict's band is the kept
    # reference's: which configuration is best, FP32 or bf16, may differ between the two runs)
    assert second.get("reference_final_loss") == first.get("reference_final_loss")
    assert len(list((tmp_path / "cache" / "accuracy").glob("*.json"))) == 1


@pytest.mark.slow
def test_a_search_whose_accuracy_check_is_slow_ends_within_its_budget_and_says_so(tmp_path):
    """The CI test of issue 17: the check of this model (its held-out evaluation sleeps) outlasts
    the whole budget; the search still ends within budget + 15 s, and every output says the
    recommendation's numerics were not checked within the budget."""
    out = tmp_path / "out"
    started = time.monotonic()
    proc = run_cli("search", "--model", "fake_models:slow_check_cnn", *SMALL, "--budget", "40s",
                   "--accuracy-method", "held-out", "--out", str(out))
    elapsed = time.monotonic() - started
    assert elapsed < 40 + 15, f"a 40 s budget took {elapsed:.0f} s"
    accuracy = json.loads((out / "config.json").read_text())["accuracy"]
    assert accuracy["verdict"] == "not checked" and "not checked within the budget" in accuracy["reason"]
    # the check's steps were planned from the baseline's step time, to fit in a quarter of the budget
    assert accuracy["plan"]["how"] == "scaled" and 10 <= accuracy["plan"]["steps"] < 100
    said = " ".join(proc.stderr.split())
    assert "accuracy: not checked:" in said and "not checked within the budget" in said
    assert f"accuracy check: {accuracy['plan']['steps']} steps" in said and "of the 40 s budget" in said
    for report in ("report.md", "report.html"):
        text = " ".join((out / report).read_text().split())
        assert "not checked within the budget" in text and "accuracy check:" in text, report


@pytest.mark.slow
def test_the_live_line_hears_the_checks_steps_and_a_hopeless_final_check_is_not_started(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))  # the worker imports fake_models
    settings = AccuracySettings.for_device("cpu", steps=20)
    # slow_cnn sleeps 50 ms a step: each 20-step run lasts a second, several polls
    gate = AccuracyGate(settings=settings, space=SPACE, workload={**TINY, "model": "fake_models:slow_cnn"},
                        timeout_s=300, cache=ReferenceCache(tmp_path))
    heard: list[str] = []
    gate.on_phase = heard.append
    study = optuna.create_study(direction="maximize")
    gate.attach(study)
    judged = gate.evidence(study, {"precision": {"mode": "bf16"}}, check=True, label="#3")
    assert judged["verdict"] in ("passed", "violated", "unstable")
    steps = [w for w in heard if w.startswith("accuracy check of #3: ") and w.endswith("/20 steps")]
    assert any(w.startswith("accuracy check of #3: FP32 reference") for w in steps)
    assert any(w.startswith("accuracy check of #3: bf16 ") for w in steps)
    # a final check whose planned cost is more than the budget left is not started
    study.set_user_attr(PLAN_ATTR, {"how": "scaled", "steps": 20, "estimate_s": 400.0})
    assert gate.estimate_s(study) == pytest.approx(100.0)  # the reference is known: one run of four
    slow = _study_with_baseline(100.0)
    slow.set_user_attr(PLAN_ATTR, {"how": "scaled", "steps": 20, "estimate_s": 400.0})
    started = time.time()
    assert gate.ensure_recommendation(slow, deadline=time.time() + 60) is None
    assert time.time() - started < 2
