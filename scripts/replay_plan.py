"""What would the planner run next? A stored search's study, replayed on a CPU without its GPU.

    python3 scripts/replay_plan.py STUDY_DB [--after N] [--left SECONDS] [--memory-gib G] [--remedies] [--feeder]
    python3 scripts/replay_plan.py --all [--first 8]   # every committed study under reports/search-yield/

A GPU session is short (30 minutes here), and a change to the planner or its proposers
(autotune.search.planner, neighbours, plain_recipe.GrowToFit) is first checked against the
searches already run: this rebuilds the study as it stood when trial N finished (default: the first
plain-recipe trial, the bar), runs the proposers' callbacks for N with the code checked out now,
and prints every queued candidate in the order the planner would run them (predicted value, cost,
expected gain a second, why), then its choice with ``--left`` seconds of the budget left.

The study as it stood: the trials finished by then, as they finished; the trials queued by then,
waiting again; none that N's callbacks made (those steered by N or grown from it, and everything
numbered after the first of them). The memory limit is the study's ``--memory-limit`` if it had
one, else ``--memory-gib`` (the card's: the study does not record it). The stop rule's measured
walls are the finished trials' own, counted as it counts them. ``--remedies`` also proposes the
findings' remedies of trial N (steering, from the findings it recorded) and ``--feeder`` the seed
feeder's next seed: proposers return candidates and only the queue (autotune.search.queue) puts them
in it, so each can be replayed.
``--all`` prints the first planned candidates of every committed search-yield study that has a plain
recipe; a change to the planner or a proposer keeps those the same or says why.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState, create_trial

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.space import SearchSpace  # noqa: E402
from autotune.search.findings import Finding  # noqa: E402
from autotune.search.neighbours import Neighbours  # noqa: E402
from autotune.search.plain_recipe import ROLE, GrowToFit  # noqa: E402
from autotune.search.planner import Planner  # noqa: E402
from autotune.search.queue import Candidate, Feeder, put, queued  # noqa: E402
from autotune.search.seeds import SeedFeeder  # noqa: E402
from autotune.search.steering import steer  # noqa: E402
from autotune.search.trials import planned_params  # noqa: E402
from autotune.search.walls import trial_wall  # noqa: E402
from autotune.trial.record import TrialRecord  # noqa: E402

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "reports" / "search-yield"
KEPT_ATTRS = ("role", "steered_by", "grown_from", "urgent")
"""A waiting trial's user attributes that say why it was queued (autotune.trial.record.queue_attrs)."""


def as_of(src: optuna.Study, after: int) -> tuple[optuna.Study, optuna.trial.FrozenTrial]:
    """An in-memory copy of ``src`` as it stood when trial ``after`` finished, and that trial."""
    told = src.trials[after]
    if told.datetime_complete is None:
        raise SystemExit(f"trial {after} never finished ({told.state.name}): give --after a finished trial")
    made_by = [t.number for t in src.trials if t.number > after and after in (
        (t.user_attrs.get("steered_by") or {}).get("trial"), t.user_attrs.get("grown_from"))]
    cut = min(made_by, default=len(src.trials))
    dst = optuna.create_study(directions=src.directions)
    for key, value in src.user_attrs.items():
        dst.set_user_attr(key, value)
    for t in src.trials[:cut]:
        if t.state.is_finished() and t.datetime_complete <= told.datetime_complete:
            dst.add_trial(create_trial(state=t.state, params=t.params, distributions=t.distributions,
                                       values=t.values, user_attrs=t.user_attrs, system_attrs=t.system_attrs))
        else:  # waiting then: proposed again with what it was proposed with
            kept = {k: t.user_attrs[k] for k in KEPT_ATTRS if k in t.user_attrs}
            put(dst, Candidate.of(planned_params(t), **kept))
    return dst, dst.trials[after]


def walls(study: optuna.Study) -> list[tuple[float, bool]]:
    """The stop rule's (wall seconds, compiled) of the trials finished by then (autotune.search.budget)."""
    return [wall for t in study.trials if (wall := trial_wall(TrialRecord.of(t))) is not None]


def replay(path: str, after: int | None = None, left_s: float | None = None,
           memory_gib: float | None = None, *, remedies: bool = False, feeder: bool = False) -> dict[str, Any]:
    """The plan after trial ``after`` of the study in ``path`` (a SQLite file): its rows and choice (with
    its runner-up); ``remedies``, ``feeder``: the findings' remedies and the seed feeder propose too."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    src = optuna.load_study(study_name=None, storage=f"sqlite:///{Path(path).resolve()}")
    if after is None:
        bars = [t.number for t in src.trials if TrialRecord.of(t).role == ROLE and t.state == TrialState.COMPLETE]
        if not bars:
            raise SystemExit(f"{path}: no plain-recipe trial finished; give --after N")
        after = bars[0]
    space = SearchSpace.from_dict(src.user_attrs["space"])
    limit = src.user_attrs.get("memory_limit_bytes") or (memory_gib * GIB if memory_gib else None)
    study, told = as_of(src, after)
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    if remedies and told.user_attrs.get("finding_rules"):
        put(study, steer(study, told, [Finding(**f) for f in told.user_attrs["finding_rules"]], space))
    if told.state == TrialState.COMPLETE:
        Feeder(proposers=[GrowToFit(space, limit), Neighbours(space, limit)]).propose(study, told)
    if feeder:
        put(study, SeedFeeder()(study, told))
    planner = Planner(space, maximize=maximize, limit_bytes=limit, walls=walls(study))
    rows = []
    queue = {t.number: planned_params(t) for t in queued(study)}
    for plan in planner.plans(study):
        fixed = queue[plan.number]
        change = {k: v for k, v in fixed.items() if told.params.get(k) != v and not k.startswith("grad_scaler.")}
        rows.append({"number": plan.number, "role": plan.role, "change": change, "predicted": plan.predicted,
                     "cost_s": plan.cost_s, "gain_per_s": plan.gain_per_s, "rank": plan.rank, "why": plan.why})
    choice = None
    if left_s is not None:
        planner.deadline = time.time() + left_s
        chosen = planner.choose(study, left_s=left_s)
        choice = None if chosen is None else {"number": chosen.number, "why": chosen.why,
                                              "runner_up": chosen.runner_up}
    return {"after": after, "limit_bytes": limit, "rows": rows, "choice": choice}


def committed(first: int = 8) -> dict[str, list[dict[str, Any]]]:
    """Each committed search-yield study with a plain recipe (its path from the repository's root) -> its
    first ``first`` planned candidates after it (role, change, rank, predicted, cost_s)."""
    out = {}
    for path in sorted(COMMITTED.glob("**/study.db")):
        try:
            rows = replay(str(path))["rows"][:first]
        except SystemExit:  # no plain recipe finished: nothing to replay from by default
            continue
        out[str(path.relative_to(ROOT))] = [{k: row[k] for k in ("role", "change", "rank", "predicted", "cost_s")}
                                            for row in rows]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study_db", nargs="?", help="a search's study.db")
    parser.add_argument("--all", action="store_true", help="every committed study under reports/search-yield/")
    parser.add_argument("--first", type=int, default=8, help="with --all: how many planned candidates each")
    parser.add_argument("--remedies", action="store_true", help="the findings' remedies of trial N proposed too")
    parser.add_argument("--feeder", action="store_true", help="the seed feeder's next seed proposed too")
    parser.add_argument("--after", type=int, help="the finished trial to replay from (default: the first plain recipe)")
    parser.add_argument("--left", type=float, help="seconds of the budget left, for the planner's choice")
    parser.add_argument("--memory-gib", type=float, help="the card's memory, where the search had no --memory-limit")
    args = parser.parse_args(argv)
    if args.all:
        for path, rows in committed(args.first).items():
            print(path)
            for row in rows:
                print(f"  {row['role'] or '':<12} {row['change'] or 'as measured'}")
        return 0
    if args.study_db is None:
        parser.error("give a study.db, or --all")
    out = replay(args.study_db, args.after, args.left, args.memory_gib, remedies=args.remedies, feeder=args.feeder)
    limit = f"{out['limit_bytes'] / GIB:.0f} GiB" if out["limit_bytes"] else "no memory limit"
    print(f"after #{out['after']} ({limit}), the queue in the planner's order:")
    for row in out["rows"]:
        print(f"  #{row['number']:<3} {row['role'] or '':<12} {row['change'] or 'as measured'}\n       {row['why']}")
    if out["choice"] is not None:
        print(f"with {args.left:.0f} s left it runs #{out['choice']['number']}: {out['choice']['why']}")
        if (runner := out["choice"]["runner_up"]) is not None:
            print(f"  not #{runner['number']} ({runner['role']}): {runner['lost']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
