"""The search's Optuna study: opened (or created) for its objective, locked to one search per output
folder, checked against what an earlier run of it measured, set up with its seeds, and its dead
trials recovered."""

from __future__ import annotations

import fcntl
import warnings
from pathlib import Path
from typing import Any

import optuna

from autotune.space import SearchSpace
from autotune.errors import ConfigError
from autotune.search.distributed import (
    check_same_hardware,
    sampler_seed,
    setup_done,
    wait_for_setup,
)
from autotune.search.knob_effects import apply_fixed_knobs
from autotune.search.memory import PROBE_ATTR
from autotune.search.machine import MACHINE_ATTR, check_resume, this_machine
from autotune.search.options import SearchConfig, memory_limit_bytes
from autotune.search.queue import put
from autotune.search.seeds import replay_candidates, seed_candidates, seed_configurations
from autotune.search.space import same_space
from autotune.search.storage import mask_url, open_storage
from autotune.search.warm import evidence_key, judged_by, starts_warm, unmeasured, warm_start
from autotune.workload.units import ATTR as UNITS_ATTR, Units


def _limit_words(limit: int | None) -> str:
    return "no memory limit" if limit is None else f"a memory limit of {limit / 2**30:.1f} GiB"


def _ddp_words(world_size: Any) -> str:
    return "single-process" if world_size == 1 else f"{world_size}-process DDP"


class SearchLock:
    """One search per output folder at a time; holding it also proves that RUNNING trials in the
    folder's own SQLite study belong to a search process that died."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "w")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise ConfigError(f"another `autotune search` is running on {path.parent}; wait for it to end, "
                              "or give this one another --out (to search one study with several processes, "
                              "give each its own --out and the same --storage postgresql://USER@HOST/DB "
                              "--study-name NAME; on one machine, --gpus)") from None

    def release(self) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def tpe_sampler(seed: int, parallel: bool = False) -> optuna.samplers.TPESampler:
    """The study's sampler. With trials in flight at once (--gpus, a shared --storage), Optuna's
    advice for parallel TPE: ``constant_liar``, so a trial still running counts as a poor result
    and the next proposal explores elsewhere instead of repeating it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, constant_liar=parallel)


def open_study(storage: optuna.storages.BaseStorage, name: str, seed: int,
               objective: str = "throughput", parallel: bool = False) -> optuna.Study:
    """Create the study for ``objective`` (its direction, recorded as a user attribute), or load
    it; a study made for another objective is refused (Optuna's load_if_exists would silently
    keep the stored direction, and the values of the two objectives must never be mixed)."""
    from autotune.search.goal import OBJECTIVE_ATTR, goal, goal_of

    wanted = goal(objective)
    study = optuna.create_study(storage=storage, study_name=name, direction=wanted.direction,
                                sampler=tpe_sampler(seed, parallel), load_if_exists=True)
    if OBJECTIVE_ATTR not in study.user_attrs and not study.trials and study.direction.name.lower() == wanted.direction:
        study.set_user_attr(OBJECTIVE_ATTR, wanted.name)
    stored = goal_of(study)
    if stored != wanted or study.direction.name.lower() != wanted.direction:
        raise ConfigError(f"study {name!r} was created with --objective {stored.name} ({stored.text}); resuming it "
                          f"with --objective {wanted.name} would mix the two objectives' values. Resume it with "
                          f"--objective {stored.name}, or start a new search with another --study-name or --out")
    return study


def prepare_study(config: SearchConfig, storage: optuna.storages.BaseStorage | None, device: str,
                  info: dict[str, Any], space: SearchSpace, out_dir: Path,
                  slug: str) -> tuple[optuna.Study, optuna.storages.BaseStorage, int | None]:
    """Open this search's study (``storage``: the user's, else the folder's own study.db) and make
    it ready for trials: refused when it holds another machine's, another space's or another
    memory limit's measurements; set up (what it measures, its seeds) by the first process that
    opens it. Returns the study, its storage and the memory limit of each trial."""
    name = config.study_name or f"{config.workload.short_name}-{slug}"
    own_storage = config.storage is None
    storage = storage or open_storage(f"sqlite:///{out_dir / 'study.db'}")
    parallel = not own_storage or (config.gpus is not None and len(config.gpus) > 1)
    study = open_study(storage, name, config.seed, config.objective, parallel=parallel)
    machine = this_machine(info["provenance"])
    if own_storage:
        # before anything is written to it: a committed example or another machine's study
        # is never resumed by accident (a shared --storage is many machines by design)
        check_resume(study, machine, where=str(out_dir / "study.db"), resume=config.resume)
    if study.trials or not own_storage:
        # a resumed study gets a fresh sampler seed, so it does not re-propose the same sequence;
        # on a shared storage, neither does another process joining it at the same moment
        study.sampler = tpe_sampler(sampler_seed(config.seed, len(study.trials), shared=not own_storage), parallel)
    if config.steer:
        # knobs an earlier run of this study found to have no effect stay fixed
        apply_fixed_knobs(study)
    # several processes may join the study at once: one sets it up, the others wait for it
    stored_space = wait_for_setup(storage, study)
    where = mask_url(config.storage or str(out_dir / "study.db"))
    check_same_hardware(study, device, info["provenance"], suggestion=f"{name}-{slug}", where=where)
    limit = _check_stored_setup(config, device, info, study, stored_space, space, f"study {name!r} in {where}")
    if stored_space is None:
        _set_up(config, device, info, study, space, machine, limit)
    return study, storage, limit


def _check_stored_setup(config: SearchConfig, device: str, info: dict[str, Any], study: optuna.Study,
                        stored_space: dict[str, Any] | None, space: SearchSpace, study_words: str) -> int | None:
    """Refuse to add this search's trials to a study measured otherwise (DDP processes, memory
    limit, search space); returns this search's memory limit."""
    # a space stored before --ddp existed has no ddp_world_size: single-process trials
    theirs = None if stored_space is None else stored_space.get("ddp_world_size", 1)
    if theirs is not None and theirs != space.ddp_world_size:
        raise ConfigError(
            f"{study_words} holds "
            f"{_ddp_words(theirs)} measurements and this search measures {_ddp_words(space.ddp_world_size)}: "
            "one study must not mix them. Resume it with " + (f"--ddp {theirs}" if theirs != 1 else "no --ddp")
            + ", or start a new search with another --study-name or --out")
    limit = memory_limit_bytes(config, device, info)
    if stored_space is not None and study.user_attrs.get("memory_limit_bytes") != limit:
        raise ConfigError(
            f"{study_words} was measured under "
            f"{_limit_words(study.user_attrs.get('memory_limit_bytes'))} and this search runs under "
            f"{_limit_words(limit)}: "
            "what fits differs. Resume it with the same limit, or start a new one with another --out")
    if stored_space is not None and not same_space(stored_space, space):
        raise ConfigError(
            f"{study_words} was made with another search space ({stored_space}); "
            "resume it with the same options, or start a new one with another --out (it starts with the "
            "trials this one measured that its space offers; --fresh: without them)")
    return limit


def _set_up(config: SearchConfig, device: str, info: dict[str, Any], study: optuna.Study, space: SearchSpace,
            machine: dict[str, Any], limit: int | None) -> None:
    """Record what the study measures (space, workload, device, machine, memory limit) and queue
    its seeds: the FP32 baseline, the known-good configurations, with --replay an earlier search's."""
    study.set_user_attr("space", space.to_dict())
    study.set_user_attr("workload", config.workload.to_dict())
    study.set_user_attr("device", device)
    study.set_user_attr("provenance", info["provenance"])
    study.set_user_attr(MACHINE_ATTR, machine)
    study.set_user_attr("memory_limit_bytes", limit)
    if info.get("seconds"):  # where the probe's time went: building the model, its forwards, the compile check
        study.set_user_attr("probe_seconds", {k: round(v, 2) for k, v in info["seconds"].items() if v is not None})
    # what one sample is (a language model's tokens per sample): the report's tokens/s
    units = Units.from_dict(info)
    study.set_user_attr(UNITS_ATTR, units.to_dict())
    probed = info.get("memory_probe")
    if probed:  # the memory model's prior (autotune.search.fit)
        study.set_user_attr(PROBE_ATTR, {k: v for k, v in probed.items() if k != "plain_recipe_batch"})
    seeds = seed_configurations(space, units.tokens_per_sample,
                                plain_batch=(probed or {}).get("plain_recipe_batch"))
    # the guides' best first; the rest fed as the search's own trials catch up (SeedFeeder);
    # --replay measures in the earlier search's order, its seeds where it measured them
    if config.replay is not None:
        put(study, replay_candidates(study, config.replay, space, seeds))
    else:
        if starts_warm(config):
            # what earlier searches measured is evidence before the first trial, and a seed one of them
            # measured (the baseline, the plain recipe) is not queued again (autotune.search.warm)
            warm_start(study, space, evidence_key(config, device, info, limit), judged_by(config))
            seeds = unmeasured(study, seeds)
        put(study, seed_candidates(study, seeds))
    setup_done(study)
