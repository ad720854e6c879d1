"""allocator knob: the CUDA caching allocator's expandable segments, offered on CUDA, set before the
model is built (the trial worker, autotune.load, TunedConfig.prepare), listed by the framework exports
with the environment variable that sets it, left out of the accuracy check, and traded by the memory
model for the gap between reserved and allocated memory measured without it. On a CPU: the run-time
setter is replaced by a recorder; the last test needs a GPU."""

from __future__ import annotations

import optuna
import pytest
import torch

import strategies
from autotune.accuracy.settings import NUMERICS_KNOBS, numerics_key
from autotune.deploy import config as config_module, exports
from autotune.deploy.config import TunedConfig
from autotune.space import SearchSpace
from autotune.search import plain_recipe
from autotune.search.levers import LEVERS, levers_of
from autotune.search.memory import MemoryModel, family
from autotune.search.neighbours import Neighbours
from autotune.priors import prior
from autotune.trial import work as worker
from strategies.allocator import ENVIRONMENT_FIX, SETTING, Allocator, set_allocator

optuna.logging.set_verbosity(optuna.logging.WARNING)

GIB = 2**30
PARAM = "allocator.expandable_segments"
GPU_SPACE = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[1, 2, 4, 8, 16], base_batch_size=16,
                        compile_modes=["off", "default"], optimizer_implementations=["foreach", "fused"],
                        choices={"allocator": [False, True]})
CPU_SPACE = SearchSpace(device="cpu", batch_sizes=[8], base_batch_size=8)
WORKLOAD = {"model": "mlp", "input_shape": [32], "num_classes": 10}


@pytest.fixture
def setter_calls(monkeypatch) -> list[str]:
    """Every call of the allocator's run-time setter, recorded instead of made (no GPU here)."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda setting: calls.append(setting))
    return calls


def _cfg(space: SearchSpace, **params) -> TunedConfig:
    return TunedConfig.from_params({**plain_recipe.params(space, 4), **params}, space)


def _knobs(space: SearchSpace, params: dict) -> dict:
    return strategies.knobs_to_dict(strategies.sample(optuna.trial.FixedTrial(params), space))


# the knob --------------------------------------------------------------------------------------


def test_offered_on_cuda_only_and_not_where_this_torch_cannot_set_it(monkeypatch) -> None:
    knob = Allocator()
    assert knob.offer(None, "cuda", {}, {}) == {"choices": {"allocator": [False, True]}}
    assert knob.offer(None, "cpu", {}, {}) == {}
    monkeypatch.delattr(torch.cuda.memory, "_set_allocator_settings")
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
    assert knob.offer(None, "cuda", {}, {}) == {}


def test_sampled_replayed_and_recorded_through_the_strategies(tmp_path) -> None:
    on = _cfg(GPU_SPACE, **{PARAM: True})
    assert on.knobs["allocator"].expandable_segments and on.recipe.expandable_segments
    assert "expandable segments" in strategies.describe(strategies.knobs_to_dict(on.knobs))
    assert any(ENVIRONMENT_FIX in note for note in on.notes)
    on.save(tmp_path / "config.json")
    loaded = TunedConfig.load(tmp_path / "config.json", here=False)
    assert loaded.knobs == on.knobs and loaded.recipe.expandable_segments
    assert strategies.knobs_from_dict(strategies.knobs_to_dict(on.knobs)) == on.knobs
    # the baseline and the known-good seeds keep PyTorch's default
    assert strategies.seed_params(GPU_SPACE, tuned=True)[PARAM] is False
    assert strategies.seed_params(GPU_SPACE, tuned=False)[PARAM] is False
    assert plain_recipe.params(GPU_SPACE, 4)[PARAM] is False
    # a CPU space has no such parameter, and its recipe keeps the default
    cpu = TunedConfig.from_params(strategies.seed_params(CPU_SPACE, tuned=False), CPU_SPACE)
    assert PARAM not in cpu.params and not cpu.recipe.expandable_segments


def test_set_allocator_sets_expandable_segments_only_for_a_cuda_recipe_with_the_knob_on(setter_calls) -> None:
    assert set_allocator(_cfg(GPU_SPACE, **{PARAM: True}).recipe)
    assert not set_allocator(_cfg(GPU_SPACE, **{PARAM: False}).recipe)
    cpu = TunedConfig.from_params({}, CPU_SPACE).recipe
    cpu.expandable_segments = True  # a CPU has no caching allocator to set
    assert not set_allocator(cpu)
    assert setter_calls == [SETTING]


def test_a_torch_without_the_setter_warns_with_the_environment_fix(monkeypatch) -> None:
    monkeypatch.delattr(torch.cuda.memory, "_set_allocator_settings")
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
    with pytest.warns(UserWarning, match="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        assert not set_allocator(_cfg(GPU_SPACE, **{PARAM: True}).recipe)


# set before the model is built ----------------------------------------------------------------


class _Built(Exception):
    """Raised by the stand-in for the workload's build: the order of calls up to it is the test's."""


@pytest.mark.parametrize("mode", ["trial", "memory"])
def test_the_worker_sets_the_allocator_after_the_cap_and_before_building_the_model(mode, monkeypatch) -> None:
    order: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda setting: order.append(setting))
    monkeypatch.setattr(worker, "cap_memory", lambda limit: order.append("cap"))

    def build(spec, **kwargs):
        order.append("build")
        raise _Built

    monkeypatch.setattr(worker, "build", build)
    run = worker.run_trial if mode == "trial" else worker.probe_memory
    for on in (True, False):
        order.clear()
        request = {"mode": mode, "space": GPU_SPACE.to_dict(), "workload": WORKLOAD, "batches": [1, 2],
                   "knobs": _knobs(GPU_SPACE, {**plain_recipe.params(GPU_SPACE, 4), PARAM: on}),
                   "measure": {"min_steps": 2}, "memory_limit_bytes": 24 * GIB}
        with pytest.raises(_Built):
            run(request)
        assert order == (["cap", SETTING, "build"] if on else ["cap", "build"])


def test_load_sets_the_allocator_for_a_cuda_config_used_here_and_prepare_sets_it_first(
        tmp_path, setter_calls, monkeypatch) -> None:
    path = tmp_path / "config.json"
    _cfg(GPU_SPACE, **{PARAM: True}).save(path)
    TunedConfig.load(path, here=False)  # read as data (autotune export): this process's CUDA untouched
    assert setter_calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = config_module.load(path)
    assert setter_calls == [SETTING]  # before the user's code builds its model
    monkeypatch.setattr(config_module.runtime, "prepare_model", lambda model, recipe: setter_calls.append("prepare"))
    cfg.prepare(torch.nn.Linear(2, 2))
    assert setter_calls == [SETTING, SETTING, "prepare"]
    setter_calls.clear()
    _cfg(GPU_SPACE, **{PARAM: False}).save(path)
    config_module.load(path)
    assert setter_calls == []


# exports and accuracy --------------------------------------------------------------------------


def test_the_framework_exports_list_it_with_the_environment_variable() -> None:
    on, off = _cfg(GPU_SPACE, **{PARAM: True}), _cfg(GPU_SPACE, **{PARAM: False})
    for export in (lambda c: exports.hf_training_args(c).unsupported, lambda c: exports.accelerate_config(c).unsupported,
                   lambda c: exports.lightning_settings(c)["unsupported"]):
        (entry,) = [u for u in export(on) if u["setting"] == PARAM]
        assert entry["value"] is True and ENVIRONMENT_FIX in entry["why"]
        assert PARAM not in {u["setting"] for u in export(off)}


def test_it_is_not_a_numerics_knob() -> None:
    assert "allocator" not in NUMERICS_KNOBS
    bf16 = _knobs(GPU_SPACE, {**plain_recipe.params(GPU_SPACE, 4)})
    assert numerics_key({**bf16, "allocator": {"expandable_segments": True}}) == numerics_key(bf16)


# the memory model and the plain recipe's neighbours -----------------------------------------------


def _model(gap_gib: float | None) -> MemoryModel:
    """Peaks made up for the test: the plain recipe at 20 GiB at batch 1 and 21 at batch 2 (19 + 1 a
    sample), with ``gap_gib`` reserved above its allocated peak at batch 2 where given."""
    model = MemoryModel(24 * GIB)
    fam = family(_knobs(GPU_SPACE, plain_recipe.params(GPU_SPACE, 1)))
    model.add(fam, 1, 20 * GIB)
    model.add(fam, 2, 21 * GIB)
    if gap_gib is not None:
        model.gaps[fam][2] = gap_gib * GIB
    return model


def test_expandable_segments_are_predicted_from_the_measured_twin_less_its_gap_and_without_one_save_nothing():
    on = _knobs(GPU_SPACE, {**plain_recipe.params(GPU_SPACE, 4), PARAM: True})
    assert [lever.param for lever in levers_of(on)] == [PARAM]
    base = 19 * GIB + 4 * GIB  # the twin's line at batch 4
    saving = 4 * GIB - prior("allocator.expandable_segments", True, "gap slack") * (base - 4 * GIB)
    assert _model(4.0).predict(on) == pytest.approx(base - saving)
    assert _model(None).predict(on) == pytest.approx(base)
    assert _model(0.5).predict(on) == pytest.approx(base)  # a gap under the slack saves nothing
    off = _knobs(GPU_SPACE, plain_recipe.params(GPU_SPACE, 4))
    assert _model(4.0).predict(off) == pytest.approx(base)


def _capped_study(gap_gib: float | None) -> optuna.Study:
    """The plain recipe measured under a 24 GiB cap at batches 1 and 2 (peaks made up for the test, as in
    _model), its reserved and allocated peaks recorded where ``gap_gib`` is given."""
    study = optuna.create_study(direction="maximize")
    for batch, value, peak in ((1, 30.0, 20.0), (2, 45.0, 21.0)):
        params = plain_recipe.params(GPU_SPACE, batch)
        figures = {"peak_memory_bytes": peak * GIB}
        if gap_gib is not None:
            figures.update(peak_reserved_bytes=(peak - 0.5) * GIB, peak_allocated_bytes=(peak - 0.5 - gap_gib) * GIB)
        study.enqueue_trial(params, user_attrs={"role": plain_recipe.ROLE, "status": "ok", "figures": figures,
                                                "knobs": _knobs(GPU_SPACE, params)})
        trial = study.ask()
        strategies.sample(trial, GPU_SPACE)
        study.tell(trial, value)
    return study


def test_under_a_cap_the_neighbours_queue_expandable_segments_at_the_batch_the_gap_frees():
    study = _capped_study(4.0)
    model = MemoryModel.from_study(study, 24 * GIB)
    assert model.gaps[family(_knobs(GPU_SPACE, plain_recipe.params(GPU_SPACE, 2)))] == {1: 4 * GIB, 2: 4 * GIB}
    neighbours = Neighbours(GPU_SPACE, limit_bytes=24 * GIB)
    ((params, why),) = [(p, w) for p, w in neighbours.levers(study, study.best_trial) if p.get(PARAM)]
    # 19 + 4 = 23 GiB at batch 4 is over 92% of 24 (22.08); less 4 - 5% of 19 = 3.05 GiB it fits; at 8 it would not
    assert params["batch_size.batch_size"] == 4 and "allocator True" in why
    unmeasured = _capped_study(None)  # no reserved and allocated peaks: no saving predicted, nothing queued
    assert not [p for p, _ in neighbours.levers(unmeasured, unmeasured.best_trial) if p.get(PARAM)]


def test_the_lever_is_free_in_speed_and_saves_no_size_of_the_model():
    (lever,) = [lever for lever in LEVERS if lever.param == PARAM]
    assert lever.saves_gap and lever.speed == 1.0 and lever.per_sample_share == 1.0
    assert lever.fixed_saving({"num_parameters": 1e9}) == 0.0


# on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_cuda_a_trial_with_expandable_segments_reserves_less_above_what_it_allocates():
    from autotune.trial.measure import MeasureSettings
    from autotune.trial.runner import run_worker

    space = SearchSpace(device="cuda", precisions=["fp32"], batch_sizes=[64], base_batch_size=64,
                        choices={"allocator": [False, True]})
    quick = MeasureSettings(min_warmup_steps=2, max_warmup_s=5, min_steps=5, min_time_s=0.3, max_remeasure=0)
    gaps = {}
    for on in (False, True):
        knobs = strategies.sample(optuna.trial.FixedTrial({PARAM: on}), space)
        result = run_worker({"mode": "trial", "space": space.to_dict(), "knobs": strategies.knobs_to_dict(knobs),
                             "workload": {"model": "resnet50", "input_shape": [3, 224, 224], "num_classes": 1000},
                             "measure": quick.to_dict(), "seed": 0, "profile": False,
                             "memory_limit_bytes": 12 * GIB}, timeout_s=300)
        assert result["status"] == "ok", result
        figures = result["figures"]
        gaps[on] = figures["peak_reserved_bytes"] - figures["peak_allocated_bytes"]
    print(f"\nreserved above allocated: {gaps[False] / GIB:.2f} GiB without, {gaps[True] / GIB:.2f} GiB with")
    assert gaps[True] < gaps[False]
