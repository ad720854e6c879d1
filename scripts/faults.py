"""Run the fault set: a search per fault, each with healthy and faulty trials, and check that the
study went on, the reason was recorded and no trial was lost.

    python3 scripts/faults.py                    # CPU faults (and the CUDA ones where there is a GPU)
    python3 scripts/faults.py --only oom,crash   # a subset
    python3 scripts/faults.py --jobs 3           # three searches at a time (a hung trial mostly waits)

Prints one line per fault and, last, `faults survived: N/N, trials lost: 0`.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRIALS = 4
# a hung trial waits out its timeout: 12 s is still 3-4 times what a healthy trial of this model takes
# on 2 busy cores (workers forked on a CPU start in milliseconds)
TRIAL_TIMEOUT_S = {"hang": 12}

# fault -> (expected state of the faulty trials, text their reason must contain, needs CUDA)
FAULTS = {
    "oom": ("PRUNED", "does not fit at batch", False),
    "wrapped-oom": ("PRUNED", "does not fit at batch", False),
    "hang": ("FAIL", "no result after", False),
    "crash": ("FAIL", "exited with code 11", False),
    "nan": ("COMPLETE", None, False),  # unstable, not failed
    "raise": ("FAIL", "injected bug", False),
    "cuda-oom": ("PRUNED", "does not fit at batch", True),
    "device-assert": ("FAIL", "device-side assert", True),
}


def run_fault(fault: str, device: str, workdir: Path) -> tuple[bool, int, str]:
    """One search with the fault injected; returns (survived, trials lost, explanation)."""
    state, reason, _ = FAULTS[fault]
    out = workdir / fault
    env = dict(os.environ, AUTOTUNE_FAULT=fault,
               PYTHONPATH=os.pathsep.join(p for p in [str(HERE), str(ROOT), os.environ.get("PYTHONPATH")] if p))
    cmd = [sys.executable, "-m", "autotune", "search", "--model", "fault_models:faulty", "--device", device,
           "--input-shape", "3x32x32", "--num-classes", "10", "--min-batch-size", "8", "--max-batch-size", "32",
           "--base-batch-size", "16", "--min-measure-time", "0.3",
           "--trial-timeout", str(TRIAL_TIMEOUT_S.get(fault, 20)), "--trials", str(TRIALS), "--no-compile",
           "--no-accuracy-check",
           # every trial measured in full: the checks below expect each state, and searches run side by
           # side (--jobs) on a shared CPU would otherwise stop a healthy or NaN trial as slower
           "--early-stop-below", "0", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return False, 0, f"the search itself failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}").trials
    lost = sum(not t.state.is_finished() for t in trials)
    counted = [t for t in trials if "status" in t.user_attrs]
    faulty = [t for t in counted if t.params.get("batch_size.batch_size", 0) >= 24]
    healthy = [t for t in counted if t.params.get("batch_size.batch_size", 0) < 24]
    problems = []
    if len(counted) != TRIALS:
        problems.append(f"{len(counted)} trials recorded, not {TRIALS}")
    if not faulty:
        problems.append("no trial met the fault")
    for t in faulty:
        if t.state.name != state:
            problems.append(f"trial {t.number} is {t.state.name}, not {state}")
        if reason and reason not in t.user_attrs.get("reason", ""):
            problems.append(f"trial {t.number}'s reason {t.user_attrs.get('reason')!r} lacks {reason!r}")
        if fault == "nan" and not t.user_attrs.get("unstable"):
            problems.append(f"trial {t.number} with a NaN loss is not marked unstable")
    if not any(t.state.name == "COMPLETE" for t in healthy):
        problems.append("no healthy trial completed")
    if faulty and max(t.number for t in trials) <= min(t.number for t in faulty):
        problems.append("the study did not go on after the fault")
    return not problems, lost, "; ".join(problems) or f"{len(faulty)} faulty and {len(healthy)} healthy trials recorded"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated faults: " + ",".join(FAULTS))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--jobs", type=int, default=1,
                        help="fault searches run at the same time (default 1; each is its own study and folder)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    names = args.only.split(",") if args.only else [f for f, (_, _, cuda) in FAULTS.items() if device == "cuda" or not cuda]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        parser.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    survived = lost_total = 0

    def timed(name: str) -> tuple[str, bool, int, str, float]:
        started = time.time()
        ok, lost, why = run_fault(name, device, Path(tmp))
        return name, ok, lost, why, time.time() - started

    with tempfile.TemporaryDirectory(prefix="autotune-faults-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        for name, ok, lost, why, took in pool.map(timed, names):  # in the given order
            survived += ok
            lost_total += lost
            print(f"{'ok  ' if ok else 'FAIL'} {name:<14} {took:5.0f}s  {why}", flush=True)
    print(f"faults survived: {survived}/{len(names)}, trials lost: {lost_total}")
    return 0 if survived == len(names) and lost_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
