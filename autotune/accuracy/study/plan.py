"""How many steps the accuracy check trains, so that the checks cost in proportion: scaled to the
model's measured step time and to the share of ``--budget`` they may spend (``--accuracy-share``).

Before a search's first check, the FP32 baseline trial's throughput gives the time of one check
step (per sample, at the check's own batch size). The checks a search usually runs are the FP32
reference with its reshuffled twin (one worker), then about two configurations, an fp16 and a bf16
class (a worker each); their steps are as many as fit in the share, between MIN_STEPS and the
default. The plan is then fixed for the study (the steps are part of the check's fingerprint, so
every check compares) and recorded, so the summary can say how it was chosen.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from autotune.accuracy.settings import MIN_STEPS, AccuracySettings
from autotune.trial.record import TrialRecord

PLAN_ATTR = "accuracy_plan"
"""Study user attribute: the plan (``plan``'s dict, or how the steps were otherwise fixed)."""
DEFAULT_SHARE = 0.25
"""What the accuracy checks may spend of --budget by default."""
CHECKS_ATTR = "accuracy_checks"
"""Study user attribute: the checks this study's runs made, in order, each with its label, seconds, the
time it was given and how it ended ("ok", "cut by the budget", "error"...): where the share went, for a
recommendation left unchecked, which nothing would say otherwise."""
CHECK_RUNS = 4
"""Training runs the checks are planned for: the FP32 reference, its reshuffled twin, and about two
configurations (an fp16 and a bf16 class)."""
CHECK_WORKERS = 3
"""Workers those runs take (the reference and the first configuration share one)."""
BUILDS_PER_WORKER = 5
"""A check worker's set-up besides its start, in model builds: it needs the model once per training
run and one-step comparison (16 over the CHECK_WORKERS: the reference's two runs and its FP32 and
FP64 steps; each configuration's run and its own, FP32's and FP64's steps), built for the first
and deep-copied after (autotune.accuracy.worker.check.seeded_workload; rebuilt for a model over a quarter
of host memory), and it takes the FP64 step. The figure was set when each was a build; with the
copies it still comes close to what a reference worker spends beside its training runs."""
FIRST_VERDICT_RUNS = 3
"""Training runs before the first configuration has a verdict: the FP32 reference, its reshuffled
twin and the configuration's run."""
FIRST_VERDICT_WORKERS = 2
"""Workers those runs take: the reference's (its two runs) and the configuration's."""
EVAL_COST = 1 / 3
"""A held-out batch (forward only, no gradients) costs about a third of a training step."""
FP64_FACTOR = 2
"""The check's one FP64 step (autotune.accuracy.worker.check.step_numerics) holds about twice what an FP32
step of the same batch holds."""
CHECK_FILL = 0.9
"""The check's batch is sized so that its FP64 step stays within this share of the memory limit."""


def step_time(study) -> dict[str, Any] | None:
    """What the search measured that a check's step time follows from: the FP32 baseline's
    throughput (the slowest measured trial's when no baseline was measured), with that trial's worker
    start and BUILDS_PER_WORKER of its builds as each check worker's overhead. None before any trial
    was measured."""
    measured = []
    for t in study.get_trials(deepcopy=False):
        record = TrialRecord.of(t)
        # under --ddp a check trains in one process: one GPU's share of the throughput
        rate = record.figures.get("per_gpu_samples_per_s") or record.samples_per_s
        if record.status == "ok" and rate:
            measured.append((record.role != "baseline", rate, record))
    if not measured:
        return None
    _, rate, record = min(measured, key=lambda m: (m[0], m[1]))
    figures = record.figures
    overhead = (record.timing.get("worker_start_s") or 0.0) + BUILDS_PER_WORKER * check_build_s(record)
    limits = [b for b in (figures.get("device_total_bytes"), study.user_attrs.get("memory_limit_bytes")) if b]
    return {"samples_per_s": rate, "trial": record.number, "baseline": record.role == "baseline",
            "overhead_s": overhead, "worker_start_s": record.timing.get("worker_start_s") or 0.0,
            "build_s": check_build_s(record), "batch_size": figures.get("batch_size"),
            "peak_memory_bytes": figures.get("peak_memory_bytes"), "limit_bytes": min(limits) if limits else None}


def check_build_s(record: TrialRecord) -> float:
    """What one build costs a check worker, from a measured trial: its model and optimizer and their
    preparation, where the trial recorded them apart (autotune.trial.work), not the trial's input
    batches and request, which a check does not make; the trial's whole build otherwise."""
    figures = record.figures
    parts = [figures.get("build_model_s"), figures.get("build_prepare_s")]
    if all(isinstance(p, (int, float)) for p in parts):
        return float(sum(parts))
    return record.timing.get("build_s") or 0.0


def fitting_batch(batch_size: int, measured: Mapping[str, Any], *, bytes_factor: float = FP64_FACTOR,
                  minimum: int = 2, multiple: int = 8) -> int:
    """The check's batch: ``batch_size`` (the default), or less where an FP32 step of it would not fit
    in CHECK_FILL of the memory limit, times ``bytes_factor`` (the held-out check's FP64 step holds
    about twice an FP32 step; parity's runs are FP32 only: 1), rounded down to a ``multiple`` (from 8
    up) and at least ``minimum``. The FP32 baseline's peak over its batch bounds FP32's bytes per
    sample from above (the fixed part counted in); without a baseline, the measured trial's, twice
    (FP32 keeps the same weights and states, its activations at most twice a 16-bit step's): at the
    default batch a language model's FP32 check can run out of memory, under a cap or not."""
    peak, batch, limit = measured.get("peak_memory_bytes"), measured.get("batch_size"), measured.get("limit_bytes")
    if not (peak and batch and limit):
        return batch_size
    per_sample = (1 if measured.get("baseline") else 2) * bytes_factor * peak / batch
    most = int(CHECK_FILL * limit / per_sample)
    if most >= 8:
        most -= most % multiple
    return max(minimum, min(batch_size, most))


def plan(settings: AccuracySettings, *, budget_s: float, share: float, measured: dict[str, Any],
         held_out: bool = True) -> dict[str, Any]:
    """The check's steps for a search of ``budget_s`` whose checks may spend ``share`` of it, from
    ``step_time``'s figures; ``settings.steps`` (the default) is the most. The batch is
    ``fitting_batch``'s; the plan names it where it is not the default. Without a held-out set
    (``held_out`` False: a workload's own batches, a language model's random tokens) no evaluation
    is counted: it would double a language model's planned cost."""
    batch = fitting_batch(settings.batch_size, measured)
    step_s = batch / measured["samples_per_s"]
    eval_steps = math.ceil(settings.held_out_size / batch) * EVAL_COST if held_out else 0.0
    room = share * budget_s - CHECK_WORKERS * measured["overhead_s"]
    fit = math.floor(room / (CHECK_RUNS * step_s) - eval_steps)
    steps = max(MIN_STEPS, min(settings.steps, fit))
    run_s = (steps + eval_steps) * step_s
    estimate = CHECK_WORKERS * measured["overhead_s"] + CHECK_RUNS * run_s
    first = FIRST_VERDICT_WORKERS * measured["overhead_s"] + FIRST_VERDICT_RUNS * run_s
    fitted = {"batch_size": batch, "default_batch_size": settings.batch_size} if batch != settings.batch_size else {}
    return {"how": "scaled", "steps": steps, "default_steps": settings.steps, "share": share,
            "budget_s": budget_s, "step_s": round(step_s, 6), "estimate_s": round(estimate, 1),
            "first_verdict_s": round(first, 1), "from_trial": measured["trial"], "from_baseline": measured["baseline"],
            **fitted}


def describe(plan: dict[str, Any] | None) -> str | None:
    """'40 steps (scaled to 25% of the 3 min budget)', for the summary and the report."""
    if not plan or not plan.get("steps"):
        return None
    steps, how = plan["steps"], plan.get("how")
    if how == "explicit":
        return f"{steps} steps (--accuracy-steps)"
    if how == "kept":
        return f"{steps} steps (as in this study's earlier runs)"
    if how == "unmeasured":
        return f"{steps} steps (the default: no trial was measured to scale it by)"
    if how != "scaled":
        return f"{steps} steps (the default, without a --budget to scale it to)"
    within = f"{plan['share']:.0%} of the {duration(plan['budget_s'])} budget"
    if plan.get("method") == "parity":
        batch = f" at batch {plan['batch_size']}" if plan.get("batch_size") else ""
        if plan.get("fits") is False:
            return f"{steps} steps of numerics parity{batch} would not fit in {within}"
        return (f"{steps} steps of numerics parity against FP32{batch} (scaled to {within}; the first verdict "
                f"about {plan['first_verdict_s']:.0f} s, each later one "
                f"{plan['check_s'] * plan.get('later_margin', 1.0):.0f} s)")
    if plan.get("batch_size"):
        within += (f"; batch {plan['batch_size']} instead of {plan['default_batch_size']}, for the FP32 "
                   "baseline's memory")
    if steps >= plan["default_steps"]:
        return f"{steps} steps (the full check fits in {within})"
    if plan["estimate_s"] > plan["share"] * plan["budget_s"]:
        return (f"{steps} steps, the fewest that say anything (scaled to {within}, the checks may take "
                f"about {plan['estimate_s']:.0f} s)")
    return f"{steps} steps (scaled to {within})"


def duration(seconds: float) -> str:
    """40 -> '40 s', 180 -> '3 min', 5400 -> '1.5 h'."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{round(seconds / 60, 1):g} min"
    return f"{round(seconds / 3600, 1):g} h"


def checks_spent(study) -> str | None:
    """Where the checks' seconds went, in words ("#3, FP32: 41 s; #1: cut by the budget after 9 s"), from
    CHECKS_ATTR; None where the study kept none."""
    checks = study.user_attrs.get(CHECKS_ATTR) or []
    if not checks:
        return None
    parts = []
    for check in checks:
        what = check["label"] + (", FP32" if check.get("fp32") else "")
        how = "" if check["status"] == "ok" else f"{check['status']} after "
        parts.append(f"{what}: {how}{check['seconds']:.0f} s")
    return f"the checks took {sum(c['seconds'] for c in checks):.0f} s ({'; '.join(parts)})"
