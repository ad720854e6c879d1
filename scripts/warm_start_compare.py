"""What a second search of the same workload gained by starting warm (issue 59): its recommendation against
the first's, when it had it, what it measured that the first did not, and what its trials cost.

    python3 scripts/warm_start_compare.py FIRST_OUT_DIR SECOND_OUT_DIR

Reads each folder's study.db and config.json; prints one JSON line per search, then the comparison.
The second search's clock starts at its study's first own trial; a recommendation it took from the first
search's trials (autotune.search.warm) was had at 0 s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import optuna
from optuna.trial import TrialState

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.report.format import describe  # noqa: E402
from autotune.trial.record import TrialRecord  # noqa: E402


def load(folder: Path) -> optuna.Study:
    url = f"sqlite:///{folder / 'study.db'}"
    return optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)


def summary(folder: Path) -> dict:
    study = load(folder)
    config = json.loads((folder / "config.json").read_text())
    trials = study.get_trials(deepcopy=False)
    own = [t for t in trials if TrialRecord.of(t).warm_from is None]
    ran = [t for t in own if TrialRecord.of(t).status is not None and TrialRecord.of(t).duplicate_of is None]
    start = min((t.datetime_start for t in own if t.datetime_start), default=None)
    best_number = config["study"]["trial_number"]
    best = study.trials[best_number]
    record = TrialRecord.of(best)
    reached = 0.0 if record.warm_from is not None or start is None else \
        (best.datetime_complete - start).total_seconds()
    timing = [TrialRecord.of(t).timing for t in ran]
    return {
        "folder": str(folder), "best_samples_per_s": config["figures"]["samples_per_s"], "best_trial": best_number,
        "best_config": describe(record.knobs), "best_from_earlier_search": record.warm_from is not None,
        "best_reached_s": round(reached, 1), "warm_trials": len(trials) - len(own), "trials_run": len(ran),
        "compile_s": round(sum(x.get("compile_s") or 0.0 for x in timing), 1),
        "compile_cache_hits": sum(x.get("compile_cache") == "hit" for x in timing),
        "measured": {describe(TrialRecord.of(t).knobs): TrialRecord.of(t).figures.get("samples_per_s")
                     for t in ran if t.state == TrialState.COMPLETE},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    first, second = summary(args.first), summary(args.second)
    for s in (first, second):
        print(json.dumps(s))
    new = {c: v for c, v in second["measured"].items() if c not in first["measured"]}
    ratio = second["best_samples_per_s"] / first["best_samples_per_s"]
    print(f"recommendation: first {first['best_samples_per_s']:,.1f} samples/s ({first['best_config']}), second "
          f"{second['best_samples_per_s']:,.1f} ({second['best_config']}): {ratio:.3f}x, had by the second search "
          f"{second['best_reached_s']:.0f} s after its first trial"
          + (" (the first search's trial)" if second["best_from_earlier_search"] else ""))
    print(f"second search: {second['warm_trials']} trials of the first as evidence, {second['trials_run']} run, "
          f"compiling {second['compile_s']:.0f} s ({second['compile_cache_hits']} compiles loaded from the cache); "
          f"first search: {first['trials_run']} run, compiling {first['compile_s']:.0f} s")
    print(f"measured by the second search and not the first ({len(new)}):")
    for config, value in new.items():
        print(f"  {config}: {value if value is None else round(value, 1)} samples/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
