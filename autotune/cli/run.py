"""run_search: one search as a short sequence of named steps, from its options to its exported results
(checks before any device time, probe, space, study, trials, final accuracy checks, outputs)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import optuna

from autotune import stop
from autotune.cache import trim_cache
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from autotune.search.artifacts import Artifacts
from autotune.search.budget import StopRule, deadline
from autotune.search.distributed import SharedStudy
from autotune.search.fit import plain_recipe_batch, probe_fit, widen_to_fit
from autotune.search.goal import Goal, goal, nvml_refusal
from autotune.search.objective import Objective, fit_limit_bytes
from autotune.search.queue import TrialFailed
from autotune.search.options import (
    DEFAULT_OUT,
    SearchConfig,
    device_slug,
    memory_limit_bytes,
    resolve_device,
)
from autotune.report.write import write_outputs
from autotune.search.outputs import check_writable
from autotune.search.neighbours import Neighbours
from autotune.search.plain_recipe import GrowToFit
from autotune.search.planner import Planner
from autotune.search.queue import Feeder
from autotune.search.runlog import run_log
from autotune.search.screening import CompileFinalist
from autotune.search.seeds import SeedFeeder
from autotune.search.space import build_space, check_ddp, probe
from autotune.search.storage import open_storage, recover_dead_trials
from autotune.search.study import SearchLock, prepare_study
from autotune.search.trials import counted_trials
from autotune.search.walls import compile_prior_s
from autotune.search.warm import evidence_key, judged_by, propose_from_evidence, remember, warm_walls
from autotune.trial.gpus import GpuPool, pinned, probe_view
from autotune.trial.runner import discard_spares, forks, prestart_setting, start_spare
from autotune.workload.models import check_spec


@dataclass
class SearchResult:
    study: optuna.Study
    out_dir: Path
    space: SearchSpace
    probe: dict[str, Any]
    elapsed_s: float
    new_trials: int
    files: dict[str, Path] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of this run outside its trials: "probe", "final accuracy checks", "export"."""
    cache: dict[str, Any] = field(default_factory=dict)
    """autotune's cache after the search (autotune.cache.trim_cache): its path, bytes, limit, bytes freed."""


def run_search(config: SearchConfig, *, on_event: Callable[[str, Any], None] | None = None) -> SearchResult:
    """Run (or resume) a search and export its results. ``on_event(kind, payload)`` reports
    progress: ("start", info), ("trial", FrozenTrial), ("end", None)."""
    emit = on_event or (lambda kind, payload: None)
    device, prestart, storage, target = _check_before_device_time(config)
    # a tracking store MLflow refuses is refused here, before any device time
    tracking = _mlflow_log(config)
    # --budget counts from the command's start (its imports and checks too), else from here
    started = config.started_at or time.time()
    phases: dict[str, float] = {}
    # --gpus: the probe sees the requested GPUs (its device 0 the first) and names them, which
    # makes the pool; a mix of GPU models or a missing one is refused here
    with pinned(probe_view(config.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))):
        info = probe(config, device, list_devices=config.gpus is not None, spare=prestart and config.gpus is None)
    phases["probe"] = time.time() - started
    _start_fork_server(config, device)
    gpu_pool = GpuPool.for_search(config.gpus, device, probed=info.get("cuda_devices"))
    if target.needs_nvml and (refusal := nvml_refusal(device, info.get("nvml"))):
        raise ConfigError(refusal)
    space = _fit(config, device, info, phases, spare=prestart and config.gpus is None)
    _warn_without_nvml(config, device, info)
    slug = _slug(config, device, info)
    out_dir = Path(config.out_dir or DEFAULT_OUT / f"{config.workload.short_name}-{slug}")
    check_writable(out_dir)
    (out_dir / "logs").mkdir(exist_ok=True)
    lock = SearchLock(out_dir / ".search.lock")
    logged = contextlib.ExitStack()
    try:
        # Optuna's per-trial messages and tracebacks go to logs/search.log, not the terminal
        logged.enter_context(run_log(out_dir / "logs"))
        if gpu_pool:
            gpu_pool.activate()
        study, storage, limit = prepare_study(config, storage, device, info, space, out_dir, slug)
        recovered = recover_dead_trials(study, storage) if config.storage is None else []
        shared = SharedStudy(study, storage, config.storage or f"sqlite:///{out_dir / 'study.db'}", config.trials)
        on_phase = lambda words: emit("phase", words)  # noqa: E731
        gate = _accuracy_gate(config, device, space, out_dir, study, info, prestart=prestart, on_phase=on_phase)
        emit("start", {"space": space, "probe": info, "out_dir": out_dir, "study": study,
                       "recovered": recovered, "done": len(counted_trials(study)), "config": config})
        stop_rule = StopRule(config, shared, started, emit, compile_prior_s=compile_prior_s(info))
        stop_rule.gate = gate
        fits_in = fit_limit_bytes(limit, _device_memory_bytes(device, info))
        planner = _planner(config, space, stop_rule, target, fits_in, _deadline(config, started))
        objective = _objective(config, device, info, space, out_dir, started, target=target, gate=gate,
                               prestart=prestart, limit=limit, on_phase=on_phase, stop_rule=stop_rule, planner=planner)
        feeder = Feeder(planner, stop_rule, slots=len(gpu_pool) if gpu_pool else 1,
                        proposers=_proposers(config, space, target, fits_in, info))
        artifacts = Artifacts(out_dir)  # each trial's log and trace, for optuna-dashboard
        if tracking is not None:
            tracking.start(study, config.command)
        _warm(study, stop_rule, feeder)
        interrupted = _optimize(config, study, artifacts.wrap(objective), shared, gpu_pool,
                                [feeder] + ([tracking] if tracking is not None else []), started, feeder)
        if gate is not None and interrupted is None:
            # the recommendation must have passing accuracy evidence: check the fastest trials that have none,
            # fastest first, until one passes, within the budget (one left unchecked says so: export)
            t = time.time()
            gate.ensure_recommendation(study, deadline=_deadline(config, started))
            phases["final accuracy checks"] = time.time() - t
        t = time.time()
        emit("phase", "writing config.json, trials.csv and the report")
        files = write_outputs(study, out_dir, config, space, info, device)
        artifacts.attach_outputs(study, files)
        cache = _keep_for_the_next_search(config, study, out_dir, device, info, limit)
        if tracking is not None:
            tracking.finish(study, files, interrupted=interrupted is not None)
        phases["export"] = time.time() - t
        emit("end", None)
        if interrupted is not None:
            raise interrupted
        return SearchResult(study=study, out_dir=out_dir, space=space, probe=info, elapsed_s=time.time() - started,
                            new_trials=stop_rule.new_trials, files=files, phases=phases, cache=cache)
    finally:
        if tracking is not None:
            tracking.close("FAILED")  # ended by an error: the search's run says so (no-op once finished)
        discard_spares()
        GpuPool.deactivate()
        logged.close()
        lock.release()


def _warm(study: optuna.Study, stop_rule: StopRule, feeder: Feeder) -> None:
    """Hand the trials earlier searches measured (autotune.search.warm), where the study starts with such
    trials, to the feeder's proposers, whose candidates it puts in the queue; the stop rule learns from
    them what a trial costs here."""
    stop_rule.walls.extend(warm_walls(study))
    propose_from_evidence(study, feeder.propose)


def _keep_for_the_next_search(config: SearchConfig, study: optuna.Study, out_dir: Path, device: str,
                              info: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """What this search measured, kept to start the next search of the same workload here (autotune.search.warm);
    autotune's cache trimmed to --cache-limit. Returns the cache's figures (autotune.cache.trim_cache)."""
    remember(study, out_dir, evidence_key(config, device, info, limit), judged_by(config))
    return trim_cache(config.cache_limit)


def _check_before_device_time(config: SearchConfig) -> tuple[str, bool, optuna.storages.BaseStorage | None, Goal]:
    """Settle the budget and refuse what cannot run, before any device time. Returns the device,
    whether trial workers prestart, the user's --storage (opened; None: the folder's own) and the
    objective."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    check_spec(config.workload)
    device = resolve_device(config.device)
    check_ddp(config, device)
    prestart = _prestart_workers(config, device)
    GpuPool.check_device(config.gpus, device)  # --gpus on a CPU: refused before any device time
    # before any device time: the folder (or, by default, runs/) must take the results
    check_writable(Path(config.out_dir) if config.out_dir else DEFAULT_OUT)
    # a user's storage URL is checked (and its tables created) before any device time
    storage = open_storage(config.storage) if config.storage else None
    target = goal(config.objective)
    if target.needs_nvml and device != "cuda":  # known before the probe: refuse at once
        raise ConfigError(nvml_refusal(device, None))
    return device, prestart, storage, target


def _fit(config: SearchConfig, device: str, info: dict[str, Any], phases: dict[str, float], *, spare: bool
         ) -> SearchSpace:
    """The search space, fitted before any trial: the memory probe (autotune.search.fit) measures what
    the model needs at small batches, which sizes every trial before it starts; where the base batch
    does not fit, the batch range goes down to 1. The probe's findings go into ``info``."""
    space = build_space(config, device, info)
    fit = probe_fit(config, device, space, info, memory_limit_bytes(config, device, info), spare=spare)
    if widen_to_fit(config, space, fit):  # the batches from 1: the space the study records
        space = build_space(dataclasses.replace(config, min_batch_size=1), device, info)
    if fit is not None:
        info["memory_probe"] = {**fit.probed, "plain_recipe_batch": plain_recipe_batch(space, fit)}
        phases["memory probe"] = fit.probed.get("seconds") or 0.0
    return space


def _proposers(config: SearchConfig, space: SearchSpace, target: Goal, fits_in: int | None,
               info: dict[str, Any]) -> list[Callable]:
    """What proposes candidates for the planner after each trial (the queue's Feeder puts them in the
    queue, in this order): the seed feeder; the fastest eager configuration compiled; the plain recipe
    grown to the batch that fits, then its neighbours (one knob changed; the memory knobs under a cap)
    (not under --replay: it measures an earlier search's configurations as they were)."""
    if config.replay:
        return [SeedFeeder()]
    return [SeedFeeder(), CompileFinalist(space, target.maximize), GrowToFit(space, fits_in), Neighbours(space, fits_in)]


def _planner(config: SearchConfig, space: SearchSpace, stop_rule: StopRule, target: Goal, fits_in: int | None,
             end: float | None) -> Planner:
    """One place decides what runs next, from the whole picture (autotune.search.planner): asked by the
    queue (autotune.search.queue, whose Feeder puts the proposers' candidates in it after each trial: see
    ``_proposers``) which candidate runs next, by the stop rule what the next trial costs and by the
    objective whether a trial is predicted to be overtaken (then not checked for accuracy); under --replay
    it runs the queue in its order."""
    planner = Planner(space, maximize=target.maximize, limit_bytes=fits_in, walls=stop_rule.walls,
                      compile_prior_s=stop_rule.compile_prior_s, deadline=end, unit=target.unit,
                      queue_order=bool(config.replay))
    stop_rule.planner = planner
    return planner


def _mlflow_log(config: SearchConfig):
    """--mlflow: the search's MLflow log (autotune.search.mlflow_log.MlflowLog), its store opened;
    None without --mlflow (mlflow is then never imported)."""
    if config.mlflow is None:
        return None
    from autotune.search.mlflow_log import MlflowLog

    return MlflowLog(config.mlflow)


def _prestart_workers(config: SearchConfig, device: str) -> bool:
    """Whether each trial's worker starts while the previous trial runs: config.prestart_workers,
    else $AUTOTUNE_PRESTART (autotune.trial.runner.prestart_setting), else on a GPU without --ddp."""
    if config.prestart_workers is not None:
        return config.prestart_workers
    setting = prestart_setting()
    return setting if setting is not None else device == "cuda" and not config.ddp


def _start_fork_server(config: SearchConfig, device: str) -> None:
    """Where trials fork (a CPU, autotune.trial.runner.forks) and ``--device auto`` probed in a worker
    of its own: the trials' fork server imports now, while the study is set up (a no-op where the
    probe was forked from it already)."""
    warm = {"workload": config.workload.to_dict(), "device": device}
    if forks(warm) and config.ddp is None:
        start_spare(warm)


def _warn_without_nvml(config: SearchConfig, device: str, info: dict[str, Any]) -> None:
    """Say so when profiled GPU trials will lack NVML's figures (energy, power, clocks, throttling)."""
    nvml = info.get("nvml") or {}
    if device == "cuda" and config.profile and nvml.get("available") is False:
        # stacklevel: shown at the line that called run_search
        warnings.warn(f"NVML is not usable here ({nvml.get('reason')}): energy, power, clock and throttling "
                      "figures are missing; everything else is measured", stacklevel=3)


def _slug(config: SearchConfig, device: str, info: dict[str, Any]) -> str:
    """The device part of the default output folder's and study's names: "h200", "cpu", "h200-ddp2"."""
    slug = device_slug(info["provenance"], device)
    if config.ddp:
        # a study of N-process DDP steps never mixes with single-process ones (nor another N):
        # its own folder and study name by default, and refused on resume (study.prepare_study)
        slug = f"{slug}-ddp{config.ddp}"
    return slug


def _deadline(config: SearchConfig, started: float) -> float | None:
    """When trials and checks must be done (time.time()): the budget less the export's reserve
    (autotune.search.budget.deadline); None without --budget."""
    return deadline(config, started)


def _accuracy_gate(config: SearchConfig, device: str, space: SearchSpace, out_dir: Path, study: optuna.Study,
                   info: dict[str, Any], *, prestart: bool = False, on_phase: Callable[[str], None] | None = None):
    """The accuracy check's gate, attached to the study, telling the live line what it does (``on_phase``);
    None when the check is off."""
    if not config.accuracy_check:
        return None
    from autotune.accuracy.study.gate import AccuracyGate
    from autotune.accuracy.study.parity_gate import ParityGate

    # without --accuracy-steps the check's steps are planned from the first measured step time to
    # fit in --accuracy-share of the budget; the FP32 reference comes from the file cache when kept
    common = {"space": space, "workload": config.workload.to_dict(), "timeout_s": config.trial_timeout_s,
              "log_dir": out_dir / "logs", "budget_s": config.budget_s, "share": config.share_of_budget,
              "scale_steps": config.accuracy_steps is None, "prestart": prestart}
    if config.accuracy_method == "parity":
        gate = ParityGate(settings=config.parity_settings(), **common)
    else:
        gate = AccuracyGate(settings=config.accuracy_settings(device), **common,
                            held_out=not (info.get("own_batches") and config.data is None))
    gate.on_phase = on_phase
    gate.attach(study)
    return gate


def _device_memory_bytes(device: str, info: dict[str, Any]) -> int | None:
    """The GPU's memory, from the probe; None on a CPU."""
    return info["provenance"].get("gpu_memory_bytes") if device == "cuda" else None


def _objective(config: SearchConfig, device: str, info: dict[str, Any], space: SearchSpace, out_dir: Path,
               started: float, *, target: Goal, gate, prestart: bool, limit: int | None,
               on_phase: Callable[[str], None], stop_rule: StopRule, planner: Planner) -> Objective:
    """What each trial runs: its worker's request settings, its deadline, and how its value is judged; built
    whole, with the stop rule's measured walls and the planner it asks."""
    return Objective(accuracy=gate, space=space, workload=config.workload.to_dict(), measure=config.measure_settings(device).to_dict(),
                     input_on_device=config.input_on_device, seed=config.seed, data=config.data,
                     trial_timeout_s=config.trial_timeout_s, log_dir=out_dir / "logs",
                     deadline=_deadline(config, started),
                     profile=config.profile, steer=config.steer, goal=target,
                     early_stop_below=config.early_stop_below if target.name == "throughput" else 0.0,
                     misaligned=(info.get("misaligned") or {}).get("8"),
                     prestart_workers=prestart,
                     memory_limit_bytes=limit, device_memory_bytes=_device_memory_bytes(device, info),
                     on_phase=on_phase, walls=stop_rule.walls, compile_prior_s=stop_rule.compile_prior_s,
                     planner=planner)


def _optimize(config: SearchConfig, study: optuna.Study, objective: Callable[[optuna.Trial], float],
              shared: SharedStudy, gpu_pool: GpuPool | None, callbacks: list[Callable], started: float,
              feeder: Feeder) -> KeyboardInterrupt | None:
    """Run trials until the stop rule (asked by ``feeder``, one of ``callbacks``, Optuna's after each trial)
    or the time left of the budget ends them, the queue's choice fed to Optuna before the first; a Ctrl-C
    or SIGTERM is returned, not raised, so what was measured is still exported."""
    remaining = None if config.trials is None else config.trials - len(counted_trials(study))
    interrupted = None
    if remaining is None or remaining > 0:
        end = _deadline(config, started)
        timeout = None if end is None else max(1.0, end - time.time())
        try:
            # --gpus: Optuna's own parallel loop, a thread (and a GPU) per trial in flight
            guarded = shared.guard(objective)
            feeder.feed(study)
            study.optimize(gpu_pool.wrap(guarded) if gpu_pool else guarded, n_trials=None, timeout=timeout,
                           n_jobs=len(gpu_pool) if gpu_pool else 1, callbacks=callbacks,
                           catch=(TrialFailed,), gc_after_trial=False, show_progress_bar=False)
        except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: what was measured is still exported
            interrupted = exc
        else:
            if stop.requested():  # asked after the last trial, and swallowed
                interrupted = KeyboardInterrupt()
        finally:
            if interrupted is not None:
                discard_spares()
            # else the worker started for the next trial is kept for the recommendation's accuracy check (a
            # fresh one took a third of a 1B Llama's), until the search ends (run_search's finally)
    return interrupted
