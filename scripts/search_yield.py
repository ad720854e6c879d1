"""Search yield: what a `autotune search --budget B` finds, against the best of a long search of the
same space, how many configurations it measures, and where its time goes.

    python3 scripts/search_yield.py [--models resnet50,vit_b_16,gpt_lm,odd_mlp] [--budgets 3m,10m]
        [--reference MODEL=DIR ... | --reference-budget 30m] [--repeats N] [--verify N]
        [--device auto|cuda|cpu] [--shared-caches] [--out runs/search-yield] [-- EXTRA AUTOTUNE SEARCH ARGS]

For each model and budget it runs ``python -m autotune search --model M --budget B --out
OUT/<model>-<budget>`` as a user would (a subprocess, default options, a fresh output folder; the
arguments after ``--`` are passed on), times the whole command's wall clock, then reads the folder
(config.json, the study in study.db) into one row: the wall time and how far over or under the
budget it ended, the configurations measured (the study's counted trials), how many of them
completed a full measurement (the others were stopped early, ran out of memory or failed) and why
each was measured (seeded: the FP32 baseline and the known-good list; sampled by TPE; steered by a
finding; other: backed off after running out of memory, replayed), the best recommended value, the
reference's best and their ratio, and the time by phase:

    start-up and probe   the command's start to its first trial (imports, probe, opening the study)
    worker start, build, compile, warm-up, measuring
                         the trials' own figures, summed (config.json's "search cost")
    rest of trials       the trial workers' wall time not in those (profiling window, fit probes,
                         hand-over)
    accuracy checks and sampling in trials
                         a trial's time outside its worker: its accuracy check (when it is near the
                         best), the sampler, steering, the study's storage; the whole of a trial
                         that repeats an earlier one
    trials cut off       trials that ended without an outcome (the budget ran out during them: re-queued)
    final accuracy checks, export
                         after the last trial: checking the recommendation's numerics, writing
                         config.json, trials.csv and the report (the CLI's own figures)
    other                the rest of the wall clock: between trials, the command's exit

and, apart from the sum, the accuracy checks' training time (FP32 reference, its reshuffled twin,
each numerics class checked: from the study's cached results) wherever it fell.

The reference is the best value of an earlier, long search of the same space: ``--reference
MODEL=DIR`` per model (its output folder), or ``--reference-budget 30m``, which runs that search
first into OUT/<model>-reference-30m. Without either, each model's reference is the best of this
benchmark's own runs of it, and the table says so. ``--repeats N`` runs each (model, budget) N times
(OUT/<model>-<budget>, -r2, ...) and the row gives the medians. Each figure is the one its search
recorded; ``--verify N`` also re-measures the reference's best and each run's best N times with
`autotune verify`, back to back after the model's searches, so that the "verified" ratio is free of
whatever drifted between searches run far apart (other load on the machine, clocks, temperature).

The plain recipe (issue 35) is the other yardstick: after each model's searches the script runs
scripts/plain_recipe_loop.py, a hand-written loop of the benchmark's own (bf16 autocast, TF32,
channels_last, cudnn.benchmark, fused AdamW, torch.compile, the largest batch that fits up to 4x the
base), on the same model with the searches' workload and memory options from after ``--``
(--model-config, --seq-len, --input-shape, --num-classes, --base-batch-size, --memory-limit,
--memory-headroom, --input-on-device, --compile/--no-compile). Each row gets its samples/s
(tokens/s), its batch and the ratio best / plain recipe; the summary gives their median across
rows. Kept in OUT/plain-recipe/ and reused; ``--no-plain-recipe`` skips it.

Each search starts with empty autotune caches of its own (AUTOTUNE_CACHE_DIR in a fresh temporary
folder, deleted afterwards), as on a machine that never ran autotune: no run profits from the
compiles or FP32 accuracy references of the runs before it. ``--shared-caches`` lets them share
the user's caches instead, as a returning user's searches do.

A run folder holding ``yield-run.json`` (written when its command ended) is reused, not run again,
so a benchmark cut off by a time limit is completed by running the same command again; a folder
without it is an unfinished run, deleted and run again. Writes results.csv, results.md and
results.json into --out.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = {
    "resnet50": "resnet50",
    "vit_b_16": "vit_b_16",
    "gpt_lm": "yield_models:gpt_lm",
    "odd_mlp": "yield_models:odd_mlp",
    "gpt_lm_tiny": "yield_models:gpt_lm_tiny",
    "odd_mlp_tiny": "yield_models:odd_mlp_tiny",
}
"""Short names for --models; any other --model value (a torchvision name, package.module:factory)
is passed on as it is."""
DEFAULT_MODELS = "resnet50,vit_b_16,gpt_lm,odd_mlp"
DEFAULT_BUDGETS = "3m,10m"
MARKER = "yield-run.json"
"""Written into a run's folder when its command ended: the command, its wall time and console output."""
SEEDED = ("baseline", "known-good")
PHASES = ("startup_s", "worker_start_s", "build_s", "compile_s", "warmup_s", "measure_s", "trial_rest_s",
          "in_trial_s", "cut_s", "final_accuracy_s", "export_s", "other_s")
"""The wall clock's parts, in order; they add up to the wall time."""
PHASE_TITLES = ("start-up and probe", "worker start", "build", "compile", "warm-up", "measuring",
                "rest of trials", "accuracy checks and sampling in trials", "trials cut off",
                "final accuracy checks", "export", "other")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="arguments after -- go to every `autotune search` (reference included)")
    p.add_argument("--models", default=DEFAULT_MODELS,
                   help=f"comma-separated: {', '.join(MODELS)}, or any --model value (default {DEFAULT_MODELS})")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"comma-separated --budget values (default {DEFAULT_BUDGETS})")
    p.add_argument("--reference", action="append", default=[], metavar="MODEL=DIR",
                   help="the output folder of a long search of MODEL's space, whose best is the yardstick (repeat per model)")
    p.add_argument("--reference-budget", help="run the reference search first, with this --budget (e.g. 30m)")
    p.add_argument("--repeats", type=int, default=1, help="runs per model and budget; the row gives medians (default 1)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="passed to autotune search (default: its own)")
    p.add_argument("--shared-caches", action="store_true",
                   help="let the searches share the user's autotune caches (compiles, FP32 references), so later "
                        "runs profit from earlier ones; default: each run starts with empty caches of its own")
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="re-measure each run's best and the reference's best N times with `autotune verify`, back "
                        "to back after the model's searches, and compare those (throughput only; default 0: off)")
    p.add_argument("--no-plain-recipe", dest="plain_recipe", action="store_false",
                   help="do not run the plain recipe's hand-written loop (scripts/plain_recipe_loop.py) per model")
    p.add_argument("--plain-recipe-batch", type=int, metavar="N",
                   help="run the plain recipe's loop at batch N only (its --batch-size), where an earlier run of it "
                        "found N the largest that fits: its search of the batch compiles once per batch tried")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "search-yield")
    args = p.parse_args(argv)
    args.extra = extra
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    references = {}
    for entry in args.reference:
        name, sep, folder = entry.partition("=")
        if not sep or not folder:
            p.error(f"--reference {entry!r}: write MODEL=DIR, e.g. resnet50=reports/resnet50-h200-compile")
        references[name] = Path(folder)
    if references and args.reference_budget:
        p.error("give --reference folders or --reference-budget, not both")
    args.references = references
    from autotune.search.options import parse_duration

    for budget in args.budgets + ([args.reference_budget] if args.reference_budget else []):
        parse_duration(budget)  # a malformed budget is refused before any search runs
    return args


def model_target(name: str) -> str:
    """The --model value of a short name (gpt_lm -> yield_models:gpt_lm); others pass as they are."""
    return MODELS.get(name, name)


def folder_label(name: str) -> str:
    return name.rsplit(":", 1)[-1].replace(".", "_").replace("/", "_")


def search_command(target: str, budget: str, out_dir: Path, device: str | None, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "autotune", "search", "--model", target, "--budget", budget, "--out", str(out_dir),
            *(["--device", device] if device else []), *extra]


def search_env(cache_dir: Path | None) -> dict[str, str]:
    """scripts/ (yield_models) and the checkout on PYTHONPATH, the caller's own kept; a console wide
    enough that the CLI's summary lines are not wrapped; ``cache_dir``: autotune's caches there
    (compiles, FP32 references) instead of the user's."""
    path = [str(HERE), str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), COLUMNS="1000")
    if cache_dir is not None:
        env["AUTOTUNE_CACHE_DIR"] = str(cache_dir)
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return env


def run_command(command: list[str], out_dir: Path, budget_s: float, *, cold: bool = True,
                echo: bool = True) -> dict[str, Any]:
    """Run one search, as a user would, timing the whole command; write its record (MARKER) into its
    folder and return it. ``cold``: with empty caches of its own (deleted afterwards), as on a
    machine that never ran autotune, so no run profits from the compiles or FP32 references of
    the runs before it. A search still running at twice its budget plus 10 minutes is stopped
    with SIGTERM (a clean stop: it writes its outputs) and recorded as timed out."""
    cache_dir = Path(tempfile.mkdtemp(prefix="autotune-yield-cache-")) if cold else None
    engine = checkout()
    started_at = dt.datetime.now()
    started = time.monotonic()
    lines: list[str] = []
    # in the caller's folder, as the user would run it (a relative --out means the same to both)
    with subprocess.Popen(command, env=search_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace") as proc:
        reader = threading.Thread(target=_follow, args=(proc.stdout, lines, echo), daemon=True)
        reader.start()
        try:
            returncode, timed_out = proc.wait(timeout=2 * budget_s + 600), False
        except subprocess.TimeoutExpired:
            proc.terminate()
            returncode, timed_out = proc.wait(), True
        wall_s = round(time.monotonic() - started, 2)
        reader.join()
    if cache_dir is not None:
        shutil.rmtree(cache_dir, ignore_errors=True)
    record = {"command": command, "checkout": engine, "started": started_at.isoformat(timespec="seconds"),
              "wall_s": wall_s, "budget_s": budget_s, "returncode": returncode, "timed_out": timed_out,
              "caches": "cold" if cold else "shared", "console": lines}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER).write_text(json.dumps(record, indent=1))
    return record


def _follow(stream, lines: list[str], echo: bool) -> None:
    """Keep (and show, indented) a search's console output as it comes."""
    for line in stream:
        lines.append(line.rstrip("\n"))
        if echo:
            print(f"    {line.rstrip()}", flush=True)


def ensure_run(target: str, budget: str, out_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The record of one search into ``out_dir``: reused when it finished there, else run (afresh)."""
    from autotune.search.options import parse_duration

    marker = out_dir / MARKER
    if marker.exists() and (out_dir / "study.db").exists():
        record = json.loads(marker.read_text())
        print(f"  reused the finished run in {out_dir} ({record['wall_s']:.0f}s)", flush=True)
        return record
    if out_dir.exists():
        # killed mid-run, or ended before it opened a study (a crash at start-up): run it again
        print(f"  removed the unfinished run in {out_dir}", flush=True)
        shutil.rmtree(out_dir)
    command = search_command(target, budget, out_dir, args.device, args.extra)
    print(f"  $ {' '.join(command[1:])}", flush=True)
    return run_command(command, out_dir, parse_duration(budget), cold=not args.shared_caches)


def load_study(out_dir: Path):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=None, storage=f"sqlite:///{out_dir.resolve() / 'study.db'}")


def count_trials(study) -> dict[str, Any]:
    """Counted trials (as `--trials` and config.json count them: the configurations measured), those
    completed (a full measurement that gave a value, not a repeat of an earlier trial), each
    outcome's count (ok, pruned: stopped early, oom, error, ...) and why each trial was measured."""
    from autotune.search.trials import counted_trials
    from autotune.trial.record import TrialRecord

    records = [TrialRecord.of(t) for t in counted_trials(study)]
    roles: dict[str, int] = {}
    statuses: dict[str, int] = {}
    for r in records:
        roles[r.role or "search"] = roles.get(r.role or "search", 0) + 1
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return {
        "trials": len(records),
        "completed": sum(1 for r in records if r.measured and r.duplicate_of is None),
        # completed, but their steps' spread stayed above the noise limit: a busy machine, say
        "noisy": sum(1 for r in records if r.measured and r.duplicate_of is None and r.figures.get("noisy")),
        "statuses": statuses,
        "roles": roles,
        "seeded": sum(roles.get(role, 0) for role in SEEDED),
        "sampled": roles.get("search", 0),
        "steered": roles.get("steered", 0),
        "other_roles": sum(n for role, n in roles.items() if role not in (*SEEDED, "search", "steered")),
    }


MEMORY_KNOBS = ("optimizer_state", "loss_kernel", "activation_checkpointing", "llm_kernels", "allocator")
"""The knobs that buy memory (issue 36): a row also gives its search's best with all of them off."""


def best_without_memory_knobs(study) -> dict[str, Any] | None:
    """The search's best measured configuration with every MEMORY_KNOBS knob at its untuned value (a
    field a trial does not record taken as untuned): what the same search gives without them. None
    where no such trial completed."""
    import optuna

    import strategies
    from autotune.search.trials import counted_trials
    from autotune.trial.record import TrialRecord

    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    untuned = strategies.untuned_values()
    best = None
    for t in counted_trials(study):
        record = TrialRecord.of(t)
        if not record.measured or record.duplicate_of is not None or t.value is None:
            continue
        values = strategies.with_untuned(record.knobs)
        if all(values[name] == untuned[name] for name in MEMORY_KNOBS) and (best is None or (t.value > best.value if maximize else t.value < best.value)):
            best = t
    if best is None:
        return None
    return {"value": best.value, "trial": best.number, "config": strategies.describe(TrialRecord.of(best).knobs)}


def accuracy_training_s(study) -> float:
    """Seconds the accuracy checks trained, from the study's cached check results: each FP32
    reference and its reshuffled twin, and each numerics class checked against it."""
    from autotune.accuracy.study.gate import REFERENCE_ATTR, RESULT_ATTR

    prefixes = (REFERENCE_ATTR.split("{")[0], RESULT_ATTR.split("{")[0])
    total = 0.0
    for name, value in study.user_attrs.items():
        if name.startswith(prefixes) and isinstance(value, dict):
            total += value.get("wall_s") or 0.0
            total += (value.get("reshuffled") or {}).get("wall_s") or 0.0
    return round(total, 2)


def cli_phases(console: list[str]) -> dict[str, float]:
    """The CLI's own figures outside the trials, from its summary line
    "...; this run 39s (probe 3.1s, final accuracy checks 0.0s, export 1.5s)"; {} when absent."""
    import re

    text = " ".join(console)
    match = re.search(r"this run [\d.]+s \(([^)]*)\)", text)
    if not match:
        return {}
    phases = {}
    for part in match.group(1).split(","):
        found = re.fullmatch(r"\s*(.+?) ([\d.]+)s\s*", part)
        if found:
            phases[found.group(1)] = float(found.group(2))
    return phases


def phase_times(study, record: dict[str, Any]) -> dict[str, float | None]:
    """The run's wall clock by phase (see the module's docstring); they add up to the wall time."""
    from autotune.search.trials import counted_trials
    from autotune.trial.record import TrialRecord

    timing = [r.timing for r in map(TrialRecord.of, counted_trials(study)) if r.duplicate_of is None]

    def total(key: str) -> float:
        return round(sum(t.get(key) or 0.0 for t in timing), 2)

    trials = [t for t in study.get_trials(deepcopy=False) if t.datetime_start and t.datetime_complete]
    started = dt.datetime.fromisoformat(record["started"])
    startup = (min(t.datetime_start for t in trials) - started).total_seconds() if trials else None
    phases: dict[str, float | None] = {"startup_s": None if startup is None else round(startup, 2)}
    phases.update({key: total(key) for key in ("worker_start_s", "build_s", "compile_s", "warmup_s", "measure_s")})
    phases["trial_rest_s"] = round(total("wall_s") - sum(phases[k] for k in PHASES[1:6]), 2)
    counted = {t.number: TrialRecord.of(t) for t in counted_trials(study)}

    def outside_worker(t) -> float:
        # a repeat of an earlier trial copies its figures (and timing) without running a worker
        record = counted[t.number]
        worker = (record.timing.get("wall_s") or 0.0) if record.duplicate_of is None else 0.0
        return (t.datetime_complete - t.datetime_start).total_seconds() - worker

    phases["in_trial_s"] = round(sum(outside_worker(t) for t in trials if t.number in counted), 2)
    # trials that ended without an outcome: cut off by the budget (re-queued) or by a stop
    phases["cut_s"] = round(sum((t.datetime_complete - t.datetime_start).total_seconds()
                                for t in trials if t.number not in counted), 2)
    cli = cli_phases(record.get("console", []))
    phases["final_accuracy_s"], phases["export_s"] = cli.get("final accuracy checks"), cli.get("export")
    phases["other_s"] = round(record["wall_s"] - sum(phases[k] or 0.0 for k in PHASES[:-1]), 2)
    phases["accuracy_training_s"] = accuracy_training_s(study)  # apart: it falls within the phases above
    return phases


def summarize_run(out_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: wall time against its budget, trials by role, the best, time by phase."""
    run: dict[str, Any] = {"out_dir": str(out_dir), "checkout": record.get("checkout", "unknown"),
                           "wall_s": record["wall_s"], "budget_s": record["budget_s"],
                           "over_budget_s": round(record["wall_s"] - record["budget_s"], 2),
                           "returncode": record["returncode"], "timed_out": record.get("timed_out", False)}
    if not (out_dir / "study.db").exists():
        last = next((line.strip() for line in reversed(record.get("console", [])) if line.strip()), "")
        run["error"] = f"the command exited {record['returncode']} before it opened a study: {last}"
        return run
    study = load_study(out_dir)
    run.update(count_trials(study))
    run["without_memory_knobs"] = best_without_memory_knobs(study)
    run["phases"] = phase_times(study, record)
    run["cli_phases"] = cli_phases(record.get("console", []))
    config = json.loads((out_dir / "config.json").read_text()) if (out_dir / "config.json").exists() else None
    if config is None:
        run["error"] = "no configuration to recommend (no config.json); see its trials.csv"
        return run
    objective = config.get("objective") or {}
    run.update({
        "objective": objective.get("name", "throughput"), "unit": objective.get("unit", "samples/s"),
        "maximize": objective.get("direction", "maximize") == "maximize",
        "best_value": objective.get("value", config["figures"].get("samples_per_s")),
        "baseline_value": objective.get("baseline_value"),
        "best_config": config.get("summary"), "best_trial": config["study"]["trial_number"],
        "accuracy": (config.get("accuracy") or {}).get("verdict", "not checked"),
        "workload": config.get("workload"), "gpu": config["provenance"].get("gpu"),
        "torch": config["provenance"].get("torch"), "space": config.get("space"),
    })
    return run


def reference_run(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """The reference of one model: --reference's folder, or a --reference-budget search (run once)."""
    if name in args.references:
        folder = args.references[name]
        if not (folder / "config.json").exists():
            raise SystemExit(f"--reference {name}={folder}: no config.json there; give the output folder of a "
                             "finished search")
        record = json.loads((folder / MARKER).read_text()) if (folder / MARKER).exists() else None
        return summarize_run(folder, record) if record else reference_from_config(folder)
    if not args.reference_budget:
        return None
    folder = args.out / f"{folder_label(name)}-reference-{args.reference_budget}"
    print(f"{name}: reference search, --budget {args.reference_budget}", flush=True)
    return summarize_run(folder, ensure_run(model_target(name), args.reference_budget, folder, args))


def reference_from_config(folder: Path) -> dict[str, Any]:
    """The figures of a reference folder that this script did not run (a committed report)."""
    config = json.loads((folder / "config.json").read_text())
    objective = config.get("objective") or {}
    return {"out_dir": str(folder), "best_value": objective.get("value", config["figures"].get("samples_per_s")),
            "maximize": objective.get("direction", "maximize") == "maximize", "best_config": config.get("summary"),
            "objective": objective.get("name", "throughput"), "workload": config.get("workload"),
            "gpu": config["provenance"].get("gpu"), "space": config.get("space"),
            "trials": (config.get("search") or {}).get("num_trials")}


def _unset_dropped(value: Any) -> Any:
    """A workload as it is compared: the options an older config.json did not write yet (None, {})
    mean the same as their absence (reports/resnet50-h200-compile has no model_config or seq_len)."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if v not in (None, {}, [])}
    return value


def check_reference(name: str, reference: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """Refuse a reference of another workload, device or objective; notes for one whose space differs."""
    notes = []
    for run in runs:
        if "best_value" not in run:
            continue
        for key in ("workload", "gpu", "objective"):
            if _unset_dropped(reference.get(key)) != _unset_dropped(run.get(key)):
                raise SystemExit(f"the reference of {name} ({reference['out_dir']}) has {key} {reference.get(key)!r}, "
                                 f"the run in {run['out_dir']} {run.get(key)!r}: give a reference of the same search")
        if reference.get("space") != run.get("space") and not notes:
            differ = sorted(k for k in set(reference["space"] or {}) | set(run["space"] or {})
                            if (reference["space"] or {}).get(k) != (run["space"] or {}).get(k))
            notes.append(f"{name}: the reference's space differs from the runs' in {', '.join(differ)}")
    return notes


def median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(name: str, budget: str, runs: list[dict[str, Any]], reference: dict[str, Any],
              plain: dict[str, Any] | None = None) -> dict[str, Any]:
    """One row of the table: the medians of a (model, budget)'s runs, and their best against the
    reference and against the plain recipe (``plain``: plain_recipe_loop.py's result; None: not run)."""
    done = [r for r in runs if r.get("best_value") is not None]
    row: dict[str, Any] = {"model": name, "target": model_target(name), "budget": budget,
                           "budget_s": runs[0]["budget_s"], "runs": len(runs), "runs_with_result": len(done)}
    for key in ("wall_s", "over_budget_s", "trials", "completed", "noisy", "seeded", "sampled", "steered", "other_roles"):
        row[key] = median([r.get(key) for r in runs])
    row["max_over_budget_s"] = max(r["over_budget_s"] for r in runs)
    row["best_value"] = median([r["best_value"] for r in done])
    top = max(done, key=lambda r: r["best_value"] if r["maximize"] else -r["best_value"], default=None)
    row["best_config"] = top["best_config"] if top else None
    row["unit"] = top["unit"] if top else None
    row["accuracy"] = ", ".join(sorted({r["accuracy"] for r in done})) or None
    row["reference_value"], row["reference_source"] = reference.get("best_value"), reference.get("source")
    if row["best_value"] is not None and row["reference_value"]:
        ratio = row["best_value"] / row["reference_value"]
        row["ratio"] = round(ratio if top["maximize"] else 1 / ratio, 4)
    else:
        row["ratio"] = None
    for key in (*PHASES, "accuracy_training_s"):
        row[key] = median([(r.get("phases") or {}).get(key) for r in runs])
    row["verified_best"] = median([r.get("verified_best") for r in done])
    row["verified_reference"] = reference.get("verified")
    row["verified_ratio"] = median([r.get("verified_ratio") for r in done])
    row["errors"] = "; ".join(sorted({r["error"] for r in runs if r.get("error")})) or None
    row.update(plain_figures(row, plain))
    off = [r["without_memory_knobs"] for r in done if r.get("without_memory_knobs")]
    row["without_memory_knobs_value"] = median([o["value"] for o in off])
    row["without_memory_knobs_config"] = max(off, key=lambda o: o["value"])["config"] if off else None
    speed = row.get("plain_samples_per_s")
    row["without_memory_knobs_plain_ratio"] = (round(row["without_memory_knobs_value"] / speed, 4)
                                               if off and speed and row.get("unit") in (None, "samples/s") else None)
    return row


def plain_figures(row: dict[str, Any], plain: dict[str, Any] | None) -> dict[str, Any]:
    """The plain recipe's columns of a row: its samples/s, tokens/s and batch, and best / plain recipe
    (throughput searches only: the plain recipe is measured in samples/s)."""
    plain = plain or {}
    speed = plain.get("samples_per_s")
    comparable = row["best_value"] is not None and speed and row.get("unit") in (None, "samples/s")
    return {"plain_samples_per_s": speed, "plain_tokens_per_s": plain.get("tokens_per_s"),
            "plain_batch": plain.get("batch"),
            "plain_ratio": round(row["best_value"] / speed, 4) if comparable else None,
            "plain_error": plain.get("error")}


def references_for(name: str, runs: list[dict[str, Any]], args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The model's reference value and where it comes from, and notes on it."""
    reference = reference_run(name, args)
    if reference is None:
        values = [r for r in runs if r.get("best_value") is not None]
        if not values:
            return {"best_value": None, "source": "none: no run recommended a configuration"}, []
        top = max(values, key=lambda r: r["best_value"] if r["maximize"] else -r["best_value"])
        return {"best_value": top["best_value"], "folder": top["out_dir"],
                "source": "best of these runs (no reference search given)"}, []
    if reference.get("best_value") is None:
        raise SystemExit(f"the reference search of {name} gave no best value: {reference.get('error')}; fix that "
                         f"(or delete {reference['out_dir']} to run it again)")
    notes = check_reference(name, reference, runs)
    trials = f", {reference['trials']} trials" if reference.get("trials") is not None else ""
    wall = f", {reference['wall_s']:.0f}s" if reference.get("wall_s") is not None else ""
    source = f"{reference['out_dir']} ({reference.get('best_config')}{trials}{wall})"
    return {"best_value": reference["best_value"], "folder": reference["out_dir"], "source": source,
            "checkout": reference.get("checkout")}, notes


def fmt(value: Any, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}" if abs(value) < 10 else f"{value:.0f}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], notes: list[str]) -> str:
    """results.md: the yield table, then the time by phase."""
    lines = [f"# Search yield: {meta['where']}, torch {meta['torch']}", "",
             f"`{meta['command']}` (autotune at {', '.join(meta['checkouts'])}; each search with "
             + ("the user's shared caches)" if meta.get("caches") == "shared" else "empty caches of its own)"), "",
             ("| model | budget | wall s | over budget s | trials | completed | seeded / sampled / steered / other "
              "| best | reference | best / reference | verified | plain recipe | best / plain | accuracy "
              "| best configuration |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        roles = " / ".join(fmt(r[k], "g") for k in ("seeded", "sampled", "steered", "other_roles"))
        unit = f" {r['unit']}" if r.get("unit") else ""
        noisy = f" ({r['noisy']:g} noisy)" if r.get("noisy") else ""
        lines.append(f"| {r['model']} | {r['budget']} | {seconds(r['wall_s'])} | {r['over_budget_s']:+.1f} "
                     f"| {fmt(r['trials'], 'g')} | {fmt(r['completed'], 'g')}{noisy} | {roles} | {fmt(r['best_value'])}{unit} "
                     f"| {fmt(r['reference_value'])} | {fmt(r['ratio'], '.1%')} | {fmt(r['verified_ratio'], '.1%')} "
                     f"| {plain_cell(r)} | {fmt(r.get('plain_ratio'), '.1%')} | {r['accuracy'] or '-'} "
                     f"| {r['best_config'] or r['errors'] or '-'} |")
    lines += ["", "Time by phase (seconds; they add up to the wall time):", "",
              "| model | budget | " + " | ".join(PHASE_TITLES) + " | wall | accuracy training (within the above) |",
              "| --- | --- | " + " | ".join("---" for _ in PHASES) + " | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['budget']} | " + " | ".join(seconds(r[k]) for k in PHASES)
                     + f" | {seconds(r['wall_s'])} | {seconds(r['accuracy_training_s'])} |")
    lines += ["", "References:", ""]
    lines += [f"- {model}: {fmt(value)} from {source}" for model, (value, source) in meta["references"].items()]
    lines += plain_section(rows, meta)
    if meta["repeats"] > 1:
        lines += ["", f"Medians of {meta['repeats']} runs per row; the best configuration is the best run's."]
    lines += [""] + [f"Note: {n}" for n in notes] if notes else []
    return "\n".join(lines) + "\n"


def plain_cell(row: dict[str, Any]) -> str:
    """'3,210 at batch 512' (tokens/s after it for a language model), or '-'."""
    if row.get("plain_samples_per_s") is None:
        return "-"
    tokens = f" ({fmt(row['plain_tokens_per_s'])} tokens/s)" if row.get("plain_tokens_per_s") else ""
    return f"{fmt(row['plain_samples_per_s'])}{tokens} at batch {row['plain_batch']}"


def plain_section(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """The plain recipe's lines of results.md: each model's run (the batches it tried) and the median
    best / plain recipe across rows."""
    plains = meta.get("plain_recipes") or {}
    if not plains:
        return []
    lines = ["", "Plain recipe (scripts/plain_recipe_loop.py: bf16 autocast, TF32, channels_last, cudnn.benchmark, "
             "fused AdamW, torch.compile, the largest batch that fits up to 4x the base):", ""]
    for model, p in plains.items():
        if p.get("samples_per_s") is None:
            lines.append(f"- {model}: {p.get('error') or 'no result'}")
            continue
        failed = [t["batch"] for t in p.get("tried", []) if t.get("outcome") != "ok"]
        tried = f"; out of memory at {', '.join(map(str, failed))}" if failed else ""
        tokens = f", {fmt(p['tokens_per_s'])} tokens/s" if p.get("tokens_per_s") else ""
        peak = f", peak {p['peak_memory_gib']:.1f} GiB" if p.get("peak_memory_gib") is not None else ""
        cap = f" (capped at {p['memory_limit_gib']:.0f} GiB)" if p.get("memory_limit_gib") else ""
        how = f"{p.get('precision')}{' + GradScaler' if p.get('grad_scaler') else ''}, " + (
            "compiled" if p.get("compile") else "eager")
        lines.append(f"- {model}: {fmt(p['samples_per_s'])} samples/s{tokens} at batch {p['batch']} "
                     f"(base {p.get('base_batch')}{tried}){peak}{cap}; {how}, {p.get('optimizer')}")
    for r in rows:
        if r.get("without_memory_knobs_value") is not None and r["without_memory_knobs_value"] != r["best_value"]:
            ratio = r.get("without_memory_knobs_plain_ratio")
            lines.append(f"- {r['model']} ({r['budget']}), the same search's best with the memory knobs off: "
                         f"{fmt(r['without_memory_knobs_value'])}" + (f" ({ratio:.1%} of the plain recipe)" if ratio else "")
                         + f": {r['without_memory_knobs_config']}")
    median_ratio = meta.get("plain_median_ratio")
    if median_ratio is not None:
        n = sum(1 for r in rows if r.get("plain_ratio") is not None)
        lines += ["", f"Median best / plain recipe across {n} rows: {median_ratio:.1%}"]
    return lines


def write_results(out: Path, rows: list[dict[str, Any]], runs: list[dict[str, Any]], meta: dict[str, Any],
                  notes: list[str]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.csv", out / "results.md", out / "results.json"]
    with open(paths[0], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    paths[1].write_text(markdown(rows, meta, notes))
    paths[2].write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs, "notes": notes}, indent=1, default=str))
    return paths


def verify(folder: Path, name: str, args: argparse.Namespace) -> float | None:
    """The median of ``--verify`` re-measurements of a folder's best configuration (`autotune verify`,
    a fresh worker each); kept in OUT/verify/ and reused. None when the re-measurement failed."""
    store = args.out / "verify" / f"{folder_label(name)}--{Path(folder).name}.json"
    if store.exists() and json.loads(store.read_text()).get("repeat") == args.verify:
        return json.loads(store.read_text())["median"]
    command = [sys.executable, "-m", "autotune", "verify", str(folder), "--repeat", str(args.verify)]
    print(f"  $ {' '.join(command[1:])}", flush=True)
    proc = subprocess.run(command, env=search_env(None), capture_output=True, text=True, check=False)
    found = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not found:
        print(f"    re-measurement failed: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}", flush=True)
        return None
    result = {**json.loads(found[-1]), "repeat": args.verify, "folder": str(folder)}
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(result, indent=1))
    print(f"    re-measured {result['median']:,.0f} samples/s (recorded {result['recorded']:,.0f})", flush=True)
    return result["median"]


def verify_model(name: str, runs: list[dict[str, Any]], reference: dict[str, Any], args: argparse.Namespace) -> None:
    """Re-measure the reference's best, then each run's, back to back: their ratio is then free of the
    drift between searches run minutes or hours apart. Adds verified figures to ``reference`` and ``runs``."""
    if reference.get("folder") is None or any(r.get("objective", "throughput") != "throughput" for r in runs):
        return  # `autotune verify` re-measures samples/s
    print(f"{name}: re-measuring the best configurations ({args.verify} times each)", flush=True)
    reference["verified"] = verify(Path(reference["folder"]), name, args)
    for run in runs:
        if run.get("best_value") is None:
            continue
        run["verified_best"] = verify(Path(run["out_dir"]), name, args)
        if run["verified_best"] and reference["verified"]:
            run["verified_ratio"] = round(run["verified_best"] / reference["verified"], 4)


PLAIN_OPTIONS = {"--model-config": True, "--seq-len": True, "--input-shape": True, "--num-classes": True,
                 "--base-batch-size": True, "--memory-limit": True, "--memory-headroom": True,
                 "--input-on-device": False, "--compile": False, "--no-compile": False}
"""The search options (after --) that the plain recipe's loop takes too: the workload's shape, its
memory cap, where its batches live and whether it compiles; True: the option takes a value."""
PLAIN_TIMEOUT_S = 1800


def plain_recipe_args(extra: list[str]) -> list[str]:
    """The searches' extra arguments that shape the plain recipe's run, in their order."""
    out, i = [], 0
    while i < len(extra):
        name, eq, _ = extra[i].partition("=")
        if name in PLAIN_OPTIONS:
            takes_value = PLAIN_OPTIONS[name]
            out.append(extra[i])
            if takes_value and not eq and i + 1 < len(extra):
                out.append(extra[i + 1])
                i += 1
        i += 1
    return out


def plain_recipe_command(target: str, device: str | None, extra: list[str], batch: int | None = None) -> list[str]:
    return [sys.executable, str(HERE / "plain_recipe_loop.py"), "--model", target,
            *(["--device", device] if device else []), *plain_recipe_args(extra),
            *(["--batch-size", str(batch)] if batch else [])]


def plain_recipe(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The plain recipe's figures for one model (plain_recipe_loop.py, a subprocess after the model's
    searches); kept in OUT/plain-recipe/ and reused while its command is the same. On failure a
    dict with "error"."""
    command = plain_recipe_command(model_target(name), args.device, args.extra, args.plain_recipe_batch)
    store = args.out / "plain-recipe" / f"{folder_label(name)}.json"
    if store.exists():
        kept = json.loads(store.read_text())
        if kept.get("command") == command[1:] and kept["result"].get("samples_per_s") is not None:
            print(f"{name}: reused the plain recipe's run in {store}", flush=True)
            return kept["result"]
    print(f"{name}: the plain recipe's loop", flush=True)
    print(f"  $ {' '.join(command[1:])}", flush=True)
    try:
        proc = subprocess.run(command, env=search_env(None), capture_output=True, text=True, errors="replace",
                              timeout=PLAIN_TIMEOUT_S, check=False)
        found = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        result = json.loads(found[-1]) if found else {}
        if not result.get("samples_per_s"):
            last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            result.setdefault("error", f"the plain recipe's loop exited {proc.returncode}: {last[0][:300]}")
    except subprocess.TimeoutExpired:
        result = {"error": f"the plain recipe's loop ran over {PLAIN_TIMEOUT_S}s"}
    if result.get("samples_per_s") is not None:
        tokens = f", {result['tokens_per_s']:,.0f} tokens/s" if result.get("tokens_per_s") else ""
        print(f"    {result['samples_per_s']:,.0f} samples/s{tokens} at batch {result['batch']}", flush=True)
    else:
        print(f"    failed: {result['error']}", flush=True)
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps({"command": command[1:], "result": result}, indent=1))
    return result


def checkout() -> str:
    """The commit the searches ran from, "+ local changes" when the engine differed from it."""
    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    # the GPU machine's copy of the working tree names it in AUTOTUNE_COMMIT: its own .git, where it
    # has one, is the session's starting commit (a run of ba47806 said "82b598c + local changes")
    commit = os.environ.get("AUTOTUNE_COMMIT") or git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" + local changes" if git("status", "--porcelain", "--", "autotune", "strategies") else "")


def run_folder(out: Path, name: str, budget: str, repeat: int) -> Path:
    return out / (f"{folder_label(name)}-{budget}" + (f"-r{repeat}" if repeat > 1 else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, all_runs, notes, references, engines, plains = [], [], [], {}, set(), {}
    for name in args.models:
        model_runs: dict[str, list[dict[str, Any]]] = {}
        for budget in args.budgets:
            for repeat in range(1, args.repeats + 1):
                folder = run_folder(args.out, name, budget, repeat)
                print(f"{name}, --budget {budget}" + (f", run {repeat}" if args.repeats > 1 else ""), flush=True)
                run = summarize_run(folder, ensure_run(model_target(name), budget, folder, args))
                run.update(model=name, budget=budget, repeat=repeat)
                model_runs.setdefault(budget, []).append(run)
        reference, model_notes = references_for(name, [r for rs in model_runs.values() for r in rs], args)
        if args.verify:
            verify_model(name, [r for rs in model_runs.values() for r in rs], reference, args)
        references[name] = (reference["best_value"], reference["source"])
        engines |= {reference["checkout"]} if reference.get("checkout") else set()
        notes += model_notes
        plain = plain_recipe(name, args) if args.plain_recipe else None
        if plain is not None:
            plains[name] = plain
        for budget, runs in model_runs.items():
            rows.append(aggregate(name, budget, runs, reference, plain))
            all_runs += runs
    first = next((r for r in all_runs if r.get("torch")), {})
    meta = {"where": first.get("gpu") or "CPU", "torch": first.get("torch", "?"), "repeats": args.repeats,
            "checkouts": sorted(engines | {r["checkout"] for r in all_runs}), "caches": "shared" if args.shared_caches else "cold",
            "command": " ".join(["python3 scripts/search_yield.py", *(argv if argv is not None else sys.argv[1:])]),
            "references": references, "plain_recipes": plains,
            "plain_median_ratio": median([r["plain_ratio"] for r in rows])}
    paths = write_results(args.out, rows, all_runs, meta, notes)
    print()
    print(paths[1].read_text())
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
