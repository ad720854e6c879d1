"""llm_kernels: a transformers LLM's RMSNorm, rotary embedding (RoPE) and gated MLP activation
(SwiGLU, GeGLU) as liger-kernel's Triton kernels, or as transformers writes them.

transformers computes each of them as a chain of PyTorch operations: an RMSNorm is an upcast, a
square, a mean, a reciprocal square root, two multiplies and a downcast, each a kernel of its own
in eager mode that reads and writes the hidden states, several of them kept for the backward pass.
liger-kernel (linkedin/Liger-Kernel) computes each in one Triton kernel forward and one backward,
and keeps less: its RMSNorm its input and one inverse RMS a row, its SwiGLU the two projections it
multiplies. The functions are transformers' own, rounded otherwise (its RMSNorm computes the
inverse RMS in FP32 as Llama's does: liger's "llama" casting mode).

"liger" calls liger's patch for the model's type, ``apply_liger_kernel_to_<model_type>(model=...,
cross_entropy=False, fused_linear_cross_entropy=False)`` (liger's ``MODEL_TYPE_TO_APPLY_LIGER_FN``:
what ``TrainingArguments(use_liger_kernel=True)`` applies), at model preparation (a model transform,
before the model moves to the GPU; ``cfg.prepare`` does it). The losses stay off: a fused linear
cross-entropy is the ``loss_kernel`` knob's, with its own checks. For a Llama, liger 0.8.5's patch

* binds LigerRMSNorm's forward (and its eps, casting mode and in-place backward) on each RMSNorm
  instance, the decoder layers' two and the final one, and LigerSwiGLUMLP's forward on each decoder
  layer's MLP: parameters, buffers, classes and the state_dict stay what they were;
* and, process-wide, sets transformers' modeling module of that type: its ``apply_rotary_pos_emb``
  becomes liger's RoPE (liger has no RoPE patch of an instance: the attention looks the function up
  when it runs), its RMSNorm and MLP classes liger's (a model of that type built later in the
  process is built with them). A trial runs in a process of its own; in yours, as with the
  Trainer's ``use_liger_kernel``, every model of that type uses liger's RoPE from then on (wrapped
  for torch.compile: below).

Where it is offered: on CUDA, for a model that holds one transformers model (``PreTrainedModel``)
whose ``config.model_type`` liger patches (llama, mistral, qwen2/3, gemma, phi3 and others), whose
MLP activation is the one liger's kernel computes (SiLU for SwiGLU, tanh-approximated GELU for
GeGLU: its instance patch binds the kernel's forward whatever the configuration says), with
liger-kernel 0.8+ importable (``pip install 'autotune[memory]'``). Not on a CPU: liger's kernels are
Triton, which runs on GPUs. Otherwise, for a language model, one line at search start says why.

How it composes:

* torch.compile: each of liger's kernels is a graph break: it runs as in eager mode, and the compiled
  graphs end before it and start after it. Traced by TorchDynamo, liger's autograd Functions (their
  forwards set attributes on ``ctx`` and write their outputs in place with Triton kernels) failed with
  torch 2.11: its rewritten autograd.Function tracing (pytorch/pytorch#166788) raised an
  AssertionError (overwrite_tensor_vt_proxy) at the first LigerRMSNorm of a compiled tiny Llama, and
  the same rewrite computes wrong gradients for forwards that write in place (#180642, fixed in 2.12
  by #180921). So :func:`apply_liger` wraps each forward it binds, and liger's RoPE in transformers'
  module (:func:`eager_under_compile`): eager, they run as liger wrote them; traced by TorchDynamo,
  they call ``torch.compiler.disable``'d forwards. That holds wherever the model is compiled, by
  ``cfg.prepare`` or by your own ``torch.compile`` after ``apply_liger(model)``. It costs fusion: a
  Llama decoder layer has four breaks (its two norms, the RoPE, the MLP, whose projections run
  eagerly around liger's SwiGLU), Inductor fuses nothing across them, and under reduce-overhead each
  graph between them is a CUDA graph of its own. Inductor fuses the same chains itself (on a B300 a
  compiled liger SwiGLU was 3.1x slower than Inductor's own: linkedin/Liger-Kernel#1330), so it is
  sampled with every compile mode and measured; the GPU test of tests/test_llm_kernels.py trains a
  compiled tiny Llama with it.
* whole-step CUDA graphs: 0.8.5's RMSNorm, RoPE and SwiGLU neither synchronise with the host nor
  read device values on it, so the step stays capturable (the GPU test captures a tiny Llama's).
* loss_kernel: independent (the LM head and the loss are left alone); ``autotune export --to hf``
  writes both knobs' switches in one ``liger_kernel_config``.
* fp32_layers: it comes after this knob, and its wrapper calls the class's forward, so a layer both
  touch runs in FP32 as transformers writes it; a Llama-type model's norms are transformers' own
  classes, which fp32_layers' "norm" (torch's norm layers) does not pick.
* activation checkpointing recomputes liger's forward as any other; fp16, bf16 and FP32 run.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from strategies.base import Strategy
from strategies.loss_kernel import MEMORY_EXTRA, liger_problem

KERNELS = ("framework", "liger")
LOSS_SWITCHES = ("cross_entropy", "fused_linear_cross_entropy")
"""liger's loss switches, off here: the loss is the loss_kernel knob's."""
HF_SWITCHES = ("rope", "rms_norm", "swiglu")
"""The layer switches TrainingArguments' ``liger_kernel_config`` names for this knob."""
OTHER_SWITCHES = ("geglu", "layer_norm", "relu_squared")
"""Layer switches of some model types' apply functions (Gemma's GeGLU, a vision tower's LayerNorm,
Nemotron's ReLU squared): on, this knob leaves them at liger's defaults, as a Trainer does."""
ACTIVATIONS = {"swiglu": ("silu", "swish"), "geglu": ("gelu_pytorch_tanh", "gelu_new"), "relu_squared": ("relu2",)}
"""The MLP activations (transformers' ACT2FN names) each gated kernel of liger computes."""
NOT_ON_CPU = "liger's kernels are Triton, which runs on CUDA GPUs"
GRAPH_BREAK = "_autotune_graph_break"
"""The attribute that marks a function :func:`eager_under_compile` made (so it is not wrapped twice)."""


def transformers_models(model: nn.Module) -> list[nn.Module]:
    """The outermost transformers models (``PreTrainedModel``) in ``model``, itself included;
    transformers is looked up only where it is imported already, as it is wherever one was built."""
    utils = sys.modules.get("transformers.modeling_utils")
    if utils is None:
        return []
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # pre-order: a parent comes before its children
        if id(module) not in inside and isinstance(module, utils.PreTrainedModel):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def model_type(model: nn.Module) -> str | None:
    """A transformers model's ``config.model_type`` ("llama")."""
    return getattr(getattr(model, "config", None), "model_type", None)


def apply_function(kind: str | None) -> Callable[..., None] | None:
    """liger's ``apply_liger_kernel_to_<kind>``; None where liger has none or does not import."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # not installed, or no Triton: liger_problem says which
        return None
    return MODEL_TYPE_TO_APPLY_LIGER_FN.get(kind) if kind else None


def _activation_problem(config: Any, switches: Mapping[str, Any]) -> str | None:
    """Why the model's MLP activation is not what liger's gated kernel for it computes; None if it is."""
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    for switch, computed in ACTIVATIONS.items():
        if switch in switches and isinstance(activation, str) and activation not in computed:
            return (f"its MLP's activation is {activation}, and liger's {switch} kernel, bound in place of the "
                    f"MLP's forward, computes {computed[0]}")
    return None


def unpatchable(target: nn.Module) -> str | None:
    """Why liger's kernels cannot be applied to the transformers model ``target``; None if they can."""
    problem = liger_problem()
    if problem is not None:
        return problem
    kind = model_type(target)
    apply = apply_function(kind)
    if apply is None:
        return f"liger-kernel has no patches for {kind or 'untyped'} models (its MODEL_TYPE_TO_APPLY_LIGER_FN)"
    return _activation_problem(target.config, inspect.signature(apply).parameters)


def eager_under_compile(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` as it is in eager mode, and a graph break under torch.compile: traced by TorchDynamo
    (``torch.compiler.is_compiling()``), it calls ``torch.compiler.disable(func)``, which TorchDynamo
    does not trace, nor anything it calls: ``func`` runs eagerly between the graphs compiled before and
    after it (a ``fullgraph=True`` compile refuses it). It keeps ``func``'s name (``__wrapped__`` is
    ``func``); a function it made is returned as it is."""
    if getattr(func, GRAPH_BREAK, False):
        return func
    disabled = torch.compiler.disable(func)

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return func(*args, **kwargs)

    setattr(run, GRAPH_BREAK, True)
    return run


def _liger_s(func: Any) -> bool:
    """Whether ``func`` is a Python function of liger-kernel's (its module is liger_kernel's)."""
    return isinstance(func, types.FunctionType) and (func.__module__ or "").startswith("liger_kernel.")


def break_graphs_at_liger(target: nn.Module) -> list[str]:
    """Make each of liger's kernels that its patch bound on the transformers model ``target`` a graph
    break under torch.compile (:func:`eager_under_compile`): the liger forwards bound on its modules, and
    liger's functions in the modeling modules of its modules' classes (its RoPE, which the attention
    looks up there). Returns what it wrapped ("model.norm.forward", "modeling_llama.apply_rotary_pos_emb")."""
    wrapped = []
    for name, module in target.named_modules():
        func = getattr(module.__dict__.get("forward"), "__func__", None)
        if _liger_s(func) and not getattr(func, GRAPH_BREAK, False):
            module.__dict__["forward"] = types.MethodType(eager_under_compile(func), module)
            wrapped.append(f"{name or '<model>'}.forward")
    modeling = {sys.modules.get(type(m).__module__) for m in target.modules()}
    for namespace in sorted((m for m in modeling if m is not None and m.__name__.startswith("transformers.")),
                            key=lambda m: m.__name__):
        for attr, value in list(vars(namespace).items()):
            if _liger_s(value) and not getattr(value, GRAPH_BREAK, False):
                setattr(namespace, attr, eager_under_compile(value))
                wrapped.append(f"{namespace.__name__.rsplit('.', 1)[-1]}.{attr}")
    return wrapped


def dynamo_fails_on_liger(version: str | None = None) -> bool:
    """Whether TorchDynamo of this torch (``version``: another's) fails on liger's kernels where nothing
    breaks the graph at them: 2.11's autograd.Function tracing (pytorch/pytorch#180642, fixed in 2.12)."""
    release = (version or torch.__version__).split("+")[0].split(".")
    try:
        return (int(release[0]), int(release[1])) == (2, 11)
    except (IndexError, ValueError):
        return False


def apply_liger(model: nn.Module) -> nn.Module:
    """Apply liger-kernel's kernels to the layers of the transformers model in ``model`` (``model``
    itself, or one inside it), in place, losses off, each kernel a graph break under torch.compile
    (:func:`break_graphs_at_liger`); returns ``model``. What it changes: the module's docstring.
    ConfigError where it cannot (no transformers model, a type liger does not patch, liger-kernel
    missing)."""
    found = transformers_models(model)
    if len(found) != 1:
        raise ConfigError(f"this configuration applies liger-kernel's kernels to a transformers model's layers "
                          f"(llm_kernels 'liger'), and {type(model).__name__} holds {len(found) or 'no'} transformers "
                          "models where it needs one; use a configuration with llm_kernels 'framework'")
    target = found[0]
    why = unpatchable(target)
    if why is not None:
        raise ConfigError(f"this configuration applies liger-kernel's kernels to the model's layers (llm_kernels "
                          f"'liger'), and {why}; use a configuration with llm_kernels 'framework'")
    apply = apply_function(model_type(target))
    assert apply is not None  # unpatchable said so
    parameters = inspect.signature(apply).parameters
    apply(model=target, **{switch: False for switch in LOSS_SWITCHES if switch in parameters})
    break_graphs_at_liger(target)
    return model


def probe(model: nn.Module, *, device: str) -> dict[str, Any] | None:
    """What the offer needs to know (the probe's ``llm_kernels``): None for a model without a
    transformers model in it; else ``{"model_type", "reason"}``, reason None where liger's kernels
    apply on ``device`` (liger-kernel is imported only on CUDA)."""
    found = transformers_models(model)
    if not found:
        return None
    if len(found) > 1:
        return {"model_type": None, "reason": f"the model holds {len(found)} transformers models, and liger's "
                                              "patch takes one"}
    kind = model_type(found[0])
    return {"model_type": kind, "reason": unpatchable(found[0]) if device == "cuda" else NOT_ON_CPU}


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
KERNELS_PARAM = "llm_kernels.kernels"


class LLMKernels(Strategy):
    """A transformers LLM's layers as liger-kernel's Triton kernels (see the module's docstring)."""

    name = "llm_kernels"
    label = "LLM kernels"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        kernels: str = "framework"
        """framework (transformers' layers as written) | liger (liger-kernel's RMSNorm, RoPE and
        SwiGLU/GeGLU kernels, bound by its apply_liger_kernel_to_<model_type>)."""

        def __post_init__(self) -> None:
            if self.kernels not in KERNELS:
                raise ValueError(f"llm_kernels.kernels {self.kernels!r}: choose from {', '.join(KERNELS)}")

    def applies(self, space: SearchSpace) -> bool:
        return len(space.choices.get(self.name, [])) > 1

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        if device != "cuda":
            return {}  # liger's kernels are Triton: not on a CPU
        found = probe.get("llm_kernels")
        if found is None and not probe.get("vocab_size"):
            return {}  # not a language model: nothing to say
        reason = found.get("reason") if found is not None else \
            "the model is not a transformers model (PreTrainedModel), which liger's patches are written for"
        if reason is not None:
            warnings.warn(f"liger-kernel's LLM kernels (llm_kernels) are not searched: {reason}", stacklevel=4)
            return {}
        return {"choices": {self.name: list(KERNELS)}}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        # transformers' layers in the baseline and the known-good recipes; the search tries liger's
        return {self.param("kernels"): "framework"} if self.applies(space) else {}

    def words(self, values: Mapping[str, Any]) -> str:
        return "liger kernels" if values.get("kernels", "framework") == "liger" else ""

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(kernels=self.choose(trial, "kernels", list(space.choices[self.name])))

    def apply(self, config: Config, recipe: Recipe) -> None:
        if config.kernels == "liger":
            recipe.llm_kernels = "liger"  # its first step compiles the kernels (TrainStep.num_setup_steps)
            recipe.model_transforms.append(apply_liger)
            recipe.notes.append(f"cfg.prepare applies liger-kernel's RMSNorm, RoPE and SwiGLU kernels to your "
                                f"transformers model ({MEMORY_EXTRA}); liger's RoPE is set in transformers' module, "
                                "for every model of that type in the process; under torch.compile each kernel is a "
                                "graph break (it runs eagerly, the compiled graphs end before it and start after it)")
