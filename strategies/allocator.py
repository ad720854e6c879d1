"""allocator: the CUDA caching allocator's expandable segments, off or on.

PyTorch's caching allocator keeps the memory it got from ``cudaMalloc`` in segments and splits them
into blocks. A free block in the middle of a segment can serve only a request that fits in it, so a
training step whose tensors come and go in changing sizes leaves memory reserved that no tensor
uses: ``torch.cuda.max_memory_reserved()`` above ``max_memory_allocated()``. With expandable segments
(``expandable_segments:True``, PyTorch 2.1 on) a segment is one range of virtual addresses onto which
the allocator maps and unmaps physical pages of 2 MiB as it needs them, so that gap mostly closes.
It changes where tensors live, not what is computed: same numerics, not checked for accuracy.

When it pays: under a memory cap (``--memory-limit``, or a card just big enough), where the batch
is what memory allows and the gap is what a larger batch lacks: under a 24 GiB cap, a 1B Llama's
steps reserved 1.4-3.3 GiB above what their tensors allocated, and the search's peak figure (reserved
plus what lies outside the allocator) counts them. What it saves with the setting on is not
measured here yet; the memory model (autotune.search.memory) predicts it from the gap measured on the
same configuration without it. Its cost in speed is expected to be none (mapping pages happens when a
segment grows, which a steady training step stops doing after its first steps): an assumption.

The setting covers the segments allocated after it is made: it must be set before the model and the
optimizer's state are on the GPU. :func:`set_allocator` sets it at run time
(``torch.cuda.memory._set_allocator_settings``, as PyTorch's own tests of expandable segments do); the
trial worker calls it before building the model (an ``hf:`` model is built on the GPU directly),
``autotune.load`` calls it when a CUDA configuration is loaded to be used in this process, and
``TunedConfig.prepare`` calls it again (harmless when already set) for a config made otherwise. Set
outside autotune, it is the environment's ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
before the process first uses CUDA (what the framework exports say).

Offered on CUDA only (a CPU has no caching allocator to set), beside every other knob:
``set_per_process_memory_fraction`` (``--memory-limit``) still caps the total. How it goes with the
private memory pools of CUDA graphs (whole-step capture, compile's reduce-overhead) has not been
measured here: a trial that fails with them is recorded as any failed trial is. Under
``--ddp`` it is offered too: DDP's gradient buckets are tensors of this allocator like any other, and
each rank builds its model on the CPU and sets the allocator in ``cfg.prepare`` before the move to its
GPU (autotune.trial.ddp_rank); no DDP trial with it has run on GPUs yet. It is only ever switched on:
a search whose environment already sets it measures every trial with it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import Strategy

SETTING = "expandable_segments:True"
ENVIRONMENT_FIX = ("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment before the process "
                   "first uses CUDA")


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
EXPANDABLE_SEGMENTS_PARAM = "allocator.expandable_segments"


class Allocator(Strategy):
    """The CUDA caching allocator's expandable segments (less memory reserved than allocated)."""

    name = "allocator"
    label = "expandable segments"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        expandable_segments: bool = False
        """The caching allocator's ``expandable_segments`` setting (PYTORCH_CUDA_ALLOC_CONF)."""

    def applies(self, space: SearchSpace) -> bool:
        return len(space.choices.get(self.name, [])) > 1

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        if device != "cuda" or settings_setter() is None:
            return {}
        return {"choices": {self.name: [False, True]}}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        # the baseline and the known-good configurations keep PyTorch's default: the memory knobs are
        # traded for a batch under a cap (autotune.search.neighbours), not assumed
        return {self.param("expandable_segments"): False} if self.applies(space) else {}

    def words(self, values: Mapping[str, Any]) -> str:
        return "expandable segments" if values.get("expandable_segments") else ""

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(expandable_segments=self.choose(trial, "expandable_segments", space.choices[self.name]))

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.expandable_segments = config.expandable_segments
        if config.expandable_segments and recipe.device == "cuda":
            recipe.notes.append("autotune.load sets the CUDA allocator's expandable segments before your model is "
                                f"built; elsewhere, {ENVIRONMENT_FIX}")


def settings_setter() -> Callable[[str], Any] | None:
    """This torch's run-time setter of the allocator's settings; None where it has none."""
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:  # a torch that dropped the deprecated name keeps the accelerator-wide one
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    return setter


def set_allocator(recipe: Recipe) -> bool:
    """Turn the CUDA caching allocator's expandable segments on where ``recipe`` says so (on CUDA, with
    the knob on), for the segments allocated from now on; call it before the model is built or moved
    to the GPU. Returns whether it set them. A torch without the setting warns once with the fix."""
    if recipe.device != "cuda" or not recipe.expandable_segments:
        return False
    setter = settings_setter()
    if setter is None:
        warnings.warn(f"expandable segments are not set: torch {torch.__version__} has no run-time allocator "
                      f"setting; {ENVIRONMENT_FIX}", stacklevel=2)
        return False
    with warnings.catch_warnings():  # a newer torch points to the accelerator-wide setter in a FutureWarning
        warnings.simplefilter("ignore", FutureWarning)
        setter(SETTING)
    return True
