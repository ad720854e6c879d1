"""The study side of the accuracy check: judge a run against the reference (judge), cache the
checks in the study's user attributes (and the FP32 reference across searches: reference_cache),
and decide which trials to check and at how many steps (AccuracyGate, plan). `autotune accuracy`'s
comparison of precision modes is autotune.accuracy.study.compare."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from autotune.accuracy.settings import (
    DIVERGED_FACTOR,
    MAX_SKIPPED_FRACTION,
    NEAR_FRONTIER,
    UNSTABLE_CONSTRAINT,
    AccuracySettings,
    numerics_key,
    numerics_knobs,
)
from autotune.accuracy.study.plan import CHECK_RUNS, CHECKS_ATTR, DEFAULT_SHARE, PLAN_ATTR, step_time
from autotune.accuracy.study.plan import plan as make_plan
from autotune.accuracy.study.reference_cache import ReferenceCache, reference_key
from autotune.trial.record import TrialRecord

# ---------------------------------------------------------------------------------------------
# the verdict


def judge(run: Mapping[str, Any], reference: Mapping[str, Any], *, max_accuracy_drop: float,
          max_loss_drift: float) -> dict[str, Any]:
    """passed / violated / unstable, with a reason in words and the Optuna constraint value
    (<= 0 feasible): the drop beyond the allowed one, in points (or loss drift beyond the allowed)."""
    out: dict[str, Any] = {
        "steps": run.get("steps"),
        "batch_size": run.get("batch_size"),
        "data": run.get("data"),
        "final_loss": run.get("final_loss"),
        "reference_final_loss": reference.get("final_loss"),
        "skipped_steps": run.get("skipped_steps"),
        "retried_steps": run.get("retried_steps"),
        "taken_steps": run.get("taken_steps"),
        "final_scale": run.get("final_scale"),
        "nonfinite_losses": run.get("nonfinite_losses"),
        "numerics": run.get("numerics"),
        "numerics_key": run.get("numerics_key"),
        "max_accuracy_drop": max_accuracy_drop,
        "max_loss_drift": max_loss_drift,
        # "trained" by a check of this study, or "cache": an earlier search's (reference_cache)
        "reference_source": reference.get("reference_source"),
    }
    has_accuracy = run.get("held_out_accuracy") is not None and reference.get("held_out_accuracy") is not None
    if has_accuracy:
        out["accuracy"] = run["held_out_accuracy"]
        out["reference_accuracy"] = reference["held_out_accuracy"]
        out["accuracy_drop"] = reference["held_out_accuracy"] - run["held_out_accuracy"]
        out["held_out_size"] = run.get("held_out_size")
    # a language model's check judges its held-out loss (the teacher's tokens: autotune.accuracy.worker.check)
    held = not has_accuracy and run.get("held_out_loss") is not None and reference.get("held_out_loss") is not None
    key, words = ("held_out_loss", "held-out loss") if held else ("final_loss", "final training loss")
    progress = (reference.get("initial_loss") or 0.0) - (reference.get(key) or 0.0)
    final, ref_final = run.get(key), reference.get(key)
    if final is not None and ref_final is not None and math.isfinite(final):
        # the share of the FP32 run's loss decrease that this run lost (0: as good, 1: learnt nothing)
        out["loss_drift"] = (final - ref_final) / progress if progress > 0 else (final - ref_final) / max(abs(ref_final), 1e-12)

    shuffled = reference.get("reshuffled") or {}
    noise_acc = (abs(reference["held_out_accuracy"] - shuffled["held_out_accuracy"])
                 if has_accuracy and shuffled.get("held_out_accuracy") is not None else 0.0)
    noise_drift = 0.0
    if shuffled.get(key) is not None and ref_final is not None and math.isfinite(shuffled[key]):
        noise_drift = abs(shuffled[key] - ref_final) / progress if progress > 0 else 0.0
    out["fp32_noise"] = {"accuracy_points": noise_acc, "loss_drift": noise_drift}
    unstable = _instability(run) or (f"the held-out loss was {final}" if held and not math.isfinite(final) else None)
    if unstable:
        out.update(verdict="unstable", stable=False, reason=unstable, constraint=UNSTABLE_CONSTRAINT)
        return out
    out["stable"] = True
    if has_accuracy:
        allowed = max_accuracy_drop + noise_acc
        excess = out["accuracy_drop"] - allowed
        noise = f" + {noise_acc:.2f} FP32 reshuffle noise" if noise_acc else ""
        what = (f"held-out accuracy {out['accuracy']:.2f}% vs {out['reference_accuracy']:.2f}% for FP32 "
                f"(drop {out['accuracy_drop']:.2f} points, allowed {max_accuracy_drop:g}{noise}) after "
                f"{run.get('steps')} steps")
    else:
        allowed = max_loss_drift + noise_drift
        excess = out["loss_drift"] - allowed
        noise = f" + {noise_drift:.3f} FP32 reshuffle noise" if noise_drift else ""
        what = (f"{words} {final:.4g} vs {ref_final:.4g} for FP32 (drift {out['loss_drift']:.3f} of "
                f"FP32's loss decrease, allowed {max_loss_drift:g}{noise}) after {run.get('steps')} steps")
    out["allowed"] = allowed
    out["constraint"] = float(excess)
    out["verdict"] = "violated" if excess > 0 else "passed"
    out["reason"] = what
    return out


def _instability(run: Mapping[str, Any]) -> str | None:
    steps = run.get("steps") or 0
    if run.get("nonfinite_losses"):
        return f"the training loss was NaN/Inf in {run['nonfinite_losses']} of {steps} steps"
    if run.get("params_finite") is False:
        return "the weights became NaN/Inf during training"
    # skipped steps taken again on their batch were made in the end (autotune.accuracy.worker.check)
    not_taken = (run.get("skipped_steps") or 0) - (run.get("retried_steps") or 0)
    if not_taken > MAX_SKIPPED_FRACTION * steps:
        return (f"the GradScaler skipped {not_taken} of {steps} steps (gradients overflowed; final "
                f"scale {run.get('final_scale'):g}), so the model barely trained")
    final, initial = run.get("final_loss"), run.get("initial_loss")
    if final is not None and initial is not None and math.isfinite(initial) and final > DIVERGED_FACTOR * initial:
        return f"the training loss diverged ({initial:.4g} at the start, {final:.4g} at the end)"
    return None


def passed(accuracy: Mapping[str, Any] | None) -> bool:
    return bool(accuracy) and accuracy.get("verdict") == "passed"


def failed(accuracy: Mapping[str, Any] | None) -> bool:
    """Violated, unstable, or the check itself failed: never recommended."""
    return bool(accuracy) and accuracy.get("verdict") in ("violated", "unstable", "error")


# ---------------------------------------------------------------------------------------------
# in the study process: when to check, the cache, the recommendation

SETTINGS_ATTR = "accuracy_settings"
METHOD_ATTR = "accuracy_method"
"""How the study's checks judge: "parity" (autotune.accuracy.study.parity_gate), absent for the held-out check."""
UNAVAILABLE_ATTR = "accuracy_unavailable"
REFERENCE_ATTR = "accuracy_reference:{fingerprint}"
RESULT_ATTR = "accuracy_run:{fingerprint}:{key}"


def key_hash(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def study_settings(study):
    """The study's check settings: ParitySettings where its checks are numerics parity, else
    AccuracySettings; None before a check was set up."""
    data = study.user_attrs.get(SETTINGS_ATTR)
    if not data:
        return None
    if study.user_attrs.get(METHOD_ATTR) == "parity":
        from autotune.accuracy.worker.parity import ParitySettings

        return ParitySettings.from_dict(data)
    return AccuracySettings.from_dict(data)


def cached_run(study, settings: AccuracySettings, knobs: Mapping[str, Any]) -> tuple[dict, dict] | None:
    """(run, reference) already measured for this numerics key, or None."""
    attrs = study.user_attrs
    reference = attrs.get(REFERENCE_ATTR.format(fingerprint=settings.fingerprint()))
    if reference is None:
        return None
    key = numerics_key(knobs)
    if key == numerics_key({}):
        return {**reference, "numerics_key": key}, reference
    run = attrs.get(RESULT_ATTR.format(fingerprint=settings.fingerprint(), key=key_hash(key)))
    return (run, reference) if run is not None else None


def accuracy_of(study, trial) -> dict[str, Any] | None:
    """A trial's judged accuracy evidence: its own attribute, else the study's cached check of its
    numerics key (checked after it finished, at export), judged with the study's thresholds."""
    record = TrialRecord.of(trial)
    if record.accuracy:
        return record.accuracy
    settings = study_settings(study)
    knobs = record.knobs
    if settings is None or not knobs:
        return None
    found = cached_run(study, settings, knobs)
    if found is None:
        return None
    run, reference = found
    if "calibration" in reference:  # a parity check's: its runs are stored judged
        from autotune.accuracy.worker.parity_verdict import reference_evidence

        return dict(run) if run.get("method") else reference_evidence(reference, numerics_key=run.get("numerics_key"))
    return judge(run, reference, max_accuracy_drop=settings.max_accuracy_drop, max_loss_drift=settings.max_loss_drift)


def _planned(settings: AccuracySettings, plan: Mapping[str, Any]) -> AccuracySettings:
    """``settings`` at the plan's steps, and at its batch where it fitted one to memory."""
    return dataclasses.replace(settings, steps=int(plan["steps"]),
                               batch_size=int(plan.get("batch_size") or settings.batch_size))


class AccuracyGate:
    """The study side of the check: reuse by numerics key, check near the speed frontier, and
    make sure the recommended configuration has passing evidence. With a budget, the checks cost in
    proportion: their steps are planned from the measured step time (autotune.accuracy.study.plan), and
    during the search they spend at most ``share`` of it; the FP32 reference is trained once per
    workload and device (autotune.accuracy.study.reference_cache)."""

    def __init__(self, *, settings: AccuracySettings, space, workload: dict[str, Any], timeout_s: float,
                 log_dir: Path | None = None, budget_s: float | None = None, share: float = DEFAULT_SHARE,
                 scale_steps: bool = False, cache: ReferenceCache | None = None, held_out: bool = True,
                 prestart: bool = False) -> None:
        self.settings = settings
        self.space = space
        self.workload = workload
        self.timeout_s = timeout_s
        self.log_dir = log_dir
        self.budget_s = budget_s
        """The search's --budget (None: --trials alone): the checks' steps and spending follow it."""
        self.share = share
        """What the checks may spend of ``budget_s`` while trials run (--accuracy-share)."""
        self.scale_steps = scale_steps
        """The steps may be planned (no --accuracy-steps given)."""
        self.pending = scale_steps and budget_s is not None
        """The steps are still to be planned, from the first measured step time, before the first check."""
        self.held_out = held_out
        """The check evaluates a held-out set after training (not for a workload's own batches)."""
        self.prestart = prestart
        """The search's GPU workers prestart: a check takes the spare started for the next trial, and
        starts another (otherwise each check leaves the next trial a worker's start-up)."""
        self.cache = cache if cache is not None else ReferenceCache()
        self.spent_s = 0.0
        """Seconds this run's checks took."""
        self.on_phase = None
        """Hears what a running check does ("accuracy check of #2: FP32 reference 40/100 steps")."""
        self.unavailable: str | None = None
        """Why no configuration can be checked (the FP32 reference failed), or None."""
        self._lock = threading.Lock()
        self._looked_up: set[str] = set()

    def attach(self, study) -> None:
        """Record the settings on the study; the steps are settled here unless they are to be planned."""
        kept = self._kept_steps(study) if self.scale_steps else None
        if kept is not None:
            # a resume checks at the steps (and batch) of the study's earlier runs, so every check compares
            self.settings = _planned(self.settings, {**(study.user_attrs.get(PLAN_ATTR) or {}), "steps": kept})
            self.pending = False
            if not study.user_attrs.get(PLAN_ATTR):
                study.set_user_attr(PLAN_ATTR, {"how": "kept", "steps": kept})
        elif not self.pending:
            how = "default" if self.scale_steps else "explicit"
            study.set_user_attr(PLAN_ATTR, {"how": how, "steps": self.settings.steps})
        study.set_user_attr(SETTINGS_ATTR, self.settings.to_dict())

    @staticmethod
    def _kept_steps(study) -> int | None:
        plan = study.user_attrs.get(PLAN_ATTR) or {}
        if plan.get("steps"):
            return int(plan["steps"])
        old = study_settings(study)
        if old is not None and study.user_attrs.get(REFERENCE_ATTR.format(fingerprint=old.fingerprint())):
            return old.steps  # a study from before plans: its checks ran at these steps
        return None

    def settle(self, study, *, force: bool = False) -> None:
        """Plan the check's steps (autotune.accuracy.study.plan) once a trial was measured, or with
        ``force`` (a check is due) from the default when none was; then they are fixed."""
        if not self.pending:
            return
        with self._lock:  # --gpus: trials conclude in threads
            if not self.pending:
                return
            plan = study.user_attrs.get(PLAN_ATTR)  # another process of a shared study planned first
            if not plan:
                measured = step_time(study)
                if measured is None and not force:
                    return
                plan = self.make_plan(measured) if measured else {"how": "unmeasured", "steps": self.settings.steps}
                study.set_user_attr(PLAN_ATTR, plan)
            self.settings = _planned(self.settings, plan)
            study.set_user_attr(SETTINGS_ATTR, self.settings.to_dict())
            self.pending = False

    def make_plan(self, measured: dict[str, Any]) -> dict[str, Any]:
        """The checks' steps (and batch) from ``step_time``'s figures (autotune.accuracy.study.plan)."""
        return make_plan(self.settings, budget_s=self.budget_s, share=self.share, measured=measured,
                         held_out=self.held_out)

    def judge(self, run: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, Any]:
        return judge(run, reference, max_accuracy_drop=self.settings.max_accuracy_drop,
                     max_loss_drift=self.settings.max_loss_drift)

    def evidence(self, study, knobs: Mapping[str, Any], *, check: bool, timeout_s: float | None = None,
                 within_share: bool = True, label: str = "") -> dict[str, Any] | None:
        """The judged accuracy of ``knobs``: reused when its numerics key was checked, else
        measured in a worker when ``check`` (and, ``within_share``, while the checks have not spent
        their share of the budget), else None."""
        self.settle(study, force=check)
        if not self.pending:
            self._reference(study)  # an earlier search's, from the file cache
        found = cached_run(study, self.settings, knobs)
        if found is None and check and self.unavailable is None:
            timeout = self._timeout(timeout_s, within_share)
            if timeout is not None and within_share and not self._first_verdict_fits(study):
                timeout = None
            if timeout is not None:
                found = self._measure(study, knobs, timeout, label)
        if found is None:
            return None
        run, reference = found
        if run.get("status") == "error":
            return {"verdict": "error", "stable": False, "reason": run["reason"], "constraint": UNSTABLE_CONSTRAINT,
                    "numerics_key": run.get("numerics_key")}
        return self.judge(run, reference)

    def _timeout(self, timeout_s: float | None, within_share: bool) -> float | None:
        """How long the next check may take; None: it is not started (the share is spent)."""
        timeout = timeout_s or self.timeout_s
        if within_share and self.budget_s is not None:
            left = self.share * self.budget_s - self.spent_s
            if left < MIN_CHECK_S:
                return None  # the recommendation is still checked at the end, with what is left
            timeout = min(timeout, left)
        return timeout

    def _first_verdict_fits(self, study) -> bool:
        """Whether, with no FP32 reference yet, the reference and one configuration's check fit in
        what is left of the share (the plan's ``first_verdict_s``). A reference the share cannot
        follow with a check is time taken from the trials for nothing; the trials get that
        time instead, and the recommendation says it was not checked within the budget."""
        if self.budget_s is None or self._reference(study) is not None:
            return True
        need = (study.user_attrs.get(PLAN_ATTR) or {}).get("first_verdict_s") or 0.0
        return self.spent_s + need <= self.share * self.budget_s

    def _reference(self, study) -> dict[str, Any] | None:
        """The FP32 reference of these settings: the study's, else one an earlier search kept in the
        file cache (then the study's too), else None (the next check's worker trains it)."""
        name = REFERENCE_ATTR.format(fingerprint=self.settings.fingerprint())
        reference = study.user_attrs.get(name)
        if reference is not None:
            return reference
        if name in self._looked_up:  # one look a run: a miss is trained by the next check
            return None
        self._looked_up.add(name)
        key = self._cache_key(study)
        reference = self.cache.load(key) if key is not None else None
        if reference is not None:
            reference = {**reference, "reference_source": "cache"}
            study.set_user_attr(name, reference)
        return reference

    def _cache_key(self, study, reference: Mapping[str, Any] | None = None) -> str | None:
        """The file cache's key: of a reference trained here, by the device and torch its worker
        reported; before one is, by this study's device (its probed GPU). None where unknown."""
        if reference is not None:
            device, version = reference.get("device_name"), reference.get("torch")
        else:
            import torch

            gpu = (study.user_attrs.get("provenance") or {}).get("gpu")
            device, version = ("cpu" if self.space.device == "cpu" else gpu), torch.__version__
        if not device or not version:
            return None
        return reference_key(self.workload, self.settings, device_name=device, torch_version=version)

    def _measure(self, study, knobs: Mapping[str, Any], timeout_s: float, label: str = "") -> tuple[dict, dict] | None:
        from autotune.trial.runner import run_worker

        fingerprint = self.settings.fingerprint()
        reference = self._reference(study)
        key = numerics_key(knobs)
        request = {"mode": "accuracy", "workload": self.workload, "space": self.space.to_dict(),
                   "knobs": numerics_knobs(knobs), "settings": self.settings.to_dict(), "reference": reference}
        log = self.log_dir / f"accuracy-{key_hash(key)}.log" if self.log_dir else None
        started, result = time.time(), None
        try:
            said = None
            if self.on_phase is not None:
                said = lambda words: self.on_phase(f"accuracy check{' of ' + label if label else ''}: {words}")  # noqa: E731
            result = run_worker(request, timeout_s=timeout_s, log_path=log, on_progress=said, spare=self.prestart)
        finally:
            self._spent(study, label, key, started, result, timeout_s)
        if self._cut(result, timeout_s):
            return None  # cut by the search budget: not the configuration's fault, check again later
        if result["status"] != "ok":
            run = self._failure(study, result, reference, key, "accuracy check")
            if run is None:
                return None
        else:
            run = result["run"]
            if reference is None:
                reference = self._trained_reference(study, result["reference"])
        if key != numerics_key({}):
            study.set_user_attr(RESULT_ATTR.format(fingerprint=fingerprint, key=key_hash(key)),
                                {**run, "knobs": numerics_knobs(knobs)})
        return run, reference

    def _spent(self, study, label: str, key: str, started: float, result: Mapping[str, Any] | None,
               timeout_s: float, *, trains_reference: bool = False) -> None:
        """Count a check's seconds against the share, and keep how it ended in the study (CHECKS_ATTR):
        ``trains_reference``, a check whose worker trained the FP32 reference before the configuration."""
        seconds = time.time() - started
        self.spent_s += seconds
        status = "cut by the budget" if self._cut(result, timeout_s) else (result or {}).get("status", "interrupted")
        entry = {"label": label or "a check", "fp32": key == numerics_key({}), "seconds": round(seconds, 1),
                 "timeout_s": round(timeout_s, 1), "status": status, **({"trains_reference": True} if trains_reference else {})}
        if (result or {}).get("runs"):
            entry["runs"] = result["runs"]  # a parity worker's runs, each one's seconds by phase
        for name in ("in_worker_s", "worker_start_s"):  # the rest of the seconds: the worker's start and exit
            if (result or {}).get(name) is not None:
                entry[name] = round(result[name], 2)
        with self._lock:
            study.set_user_attr(CHECKS_ATTR, [*(study.user_attrs.get(CHECKS_ATTR) or []), entry])

    def _cut(self, result: Mapping[str, Any] | None, timeout_s: float) -> bool:
        """Whether a check worker timed out because the budget gave it less than a check's own timeout
        (not the configuration's fault: it is checked again later)."""
        return (result or {}).get("status") == "timeout" and timeout_s < self.timeout_s

    def _failure(self, study, result: Mapping[str, Any], reference: Mapping[str, Any] | None, key: str,
                 check: str) -> dict[str, Any] | None:
        """A check worker that did not answer "ok": the configuration's error run, or None where it was
        the FP32 reference that failed (nothing can be judged, and it is not this configuration's
        fault; the search goes on for speed and says so everywhere)."""
        reason = f"the {check} {result['status']}: {result.get('reason')}"
        if reference is not None:
            return {"status": "error", "reason": reason, "numerics_key": key}
        self.unavailable = (f"the FP32 reference of the {check} failed ({reason}); fix --data, "
                            "lower --accuracy-steps, or pass --no-accuracy-check")
        study.set_user_attr(UNAVAILABLE_ATTR, self.unavailable)
        return None

    def _trained_reference(self, study, trained: Mapping[str, Any]) -> dict[str, Any]:
        """A reference a check worker trained: kept for later searches and in the study."""
        self._keep(study, trained)
        reference = {**trained, "reference_source": "trained"}
        study.set_user_attr(REFERENCE_ATTR.format(fingerprint=self.settings.fingerprint()), reference)
        return reference

    def _keep(self, study, reference: Mapping[str, Any]) -> None:
        """Keep a reference trained here for later searches (autotune.accuracy.study.reference_cache)."""
        key = self._cache_key(study, reference)
        if key is not None:
            about = {**self.workload, "data": self.settings.data, "steps": self.settings.steps,
                     "batch_size": self.settings.batch_size, "seed": self.settings.seed,
                     "device": reference.get("device_name"), "torch": reference.get("torch")}
            self.cache.store(key, reference, about)

    def estimate_s(self, study) -> float:
        """About how long the next check takes, from the plan (autotune.accuracy.study.plan): one training
        run, or three when the FP32 reference and its reshuffled twin must be trained first; 0 when
        the steps were not planned from a measured step time."""
        plan = study.user_attrs.get(PLAN_ATTR) or {}
        if plan.get("how") != "scaled" or not plan.get("estimate_s"):
            return 0.0
        per_run = plan["estimate_s"] / CHECK_RUNS
        return per_run if self._reference(study) is not None else 3 * per_run

    def verdict_reserve_s(self, study) -> float:
        """Seconds the trials leave for the recommendation's check: none here (this check spends its
        share while trials run, and the recommendation takes what is left; ParityGate plans one)."""
        return 0.0

    def near_frontier(self, study, value: float) -> bool:
        """Whether an objective value (samples/s, or joules per sample or peak memory, which are
        minimized) is on or near the frontier of what is recommendable."""
        from optuna.study import StudyDirection
        from optuna.trial import TrialState

        maximize = study.direction == StudyDirection.MAXIMIZE
        best = value
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.value is not None and not TrialRecord.of(t).unstable and not failed(accuracy_of(study, t)):
                best = max(best, t.value) if maximize else min(best, t.value)
        return value >= NEAR_FRONTIER * best if maximize else value * NEAR_FRONTIER <= best

    def ensure_recommendation(self, study, deadline: float | None = None):
        """Check the best trials (under the study's objective) without evidence, best first, until
        one passes, while ``deadline`` (time.time(); the search budget's end) leaves time for a
        check. Returns the recommended trial (best with passing evidence) or None."""
        from optuna.study import StudyDirection
        from optuna.trial import TrialState

        done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.value is not None and not (r := TrialRecord.of(t)).unstable and r.knobs]
        for t in sorted(done, key=lambda t: t.value, reverse=study.direction == StudyDirection.MAXIMIZE):
            acc = accuracy_of(study, t)
            if acc is None:
                left = None if deadline is None else deadline - time.time()
                if left is not None and left < max(MIN_CHECK_S, self.estimate_s(study)):
                    return None  # the budget is spent: the export says the numerics were not checked
                # the search is over: the recommendation may take what is left of the budget
                acc = self.evidence(study, TrialRecord.of(t).knobs, check=True, within_share=False,
                                    timeout_s=None if left is None else min(self.timeout_s, left),
                                    label=f"#{t.number}")
            if passed(acc):
                return t
        return None


MIN_CHECK_S = 5.0
"""A check is not started with less of the budget left than this."""
