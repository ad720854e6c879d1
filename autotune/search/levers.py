"""The memory knobs as the search trades them for batch: what each saves and what it costs in speed.

8-bit optimizer states (strategies.optimizer_state), a fused linear cross-entropy
(strategies.loss_kernel) and recomputed activations (strategies.activation_checkpointing) each buy
memory: a fixed part (the optimizer's states) or a share of what a sample holds. The allocator's
expandable segments (strategies.allocator) buy what the caching allocator reserved and no tensor used,
which no size of the model says: the memory model takes it from the same configuration measured
without them (MemoryModel.gap_predict). The memory model
(autotune.search.memory) predicts a configuration with them from the same configuration measured
without them, less these savings, until it measures one; the plain recipe's neighbours
(autotune.search.neighbours) queue them at the batch that prediction says fits, and the planner
ranks them by their expected speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import strategies
from autotune.priors import prior


@dataclass(frozen=True)
class Lever:
    """A knob that buys memory: what it saves, and what it is expected to cost in speed (its numbers are
    rows of autotune.priors)."""

    param: str
    value: Any
    fixed_saving: Callable[[dict[str, Any]], float]
    """Bytes it saves whatever the batch, from the probe's findings (num_parameters ...)."""
    per_sample_saving: Callable[[dict[str, Any]], float]
    """Bytes per sample it saves on top of ``per_sample_share`` (a language model's logits)."""
    saves_gap: bool = False
    """It saves the allocator's fragmentation as measured (peak reserved minus peak allocated) instead
    of bytes from the probe's sizes: the memory model predicts it from a measured configuration."""

    @property
    def speed(self) -> float:
        """Expected speed at the same batch, over the plain recipe."""
        return prior(self.param, self.value, "speed")

    @property
    def per_sample_share(self) -> float:
        """Share of the compiled step's bytes per sample it keeps (1.0: it saves none of them)."""
        return prior(self.param, self.value, "per-sample share", 1.0)

    @property
    def step_s_per_param(self) -> float:
        """Seconds it adds to every optimizer step per parameter (an optimizer's own kernels), whatever the
        batch: the planner's cost of it where the model's size is known (step_costs); ``speed`` is the
        ratio taken where it is not. 0 for a knob whose cost is not per step."""
        return prior(self.param, self.value, "step seconds per parameter", 0.0)


def _adam_states(probe: dict[str, Any]) -> float:
    # AdamW's two FP32 states against 8-bit ones
    return (prior(strategies.optimizer_state.STATE_PARAM, None, "bytes saved per parameter")
            * float(probe.get("num_parameters") or 0))


def _logits(probe: dict[str, Any]) -> float:
    # a compiled loss still holds the 16-bit logits; a fused linear cross-entropy never makes them whole
    return (prior(strategies.loss_kernel.KERNEL_PARAM, "fused_linear", "bytes saved per logit")
            * float(probe.get("tokens_per_sample") or 0) * float(probe.get("vocab_size") or 0))


def _none(probe: dict[str, Any]) -> float:
    return 0.0


LEVERS: tuple[Lever, ...] = (
    # bitsandbytes' 8-bit AdamW: a cost a step whatever the batch
    Lever(strategies.optimizer_state.STATE_PARAM, "8bit-bnb", _adam_states, _none),
    # torchao's 8-bit AdamW: slower still
    Lever(strategies.optimizer_state.STATE_PARAM, "8bit", _adam_states, _none),
    # liger's fused linear cross-entropy: the logits never held whole
    Lever(strategies.loss_kernel.KERNEL_PARAM, "fused_linear", _none, _logits),
    # recomputing every other block's forward in backward: about a sixth more compute. A checkpointed
    # block keeps its input alone (about 1/17 of a transformer layer's activations), but a sample also
    # holds what lies outside the blocks (a 1B Llama's 128k-wide logits), so the share kept is of the
    # whole sample
    Lever(strategies.activation_checkpointing.EVERY_PARAM, 2, _none, _none),
    Lever(strategies.activation_checkpointing.EVERY_PARAM, 1, _none, _none),
    # expandable segments: the same kernels on memory mapped as it is needed; what they save is the gap
    # the allocator reserved above its allocated peak, as measured
    Lever(strategies.allocator.EXPANDABLE_SEGMENTS_PARAM, True, _none, _none, saves_gap=True),
)
"""The memory knobs, from the cheapest in speed."""

LEVER_SETS: tuple[tuple[int, ...], ...] = ((0,), (1,), (2,), (0, 2), (1, 2), (3,), (0, 3), (0, 2, 3), (4,), (0, 2, 4),
                                           (5,), (0, 5), (1, 5))
"""Combinations of LEVERS tried, as indices: one knob, then more (a 1B Llama's optimizer states and
its logits together), recompute last (it costs the most); then expandable segments, alone and with
8-bit states (appended: the sets before keep their order). A combination the space does not offer (no
bitsandbytes, say) is skipped, and one whose batch an earlier one already takes is not queued."""

def levers_of(knobs: dict[str, Any]) -> tuple[Lever, ...]:
    """The LEVERS a configuration (its recorded knob values) has on."""
    return tuple(lever for lever in LEVERS
                 if (knobs.get(lever.param.split(".")[0]) or {}).get(lever.param.split(".")[1]) == lever.value)


def without_levers(knobs: dict[str, Any], levers: tuple[Lever, ...] = LEVERS) -> dict[str, Any]:
    """The configuration with every memory knob (of ``levers``: all of them unless given) at its
    untuned value."""
    out, untuned = dict(knobs), strategies.untuned_values()
    for name in {lever.param.split(".")[0] for lever in levers}:
        if name in out:
            out[name] = untuned[name]
    return out


def step_costs(sizes: dict[str, Any]) -> dict[tuple[str, Any], float]:
    """(param, value) -> seconds a step, of the levers whose cost is per optimizer step, for a model of
    ``sizes["num_parameters"]``; empty where that is unknown (a search without a memory probe)."""
    params = float(sizes.get("num_parameters") or 0)
    if not params:
        return {}
    return {(lever.param, lever.value): lever.step_s_per_param * params for lever in LEVERS
            if lever.step_s_per_param}


def untuned(param: str) -> Any:
    """A knob's untuned value (its strategy's default) for an Optuna parameter name, "strategy.field";
    None for a name no strategy has."""
    name, _, attr = param.partition(".")
    strategy = strategies.BY_NAME.get(name)
    return getattr(strategy.Config(), attr, None) if strategy is not None else None


GAP_LEVERS = tuple(lever for lever in LEVERS if lever.saves_gap)
"""The levers whose saving is a measured gap between reserved and allocated memory."""


def lever_bytes(levers: tuple[Lever, ...], sizes: dict[str, Any], fixed: float, per_sample: float, batch: int) -> float:
    """Predicted bytes at ``batch`` of a configuration measured at ``fixed`` + ``per_sample`` x batch
    without ``levers``, with them on."""
    share = 1.0
    for lever in levers:
        share *= lever.per_sample_share
    fixed -= sum(lever.fixed_saving(sizes) for lever in levers)
    saving = sum(lever.per_sample_saving(sizes) for lever in levers)
    # a sample never holds less than a tenth of what it held: the logits are not all it holds
    return fixed + batch * max(per_sample * share - saving, 0.1 * per_sample)
