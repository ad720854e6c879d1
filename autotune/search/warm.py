"""Warm start: a new search of a workload searched before on the same kind of machine begins with
what the earlier searches measured.

Every search keeps its measured trials in ``searches/`` under autotune's cache folder
(autotune.cache), one JSON file per key: the workload, the device and its GPU (or CPU), torch, the
objective and what bounds a trial's figures (memory limit, DDP processes, timing settings). A new
search of the same key adds them to its study before its first trial, as finished trials marked
``warm_from``: the planner, the sampler and the recommendation see them as evidence; a queued
configuration one of them measured (the FP32 baseline, the plain recipe) is copied, not run again
(Objective._reuse); the budget goes to what none of them reached. Their compiles and FP32 references
are in the caches beside (compile/, accuracy/), so the trials that need them load them. A trial the
budget cut (a compile still going) comes as a failed trial with the seconds it ran: the planner expects
its compile mode to cost more than that (autotune.search.walls.cut_floors), not to fit again.

``autotune search --fresh`` (or ``AUTOTUNE_FRESH=1`` in the environment, as the test suite sets it)
starts without them. Deleting the folder only makes the next search cold.
A resumed study is never warmed again: it holds its own evidence.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import optuna
from optuna.trial import TrialState

import strategies
from autotune.cache import cache_root
from autotune.space import SearchSpace
from autotune.search.options import SearchConfig
from autotune.trial.record import TrialRecord

FOLDER = "searches"
FORMAT = 1
RUNS_KEPT = 8
"""The newest searches kept per key: older ones' trials are re-measured, if ever, by newer searches."""
ID_ATTR = "search_id"
"""Study user attribute: the study's own id, which names its record among the kept searches."""
ATTR = "warm_start"
"""Study user attribute: the earlier searches this study was started with, [{out_dir, study, finished, trials}]."""
_CONSTRAINTS = "constraints:"  # Optuna's system attributes of Trial.set_constraint
_STUDY_ATTRS = ("accuracy_run:", "accuracy_reference:", "accuracy_unfit:")
"""The accuracy gate's study-level results, each keyed by its settings' fingerprint and the numerics it
judged (autotune.accuracy.study.gate): valid in any study of the same workload, so kept with the trials."""


FRESH_ENV = "AUTOTUNE_FRESH"


def starts_warm(config: SearchConfig) -> bool:
    """Whether a new study of this search starts with earlier searches' trials: not under --fresh,
    AUTOTUNE_FRESH=1 or --replay (which measures an earlier search's configurations as they were)."""
    env = os.environ.get(FRESH_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    return not (config.fresh or env or config.replay is not None)


def evidence_key(config: SearchConfig, device: str, info: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """What two searches must share for one's figures to stand in the other's study."""
    prov = info["provenance"]
    hardware = prov.get("gpu") if device == "cuda" else [prov.get("cpu"), prov.get("num_cpus")]
    return {"workload": config.workload.to_dict(), "data": config.data, "device": device, "hardware": hardware,
            "torch": prov.get("torch"), "objective": config.objective, "memory_limit_bytes": limit,
            "ddp": config.ddp or 1, "global_batch_size": config.global_batch_size,
            "input_on_device": config.input_on_device, "measure": config.measure_settings(device).to_dict()}


def judged_by(config: SearchConfig) -> dict[str, Any]:
    """What a trial's accuracy verdict depends on besides its key: a verdict reached under other settings
    is dropped on import (the trial's figures still count)."""
    return {"check": config.accuracy_check, "method": config.accuracy_method,
            "max_accuracy_drop": config.max_accuracy_drop, "max_loss_drift": config.max_loss_drift,
            "steps": config.accuracy_steps}


def evidence_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    name = str(key["workload"].get("model", "model")).replace("/", "_").replace(":", "_")
    return cache_root() / FOLDER / f"{name}-{key['device']}-{digest}.json"


def remember(study: optuna.Study, out_dir: Path, key: dict[str, Any], judged: dict[str, Any]) -> Path | None:
    """Keep the trials this study measured (not the copies, nor those it was warmed with), and those the
    budget cut (what they cost is more than they ran: walls.cut_floors), for the next search of ``key``;
    this study's earlier record (a resumed search's) is replaced, another study's kept, in the same
    folder too (a folder deleted and searched again). Returns the file, or None when nothing was measured."""
    trials = [_entry(t) for t in study.get_trials(deepcopy=False) if _own_outcome(t) or _own_cut(t)]
    if not trials:
        return None
    attrs = {k: v for k, v in study.user_attrs.items() if k.startswith(_STUDY_ATTRS)}
    if ID_ATTR not in study.user_attrs:  # a study set up before warm starts existed
        study.set_user_attr(ID_ATTR, uuid.uuid4().hex)
    run = {"id": study.user_attrs[ID_ATTR], "out_dir": str(Path(out_dir).resolve()), "study": study.study_name,
           "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
           "judged": judged, "trials": trials, "study_attrs": attrs}
    path = evidence_path(key)
    with _locked(path):
        runs = [r for r in _read(path, key) if r.get("id") != run["id"]]
        runs = sorted([*runs, run], key=lambda r: r["finished"])[-RUNS_KEPT:]
        _write(path, {"format": FORMAT, "key": key, "runs": runs})
    return path


def warm_start(study: optuna.Study, space: SearchSpace, key: dict[str, Any], judged: dict[str, Any]) -> list[dict]:
    """Add to ``study`` (new, no trial yet) the trials earlier searches of ``key`` measured that this
    space offers, newest first where two measured the same configuration; returns the searches used
    ({out_dir, study, finished, trials}), also stored as the study's ``warm_start`` attribute."""
    path = evidence_path(key)
    with _locked(path):
        runs = _read(path, key)
    seen: set[str] = set()
    used = []
    for run in sorted(runs, key=lambda r: r["finished"], reverse=True):
        added = 0
        for entry in run["trials"]:
            trial = _trial(entry, run, space, verdicts=run.get("judged") == judged)
            if trial is None or (same := json.dumps(trial.params, sort_keys=True)) in seen:
                continue
            seen.add(same)
            study.add_trial(trial)
            added += trial.state != TrialState.FAIL  # measured; a cut one bounds a cost
        for name, value in (run.get("study_attrs") or {}).items():
            if name not in study.user_attrs:
                study.set_user_attr(name, value)
        if added:
            used.append({"out_dir": run["out_dir"], "study": run["study"], "finished": run["finished"], "trials": added})
    if used:
        study.set_user_attr(ATTR, used)
    return used


def unmeasured(study: optuna.Study, seeds: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """The seeds ((role, complete parameters), autotune.search.seeds) no trial of ``study`` measured."""
    done = [t.params for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))]
    return [(role, params) for role, params in seeds if params not in done]


def propose_from_evidence(study: optuna.Study,
                          propose_after: Callable[[optuna.Study, optuna.trial.FrozenTrial], None]) -> int:
    """Hand each trial the study was warmed with to ``propose_after`` (the queue's proposers after a trial,
    whose candidates it puts in the queue: autotune.search.queue.Feeder.propose), in the order they were
    measured, as if it had just finished here: the plain recipe's neighbours, the climbs from a winner,
    the compile of the fastest eager trial are proposed where no trial measured them, before this search's
    first trial. Only for a study that has not started a trial of its own (a resumed one has had its
    proposals; the seeds queued at its creation wait); returns how many trials were handed."""
    trials = study.get_trials(deepcopy=False)
    if any(TrialRecord.of(t).warm_from is None and t.state != TrialState.WAITING for t in trials):
        return 0
    warm = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    for trial in sorted(warm, key=lambda t: (t.user_attrs["warm_from"]["finished"], t.user_attrs["warm_from"]["number"])):
        propose_after(study, trial)
    return len(warm)


def warm_walls(study: optuna.Study) -> list[tuple[float, bool]]:
    """The stop rule's walls (autotune.search.walls.trial_wall) of the trials the study was warmed with."""
    from autotune.search.walls import trial_wall

    records = (TrialRecord.of(t) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,
                                                                                   TrialState.PRUNED)))
    return [wall for r in records if r.warm_from is not None and (wall := trial_wall(r)) is not None]


def _own_cut(trial: optuna.trial.FrozenTrial) -> bool:
    record = TrialRecord.of(trial)
    return trial.state == TrialState.FAIL and bool(record.cut_after_s) and record.warm_from is None


def _own_outcome(trial: optuna.trial.FrozenTrial) -> bool:
    record = TrialRecord.of(trial)
    return bool(trial.params) and record.status is not None and record.duplicate_of is None \
        and record.warm_from is None


def _entry(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    return {"number": trial.number, "state": trial.state.name, "value": trial.value, "params": dict(trial.params),
            "user_attrs": dict(trial.user_attrs),
            "constraints": {k: v for k, v in trial.system_attrs.items() if k.startswith(_CONSTRAINTS)}}


def _trial(entry: dict[str, Any], run: dict[str, Any], space: SearchSpace, *, verdicts: bool
           ) -> optuna.trial.FrozenTrial | None:
    """The earlier trial as a finished trial of this study, or None where this space does not offer
    its configuration (another batch range, a precision left out)."""
    from autotune.search.steering import complete_params

    params = complete_params(entry["params"], space)
    if any(params.get(name) != value for name, value in entry["params"].items()):
        return None
    fixed = optuna.trial.FixedTrial(params)
    strategies.sample(fixed, space)  # this space's distributions, as its own trials suggest them
    attrs = {k: v for k, v in entry["user_attrs"].items() if k != "planned"}
    attrs["warm_from"] = {"out_dir": run["out_dir"], "study": run["study"], "number": entry["number"],
                          "finished": run["finished"]}
    constraints = dict(entry.get("constraints") or {})
    if not verdicts:  # judged under other accuracy settings: the figures stand, the verdict does not
        attrs.pop("accuracy", None)
        constraints = {}
    state = TrialState[entry["state"]]
    return optuna.trial.create_trial(
        state=state, value=entry["value"] if state == TrialState.COMPLETE else None,
        params=dict(fixed.params), distributions=dict(fixed.distributions), user_attrs=attrs,
        system_attrs=constraints)


def _read(path: Path, key: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs kept for ``key``; none where the file is missing, unreadable, of another format or
    (a hash collision, an edit) another key's."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != json.loads(
            json.dumps(key, default=str)):
        return []
    return [r for r in data.get("runs") or [] if isinstance(r, dict) and r.get("trials")]


def _write(path: Path, data: dict[str, Any]) -> None:
    """Replace the file whole (a reader never sees half of it)."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(data, f, default=str)
    os.replace(f.name, path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One search at a time reads or rewrites a key's file (two searches may end together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

