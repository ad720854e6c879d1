"""One trial: sample the strategies, run the plan in a fresh worker, record what it measured."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

import strategies
from autotune import stop
from autotune.search.outputs import compile_archive_name, prune_compile_archives
from autotune.search.queue import Candidate, TrialFailed, prune, put, requeue, trials
from autotune.search.screening import missing_eager_twin, screen_eagerly
from autotune.search.trials import planned_params
from autotune.search.walls import cached_compile_saving, cut_floors, expected_wall, trial_cost_s
from autotune.trial.instruments import cache_outcome
from autotune.trial.record import TrialRecord, copy, write
from autotune.trial.runner import run_worker
from strategies.compile import COMPILE_ALLOWANCE_S

BASELINE_MIN_STEPS = 8
"""Timed steps the FP32 baseline needs at least (a trial's default is 20; the 2 s of timed time and the
spread's re-measure still hold): its figure is the denominator of every speed-up, not a candidate
that must be told from a close runner-up, and an FP32 step is slow: 20 of them took about half of the
baseline's trial."""

# trial user attributes that hold a result; copied verbatim when a configuration repeats
RESULT_ATTRS = ("status", "reason", "figures", "knobs", "timing", "energy", "profile", "findings", "screening")


def fit_limit_bytes(memory_limit_bytes: int | None, device_memory_bytes: int | None) -> int | None:
    """What a configuration must fit in: the memory limit, else the GPU's memory (None on a CPU)."""
    return memory_limit_bytes or device_memory_bytes


class Objective:
    """Callable for ``study.optimize``: returns the objective's value (samples/s by default,
    joules per sample or peak memory bytes; see autotune.search.goal), or prunes with a reason."""

    def __init__(self, *, space, workload: dict[str, Any], measure: dict[str, Any], input_on_device: bool,
                 seed: int, trial_timeout_s: float, log_dir: Path | None = None,
                 deadline: float | None = None, accuracy=None, profile: bool = True,
                 misaligned: list[str] | None = None, steer: bool = True, goal=None,
                 data: str | None = None, prestart_workers: bool = False,
                 memory_limit_bytes: int | None = None, device_memory_bytes: int | None = None,
                 early_stop_below: float = 0.0, on_phase: Callable[[str], None] | None = None,
                 screen_compiles: bool = True, walls: list[tuple[float, bool]] | None = None,
                 compile_prior_s: float = 0.0, planner=None) -> None:
        from autotune.search.goal import goal as goal_named

        self.space = space
        self.workload = workload
        self.measure = measure
        self.input_on_device = input_on_device
        self.seed = seed
        self.trial_timeout_s = trial_timeout_s
        self.log_dir = log_dir
        self.deadline = deadline
        """Wall-clock time (time.time()) at which the search budget ends; a trial still running
        then is stopped, so --budget is a limit and not a hint."""
        self.accuracy = accuracy
        """An autotune.accuracy.study.gate.AccuracyGate, or None when the accuracy check is off."""
        self.profile = profile
        """Profile each trial (on a GPU) in a short window after the timed one."""
        self.misaligned = list(misaligned or [])
        """Layers whose widths are not multiples of 8 (from the probe), for the findings."""
        self.steer = steer
        """Queue the configurations the findings suggest."""
        self.goal = goal or goal_named(None)
        """What a trial's value is (autotune.search.goal.Goal); throughput when not given."""
        self.data = data
        """--data: the timed steps are fed by a DataLoader over it (the dataloader knob); None:
        ready-made batches."""
        self.prestart_workers = prestart_workers
        """Start the next trial's worker while this one runs (autotune.trial.runner: spare workers)."""
        self.memory_limit_bytes = memory_limit_bytes
        """--memory-limit (less --memory-headroom): each worker caps its device memory at this."""
        self.device_memory_bytes = device_memory_bytes
        """The GPU's memory (from the probe); None on a CPU."""
        self.on_phase = on_phase
        """Hears what the running trial does, in words ("#5 compiling, 35 s"), for the live line."""
        self.early_stop_below = early_stop_below
        """A trial whose warm-up runs below this share of the best throughput so far is stopped
        (multi-fidelity screening); 0: never."""
        self.screen_compiles = screen_compiles
        """Compile a configuration only once its eager twin ran among the fastest
        (autotune.search.screening); replayed trials are measured as they were either way."""
        self.walls = walls
        """This run's measured trial walls ``(seconds, compiled)`` (the stop rule's), which tell
        whether a compiled trial can still end within the budget; None: not judged."""
        self.compile_prior_s = compile_prior_s
        """What a first compile is expected to cost (autotune.search.budget.compile_prior_s)."""
        self.planner = planner
        """The search's planner (autotune.search.planner): a trial that a queued candidate is predicted
        to overtake is not checked for accuracy while it runs; None: every trial near the frontier is."""

    @property
    def fit_limit_bytes(self) -> int | None:
        """What a configuration must fit in: the memory limit, else the GPU's memory."""
        return fit_limit_bytes(self.memory_limit_bytes, self.device_memory_bytes)

    def __call__(self, trial: optuna.Trial) -> float:
        stop.check()  # asked to stop between trials, where the interrupt may have been swallowed
        knobs = strategies.sample(trial, self.space)
        write(trial, knobs=strategies.knobs_to_dict(knobs))
        previous = self._same_params(trial)
        if previous is not None:
            return self._reuse(trial, previous)
        self._prune_what_cannot_run(trial)
        self._prune_if_it_cannot_fit(trial)
        self._prune_if_its_numerics_fail(trial)
        # the plain recipe is measured as a user runs it, compiled, with no eager twin first, and so
        # are its neighbours: one knob from it, ranked from it (autotune.search.neighbours)
        if self.screen_compiles and not _ranked_from_the_bar(TrialRecord.of(trial)):
            screen_eagerly(trial, self.space, compile_mode=knobs["compile"].mode, maximize=self.goal.maximize,
                           unit=self.goal.unit)
        self._skip_a_compile_past_the_budget(trial, knobs)
        request = self._request(trial, knobs)
        log_path = self.log_dir / f"trial-{trial.number:04d}.log" if self.log_dir else None
        # a compile trial spends minutes compiling before its first step: not a hang
        timeout = self.trial_timeout_s + COMPILE_ALLOWANCE_S[knobs["compile"].mode]
        end = self._trials_end(trial.study)
        cut_by_budget = end is not None and end - time.time() < timeout
        if cut_by_budget:
            timeout = max(1.0, end - time.time())
        try:
            said = None if self.on_phase is None else (lambda words, n=trial.number: self.on_phase(f"#{n} {words}"))
            result = run_worker(request, timeout_s=timeout, log_path=log_path, spare=self.prestart_workers,
                                on_progress=said)
        except KeyboardInterrupt:
            # the search was stopped (Ctrl-C, SIGTERM): this configuration is not at fault and
            # the next run measures it again
            write(trial, reason="the search was interrupted during this trial; re-queued for the next run")
            requeue(trial.study, trial)
            raise
        if result["status"] == "timeout" and cut_by_budget:
            # not the configuration's fault: no "status", so it is not counted, and a resumed
            # search may measure it again
            write(trial, reason=f"the search budget ran out {timeout:.0f} s into this trial; "
                                          "re-queued for the next run", cut_after_s=round(timeout, 1))
            requeue(trial.study, trial)
            raise TrialFailed(f"trial {trial.number} stopped at the end of the search budget")
        self._record(trial, result)
        return self._conclude(trial, result["status"], result.get("reason"), result.get("figures"),
                              traceback=result.get("traceback") or result.get("log_tail"))

    def _reuse(self, trial: optuna.Trial, previous: optuna.trial.FrozenTrial) -> float:
        """Conclude ``trial`` with the result of ``previous``, an earlier trial of the same parameters."""
        # Optuna may propose a configuration again (small categorical spaces): re-measuring
        # costs time and, for a failing one, repeats the failure; reuse the measured result
        copy(previous, trial, RESULT_ATTRS)
        write(trial, duplicate_of=previous.number)
        before = TrialRecord.of(previous)
        return self._conclude(trial, before.status, before.reason, before.figures or None)

    def _prune_if_its_numerics_fail(self, trial: optuna.Trial) -> None:
        """Prune, unstarted, a configuration whose numerics failed their accuracy check: already, or in
        a check made before it runs where that costs less than running it (autotune.search.precheck)."""
        from autotune.search.precheck import verdict_before_running

        found = verdict_before_running(self, trial)
        if found is None:
            return
        reason, accuracy = found
        trial.set_constraint("accuracy", accuracy["constraint"])
        prune(trial, reason, accuracy=accuracy)

    def _prune_what_cannot_run(self, trial: optuna.Trial) -> None:
        """Prune, unstarted and uncounted, a configuration whose pinned attention backend cannot run:
        known beforehand (strategies.attention.cannot_run), or failed in this study already with
        attention in the same dtype (a backend refuses a model's head size, mask or dropout alike
        in every configuration that hands it the same inputs)."""
        from strategies.attention import attention_dtype, cannot_run

        knobs = TrialRecord.of(trial).knobs
        backend = (knobs.get("attention") or {}).get("backend", "default")
        if backend == "default":
            return
        dtype = attention_dtype(knobs)
        records = map(TrialRecord.of, trial.study.get_trials(deepcopy=False, states=(TrialState.FAIL,)))
        failed = (r for r in records if (r.reason or "").startswith("BackendFailed")
                  and r.knob("attention", "backend") == backend and attention_dtype(r.knobs) == dtype)
        reason = cannot_run(knobs, self.space.device)
        if reason is None and (before := next(failed, None)) is not None:
            reason = (f"not run: #{before.number} pinned the same attention backend with attention in {dtype}, "
                      "and it could not run this model's attention")
        if reason is not None:
            prune(trial, reason)

    def _prune_if_it_cannot_fit(self, trial: optuna.Trial) -> None:
        """Prune, unmeasured, a configuration the memory model says does not fit, and back it off."""
        from autotune.search.memory import MemoryModel, batch_of

        record = TrialRecord.of(trial)
        verdict = MemoryModel.from_study(trial.study, self.fit_limit_bytes).verdict(record.knobs)
        if (verdict or "").startswith("predicted") and record.role == "baseline" \
                and batch_of(record.knobs) == min(self.space.batch_sizes):
            # the FP32 baseline at the smallest batch is measured whatever the prediction: every figure
            # is compared with it, and out of memory there is the result (the search then says so); a
            # prediction near the limit can be wrong, and without the baseline nothing has a speed-up
            return
        if verdict is not None:
            # not run, and not counted (no "status"): the sampler learns the region from the pruned
            # trial, and the configuration is queued at a batch that fits
            write(trial, reason=verdict, predicted_oom=True)
            self._queue_back_off(trial)
            prune(trial, verdict)

    def _trials_end(self, study: optuna.Study) -> float | None:
        """Where the trials' time ends: the budget's, less the seconds the recommendation's accuracy verdict
        needs while the best trial has none (the gate's verdict_reserve_s, which the stop rule keeps too): a
        trial that runs long is cut there, not the verdict (a 1B Llama's fp8 compile ran 88 s into them)."""
        if self.deadline is None or self.accuracy is None:
            return self.deadline
        return self.deadline - self.accuracy.verdict_reserve_s(study)

    def _skip_a_compile_past_the_budget(self, trial: optuna.Trial, knobs: dict[str, Any]) -> None:
        """Prune, unstarted, a compiled configuration expected to end past the budget while an eager
        trial still fits, its eager twin (the same knobs, compile off) proposed in its place where none
        is measured or queued: the end of a budget goes to trials that can finish, not to a compile
        cut short."""
        end = self._trials_end(trial.study)
        if end is None or not self.walls or knobs["compile"].mode == "off":
            return  # no trial measured yet: nothing says what one takes
        left = end - time.time()
        trials = trial.study.get_trials(deepcopy=False)
        done = [(dict(t.params), TrialRecord.of(t).timing) for t in trials if t.state == TrialState.COMPLETE]
        need = trial_cost_s(self.walls, knobs["compile"].mode, knobs["precision"].mode, self.compile_prior_s,
                            saved_s=cached_compile_saving(dict(trial.params), done), floors=cut_floors(trials))
        if need <= left or expected_wall(self.walls, False) > left:
            return  # it fits; or nothing does, and the stop rule ends the search
        measured = "" if any(c for _, c in self.walls) else " (no compiled trial measured yet: an estimate)"
        text = (f"not started: a compiled trial takes about {need:.0f} s here{measured} and {left:.0f} s of "
                "the budget are left; its eager twin is measured instead")
        prune(trial, text, instead=missing_eager_twin(trial, self.space, rule="budget"))

    def _measure_of(self, trial: optuna.Trial) -> dict[str, Any]:
        """What the trial's worker times: the search's settings, at most BASELINE_MIN_STEPS for the baseline."""
        if TrialRecord.of(trial).role != "baseline" or not self.measure:
            return self.measure
        return {**self.measure, "min_steps": min(self.measure.get("min_steps", BASELINE_MIN_STEPS), BASELINE_MIN_STEPS)}

    def _request(self, trial: optuna.Trial, knobs: dict[str, Any]) -> dict[str, Any]:
        """The trial worker's request: the configuration, what to measure, where to write its trace."""
        request = {
            "mode": "trial",
            "space": self.space.to_dict(),
            "knobs": strategies.knobs_to_dict(knobs),
            "workload": self.workload,
            "measure": self._measure_of(trial),
            "input_on_device": self.input_on_device,
            "seed": self.seed,
            "profile": self.profile,
        }
        if self.data is not None:
            request["data"] = self.data
        if self.memory_limit_bytes:
            request["memory_limit_bytes"] = self.memory_limit_bytes
        batch = knobs["batch_size"].batch_size
        if (strategies.batch_size.BATCH_SIZE_PARAM in trial.params and knobs["compile"].mode == "off"
                and not knobs["cuda_graphs"].enabled and self.space.ddp_world_size == 1 and self.data is None):
            # out of memory: the worker looks for the largest smaller batch that fits (eager steps
            # only: no recompile, no graph capture), and the search measures that next
            request["fit_probe"] = [b for b in self.space.batch_sizes if b < batch]
        bar = self._early_stop_bar(trial)
        if bar is not None:
            request["prune_below"] = bar
        if self.profile and self.log_dir:
            request["trace_path"] = str(self.log_dir / f"trace-{trial.number:04d}.json")
        if knobs["compile"].mode != "off" and self.log_dir:
            # its compile, kept beside config.json if it is recommended; logs/ keeps only the best few
            request["compile_cache_path"] = str(self.log_dir / compile_archive_name(trial.number))
            prune_compile_archives(trial.study, self.log_dir)
        return request

    def _early_stop_bar(self, trial: optuna.Trial) -> float | None:
        """The samples/s below which this trial's warm-up stops it: ``early_stop_below`` of the best
        recommendable throughput so far. None for the FP32 baseline and the plain recipe (every
        figure is compared with them), under --ddp and --data (their rate is only known after the
        timed window), and before anything was measured."""
        from autotune.search.trials import best_trial

        bars = TrialRecord.of(trial).role in ("baseline", "plain-recipe")
        if not self.early_stop_below or bars or self.data is not None or self.space.ddp_world_size > 1:
            return None
        best = best_trial(trial.study)
        return None if best is None or not best.value else self.early_stop_below * best.value

    def _record(self, trial: optuna.Trial, result: dict[str, Any]) -> None:
        """Store what the worker measured on the trial; back off one that did not fit, explain one that ran."""
        figures = result.get("figures")
        timing = {"worker_start_s": result.get("worker_start_s"), "wall_s": result["wall_s"]}
        if figures:
            timing.update(warmup_s=figures.get("warmup_s"), measure_s=figures.get("measure_s"),
                          build_s=figures.get("build_s"), compile_s=figures.get("compile_s", 0.0))
            if cached := cache_outcome(figures.get("compile_cache")):
                timing["compile_cache"] = cached  # "hit": its compile was loaded, not redone
        screening = result.get("screening")
        if screening:
            timing.update(warmup_s=screening.get("warmup_s"), build_s=screening.get("build_s"))
            write(trial, screening=screening)
        write(trial, timing=timing)
        write(trial, status=result["status"])
        if result.get("reason"):
            write(trial, reason=result["reason"])
        if figures:
            write(trial, figures=figures)
        fit = result.get("fit") or {}
        if fit.get("peaks"):
            write(trial, fit_peaks=fit["peaks"])
        if fit.get("does_not_fit_at"):
            write(trial, fit_oom_batch=fit["does_not_fit_at"])
        if result["status"] == "oom":
            self._queue_back_off(trial, fits_at=fit.get("fits_at"))
        if result["status"] == "ok":
            self._explain(trial, result)

    def _queue_back_off(self, trial: optuna.Trial, fits_at: int | None = None) -> None:
        """Put the back-off's candidate (``_back_off``) in the queue and record its batch on the trial."""
        backoff = self._back_off(trial, fits_at=fits_at)
        if backoff is not None:
            put(trial.study, backoff)
            write(trial, backed_off_to=backoff.params[strategies.batch_size.BATCH_SIZE_PARAM])

    def _back_off(self, trial: optuna.Trial, fits_at: int | None = None) -> Candidate | None:
        """This configuration at the largest batch that can fit (``fits_at``, as the worker found it,
        unless its probe came too close to the limit; else the memory model's choice), as a candidate
        keeping its role: the FP32 baseline backs off as a baseline, so there always is one. None for a
        pinned batch size, or a configuration already measured, running or queued at that batch."""
        from autotune.search.memory import MemoryModel

        if strategies.batch_size.BATCH_SIZE_PARAM not in trial.params:
            return None
        knobs = TrialRecord.of(trial).knobs
        model = MemoryModel.from_study(trial.study, self.fit_limit_bytes)
        batch = model.backoff_batch(knobs, self.space.batch_sizes, fits_at=fits_at)
        if batch is None:
            return None
        params = {**trial.params, strategies.batch_size.BATCH_SIZE_PARAM: batch}
        for other in trials(trial.study):
            if planned_params(other) == params:
                return None
        record = TrialRecord.of(trial)
        role = record.role
        # the baseline is measured next, not after the seeds: every figure is compared with it. A
        # neighbour of the plain recipe keeps what steered it, so it is still ranked from the bar and
        # not screened eagerly: a move sized down would otherwise wait for an eager twin that the
        # planner predicts below the compiled bar
        return Candidate.of(params, role=role if role == "baseline" else "backed-off", backoff_of=trial.number,
                            **({"urgent": True} if role == "baseline" else {}),
                            **({"steered_by": record.steered_by} if record.steered_by else {}))

    def _explain(self, trial: optuna.Trial, result: dict[str, Any]) -> None:
        """Record the trial's NVML and profile figures and the findings they support, and put the
        configurations the findings suggest (steering's candidates) in the queue."""
        from autotune.search.findings import derive
        from autotune.search.steering import offered, steer

        energy, profile, figures = result.get("energy"), result.get("profile"), result.get("figures") or {}
        if result.get("profile_error"):
            write(trial, profile_error=result["profile_error"])
        if energy:
            write(trial, energy=energy)
        if profile:
            write(trial, profile=profile)
        findings = derive(profile, energy, TrialRecord.of(trial).knobs, misaligned=self.misaligned,
                          offered=offered(self.space), figures=figures)
        if not findings:
            return
        write(trial, findings=[f.text for f in findings])
        write(trial, finding_rules=[f.to_dict() for f in findings])
        if self.steer and figures.get("loss_finite", True):
            steered = put(trial.study, steer(trial.study, trial, findings, self.space))
            if steered:
                write(trial, steered=[c.params for c in steered])

    def _conclude(self, trial: optuna.Trial, status: str | None, reason: str | None,
                  figures: dict[str, Any] | None, traceback: str | None = None) -> float:
        if status == "ok" and figures:
            if not figures.get("loss_finite", True):
                write(trial, unstable=True)
            value = self.goal.value(figures, TrialRecord.of(trial).energy)
            if value is None:
                text = (f"measured, but without the {self.goal.unit} that --objective {self.goal.name} ranks by "
                        "(NVML gave no energy reading for this trial)")
                write(trial, reason=text)
                raise TrialFailed(f"trial {trial.number}: {text}")
            self._check_accuracy(trial, value)
            return value
        if status == "pruned":
            # screened out in its warm-up: its windows are Optuna's intermediate values, so the
            # sampler ranks it below the completed trials by how slow it ran
            for step, rate in enumerate((TrialRecord.of(trial).screening or {}).get("windows", [])):
                trial.report(rate, step)
            prune(trial, reason)
        if status == "oom":
            batch = TrialRecord.of(trial).batch_size
            # PRUNED, not FAIL: Optuna's samplers learn from pruned trials (ranked below every
            # completed one), so the region that does not fit stops being proposed
            prune(trial, f"does not fit at batch {batch}: {reason}")
        raise TrialFailed(f"trial {trial.number} {status}: {reason}" + (f"\n{traceback}" if traceback else ""))

    def _check_accuracy(self, trial: optuna.Trial, value: float) -> None:
        """Attach accuracy evidence: reused when the numerics key was checked, measured when the
        trial is on or near the speed frontier; its constraint steers the sampler (Optuna 5's
        Trial.set_constraint; a trial without one counts as feasible)."""
        from autotune.accuracy.settings import UNSTABLE_CONSTRAINT

        if self.accuracy is None:
            return
        if TrialRecord.of(trial).unstable:
            trial.set_constraint("accuracy", UNSTABLE_CONSTRAINT)
            return
        check = self.accuracy.near_frontier(trial.study, value)
        timeout = None
        if self.deadline is not None:
            left = self.deadline - time.time()
            check = check and left > 5
            timeout = min(self.accuracy.timeout_s, max(1.0, left))
            if check and (self._fp32(trial) or self._bar(trial) or self._overtaken(trial, value)):
                check = False
        try:
            accuracy = self.accuracy.evidence(trial.study, TrialRecord.of(trial).knobs, check=check, timeout_s=timeout,
                                              label=f"#{trial.number}")
        except KeyboardInterrupt:
            write(trial, reason="the search was interrupted during this trial's accuracy check; "
                                          "re-queued for the next run")
            requeue(trial.study, trial)
            raise
        if accuracy is not None:
            write(trial, accuracy=accuracy)
            trial.set_constraint("accuracy", accuracy["constraint"])

    @staticmethod
    def _fp32(trial: optuna.Trial) -> bool:
        """Whether the trial has FP32's numerics: its check mid-search would only train the FP32 reference,
        in a worker of its own; the first other configuration's check trains it in its worker, before its
        own run, one worker's set-up and FP32 step less (a large model's reference alone can take half the
        share, leaving the winner's check too little). A reference trained there is kept even where that
        configuration's run fails or is cut. At the end an FP32 recommendation is checked as any other
        (ensure_recommendation)."""
        from autotune.accuracy.settings import numerics_key

        return numerics_key(TrialRecord.of(trial).knobs) == numerics_key({})

    def _bar(self, trial: optuna.Trial) -> bool:
        """Whether the trial is the plain recipe, in a planned search: its neighbours (one knob from it,
        predicted from its figure) are queued after it, where expects_better cannot see them yet: checked
        when measured, the bar would take the share its faster neighbour's check needs. Where nothing beats
        it, it is checked at the end as the recommendation, in the seconds the stop rule keeps for that
        (ParityGate.verdict_reserve_s)."""
        return self.planner is not None and TrialRecord.of(trial).role == "plain-recipe"

    def _overtaken(self, trial: optuna.Trial, value: float) -> bool:
        """Whether the planner expects a queued candidate to overtake this trial: its accuracy check
        would spend the share on a configuration that will not be recommended, and leave the winner
        unchecked (the stop rule keeps the recommendation's verdict its seconds)."""
        if self.planner is None:
            return False
        return self.planner.expects_better(trial.study, value) is not None

    @staticmethod
    def _same_params(trial: optuna.Trial):
        done = trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL))
        for other in done:
            if other.params == trial.params and TrialRecord.of(other).status is not None:
                return other
        return None


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


def _ranked_from_the_bar(record: TrialRecord) -> bool:
    """A trial compiled with no eager twin first: a replayed one (as it ran), the plain recipe, and a
    neighbour of the plain recipe (one knob from its measured, compiled figure)."""
    from autotune.search.neighbours import RULE

    return record.role in ("replayed", "plain-recipe") or (record.steered_by or {}).get("rule") == RULE
