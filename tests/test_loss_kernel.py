"""loss_kernel: a fused linear cross-entropy in place of the framework's loss of a language model.

On a CPU the plumbing runs with a pure-PyTorch reference of liger's math (the logits a chunk of
tokens at a time, the gradients computed in the forward, the incoming gradient multiplied in by the
backward) put where liger's kernel goes; a slow test runs liger's own kernel under Triton's CPU
interpreter, and the GPU tests run it on CUDA, where it is offered.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings
from types import SimpleNamespace

import optuna
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotune
import strategies
from autotune.accuracy.settings import describe_numerics, numerics_key
from autotune.deploy import runtime
from autotune.deploy.config import TunedConfig
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from autotune.workload.hub import causal_lm_loss
from autotune.workload.models import WorkloadSpec, build, logits
from conftest import ROOT, subprocess_env
from strategies import loss_kernel
from strategies.cuda_graphs import legal as cuda_graphs_legal
from strategies.fp32_layers import keep_fp32
from strategies.vocab_padding import pad_vocab

# GPT-2's own 50,257 tokens, its head tied to wte; no dropout, whose masks would differ between the two losses
GPT2 = ("hf:gpt2", {"n_layer": 1, "n_embd": 32, "n_head": 2, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
LLAMA = ("hf:llama", {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "intermediate_size": 64, "vocab_size": 1000})  # untied head, a vocabulary off 64's multiple
SEQ = 16
FUSED = {"loss_kernel.kernel": "fused_linear"}


class _ChunkedLinearCE(torch.autograd.Function):
    """liger's fused linear cross-entropy, in PyTorch: the logits a chunk of tokens at a time, the
    gradients of the hidden states, weight and bias computed in the forward; the backward multiplies
    the incoming gradient in (GradScaler's scale, accumulation's 1/k)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, ignore_index, label_smoothing, reduction):
        count = (targets != ignore_index).sum() if reduction == "mean" else 1
        total = hidden.new_zeros((), dtype=torch.float32)
        grads = [torch.zeros_like(hidden), torch.zeros_like(weight), None if bias is None else torch.zeros_like(bias)]
        for start in range(0, hidden.shape[0], 5):
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (hidden[start:start + 5], weight)]
                leaves += [bias.detach().requires_grad_()] if bias is not None else []
                chunk = F.linear(*leaves).float()
                loss = F.cross_entropy(chunk, targets[start:start + 5], ignore_index=ignore_index,
                                       label_smoothing=label_smoothing, reduction="sum") / count
                got = torch.autograd.grad(loss, leaves)
            total += loss.detach()
            grads[0][start:start + 5] = got[0]
            grads[1] += got[1]
            if bias is not None:
                grads[2] += got[2]
        ctx.save_for_backward(*[g for g in grads if g is not None])
        ctx.has_bias = bias is not None
        return total

    @staticmethod
    def backward(ctx, grad_output):
        saved = [g * grad_output for g in ctx.saved_tensors]
        return saved[0], saved[1], None, saved[2] if ctx.has_bias else None, None, None, None


def reference(weight, hidden, targets, bias=None, *, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    return _ChunkedLinearCE.apply(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction)


@pytest.fixture
def fused_reference(monkeypatch):
    """liger's kernel replaced by the reference; the calls it gets."""
    calls = []

    def counted(*args, **kwargs):
        calls.append({"hidden_dtype": args[1].dtype, "autocast": torch.is_autocast_enabled("cpu"), **kwargs})
        return reference(*args, **kwargs)

    monkeypatch.setitem(loss_kernel.IMPLEMENTATIONS, "fused_linear", counted)
    return calls


def _lm(which=LLAMA):
    torch.manual_seed(0)
    workload = build(WorkloadSpec(model=which[0], model_config=dict(which[1]), seq_len=SEQ))
    return workload, workload.batch(4, torch.Generator().manual_seed(1))


def _loss_and_grads(model, loss_fn, x, y):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(logits(model(x)), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b, atol=1e-5):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert abs(float(loss_a) - float(loss_b)) <= atol
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("which", [GPT2, LLAMA], ids=["gpt2-tied", "llama"])
def test_the_fused_loss_gives_causal_lm_loss_and_its_gradients(which, fused_reference):
    workload, (x, y) = _lm(which)
    model, framework = workload.model, copy.deepcopy(workload.model)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    loss_fn = loss_kernel.fused_loss(model, causal_lm_loss)
    fused = _loss_and_grads(model, loss_fn, x, y)
    _assert_same(fused, _loss_and_grads(framework, causal_lm_loss, x, y))
    assert fused_reference and fused_reference[0]["reduction"] == "mean"
    # in training the model hands on its hidden states; the head, its weight and its tying stay
    assert logits(model(x)).shape == (4, SEQ, model.config.hidden_size)
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    if which is GPT2:
        assert model.lm_head.weight is model.transformer.wte.weight
    # in eval mode it computes logits, and the loss is the user's
    model.eval(), framework.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(model(x)), logits(framework(x)))
        assert float(loss_fn(logits(model(x)), y)) == pytest.approx(float(causal_lm_loss(logits(framework(x)), y)))
    assert loss_kernel.fused_loss(model, causal_lm_loss).head is loss_fn.head  # twice: the same head, once changed


def _cfg(params, **space):
    space = SearchSpace(device="cpu", batch_sizes=[4], base_batch_size=4,
                        choices={"loss_kernel": list(loss_kernel.KERNELS)}, **space)
    return TunedConfig.from_params(params, space)


def _train(cfg, model, x, y, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = cfg.prepare(model, optimizer)
    step = cfg.train_step(model, optimizer, causal_lm_loss)
    return [float(step(x, y)) for _ in range(steps)], dict(model.named_parameters())


def test_a_tuned_config_replays_the_fused_loss_and_trains_as_the_framework_loss(fused_reference, tmp_path):
    cfg = _cfg(FUSED)
    assert cfg.knobs["loss_kernel"].kernel == "fused_linear" and cfg.recipe.loss_kernel == "fused_linear"
    assert strategies.describe(strategies.knobs_to_dict(cfg.knobs)).endswith(", fused linear CE")
    assert any("fused_loss(model, loss_fn)" in note for note in cfg.notes)
    cfg.save(tmp_path / "config.json")
    loaded = autotune.load(tmp_path / "config.json")
    assert loaded.knobs == cfg.knobs and loaded.recipe.loss_kernel == "fused_linear"

    workload, (x, y) = _lm()
    framework_model = copy.deepcopy(workload.model)
    fused_losses, fused_params = _train(loaded, workload.model, x, y)
    losses, params = _train(_cfg({"loss_kernel.kernel": "framework"}), framework_model, x, y)
    assert fused_losses == pytest.approx(losses, abs=1e-5) and losses[-1] < losses[0]
    for name, p in params.items():
        torch.testing.assert_close(fused_params[name], p, atol=1e-5, rtol=0, msg=name)
    assert len(fused_reference) == 3


def test_accumulation_and_grad_scaler_reach_the_fused_loss_as_its_incoming_gradient(fused_reference):
    workload, (x, y) = _lm(GPT2)
    params = {}
    for kernel, model in [("framework", copy.deepcopy(workload.model)), ("fused_linear", workload.model)]:
        recipe = strategies.build_recipe({"loss_kernel": loss_kernel.LossKernel.Config(kernel=kernel)}, "cpu")
        recipe.accumulation_steps, recipe.grad_scaler = 2, {"init_scale": 256.0}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        step = runtime.TrainStep(model, optimizer, causal_lm_loss, recipe)
        for half in (slice(0, 2), slice(2, 4)):  # two micro-batches, one optimizer step
            step(x[half], y[half])
        assert step.scaler.is_enabled() and step.scaler.get_scale() == 256.0
        assert step.num_setup_steps == (kernel != "framework")  # liger's Triton kernels compile in the first step
        params[kernel] = dict(model.named_parameters())
    for name, p in params["framework"].items():
        torch.testing.assert_close(params["fused_linear"][name], p, atol=1e-5, rtol=0, msg=name)
    assert len(fused_reference) == 2


def test_a_vocab_padded_head_is_read_to_its_real_rows(fused_reference):
    workload, (x, y) = _lm()  # 1,000 tokens, padded to 1,024
    model = pad_vocab(workload.model, 64)
    framework = copy.deepcopy(model)
    assert model.lm_head.weight.shape[0] == 1024
    fused = _loss_and_grads(model, loss_kernel.fused_loss(model, causal_lm_loss), x, y)
    _assert_same(fused, _loss_and_grads(framework, causal_lm_loss, x, y))
    assert not fused[1]["lm_head.weight"][1000:].any()  # the padded rows get no gradient and stay zero


def test_a_head_kept_in_fp32_computes_its_fused_loss_in_fp32(fused_reference):
    workload, (x, y) = _lm()
    model = keep_fp32(workload.model, ("head",))
    loss_fn = loss_kernel.fused_loss(model, causal_lm_loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(logits(model(x)), y)
    assert fused_reference[-1]["hidden_dtype"] == torch.float32 and not fused_reference[-1]["autocast"]
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert logits(model(x)).dtype == torch.float32  # eval: the fp32 head's own forward, logits in FP32
    other, _ = _lm()
    plain = loss_kernel.fused_loss(other.model, causal_lm_loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(logits(other.model(x)), y)
    assert fused_reference[-1]["autocast"]  # otherwise under the step's autocast, as liger runs it


def test_only_a_cross_entropy_of_the_head_s_logits_is_replaced(fused_reference):
    workload, (x, y) = _lm()
    for loss_fn in (lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()),
                    nn.CrossEntropyLoss(weight=torch.ones(1000)), nn.CrossEntropyLoss(reduction="none")):
        with pytest.raises(ConfigError, match="is not known to be that.*loss_kernel 'framework'"):
            loss_kernel.fused_loss(workload.model, loss_fn)
    assert not getattr(workload.model.lm_head, "_autotune_fused_loss", False)  # refused before the head changed
    # a torch CrossEntropyLoss keeps its options: tokens ignored, label smoothing, a sum
    y = y.clone()
    y[:, :3] = -1
    ce = nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1, reduction="sum")
    framework = copy.deepcopy(workload.model)
    fused = _loss_and_grads(workload.model, loss_kernel.fused_loss(workload.model, ce), x, y)
    _assert_same(fused, _loss_and_grads(framework, lambda out, t: ce(out.flatten(0, 1), t.flatten()), x, y), atol=1e-4)
    assert fused_reference[-1] == {"hidden_dtype": torch.float32, "autocast": False, "ignore_index": -1,
                                   "label_smoothing": 0.1, "reduction": "sum"}
    with pytest.raises(ConfigError, match="needs a language model"):
        loss_kernel.fused_loss(nn.Sequential(nn.Linear(4, 4)), causal_lm_loss)


def test_the_step_refuses_a_whole_step_cuda_graph_and_a_missing_liger(monkeypatch):
    workload, _ = _lm()
    recipe = strategies.build_recipe({"loss_kernel": loss_kernel.LossKernel.Config(kernel="fused_linear")}, "cpu")
    recipe.cuda_graphs = True
    with pytest.raises(ConfigError, match="CUDA graph cannot capture"):
        loss_kernel.step_loss(workload.model, causal_lm_loss, recipe)
    monkeypatch.setattr(loss_kernel, "liger_problem", lambda: "liger-kernel is not installed (pip install x)")
    with pytest.raises(ConfigError, match="liger-kernel's fused linear cross-entropy, and liger-kernel is not installed"):
        loss_kernel.fused_loss(workload.model, causal_lm_loss)
    recipe.loss_kernel = "framework"
    assert loss_kernel.step_loss(workload.model, causal_lm_loss, recipe) is causal_lm_loss


# the search: what is offered, sampled, seeded and said -------------------------------------------

LM_HEAD = {"vocab": 128256, "fusable": True, "reason": None}


def _offer(probe, device="cuda", ddp=None):
    options = SimpleNamespace(ddp=ddp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offered = loss_kernel.LossKernel().offer(options, device, probe, {})
    return offered, [str(w.message) for w in caught]


def test_offered_on_cuda_for_a_fusable_lm_and_otherwise_said_why():
    assert _offer({"lm_head": LM_HEAD}) == ({"choices": {"loss_kernel": ["framework", "fused_linear"]}}, [])
    assert _offer({"lm_head": None}) == ({}, [])  # not a language model: nothing to say
    assert _offer({"lm_head": LM_HEAD}, device="cpu") == ({}, [])  # liger's Triton kernels run on CUDA
    missing = {**LM_HEAD, "fusable": False, "reason": "liger-kernel is not installed (pip install 'autotune[memory]')"}
    assert _offer({"lm_head": missing}) == ({}, ["the fused linear cross-entropy (loss_kernel) is not searched: "
                                                 "liger-kernel is not installed (pip install 'autotune[memory]')"])
    offered, said = _offer({"lm_head": LM_HEAD}, ddp=2)
    assert offered == {} and "--ddp" in said[0]


def test_sampled_beside_bf16_not_fp16_nor_a_padded_vocabulary_and_never_captured_whole():
    space = SearchSpace(device="cuda", precisions=["fp32", "fp16", "bf16"], batch_sizes=[8],
                        optimizer_implementations=["foreach", "fused"], cuda_graphs=[False, True],
                        choices={"loss_kernel": list(loss_kernel.KERNELS), "vocab_padding": [1, 64]})

    def sample(params):  # the parameters given, the rest sampled
        study = optuna.create_study()
        study.enqueue_trial({"optimizer.implementation": "fused", **params})
        trial = study.ask()
        return strategies.sample(trial, space), trial.params

    bf16, params = sample({"precision.mode": "bf16", "vocab_padding.multiple": 1, **FUSED, "cuda_graphs.enabled": True})
    assert bf16["loss_kernel"].kernel == "fused_linear" and params["loss_kernel.kernel"] == "fused_linear"
    assert not bf16["cuda_graphs"].enabled and "cuda_graphs.enabled" not in params
    assert not cuda_graphs_legal(space, bf16)
    for ruled_out in ({"precision.mode": "fp16", "vocab_padding.multiple": 1},
                      {"precision.mode": "bf16", "vocab_padding.multiple": 64}):
        knobs, params = sample({**ruled_out, **FUSED})
        assert knobs["loss_kernel"].kernel == "framework" and "loss_kernel.kernel" not in params
    # the baseline and the known-good configurations run the framework's loss
    assert strategies.seed_params(space, tuned=False)["loss_kernel.kernel"] == "framework"
    assert strategies.seed_params(space, tuned=True)["loss_kernel.kernel"] == "framework"
    assert "loss_kernel.kernel" not in strategies.seed_params(SearchSpace(device="cuda"), tuned=True)


def test_the_accuracy_check_keys_and_trains_the_fused_loss_as_its_own_numerics(fused_reference):
    from autotune.accuracy.settings import AccuracySettings
    from autotune.accuracy.worker import check

    bf16 = {"precision": {"mode": "bf16"}}
    fused = {**bf16, "loss_kernel": {"kernel": "fused_linear"}}
    assert numerics_key(fused) != numerics_key(bf16) == numerics_key({**bf16, "loss_kernel": {"kernel": "framework"}})
    assert describe_numerics(fused) == "bf16, fused linear CE"
    workload, batch = _lm()
    spec = WorkloadSpec(model=LLAMA[0], model_config=dict(LLAMA[1]), seq_len=SEQ)
    settings = AccuracySettings.for_device("cpu", steps=10, batch_size=4)
    space = SearchSpace(device="cpu")
    got = check._one_step(spec, {"loss_kernel": {"kernel": "fused_linear"}}, space, settings, batch, torch.float32)
    assert fused_reference
    want = check._one_step(spec, {}, space, settings, batch, torch.float32)
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)


# the probe ---------------------------------------------------------------------------------------


class _ScaledLogits(nn.Module):
    """A causal LM that scales its logits after the head (as Cohere's does): not fusable."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(1000, 8), nn.Linear(8, 1000)

    def forward(self, x):
        return self.head(self.embed(x)) * 0.5


def test_the_probe_finds_a_fusable_head_and_says_why_not(monkeypatch):
    workload, (x, _) = _lm(GPT2)
    assert loss_kernel.probe(workload, x, device="cpu") == {"vocab": 50257, "fusable": True, "reason": None}
    monkeypatch.setattr(loss_kernel, "liger_problem", lambda: "liger-kernel is not installed")
    assert loss_kernel.probe(workload, x, device="cuda")["reason"] == "liger-kernel is not installed"
    assert "no forward pass" in loss_kernel.probe(workload, x, device="cpu", forward=False)["reason"]
    scaled = SimpleNamespace(model=_ScaledLogits(), loss_fn=causal_lm_loss)
    assert "changes its LM head's output" in loss_kernel.probe(scaled, x % 1000, device="cpu")["reason"]
    other_loss = SimpleNamespace(model=workload.model, loss_fn=lambda out, t: out.sum())
    assert "not known to be the cross-entropy" in loss_kernel.probe(other_loss, x, device="cpu")["reason"]
    assert loss_kernel.probe(SimpleNamespace(model=nn.Linear(4, 4), loss_fn=None), x, device="cpu") is None


# exports -----------------------------------------------------------------------------------------


def test_hf_export_turns_liger_s_fused_loss_on_and_the_others_say_how():
    transformers = pytest.importorskip("transformers")
    space = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[8],
                        choices={"loss_kernel": list(loss_kernel.KERNELS)})
    cfg = TunedConfig.from_params({"precision.mode": "bf16", **FUSED}, space, info={"workload": {"model": "hf:llama"}})
    kwargs, unsupported = cfg.hf_training_args()
    assert kwargs["use_liger_kernel"] is True and unsupported == []
    assert {k: v for k, v in kwargs["liger_kernel_config"].items() if v} == {"fused_linear_cross_entropy": True}
    assert set(kwargs) <= set(transformers.TrainingArguments.__dataclass_fields__)
    # liger's transformers patch has no GPT-2, installed or not: the Trainer would leave its loss as it is
    gpt2 = TunedConfig.from_params({"precision.mode": "bf16", **FUSED}, space, info={"workload": {"model": "hf:gpt2"}})
    kwargs, unsupported = gpt2.hf_training_args()
    assert "use_liger_kernel" not in kwargs and [u["setting"] for u in unsupported] == ["loss_kernel.kernel"]
    framework = TunedConfig.from_params({"precision.mode": "bf16", "loss_kernel.kernel": "framework"}, space)
    assert "use_liger_kernel" not in framework.hf_training_args()[0]
    why = next(u["why"] for u in cfg.accelerate_config().unsupported if u["setting"] == "loss_kernel.kernel")
    assert "strategies.loss_kernel.fused_loss(model, loss_fn)" in why
    from autotune.deploy.exports import lightning_settings

    assert "loss_kernel.kernel" in {u["setting"] for u in lightning_settings(cfg)["unsupported"]}


def _hide_liger(monkeypatch) -> None:
    """liger-kernel not importable in this process, as on a machine without it."""
    for name in ["liger_kernel", *(n for n in sys.modules if n.startswith("liger_kernel."))]:
        monkeypatch.setitem(sys.modules, name, None)


def test_the_hf_export_lists_the_fused_loss_where_the_trainer_cannot_apply_it_whatever_is_installed(
        monkeypatch, tmp_path):
    """TrainingArguments(use_liger_kernel=True) patches a transformers model of a type liger-kernel
    patches, nothing else: the export of any other workload lists the fused loss, and the file is
    the same with liger-kernel importable where it is written and without."""
    space = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[8],
                        choices={"loss_kernel": list(loss_kernel.KERNELS)})
    workloads = ["my_models:small_gpt", None, "hf:gpt2", "hf:llama", "hf:gemma"]

    def exported(folder):
        out = {}
        for model in workloads:
            info = {"workload": {"model": model}} if model else {}
            cfg = TunedConfig.from_params({"precision.mode": "bf16", **FUSED}, space, info=info)
            files, _ = cfg.export("hf", tmp_path / folder / str(len(out)))
            out[model] = json.loads(files[0].read_text())
        return out

    installed = exported("installed")
    _hide_liger(monkeypatch)
    assert loss_kernel.liger_problem() is not None
    assert exported("hidden") == installed
    for model in ("my_models:small_gpt", None, "hf:gpt2"):
        data = installed[model]
        assert [u["setting"] for u in data["unsupported"]] == ["loss_kernel.kernel"], model
        assert "strategies.loss_kernel.fused_loss(model, loss_fn)" in data["unsupported"][0]["why"]
        assert "use_liger_kernel" not in data["training_args"], model  # it would apply nothing
    assert "not an hf: model" in installed["my_models:small_gpt"]["unsupported"][0]["why"]
    for model in ("hf:llama", "hf:gemma"):
        args = installed[model]["training_args"]
        assert installed[model]["unsupported"] == [] and args["use_liger_kernel"] is True
        # every layer switch named off: liger turns on what is left out (Gemma's GeGLU, unmeasured)
        assert {k for k, v in args["liger_kernel_config"].items() if v} == {"fused_linear_cross_entropy"}
    assert installed["hf:gemma"]["training_args"]["liger_kernel_config"]["geglu"] is False


def test_the_model_types_the_hf_export_counts_on_are_patched_by_the_installed_liger():
    """exports.LIGER_MODEL_TYPES against the liger-kernel installed here: each type has an apply
    function that takes the fused loss's switch (the Trainer passes it only what it takes)."""
    import inspect

    patches = pytest.importorskip("liger_kernel.transformers.monkey_patch").MODEL_TYPE_TO_APPLY_LIGER_FN
    from autotune.deploy.exports import LIGER_MODEL_TYPES

    assert LIGER_MODEL_TYPES <= set(patches) and "gpt2" not in patches
    for kind in LIGER_MODEL_TYPES:
        assert "fused_linear_cross_entropy" in inspect.signature(patches[kind]).parameters, kind


@pytest.mark.slow
def test_a_compiled_model_hands_its_hidden_states_to_the_fused_loss_outside_it(fused_reference):
    """torch.compile traces the head's new forward (its input in training mode) into the model's
    graph; the loss runs after it, eager. On 2 CPU cores the compile takes about 15 s."""
    workload, (x, y) = _lm()
    framework_model = copy.deepcopy(workload.model)
    cfg = _cfg({**FUSED, "compile.mode": "default"}, compile_modes=["off", "default"])
    assert cfg.recipe.compile_mode == "default"
    fused_losses, fused_params = _train(cfg, workload.model, x, y)
    losses, params = _train(_cfg({"loss_kernel.kernel": "framework"}), framework_model, x, y)
    assert fused_losses == pytest.approx(losses, abs=1e-5) and len(fused_reference) == 3
    for name, p in params.items():
        torch.testing.assert_close(fused_params[name], p, atol=1e-5, rtol=0, msg=name)


# liger's own kernel ------------------------------------------------------------------------------

LIGER_ON_CPU = textwrap.dedent('''
    import copy, json, torch
    from autotune.workload.hub import causal_lm_loss
    from autotune.workload.models import WorkloadSpec, build, logits
    from strategies import loss_kernel
    from strategies.vocab_padding import pad_vocab

    torch.manual_seed(0)
    spec = WorkloadSpec(model="hf:llama", model_config=json.loads(__import__("sys").argv[1]), seq_len=16)
    workload = build(spec)
    x, y = workload.batch(4, torch.Generator().manual_seed(1))
    out = {}
    for name, model in (("plain", workload.model), ("padded", pad_vocab(copy.deepcopy(workload.model), 64))):
        framework = copy.deepcopy(model)
        loss = loss_kernel.fused_loss(model, causal_lm_loss)(logits(model(x)), y)
        loss.backward()
        ref = causal_lm_loss(logits(framework(x)), y)
        ref.backward()
        grads = [(p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), framework.parameters())]
        out[name] = {"loss": abs(loss.item() - ref.item()), "grad": max(grads)}
    print(json.dumps(out))
''')


@pytest.mark.slow
def test_liger_s_own_kernel_gives_the_framework_loss_and_gradients_under_tritons_cpu_interpreter(tmp_path):
    """liger's Triton kernel, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before
    liger is imported: a process of its own), through the same fused_loss the step calls."""
    pytest.importorskip("liger_kernel")
    script = tmp_path / "liger_on_cpu.py"
    script.write_text(LIGER_ON_CPU)
    env = subprocess_env(TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(script), json.dumps(LLAMA[1])], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("plain", "padded"):
        assert out[name]["loss"] <= 1e-5 and out[name]["grad"] <= 1e-5, out


HF_TRAINER = textwrap.dedent('''
    import json, sys, tempfile
    import torch, transformers
    from autotune.deploy.config import TunedConfig
    from autotune.space import SearchSpace

    space = SearchSpace(device="cpu", batch_sizes=[4], choices={"loss_kernel": ["framework", "fused_linear"]})
    out = {}
    for kernel in ("framework", "fused_linear"):
        cfg = TunedConfig.from_params({"loss_kernel.kernel": kernel}, space, info={"workload": {"model": "hf:llama"}})
        kwargs, unsupported = cfg.hf_training_args()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**json.loads(sys.argv[1])))
        tokens = torch.randint(0, 1000, (8, 16), generator=torch.Generator().manual_seed(1))
        with tempfile.TemporaryDirectory() as folder:
            args = transformers.TrainingArguments(output_dir=folder, max_steps=2, report_to="none", save_strategy="no",
                                                  logging_steps=1, learning_rate=1e-3, **kwargs)
            trainer = transformers.Trainer(model=model, args=args,
                                           train_dataset=[{"input_ids": t, "labels": t} for t in tokens])
            trainer.train()
        out[kernel] = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                       "forward": getattr(model.forward, "__func__", model.forward).__module__,
                       "unsupported": unsupported}
    print(json.dumps(out))
''')


@pytest.mark.slow
def test_the_hf_export_has_the_trainer_compute_liger_s_fused_loss(tmp_path):
    """TrainingArguments(use_liger_kernel=True, liger_kernel_config=...) as exported: the Trainer
    patches the Llama's forward with liger's fused loss (under Triton's CPU interpreter) and trains
    as without it."""
    pytest.importorskip("liger_kernel")
    script = tmp_path / "hf_trainer.py"
    script.write_text(HF_TRAINER)
    done = subprocess.run([sys.executable, str(script), json.dumps(LLAMA[1])], env=subprocess_env(TRITON_INTERPRET="1"),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["fused_linear"]["forward"].startswith("liger_kernel.")
    assert out["framework"]["forward"].startswith("transformers.")
    assert out["fused_linear"]["losses"] == pytest.approx(out["framework"]["losses"], abs=1e-4)
    assert len(out["fused_linear"]["losses"]) == 2 and out["fused_linear"]["unsupported"] == []


# on the GPU --------------------------------------------------------------------------------------

TINY_LLAMA = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 512}


def _gpu_step(kernel, vocab, *, mode="fp32", compile_mode="off", steps=2):
    """The loss and peak allocated bytes of a tiny Llama's train_step with ``kernel`` (the model's
    weights seeded the same for both kernels), after a first step that makes the optimizer's state."""
    torch.manual_seed(0)
    workload = build(WorkloadSpec(model="hf:llama", model_config={**TINY_LLAMA, "vocab_size": vocab}, seq_len=256))
    space = SearchSpace(device="cuda", precisions=["fp32", "bf16"], batch_sizes=[4],
                        compile_modes=["off", "default", "reduce-overhead"], choices={"loss_kernel": list(loss_kernel.KERNELS)})
    cfg = TunedConfig.from_params({"precision.mode": mode, "compile.mode": compile_mode,
                                   "loss_kernel.kernel": kernel}, space)
    model, optimizer = cfg.prepare(workload.model, torch.optim.AdamW(workload.model.parameters(), lr=1e-4))
    step = cfg.train_step(model, optimizer, causal_lm_loss)
    x, y = (t.cuda() for t in workload.batch(4, torch.Generator().manual_seed(1)))
    losses = [float(step(x, y))]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses += [float(step(x, y)) for _ in range(steps - 1)]
    torch.cuda.synchronize()
    return losses, torch.cuda.max_memory_allocated()


@pytest.mark.gpu
def test_liger_on_the_gpu_gives_the_framework_loss_in_fp32_and_bf16_compiled(restore_backend_flags):
    pytest.importorskip("liger_kernel")
    fused, _ = _gpu_step("fused_linear", 32000)
    framework, _ = _gpu_step("framework", 32000)
    assert fused == pytest.approx(framework, abs=1e-3)
    # the compiled model with the loss outside it, eager, under bf16 autocast; its CUDA graphs too
    framework, _ = _gpu_step("framework", 32000, mode="bf16", compile_mode="default", steps=3)
    for compile_mode in ("default", "reduce-overhead"):
        fused, _ = _gpu_step("fused_linear", 32000, mode="bf16", compile_mode=compile_mode, steps=3)
        assert fused == pytest.approx(framework, abs=2e-2), compile_mode


@pytest.mark.gpu
def test_liger_on_the_gpu_holds_no_logits(restore_backend_flags):
    """At a 128,256-token vocabulary, 4 x 256 tokens' FP32 logits are 0.49 GiB: the framework's step
    holds them, their log-softmax and their gradient; the fused one a chunk's worth."""
    pytest.importorskip("liger_kernel")
    vocab = 128256
    _, fused = _gpu_step("fused_linear", vocab)
    _, framework = _gpu_step("framework", vocab)
    logits_bytes = 4 * 256 * vocab * 4
    assert fused <= framework - logits_bytes, (fused / 2**30, framework / 2**30)


@pytest.mark.gpu
def test_the_probe_offers_it_on_this_gpu():
    pytest.importorskip("liger_kernel")
    assert loss_kernel.liger_problem() is None  # liger-kernel 0.8+ and its Triton import here
    workload, (x, _) = _lm()
    assert loss_kernel.probe(workload, x, device="cuda") == {"vocab": 1000, "fusable": True, "reason": None}
