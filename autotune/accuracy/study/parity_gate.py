"""The search's accuracy verdict by numerics parity (autotune.accuracy.worker.parity): the gate that checks
configurations near the speed frontier and the recommendation against FP32, planned to cost at most
``share`` (15% by default) of ``--budget``, all its checks and the recommendation's verdict together.

The held-out accuracy check (autotune.accuracy.study.gate.AccuracyGate, ``--accuracy-method held-out``)
trains each configuration for hundreds of steps and judges held-out accuracy; in seven default
searches (issue 37) none of its verdicts could have failed: a saturated task, a 25-point FP32
reshuffle allowance, or no verdict because its runs did not fit the budget. A parity check costs a
few dozen steps and fails what breaks training (scripts/parity_calibration.py).

The plan (``parity_plan``): once the FP32 baseline is measured, its throughput gives the check's step
time; the first verdict trains the reference, its calibrations and the configuration (each ``steps``
steps and the first batch again: ParitySettings.first_verdict_runs runs) in one worker; a later one
the configuration's run. The steps are the most (up to ParitySettings.steps) with which the first
verdict and one later check fit in the share together (the first verdict's configuration may fail, or
a later trial beat it: the recommendation's check then follows), halving the check's batch for
PREFERRED_STEPS where needed. Where even MIN_STEPS do not fit, the search says so in one line, with
the budget that would fit one, and checks nothing. Every check but the end's keeps one later check's
seconds of the share for the recommendation, the best trial's so far too; the stop rule
(autotune.search.budget) ends the trials early enough for the recommendation's verdict where the best
has none, and a trial that runs long is cut where those seconds begin (autotune.search.objective).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

from autotune.accuracy.settings import numerics_key, numerics_knobs
from autotune.accuracy.study.gate import (
    METHOD_ATTR,
    MIN_CHECK_S,
    PLAN_ATTR,
    RESULT_ATTR,
    SETTINGS_ATTR,
    AccuracyGate,
    accuracy_of,
    key_hash,
    failed,
)
from autotune.accuracy.study.plan import CHECKS_ATTR, duration, fitting_batch
from autotune.accuracy.worker.parity import ParityResult, ParitySettings
from autotune.accuracy.worker.parity_verdict import METHOD, evidence, reference_evidence
from autotune.accuracy.worker.reference_file import read_reference
from autotune.trial.record import TrialRecord

DEFAULT_SHARE = 0.15
"""What the parity checks may spend of --budget (issue 37: at most 15%)."""
MIN_STEPS = 3
"""The fewest steps of a parity run: a loss trajectory of four points and the first batch again."""
PREFERRED_STEPS = 8
"""Steps a plan halves the check's batch for, before it settles for fewer."""
MIN_BATCH = 4
"""The smallest batch a plan halves the check's batch to."""
RESERVE_MARGIN = 1.2
"""The trials leave the recommendation's verdict this multiple of its estimated seconds, and MIN_CHECK_S: a
trial ends a few seconds past its own estimate."""
OVERRUN = 3.0
"""A check started while trials run may take this multiple of its estimate (a busy machine's pace) before
it is cut, within the budget: the seconds past the share come out of the trials."""
BUILDS = 2
"""A parity worker's set-up besides its start, in model builds: it builds the model once and copies
it for each run (autotune.accuracy.worker.check.seeded_workload); the second is the data and the copies."""


def run_setup_steps(device: str) -> int:
    """A parity run's set-up beside its steps on ``device`` ("cuda", "cuda:1", "cpu"), in steps of its own
    pace (the priors table's "run set-up steps": on a GPU its first calls cost about 12 steps, on a CPU one)."""
    from autotune.priors import prior

    return int(prior("accuracy check", "cuda" if device.startswith("cuda") else "cpu", "run set-up steps"))


def later_check_margin(device: str) -> float:
    """How far a later check (a configuration's run, once the FP32 reference is trained) may run past the
    plan's figure for it, which counts FP32's pace and set-up, on ``device`` (the priors table's "later check
    over its plan": a configuration's kernels' first calls, an 8-bit optimizer's compiled update and recomputed
    blocks make its run slower than FP32's)."""
    from autotune.priors import prior

    return float(prior("accuracy check", "cuda" if device.startswith("cuda") else "cpu", "later check over its plan"))


def parity_plan(settings: ParitySettings, *, budget_s: float, share: float, measured: Mapping[str, Any],
                device: str = "cpu") -> dict[str, Any]:
    """The parity checks' steps and batch for a search of ``budget_s`` whose checks may spend ``share``
    of it, from autotune.accuracy.study.plan.step_time's figures: the largest batch (``settings.batch_size``,
    halved down to MIN_BATCH) at which PREFERRED_STEPS of a first verdict and a later check fit, else the
    largest at which MIN_STEPS of both do, else of the first verdict alone;
    ``fits`` False where none does (``needed_budget_s`` says what budget would, at the smallest). Each
    run is counted with ``device``'s set-up (run_setup_steps), which the plan records. On
    a 2-core CPU with bf16 matrix units (AMX) ResNet-50's FP32 baseline ran 1.4 samples/s: the
    reference's and the calibration's FP32 steps at batch 16 took 137 s of a 90 s share."""
    largest = fitting_batch(settings.batch_size, measured, bytes_factor=1.0, minimum=1, multiple=1)
    setup, margin = run_setup_steps(device), later_check_margin(device)
    options = [_sized(settings, largest, budget_s=budget_s, share=share, measured=measured, setup=setup,
                      margin=margin)]
    while options[-1]["batch"] // 2 >= MIN_BATCH:
        options.append(_sized(settings, options[-1]["batch"] // 2, budget_s=budget_s, share=share, measured=measured,
                              setup=setup, margin=margin))
    want = min(settings.steps, PREFERRED_STEPS)
    pick = next((o for o in options if o["both"] and o["steps"] >= want), None) or \
        next((o for o in options if o["both"]), None) or next((o for o in options if o["fits"]), options[-1])
    batch = pick.pop("batch")
    pick.pop("both")
    plan = {"how": "scaled", "method": METHOD, **pick, "setup_steps": setup, "later_margin": margin,
            "default_steps": settings.steps, "share": share,
            "budget_s": budget_s, "from_trial": measured["trial"], "from_baseline": measured["baseline"]}
    if batch != settings.batch_size:
        plan.update(batch_size=batch, default_batch_size=settings.batch_size)
    return plan


def _sized(settings: ParitySettings, batch: int, *, budget_s: float, share: float,
           measured: Mapping[str, Any], setup: int, margin: float) -> dict[str, Any]:
    """The plan's figures at ``batch``: the most steps (up to settings.steps) with which the first
    verdict and one later check fit in the share, a configuration's run counted at ``margin`` times an FP32
    run (later_check_margin: in the first verdict as in a later check); ``fits`` where the first verdict
    alone does at MIN_STEPS (a verdict, if not a second); what a first and a later verdict cost, and the
    budget MIN_STEPS would need."""
    step_s = batch / measured["samples_per_s"]
    overhead = measured["overhead_s"]
    # the first verdict: the reference and the calibrations, each an FP32 run, and the configuration's run,
    # which runs ``margin`` times an FP32 run as a later check's does; a later check, that run and a worker
    fp32_runs = settings.first_verdict_runs - 1
    room = share * budget_s - (1 + margin) * overhead
    steps = min(settings.steps, math.floor(room / ((fp32_runs + 2 * margin) * step_s)) - 1 - setup)

    def first_verdict_s(steps: int) -> float:
        return overhead + (fp32_runs + margin) * run_s(steps, step_s, setup)

    fits = share * budget_s >= first_verdict_s(MIN_STEPS)
    both, steps = steps >= MIN_STEPS, max(MIN_STEPS, steps)
    return {"batch": batch, "steps": steps, "fits": fits, "both": both, "step_s": round(step_s, 6),
            "estimate_s": round(first_verdict_s(steps), 1), "first_verdict_s": round(first_verdict_s(steps), 1),
            # its run, at FP32's pace: the reference's first gradients and updates are kept for it
            # (parity.GRAD_SAMPLE); later_check_margin scales it where a later check is reserved
            "check_s": round(overhead + run_s(steps, step_s, setup), 1),
            "needed_budget_s": round(first_verdict_s(MIN_STEPS) / share, 1)}


def run_s(steps: int, step_s: float, setup: int = 0) -> float:
    """One parity run's seconds: its ``setup`` (run_setup_steps), its ``steps`` and the first batch again."""
    return (steps + 1 + setup) * step_s


def later_check_s(study) -> float:
    """A check's seconds once the FP32 reference is trained: from the phases of the worker that trained
    it (CHECKS_ATTR: an FP32 check, alone, or a first verdict, before its configuration's run) where it
    returned them (measured_later_check_s), not less than the plan's ``check_s``; before any, ``check_s`` times
    the plan's ``later_margin`` (later_check_margin); else ``check_s``, scaled by how far that worker ran
    past the plan's figure for it (the first verdict; less the
    configuration's run, alone): a reference can take three times its plan, and a check planned from
    the plan alone is started with too little left and cut."""
    plan = study.user_attrs.get(PLAN_ATTR) or {}
    check_s = plan.get("check_s") or 0.0
    first, step_s, steps = plan.get("first_verdict_s"), plan.get("step_s"), plan.get("steps")
    trained = next((c for c in study.user_attrs.get(CHECKS_ATTR) or []
                    if (c.get("fp32") or c.get("trains_reference")) and c.get("status") == "ok"), None)
    if trained is not None and trained.get("runs") and trained.get("in_worker_s") is not None:
        return max(check_s, measured_later_check_s(trained))  # as the scaling below, never under the plan
    if not (check_s and first and step_s and steps and trained):
        return round(check_s * plan.get("later_margin", 1.0), 1)  # a configuration's run, as the plan counts it
    planned = first - run_s(steps, step_s, plan.get("setup_steps", 0)) if trained.get("fp32") else first
    return round(check_s * max(1.0, trained["seconds"] / planned), 1) if planned > 0 else check_s


PHASES = ("build", "perturb", "first step", "steps")
"""A parity run's phases, as the worker returns them (autotune.accuracy.worker.parity.RUN_PHASES)."""


def measured_later_check_s(trained: Mapping[str, Any]) -> float:
    """A later check's seconds from the phases of the worker that trained the reference (a CHECKS_ATTR
    entry): its start, hand-over and exit, its set-up (the data), and a configuration's run (the last run of
    a first verdict; the reference's own where it was trained alone). The reference's first gradients are
    kept for the later checks (parity.GRAD_SAMPLE), so they take no FP32 step again. A configuration's run
    that stopped on its first gradients (parity._one_run) took no other steps, which a later check's may:
    they are counted at the FP32 reference's pace."""
    runs = trained["runs"]
    total = [sum(r.get(k, 0.0) for k in PHASES) for r in runs]
    setup = max(0.0, trained["in_worker_s"] - sum(total))
    outside = max(0.0, trained["seconds"] - trained["in_worker_s"])
    run = total[-1] if trained.get("trains_reference") else total[0]
    if trained.get("trains_reference") and runs[-1].get("stopped"):
        run += runs[0].get("steps", 0.0)
    return round(outside + setup + run, 1)


UNFIT_ATTR = "accuracy_unfit:{fingerprint}:{key}"
"""A configuration's numerics whose parity check ran out of memory (the reason): not checked, not
failed. The check runs eager at its own batch, under --memory-limit: a configuration that fits a
cap compiled may not fit it eager, after the FP32 reference trained in the same worker, and that is
no verdict on its numerics."""


def unfit(study, settings: ParitySettings, knobs: Mapping[str, Any]) -> str | None:
    """Why the parity check of ``knobs``' numerics could not run (it ran out of memory), or None."""
    return study.user_attrs.get(UNFIT_ATTR.format(fingerprint=settings.fingerprint(), key=key_hash(numerics_key(knobs))))


def no_verdict_notice(plan: Mapping[str, Any]) -> str:
    """The one line a search prints when no verdict fits its budget."""
    return (f"no accuracy verdict fits: one numerics parity check against FP32 takes about "
            f"{plan['first_verdict_s']:.0f} s here, more than {100 * plan['share']:.3g}% of the "
            f"{duration(plan['budget_s'])} budget; the recommendation will say it was not checked "
            f"(--budget {math.ceil(plan['needed_budget_s'] / 60)}m would fit one, or raise --accuracy-share)")


class ParityGate(AccuracyGate):
    """AccuracyGate whose checks are numerics parity runs (one worker a check), judged when measured
    and kept judged in the study; the FP32 reference is trained once per workload, settings and
    device and kept across searches (reference_cache), as the held-out check's is."""

    def __init__(self, *, settings: ParitySettings, share: float = DEFAULT_SHARE, **kwargs: Any) -> None:
        super().__init__(settings=settings, share=share, held_out=False, **kwargs)
        self.final = False
        """The search is over: the recommendation's check may take what the share has left."""
        self.notice: str | None = None
        """The one line said when no verdict fits the budget (no_verdict_notice)."""
        self.study = None
        """The study attached (attach)."""
        self._grads_dir: str | None = None
        """A folder of this run's: the FP32 reference's first gradients, sampled, between its checks."""

    def grads_path(self) -> str:
        """Where this run's check workers keep the reference's first gradients (autotune.accuracy.worker.parity.
        run_parity): written by the worker that trains the reference, read by the later ones, which then
        take no FP32 step; removed with the gate."""
        import weakref

        if self._grads_dir is None:
            self._grads_dir = tempfile.mkdtemp(prefix="autotune-parity-grads-")
            weakref.finalize(self, shutil.rmtree, self._grads_dir, ignore_errors=True)
        return str(Path(self._grads_dir) / f"{self.settings.fingerprint()}.pt")

    def attach(self, study) -> None:
        self.study = study
        if study.user_attrs.get(SETTINGS_ATTR) and study.user_attrs.get(METHOD_ATTR) != METHOD:
            # a study of the held-out check resumed: its plan's steps were for that check, not this one
            study.set_user_attr(PLAN_ATTR, {})
        study.set_user_attr(METHOD_ATTR, METHOD)
        super().attach(study)

    def make_plan(self, measured: dict[str, Any]) -> dict[str, Any]:
        measured = {**measured, "overhead_s": self._overhead(measured)}
        plan = parity_plan(self.settings, budget_s=self.budget_s, share=self.share, measured=measured,
                           device=self.space.device)
        if not plan["fits"]:
            self.notice = no_verdict_notice(plan)
            warnings.warn(self.notice, stacklevel=2)
        return plan

    @staticmethod
    def _overhead(measured: Mapping[str, Any]) -> float:
        """A parity worker's start and BUILDS builds, as the trial step_time read measured them."""
        return measured.get("worker_start_s", 0.0) + BUILDS * measured.get("build_s", 0.0)

    def _keep_s(self, study) -> float:
        """Seconds of the share a check keeps for the recommendation's verdict at the end: one later
        check's, for every check but the end's own (the plan holds the first verdict and one later check:
        parity_plan). The best trial's so far keeps them too: its configuration may fail, or a later
        trial beat it, and the recommendation's check then follows (a 1B Llama's check of its best
        candidate, before it ran, took the share and failed; the winner's check at the end took as much
        again as the share had left: reports/measurement-log.md)."""
        if self.final:
            return 0.0
        return later_check_s(study)

    def judge(self, run: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, Any]:
        """A parity run is stored judged; FP32's numerics are the reference's own."""
        if run.get("method") == METHOD:
            return dict(run)
        return reference_evidence(reference, numerics_key=run.get("numerics_key"))

    def _planned_fits(self, study) -> bool:
        plan = study.user_attrs.get(PLAN_ATTR) or {}
        return plan.get("fits", True) is not False

    def evidence(self, study, knobs: Mapping[str, Any], *, check: bool, timeout_s: float | None = None,
                 within_share: bool = True, label: str = "") -> dict[str, Any] | None:
        self.settle(study, force=check)
        if check and self.budget_s is not None and not self._planned_fits(study):
            check = False  # said once, before the checks: no verdict fits this budget
        if check and unfit(study, self.settings, knobs) is not None:
            check = False  # its check ran out of memory once: it would again
        return super().evidence(study, knobs, check=check, timeout_s=timeout_s, within_share=True, label=label)

    def _timeout(self, timeout_s: float | None, within_share: bool) -> float | None:
        """How long the next check may take (``timeout_s``: what the budget's end leaves it); None: it is
        not started. The share decides which checks start: while trials run, one whose estimate the
        share's rest (less one check's seconds kept for the end) holds; at the end, the recommendation's
        whatever the share has left, since the stop rule kept its seconds (verdict_reserve_s). A check
        started while trials run is cut at OVERRUN times its estimate, or, where it trains the reference, at
        what the share has left if that is more; the end's by the budget's end only: on a machine slower
        than its plan the overrun comes out of the trials, and the verdict is not lost for a few seconds."""
        timeout = timeout_s or self.timeout_s
        if self.budget_s is None:
            return timeout
        need = max(MIN_CHECK_S, self.estimate_s(self.study) if self.study is not None else 0.0)
        if timeout < need:
            return None  # the budget's end would cut it: its seconds would be the trials' for nothing
        if self.final:
            return timeout
        keep = self._keep_s(self.study) if self.study is not None else 0.0
        rest = self.share * self.budget_s - self.spent_s - keep
        if rest < need:
            return None
        if self.study is not None and self._reference(self.study) is None:
            # it trains the FP32 reference every verdict needs: cut, all its seconds would be lost, and its
            # estimate is the least sure (the FP32 pace at the check's batch is inferred from the baseline's)
            return min(timeout, max(OVERRUN * need, rest))
        return min(timeout, OVERRUN * need)

    def _first_verdict_fits(self, study) -> bool:
        if self.budget_s is None or self._reference(study) is not None:
            return True
        plan = study.user_attrs.get(PLAN_ATTR) or {}
        return self.spent_s + (plan.get("first_verdict_s") or 0.0) <= self.share * self.budget_s

    def estimate_s(self, study) -> float:
        plan = study.user_attrs.get(PLAN_ATTR) or {}
        if plan.get("method") != METHOD:
            return 0.0
        return later_check_s(study) if self._reference(study) is not None else plan["first_verdict_s"]

    def verdict_reserve_s(self, study) -> float:
        """Seconds the trials leave for the recommendation's verdict: one check's, where the best
        trial so far has none and can be checked; 0 otherwise."""
        plan = study.user_attrs.get(PLAN_ATTR) or {}
        if self.budget_s is None or plan.get("method") != METHOD or not plan.get("fits", True) or self.unavailable:
            return 0.0
        best = self._best(study)
        if best is None or accuracy_of(study, best) is not None or unfit(study, self.settings, TrialRecord.of(best).knobs):
            return 0.0
        # kept whether or not the share still holds it: the verdict is planned first, and a search
        # whose checks ran slower than planned gives up trials for it, not the recommendation's verdict;
        # a trial ends a few seconds past its estimate, hence the margin
        return RESERVE_MARGIN * self.estimate_s(study) + MIN_CHECK_S

    @staticmethod
    def _best(study):
        from optuna.study import StudyDirection
        from optuna.trial import TrialState

        done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.value is not None and not TrialRecord.of(t).unstable and TrialRecord.of(t).knobs
                and not failed(accuracy_of(study, t))]
        if not done:
            return None
        pick = max if study.direction == StudyDirection.MAXIMIZE else min
        return pick(done, key=lambda t: t.value)

    def ensure_recommendation(self, study, deadline: float | None = None):
        self.final = True
        return super().ensure_recommendation(study, deadline=deadline)

    def _measure(self, study, knobs: Mapping[str, Any], timeout_s: float, label: str = "") -> tuple[dict, dict] | None:
        from autotune.trial.runner import run_worker

        reference = self._reference(study)
        key = numerics_key(knobs)
        fp32 = key == numerics_key({})
        request = {"mode": "parity", "workload": self.workload, "device": self.space.device,
                   "knobs": numerics_knobs(knobs), "settings": self.settings.to_dict(), "reference": reference,
                   "reference_only": fp32 and reference is None, "grads_path": self.grads_path()}
        if study.user_attrs.get("memory_limit_bytes"):  # the check runs on the user's card too
            request["memory_limit_bytes"] = study.user_attrs["memory_limit_bytes"]
        written = None
        if reference is None and not fp32:  # the reference first, kept whatever befalls the configuration's run
            written = Path(tempfile.mkdtemp(prefix="autotune-parity-")) / "reference.json"
            request["reference_path"] = str(written)
        log = self.log_dir / f"parity-{key_hash(key)}.log" if self.log_dir else None
        if self.on_phase is not None:
            self.on_phase(f"accuracy check{' of ' + label if label else ''}: numerics parity against FP32 "
                          f"({self.settings.steps} steps{'' if reference else ', the FP32 reference first'})")
        started, result = time.time(), None
        try:
            result = run_worker(request, timeout_s=timeout_s, log_path=log, spare=self.prestart)
        finally:
            self._spent(study, label, key, started, result, timeout_s, trains_reference=written is not None)
        if written is not None:
            trained = read_reference(written) if result["status"] != "ok" else None
            shutil.rmtree(written.parent, ignore_errors=True)
            if trained is not None:  # trained before the configuration's run failed or was cut
                reference = self._trained_reference(study, trained)
        return self._recorded(study, result, knobs, reference, timeout_s)

    def _recorded(self, study, result: Mapping[str, Any], knobs: Mapping[str, Any], reference: dict | None,
                  timeout_s: float) -> tuple[dict, dict] | None:
        """Keep what a parity worker answered in the study (and a reference it trained in the file
        cache); the run judged, and the reference, or None where nothing can be judged."""
        fingerprint, key = self.settings.fingerprint(), numerics_key(knobs)
        if self._cut(result, timeout_s):
            return None  # cut by the budget: not the configuration's fault
        if result["status"] == "oom" and reference is not None:
            # the check's eager run at its batch says nothing of the numerics: not checked, and not again
            study.set_user_attr(UNFIT_ATTR.format(fingerprint=fingerprint, key=key_hash(key)),
                                (result.get("reason") or "out of memory").splitlines()[0][:200])
            return None
        if result["status"] != "ok":
            run = self._failure(study, result, reference, key, "parity check")
            return None if run is None else (run, reference)
        if reference is None:
            reference = self._trained_reference(study, result["reference"])
        if result.get("result") is None:  # FP32's numerics: the reference is their run
            return {"numerics_key": key}, reference
        run = evidence(ParityResult.from_dict(result["result"]), numerics_key=key)
        study.set_user_attr(RESULT_ATTR.format(fingerprint=fingerprint, key=key_hash(key)),
                            {**run, "knobs": numerics_knobs(knobs)})
        return run, reference
