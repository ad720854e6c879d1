"""activation_checkpointing: recompute the activations of a model's repeated blocks in the backward
pass instead of keeping them from the forward pass (``torch.utils.checkpoint``, non-reentrant).

A checkpointed block keeps only what it was called with (for a transformer layer, its input
hidden states); the tensors its backward needs are recomputed from those, one block at a time,
when the backward pass reaches it. That costs about one more forward of the block and frees the
memory of its activations, which is what limits the batch of a large model on a small card.
``every`` chooses the blocks: 1 checkpoints every repeated block, k every k-th (the first, the
(k+1)-th, ...), which gives memory back to speed; 0 is off.

Applied through the model's own API where it has one, else around the blocks themselves:

* Hugging Face transformers: the model's ``activation_checkpointing_enable(every_n_layers=k)``
  (``gradient_checkpointing_enable`` where transformers predates it, then every k-th
  ``GradientCheckpointingLayer``'s flag set here), with ``use_reentrant=False``; and
  ``config.use_cache = False``, as the Trainer trains (a checkpointed layer cannot write a KV
  cache: its recompute would write it twice, so transformers turns the cache off each forward
  with a warning, where a compiled step breaks its graph).
* timm, every block: the model's ``set_grad_checkpointing()``, unless its models are set to
  reentrant checkpointing (``TIMM_REENTRANT_CKPT``) or the model has BatchNorm (timm's recompute
  updates the running statistics a second time); then, and for every k-th block, as below.
* any other model: the blocks are the children of its ``nn.Sequential``/``nn.ModuleList``/
  ``nn.ModuleDict`` containers that come in runs of two or more of one class (a ResNet's
  Bottlenecks in layer1 to layer4, a ViT's encoder layers, a GPT's decoder blocks), the class with
  the most parameters among those (:func:`find_blocks`). Each chosen block's class is swapped in
  place for a subclass whose forward runs the original under ``torch.utils.checkpoint`` (same
  object, parameters and state_dict keys; a pickled model unpickles with it). The recompute leaves
  BatchNorm running statistics alone, so they are updated once a step as without checkpointing.

What it changes, and what not: the loss and the gradients are those of the model without
checkpointing (bit for bit in FP32 on a CPU: the recompute runs the same kernels under the same
autocast state, and the RNG state is restored for it, so dropout draws the same mask). Blocks
checkpoint only in training mode with gradients enabled: evaluation runs them as written.
It composes with ``torch.compile`` (Dynamo traces non-reentrant checkpoints into the graph, and
the partitioner recomputes those regions) and with autocast; DDP needs no ``static_graph`` for
non-reentrant checkpoints (not tested here). It is never combined with
whole-step CUDA graphs (the ``cuda_graphs`` knob): checkpoint reads and restores the CUDA RNG
state around each block, which is illegal while a graph is captured (pytorch/pytorch#162504). The
compile modes with CUDA graphs (reduce-overhead) capture the compiled graph, recompute included.

What it saves, for the memory model: a checkpointed block keeps its inputs instead of its
activations (a transformer layer's input is 1 of the ~17 hidden-size tensors plus attention
scores it keeps otherwise), and its backward holds one block's activations at a time, recomputed.
So every=1 leaves the blocks ``num_blocks x input + 1 x block`` of their activations, every=k
about (k-1)/k of them (the blocks not checkpointed keep theirs); what lies outside the blocks
(embeddings, the logits, the loss) is kept as before. The price is one more forward of each
checkpointed block: about a third more of its compute.

Offered on a GPU, where memory limits the batch, for models with repeated blocks (the probe counts
them: ``checkpoint_blocks``); choices 0, 1 and 2. On a CPU it is not offered: nothing caps memory
there, and recomputing only costs time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import sys
import warnings
from typing import Any, Callable, Iterator, Mapping

import optuna
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from strategies.base import ReportKnob, Strategy

CHOICES = [0, 1, 2]
"""The values offered: off, every block, every 2nd block."""
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_PREFIX = "Checkpointed__"
"""The start of a checkpointed class's qualified name, which encodes its original class (pickling)."""
_CLASSES: dict[type, type] = {}


# which blocks ------------------------------------------------------------------------------------


def _kind(module: nn.Module) -> type:
    """A module's class as its model defines it (a checkpointed block's original class)."""
    return type(module).__dict__.get("_autotune_checkpointed", type(module))


def _runs(container: nn.Module) -> Iterator[list[nn.Module]]:
    """Runs of two or more consecutive children of one class, a block's (not a container's, nor a
    leaf's: a Linear alone is a layer, not a block), in ``container``."""
    run: list[nn.Module] = []
    for child in list(container.children()) + [None]:
        if run and (child is None or _kind(child) is not _kind(run[0])):
            if len(run) >= 2:
                yield run
            run = []
        if child is not None and not isinstance(child, CONTAINERS) and next(child.children(), None) is not None:
            run.append(child)


def _num_parameters(modules: list[nn.Module]) -> int:
    seen = {id(p): p.numel() for m in modules for p in m.parameters()}
    return sum(seen.values())


def _stage_blocks(stage: nn.Module) -> list[nn.Module] | None:
    """The blocks a stage is made of (timm's ConvNeXtStage: a downsampling layer, then an
    nn.Sequential of blocks): its largest run inside an nn.Sequential of its own, where that run
    holds at least half of its parameters; None where it is no such stage."""
    runs = [run for m in stage.modules() if m is not stage and isinstance(m, nn.Sequential) for run in _runs(m)]
    best = max(runs, key=_num_parameters, default=None)
    return best if best is not None and 2 * _num_parameters(best) >= _num_parameters([stage]) else None


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in the order of ``model.modules()``: the children of its
    containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) that come in runs of two or
    more of one class, of the class whose runs hold the most parameters (ties: the most blocks),
    outermost only; a block that is a stage of finer blocks (:func:`_stage_blocks`) gives way to
    those. Empty where there is none (an MLP of Linear layers)."""
    by_class: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        if isinstance(module, CONTAINERS):
            for run in _runs(module):
                by_class.setdefault(_kind(run[0]), []).extend(run)
    if not by_class:
        return []
    kind = max(by_class, key=lambda k: (_num_parameters(by_class[k]), len(by_class[k])))
    blocks = list({id(b): b for b in by_class[kind]}.values())
    inside = {id(m) for b in blocks for m in b.modules() if m is not b}
    blocks = [b for b in blocks if id(b) not in inside]
    while True:
        finer = [inner for b in blocks for inner in (_stage_blocks(b) or [b])]
        if len(finer) == len(blocks):
            return blocks
        blocks = finer


def _outermost(model: nn.Module, test: Callable[[nn.Module], bool]) -> list[nn.Module]:
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # pre-order: a parent comes before its children
        if id(module) not in inside and test(module):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def _hf_layers(model: nn.Module) -> list[nn.Module]:
    """The ``GradientCheckpointingLayer``s of a transformers model (its decoder layers), in the
    order transformers counts them; empty for any other model. transformers is looked up only if it
    is imported already, as it is wherever one of its models was built."""
    layers = sys.modules.get("transformers.modeling_layers")
    if layers is None:
        return []
    return [m for m in model.modules() if isinstance(m, layers.GradientCheckpointingLayer)]


def _hf_models(model: nn.Module) -> list[nn.Module]:
    utils = sys.modules.get("transformers.modeling_utils")
    if utils is None:
        return []
    return _outermost(model, lambda m: isinstance(m, utils.PreTrainedModel)
                      and getattr(m, "supports_gradient_checkpointing", False) and bool(_hf_layers(m)))


def _timm_models(model: nn.Module) -> list[nn.Module]:
    return _outermost(model, lambda m: type(m).__module__.startswith("timm.")
                      and callable(getattr(m, "set_grad_checkpointing", None)))


def num_blocks(model: nn.Module) -> int:
    """How many blocks checkpointing every block would checkpoint (the probe's ``checkpoint_blocks``):
    a transformers model's checkpointing layers, else the repeated blocks of :func:`find_blocks`."""
    hf = _hf_models(model)
    if hf:
        return sum(len(_hf_layers(m)) for m in hf)
    return len(find_blocks(model))


# how: a block's class swapped for a checkpointing subclass ------------------------------------------


def _call(forward: Callable[..., Any], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return forward(module, *args, **kwargs)


_STATS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def _running_stats_kept(block: nn.Module) -> Iterator[None]:
    """The recompute of ``block`` updates copies of its BatchNorm layers' running statistics, put
    back afterwards: without checkpointing they are updated once a step, and would be twice. (The
    layers must still be given running statistics: their saved tensors must match the forward's.)"""
    norms = [m for m in block.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    kept = [(m, {n: m._buffers[n] for n in _STATS if m._buffers.get(n) is not None}) for m in norms]
    for m, buffers in kept:
        for n, tensor in buffers.items():
            m._buffers[n] = tensor.clone()
    try:
        yield
    finally:
        for m, buffers in kept:
            m._buffers.update(buffers)


def _contexts(block: nn.Module) -> tuple[contextlib.AbstractContextManager[None], ...]:
    """checkpoint's context_fn: nothing around the forward, the running statistics kept around the recompute."""
    return contextlib.nullcontext(), _running_stats_kept(block)


def checkpointed_class(cls: type) -> type:
    """``cls`` with a forward that runs ``cls.forward`` under non-reentrant ``torch.utils.checkpoint``
    in training with gradients enabled (the same forward otherwise); one class per ``cls``."""
    if cls in _CLASSES:
        return _CLASSES[cls]

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return cls.forward(self, *args, **kwargs)
        # the arguments as one tuple and one dict: checkpoint saves the RNG state of every device
        # found in its positional arguments, keyword tensors included this way
        if torch.compiler.is_compiling():
            # traced into the graph, whose partitioner recomputes the region and updates buffers
            # once (Dynamo takes no context_fn but a TorchDispatchMode's)
            return checkpoint(_call, cls.forward, self, args, kwargs, use_reentrant=False)
        return checkpoint(_call, cls.forward, self, args, kwargs, use_reentrant=False,
                          context_fn=functools.partial(_contexts, self))

    def extra_repr(self: nn.Module) -> str:
        return ", ".join(s for s in (cls.extra_repr(self), "activation checkpointing") if s)

    name = _PREFIX + f"{cls.__module__}:{cls.__qualname__}".replace(".", "/")
    sub = type(cls.__name__, (cls,), {"forward": forward, "extra_repr": extra_repr, "__module__": __name__,
                                      "__qualname__": name, "_autotune_checkpointed": cls})
    _CLASSES[cls] = sub
    return sub


def __getattr__(name: str) -> type:
    """A checkpointed class by its qualified name: how a pickled checkpointed model unpickles."""
    if not name.startswith(_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, qualname = name[len(_PREFIX):].replace("/", ".").partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return checkpointed_class(obj)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` is a block this module checkpoints (generic path)."""
    return "_autotune_checkpointed" in type(module).__dict__


def _checkpoint_hf(model: nn.Module, every: int) -> None:
    # no KV cache in training, as the Trainer sets it (TrainingArguments.use_cache=False): with it,
    # transformers turns it off each forward with a warning, where a compiled step breaks its graph
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and "every_n_layers" in inspect.signature(enable).parameters:
        enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
        return
    # transformers before activation_checkpointing_enable: every layer, then every k-th kept
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for i, layer in enumerate(_hf_layers(model)):
        layer.gradient_checkpointing = i % every == 0


def _timm_api_fits(model: nn.Module, every: int) -> bool:
    """Whether timm's own ``set_grad_checkpointing`` does what the generic path would: every block,
    non-reentrant, and no BatchNorm whose statistics its recompute would update again."""
    if every != 1 or any(isinstance(m, _BatchNorm) for m in model.modules()):
        return False
    try:
        from timm.layers import use_reentrant_ckpt
    except ImportError:  # a timm too old to say: the generic path is known to be non-reentrant
        return False
    return not use_reentrant_ckpt()


def checkpoint_blocks(model: nn.Module, every: int) -> nn.Module:
    """Checkpoint every ``every``-th repeated block of ``model`` (1: every block; 0: none), in place,
    through the model's own API where it has one (transformers, timm), else by swapping each chosen
    block's class (:func:`checkpointed_class`). Applying it again changes nothing. Returns ``model``.

    Raise ConfigError where the model has no repeated block to checkpoint."""
    if not isinstance(every, int) or every < 0:
        raise ValueError(f"every must be 0 (off) or a positive integer, got {every!r}")
    if every == 0:
        return model
    hf = _hf_models(model)
    if hf:
        for m in hf:
            _checkpoint_hf(m, every)
        return model
    timm_models = [m for m in _timm_models(model) if _timm_api_fits(m, every)]
    for m in timm_models:
        m.set_grad_checkpointing(True)
    own = {id(b) for m in timm_models for b in m.modules()}  # checkpointed by timm's own forward
    blocks = [b for b in find_blocks(model) if id(b) not in own]
    if not blocks and not timm_models:
        raise ConfigError(f"this configuration checkpoints every {ordinal(every)} repeated block, and "
                          f"{type(model).__name__} has none (an nn.Sequential, nn.ModuleList or nn.ModuleDict with "
                          "two or more modules of one class in a row): use a configuration with "
                          "activation_checkpointing.every 0, or tune this model with `autotune search`")
    for i, block in enumerate(blocks):
        if i % every == 0 and not is_checkpointed(block):
            block.__class__ = checkpointed_class(type(block))
    return model


def ordinal(n: int) -> str:
    """2 -> '2nd', 3 -> '3rd', 11 -> '11th'."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


CODE = "strategies.activation_checkpointing.checkpoint_blocks(model, every={every})"
"""What a training script of the user's own calls to checkpoint as measured (``cfg.prepare`` does it)."""


def hf_training_args(every: int) -> tuple[dict[str, Any], str | None]:
    """``transformers.TrainingArguments`` fields that checkpoint every ``every``-th decoder layer
    non-reentrantly, named as the installed transformers names them (``activation_checkpointing``
    since it renamed ``gradient_checkpointing``; the old name without transformers here), and why
    they cannot where they cannot: a transformers whose models checkpoint all layers or none takes
    no ``every_n_layers``, so every k-th layer (k > 1) is then left to :data:`CODE`."""
    if every <= 0:
        return {}, None
    try:
        from transformers import TrainingArguments
    except ImportError:
        TrainingArguments = None
    names = {f.name for f in dataclasses.fields(TrainingArguments)} if TrainingArguments is not None else set()
    flag = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    options: dict[str, Any] = {"use_reentrant": False}
    if every > 1:
        if not _hf_every_n_layers():
            return {}, (f"the Trainer of this transformers ({_hf_version()}) checkpoints every layer or none: "
                        f"call {CODE.format(every=every)} before Trainer(model=model, ...), or upgrade transformers "
                        "to one whose activation_checkpointing_enable takes every_n_layers")
        options["every_n_layers"] = every  # the Trainer hands it to the model's enable method
    return {flag: True, f"{flag}_kwargs": options}, None


def _hf_every_n_layers() -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return any("every_n_layers" in inspect.signature(getattr(PreTrainedModel, name)).parameters
               for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable")
               if hasattr(PreTrainedModel, name))


def _hf_version() -> str:
    try:
        return "transformers " + importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none installed here"


# the knob ----------------------------------------------------------------------------------------


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
EVERY_PARAM = "activation_checkpointing.every"


class ActivationCheckpointing(Strategy):
    """Recompute repeated blocks' activations in the backward pass (see :func:`checkpoint_blocks`)."""

    name = "activation_checkpointing"
    label = "activation checkpointing"

    @dataclasses.dataclass(kw_only=True, frozen=True)
    class Config:
        every: int = 0
        """Checkpoint every k-th repeated block: 0 off, 1 every block, 2 every second one, ..."""

        def __post_init__(self) -> None:
            if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 0:
                raise ValueError(f"activation_checkpointing.every {self.every!r}: 0 (off) or a positive integer")

    def applies(self, space: SearchSpace) -> bool:
        return len(space.choices.get(self.name, [])) > 1

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        if device != "cuda":
            return {}  # nothing caps a CPU's memory: recomputing would only cost time
        blocks = probe.get("checkpoint_blocks")
        if not blocks:
            why = ("the probe did not count the model's blocks" if blocks is None else
                   "the model has no repeated blocks (two or more modules of one class in a row in an nn.Sequential, "
                   "nn.ModuleList or nn.ModuleDict, or a transformers model's decoder layers)")
            warnings.warn(f"activation checkpointing is not searched: {why}; the search goes on without it",
                          stacklevel=4)
            return {}
        return {"choices": {self.name: CHOICES if blocks > 1 else CHOICES[:2]}}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        # the baseline and the guides' recipes keep every activation; checkpointing is for the search to weigh
        return {self.param("every"): 0} if self.applies(space) else {}

    def words(self, values: Mapping[str, Any]) -> str:
        every = values.get("every", 0)
        if not every:
            return ""
        return "checkpointing every block" if every == 1 else f"checkpointing every {ordinal(every)} block"

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("activation_checkpointing", "activation checkpointing (every k-th block)", self.name,
                           "every", 0)]

    def suggest(self, trial: optuna.trial.BaseTrial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        graphs = chosen.get("cuda_graphs")
        if graphs is not None and graphs.enabled:
            return self.Config()  # checkpoint's RNG save and restore cannot run inside a CUDA graph capture
        return self.Config(every=self.choose(trial, "every", space.choices[self.name]))

    def apply(self, config: Config, recipe: Recipe) -> None:
        if config.every > 0:
            recipe.model_transforms.append(functools.partial(checkpoint_blocks, every=config.every))
