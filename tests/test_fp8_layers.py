"""fp8 on the feed-forward layers alone (strategies/fp8_layers.py): offered beside fp8 where the model has
such layers among others, converting only those (tiny HF Llama, torchao's emulated float8 on a CPU),
judged apart by the accuracy check, replayed and exported as measured, predicted by its share of the
model, and not suspected where fp8 on every layer failed its check."""

from __future__ import annotations

from types import SimpleNamespace

import optuna
import pytest
from torch import nn

import strategies
from autotune.accuracy.settings import numerics_key
from autotune.space import SearchSpace
from autotune.search.neighbours import fp8_speed
from autotune.search.planner import Planner, accuracy_suspects
from autotune.search.steering import complete_params
from strategies import precision
from strategies.fp8_layers import FP8Layers
from conftest import measured

pytest.importorskip("torchao")
pytest.importorskip("transformers")

SPACE = SearchSpace(device="cuda", precisions=["fp32", "bf16", "fp8"], batch_sizes=[1, 2, 4, 8, 16, 32],
                    base_batch_size=16, compile_modes=["off", "default"], optimizer_implementations=["fused"],
                    choices={"fp8_layers": ["all", "feed-forward"]})
SIZES = {"num_parameters": 1.236e9, "fp8_eligible_share": 1.0, "fp8_width": 2006.0,
         "fp8_ff_share": 0.65, "fp8_ff_width": 2048.0}


def tiny_llama():
    from autotune.workload import hub

    return hub.build_hf("hf:llama", hub.parse_model_config(
        "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,"
        "vocab_size=1024,tie_word_embeddings=true"), 16)["model"]


def test_only_the_feed_forward_layers_train_in_float8():
    from torchao.float8.float8_linear import Float8Linear

    model = tiny_llama()
    share, ff = precision.fp8_eligible_share(model), precision.fp8_eligible_share(model, "feed-forward")
    assert 0 < ff < share
    assert precision.fp8_width(model, "feed-forward") == 64  # min(64, 128) for gate, up and down
    precision.to_float8_training(model, layers="feed-forward")
    converted = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert converted == [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("down_proj", "gate_proj", "up_proj")]
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    with pytest.raises(Exception, match="no feed-forward Linear layer"):
        precision.to_float8_training(nn.Sequential(nn.Linear(16, 32)), layers="feed-forward")


def test_it_is_offered_beside_fp8_and_sampled_only_with_it():
    knob, options = FP8Layers(), SimpleNamespace()
    probe = {"fp8_eligible_share": 1.0, "fp8_ff_share": 0.65}
    assert knob.offer(options, "cuda", probe, {"precisions": ["fp32", "bf16", "fp8"]}) == \
        {"choices": {"fp8_layers": ["all", "feed-forward"]}}
    # nothing to choose, no entry: a study stored before this knob keeps the same space
    assert knob.offer(options, "cuda", probe, {"precisions": ["fp32", "bf16"]}) == {}
    # a model whose eligible layers are all feed-forward (or none are) has nothing to choose
    for ff in (0.0, 1.0):
        assert knob.offer(options, "cuda", {**probe, "fp8_ff_share": ff}, {"precisions": ["fp8"]}) == {}
    assert "fp8_layers.layers" not in complete_params({"precision.mode": "bf16"}, SPACE)
    assert complete_params({"precision.mode": "fp8"}, SPACE)["fp8_layers.layers"] == "all"


def test_it_is_replayed_as_measured_judged_apart_and_exported_with_its_layers():
    from torchao.float8.float8_linear import Float8Linear

    from autotune.deploy.config import TunedConfig

    params = {"precision.mode": "fp8", "fp8_layers.layers": "feed-forward", "batch_size.batch_size": 4}
    cpu = SearchSpace(device="cpu", precisions=["fp32", "fp8"], batch_sizes=[4], base_batch_size=4,
                      choices={"fp8_layers": ["all", "feed-forward"]})
    cfg = TunedConfig.from_params(params, cpu)
    model, _ = cfg.prepare(tiny_llama(), None)
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 6
    knobs = strategies.knobs_of(params, cpu)
    assert numerics_key(knobs) != numerics_key(strategies.knobs_of({**params, "fp8_layers.layers": "all"}, cpu))
    assert strategies.describe(knobs) == "fp8, contiguous, batch 4, fp8 on feed-forward layers only"
    _, unsupported = cfg.hf_training_args()
    why = next(u for u in unsupported if u["setting"] == "precision.mode")
    assert 'to_float8_training(model, layers="feed-forward")' in str(why)


def _study():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    study.set_user_attr("memory_probe", {"family": "x", "peaks": {}, "sizes": SIZES})
    return study


def _measured(study, params, value, **attrs):
    return measured(study, SPACE, params, value, **attrs).number


def test_the_planner_predicts_it_from_its_share_and_does_not_suspect_it_where_fp8_on_every_layer_failed():
    """On the H100 the 1B Llama's fp8 (every layer) failed its parity check: its candidates on the
    feed-forward layers alone are other numerics, and are predicted at their share's gain."""
    bf16 = complete_params({"precision.mode": "bf16", "batch_size.batch_size": 32, "compile.mode": "default"}, SPACE)
    study = _study()
    _measured(study, bf16, 46.0)
    failed = _measured(study, complete_params({**bf16, "precision.mode": "fp8"}, SPACE), 63.4,
                       accuracy={"verdict": "violated"})
    assert accuracy_suspects(study, study.get_trials()) == [
        (f"#{failed}'s accuracy check", frozenset({("precision.mode", "fp8"), ("fp8_layers.layers", "all")}))]
    study.enqueue_trial(complete_params({**bf16, "precision.mode": "fp8", "fp8_layers.layers": "feed-forward"}, SPACE),
                        user_attrs={"role": "steered"})
    plan = Planner(SPACE, walls=[(80.0, True)]).plans(study)[0]
    # from the nearest measurement, the failed fp8 trial's speed (its figure stands; its numerics do not),
    # by the feed-forward share's gain over every layer's
    assert plan.predicted == pytest.approx(63.4 * fp8_speed(SIZES, "feed-forward") / fp8_speed(SIZES), rel=1e-6)
    assert plan.gain > 0 and "last:" not in plan.why
    assert fp8_speed(SIZES, "feed-forward") == pytest.approx(1.21, abs=0.01)  # the 1B Llama's, against 1.35


def test_under_a_cap_the_memory_knobs_also_go_on_an_fp8_twin_of_the_feed_forward_layers():
    from autotune.search.neighbours import Neighbours

    study = _study()
    bar = complete_params({"precision.mode": "bf16", "batch_size.batch_size": 1, "compile.mode": "default"}, SPACE)
    _measured(study, bar, 28.7, role="plain-recipe")
    starts = Neighbours(SPACE, limit_bytes=24 * 2**30)._lever_starts(study.trials[-1])
    assert [(s["precision.mode"], s.get("fp8_layers.layers")) for s in starts] == [
        ("bf16", None), ("fp8", "all"), ("fp8", "feed-forward")]
    only_all = SearchSpace(**{**SPACE.to_dict(), "choices": {"fp8_layers": ["all"]}})
    assert len(Neighbours(only_all, limit_bytes=24 * 2**30)._lever_starts(study.trials[-1])) == 2
