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


def compile_prior_s(probe: dict[str, Any]) -> float:
    """What the first compile of the probed model is expected to cost (COMPILE_PRIOR_S scaled by its
    leaf modules, at least 15 s); ResNet-50's figure when the probe did not count them."""
    modules = probe.get("num_leaf_modules") or _PRIOR_MODULES
    return max(15.0, COMPILE_PRIOR_S * modules / _PRIOR_MODULES)


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
