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


@dataclass(frozen=True)
class Lever:
    """A knob that buys memory: what it saves, and what it is expected to cost in speed."""

    param: str
    value: Any
    speed: float
    """Expected speed at the same batch, over the plain recipe."""
    fixed_saving: Callable[[dict[str, Any]], float]
    """Bytes it saves whatever the batch, from the probe's findings (num_parameters ...)."""
    per_sample_share: float
    """Share of the compiled step's bytes per sample it keeps (1.0: it saves none of them)."""
    per_sample_saving: Callable[[dict[str, Any]], float]
    """Bytes per sample it saves on top (a language model's logits)."""
    saves_gap: bool = False
    """It saves the allocator's fragmentation as measured (peak reserved minus peak allocated) instead
    of bytes from the probe's sizes: the memory model predicts it from a measured configuration."""
    step_s_per_param: float = 0.0
    """Seconds it adds to every optimizer step per parameter (an optimizer's own kernels), whatever the
    batch: the planner's cost of it where the model's size is known (step_costs); ``speed`` is the
    ratio taken where it is not."""


def _adam_states(probe: dict[str, Any]) -> float:
    # AdamW's two FP32 states are 8 bytes a parameter; 8-bit ones 2.03 (1,235,814,400 parameters of
    # the 1B Llama shape on the H200: 9.21 GiB against 2.34, scripts/memory_parts_bench.py)
    return 5.97 * float(probe.get("num_parameters") or 0)


def _logits(probe: dict[str, Any]) -> float:
    # a compiled loss still holds the bf16 logits (0.98 GiB for 4 x 1,024 tokens of a 128,256
    # vocabulary); liger's fused linear cross-entropy held 0.49 GiB there: about one byte a logit saved
    return float(probe.get("tokens_per_sample") or 0) * float(probe.get("vocab_size") or 0)


LEVERS: tuple[Lever, ...] = (
    # bitsandbytes' 8-bit AdamW: on the H200 (b092e42) the compiled 1B Llama stepped in 101.4 ms at
    # batch 4 with it, and in 73.5 ms with fused AdamW (its hand-written loop, over 24 GiB): 27.9 ms a
    # step more for 1,235,814,400 parameters, whatever the batch. As a ratio, 0.72 at batch 4
    Lever("optimizer_state.state", "8bit-bnb", 0.72, _adam_states, 1.0, lambda probe: 0.0,
          step_s_per_param=27.9e-3 / 1.2358e9),
    # torchao's 8-bit AdamW stepped the 1B Llama's parameters in 122 ms against fused AdamW's 11 on the
    # H200: for a step of about 75 ms, about half the speed at the same batch
    Lever("optimizer_state.state", "8bit", 0.5, _adam_states, 1.0, lambda probe: 0.0,
          step_s_per_param=(122e-3 - 11e-3) / 1.2358e9),
    # liger's loss took 25 ms against the compiled loss's 11 ms for 4 x 1,024 tokens of the 1B Llama
    # alone. Its speed here, and the checkpointing's below, are fitted to the two trials of the H200's
    # 24 GiB Llama search at 3445a3e, from the plain recipe at batch 2 (47.5 sequences/s) and the batch's
    # and 8-bit states' costs: with 8-bit states and every 2nd block checkpointed at batch 16, 50.6
    # measured (52.1 predicted); every block at 24, 50.9 (50.3). The earlier 0.85, 0.87 and 0.75
    # predicted 45.7 and 41.5, and the planner ranked them below the plain recipe's smaller batches
    Lever("loss_kernel.kernel", "fused_linear", 0.92, lambda probe: 0.0, 1.0, _logits),
    # recomputing every other block's forward in backward: about a sixth more compute. A checkpointed
    # block keeps its input alone (about 1/17 of a transformer layer's activations), but a sample also
    # holds what lies outside the blocks (a 1B Llama's 128k-wide logits), so the share kept is of the
    # whole sample. Measured on the H200 under 24 GiB, with 8-bit states and the fused loss (what they
    # save taken off): the compiled plain recipe's sample held 1.57 GiB (its hand-written loop, batch 1
    # to 4), every 2nd block checkpointed 0.56 GiB (batch 16), every block 0.14 (batch 24), allocated
    Lever("activation_checkpointing.every", 2, 0.93, lambda probe: 0.0, 0.43, lambda probe: 0.0),
    Lever("activation_checkpointing.every", 1, 0.85, lambda probe: 0.0, 0.17, lambda probe: 0.0),
    # expandable segments: the same kernels on memory mapped as it is needed; a speed of 1.0 is an
    # assumption, not measured (pages are mapped when a segment grows, which a steady step stops doing)
    Lever("allocator.expandable_segments", True, 1.0, lambda probe: 0.0, 1.0, lambda probe: 0.0, saves_gap=True),
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
