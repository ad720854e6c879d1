"""How much faster does ``--gpus`` finish the same search than one GPU?

    python3 scripts/gpus_speedup.py --gpus 0,1 --trials 28 [--arms one,all] [--out runs/gpus-speedup]
        [--no-warmup] -- --model resnet18 --input-shape 3x64x64 --num-classes 10 --no-compile --no-accuracy-check

Runs ``autotune search`` twice, as a user runs it (a subprocess each), with the same options, the
same ``--trials`` and the same seed: arm ``one`` on the first GPU of ``--gpus`` (``--gpus 0``),
arm ``all`` on all of them (``--gpus 0,1``). Each arm's wall time is the whole command's: start-up,
the probe, the trials and the export, as the user waits for it. The search's own fixed cost (about
30 s on an H200: imports, the probe, the report) is paid once per arm, so the speed-up of the
whole command grows with the number of trials towards that of the trial phase (the first trial's
start to the last one's end, read from the study), which the summary prints too.

Before the first timed arm, an untimed two-trial search warms the machine up (disk caches of the
torch libraries, the driver): on a freshly started machine the first search's trials were 30%
slower than later ones', which would flatter the second arm (``--no-warmup`` skips it).

Each arm's search chooses its own configurations: on several GPUs the sampler proposes while
other trials run and the findings steer from trials finished in another order, so the two searches
take different paths, and a path of slower configurations costs more whatever the GPUs. With
``--replay``, arm ``all`` measures arm one's configurations in arm one's order (``autotune search
--replay``): the same trials, so the two arms differ in the GPUs alone.

An arm already finished under --out (ARM/wall.json and a study with --trials finished trials) is
reused, not run again, so the arms can run in separate calls of a time-limited GPU machine
(``--arms one``, then ``--arms all``) and be summarized together. Writes gpus-speedup.json and
gpus-speedup.md into --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("one", "all")
COUNTED = ("COMPLETE", "FAIL", "PRUNED")
"""Trial states that --trials counts (finished, whatever their outcome)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    search_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, search_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="0,1", help="the GPUs of arm 'all' (arm 'one' takes the first); default 0,1")
    p.add_argument("--trials", type=int, default=28, help="trials of each arm's search (default 28)")
    p.add_argument("--arms", default="one,all", help="which arms to run now: one, all or one,all (default)")
    p.add_argument("--out", type=Path, default=Path("runs/gpus-speedup"), help="output folder (default runs/gpus-speedup)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up search")
    p.add_argument("--replay", action="store_true",
                   help="arm all measures arm one's configurations, in its order (run arm one first)")
    args = p.parse_args(argv)
    args.search_args = search_args
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if len(gpus) < 2:
        p.error(f"--gpus {args.gpus!r}: give two GPUs or more, e.g. 0,1 (arm 'one' runs on the first)")
    args.gpu_list = gpus
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms):
        p.error(f"--arms {args.arms!r}: choose from one, all")
    args.arm_list = arms
    for flag in ("--gpus", "--trials", "--out", "--seed", "--budget", "--ddp", "--replay"):
        if flag in search_args:
            p.error(f"{flag} after -- is set by the script (each arm gets its own), drop it")
    if args.trials < 2:
        p.error("--trials must be at least 2")
    return args


def arm_command(args: argparse.Namespace, arm: str, out_dir: Path, trials: int | None = None) -> list[str]:
    gpus = args.gpu_list[0] if arm == "one" else ",".join(args.gpu_list)
    replay = ["--replay", str(args.out / "one")] if arm == "all" and args.replay else []
    return [sys.executable, "-m", "autotune", "search", *args.search_args, "--trials", str(trials or args.trials),
            "--seed", str(args.seed), "--gpus", gpus, *replay, "--out", str(out_dir)]


def _env() -> dict[str, str]:
    path = [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def warm_up(args: argparse.Namespace) -> None:
    """An untimed two-trial search on the first GPU, its outputs thrown away."""
    with tempfile.TemporaryDirectory() as tmp:
        command = arm_command(args, "one", Path(tmp) / "warmup", trials=2)
        started = time.perf_counter()
        subprocess.run(command, cwd=ROOT, env=_env(), check=True, stdout=subprocess.DEVNULL)
        print(f"warm-up search: {time.perf_counter() - started:.1f} s (not counted)", flush=True)


def run_arm(args: argparse.Namespace, arm: str) -> None:
    out_dir = args.out / arm
    if out_dir.exists():
        shutil.rmtree(out_dir)  # an unfinished run: start the arm afresh, so its wall is one command's
    command = arm_command(args, arm, out_dir)
    print("$", " ".join(command[1:]), flush=True)
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=_env(), check=True)
    wall = time.perf_counter() - started
    (out_dir / "wall.json").write_text(json.dumps({"wall_s": wall, "command": ["autotune", *command[3:]]}, indent=1))


def read_arm(out_dir: Path) -> dict[str, Any]:
    """An arm's figures: the command's wall, the trial phase and the trials from its study."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    wall = json.loads((out_dir / "wall.json").read_text())
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out_dir / 'study.db'}")
    done = [t for t in study.trials if t.state.name in COUNTED and t.datetime_start and t.datetime_complete]
    if not done:
        raise SystemExit(f"{out_dir}: no finished trial in its study")
    first = min(t.datetime_start for t in done)
    last = max(t.datetime_complete for t in done)
    # a repeat of a configuration already measured is not measured again (its result is copied):
    # it counts towards --trials but costs next to nothing, so the arms' measured work is compared too
    measured = [t for t in done if "duplicate_of" not in t.user_attrs] or done
    walls = [(t.datetime_complete - t.datetime_start).total_seconds() for t in measured]
    gpus = sorted({str(t.system_attrs.get("autotune:gpu")) for t in done})
    # the end of the trial phase when only some GPUs still had a trial running: the first GPU to
    # run out of trials waits for the last one's
    ends = [max(t.datetime_complete for t in done if str(t.system_attrs.get("autotune:gpu")) == g) for g in gpus]
    return {"wall_s": wall["wall_s"], "command": wall["command"], "trials": len(done), "measured": len(measured),
            "trial_phase_s": (last - first).total_seconds(), "median_trial_s": statistics.median(walls),
            "fixed_s": wall["wall_s"] - (last - first).total_seconds(), "gpus": gpus,
            "tail_s": (max(ends) - min(ends)).total_seconds(),
            "timing_by_config": {json.dumps(t.params, sort_keys=True): t.user_attrs["timing"]
                                 for t in measured if isinstance(t.user_attrs.get("timing"), dict)}}


PHASES = ("worker_start_s", "build_s", "compile_s", "warmup_s", "measure_s", "wall_s")


def phase_differences(one: dict[str, Any], all_: dict[str, Any]) -> dict[str, Any]:
    """How much longer each phase of a trial took in arm all than the same configuration's in arm
    one (median over the configurations both measured): where running trials side by side costs."""
    common = sorted(set(one["timing_by_config"]) & set(all_["timing_by_config"]))
    diffs = {}
    for phase in PHASES:
        pairs = [(one["timing_by_config"][c].get(phase), all_["timing_by_config"][c].get(phase)) for c in common]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        if pairs:
            diffs[phase] = {"one_s": statistics.median(a for a, _ in pairs),
                            "extra_s": statistics.median(b - a for a, b in pairs)}
    return {"configurations": len(common), "phases": diffs}


def summarize(one: dict[str, Any], all_: dict[str, Any]) -> dict[str, Any]:
    if one["trials"] != all_["trials"]:
        raise SystemExit(f"the arms finished {one['trials']} and {all_['trials']} trials: not the same search; "
                         "run both with the same --trials")
    summary = {"one": one, "all": all_, "speedup": one["wall_s"] / all_["wall_s"],
               "trial_phase_speedup": one["trial_phase_s"] / all_["trial_phase_s"],
               "side_by_side": phase_differences(one, all_)}
    if one["measured"] != all_["measured"]:
        # the same --trials, but one arm repeated configurations it had measured: what the whole
        # command would have taken had it measured as many as the other, each extra trial at its
        # median pace spread over its GPUs
        fewer, more = (all_, one) if all_["measured"] < one["measured"] else (one, all_)
        extra = (more["measured"] - fewer["measured"]) * fewer["median_trial_s"] / len(fewer["gpus"])
        walls = {arm: summary[arm]["wall_s"] + (extra if summary[arm] is fewer else 0.0) for arm in ARMS}
        summary["same_measured_speedup"] = walls["one"] / walls["all"]
    return summary


def table(summary: dict[str, Any]) -> str:
    rows = ["| arm | GPUs | trials | measured | command wall | trial phase | fixed cost | median measured trial |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm in ARMS:
        a = summary[arm]
        rows.append(f"| {arm} | {', '.join(a['gpus'])} | {a['trials']} | {a['measured']} | "
                    f"{a['wall_s']:.1f} s | {a['trial_phase_s']:.1f} s | {a['fixed_s']:.1f} s | "
                    f"{a['median_trial_s']:.1f} s |")
    rows += ["", f"Speed-up of the whole command: **{summary['speedup']:.2f}x**; of the trial phase: "
                 f"{summary['trial_phase_speedup']:.2f}x."]
    if "same_measured_speedup" in summary:
        rows += ["", "The arms measured different numbers of configurations: the others were repeats of "
                     "configurations already measured, whose results are copied. Had the arm with fewer measured "
                     "as many, at its median pace: about "
                     f"**{summary['same_measured_speedup']:.2f}x** (estimated, not measured)."]
    rows += ["", f"At the end of arm all's trial phase, {summary['all']['tail_s']:.1f} s passed with some GPU out "
                 "of trials, waiting for the last one's."]
    side = summary["side_by_side"]
    if side["phases"]:
        rows += ["", f"Per trial, the {side['configurations']} configurations both arms measured, median: "
                     "how long each phase took alone (arm one) and how much longer side by side (arm all):", "",
                 "| phase | alone | side by side |", "| --- | --- | --- |",
                 *[f"| {phase.removesuffix('_s').replace('_', ' ')} | {d['one_s']:.2f} s | {d['extra_s']:+.2f} s |"
                   for phase, d in side["phases"].items()]]
    rows += ["",
             "Commands:", "", *[f"- {arm}: `{' '.join(summary[arm]['command'])}`" for arm in ARMS]]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [arm for arm in args.arm_list if finished_arm(args.out / arm, args.trials) is None]
    if args.replay and "all" in todo and "one" not in todo and finished_arm(args.out / "one", args.trials) is None:
        raise SystemExit(f"--replay: arm all measures arm one's configurations, and {args.out / 'one'} holds no "
                         "finished arm one; run --arms one first (or --arms one,all)")
    if todo and args.warmup:
        warm_up(args)
    for arm in todo:
        run_arm(args, arm)
    arms = {arm: finished_arm(args.out / arm, args.trials) for arm in ARMS}
    if any(a is None for a in arms.values()):
        print(f"arms finished so far under {args.out}: {[arm for arm, a in arms.items() if a is not None]}; "
              "run the others to compare")
        return 0
    summary = summarize(arms["one"], arms["all"])
    saved = {key: ({k: v for k, v in value.items() if k != "timing_by_config"} if key in ARMS else value)
             for key, value in summary.items()}
    (args.out / "gpus-speedup.json").write_text(json.dumps(saved, indent=1))
    text = table(summary)
    (args.out / "gpus-speedup.md").write_text("# --gpus versus one GPU, same search\n\n" + text)
    print(text)
    return 0


def finished_arm(out_dir: Path, trials: int) -> dict[str, Any] | None:
    """The arm's figures (``read_arm``) once it has finished ``trials`` trials, else None."""
    if not (out_dir / "wall.json").exists() or not (out_dir / "study.db").exists():
        return None
    arm = read_arm(out_dir)
    return arm if arm["trials"] >= trials else None


if __name__ == "__main__":
    sys.exit(main())
