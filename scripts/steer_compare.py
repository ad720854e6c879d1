"""Does the profile-steered search find its best configuration in fewer trials than plain TPE?

    python3 scripts/steer_compare.py [--model resnet18 --input-shape 3x64x64 --num-classes 10]
        [--seeds 3] [--trials 8] [--total-time 4m] [--precisions fp32,bf16] [--min-measure-time 0.3]
        [--out DIR]

Runs the same search (same model, shapes, space, trial count or time) K times with steering
(findings queue their remedies, knobs shown to have no effect are fixed) and K times with
``--no-steer`` (plain TPE over the whole space), seed by seed, alternating the arms so that a
drift of the machine touches both alike. Each run's seed is the search's ``--seed`` (TPE's
sampler and the data).

The yardstick is one reference for all runs: the best objective value (samples/s by default)
seen in any run of either arm. For each run it counts the completed trials (every trial
``--trials`` counts, in order: failed and out-of-memory ones cost a trial too) until the first
usable one within ``--tolerance`` (2%) of that reference, or "not reached". A per-arm reference
would let an arm that never finds the fast region "reach" its own poor best quickly.

The known-good seed configurations (the FP32 baseline first, then the guides' recipes that the
space offers) are queued in both arms, in the same order, before any sampled or steered trial: the
first trials of the two arms are the same configurations, and the arms differ only after them.
So a run whose best is one of the seeds reaches it in the same number of trials in both arms;
the comparison measures what steering adds beyond the seeds, and it needs ``--trials`` well
above the number of seeds to show anything. That is why the default space is fp32 and bf16 only:
on a GPU without --compile it has two seeds (the baseline and bf16 at batch 512), where all four
precisions have six (four of them fp16 recipes), which would leave a short run almost nothing
but seeds. A seed's measurement noise can still make one arm's copy of it count and the other's
not, which is why the reference is shared and the tolerance is not smaller than the noise.

Defaults are sized for about 4 minutes on an H200: resnet18 at 3x64x64 (a launch-bound step, where
the profile has something to say), no torch.compile, no accuracy check, 0.3 s of timed steps, 8
trials per run, 3 seeds (6 runs of about 40 s: a probe, 8 trials of 4-5 s, the export).
``--total-time 4m`` makes that a limit: each run gets a sixth of it as its --budget, and a run
that runs out before reaching the reference counts as not reached. Writes steer-compare.json and
steer-compare.csv into --out and prints the table and the medians per arm.

A run already finished under --out (ARM-seedSEED/ with its config.json) is reused, not run again:
runs spread over several GPUs (one invocation per GPU, each its own --first-seed) or cut short by
a time limit are completed by running the same command on a folder holding the finished ones,
and the summary then takes one reference over all of them.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ARMS = ("steered", "plain")


def trials_to_reach(values: Sequence[float | None], reference: float, *, maximize: bool = True,
                    tolerance: float = 0.02) -> int | None:
    """The 1-based position of the first value within ``tolerance`` of ``reference`` (at least
    (1 - tolerance) x reference when maximizing, at most (1 + tolerance) x reference when
    minimizing); None when no value gets there. ``values`` holds one entry per trial in the order
    they ran, None for a trial with no usable value (failed, pruned, unstable, failed accuracy)."""
    if reference is None or not math.isfinite(reference) or reference <= 0:
        raise ValueError(f"the reference must be a positive number, got {reference!r}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"the tolerance is a share in [0, 1), got {tolerance!r}")
    for position, value in enumerate(values, 1):
        if value is None:
            continue
        if (value >= (1 - tolerance) * reference) if maximize else (value <= (1 + tolerance) * reference):
            return position
    return None


def arm_median(counts: Sequence[int | None]) -> float:
    """The median of trial counts, "not reached" counted as infinitely many (a run that never got
    there is worse than any that did); inf when half or more did not reach."""
    return statistics.median([math.inf if c is None else c for c in counts]) if counts else math.nan


def run_values(study) -> list[float | None]:
    """A run's objective value per counted trial, in order; None where it is not usable."""
    from optuna.trial import TrialState

    from autotune.accuracy.study.gate import accuracy_of, failed
    from autotune.search.trials import counted_trials

    out: list[float | None] = []
    for t in sorted(counted_trials(study), key=lambda t: t.number):
        usable = (t.state == TrialState.COMPLETE and t.value is not None and not t.user_attrs.get("unstable")
                  and not failed(accuracy_of(study, t)))
        out.append(float(t.value) if usable else None)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18", help="torchvision name or package.module:factory (default resnet18)")
    p.add_argument("--input-shape", default="3x64x64", help="one sample's shape (default 3x64x64)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--seeds", type=int, default=3, help="runs per arm, seeds 0..K-1 (default 3)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--trials", type=int, help="trials per run (default 8 unless --total-time is given)")
    p.add_argument("--total-time", help="wall-clock time for all 2K runs together, e.g. 4m: each run gets an "
                                        "equal --budget (and --trials, when given, still caps it)")
    p.add_argument("--min-measure-time", type=float, default=0.3, help="seconds of timed steps per trial")
    p.add_argument("--min-batch-size", type=int)
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--precisions", default="fp32,bf16",
                   help="comma-separated modes to search (default fp32,bf16: two seeds instead of six; 'all' for "
                        "every mode the device runs)")
    p.add_argument("--objective", default="throughput", choices=["throughput", "energy", "memory"])
    p.add_argument("--tolerance", type=float, default=0.02, help="within this share of the reference (default 0.02)")
    p.add_argument("--compile", action="store_true", help="search torch.compile too (slow: minutes per compile)")
    p.add_argument("--accuracy-check", action="store_true", help="run the accuracy check (slow)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "steer-compare")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    if not 0 <= args.tolerance < 1:
        p.error("--tolerance is a share: 0.02 means 2%")
    if args.trials is None and args.total_time is None:
        args.trials = 8
    return args


def search_config(args: argparse.Namespace, *, steer: bool, seed: int, budget_s: float | None, out_dir: Path):
    """The SearchConfig of one run: everything but steering and the seed is the same in both arms."""
    import dataclasses

    from autotune.search.options import SearchConfig, resolve_device
    from autotune.trial.measure import MeasureSettings
    from autotune.workload.models import WorkloadSpec, parse_input_shape

    spec = WorkloadSpec(model=args.model, num_classes=args.num_classes,
                        input_shape=parse_input_shape(args.input_shape) if args.input_shape else None)
    measure = dataclasses.replace(MeasureSettings.for_device(resolve_device(args.device)),
                                  min_time_s=args.min_measure_time)
    return SearchConfig(
        workload=spec, device=args.device, out_dir=out_dir, trials=args.trials, budget_s=budget_s,
        min_batch_size=args.min_batch_size, max_batch_size=args.max_batch_size,
        precisions=[m.strip() for m in args.precisions.split(",")] if args.precisions != "all" else None,
        compile=True if args.compile else False, accuracy_check=args.accuracy_check, steer=steer, seed=seed,
        objective=args.objective, measure=measure,
        command=f"scripts/steer_compare.py ({'steered' if steer else '--no-steer'}, --seed {seed})")


def run_one(args: argparse.Namespace, arm: str, seed: int, budget_s: float | None) -> dict[str, Any]:
    """Run one arm for one seed into ARM-seedSEED under --out, or reuse that run if it finished."""
    import strategies
    from autotune.cli.run import run_search

    out_dir = args.out / f"{arm}-seed{seed}"
    if (out_dir / "study.db").exists():
        finished = finished_run(out_dir, arm, seed, trials=args.trials)
        print(f"    reused the finished run in {out_dir} ({len(finished['values'])} trials)", flush=True)
        return finished
    config = search_config(args, steer=arm == "steered", seed=seed, budget_s=budget_s, out_dir=out_dir)

    def on_event(kind: str, payload: Any) -> None:
        if kind == "trial" and "status" in payload.user_attrs:
            role = payload.user_attrs.get("role", "search")
            value = "-" if payload.value is None else f"{payload.value:,.4g}"
            print(f"    #{payload.number:<3} {role:<10} {value:>12}  {strategies.describe(payload.user_attrs.get('knobs', {}))}",
                  flush=True)
        elif kind == "fixed":
            for param, entry in payload.items():
                print(f"    fixed {param} = {entry['value']!r}: {entry['reason']}", flush=True)

    started = time.time()
    result = run_search(config, on_event=on_event)
    return run_record(result.study, arm, seed, out_dir, wall_s=round(time.time() - started, 1))


def finished_run(out_dir: Path, arm: str, seed: int, *, trials: int | None) -> dict[str, Any]:
    """The record of a run that an earlier invocation finished in ``out_dir`` (its config.json
    is written at the end of a run), so that runs cut short, or spread over several GPUs or
    machines, are completed and summarized together with one reference. A run that did not
    finish, or ran another number of trials, is refused: its count would not compare."""
    import optuna

    if not (out_dir / "config.json").exists():
        raise SystemExit(f"{out_dir} holds a run that did not finish (no config.json): delete the folder "
                         "to run it again")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out_dir / 'study.db'}")
    record = run_record(study, arm, seed, out_dir, wall_s=None)
    if trials is not None and len(record["values"]) != trials:
        raise SystemExit(f"{out_dir} holds a run of {len(record['values'])} trials, not --trials {trials}: "
                         "give the same --trials, or another --out")
    return record


def run_record(study, arm: str, seed: int, out_dir: Path, *, wall_s: float | None) -> dict[str, Any]:
    """What the comparison keeps of one run: its values in trial order, roles, best and fixed knobs."""
    import strategies
    from autotune.search.goal import goal_of
    from autotune.search.knob_effects import fixed_knobs
    from autotune.search.trials import best_trial

    best = best_trial(study)
    values = run_values(study)
    return {
        "arm": arm, "seed": seed, "out_dir": str(out_dir), "wall_s": wall_s,
        "objective": goal_of(study).name, "values": values,
        "roles": [t.user_attrs.get("role", "search") for t in sorted(
            (t for t in study.trials if "status" in t.user_attrs), key=lambda t: t.number)],
        "best_value": None if best is None else best.value,
        "best_config": None if best is None else strategies.describe(best.user_attrs["knobs"]),
        "fixed_knobs": {param: entry["value"] for param, entry in fixed_knobs(study).items()},
    }


def summarize(runs: list[dict[str, Any]], *, maximize: bool, tolerance: float) -> dict[str, Any]:
    """Add each run's count to the shared reference; the medians per arm."""
    usable = [v for r in runs for v in r["values"] if v is not None]
    if not usable:
        raise SystemExit("no run completed a single usable trial: nothing to compare (see the runs' trials.csv)")
    reference = max(usable) if maximize else min(usable)
    for r in runs:
        r["trials_to_reach"] = trials_to_reach(r["values"], reference, maximize=maximize, tolerance=tolerance)
    medians = {arm: arm_median([r["trials_to_reach"] for r in runs if r["arm"] == arm]) for arm in ARMS}
    return {"reference": reference, "tolerance": tolerance, "medians": medians}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from autotune.search.goal import goal
    from autotune.search.options import parse_duration

    target = goal(args.objective)
    total_s = parse_duration(args.total_time) if args.total_time else None
    budget_s = None if total_s is None else total_s / (2 * args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    started = time.time()
    for seed in seeds:
        for arm in ARMS:
            print(f"[{time.time() - started:5.0f}s] {arm} seed {seed}", flush=True)
            runs.append(run_one(args, arm, seed, budget_s))
    summary = summarize(runs, maximize=target.maximize, tolerance=args.tolerance)

    def count_text(c: int | float | None) -> str:
        return "not reached" if c is None or c == math.inf else f"{c:g}"

    print(f"\nreference: {target.format(summary['reference'])} (best of all {len(runs)} runs); "
          f"counting trials to within {100 * args.tolerance:g}% of it\n")
    header = f"{'arm':<8} {'seed':>4} {'trials':>6} {'to within':>11} {'best':>18} {'steered':>7}  fixed knobs"
    print(header)
    print("-" * len(header))
    for r in runs:
        print(f"{r['arm']:<8} {r['seed']:>4} {len(r['values']):>6} {count_text(r['trials_to_reach']):>11} "
              f"{target.format(r['best_value']):>18} {r['roles'].count('steered'):>7}  "
              f"{', '.join(f'{k}={v}' for k, v in r['fixed_knobs'].items()) or '-'}")
    print()
    for arm in ARMS:
        counts = [r["trials_to_reach"] for r in runs if r["arm"] == arm]
        print(f"median trials to within {100 * args.tolerance:g}%, {arm}: {count_text(summary['medians'][arm])} "
              f"(runs: {', '.join(count_text(c) for c in counts)})")
    print(f"\nall runs: {time.time() - started:.0f}s")
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "objective": target.name, **summary,
              "medians": {k: (None if v == math.inf else v) for k, v in summary["medians"].items()},
              "runs": runs, "wall_s": round(time.time() - started, 1)}
    (args.out / "steer-compare.json").write_text(json.dumps(report, indent=2, default=str))
    with open(args.out / "steer-compare.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "seed", "trials", "trials_to_reach", "best_value", "best_config", "steered_trials",
                         "fixed_knobs", "wall_s", "out_dir"])
        for r in runs:
            writer.writerow([r["arm"], r["seed"], len(r["values"]), r["trials_to_reach"], r["best_value"],
                             r["best_config"], r["roles"].count("steered"), json.dumps(r["fixed_knobs"]),
                             r["wall_s"], r["out_dir"]])
    print(f"wrote {args.out / 'steer-compare.json'} and {args.out / 'steer-compare.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
