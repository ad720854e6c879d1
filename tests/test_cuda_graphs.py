"""cuda_graphs knob, CPU side: where whole-step capture is offered (and where it is not legal),
replay, the seeds that use it, and the step's refusal of a batch of another shape.
The capture itself runs in tests/test_gpu_compile.py (GPU)."""

from __future__ import annotations

import json

import optuna
import pytest
import torch
from torch.utils._pytree import tree_flatten

import strategies
from autotune.recipe import Recipe
from autotune.deploy.runtime import GRAPH_WARMUP_STEPS, TrainStep
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from autotune.search.options import SearchConfig
from autotune.search.seeds import seed_configurations
from autotune.search.steering import complete_params
from autotune.search.space import build_space
from autotune.workload.models import WorkloadSpec
from strategies import describe
from strategies.compile import CUDAGRAPH_MODES
from strategies.cuda_graphs import CudaGraphs, legal

optuna.logging.set_verbosity(optuna.logging.WARNING)

CUDA_SPACE = SearchSpace(
    device="cuda", precisions=["fp32", "tf32", "fp16", "bf16"], batch_sizes=[128, 256, 512], base_batch_size=256,
    memory_formats=["contiguous", "channels_last"], stream_counts=[1, 2], cudnn_benchmark=[False, True],
    optimizer_implementations=["foreach", "fused"], zero_grad_set_to_none=[True, False],
    compile_modes=["off", "default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"],
    cuda_graphs=[False, True])


def sampled(space: SearchSpace, n: int = 300):
    out = []
    for seed in range(n // 3):
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
        for _ in range(3):
            trial = study.ask()
            knobs = strategies.sample(trial, space)
            out.append((dict(trial.params), knobs))
    return out


def test_offered_only_where_capture_is_legal() -> None:
    seen_enabled = seen_disabled = 0
    for params, knobs in sampled(CUDA_SPACE):
        asked = "cuda_graphs.enabled" in params
        ok = (knobs["compile"].mode not in CUDAGRAPH_MODES
              and (knobs["precision"].mode != "fp16" or knobs["optimizer"].implementation == "fused"))
        assert asked == ok, (params, knobs)
        if knobs["cuda_graphs"].enabled:
            seen_enabled += 1
            # never two layers of CUDA graphs, never GradScaler's host-synchronising step in a capture
            assert knobs["compile"].mode not in CUDAGRAPH_MODES
            assert knobs["precision"].mode != "fp16" or knobs["optimizer"].implementation == "fused"
        else:
            seen_disabled += 1
        recipe = strategies.build_recipe(knobs, "cuda")
        assert recipe.cuda_graphs is knobs["cuda_graphs"].enabled
    assert seen_enabled and seen_disabled


def test_replay_gives_the_same_knobs() -> None:
    for params, knobs in sampled(CUDA_SPACE, 60):
        assert strategies.sample(optuna.trial.FixedTrial(json.loads(json.dumps(params))), CUDA_SPACE) == knobs


@pytest.mark.parametrize(("chosen", "expected"), [
    ({}, True),
    ({"precision": "fp16", "optimizer": "foreach"}, False),  # GradScaler.step reads found_inf on the host
    ({"precision": "fp16", "optimizer": "fused"}, True),     # the fused step takes it on the device
    ({"precision": "bf16", "optimizer": "foreach"}, True),
    ({"compile": "reduce-overhead"}, False),                  # already CUDA graphs
    ({"compile": "max-autotune"}, False),
    ({"compile": "default"}, True),
    ({"compile": "max-autotune-no-cudagraphs"}, True),
])
def test_legal(chosen: dict, expected: bool) -> None:
    configs = {}
    if "precision" in chosen:
        configs["precision"] = strategies.BY_NAME["precision"].Config(mode=chosen["precision"])
    if "optimizer" in chosen:
        configs["optimizer"] = strategies.BY_NAME["optimizer"].Config(implementation=chosen["optimizer"])
    if "compile" in chosen:
        configs["compile"] = strategies.BY_NAME["compile"].Config(mode=chosen["compile"])
    assert legal(CUDA_SPACE, configs) is expected
    assert legal(SearchSpace(device="cpu", cuda_graphs=[False, True]), configs) is False


def test_untuned_space_and_cpu_never_capture() -> None:
    for space in (SearchSpace(device="cuda"), SearchSpace(device="cpu")):
        trial = optuna.create_study().ask()
        assert CudaGraphs().suggest(trial, space, {}) == CudaGraphs.Config(enabled=False)
        assert trial.params == {}
    recipe = Recipe(device="cpu")
    CudaGraphs().apply(CudaGraphs.Config(enabled=True), recipe)
    assert recipe.cuda_graphs is False


def _info(**extra) -> dict:
    return {"precisions": ["fp32", "tf32", "fp16", "bf16"], "input_dim": 4, "misaligned": {},
            "compile": {"works": True, "reason": ""}, **extra}


def test_build_space_offers_capture_on_cuda_only() -> None:
    config = SearchConfig(workload=WorkloadSpec(model="resnet50"))
    assert build_space(config, "cuda", _info()).cuda_graphs == [False, True]
    cpu = build_space(config, "cpu", {"precisions": ["fp32"], "input_dim": 4, "misaligned": {}})
    assert cpu.cuda_graphs == [False]


def test_cuda_seeds_include_the_top_configurations_and_replay() -> None:
    config = SearchConfig(workload=WorkloadSpec(model="resnet50"))
    space = build_space(config, "cuda", _info())
    seeds = seed_configurations(space)
    role, baseline = seeds[0]
    assert role == "baseline"
    base_knobs = strategies.sample(optuna.trial.FixedTrial(baseline), space)
    # the baseline is untuned: eager, the optimizer as PyTorch builds it on a GPU, no capture
    assert base_knobs["compile"].mode == "off" and not base_knobs["cuda_graphs"].enabled
    assert base_knobs["optimizer"].implementation == "foreach"
    described = []
    for _, params in seeds:
        knobs = strategies.sample(optuna.trial.FixedTrial(params), space)
        # every seed's own values are what the strategies replay (none silently re-sampled)
        for key, value in params.items():
            name, field = key.split(".", 1)
            assert getattr(knobs[name], field) == value, key
        described.append(describe(strategies.knobs_to_dict(knobs)))
    # the plain recipe second: what a user writes in five lines, compiled, at the base batch without
    # a memory probe (autotune.search.plain_recipe)
    assert seeds[1][0] == "plain-recipe"
    assert described[1] == "bf16, channels_last, batch 256, cudnn.benchmark, fused optimizer, compile default"
    # eager first (screened in seconds; the fastest is compiled after), the compiled top after them
    eager, compiled = described[2:7], described[7:]
    assert eager[0].startswith("fp16, channels_last, batch 256") and eager[1].startswith("fp16, channels_last, batch 1024")
    assert not any("compile" in d for d in eager)
    assert any(d.startswith("fp16, channels_last, batch 256") and "CUDA graphs" in d for d in eager)
    assert compiled[0].startswith("bf16, channels_last, batch 512") and "compile default" in compiled[0]
    assert compiled[1].startswith("bf16, channels_last, batch 256") and "compile default" in compiled[1]
    assert all("compile default" in d and "fused optimizer" in d for d in compiled)
    assert any("compile default" in d and "CUDA graphs" in d for d in compiled)
    assert not any(d.startswith("fp8") for d in described)  # no fp8 offered: no fp8 seed
    # a model with Linear layers for FP8 Tensor Cores (a ViT) gets a compiled fp8 seed, last
    vit = build_space(config, "cuda", _info(precisions=["fp32", "tf32", "fp16", "bf16", "fp8"], fp8_eligible_share=0.8))
    last = seed_configurations(vit)[-1][1]
    assert (last["precision.mode"], last["batch_size.batch_size"], last["compile.mode"]) == ("fp8", 512, "default")


def test_seeds_skip_what_the_space_does_not_offer() -> None:
    config = SearchConfig(workload=WorkloadSpec(model="resnet50"), compile=False)
    space = build_space(config, "cuda", _info())
    assert space.compile_modes == ["off"]
    for _, params in seed_configurations(space):
        assert params.get("compile.mode", "off") == "off"
    assert any(params.get("cuda_graphs.enabled") for _, params in seed_configurations(space))


def _step(**recipe_fields) -> TrainStep:
    model = torch.nn.Linear(4, 2)
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                     Recipe(device="cpu", **recipe_fields))


def test_setup_steps_count_the_compile_and_the_capture() -> None:
    assert _step().num_setup_steps == 0
    assert _step(compile_mode="default").num_setup_steps == 1
    assert _step(compile_mode="reduce-overhead").num_setup_steps == 3
    assert _step(cuda_graphs=True).num_setup_steps == GRAPH_WARMUP_STEPS + 1
    assert _step(cuda_graphs=True, compile_mode="default").num_setup_steps == GRAPH_WARMUP_STEPS + 1


def test_a_batch_of_another_shape_is_refused_with_the_fix() -> None:
    step = _step(cuda_graphs=True)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    leaves, spec = tree_flatten(x)
    step._static = ([t.clone() for t in leaves], spec, y.clone())
    step._copy_in(x + 1, y)  # same shape: copied into the static buffers
    assert torch.equal(step._static[0][0], x + 1)
    with pytest.raises(ConfigError, match=r"\(5, 4\).*differs from the captured \(8, 4\).*drop_last=True"):
        step._copy_in(torch.randn(5, 4), y[:5])


@pytest.mark.slow
def test_a_compiled_model_is_not_recompiled_inside_the_capture(no_op_cuda_graphs) -> None:
    """The capture runs autocast with its weight cache off, and a compiled model guards on that: the
    warm-up steps must run it so too, or the model recompiles inside the capture, where Inductor's
    autotuning synchronises and the capture fails (ViT-B/16 and GPT-2 on the H200). CPU autocast,
    with the CUDA stream and graph objects replaced by no-ops, counts the graphs compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                     Recipe(device="cpu", autocast_dtype=torch.bfloat16, compile_mode="default", cuda_graphs=True))
    x, y = torch.randn(8, 16), torch.randint(0, 2, (8,))
    for _ in range(GRAPH_WARMUP_STEPS):
        step(x, y)
    warmed = counters["stats"]["unique_graphs"]
    step(x, y)  # the capture
    assert step.graph is not None and warmed >= 1
    assert counters["stats"]["unique_graphs"] == warmed, "the model was compiled again inside the capture"


def test_a_language_model_on_cuda_is_seeded_with_nanogpts_recipes_sized_in_tokens() -> None:
    """hf:gpt2 at 1,024 tokens on the H200: the image seeds (fp16/bf16 at 256 to 1,024 sequences)
    ran out of memory five times in a 7-minute search, and none trained with the fused AdamW of the
    hand-written loop it was measured against. A model whose sample is a sequence of tokens gets
    nanoGPT's recipes at 16k and 64k tokens a step, and an FP32 baseline at 16k."""
    config = SearchConfig(workload=WorkloadSpec(model="hf:gpt2", seq_len=1024))
    lm = {"input_dim": 2, "tokens_per_sample": 1024, "sample_unit": "sequence", "vocab_size": 50257}
    space = build_space(config, "cuda", _info(**lm))
    assert space.base_batch_size == 16 and space.batch_sizes[0] == 16
    seeds = seed_configurations(space, 1024)
    described = [describe(strategies.knobs_to_dict(strategies.sample(optuna.trial.FixedTrial(p), space)))
                 for _, p in seeds]
    assert described[0].startswith("fp32, contiguous, batch 16,")
    # the plain recipe: bf16, fused AdamW, compiled, the model's own vocabulary
    assert seeds[1][0] == "plain-recipe" and described[1] == (
        "bf16, contiguous, batch 16, cudnn.benchmark, fused optimizer, compile default")
    described = described[:1] + described[2:]
    assert [d.split(", ")[0] for d in described[1:]] == ["bf16", "bf16", "fp16", "bf16", "bf16"]
    assert [int(d.split("batch ")[1].split(",")[0]) for d in described[1:]] == [16, 64, 64, 64, 16]
    assert all("fused optimizer" in d for d in described[1:])
    assert ["compile default" in d for d in described[1:]] == [False, False, False, True, True]
    assert all("vocab x64" in d for d in described[1:])  # 50,257 padded to 50,304
    # 4,096 tokens a sequence: 4 and 16 sequences, within the offered batches (16 at least)
    longer = seed_configurations(space, 4096)
    assert {p["batch_size.batch_size"] for _, p in longer[2:]} == {16}
    # with FP8 Tensor Cores and Linear layers for them (a Llama's, not GPT-2's Conv1D), fp8 beside
    # the large bf16 one, compiled: torchao's float8 is meant to run compiled
    fp8_space = build_space(config, "cuda", _info(**lm, precisions=["fp32", "tf32", "fp16", "bf16", "fp8"],
                                                  fp8_eligible_share=0.9))
    fp8_seeds = [p for _, p in seed_configurations(fp8_space, 1024)]
    assert [(p["precision.mode"], p["batch_size.batch_size"], p["compile.mode"]) for p in fp8_seeds[2:]] == [
        ("bf16", 16, "off"), ("bf16", 64, "off"), ("fp16", 64, "off"), ("bf16", 64, "default"),
        ("fp8", 64, "default"), ("bf16", 16, "default")]
    # each seed is the parameter set its trial records (complete_params): no knob the space offers
    # one value of (a language model's memory format), so the seed feeder knows a seed a steered
    # trial measured already (yield_models:gpt_lm on an H200 ran two such copies as seeds)
    for _, params in seed_configurations(fp8_space, 1024):
        assert "memory_format.format" not in params and complete_params(params, fp8_space) == params
    # an image model keeps the guides' recipes and its base batch of 256
    assert build_space(SearchConfig(workload=WorkloadSpec(model="resnet50")), "cuda", _info()).base_batch_size == 256
