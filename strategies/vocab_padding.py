"""vocab_padding: pad a language model's vocabulary (token embedding and LM head) to a multiple of 64.

A vocabulary like GPT-2's 50,257 tokens makes the LM head's GEMM, the largest of many language
models, run on an odd width that Tensor Cores and vectorised CPU kernels handle poorly; nanoGPT
pads it (``vocab_size = 50304  # padded up to a multiple of 64 for efficiency``). Here the padding
is done to the user's model: the embedding's and the head's weights (tied or not) get zero rows
up to the multiple, and the head's output is sliced back to the real vocabulary, so the logits,
the loss and the gradients of the real rows are those of the unpadded model. The padded rows
never meet a token id and never receive a gradient, so they stay zero. Checkpoints keep the
original shapes both ways. The slice costs a copy of the logits, so whether padding pays off is
measured by the study, not assumed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import optuna
import torch
import torch.nn.functional as F
from torch import nn

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy

MIN_VOCAB = 1000
"""An nn.Embedding this large is taken for a vocabulary (positions and types are smaller)."""
MULTIPLE = 64
_ROWS = "_autotune_vocab_rows"
"""The attribute a padded Parameter keeps its original rows in (for its optimizer state)."""


def round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def vocab_size(model: nn.Module) -> int | None:
    """The model's vocabulary: the number of rows of its largest ``nn.Embedding`` of at least
    MIN_VOCAB rows (None without one)."""
    sizes = [m.num_embeddings for m in model.modules()
             if isinstance(m, nn.Embedding) and m.num_embeddings >= MIN_VOCAB]
    return max(sizes, default=None)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (dim 0)."""
    extra = rows - tensor.shape[0]
    return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))]) if extra > 0 else tensor


def _pad_state(state_dict: dict[str, Any], keys: list[str], vocab: int, rows: int) -> None:
    """An unpadded checkpoint's ``vocab`` rows, zero-padded to the padded module's ``rows`` (in the
    state_dict that ``load_state_dict`` hands this module: its own copy); any other size is left
    for ``load_state_dict`` to refuse."""
    for key in keys:
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == vocab:
            state_dict[key] = _pad_rows(value, rows)


def _slice_state(destination: dict[str, Any], keys: list[str], vocab: int) -> None:
    for key in keys:
        value = destination.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] > vocab:
            destination[key] = value[:vocab]


class PaddedEmbedding(nn.Embedding):
    """:class:`torch.nn.Embedding` whose weight has zero rows past ``vocab_size`` (the padded
    ``num_embeddings``); its state_dict has ``vocab_size`` rows, and loads one of either size."""

    vocab_size: int

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        _slice_state(destination, [prefix + "weight"], self.vocab_size)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _pad_state(state_dict, [prefix + "weight"], self.vocab_size, self.num_embeddings)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab_size={self.vocab_size}"


class PaddedHead(nn.Linear):
    """:class:`torch.nn.Linear` with zero output rows past ``vocab_size`` (the padded
    ``out_features``): it computes the padded width and returns the first ``vocab_size`` logits;
    its state_dict has ``vocab_size`` rows, and loads one of either size."""

    vocab_size: int

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # a Python int: torch.compile sees a static slice
        return F.linear(input, self.weight, self.bias).narrow(-1, 0, self.vocab_size)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        _slice_state(destination, [prefix + "weight", prefix + "bias"], self.vocab_size)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _pad_state(state_dict, [prefix + "weight", prefix + "bias"], self.vocab_size, self.out_features)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab_size={self.vocab_size}"


def _pad_parameter(param: nn.Parameter, rows: int, done: set[int]) -> None:
    """Pad a parameter's rows in place: the same Parameter object (optimizers built before, tied
    modules and references held elsewhere keep it), with its new data; once per parameter."""
    if param is None or id(param) in done:
        return
    done.add(id(param))
    setattr(param, _ROWS, param.shape[0])
    with torch.no_grad():
        param.data = _pad_rows(param.data, rows)
        if param.grad is not None:
            param.grad = _pad_rows(param.grad, rows)


def pad_vocab(model: nn.Module, multiple: int) -> nn.Module:
    """Pad ``model``'s vocabulary (see :func:`vocab_size`) to a multiple of ``multiple``, in place.

    Every exact ``nn.Embedding`` with that many rows becomes a :class:`PaddedEmbedding` and every
    exact ``nn.Linear`` with that many outputs a :class:`PaddedHead` (the same module objects, class
    swapped as channel padding does); their weights (and the head's bias) get zero rows, a tied
    weight once. A model already padded, or without a vocabulary off the multiple, is left as it
    is. Returns ``model``.
    """
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple must be a positive integer, got {multiple!r}")
    vocab = vocab_size(model)
    if multiple == 1 or vocab is None or vocab % multiple == 0:
        return model
    padded, done = round_up(vocab, multiple), set()
    for module in model.modules():
        if type(module) is nn.Embedding and module.num_embeddings == vocab:
            _pad_parameter(module.weight, padded, done)
            module.__class__, module.num_embeddings = PaddedEmbedding, padded
        elif type(module) is nn.Linear and module.out_features == vocab:
            _pad_parameter(module.weight, padded, done)
            _pad_parameter(module.bias, padded, done)
            module.__class__, module.out_features = PaddedHead, padded
        else:
            continue
        module.vocab_size = vocab
    return model


def pad_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Optimizer state loaded for the unpadded model (a resumed run's Adam moments, momentum
    buffers) of the parameters :func:`pad_vocab` padded, zero-padded as the parameters were; any
    other state is left as it is. The optimizer's own state_dict keeps the padded rows: resume it
    into a model prepared with the same configuration."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            rows = getattr(param, _ROWS, None)
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if rows is not None and isinstance(value, torch.Tensor) and value.shape == (rows, *param.shape[1:]):
                    state[key] = _pad_rows(value, param.shape[0])


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
MULTIPLE_PARAM = "vocab_padding.multiple"


class VocabPadding(Strategy):
    """Pad the vocabulary of a language model to a multiple of 64 (see :func:`pad_vocab`)."""

    name = "vocab_padding"
    label = "vocabulary padding"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        multiple: int = 1
        """Pad the vocabulary (embedding rows, LM head outputs) up to a multiple of this (1 = off)."""

    def applies(self, space: SearchSpace) -> bool:
        return len(space.choices.get(self.name, [])) > 1

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        vocab = probe.get("vocab_size")
        return {"choices": {self.name: [1, MULTIPLE]}} if vocab and vocab % MULTIPLE else {}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        # the baseline is the model as written; a known-good GPU configuration pads, as nanoGPT does
        if not self.applies(space):
            return {}
        return {self.param("multiple"): max(space.choices[self.name]) if tuned and space.device == "cuda" else 1}

    def words(self, values: Mapping[str, Any]) -> str:
        return f"vocab x{values['multiple']}" if values.get("multiple", 1) > 1 else ""

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("vocab_padding", "vocabulary padding (multiple)", self.name, "multiple", 1)]

    def suggest(self, trial: optuna.trial.BaseTrial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(multiple=self.choose(trial, "multiple", space.choices[self.name]))

    def apply(self, config: Config, recipe: Recipe) -> None:
        if config.multiple > 1:
            recipe.model_transforms.append(functools.partial(pad_vocab, multiple=config.multiple))
