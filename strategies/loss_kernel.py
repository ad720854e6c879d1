"""loss_kernel: the framework's cross-entropy, or a fused linear cross-entropy that never holds the logits.

A language model's last layer, the LM head, turns each token's hidden state (width H) into one
logit per vocabulary entry (V), and the loss reads them once. Computed the framework's way the
logits are a tensor of tokens x V: for a 128,256-token vocabulary, one 1,024-token sequence's
logits are 0.24 GiB in bf16, twice that once upcast to FP32 for the loss, as much again for their
gradient. On a 24 GB card that memory sets the batch of a 1B LLM.

A fused linear cross-entropy ("fused_linear") computes the head's matmul and the loss together,
a chunk of tokens at a time, and the gradients of the hidden states, the head's weight and bias
with them, so only one chunk's logits ever exist. The loss and gradients are those of the
framework's cross-entropy up to rounding (the accumulation order changes), so the accuracy check
compares it with FP32 as it does a precision.

How it runs here: ``cfg.train_step`` (autotune.deploy.runtime.TrainStep) has the model's LM head
hand its input on in training mode, so the model's output (``.logits`` for a transformers model)
is the hidden states, and computes the loss from them and the head's own weight and bias
(:func:`step_loss`). The head stays in place, with its weight (tied to the embedding or not), so
the state_dict, the optimizer and weight tying are unchanged; in eval mode the head computes
logits as before and the loss is the user's own. ``cfg.prepare`` leaves the model as it is: a loop
of your own gets the fused loss with ``loss_fn = strategies.loss_kernel.fused_loss(model, loss_fn)``
once after ``cfg.prepare``.

The library: liger-kernel's ``LigerFusedLinearCrossEntropyLoss`` (``pip install
'autotune[memory]'``), not Apple's cut-cross-entropy, because

* HF's ``TrainingArguments`` carries it (``use_liger_kernel``, ``liger_kernel_config``), so
  ``autotune export --to hf`` expresses the configuration that was measured; cut-cross-entropy has
  no Trainer option;
* its gradient is the exact one in the dtype of the logits; cut-cross-entropy's default
  (``filter_eps="auto"``) skips gradient blocks below bf16's resolution, a further change of numerics;
* it is released with the liger kernels for RMSNorm, RoPE and SwiGLU that the issue's llm_kernels
  knob applies, one dependency for both (liger-kernel 0.8.5 is of this year; cut-cross-entropy's
  last PyPI release, 25.1.1, of January 2025).

cut-cross-entropy needs less memory: it recomputes the logits in the backward pass instead of
holding the head's weight gradient (V x H) from the forward on, and its logits never leave
on-chip memory; liger computes the gradients in the forward, so its backward is a copy. Which is
faster on a GPU is a measurement: a function with :func:`liger_linear_cross_entropy`'s signature
put in ``IMPLEMENTATIONS["fused_linear"]`` swaps the library (cut-cross-entropy's is
``linear_cross_entropy(hidden, weight, targets, bias, ignore_index=..., reduction=...)``).

Where it is offered: on CUDA (liger's kernels are Triton), with liger-kernel 0.8+ importable, for a
model whose loss is the next-token cross-entropy of its LM head's logits: ``hf:`` causal LMs, or a
Workload whose ``loss_fn`` is ``torch.nn.CrossEntropyLoss``; the probe checks that the model returns
the head's output as it is (a model that scales or soft-caps its logits after the head is not
offered). Otherwise a line at search start says why. Not sampled with:

* fp16: liger writes the logits' gradient (softmax - one-hot) / tokens in the logits' dtype during
  the forward, before GradScaler's scale reaches it in the backward; in fp16 most of it underflows
  (1/V = 8e-6 over 16,384 tokens is 5e-10, under fp16's smallest subnormal, 6e-8). bf16 has FP32's range;
* vocab_padding: the fused loss reads the real vocabulary's rows only (the padded head's weight is
  narrowed, a free view), so padding buys nothing and costs a padded copy of the head's gradient;
* cuda_graphs (whole-step capture): liger counts the targets that are not ignored with ``.item()``
  in every forward and compares the backward's incoming gradient with 1.0 on the host, and neither
  is legal during a capture (strategies.cuda_graphs.legal says so); compile's "reduce-overhead"
  graphs only the compiled model, and the loss runs after it, eager, with liger's own kernels;
* --ddp: the head's gradient is computed outside DistributedDataParallel's forward; not measured.

It composes with torch.compile (the model compiled, the loss eager outside it: its host sync would
split a compiled graph), autocast (the head's matmul runs in the autocast dtype; liger's softmax and
loss accumulate in FP32, the weight's gradient in FP32 for FP32 weights), fp32_layers "head" (the
fused loss then runs in FP32 without autocast), GradScaler (the scale comes in as the backward's
incoming gradient, which liger multiplies in) and gradient accumulation (likewise 1/k).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
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
from strategies.vocab_padding import vocab_size

KERNELS = ("framework", "fused_linear")
LIGER_MIN = (0, 8)
"""liger-kernel's oldest version this knob was written against (0.8.5's source)."""
MEMORY_EXTRA = "pip install 'autotune[memory]'"
SHORT_SEQUENCE = 16
"""Tokens of the probe's forward pass: whether the model returns its head's output as it is does
not depend on the sequence's length."""
_FUSED = "_autotune_fused_loss"
"""The attribute marking an LM head whose forward hands its input on in training mode."""
_BEFORE = "_autotune_forward_before"
"""The attribute keeping the forward an LM head had on the instance (an fp32_layers wrapper), for eval mode."""
_FP32_MARK = "_autotune_fp32"
"""strategies.fp32_layers' mark of a layer kept in FP32 under autocast."""


def liger_linear_cross_entropy(weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
                               bias: torch.Tensor | None = None, *, ignore_index: int = -100,
                               label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """The cross-entropy of ``hidden @ weight.T + bias`` (tokens x H, V x H, V) against ``targets``
    (tokens), by liger-kernel's fused linear cross-entropy: the logits a chunk of tokens at a time,
    the gradients computed with them."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, label_smoothing=label_smoothing,
                                            reduction=reduction)
    return loss(weight, hidden, targets, bias)


IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {"fused_linear": liger_linear_cross_entropy}
"""The function each fused kernel runs: the one place another library (or, in the CPU tests, a
pure-PyTorch reference of the same math) goes in."""


def liger_problem() -> str | None:
    """Why liger-kernel's fused linear cross-entropy cannot run in this environment; None if it can
    (installed, 0.8 or newer, and importable: it imports Triton)."""
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return f"liger-kernel is not installed ({MEMORY_EXTRA})"
    if tuple(int(p) for p in re.findall(r"\d+", version)[:2]) < LIGER_MIN:
        return f"liger-kernel {version} is older than {'.'.join(map(str, LIGER_MIN))} ({MEMORY_EXTRA} upgrades it)"
    try:
        importlib.import_module("liger_kernel.transformers")
    except Exception as exc:  # Triton missing or broken: the import says which
        return f"liger-kernel does not import ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
    return None


LIGER_HF_KERNELS = ("rope", "swiglu", "rms_norm", "cross_entropy", "fused_linear_cross_entropy")
"""The switches of liger-kernel's transformers patches (TrainingArguments' ``liger_kernel_config``)."""


def hf_liger_config(kernel: str, config: Mapping[str, bool] | None = None) -> dict[str, bool]:
    """TrainingArguments' ``liger_kernel_config`` with ``kernel``'s fused linear cross-entropy, over
    ``config`` (another knob's switches): every switch named, since liger's patches turn on what is
    left out (RoPE, SwiGLU, RMSNorm and the fused loss for a Llama)."""
    return {**{name: False for name in LIGER_HF_KERNELS}, **(config or {}),
            "fused_linear_cross_entropy": kernel == "fused_linear", "cross_entropy": False}


# the LM head and the loss it fuses with --------------------------------------------------------


def _rows(layer: nn.Linear) -> int:
    """The vocabulary a head computes logits for (a vocab-padded head's real rows)."""
    return int(getattr(layer, "vocab_size", layer.out_features))


def _is_head(layer: Any, vocab: int) -> bool:
    """An nn.Linear with an output per vocabulary entry (``vocab``: the largest embedding's rows,
    padded ones included where vocab_padding padded both)."""
    return isinstance(layer, nn.Linear) and vocab in (layer.out_features, _rows(layer))


def find_head(model: nn.Module) -> nn.Linear:
    """The model's LM head: the ``nn.Linear`` (of any subclass: vocab-padded, channel-aligned,
    float8) with one output per vocabulary entry (:func:`strategies.vocab_padding.vocab_size`),
    the model's ``get_output_embeddings()`` where it has one. ConfigError where there is none, or
    several."""
    vocab = vocab_size(model)
    if vocab is None:
        raise ConfigError("the fused linear cross-entropy needs a language model: this one has no token "
                          "embedding (an nn.Embedding of 1,000 rows or more); use loss_kernel 'framework'")
    own = getattr(model, "get_output_embeddings", None)
    head = own() if callable(own) else None
    if _is_head(head, vocab):
        return head
    heads = [m for m in model.modules() if _is_head(m, vocab)]
    if len(heads) != 1:
        raise ConfigError(f"the fused linear cross-entropy computes the LM head's logits itself, and this model has "
                          f"{len(heads) or 'no'} nn.Linear layer{'s' if len(heads) != 1 else ''} with {vocab:,} outputs "
                          "(its vocabulary) where it needs one; use loss_kernel 'framework'")
    return heads[0]


def cross_entropy_options(loss_fn: Any) -> dict[str, Any]:
    """The options of the cross-entropy ``loss_fn`` computes, for the fused kernel to compute the
    same: autotune's causal_lm_loss (every position's next-token cross-entropy, mean) or a
    ``torch.nn.CrossEntropyLoss`` without class weights, mean or sum. Any other loss is refused: the
    fused kernel replaces the loss, so it must be known to be the cross-entropy of the head's logits."""
    from autotune.heads import causal_lm_loss

    if loss_fn is causal_lm_loss:
        return {"ignore_index": -100, "label_smoothing": 0.0, "reduction": "mean"}
    if isinstance(loss_fn, nn.CrossEntropyLoss) and loss_fn.weight is None and loss_fn.reduction in ("mean", "sum"):
        return {"ignore_index": loss_fn.ignore_index, "label_smoothing": loss_fn.label_smoothing,
                "reduction": loss_fn.reduction}
    raise ConfigError(
        f"this configuration computes the loss with a fused linear cross-entropy (loss_kernel 'fused_linear'), "
        f"which stands in for the cross-entropy of the LM head's logits and the targets, token by token; your "
        f"loss_fn ({getattr(loss_fn, '__qualname__', type(loss_fn).__name__)}) is not known to be that. Pass "
        "autotune.workload.hub.causal_lm_loss (targets already shifted: logits[:, t] predicts targets[:, t]) or "
        "torch.nn.CrossEntropyLoss() (no class weights, reduction 'mean' or 'sum'), or use a configuration with "
        "loss_kernel 'framework'")


def _hidden_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """An LM head fused with the loss: its input as it is in training mode, where the fused loss
    reads it; its logits in eval mode (the forward it had before, an fp32_layers wrapper included)."""
    if self.training:
        return input
    before = self.__dict__.get(_BEFORE)
    return before(input) if before is not None else type(self).forward(self, input)


def hand_on_hidden_states(head: nn.Linear) -> None:
    """Make ``head`` return its input in training mode (once; in place, on the instance only: its
    class, parameters and state_dict stay, and a compiled model traces the new forward)."""
    if getattr(head, _FUSED, False):
        return
    head.__dict__[_BEFORE] = head.__dict__.get("forward")
    head.__dict__[_FUSED] = True
    head.forward = types.MethodType(_hidden_forward, head)


class FusedLinearLoss:
    """``loss(hidden, targets)``: the cross-entropy of the LM head's logits, computed by a fused
    linear cross-entropy from the hidden states the head was handed (batch x ... x H) and its own
    weight and bias; the real vocabulary's rows of a padded head. In eval mode the head has computed
    the logits, and the user's loss takes them."""

    def __init__(self, head: nn.Linear, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 implementation: Callable[..., torch.Tensor]) -> None:
        self.options = cross_entropy_options(loss_fn)
        self.head = head
        self.loss_fn = loss_fn
        self.implementation = implementation

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head = self.head
        if not head.training:
            return self.loss_fn(hidden, targets)
        if not isinstance(hidden, torch.Tensor) or hidden.shape[-1] != head.in_features \
                or hidden.shape[:-1] != targets.shape:
            raise ConfigError(f"the fused linear cross-entropy takes hidden states (..., {head.in_features}) "
                              f"and one target each; it got {tuple(getattr(hidden, 'shape', ()))} and targets "
                              f"{tuple(targets.shape)}: the model's output must be its LM head's, unchanged")
        weight, bias = head.weight, head.bias
        vocab = _rows(head)
        if vocab < weight.shape[0]:  # a vocab-padded head: its first rows (contiguous, no copy)
            weight = weight.narrow(0, 0, vocab)
            bias = bias.narrow(0, 0, vocab) if bias is not None else None
        hidden, targets = hidden.flatten(0, -2), targets.flatten()
        device = hidden.device.type
        if getattr(head, _FP32_MARK, False) and torch.is_autocast_enabled(device):
            # fp32_layers keeps the head in FP32: so is the loss that computes its logits
            with torch.autocast(device, enabled=False):
                return self.implementation(weight, hidden.float(), targets, bias, **self.options)
        return self.implementation(weight, hidden, targets, bias, **self.options)


def fused_loss(model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
               kernel: str = "fused_linear") -> FusedLinearLoss:
    """``loss_fn`` computed by the fused linear cross-entropy ``kernel`` from ``model``'s LM head.

    Call it once, on the model you train (after ``cfg.prepare``): from then on the head hands its
    input on in training mode, so ``model(x)`` returns hidden states (``.logits`` of a transformers
    model), and ``loss(model(x).logits, y)`` is the loss; in eval mode ``model(x)`` returns logits
    and ``loss`` is ``loss_fn``. ConfigError for a model without an LM head, a loss that is not the
    cross-entropy of its logits, or a kernel whose library is missing."""
    if kernel not in IMPLEMENTATIONS:
        raise ConfigError(f"loss_kernel {kernel!r}: choose from {', '.join(KERNELS)}")
    implementation = IMPLEMENTATIONS[kernel]
    if implementation is liger_linear_cross_entropy and (problem := liger_problem()):
        raise ConfigError(f"this configuration computes the loss with liger-kernel's fused linear cross-entropy, "
                          f"and {problem}; or use a configuration with loss_kernel 'framework'")
    head = find_head(model)
    loss = FusedLinearLoss(head, loss_fn, implementation)  # refuses another loss before the head changes
    hand_on_hidden_states(head)
    return loss


def step_loss(model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], recipe: Recipe
              ) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss a step of ``recipe`` computes from ``model``'s output: ``loss_fn`` itself, or with a
    fused loss kernel, :func:`fused_loss` (refused with a whole-step CUDA graph, which its host
    synchronisation breaks)."""
    if recipe.loss_kernel == "framework":
        return loss_fn
    if recipe.cuda_graphs:
        raise ConfigError("the fused linear cross-entropy synchronises with the host in every step (liger counts "
                          "the targets with .item()), which a whole-step CUDA graph cannot capture; use a "
                          "configuration with cuda_graphs off or loss_kernel 'framework'")
    return fused_loss(model, loss_fn, recipe.loss_kernel)


# what the probe finds ---------------------------------------------------------------------------


def _one_short_sample(inputs: Any) -> Any:
    """One sample of a batch; a token batch (integers, batch x length) cut to SHORT_SEQUENCE."""
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and not inputs.is_floating_point():
        return inputs[:1, :SHORT_SEQUENCE]
    return inputs[:1] if isinstance(inputs, torch.Tensor) else None


def returns_head_output(model: nn.Module, head: nn.Linear, inputs: Any) -> bool:
    """Whether ``model``'s output (its ``.logits``, or its first tensor) is the tensor its head
    returned, untouched: no logit scale, soft-cap or upcast after it, which the fused loss would skip."""
    from autotune.heads import logits

    short = _one_short_sample(inputs)
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        with torch.no_grad():
            out = logits(model(short))
    finally:
        hook.remove()
    return len(seen) == 1 and out is seen[0]


def _forward_problem(model: nn.Module, head: nn.Linear, inputs: Any) -> str | None:
    """Why the probe's forward does not show the model returning its head's output as it is; None if it does."""
    if _one_short_sample(inputs) is None:
        return "the model's inputs are not one tensor, which the probe's forward pass needs"
    try:
        if returns_head_output(model, head, inputs):
            return None
    except Exception as exc:  # a model that runs only on its GPU, say: nothing to check it with here
        return f"the probe's forward pass of the model failed ({type(exc).__name__})"
    return ("the model changes its LM head's output before returning it (a logit scale, soft-cap or upcast), "
            "which a loss computed from the head's input would leave out")


def probe(workload: Any, inputs: Any, *, device: str, forward: bool = True) -> dict[str, Any] | None:
    """What the offer needs to know (the probe's ``lm_head``): None for a model without a
    vocabulary; else ``{"vocab", "fusable", "reason"}``, fusable when the model's LM head and loss
    are what the fused linear cross-entropy computes and, on CUDA, liger-kernel imports."""
    model = workload.model
    vocab = vocab_size(model)
    if vocab is None:
        return None
    try:
        head = find_head(model)
    except ConfigError:
        return {"vocab": vocab, "fusable": False,
                "reason": "the model has no single LM head (an nn.Linear with an output per vocabulary entry)"}
    try:
        cross_entropy_options(workload.loss_fn)
    except ConfigError:
        reason: str | None = "the workload's loss is not known to be the cross-entropy of the LM head's logits"
    else:
        reason = _forward_problem(model, head, inputs) if forward else \
            "the probe ran no forward pass of this model (its first one failed)"
        if reason is None and device == "cuda":
            reason = liger_problem()
    return {"vocab": vocab, "fusable": reason is None, "reason": reason}


# the knob ---------------------------------------------------------------------------------------


def allowed(chosen: Mapping[str, Any]) -> bool:
    """Whether a fused kernel may be sampled beside the knobs chosen before it (not with fp16, nor
    with a padded vocabulary: see the module's docstring)."""
    precision, padding = chosen.get("precision"), chosen.get("vocab_padding")
    return (precision is None or precision.mode != "fp16") and (padding is None or padding.multiple == 1)


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
KERNEL_PARAM = "loss_kernel.kernel"


class LossKernel(Strategy):
    """The framework's cross-entropy or a fused linear cross-entropy (see the module's docstring)."""

    name = "loss_kernel"
    label = "loss kernel"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        kernel: str = "framework"
        """framework (the user's loss on the model's logits) | fused_linear (liger-kernel's fused
        linear cross-entropy from the LM head's input)."""

        def __post_init__(self) -> None:
            if self.kernel not in KERNELS:
                raise ValueError(f"loss_kernel.kernel {self.kernel!r}: choose from {', '.join(KERNELS)}")

    def applies(self, space: SearchSpace) -> bool:
        return len(space.choices.get(self.name, [])) > 1

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        head = probe.get("lm_head")
        if not head or device != "cuda":  # not a language model; on a CPU liger's Triton kernels do not run
            return {}
        reason = head.get("reason")
        if reason is None and getattr(options, "ddp", None):
            reason = "--ddp: its gradient of the LM head would come from outside DistributedDataParallel's forward"
        if reason is not None:
            warnings.warn(f"the fused linear cross-entropy (loss_kernel) is not searched: {reason}", stacklevel=4)
            return {}
        return {"choices": {self.name: list(KERNELS)}}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        # the framework's loss in the baseline and the known-good recipes; the search tries the fused one
        return {self.param("kernel"): "framework"} if self.applies(space) else {}

    def words(self, values: Mapping[str, Any]) -> str:
        return "fused linear CE" if values.get("kernel", "framework") == "fused_linear" else ""

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        if not allowed(chosen):
            return self.Config()
        return self.Config(kernel=self.choose(trial, "kernel", list(space.choices[self.name])))

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.loss_kernel = config.kernel
        if config.kernel != "framework":
            recipe.notes.append("the loss is liger-kernel's fused linear cross-entropy (pip install 'autotune[memory]'): "
                                "cfg.train_step computes it from the LM head's input; in a loop of your own, call "
                                "loss_fn = strategies.loss_kernel.fused_loss(model, loss_fn) once after cfg.prepare")
