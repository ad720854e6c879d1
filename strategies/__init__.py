"""The knobs autotune searches, one module each, applied in the order of ``REGISTRY``.

Order matters in two ways, both visible here: a strategy's ``suggest`` sees the configs of the
strategies before it (grad_scaler follows precision), and ``apply`` runs in this order, so
model transforms compose predictably (channels are padded before the memory format is set).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy
from strategies.activation_checkpointing import ActivationCheckpointing
from strategies.allocator import Allocator
from strategies.attention import Attention
from strategies.batch_size import BatchSize
from strategies.channel_alignment import ChannelAlignment
from strategies.compile import Compile
from strategies.cuda_graphs import CudaGraphs
from strategies.cudnn import Cudnn
from strategies.dataloader import DataLoaderStrategy
from strategies.depthwise_conv import DepthwiseConv
from strategies.ddp import DDP
from strategies.fp32_layers import FP32Layers
from strategies.fp8_layers import FP8Layers
from strategies.grad_scaler import GradScalerStrategy
from strategies.llm_kernels import LLMKernels
from strategies.loss_kernel import LossKernel
from strategies.memory_format import MemoryFormat
from strategies.optimizer import Optimizer
from strategies.optimizer_state import OptimizerState
from strategies.precision import Precision
from strategies.stem_conv import StemConv
from strategies.streams import Streams
from strategies.threads import Threads
from strategies.vocab_padding import VocabPadding

REGISTRY: list[Strategy] = [
    Precision(),
    GradScalerStrategy(),
    FP8Layers(),  # after precision: which layers fp8 converts (its transform, replaced)
    BatchSize(),
    # before channel padding: the padded LM head is no plain nn.Linear, so channel padding leaves it
    VocabPadding(),
    # before channel padding too: a stem computed as space-to-depth pads its own channels
    StemConv(),
    ChannelAlignment(),
    # depthwise convolutions (groups == channels) that channel padding leaves: their class swapped
    DepthwiseConv(),
    # liger-kernel's kernels bound on a transformers LLM's layers: before fp32_layers, whose wrapper
    # (the class's forward, in FP32) then holds on a layer both touch
    LLMKernels(),
    FP32Layers(),  # after padding: it wraps the forward of the (possibly padded) layers
    # the loss: after precision and vocab_padding, which rule a fused one out (fp16, a padded head),
    # before cuda_graphs, whose capture its host synchronisation rules out
    LossKernel(),
    MemoryFormat(),
    Cudnn(),
    # the CUDA allocator's setting: a process-wide switch the worker and autotune.load set before the model is built
    Allocator(),
    # the input pipeline: the DataLoader (only with --data) produces batches, streams copies them
    DataLoaderStrategy(),
    Streams(),
    Threads(),
    # the step's execution, last: compile sees the model after every transform above, and
    # cuda_graphs decides after precision, optimizer and compile, which say whether capture is legal
    # before the optimizer knob, which samples no implementation for torchao's 8-bit Adam
    OptimizerState(),
    Optimizer(),
    # the SDPA kernel of each step's forward and backward: a context the step enters, compiled or not
    Attention(),
    Compile(),
    # after compile, whose mode it sees (static_graph only for eager steps); the wrapping order in
    # the runtime is fixed apart from this: device move, then DDP, then torch.compile
    DDP(),
    CudaGraphs(),
    # a model transform, last: it sees whether the whole step is captured, which its RNG handling rules out
    ActivationCheckpointing(),
]

BY_NAME: dict[str, Strategy] = {s.name: s for s in REGISTRY}

# How a configuration is shown: the order of its words in a one-line description, and of the knobs
# in the report. A knob left out of a list comes after the listed ones, in registry order.
DESCRIBED = ["precision", "memory_format", "batch_size", "cudnn", "channel_alignment", "stem_conv", "depthwise_conv",
             "vocab_padding", "attention", "streams", "dataloader", "threads", "fp32_layers", "optimizer", "optimizer_state", "allocator", "compile",
             "cuda_graphs", "ddp"]
REPORTED = ["precision", "memory_format", "batch_size", "channel_alignment", "stem_conv", "depthwise_conv", "vocab_padding", "attention", "cudnn",
            "streams", "threads", "grad_scaler", "ddp"]


def _in_order(names: list[str]) -> list[Strategy]:
    return [BY_NAME[n] for n in names] + [s for s in REGISTRY if s.name not in names]


def offer(options: Any, device: str, probe: Mapping[str, Any]) -> SearchSpace:
    """The search space: every knob's choices on ``device`` for a search with ``options``
    (autotune.search.options.SearchConfig), given what the probe found."""
    offered: dict[str, Any] = {"device": device, "choices": {}}
    for strategy in REGISTRY:
        fields = strategy.offer(options, device, probe, offered)
        offered["choices"].update(fields.pop("choices", {}))
        offered.update(fields)
    return SearchSpace(**offered)


def seed_params(space: SearchSpace, *, tuned: bool, fixed: Mapping[str, Any] = {}) -> dict[str, Any]:
    """Optuna parameters of a seed configuration, each knob's own (``Strategy.seed``) under the
    ones ``fixed`` sets (the precision and batch of a known-good configuration, say), for the
    knobs that exist in ``space``."""
    params: dict[str, Any] = {}
    for strategy in REGISTRY:
        if not strategy.applies(space):
            continue
        own = {k: v for k, v in fixed.items() if k.startswith(strategy.name + ".")}
        params.update({**strategy.seed(space, tuned=tuned, chosen=fixed), **own})
    return params


def describe(knobs: Mapping[str, Mapping[str, Any]]) -> str:
    """A configuration in one line, from its recorded knob values: "bf16, channels_last, batch 256,
    cudnn.benchmark, fused optimizer, compile default"."""
    return ", ".join(w for s in _in_order(DESCRIBED) if (w := s.words(knobs.get(s.name) or {})))


def report_knobs() -> list[ReportKnob]:
    """The dimensions whose effect the report shows, in the report's order."""
    return [knob for s in _in_order(REPORTED) for knob in s.report_knobs()]


def sample(trial, space: SearchSpace) -> dict[str, Any]:
    """Sample every knob from an Optuna trial (or replay a FixedTrial): name -> Config."""
    chosen: dict[str, Any] = {}
    for strategy in REGISTRY:
        chosen[strategy.name] = strategy.suggest(trial, space, chosen) if strategy.applies(space) else strategy.default()
    return chosen


def knobs_of(params: Mapping[str, Any], space: SearchSpace) -> dict[str, dict[str, Any]]:
    """The recorded knob values (as a trial records them) of a configuration's Optuna parameters."""
    import optuna

    return knobs_to_dict(sample(optuna.trial.FixedTrial(dict(params)), space))


def build_recipe(knobs: Mapping[str, Any], device: str) -> Recipe:
    """Apply every knob's config, in registry order, to a fresh recipe."""
    recipe = Recipe(device=device)
    for strategy in REGISTRY:
        strategy.apply(knobs.get(strategy.name, strategy.default()), recipe)
    return recipe


def knobs_to_dict(knobs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: BY_NAME[name].to_dict(cfg) for name, cfg in knobs.items()}


@functools.cache
def _untuned() -> dict[str, dict[str, Any]]:
    return {s.name: s.to_dict(s.default()) for s in REGISTRY}


def untuned_values() -> dict[str, dict[str, Any]]:
    """Every knob's untuned values as recorded (name -> field -> value): what a configuration that does
    not record a knob or a field ran with. A new dict each call (the memory model asks for it per family)."""
    return {name: dict(fields) for name, fields in _untuned().items()}


def with_untuned(values: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Recorded knob values (name -> field -> value) with every knob and field they do not record at its
    untuned value: a trial or config.json from before a knob existed, read as what ran then."""
    out = untuned_values()
    for name, fields in values.items():
        out.setdefault(name, {}).update(fields)
    return out


def knobs_from_dict(data: Mapping[str, Mapping[str, Any]], *, fill_missing: bool = False) -> dict[str, Any]:
    """Knob configs from their recorded dicts. With ``fill_missing``, a knob added after they were
    recorded (a trial or config.json of an older autotune) takes its untuned default: that is what
    ran then, and what replaying the old space gives, since it offered no other choice."""
    knobs = {name: BY_NAME[name].from_dict(values) for name, values in data.items()}
    if fill_missing:
        for strategy in REGISTRY:
            knobs.setdefault(strategy.name, strategy.default())
    return knobs


__all__ = ["REGISTRY", "BY_NAME", "DESCRIBED", "REPORTED", "ReportKnob", "Strategy", "sample", "build_recipe",
           "knobs_to_dict", "knobs_from_dict", "untuned_values", "with_untuned", "knobs_of", "offer", "seed_params",
           "describe", "report_knobs"]
