"""compile knob on CPU: which modes are offered when, a compiled tiny model trains like the eager
one, and compile time is recorded apart from warm-up and step time (measure, worker, objective,
budget estimate, trials.csv, report)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path

import optuna
import pytest
import torch

import strategies
from autotune.search.queue import Feeder
from autotune.deploy.config import TunedConfig
from autotune.trial.measure import MeasureSettings, measure
from autotune.search.objective import Objective
from strategies import describe
from autotune.report.render import write_report
from autotune.report.export import trials_frame
from autotune.trial.instruments import cache_outcome
from autotune.trial.runner import run_worker
from autotune.space import SearchSpace
from autotune.search.budget import estimate_next_wall
from autotune.search.walls import compile_prior_s, expected_wall, trial_cost_s, trial_wall
from autotune.search.options import SearchConfig
from autotune.priors import prior
from autotune.search.space import build_space
from autotune.trial.record import TrialRecord
from autotune.workload.models import WorkloadSpec
from conftest import TESTS, measured, workers_answer_ok
from strategies import compile as compile_strategy
from strategies.compile import Compile

optuna.logging.set_verbosity(optuna.logging.WARNING)

CPU_SPACE = SearchSpace(device="cpu", batch_sizes=[8], base_batch_size=8, compile_modes=["off", "default"])
TINY = WorkloadSpec(model="fake_models:tiny_cnn", input_shape=(3, 16, 16), num_classes=10)
MAX_AUTOTUNE_COST = prior("compile.mode", "max-autotune-no-cudagraphs", "compile cost")


pytestmark = pytest.mark.usefixtures("restore_backend_flags")


def _info(works: bool = True, reason: str = "") -> dict:
    return {"precisions": ["fp32"], "input_dim": 4, "misaligned": {}, "compile": {"works": works, "reason": reason}}


# which modes, when ------------------------------------------------------------------------------


def test_candidates() -> None:
    assert compile_strategy.candidates("cuda") == ["off", "default", "max-autotune-no-cudagraphs",
                                                   "reduce-overhead", "max-autotune"]
    assert compile_strategy.candidates("cpu") == ["off", "default"]  # no CUDA-graph modes on a CPU
    with pytest.raises(ValueError, match="compile.mode 'fast': choose from off, default"):
        Compile.Config(mode="fast")


@pytest.mark.parametrize(("device", "wanted", "works", "expected"), [
    ("cuda", None, True, compile_strategy.candidates("cuda")),  # on a GPU by default
    ("cuda", False, True, ["off"]),                              # refused
    ("cpu", None, True, ["off"]),                                # CPU: only when asked for
    ("cpu", True, True, ["off", "default"]),
])
def test_build_space_compile_modes(device: str, wanted, works: bool, expected: list[str]) -> None:
    config = SearchConfig(workload=TINY, compile=wanted)
    info = _info(works)
    if device == "cuda":
        info["precisions"] = ["fp32", "bf16"]
    assert build_space(config, device, info).compile_modes == expected


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compile_that_does_not_work_is_not_offered_and_says_why(device: str) -> None:
    config = SearchConfig(workload=TINY, compile=True)
    with pytest.warns(UserWarning, match="torch.compile is not searched.*no C\\+\\+ compiler"):
        space = build_space(config, device, _info(False, "no C++ compiler"))
    assert space.compile_modes == ["off"]


def test_untuned_space_is_eager_with_no_parameter() -> None:
    trial = optuna.create_study().ask()
    assert Compile().suggest(trial, SearchSpace(device="cuda"), {}) == Compile.Config(mode="off")
    assert trial.params == {}
    assert strategies.build_recipe({"compile": Compile.Config()}, "cuda").compile_mode is None


def test_replay_and_describe() -> None:
    for seed in range(10):
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed)).ask()
        knobs = strategies.sample(trial, CPU_SPACE)
        assert strategies.sample(optuna.trial.FixedTrial(dict(trial.params)), CPU_SPACE) == knobs
        text = describe(strategies.knobs_to_dict(knobs))
        assert ("compile default" in text) == (knobs["compile"].mode == "default")


@pytest.mark.slow
def test_the_probe_check_compiles_on_this_cpu() -> None:
    # CI has a C++ toolchain; without one this is the message the search would show
    result = compile_strategy.check_compile("cpu")
    assert result["works"], result["reason"]


# a compiled model trains as the eager one does ---------------------------------------------------


def _train(mode: str, steps: int = 3) -> tuple[list[float], torch.nn.Module, torch.nn.Module]:
    import fake_models

    cfg = TunedConfig.from_params({"compile.mode": mode}, CPU_SPACE)
    torch.manual_seed(0)
    original = fake_models.tiny_cnn(10)
    optimizer = torch.optim.SGD(original.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = cfg.prepare(original, optimizer)
    step = cfg.train_step(model, optimizer, torch.nn.functional.cross_entropy)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g))
               for _ in range(steps)]
    return [float(step(x, y)) for x, y in batches], model, original


@pytest.mark.slow
def test_a_compiled_step_compiles_its_loss_and_an_eager_one_does_not() -> None:
    import fake_models

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float(), targets)

    for mode, compiled in (("off", False), ("default", True)):
        cfg = TunedConfig.from_params({"compile.mode": mode}, CPU_SPACE)
        model = fake_models.tiny_cnn(10)
        step = cfg.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
        # torch.compile's wrapper keeps the function it compiles
        assert (step.loss_fn is not loss_fn) is compiled
        assert getattr(step.loss_fn, "_torchdynamo_orig_callable", loss_fn) is loss_fn


@pytest.mark.slow
def test_compiled_model_trains_to_the_same_loss_as_eager() -> None:
    eager, eager_model, _ = _train("off")
    compiled, model, original = _train("default")
    assert model is original  # compiled in place: same module, parameters, state_dict keys
    assert list(model.state_dict()) == list(eager_model.state_dict())
    assert model._compiled_call_impl is not None
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


# compile time apart ------------------------------------------------------------------------------


@pytest.mark.slow
def test_measure_times_setup_steps_apart() -> None:
    calls = []

    def step() -> None:
        calls.append(1)
        time.sleep(0.25 if len(calls) <= 2 else 0.002)  # the first two steps "compile"

    settings = MeasureSettings(min_warmup_steps=1, max_warmup_s=5, min_steps=5, min_time_s=0.05, max_steps=50)
    m = measure(step, "cpu", settings, setup_steps=2)
    assert m.compile_s >= 0.5 and m.num_setup_steps == 2
    assert m.step_time_ms < 50 and m.warmup_s < 0.5  # neither holds the compile
    eager = measure(lambda: time.sleep(0.002), "cpu", settings)
    assert eager.compile_s == 0.0 and eager.num_setup_steps == 0
    with pytest.raises(ValueError, match="setup_steps must not be negative"):
        measure(step, "cpu", settings, setup_steps=-1)


@pytest.mark.slow
def test_worker_trial_records_compile_time_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))  # the worker imports fake_models
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))  # an empty compile cache
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    knobs = strategies.sample(optuna.trial.FixedTrial({"compile.mode": "default"}), CPU_SPACE)
    request = {"mode": "trial", "space": CPU_SPACE.to_dict(), "knobs": strategies.knobs_to_dict(knobs),
               "workload": TINY.to_dict(), "seed": 0,
               "measure": MeasureSettings(min_warmup_steps=1, max_warmup_s=10, min_steps=3, min_time_s=0.2,
                                          max_steps=30, max_remeasure=0).to_dict()}
    result = run_worker(request, timeout_s=300, log_path=tmp_path / "trial.log")
    assert result["status"] == "ok", result.get("reason") or result.get("log_tail")
    f = result["figures"]
    assert f["num_setup_steps"] == 1 and f["compiled_graphs"] >= 1
    # compiling takes seconds, several slow steps' worth: it is in none of the timed steps
    assert f["compile_s"] > 3 * f["step_time_p90_ms"] / 1e3
    assert f["compile_s"] + f["warmup_s"] + f["measure_s"] < result["wall_s"]
    assert result["knobs"]["compile"] == {"mode": "default"}
    assert f["compile_cache"]["fx_graph_misses"] >= 1 and f["compile_cache"]["fx_graph_hits"] == 0
    assert (tmp_path / "cache" / "compile").is_dir()
    # the next trial of the same graph (another worker: a later trial, or a later search) loads it
    again = run_worker(request, timeout_s=300, log_path=tmp_path / "again.log")["figures"]
    assert again["compile_cache"]["fx_graph_hits"] >= 1 and again["compile_cache"]["fx_graph_misses"] == 0
    assert cache_outcome(again["compile_cache"]) == "hit" and cache_outcome(f["compile_cache"]) == "miss"
    assert again["compile_s"] < f["compile_s"]


def test_objective_gives_compile_trials_time_to_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_worker(request, *, timeout_s, log_path, spare=False, on_progress=None):
        seen[request["knobs"]["compile"]["mode"]] = timeout_s
        figures = {"samples_per_s": 100.0, "step_time_ms": 80.0, "peak_memory_bytes": 1, "warmup_s": 1.0,
                   "measure_s": 2.0, "build_s": 0.5, "compile_s": 30.0, "loss_finite": True}
        return {"status": "ok", "figures": figures, "wall_s": 40.0, "worker_start_s": 1.0}

    monkeypatch.setattr("autotune.search.objective.run_worker", fake_worker)
    objective = Objective(space=CPU_SPACE, workload=TINY.to_dict(), measure={}, input_on_device=False, seed=0,
                          trial_timeout_s=100.0)
    study = optuna.create_study(direction="maximize")
    for mode in ("off", "default"):
        study.enqueue_trial({"compile.mode": mode})
    study.optimize(objective, n_trials=2)
    assert seen == {"off": 100.0, "default": 100.0 + compile_strategy.COMPILE_ALLOWANCE_S["default"]}
    assert compile_strategy.COMPILE_ALLOWANCE_S["max-autotune"] >= 600  # minutes of autotuning
    assert study.trials[1].user_attrs["timing"]["compile_s"] == 30.0


def test_budget_estimate_accounts_for_compile_trials() -> None:
    walls = [(10.0, False), (12.0, False), (200.0, True)]
    study = optuna.create_study()
    assert estimate_next_wall(study, []) == 0.0
    # nothing queued: each kind weighted by how often it came
    assert estimate_next_wall(study, walls) == pytest.approx(2 / 3 * 11.0 + 1 / 3 * 200.0)
    study.enqueue_trial({"compile.mode": "default"})
    assert estimate_next_wall(study, walls) == 200.0  # the queued seed compiles
    study2 = optuna.create_study()
    study2.enqueue_trial({"compile.mode": "off"})
    assert estimate_next_wall(study2, walls) == 11.0
    assert estimate_next_wall(study2, [(10.0, False)]) == 10.0


def test_before_any_compiled_trial_a_compile_is_expected_to_cost_the_prior() -> None:
    eager = [(10.0, False), (12.0, False)]
    assert expected_wall(eager, True, compile_prior_s=60.0) == 71.0  # eager median + the prior
    assert expected_wall(eager + [(200.0, True)], True, compile_prior_s=60.0) == 200.0  # measured wins
    assert expected_wall([(200.0, True)], False) == 200.0 and expected_wall([], True, 60.0) == 0.0
    # the prior grows with the model: ResNet-50's 126 leaf modules compiled in about a minute
    assert compile_prior_s({"num_leaf_modules": 126}) == 60.0
    assert compile_prior_s({"num_leaf_modules": 364}) == pytest.approx(173.3, abs=0.1)  # ResNet-152
    assert compile_prior_s({"num_leaf_modules": 3}) == 15.0 and compile_prior_s({}) == 60.0
    study = optuna.create_study()
    study.enqueue_trial({"compile.mode": "default"})
    assert estimate_next_wall(study, eager, compile_prior_s=60.0) == 71.0
    # with less left than the compile needs, the queued compile gives way to its eager twin
    assert estimate_next_wall(study, eager, left_s=50.0, compile_prior_s=60.0) == 11.0


def test_a_trials_cost_scales_its_compile_by_the_mode_and_the_precision() -> None:
    walls = [(10.0, False), (12.0, False), (80.0, True)]  # eager 11 s; a default-mode bf16 compile 69 s more
    assert trial_cost_s(walls, "off", "fp8") == 11.0  # no compile, nothing to scale
    assert trial_cost_s(walls, "default", "bf16") == 80.0
    assert trial_cost_s(walls, "default", "fp8") == pytest.approx(11.0 + 69.0 * 1.6)
    assert trial_cost_s(walls, "max-autotune", "bf16") == pytest.approx(11.0 + 69.0 * MAX_AUTOTUNE_COST)
    assert trial_cost_s(walls, "regional", "fp8") == pytest.approx(11.0 + 69.0 * 0.4 * 1.6)
    # before any compiled trial: the prior is the compile's share; before any trial, unmeasured_s too
    assert trial_cost_s(walls[:2], "default", "fp8", compile_prior_s=60.0) == pytest.approx(11.0 + 96.0)
    assert trial_cost_s([], "default", "bf16", compile_prior_s=60.0, unmeasured_s=10.0) == 70.0
    # compiled trials measured shorter than eager ones (caches warm): their median, unscaled
    assert trial_cost_s([(30.0, False), (20.0, True)], "default", "fp8") == 20.0


def test_a_compile_loaded_from_the_cache_counts_as_an_eager_wall_not_as_a_compiles_cost() -> None:
    """ViT-B/16 on the H100 (ec835cb): the FP32 baseline (20.1 s), the plain recipe compiled cold (52.6 s),
    then two one-knob moves whose compile loaded from its cache (22.0 and 22.4 s). A max-autotune compile
    is its prior times the cold compile's share; counted among the compiled walls, the hits made it 32 s."""
    space = dataclasses.replace(CPU_SPACE, compile_modes=["off", "default", "max-autotune-no-cudagraphs"])
    study = optuna.create_study(direction="maximize")
    runs = [("off", None, 20.1), ("default", "miss", 52.6), ("default", "hit", 22.0), ("default", "hit", 22.4),
            ("default", "partial", 40.0)]
    records = [TrialRecord.of(measured(study, space, {"compile.mode": mode}, 1.0, status="ok",
                                       knobs={"compile": {"mode": mode}},
                                       timing={"wall_s": wall, **({"compile_cache": cache} if cache else {})}))
               for mode, cache, wall in runs]
    assert [trial_wall(r) for r in records] == [(20.1, False), (52.6, True), (22.0, False), (22.4, False),
                                                (40.0, True)]  # a partial hit compiled some graphs cold
    walls = [trial_wall(r) for r in records[:4]]
    assert trial_cost_s(walls, "max-autotune-no-cudagraphs", "bf16") == pytest.approx(
        22.0 + (52.6 - 22.0) * MAX_AUTOTUNE_COST)
    assert trial_cost_s(walls, "default", "bf16") == 52.6
    # what the hits' figures had predicted, counted as compiles
    as_compiled = [(20.1, False), (52.6, True), (22.0, True), (22.4, True)]
    assert trial_cost_s(as_compiled, "max-autotune-no-cudagraphs", "bf16") == pytest.approx(
        20.1 + (22.4 - 20.1) * MAX_AUTOTUNE_COST)  # the compiled walls' median, 22.4 s: a compile far too cheap
    # a trial that never ran, or whose result was copied, is not counted
    queued = TrialRecord.of(measured(study, space, {"compile.mode": "default"}, 1.0))
    assert trial_wall(queued) is None


def test_a_compile_that_would_end_past_the_budget_is_not_started_and_its_eager_twin_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ran = []
    workers_answer_ok(monkeypatch, lambda request: ran.append(request["knobs"]["compile"]["mode"]))
    objective = Objective(space=CPU_SPACE, workload=TINY.to_dict(), measure={}, input_on_device=False, seed=0,
                          trial_timeout_s=100.0, deadline=time.time() + 40.0,
                          screen_compiles=False)  # this rule alone (eager screening: tests/test_screening.py)
    objective.walls, objective.compile_prior_s = [(5.0, False)], 60.0  # a compile: about 65 s; 40 s left
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({"compile.mode": "default", "batch_size.batch_size": 8}, user_attrs={"role": "known-good"})
    study.optimize(objective, n_trials=2, callbacks=[Feeder()])  # the queue hands Optuna the twin
    skipped, twin = study.trials
    assert skipped.state == optuna.trial.TrialState.PRUNED and "status" not in skipped.user_attrs  # not counted
    assert skipped.user_attrs["reason"].startswith("not started: a compiled trial takes about 65 s here")
    assert twin.params["compile.mode"] == "off" and twin.state == optuna.trial.TrialState.COMPLETE
    assert twin.user_attrs["role"] == "steered" and twin.user_attrs["steered_by"] == {"trial": 0, "rule": "budget"}
    assert ran == ["off"]
    # time enough: the compiled trial runs
    objective.deadline = time.time() + 300.0
    study.enqueue_trial({"compile.mode": "default", "batch_size.batch_size": 8})
    study.optimize(objective, n_trials=1)
    assert ran == ["off", "default"]


def test_an_fp8_compile_is_expected_to_take_longer_than_a_bf16_one_before_it_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With 80 s left after a 5 s eager trial and a 60 s compile prior, a bf16 compile (65 s) starts; an
    fp8 one (5 + 60 x 1.6 = 101 s) gives way to its eager twin."""
    ran = []
    workers_answer_ok(monkeypatch, lambda request: ran.append((request["knobs"]["precision"]["mode"],
                                                                request["knobs"]["compile"]["mode"])))
    space = dataclasses.replace(CPU_SPACE, device="cuda", precisions=["fp32", "bf16", "fp8"])
    for precision, runs in (("bf16", "default"), ("fp8", "off")):
        objective = Objective(space=space, workload=TINY.to_dict(), measure={}, input_on_device=False, seed=0,
                              trial_timeout_s=100.0, deadline=time.time() + 80.0, screen_compiles=False)
        objective.walls, objective.compile_prior_s = [(5.0, False)], 60.0
        study = optuna.create_study(direction="maximize")
        study.enqueue_trial({"compile.mode": "default", "precision.mode": precision, "batch_size.batch_size": 8})
        ran.clear()
        study.optimize(objective, n_trials=2 if runs == "off" else 1, callbacks=[Feeder()])
        assert ran == [(precision, runs)], ran
        if runs == "off":
            reason = study.trials[0].user_attrs["reason"]
            assert reason.startswith("not started: a compiled trial takes about 101 s")


def _study_with_a_compiled_best() -> optuna.Study:
    study = optuna.create_study(direction="maximize")
    for number, (mode, rate, compile_s) in enumerate([("off", 100.0, 0.0), ("default", 180.0, 42.0)]):
        knobs = strategies.knobs_to_dict(strategies.sample(optuna.trial.FixedTrial({"compile.mode": mode}),
                                                           CPU_SPACE))
        figures = {"samples_per_s": rate, "step_time_ms": 8000 / rate, "peak_memory_bytes": 2**30,
                   "spread": 0.01, "noisy": False, "num_steps": 20, "final_loss": 2.0, "loss_finite": True,
                   "compile_s": compile_s, "warmup_s": 1.0, "measure_s": 2.0, "build_s": 0.1}
        timing = {"worker_start_s": 1.0, "wall_s": 5.0 + compile_s, "warmup_s": 1.0, "measure_s": 2.0,
                  "build_s": 0.1, "compile_s": compile_s}
        attrs = {"knobs": knobs, "figures": figures, "timing": timing, "status": "ok"}
        if number == 0:
            attrs["role"] = "baseline"
        study.add_trial(optuna.trial.create_trial(
            params={"compile.mode": mode}, value=rate, user_attrs=attrs,
            distributions={"compile.mode": optuna.distributions.CategoricalDistribution(["off", "default"])}))
    return study


def test_trials_csv_and_report_show_compile_time(tmp_path: Path) -> None:
    study = _study_with_a_compiled_best()
    frame = trials_frame(study)
    assert list(frame["compile_s"]) == [0.0, 42.0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        files = write_report(study, tmp_path)
    md = files["report.md"].read_text()
    assert "Compile time" in md and "42.0 s once" in md
    html = files["report.html"].read_text()
    assert "compile s" in html and "compiling 42.0 s" in html


def test_the_stop_rule_expects_the_cost_of_the_trial_the_planner_runs_next() -> None:
    """With the planner, the next trial is the one it chooses, not the queue's first: a queued compile
    behind a queued baseline is not what runs next."""
    from autotune.search.planner import Planner

    walls = [(10.0, False), (12.0, False), (200.0, True)]
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({"compile.mode": "default"}, user_attrs={"role": "known-good"})
    study.enqueue_trial({"compile.mode": "off"}, user_attrs={"role": "baseline"})
    assert estimate_next_wall(study, walls) == 200.0  # the queue's first
    planner = Planner(CPU_SPACE, walls=walls)
    assert estimate_next_wall(study, walls, planner=planner) == 11.0  # the baseline runs first


# regional compilation ----------------------------------------------------------------------------


def _tiny_llama():
    from autotune.workload import hub

    config = "num_hidden_layers=10,hidden_size=32,intermediate_size=64,num_attention_heads=4,num_key_value_heads=2,vocab_size=512"
    return hub.build_hf("hf:llama", hub.parse_model_config(config), 16)["model"]


def test_regional_is_offered_on_a_gpu_only_for_a_model_with_repeated_blocks() -> None:
    assert "regional" in compile_strategy.candidates("cuda", blocks=12)
    assert "regional" not in compile_strategy.candidates("cuda", blocks=1)
    assert "regional" not in compile_strategy.candidates("cpu", blocks=12)


@pytest.mark.slow
def test_regional_compiles_each_block_once_and_trains_as_eager(restore_backend_flags) -> None:
    """Ten decoder layers, more than Dynamo's default recompile limit of 8: one graph serves them all,
    and the loss and gradients are eager's."""
    from torch._dynamo.utils import counters

    from autotune.workload import hub

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager, regional = _tiny_llama(), _tiny_llama()
    regional.load_state_dict(eager.state_dict())
    assert compile_strategy.compile_regions(regional) == 10
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in regional.model.layers)
    x, y = hub.random_tokens(2, torch.Generator().manual_seed(1), vocab_size=512, seq_len=16)
    losses = []
    for model in (eager, regional):
        loss = hub.causal_lm_loss(model(x).logits, y)
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], atol=1e-5)
    for a, b in zip(eager.parameters(), regional.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1


def test_regional_without_blocks_compiles_the_whole_model_and_says_so() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="no repeated blocks"):
        assert compile_strategy.compile_regions(model) == 1
    assert model._compiled_call_impl is not None


def test_regional_exports_as_code_where_a_framework_compiles_whole_models() -> None:
    from autotune.deploy import exports

    space = SearchSpace(device="cuda", precisions=["bf16"], batch_sizes=[8], base_batch_size=8,
                        compile_modes=["off", "default", "regional"])
    cfg = TunedConfig.from_params({"precision.mode": "bf16", "compile.mode": "regional"}, space)
    args, unsupported = exports.hf_training_args(cfg)
    assert args["torch_compile"] is False and "torch_compile_mode" not in args
    assert "compile_regions(model)" in next(u["why"] for u in unsupported if u["setting"] == "compile.mode")
    assert exports.accelerate_config(cfg).config["dynamo_config"] == {}
    assert "compile.mode" not in {u["setting"] for u in exports.lightning_settings(cfg)["unsupported"]}


def test_the_fp32_baseline_times_fewer_steps_than_a_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its figure is every speed-up's denominator, not a close call between candidates: 8 steps at least
    (with the 2 s and the spread's re-measure), not 20; a setting already below that is kept."""
    from autotune.search.objective import BASELINE_MIN_STEPS
    from autotune.trial.measure import MeasureSettings

    asked = []
    workers_answer_ok(monkeypatch, lambda request: asked.append(request["measure"]["min_steps"]))
    for settings, expected in ((MeasureSettings.for_device("cuda"), [BASELINE_MIN_STEPS, 20]),
                               (MeasureSettings.for_device("cpu"), [3, 3])):
        objective = Objective(space=CPU_SPACE, workload=TINY.to_dict(), measure=settings.to_dict(),
                              input_on_device=False, seed=0, trial_timeout_s=100.0, screen_compiles=False)
        study = optuna.create_study(direction="maximize")
        study.enqueue_trial({"compile.mode": "off"}, user_attrs={"role": "baseline"})
        study.enqueue_trial({"compile.mode": "default"}, user_attrs={"role": "known-good"})
        asked.clear()
        study.optimize(objective, n_trials=2)
        assert asked == expected
    assert BASELINE_MIN_STEPS == 8 and MeasureSettings().min_steps == 20


def test_a_compile_that_traces_a_measured_graph_is_costed_as_loaded_from_the_cache() -> None:
    """hf:gpt2 on the H200 (3445a3e): the plain recipe compiled in 25.4 s; its twin with gradients zeroed
    in place traced the same graph and loaded it in 3.7 s."""
    from autotune.priors import prior
    from autotune.search.walls import cached_compile_saving

    cached_share = prior("compile.mode", None, "cached compile share")

    bar = {"precision.mode": "bf16", "batch_size.batch_size": 64, "compile.mode": "default",
           "streams.num_streams": 1, "optimizer.set_to_none": True, "vocab_padding.multiple": 1}
    cold = {"compile_s": 25.4, "compile_cache": "miss"}
    side_stream = {**bar, "streams.num_streams": 2}
    assert cached_compile_saving(side_stream, [(bar, cold)]) == pytest.approx(25.4 * (1 - cached_share))
    hit = {"compile_s": 3.7, "compile_cache": "hit"}
    in_place = {**bar, "optimizer.set_to_none": False}
    assert cached_compile_saving(side_stream, [(bar, cold), (in_place, hit)]) == pytest.approx(25.4 - 3.7)
    # another graph: a padded vocabulary, another precision, batch or compile mode; or nothing compiled
    for other in ({"vocab_padding.multiple": 64}, {"precision.mode": "fp16"}, {"batch_size.batch_size": 48},
                  {"compile.mode": "max-autotune-no-cudagraphs"}, {"compile.mode": "off"}):
        assert cached_compile_saving({**side_stream, **other}, [(bar, cold)]) == 0.0, other
    assert cached_compile_saving(side_stream, [(in_place, hit)]) == 0.0  # a hit saved nothing to repeat
    # the measured trials are passed whole: an eager one, its side stream's graph uncompiled, counts for nothing
    eager = ({**side_stream, "compile.mode": "off"}, {"compile_s": 0.0, "wall_s": 10.2})
    assert cached_compile_saving(side_stream, [eager, (bar, cold)]) == pytest.approx(25.4 * (1 - cached_share))
    assert cached_compile_saving(side_stream, [eager]) == 0.0
