"""One typed record per trial, between the study's user attributes and everything that reads them.

A trial's outcome is stored as Optuna user attributes (so any Optuna tool, optuna-dashboard
included, shows it); ``TrialRecord.of(trial)`` reads them into typed fields, with the defaults a
trial written by an older autotune (or not measured yet) stands for, and ``write`` is the one way
the search stores them, so a misspelt attribute is an error, not a silently missing figure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

ROLES = ("baseline", "plain-recipe", "known-good", "steered", "replayed", "search")
"""Why a trial was measured: the FP32 baseline, the plain recipe (what a user writes in five lines:
autotune.search.plain_recipe), a seeded configuration, one a finding queued, one replayed from
another search (--replay), or one the sampler chose."""


@dataclass(frozen=True)
class TrialRecord:
    """What one trial of a search measured and concluded."""

    number: int
    state: TrialState
    value: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    role: str | None = None
    """One of ROLES; None: chosen by the sampler (shown as "search")."""
    knobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every knob's values as measured (strategies.knobs_to_dict); {} before the trial ran."""
    status: str | None = None
    """ok | oom | error | crashed | timeout | ...; None: no outcome recorded (a trial whose search
    process was killed, re-run on resume), so it is not counted."""
    reason: str | None = None
    """Why the trial failed, was pruned or was not measured, in words."""
    figures: dict[str, Any] = field(default_factory=dict)
    """The measurement: samples_per_s, step times, peak memory, ... (autotune.trial.measure)."""
    timing: dict[str, Any] = field(default_factory=dict)
    """What the trial cost the search: worker start, build, compile, warm-up, timed window."""
    screening: dict[str, Any] | None = None
    """A trial stopped in its warm-up as clearly slower than the best so far (status "pruned"): each
    warm-up window's samples/s ("windows", its intermediate values) and the bar it fell below ("below")."""
    energy: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    profile_error: str | None = None
    findings: list[str] = field(default_factory=list)
    finding_rules: list[dict[str, Any]] = field(default_factory=list)
    steered: list[Any] = field(default_factory=list)
    """The configurations this trial's findings queued."""
    steered_by: Any = None
    accuracy: dict[str, Any] | None = None
    """The trial's own judged accuracy check (autotune.accuracy.study.gate.accuracy_of also finds the
    study's cached check of its numerics)."""
    unstable: bool = False
    duplicate_of: int | None = None
    """The earlier trial with the same parameters whose outcome this one copies."""
    replay_of: int | None = None
    predicted_oom: bool = False
    backed_off_to: int | None = None
    """The batch an out-of-memory configuration was queued again at."""
    backoff_of: int | None = None
    """The out-of-memory trial this one measures again at a smaller batch."""
    fit_peaks: dict[str, Any] | None = None
    fit_oom_batch: int | None = None
    urgent: bool = False
    """Measured next, before the queued seeds (a backed-off baseline: every figure is compared with it)."""
    grown_from: int | None = None
    """The plain-recipe trial this one measures again at a larger batch (its compiled step left room:
    autotune.search.plain_recipe.GrowToFit)."""
    planned: dict[str, Any] | None = None
    """Why the planner ran this trial when it did: its predicted value, cost in seconds, peak
    memory and the words (autotune.search.planner.Plan)."""
    retry_of: int | None = None
    """The trial this one re-runs (its process died; a trial that dies twice stays failed)."""
    cut_after_s: float | None = None
    """Seconds it ran before the search budget's end cut it (its compile still going): what it costs
    is more than that (autotune.search.walls.cut_floors)."""
    warm_from: dict[str, Any] | None = None
    """Measured by an earlier search, not this one (autotune.search.warm): its folder ("out_dir"), study
    and trial "number" there. Evidence for the planner and the recommendation; not counted as a trial."""

    @classmethod
    def of(cls, trial: FrozenTrial | optuna.Trial) -> "TrialRecord":
        """The record of a finished trial, or of one running (an ``optuna.Trial``: no state or value yet)."""
        attrs = trial.user_attrs
        values = {name: attrs[name] for name in FIELDS if attrs.get(name) is not None}
        return cls(number=trial.number, state=getattr(trial, "state", TrialState.RUNNING),
                   value=getattr(trial, "value", None), params=dict(trial.params), **values)

    @property
    def counted(self) -> bool:
        """Finished with a recorded outcome (see ``status``)."""
        return self.status is not None and self.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)

    @property
    def measured(self) -> bool:
        return self.state == TrialState.COMPLETE and self.status == "ok"

    @property
    def samples_per_s(self) -> float | None:
        return self.figures.get("samples_per_s")

    @property
    def peak_memory_bytes(self) -> int | None:
        return self.figures.get("peak_memory_bytes")

    @property
    def batch_size(self) -> int | None:
        return (self.knobs.get("batch_size") or {}).get("batch_size")

    def knob(self, strategy: str, name: str, default: Any = None) -> Any:
        """One recorded knob value: ``record.knob("compile", "mode", "off")``."""
        return (self.knobs.get(strategy) or {}).get(name, default)




FIELDS = frozenset(f.name for f in dataclasses.fields(TrialRecord)) - {"number", "state", "value", "params"}
"""The user attributes a trial record reads and ``write`` may store."""


def copy(source: FrozenTrial, target: optuna.Trial, names: tuple[str, ...]) -> None:
    """Store on ``target`` the fields ``names`` that ``source`` has stored (a repeat of a measured trial)."""
    write(target, **{name: source.user_attrs[name] for name in names if name in source.user_attrs})


def write(trial: optuna.Trial | optuna.trial.FrozenTrial, **values: Any) -> None:
    """Store fields of a trial's record as its user attributes (only TrialRecord's fields)."""
    for name, value in queue_attrs(**values).items():
        trial.set_user_attr(name, value)


def queue_attrs(**values: Any) -> dict[str, Any]:
    """User attributes a queued configuration carries (``autotune.search.queue.Candidate.of(params,
    role="steered")``), checked against TrialRecord's fields as ``write`` checks them."""
    unknown = set(values) - FIELDS
    if unknown:
        raise AttributeError(f"TrialRecord has no field {', '.join(sorted(unknown))}")
    return dict(values)
