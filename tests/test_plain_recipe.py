"""The plain recipe in the search (autotune.search.plain_recipe) and fitting before running
(autotune.search.fit): what it is, at which batch it runs, and the memory probe that sizes it."""

from __future__ import annotations

import dataclasses
import warnings

import optuna
import pytest
from optuna.trial import TrialState

import strategies
from autotune.search import queue
from autotune.space import SearchSpace
from autotune.search import plain_recipe
from autotune.search.fit import Fit, plain_recipe_batch, widen_to_fit
from autotune.search.memory import PROBE_ATTR, MemoryModel, family
from autotune.search.options import SearchConfig
from autotune.search.seeds import seed_configurations
from autotune.search.trials import plain_recipe_trial
from autotune.workload.models import WorkloadSpec

GIB = 2**30
LM = SearchSpace(device="cuda", precisions=["fp32", "tf32", "fp16", "bf16"],
                 batch_sizes=[1, 2, 4, 8, 16, 24, 32, 48, 64], base_batch_size=16, compile_modes=["off", "default"],
                 optimizer_implementations=["foreach", "fused"], cuda_graphs=[False, True], stream_counts=[1, 2])


def _knobs(space, params):
    return strategies.knobs_to_dict(strategies.sample(optuna.trial.FixedTrial(params), space))


def _probed(space, peaks, does_not_fit_at=None):
    """What the memory probe records: the plain recipe's eager configuration and its peaks."""
    eager = {**plain_recipe.params(space, 1), "compile.mode": "off"}
    return {"family": family(_knobs(space, eager)), "peaks": {str(b): p for b, p in peaks.items()},
            "does_not_fit_at": does_not_fit_at}


def test_the_plain_recipe_is_what_a_user_writes_in_five_lines():
    params = plain_recipe.params(LM, 16)
    assert params["precision.mode"] == "bf16" and params["compile.mode"] == "default"
    assert params["optimizer.implementation"] == "fused" and params["streams.num_streams"] == 1
    assert params["cuda_graphs.enabled"] is False
    # fp16 with a GradScaler where the device has no bf16; nothing where it has neither
    fp16 = SearchSpace(device="cuda", precisions=["fp32", "fp16"], batch_sizes=[16], base_batch_size=16)
    assert plain_recipe.params(fp16, 16)["precision.mode"] == "fp16"
    assert "grad_scaler.init_scale" in plain_recipe.params(fp16, 16)
    assert plain_recipe.params(SearchSpace(device="cpu", precisions=["fp32"], batch_sizes=[8], base_batch_size=8),
                               8) is None
    assert plain_recipe.describe(LM) == "bf16 autocast, TF32, cudnn.benchmark, fused optimizer, torch.compile"


def test_the_probe_sizes_the_plain_recipe_to_the_largest_batch_that_fits_up_to_four_times_the_base():
    # 10 GiB fixed, 1 GiB a sample, bf16 eager: under 24 GiB (22 at BACKOFF_FILL's 92%), batch 8 fits
    fit = Fit(probed=_probed(LM, {1: 11 * GIB, 2: 12 * GIB, 4: 14 * GIB}), limit_bytes=24 * GIB, base_fits=False)
    assert plain_recipe_batch(LM, fit) == 8
    # on a GPU with room, 4x the base and no more (64 is offered)
    roomy = Fit(probed=_probed(LM, {1: 11 * GIB, 2: 12 * GIB}), limit_bytes=141 * GIB, base_fits=True)
    assert plain_recipe_batch(LM, roomy) == 64 == 4 * LM.base_batch_size
    # nothing fits but batch 1 ran: the smallest offered
    tight = Fit(probed=_probed(LM, {1: 23 * GIB}, does_not_fit_at=2), limit_bytes=24 * GIB, base_fits=False)
    assert plain_recipe_batch(LM, tight) == 1
    # without a probe (a CPU), the base batch
    assert plain_recipe_batch(LM, None) == 16
    seeds = seed_configurations(LM, 1024, plain_batch=8)
    assert seeds[1] == ("plain-recipe", plain_recipe.params(LM, 8))


def test_a_base_batch_that_does_not_fit_opens_the_range_down_to_one_and_says_how_the_batch_is_kept():
    config = SearchConfig(workload=WorkloadSpec(model="hf:gpt2"))
    fit = Fit(probed=_probed(LM, {1: 11 * GIB, 2: 12 * GIB}), limit_bytes=24 * GIB, base_fits=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert widen_to_fit(config, LM, fit)
    assert config.min_batch_size is None  # the user's options stay as given: the space is built from 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.min_batch_size = 1
    said = str(caught[0].message)
    assert said.startswith("the base batch 16 does not fit (about 26.0 GiB of 24.0 GiB): batches from 1 are searched")
    assert "--global-batch-size 16 keeps it" in said
    # the user's own --min-batch-size, or a base batch that fits: left alone
    pinned = SearchConfig(workload=WorkloadSpec(model="hf:gpt2"), min_batch_size=8)
    assert not widen_to_fit(pinned, LM, fit) and pinned.min_batch_size == 8
    fits = Fit(probed=fit.probed, limit_bytes=24 * GIB, base_fits=True)
    assert not widen_to_fit(SearchConfig(workload=WorkloadSpec(model="hf:gpt2")), LM, fits)


def test_the_probe_primes_the_memory_model_for_families_it_did_not_measure():
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(PROBE_ATTR, _probed(LM, {1: 11 * GIB, 2: 12 * GIB}))
    model = MemoryModel.from_study(study, 24 * GIB)
    fp32 = _knobs(LM, {**plain_recipe.params(LM, 1), "precision.mode": "fp32", "compile.mode": "off"})
    # FP32 holds twice bf16's activations; the fixed part (FP32 weights, grads, AdamW) is the same
    assert model.predict(fp32, 4) == pytest.approx(10 * GIB + 2 * GIB * 4)
    assert model.verdict({**fp32, "batch_size": {"batch_size": 16}}).startswith("predicted not to fit: needs about 42")
    # the back-off of a family with no line of its own follows the probe
    assert model.backoff_batch({**fp32, "batch_size": {"batch_size": 16}}, LM.batch_sizes) == 4
    # a batch that did not fit in the probe is known not to fit
    oom = optuna.create_study()
    oom.set_user_attr(PROBE_ATTR, _probed(LM, {1: 20 * GIB}, does_not_fit_at=2))
    eager = _knobs(LM, {**plain_recipe.params(LM, 2), "compile.mode": "off"})
    assert MemoryModel.from_study(oom, 24 * GIB).verdict(eager) == (
        "does not fit: the same configuration ran out of memory at batch 2 in the memory probe")


def _plain_study(allocated_gib, batch=1, value=34.0):
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(PROBE_ATTR, _probed(LM, {1: 22.6 * GIB}, does_not_fit_at=2))
    params = plain_recipe.params(LM, batch)
    study.enqueue_trial(params, user_attrs={"role": "plain-recipe"})
    trial = study.ask()
    strategies.sample(trial, LM)
    trial.set_user_attr("figures", {"peak_allocated_bytes": allocated_gib * GIB, "peak_memory_bytes": 23.2 * GIB})
    study.tell(trial, value)
    return study, study.trials[trial.number]


def test_a_plain_recipe_whose_compiled_step_left_room_is_measured_at_the_next_batch():
    """The 1B Llama shape under 24 GiB on the H200: the eager probe ran out of memory at batch 2, so
    the plain recipe ran at 1 (34,656 tokens/s); compiled, it allocated 20.2 GiB there, and the
    hand-written loop fits batch 2 (45,784 tokens/s)."""
    study, trial = _plain_study(allocated_gib=20.2)
    queue.put(study, plain_recipe.GrowToFit(LM, 24 * GIB)(study, trial))
    queued = queue.queued(study)
    assert len(queued) == 1 and queued[0].system_attrs["fixed_params"]["batch_size.batch_size"] == 2
    assert queued[0].user_attrs == {"role": "plain-recipe", "grown_from": trial.number}
    queue.put(study, plain_recipe.GrowToFit(LM, 24 * GIB)(study, trial))  # once
    assert len(queue.queued(study)) == 1
    # no room (21.6 + half the probe's 1.4 GiB a sample is over 92% of 24 GiB), or no limit: nothing
    full, trial = _plain_study(allocated_gib=21.6)
    queue.put(full, plain_recipe.GrowToFit(LM, 24 * GIB)(full, trial))
    assert not queue.queued(full)
    assert plain_recipe.GrowToFit(LM, None)(*_plain_study(allocated_gib=1.0)) is None
    # at 4x the base already: nothing larger is the plain recipe
    top, trial = _plain_study(allocated_gib=1.0, batch=64)
    queue.put(top, plain_recipe.GrowToFit(LM, 24 * GIB)(top, trial))
    assert not queue.queued(top)


GPT2_PROBE = {1: 4234149888, 8: 15202254848}
"""hf:gpt2's memory probe on the H100 (5ece370): 1.46 GiB a sequence above 2.48 GiB fixed, eager."""


def _grown_batch(limit_gib, compiled_gib_a_sample=0.42, batch=8):
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(PROBE_ATTR, _probed(LM, GPT2_PROBE))
    study.enqueue_trial(plain_recipe.params(LM, batch), user_attrs={"role": "plain-recipe"})
    trial = study.ask()
    strategies.sample(trial, LM)
    fixed = GPT2_PROBE[1] - (GPT2_PROBE[8] - GPT2_PROBE[1]) / 7
    allocated = fixed + batch * compiled_gib_a_sample * GIB
    trial.set_user_attr("figures", {"peak_allocated_bytes": allocated, "peak_memory_bytes": allocated + 1.5 * GIB})
    study.tell(trial, 300.0)
    queue.put(study, plain_recipe.GrowToFit(LM, limit_gib * GIB)(study, study.trials[trial.number]))
    queued = queue.queued(study)
    assert len(queued) <= 1
    return queued[0].system_attrs["fixed_params"]["batch_size.batch_size"] if queued else None


def test_a_plain_recipe_whose_activations_set_its_peak_grows_to_the_largest_batch_they_leave_room_for():
    """hf:gpt2 on the H100 (5ece370): the compiled plain recipe allocated 0.42 GiB a sequence above the
    probe's fixed part (22.68 GiB at batch 48, 29.66 at 64), where the eager probe held 1.46. Sized at 8
    by the probe under 24 GiB, it grows to 32 in one trial, not to 16, 24 and 32 in three."""
    assert _grown_batch(24) == 32  # 48 would allocate about 22.6 GiB, over 92% of 24
    assert _grown_batch(79) == 64  # the card's whole memory: 4x the base batch, the plain recipe's most
    assert _grown_batch(24, compiled_gib_a_sample=1.0) == 16  # a step that holds more: one batch up
    assert _grown_batch(24, compiled_gib_a_sample=2.5) is None


def test_the_plain_recipe_measured_at_two_batches_is_the_faster_of_them():
    study, first = _plain_study(allocated_gib=20.2, value=34.0)
    study.enqueue_trial(plain_recipe.params(LM, 2), user_attrs={"role": "plain-recipe", "grown_from": 0})
    trial = study.ask()
    strategies.sample(trial, LM)
    study.tell(trial, 45.0)
    assert plain_recipe_trial(study).number == trial.number


@pytest.mark.slow
def test_the_memory_probe_steps_at_small_batches_in_a_worker_of_its_own():
    """The worker side of the memory probe (autotune.trial.work.probe_memory), in a real worker on a
    CPU (its peaks there are the process's resident set): two steps at each batch, ascending."""
    from autotune.trial.runner import run_worker
    from autotune.trial.measure import MeasureSettings

    space = SearchSpace(device="cpu", precisions=["fp32", "bf16"], batch_sizes=[1, 2, 4, 8, 16], base_batch_size=8)
    params = plain_recipe.params(space, 1)
    request = {"mode": "memory", "space": space.to_dict(), "knobs": _knobs(space, params),
               "workload": WorkloadSpec(model="fake_models:tiny_cnn", input_shape=(3, 16, 16), num_classes=4).to_dict(),
               "measure": MeasureSettings.for_device("cpu").to_dict(), "seed": 0, "batches": [1, 2, 4]}
    result = run_worker(request, timeout_s=120)
    assert result["status"] == "ok", result
    assert sorted(result["peaks"]) == ["1", "2", "4"] and all(p > 0 for p in result["peaks"].values())
    assert result["does_not_fit_at"] is None and result["seconds"] > 0


def test_the_search_side_of_the_memory_probe_asks_for_the_plain_recipes_eager_step(monkeypatch):
    """probe_fit on a GPU (the worker's answer scripted: its own side runs in the test above): it
    asks for the plain recipe with compile off, under the memory limit, and judges the base batch."""
    from autotune.search import fit as fit_module
    from autotune.trial.measure import MeasureSettings

    asked = []

    def worker(request, *, timeout_s, spare=False):
        asked.append(request)
        return {"status": "ok", "peaks": {"1": 21 * GIB}, "does_not_fit_at": 2, "seconds": 3.0}

    monkeypatch.setattr(fit_module, "run_worker", worker)
    config = SearchConfig(workload=WorkloadSpec(model="hf:gpt2"), measure=MeasureSettings.for_device("cuda"))
    info = {"provenance": {"gpu_memory_bytes": 141 * GIB}}
    fit = fit_module.probe_fit(config, "cuda", LM, info, 24 * GIB)
    (request,) = asked
    assert request["mode"] == "memory" and request["batches"] == [1, 8]
    assert request["memory_limit_bytes"] == 24 * GIB
    assert request["knobs"]["compile"]["mode"] == "off" and request["knobs"]["precision"]["mode"] == "bf16"
    assert fit.limit_bytes == 24 * GIB and not fit.base_fits
    assert fit.probed["family"] == family(request["knobs"])
    # a CPU, or a search that pins its batch: no probe
    assert fit_module.probe_fit(config, "cpu", LM, info, None) is None
    one = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[16], base_batch_size=16)
    assert fit_module.probe_fit(config, "cuda", one, info, None) is None and len(asked) == 1
