"""What a trial is expected to take, from the walls this run measured: compiled and eager trials
apart, and a first compile's cost estimated from the model's size (the budget's stop rule and the
objective's check that a compile can still end within the budget both ask)."""

from __future__ import annotations

import statistics
from typing import Any

import strategies
from autotune.priors import prior, values
from autotune.trial.record import TrialRecord


def compile_prior_s(probe: dict[str, Any]) -> float:
    """What the first compile of the probed model is expected to cost: the prior's compile seconds
    scaled by the model's leaf modules against those of the model it was measured on, and no less than
    the prior's least (autotune.priors); the prior itself when the probe did not count them."""
    measured_on = prior(strategies.compile.MODE_PARAM, "default", "leaf modules")
    modules = probe.get("num_leaf_modules") or measured_on
    return max(prior(strategies.compile.MODE_PARAM, "default", "least compile seconds"),
               prior(strategies.compile.MODE_PARAM, "default", "compile seconds") * modules / measured_on)


def compile_cost_factor(mode: str, precision: str | None = None) -> float:
    """A compile's seconds in ``mode`` and ``precision`` against a default-mode bf16 compile's (their
    "compile cost" priors: max-autotune benchmarks kernel candidates for every matmul and convolution,
    regional compiles one block, fp8 traces and fuses a cast and a scale around every eligible Linear)."""
    return (values(strategies.compile.MODE_PARAM, "compile cost").get(mode, 1.0)
            * values(strategies.precision.MODE_PARAM, "compile cost").get(precision or "", 1.0))


def trial_cost_s(walls: list[tuple[float, bool]], mode: str, precision: str | None = None,
                 compile_prior_s: float = 0.0, unmeasured_s: float = 0.0, saved_s: float = 0.0,
                 floors: dict[str, float] | None = None) -> float:
    """Expected seconds of a trial in compile ``mode`` and ``precision``: this run's walls of its kind
    (expected_wall), its compile's share (the compiled median over the eager one) scaled by
    compile_cost_factor; ``unmeasured_s`` plus the compile prior before any trial was measured. Less
    ``saved_s`` (cached_compile_saving: a compile loaded from Inductor's cache), down to an eager trial's;
    no less than ``floors`` says of ``mode`` (cut_floors: a trial in it that the budget cut)."""
    floor = (floors or {}).get(mode, 0.0)
    compiled = mode != "off"
    if walls:
        wall = expected_wall(walls, compiled, compile_prior_s)
        eager = expected_wall(walls, False, compile_prior_s) if compiled else wall
    else:
        eager = unmeasured_s
        wall = eager + (compile_prior_s if compiled else 0.0)
    cost = eager + (wall - eager) * compile_cost_factor(mode, precision) if wall > eager else wall
    return max(floor, max(eager, cost - saved_s) if saved_s > 0 else cost)


def cut_floors(trials) -> dict[str, float]:
    """compile mode -> the least seconds a trial in it is expected to take, from the trials (this study's,
    or an earlier search's: autotune.search.warm) the budget cut while they ran (TrialRecord.cut_after_s):
    the longest such cut times the "cut" prior (2: nothing known but that it outlasted the cut). A trial's
    cost in that mode is no less (the planner's, and the objective's check that a compile ends within
    the budget)."""
    factor = prior("trial", "cut", "cost over its seconds")
    floors: dict[str, float] = {}
    for t in trials:
        record = TrialRecord.of(t)
        if record.cut_after_s:
            mode = record.knob("compile", "mode", "off")
            floors[mode] = max(floors.get(mode, 0.0), factor * record.cut_after_s)
    return floors


def trial_wall(record) -> tuple[float, bool] | None:
    """A finished trial's entry in the stop rule's walls, from its TrialRecord: (wall seconds, compiled
    cold); None for one not counted (no status: it never ran; a duplicate: its result was copied).

    A trial whose every graph was loaded from Inductor's cache counts among the eager walls: its wall
    is an eager trial's and a load, and a cold compile's cost is what the compiled walls predict
    (a cached one's is that less cached_compile_saving): counted as compiled, cache hits would outvote
    a cold compile and predict the next cold compile far too cheap."""
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
compiling."""


def cached_compile_saving(params: dict[str, Any], measured: list[tuple[dict[str, Any], dict[str, Any]]]) -> float:
    """Seconds less than a cold compile that a compiled configuration ``params`` is expected to take,
    from ``measured``'s (params, timing) of measured trials (those that compiled: a ``compile_s``):
    where one traced the same graph (the same parameters but GRAPH_NEUTRAL knobs) and compiled cold,
    that compile less what loading it from the cache takes (this run's median cache hit, else the
    "cached compile share" prior of it); 0 otherwise."""
    def graph(p: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in p.items() if not k.startswith(GRAPH_NEUTRAL)}

    if params.get(strategies.compile.MODE_PARAM, "off") == "off":
        return 0.0
    hits = [float(t["compile_s"]) for _, t in measured if t.get("compile_cache") == "hit" and t.get("compile_s")]
    same = [float(t["compile_s"]) for p, t in measured
            if t.get("compile_s") and t.get("compile_cache") != "hit" and graph(p) == graph(params)]
    if not same:
        return 0.0
    cold = max(same)
    loaded = (statistics.median(hits) if hits
              else prior(strategies.compile.MODE_PARAM, None, "cached compile share") * cold)
    return max(0.0, cold - loaded)
