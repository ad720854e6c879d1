"""The study side of the accuracy check: judge a run against the reference (judge), cache the
checks in the study's user attributes, decide which trials to check (AccuracyGate), and compare
precision modes (`autotune accuracy`)."""

from __future__ import annotations

import hashlib
import math
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
from autotune.errors import AutotuneError
from autotune.trial.record import TrialRecord
from strategies.precision import AUTOCAST_DTYPES

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
        "final_scale": run.get("final_scale"),
        "nonfinite_losses": run.get("nonfinite_losses"),
        "numerics": run.get("numerics"),
        "numerics_key": run.get("numerics_key"),
        "max_accuracy_drop": max_accuracy_drop,
        "max_loss_drift": max_loss_drift,
    }
    has_accuracy = run.get("held_out_accuracy") is not None and reference.get("held_out_accuracy") is not None
    if has_accuracy:
        out["accuracy"] = run["held_out_accuracy"]
        out["reference_accuracy"] = reference["held_out_accuracy"]
        out["accuracy_drop"] = reference["held_out_accuracy"] - run["held_out_accuracy"]
        out["held_out_size"] = run.get("held_out_size")
    progress = (reference.get("initial_loss") or 0.0) - (reference.get("final_loss") or 0.0)
    final, ref_final = run.get("final_loss"), reference.get("final_loss")
    if final is not None and ref_final is not None and math.isfinite(final):
        # the share of the FP32 run's loss decrease that this run lost (0: as good, 1: learnt nothing)
        out["loss_drift"] = (final - ref_final) / progress if progress > 0 else (final - ref_final) / max(abs(ref_final), 1e-12)

    shuffled = reference.get("reshuffled") or {}
    noise_acc = (abs(reference["held_out_accuracy"] - shuffled["held_out_accuracy"])
                 if has_accuracy and shuffled.get("held_out_accuracy") is not None else 0.0)
    noise_drift = 0.0
    if shuffled.get("final_loss") is not None and ref_final is not None and math.isfinite(shuffled["final_loss"]):
        noise_drift = abs(shuffled["final_loss"] - ref_final) / progress if progress > 0 else 0.0
    out["fp32_noise"] = {"accuracy_points": noise_acc, "loss_drift": noise_drift}
    unstable = _instability(run)
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
        what = (f"final training loss {final:.4g} vs {ref_final:.4g} for FP32 (drift {out['loss_drift']:.3f} of "
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
    if (run.get("skipped_steps") or 0) > MAX_SKIPPED_FRACTION * steps:
        return (f"the GradScaler skipped {run['skipped_steps']} of {steps} steps (gradients overflowed; final "
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
UNAVAILABLE_ATTR = "accuracy_unavailable"
REFERENCE_ATTR = "accuracy_reference:{fingerprint}"
RESULT_ATTR = "accuracy_run:{fingerprint}:{key}"


def _key_hash(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def study_settings(study) -> AccuracySettings | None:
    data = study.user_attrs.get(SETTINGS_ATTR)
    return AccuracySettings.from_dict(data) if data else None


def cached_run(study, settings: AccuracySettings, knobs: Mapping[str, Any]) -> tuple[dict, dict] | None:
    """(run, reference) already measured for this numerics key, or None."""
    attrs = study.user_attrs
    reference = attrs.get(REFERENCE_ATTR.format(fingerprint=settings.fingerprint()))
    if reference is None:
        return None
    key = numerics_key(knobs)
    if key == numerics_key({}):
        return {**reference, "numerics_key": key}, reference
    run = attrs.get(RESULT_ATTR.format(fingerprint=settings.fingerprint(), key=_key_hash(key)))
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
    return judge(run, reference, max_accuracy_drop=settings.max_accuracy_drop, max_loss_drift=settings.max_loss_drift)


class AccuracyGate:
    """The study side of the check: reuse by numerics key, check near the speed frontier, and
    make sure the recommended configuration has passing evidence."""

    def __init__(self, *, settings: AccuracySettings, space, workload: dict[str, Any], timeout_s: float,
                 log_dir: Path | None = None) -> None:
        self.settings = settings
        self.space = space
        self.workload = workload
        self.timeout_s = timeout_s
        self.log_dir = log_dir
        self.unavailable: str | None = None
        """Why no configuration can be checked (the FP32 reference failed), or None."""

    def attach(self, study) -> None:
        study.set_user_attr(SETTINGS_ATTR, self.settings.to_dict())

    def judge(self, run: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, Any]:
        return judge(run, reference, max_accuracy_drop=self.settings.max_accuracy_drop,
                     max_loss_drift=self.settings.max_loss_drift)

    def evidence(self, study, knobs: Mapping[str, Any], *, check: bool, timeout_s: float | None = None
                 ) -> dict[str, Any] | None:
        """The judged accuracy of ``knobs``: reused when its numerics key was checked, else
        measured in a worker when ``check``, else None."""
        found = cached_run(study, self.settings, knobs)
        if found is None and check and self.unavailable is None:
            found = self._measure(study, knobs, timeout_s or self.timeout_s)
        if found is None:
            return None
        run, reference = found
        if run.get("status") == "error":
            return {"verdict": "error", "stable": False, "reason": run["reason"], "constraint": UNSTABLE_CONSTRAINT,
                    "numerics_key": run.get("numerics_key")}
        return self.judge(run, reference)

    def _measure(self, study, knobs: Mapping[str, Any], timeout_s: float) -> tuple[dict, dict] | None:
        from autotune.trial.runner import run_worker

        fingerprint = self.settings.fingerprint()
        reference = study.user_attrs.get(REFERENCE_ATTR.format(fingerprint=fingerprint))
        key = numerics_key(knobs)
        request = {"mode": "accuracy", "workload": self.workload, "space": self.space.to_dict(),
                   "knobs": numerics_knobs(knobs), "settings": self.settings.to_dict(), "reference": reference}
        log = self.log_dir / f"accuracy-{_key_hash(key)}.log" if self.log_dir else None
        result = run_worker(request, timeout_s=timeout_s, log_path=log)
        if result["status"] == "timeout" and timeout_s < self.timeout_s:
            return None  # cut by the search budget: not the configuration's fault, check again later
        if result["status"] != "ok":
            reason = f"the accuracy check {result['status']}: {result.get('reason')}"
            if reference is None:
                # the FP32 reference itself failed: nothing can be judged, and it is not this
                # configuration's fault; the search goes on for speed and says so everywhere
                self.unavailable = (f"the FP32 reference of the accuracy check failed ({reason}); fix --data, "
                                    "lower --accuracy-steps, or pass --no-accuracy-check")
                study.set_user_attr(UNAVAILABLE_ATTR, self.unavailable)
                return None
            run = {"status": "error", "reason": reason, "numerics_key": key}
        else:
            reference, run = result["reference"], result["run"]
            study.set_user_attr(REFERENCE_ATTR.format(fingerprint=fingerprint), reference)
        if key != numerics_key({}):
            study.set_user_attr(RESULT_ATTR.format(fingerprint=fingerprint, key=_key_hash(key)),
                                {**run, "knobs": numerics_knobs(knobs)})
        return run, reference

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
        import time

        from optuna.study import StudyDirection
        from optuna.trial import TrialState

        done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.value is not None and not (r := TrialRecord.of(t)).unstable and r.knobs]
        for t in sorted(done, key=lambda t: t.value, reverse=study.direction == StudyDirection.MAXIMIZE):
            acc = accuracy_of(study, t)
            if acc is None:
                left = None if deadline is None else deadline - time.time()
                if left is not None and left < MIN_CHECK_S:
                    return None  # the budget is spent: the export says the numerics were not checked
                acc = self.evidence(study, TrialRecord.of(t).knobs, check=True,
                                    timeout_s=None if left is None else min(self.timeout_s, left))
            if passed(acc):
                return t
        return None


MIN_CHECK_S = 5.0
"""A check is not started with less of the budget left than this."""


class AccuracyCheckError(AutotuneError):
    """The FP32 reference of the accuracy check could not be trained: the data or model is at fault."""


def summary_row(mode: str, judged: Mapping[str, Any]) -> dict[str, Any]:
    """One row of `autotune accuracy`'s table."""
    n = judged.get("numerics") or {}
    return {
        "mode": mode,
        "steps": judged.get("steps"),
        "final_loss": judged.get("final_loss"),
        "accuracy": judged.get("accuracy"),
        "accuracy_drop": judged.get("accuracy_drop"),
        "loss_drift": judged.get("loss_drift"),
        "skipped_steps": judged.get("skipped_steps"),
        "loss_rel_error": n.get("loss_rel_error_vs_fp32"),
        "grad_cosine": n.get("grad_cosine_vs_fp32"),
        "grad_cosine_fp64": n.get("grad_cosine_vs_fp64"),
        "verdict": judged.get("verdict"),
        "reason": judged.get("reason"),
    }


def compare_modes(*, workload: dict[str, Any], space, settings: AccuracySettings,
                  configurations: list[tuple[str, dict[str, Any]]], timeout_s: float = 1800.0,
                  on_row=None) -> list[dict[str, Any]]:
    """`autotune accuracy`: check each (label, numerics knobs) against FP32, one worker each, the
    FP32 reference trained once; returns one judged row per configuration."""
    from autotune.trial.runner import run_worker

    reference = None
    rows = []
    for label, knobs in configurations:
        request = {"mode": "accuracy", "workload": workload, "space": space.to_dict(), "knobs": knobs,
                   "settings": settings.to_dict(), "reference": reference}
        result = run_worker(request, timeout_s=timeout_s)
        if result["status"] != "ok":
            if reference is None:
                raise AccuracyCheckError(f"the FP32 reference run failed ({result['status']}): {result.get('reason')}"
                                         f"\n{result.get('traceback', '')}")
            row = {"mode": label, "verdict": "error", "reason": f"{result['status']}: {result.get('reason')}"}
        else:
            reference = result["reference"]
            judged = judge(result["run"], reference, max_accuracy_drop=settings.max_accuracy_drop,
                           max_loss_drift=settings.max_loss_drift)
            row = summary_row(label, judged)
            row["wall_s"] = result["run"].get("wall_s")
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def mode_configurations(precisions: list[str], fp32_layers: list[str] | None = None
                        ) -> list[tuple[str, dict[str, Any]]]:
    """What `autotune accuracy` checks: each precision mode (fp16 with the default GradScaler and
    without one), then each autocast mode with each requested fp32_layers combination."""
    out: list[tuple[str, dict[str, Any]]] = []
    for mode in precisions:
        if mode == "fp16":
            out.append(("fp16", {"precision": {"mode": "fp16"}, "grad_scaler": {"enabled": True}}))
            out.append(("fp16, no GradScaler", {"precision": {"mode": "fp16"}}))
        else:
            out.append((mode, {"precision": {"mode": mode}}))
    for layers in fp32_layers or []:
        for mode in precisions:
            if mode in AUTOCAST_DTYPES:
                knobs: dict[str, Any] = {"precision": {"mode": mode}, "fp32_layers": {"layers": layers}}
                if mode == "fp16":
                    knobs["grad_scaler"] = {"enabled": True}
                out.append((f"{mode}, fp32 {layers}", knobs))
    return out
