"""What a trial is expected to take, from the walls this run measured: compiled and eager trials
apart, and a first compile's cost estimated from the model's size (the budget's stop rule and the
objective's check that a compile can still end within the budget both ask)."""

from __future__ import annotations

import statistics
from typing import Any

COMPILE_PRIOR_S = 60.0
"""Seconds a compiled trial is expected to spend compiling before this run has measured one: a
ResNet-50 (126 leaf modules) compiled in 58-66 s on an H200 (reports/resnet50-h200-8m); a model's
prior is scaled by its own count of leaf modules (compile_prior_s)."""
_PRIOR_MODULES = 126
COMPILE_MODE_COST = {"max-autotune-no-cudagraphs": 5.0, "max-autotune": 5.0, "regional": 0.4}
"""A compile's seconds in a mode against default mode's: max-autotune benchmarks kernel candidates for
every matmul and convolution (minutes for a ResNet-50: its trial timeout allows 1,200 s against
default's 300; on the H100 at 9443e57 it was still compiling 191 s into its trial, the default mode's
compile having taken 42 s: at least 4.2x, taken at 3 it was queued at 153 s); regional compiles one
block (a held-out 24-layer LM on the H200: 13.6 s to its first two steps against 57.5 s for the whole
model)."""
COMPILE_PRECISION_COST = {"fp8": 1.6}
"""A compile's seconds in a precision mode against bf16's: fp8 (torchao's float8 training) traces
and fuses a cast and a scale around every eligible Linear. Measured on the H200 (a 12-layer causal
LM, reports/search-yield/h200 and h200-6b8b65c, and reports/gpt_lm-h200-5m): 24.1 s against 14.7,
25.9 against 15.9, 22.6 against 13.5 and 15.3: 1.5-1.7x. Counted as bf16's, an fp8 compile with the
memory knobs on a 1B Llama was queued on the H100 at b1bcd84 as if it cost what the plain recipe's
57 s trial did; it was still running at 141 s."""


def compile_prior_s(probe: dict[str, Any]) -> float:
    """What the first compile of the probed model is expected to cost (COMPILE_PRIOR_S scaled by its
    leaf modules, at least 15 s); ResNet-50's figure when the probe did not count them."""
    modules = probe.get("num_leaf_modules") or _PRIOR_MODULES
    return max(15.0, COMPILE_PRIOR_S * modules / _PRIOR_MODULES)


def compile_cost_factor(mode: str, precision: str | None = None) -> float:
    """A compile's seconds in ``mode`` and ``precision`` against a default-mode bf16 compile's."""
    return COMPILE_MODE_COST.get(mode, 1.0) * COMPILE_PRECISION_COST.get(precision or "", 1.0)


def trial_cost_s(walls: list[tuple[float, bool]], mode: str, precision: str | None = None,
                 compile_prior_s: float = 0.0, unmeasured_s: float = 0.0, saved_s: float = 0.0) -> float:
    """Expected seconds of a trial in compile ``mode`` and ``precision``: this run's walls of its kind
    (expected_wall), its compile's share (the compiled median over the eager one) scaled by
    compile_cost_factor; ``unmeasured_s`` plus the compile prior before any trial was measured. Less
    ``saved_s`` (cached_compile_saving: a compile loaded from Inductor's cache), down to an eager trial's."""
    compiled = mode != "off"
    if walls:
        wall = expected_wall(walls, compiled, compile_prior_s)
        eager = expected_wall(walls, False, compile_prior_s) if compiled else wall
    else:
        eager = unmeasured_s
        wall = eager + (compile_prior_s if compiled else 0.0)
    cost = eager + (wall - eager) * compile_cost_factor(mode, precision) if wall > eager else wall
    return max(eager, cost - saved_s) if saved_s > 0 else cost


def trial_wall(record) -> tuple[float, bool] | None:
    """A finished trial's entry in the stop rule's walls, from its TrialRecord: (wall seconds, compiled
    cold); None for one not counted (no status: it never ran; a duplicate: its result was copied).

    A trial whose every graph was loaded from Inductor's cache counts among the eager walls: its wall
    is an eager trial's and a load, and a cold compile's cost is what the compiled walls predict
    (a cached one's is that less cached_compile_saving). Counted as compiled, on the H100 (ec835cb)
    ViT-B/16's two cache hits (22.0 and 22.4 s) outvoted its plain recipe's cold 52.6 s: a
    max-autotune compile was predicted at 32 s (175 s from the cold compile), started with 129 s left,
    and was cut off by the budget, still compiling."""
    if record.status is None or record.duplicate_of is not None:
        return None
    compiled = record.knob("compile", "mode", "off") != "off" and record.timing.get("compile_cache") != "hit"
    return record.timing.get("wall_s", 0.0), compiled


def expected_wall(walls: list[tuple[float, bool]], compiled: bool, compile_prior_s: float = 0.0) -> float:
    """Expected seconds of a trial of one kind (compiled or eager), from this run's measured walls
    ``(seconds, compiled)``: the kind's median; before any compiled trial, the eager median plus the
    compile prior; before any eager one, the compiled median; 0 before any trial."""
    if not walls:
        return 0.0
    eager = [w for w, c in walls if not c]
    done = [w for w, c in walls if c]
    if compiled:
        return statistics.median(done) if done else statistics.median(eager) + compile_prior_s
    return statistics.median(eager) if eager else statistics.median(done)


GRAPH_NEUTRAL = ("streams.", "cuda_graphs.", "optimizer.", "allocator.", "dataloader.", "threads.", "grad_scaler.")
"""Knobs that act outside the compiled forward and loss (the batch's copy, a capture around the whole
step, the optimizer step, the allocator, the host): a compiled configuration that differs from a
measured one only in these traces the same graph, which Inductor's cache then loads instead of
compiling. On the H200 (reports/search-yield/h200-3445a3e) hf:gpt2's plain recipe compiled in 25.4 s
and its twin with gradients zeroed in place loaded in 3.7 s ("hit"): a 17.5 s trial against 35.7."""
CACHED_COMPILE_SHARE = 0.15
"""A compile loaded from Inductor's cache as a share of the cold compile it repeats, before this run
measured one (hf:gpt2: 3.7 s against 25.4; its regional compile, 2.6 against 10.5)."""


def cached_compile_saving(params: dict[str, Any], measured: list[tuple[dict[str, Any], dict[str, Any]]]) -> float:
    """Seconds less than a cold compile that a compiled configuration ``params`` is expected to take,
    from ``measured``'s (params, timing) of measured trials (those that compiled: a ``compile_s``):
    where one traced the same graph (the same parameters but GRAPH_NEUTRAL knobs) and compiled cold,
    that compile less what loading it from the cache takes (this run's median cache hit, else
    CACHED_COMPILE_SHARE of it); 0 otherwise."""
    def graph(p: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in p.items() if not k.startswith(GRAPH_NEUTRAL)}

    if params.get("compile.mode", "off") == "off":
        return 0.0
    hits = [float(t["compile_s"]) for _, t in measured if t.get("compile_cache") == "hit" and t.get("compile_s")]
    same = [float(t["compile_s"]) for p, t in measured
            if t.get("compile_s") and t.get("compile_cache") != "hit" and graph(p) == graph(params)]
    if not same:
        return 0.0
    cold = max(same)
    loaded = statistics.median(hits) if hits else CACHED_COMPILE_SHARE * cold
    return max(0.0, cold - loaded)
