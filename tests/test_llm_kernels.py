"""llm_kernels: liger-kernel's RMSNorm, RoPE and SwiGLU kernels bound on a transformers LLM's layers.

liger's kernels are Triton: on a CPU these tests check what is offered and why not, what liger's
patch changes on the model (its layers' forwards, transformers' RoPE function) and what it leaves
(the LM head, the loss, the parameters), the replay through ``autotune.load``, and the exports; the
GPU tests train a tiny Llama with them and compare its losses with transformers' own layers.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import optuna
import pytest
import torch
from torch import nn

import autotune
import strategies
from autotune.deploy.config import TunedConfig
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from autotune.workload.hub import causal_lm_loss
from autotune.workload.models import WorkloadSpec, build
from strategies import llm_kernels, loss_kernel

pytest.importorskip("transformers")
pytest.importorskip("liger_kernel")

LLAMA = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "vocab_size": 1000}
GEMMA = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "intermediate_size": 64, "vocab_size": 1000}
LIGER = {"llm_kernels.kernels": "liger"}


@pytest.fixture
def transformers_modules_restored():
    """liger's apply functions also set transformers' modeling modules (process-wide: the RoPE
    function, the norm and MLP classes); put them back, so later tests build and run transformers' own."""
    from transformers.models.gemma import modeling_gemma
    from transformers.models.llama import modeling_llama

    kept = {module: dict(vars(module)) for module in (modeling_llama, modeling_gemma)}
    yield
    for module, before in kept.items():
        for name in set(vars(module)) - set(before):
            delattr(module, name)
        for name, value in before.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)


def _llama(**overrides):
    torch.manual_seed(0)
    return build(WorkloadSpec(model="hf:llama", model_config={**LLAMA, **overrides}, seq_len=16))


def _gemma():
    import transformers

    torch.manual_seed(0)
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**GEMMA))


def _bound(model: nn.Module) -> dict[str, str]:
    """Each module whose forward is bound on the instance -> that forward's qualified name."""
    return {name or "<model>": m.__dict__["forward"].__func__.__qualname__
            for name, m in model.named_modules() if "forward" in m.__dict__}


def _cfg(params, device="cpu", **space):
    space = SearchSpace(device=device, batch_sizes=[4], base_batch_size=4,
                        choices={"llm_kernels": list(llm_kernels.KERNELS)}, **space)
    return TunedConfig.from_params(params, space, info={"workload": {"model": "hf:llama"}})


# what liger's patch does to the model --------------------------------------------------------------


def test_cfg_prepare_binds_liger_s_kernels_on_the_layers_and_leaves_head_loss_and_parameters(
        transformers_modules_restored):
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers.models.llama import modeling_llama

    model = _llama().model
    rope = modeling_llama.apply_rotary_pos_emb
    params = {n: p for n, p in model.named_parameters()}
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters())
    prepared, _ = _cfg({"llm_kernels.kernels": "framework"}).prepare(model, optimizer)
    assert _bound(prepared) == {} and modeling_llama.apply_rotary_pos_emb is rope  # framework: as written

    cfg = _cfg(LIGER)
    assert any("liger-kernel's RMSNorm, RoPE and SwiGLU" in note for note in cfg.notes)
    assert strategies.describe(strategies.knobs_to_dict(cfg.knobs)).endswith("liger kernels")
    prepared, _ = cfg.prepare(model, optimizer)
    norms = ["model.norm"] + [f"model.layers.{i}.{n}" for i in range(2)
                              for n in ("input_layernorm", "post_attention_layernorm")]
    assert _bound(prepared) == {**{n: "LigerRMSNorm.forward" for n in norms},
                                **{f"model.layers.{i}.mlp": "LigerSwiGLUMLP.forward" for i in range(2)}}
    # liger's RoPE in transformers' module; it and each bound forward wrapped as a graph break under compile
    assert modeling_llama.apply_rotary_pos_emb.__wrapped__ is liger_rotary_pos_emb
    assert prepared.model.norm.forward.__func__.__wrapped__ is LigerRMSNorm.forward
    assert prepared.model.layers[1].mlp.forward.__func__.__wrapped__ is LigerSwiGLUMLP.forward
    assert any("under torch.compile each kernel is a graph break" in note for note in cfg.notes)
    # the losses are loss_kernel's: no fused loss in the model's forward, the LM head untouched
    assert "forward" not in prepared.__dict__ and "forward" not in prepared.lm_head.__dict__
    assert dict(prepared.named_parameters()) == params
    assert {k: v.shape for k, v in prepared.state_dict().items()} == shapes
    assert prepared.model.norm.__class__.__name__ == "LlamaRMSNorm"  # the instance's class stays transformers'


def test_liger_s_patch_refuses_what_it_cannot_bind(transformers_modules_restored, monkeypatch):
    with pytest.raises(ConfigError, match="holds no transformers models.*llm_kernels 'framework'"):
        llm_kernels.apply_liger(nn.Sequential(nn.Linear(4, 4)))
    gelu = _llama(hidden_act="gelu").model  # liger's SwiGLU computes SiLU whatever the config says
    with pytest.raises(ConfigError, match="activation is gelu.*computes silu"):
        llm_kernels.apply_liger(gelu)
    assert _bound(gelu) == {}  # refused before anything was bound
    monkeypatch.setattr(llm_kernels, "liger_problem", lambda: "liger-kernel is not installed (pip install x)")
    with pytest.raises(ConfigError, match="and liger-kernel is not installed"):
        llm_kernels.apply_liger(_llama().model)


def test_a_transformers_model_inside_a_module_of_the_user_s_is_patched(transformers_modules_restored):
    class Wrapper(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

    wrapper = Wrapper(_llama().model)
    assert llm_kernels.apply_liger(wrapper) is wrapper
    assert _bound(wrapper)["lm.model.norm"] == "LigerRMSNorm.forward"


# torch.compile: each of liger's kernels a graph break ----------------------------------------------


def test_a_function_made_eager_under_compile_runs_eagerly_between_two_compiled_graphs():
    seen = []

    def double(x):
        seen.append(torch.compiler.is_compiling())
        return x * 2

    wrapped = llm_kernels.eager_under_compile(double)
    assert wrapped.__wrapped__ is double and wrapped.__name__ == "double"
    assert llm_kernels.eager_under_compile(wrapped) is wrapped  # not wrapped twice
    x = torch.randn(4)
    assert torch.equal(wrapped(x), x * 2) and seen == [False]  # eager: the function as it is

    def step(x):
        return wrapped(x.sin()).cos()

    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(step)(x)
        assert explained.graph_count == 2 and explained.graph_break_count == 1
        assert "torch.compiler.disable" in str(explained.break_reasons[0].reason)
        seen.clear()
        assert torch.allclose(torch.compile(step, backend="eager")(x), step(x))
        assert seen == [False, False]  # compiled: not traced, run eagerly (then the eager call's)
    finally:
        torch._dynamo.reset()


def _torch_s_own_as_liger_s(monkeypatch, seen):
    """Stand in, on a CPU, for liger's Triton forwards (RMSNorm, SwiGLU MLP, RoPE) with transformers'
    arithmetic, each a function of liger's modules (where its patch looks them up and binds them), that
    notes whether TorchDynamo traced it."""
    from liger_kernel.transformers import monkey_patch, rms_norm, swiglu
    from transformers.models.llama import modeling_llama

    rope, norm = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm.forward  # before the patch

    def norm_forward(self, hidden_states):
        seen.append(("norm", torch.compiler.is_compiling()))
        return norm(self, hidden_states)

    def mlp_forward(self, x):
        seen.append(("mlp", torch.compiler.is_compiling()))
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        seen.append(("rope", torch.compiler.is_compiling()))
        return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    for fn, module in ((norm_forward, rms_norm), (mlp_forward, swiglu), (rotary_pos_emb, monkey_patch)):
        fn.__module__ = module.__name__
    monkeypatch.setattr(rms_norm.LigerRMSNorm, "forward", norm_forward)
    monkeypatch.setattr(swiglu.LigerSwiGLUMLP, "forward", mlp_forward)
    monkeypatch.setattr(monkey_patch, "liger_rotary_pos_emb", rotary_pos_emb)


@pytest.mark.slow
def test_a_compiled_llama_runs_liger_s_kernels_eagerly_and_computes_the_same(transformers_modules_restored,
                                                                             monkeypatch):
    seen = []
    _torch_s_own_as_liger_s(monkeypatch, seen)
    workload = _llama()
    model = llm_kernels.apply_liger(workload.model)
    x, y = workload.batch(2, torch.Generator().manual_seed(1))

    def grads():
        model.zero_grad()
        causal_lm_loss(model(x).logits, y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    eager = grads()
    per_forward = [("norm", False)] * 5 + [("mlp", False)] * 2 + [("rope", False)] * 2
    assert sorted(seen) == sorted(per_forward)  # 2 layers: their 2 norms, MLP and RoPE; the final norm
    torch._dynamo.reset()
    try:
        seen.clear()
        model.compile(backend="aot_eager")  # forward and backward traced, as Inductor's are; no C++ compile
        compiled = grads()
        assert sorted(seen) == sorted(per_forward)  # each run eagerly: none traced (that would note True)
        assert compiled.keys() == eager.keys()
        assert all(torch.allclose(compiled[n], eager[n], atol=1e-6) for n in eager), "compiled grads differ"
    finally:
        torch._dynamo.reset()


def test_each_kernel_liger_bound_is_wrapped_once(transformers_modules_restored):
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from transformers.models.llama import modeling_llama

    model = _llama().model
    llm_kernels.apply_function("llama")(model=model, fused_linear_cross_entropy=False)
    norms = ["model.norm"] + [f"model.layers.{i}.{n}" for i in range(2)
                              for n in ("input_layernorm", "post_attention_layernorm")]
    mlps = [f"model.layers.{i}.mlp" for i in range(2)]
    assert sorted(llm_kernels.break_graphs_at_liger(model)) == sorted(
        [f"{n}.forward" for n in norms + mlps] + ["modeling_llama.apply_rotary_pos_emb"])
    assert llm_kernels.break_graphs_at_liger(model) == []  # again: nothing left to wrap
    assert model.model.norm.forward.__func__.__wrapped__ is LigerRMSNorm.forward
    rope = modeling_llama.apply_rotary_pos_emb
    llm_kernels.apply_liger(model)  # liger's patch binds its own again; wrapped again, once
    assert model.model.norm.forward.__func__.__wrapped__ is LigerRMSNorm.forward
    assert modeling_llama.apply_rotary_pos_emb.__wrapped__ is rope.__wrapped__
    assert llm_kernels.break_graphs_at_liger(_llama().model) == []  # transformers' own layers: nothing


# replay -------------------------------------------------------------------------------------------


def test_autotune_load_replays_the_knob_and_its_patch(tmp_path, transformers_modules_restored):
    cfg = _cfg({**LIGER, "precision.mode": "bf16"}, precisions=["fp32", "bf16"])
    assert cfg.params["llm_kernels.kernels"] == "liger" and cfg.knobs["llm_kernels"].kernels == "liger"
    cfg.save(tmp_path / "config.json")
    loaded = autotune.load(tmp_path / "config.json")
    assert loaded.knobs == cfg.knobs and llm_kernels.apply_liger in loaded.recipe.model_transforms
    model, _ = loaded.prepare(_llama().model)
    assert _bound(model)["model.layers.0.mlp"] == "LigerSwiGLUMLP.forward"


# the search: what is offered, sampled, seeded and said ------------------------------------------


def _offer(probe, device="cuda"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offered = llm_kernels.LLMKernels().offer(SimpleNamespace(ddp=None), device, probe, {})
    return offered, [str(w.message) for w in caught]


def test_offered_on_cuda_for_a_type_liger_patches_and_otherwise_one_line_says_why():
    ok = {"llm_kernels": {"model_type": "llama", "reason": None}, "vocab_size": 1000}
    assert _offer(ok) == ({"choices": {"llm_kernels": ["framework", "liger"]}}, [])
    assert _offer(ok, device="cpu") == ({}, [])  # Triton kernels: not on a CPU
    gpt2 = {"llm_kernels": {"model_type": "gpt2", "reason": "liger-kernel has no patches for gpt2 models"},
            "vocab_size": 50257}
    assert _offer(gpt2) == ({}, ["liger-kernel's LLM kernels (llm_kernels) are not searched: liger-kernel has no "
                                 "patches for gpt2 models"])
    offered, said = _offer({"llm_kernels": None, "vocab_size": 50304})  # a language model of the user's own
    assert offered == {} and said == ["liger-kernel's LLM kernels (llm_kernels) are not searched: the model is not a "
                                      "transformers model (PreTrainedModel), which liger's patches are written for"]
    assert _offer({"llm_kernels": None, "vocab_size": None}) == ({}, [])  # a ResNet: nothing to say


def test_the_probe_names_the_model_type_and_why_not(monkeypatch):
    assert llm_kernels.probe(_llama().model, device="cuda") == {"model_type": "llama", "reason": None}
    assert llm_kernels.probe(_llama().model, device="cpu") == {"model_type": "llama", "reason": llm_kernels.NOT_ON_CPU}
    gpt2 = build(WorkloadSpec(model="hf:gpt2", model_config={"n_layer": 1, "n_embd": 32, "n_head": 2}, seq_len=16))
    assert llm_kernels.probe(gpt2.model, device="cuda") == {
        "model_type": "gpt2",
        "reason": "liger-kernel has no patches for gpt2 models (its MODEL_TYPE_TO_APPLY_LIGER_FN)"}
    assert "activation is gelu" in llm_kernels.probe(_llama(hidden_act="gelu").model, device="cuda")["reason"]
    assert llm_kernels.probe(_gemma(), device="cuda") == {"model_type": "gemma", "reason": None}  # GeGLU, tanh GELU
    assert llm_kernels.probe(nn.Linear(4, 4), device="cuda") is None
    monkeypatch.setattr(llm_kernels, "liger_problem", lambda: "liger-kernel is not installed")
    assert llm_kernels.probe(_llama().model, device="cuda")["reason"] == "liger-kernel is not installed"


def test_the_search_s_probe_reports_it():
    from autotune.trial import work as worker

    spec = WorkloadSpec(model="hf:llama", model_config=dict(LLAMA), seq_len=16)
    found = worker.probe({"device": "cpu", "workload": spec.to_dict()})
    assert found["llm_kernels"] == {"model_type": "llama", "reason": llm_kernels.NOT_ON_CPU}


def test_sampled_with_every_compile_mode_and_cuda_graphs_and_seeded_off():
    space = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[8], cuda_graphs=[False, True],
                        compile_modes=["off", "default", "reduce-overhead"],
                        choices={"llm_kernels": list(llm_kernels.KERNELS), "loss_kernel": list(loss_kernel.KERNELS)})
    for fixed in ({"compile.mode": "default"}, {"compile.mode": "reduce-overhead"},
                  {"compile.mode": "off", "cuda_graphs.enabled": True},
                  {"loss_kernel.kernel": "fused_linear", "precision.mode": "bf16"}):
        study = optuna.create_study()
        study.enqueue_trial({**LIGER, "loss_kernel.kernel": "framework", **fixed})  # a fused loss: no whole-step graph
        trial = study.ask()
        knobs = strategies.sample(trial, space)
        assert knobs["llm_kernels"].kernels == "liger" and trial.params["llm_kernels.kernels"] == "liger", fixed
        assert all(trial.params.get(k) == v for k, v in fixed.items()), (fixed, trial.params)
    assert strategies.seed_params(space, tuned=False)["llm_kernels.kernels"] == "framework"
    assert strategies.seed_params(space, tuned=True)["llm_kernels.kernels"] == "framework"
    assert "llm_kernels.kernels" not in strategies.seed_params(SearchSpace(device="cuda"), tuned=True)


def test_the_planner_has_a_modest_prior_for_it():
    from autotune.search import neighbours

    assert neighbours.PRIORS[("llm_kernels.kernels", "liger")] == 1.05


# exports -----------------------------------------------------------------------------------------


def _hf(model: str, params: dict) -> tuple[dict, list]:
    space = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[8], compile_modes=["off", "default"],
                        choices={"llm_kernels": list(llm_kernels.KERNELS), "loss_kernel": list(loss_kernel.KERNELS)})
    params = {"precision.mode": "bf16", "llm_kernels.kernels": "framework", "loss_kernel.kernel": "framework",
              "compile.mode": "off", **params}
    cfg = TunedConfig.from_params(params, space, info={"workload": {"model": model}})
    return cfg.hf_training_args()


def test_hf_export_writes_one_liger_config_for_both_liger_knobs():
    import transformers

    off = {"rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False}
    layers = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False}
    fused = {"loss_kernel.kernel": "fused_linear"}
    for params, config in (({**LIGER}, {**layers, "fused_linear_cross_entropy": False}),
                           ({**LIGER, **fused}, {**layers, "fused_linear_cross_entropy": True}),
                           (fused, {**off, "geglu": False, "layer_norm": False, "relu_squared": False,
                                    "fused_linear_cross_entropy": True})):
        kwargs, unsupported = _hf("hf:llama", params)
        assert kwargs["use_liger_kernel"] is True and kwargs["liger_kernel_config"] == config, params
        assert unsupported == [] and set(kwargs) <= set(transformers.TrainingArguments.__dataclass_fields__)
    assert "use_liger_kernel" not in _hf("hf:llama", {"llm_kernels.kernels": "framework"})[0]
    # a fused loss alone on a Gemma: its GeGLU switch named off too, since liger turns on what is left out
    kwargs, _ = _hf("hf:gemma", {"loss_kernel.kernel": "fused_linear"})
    assert kwargs["liger_kernel_config"]["geglu"] is False
    assert "geglu" not in _hf("hf:gemma", LIGER)[0]["liger_kernel_config"]  # on: liger's default, as applied
    _, unsupported = _hf("hf:gpt2", LIGER)  # a type liger does not patch (never offered; a hand-made config)
    assert [u["setting"] for u in unsupported] == ["llm_kernels.kernels"]
    # a model of your own: the Trainer patches only a transformers model of a type liger patches
    kwargs, unsupported = _hf("my_models:small_llama", LIGER)
    assert "use_liger_kernel" not in kwargs and [u["setting"] for u in unsupported] == ["llm_kernels.kernels"]
    assert "strategies.llm_kernels.apply_liger(model)" in unsupported[0]["why"]


def test_the_hf_export_says_where_the_trainers_own_liger_patch_fails_under_compile(monkeypatch):
    """The Trainer's use_liger_kernel patches without cfg.prepare's graph breaks: under torch_compile,
    torch 2.11's TorchDynamo failed on liger's RMSNorm (the H100's GPU test); 2.12 fixed it."""
    from strategies.llm_kernels import dynamo_fails_on_liger

    assert dynamo_fails_on_liger("2.11.0+cu130") and not dynamo_fails_on_liger("2.12.0")
    assert not dynamo_fails_on_liger("2.10.1") and not dynamo_fails_on_liger("nightly")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    compiled = {**LIGER, "compile.mode": "default"}
    _, unsupported = _hf("hf:llama", compiled)
    assert [u["setting"] for u in unsupported] == ["llm_kernels.kernels"] and "#180642" in unsupported[0]["why"]
    assert _hf("hf:llama", {**compiled, "compile.mode": "off"})[1] == []
    assert _hf("hf:llama", {**compiled, "llm_kernels.kernels": "framework",
                                     "loss_kernel.kernel": "fused_linear"})[1] == []
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    assert _hf("hf:llama", compiled)[1] == []


def test_lightning_applies_it_and_accelerate_says_how():
    space = SearchSpace(device="cuda", batch_sizes=[8], choices={"llm_kernels": list(llm_kernels.KERNELS)})
    cfg = TunedConfig.from_params(LIGER, space, info={"workload": {"model": "hf:llama"}})
    from autotune.deploy.exports import lightning_settings

    lightning = lightning_settings(cfg)
    assert lightning["callback"]["applies"]["llm_kernels.kernels"] == "liger"
    assert "llm_kernels.kernels" not in {u["setting"] for u in lightning["unsupported"]}
    why = next(u["why"] for u in cfg.accelerate_config().unsupported if u["setting"] == "llm_kernels.kernels")
    assert "strategies.llm_kernels.apply_liger(model)" in why


def test_the_trainer_binds_from_the_exported_config_what_cfg_prepare_binds(transformers_modules_restored):
    """The Trainer's own call (transformers.integrations.liger.apply_liger_kernel, what train() runs
    with use_liger_kernel) on the exported liger_kernel_config, against cfg.prepare's patch."""
    from transformers.integrations.liger import apply_liger_kernel

    kwargs, _ = _hf("hf:llama", LIGER)
    ours, _ = _cfg(LIGER).prepare(_llama().model)
    theirs = _llama().model
    apply_liger_kernel(theirs, kwargs["liger_kernel_config"])
    assert _bound(theirs) == _bound(ours) != {}
    # a fused loss alone on a Gemma: the Trainer patches the loss, not the GeGLU MLPs measured without liger
    kwargs, _ = _hf("hf:gemma", {"loss_kernel.kernel": "fused_linear"})
    gemma = _gemma()
    apply_liger_kernel(gemma, kwargs["liger_kernel_config"])
    assert set(_bound(gemma)) == {"<model>"}


# on the GPU --------------------------------------------------------------------------------------

TINY_LLAMA = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 512, "vocab_size": 1000}


def _gpu_losses(kernels, *, mode, compile_mode, graphs, steps=6):
    """A tiny Llama's losses over ``steps`` train_steps on one batch with ``kernels`` (weights seeded the same)."""
    torch.manual_seed(0)
    workload = build(WorkloadSpec(model="hf:llama", model_config=TINY_LLAMA, seq_len=128))
    space = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[4], compile_modes=["off", "default"],
                        cuda_graphs=[False, True], choices={"llm_kernels": list(llm_kernels.KERNELS)})
    cfg = TunedConfig.from_params({"precision.mode": mode, "compile.mode": compile_mode, "cuda_graphs.enabled": graphs,
                                   "llm_kernels.kernels": kernels}, space)
    model, optimizer = cfg.prepare(workload.model, torch.optim.AdamW(workload.model.parameters(), lr=1e-3))
    assert (_bound(model).get("model.norm") == "LigerRMSNorm.forward") == (kernels == "liger")
    step = cfg.train_step(model, optimizer, causal_lm_loss)
    x, y = (t.cuda() for t in workload.batch(4, torch.Generator().manual_seed(1)))
    losses = [float(step(x, y)) for _ in range(steps)]
    torch.cuda.synchronize()
    return losses


@pytest.mark.gpu
@pytest.mark.parametrize("mode, compile_mode, graphs, tolerance", [
    ("fp32", "off", False, 1e-3), ("bf16", "default", False, 2e-2), ("fp32", "off", True, 1e-3)],
    ids=["fp32-eager", "bf16-compiled", "fp32-whole-step-cuda-graph"])
def test_a_tiny_llama_trains_on_the_gpu_with_liger_s_kernels_as_without(mode, compile_mode, graphs, tolerance,
                                                                        restore_backend_flags,
                                                                        transformers_modules_restored):
    # transformers' own layers first: liger's patch sets transformers' module for every Llama after it
    framework = _gpu_losses("framework", mode=mode, compile_mode="off" if graphs else compile_mode, graphs=False)
    liger = _gpu_losses("liger", mode=mode, compile_mode=compile_mode, graphs=graphs)
    assert liger == pytest.approx(framework, abs=tolerance), (liger, framework)
    assert liger[-1] < liger[0]


def test_liger_kernels_are_checked_for_accuracy_apart_and_their_first_step_is_setup():
    """They change the arithmetic (their own RMSNorm, RoPE and SwiGLU), so a configuration with them
    shares no accuracy check with one without; their Triton kernels compile in the first step that calls
    them, which is compile time, not step time."""
    import torch

    from autotune.accuracy.settings import describe_numerics, numerics_key
    from autotune.recipe import Recipe
    from autotune.deploy.runtime import TrainStep

    on = {"precision": {"mode": "bf16"}, "llm_kernels": {"kernels": "liger"}}
    off = {"precision": {"mode": "bf16"}, "llm_kernels": {"kernels": "framework"}}
    assert numerics_key(on) != numerics_key(off) == numerics_key({"precision": {"mode": "bf16"}})
    assert describe_numerics(on) == "bf16, liger kernels"
    recipe = Recipe(device="cpu")
    strategies.BY_NAME["llm_kernels"].apply(strategies.BY_NAME["llm_kernels"].Config(kernels="liger"), recipe)
    model = torch.nn.Linear(2, 2)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss, recipe)
    assert recipe.llm_kernels == "liger" and step.num_setup_steps == 1
    assert TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                     Recipe(device="cpu")).num_setup_steps == 0
