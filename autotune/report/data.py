"""The data the report shows, collected once from the study (and its exported config.json): one
row per trial with its figures and knob values, the best, baseline and plain recipe rows, and the
search's cost."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

import strategies
from autotune.report.effects import Effects, measure
from autotune.report.export import plain_recipe_missing, trials_frame
from autotune.report.format import warm_source
from autotune.search.trials import baseline_trial, best_trial, plain_recipe_trial, search_cost
from autotune.search.warm import ATTR as WARM_ATTR
from autotune.trial.record import TrialRecord
from autotune.workload.units import ATTR as UNITS_ATTR, Units

KNOBS = strategies.report_knobs()
"""The dimensions whose effect the report shows: each strategy says its own (Strategy.report_knobs)."""


@dataclass
class ReportData:
    """Everything both renderings need, computed once."""

    study_name: str
    out_dir: Path
    config: dict[str, Any] | None
    workload: dict[str, Any]
    device: str
    provenance: dict[str, Any]
    frame: pd.DataFrame
    """trials_frame(study) plus the optional figures and knob columns, one row per trial."""
    measured: pd.DataFrame
    """The rows plots use: completed, measured, not a repeat of another trial."""
    best: pd.Series | None
    baseline: pd.Series | None
    records: dict[int, TrialRecord]
    """Each trial's record, by number (its accuracy: its own check or the study's of its numerics)."""
    cost: dict[str, Any]
    has: dict[str, bool] = field(default_factory=dict)
    """Which optional sections some trial has: energy, profile, findings, accuracy."""
    effects: Effects | None = None
    """Each parameter's effect from pairs of trials that differ in it alone, and its PED-ANOVA importance."""
    units: Units = field(default_factory=Units)
    """What a sample is: a language model's tables show tokens/s next to samples/s."""
    plain_recipe: pd.Series | None = None
    """The plain recipe's row (autotune.search.plain_recipe): the bar the recommendation must clear."""
    plain_recipe_missing: str | None = None
    """Why there is no plain recipe row when its trial did not complete; None where the search had none."""
    warm_start: list[dict[str, Any]] | None = None
    """The earlier searches whose trials this one started with (autotune.search.warm); None: it started cold."""

    @property
    def best_is_plain_recipe(self) -> bool:
        """Nothing measured beat the plain recipe: the recommendation is the recipe (config.json says so)."""
        if self.best is None or self.plain_recipe is None:
            return False
        exported = (self.config or {}).get("best_is_plain_recipe")
        if exported is not None:
            return bool(exported)
        return int(self.best["number"]) == int(self.plain_recipe["number"]) or \
            self.records[int(self.best["number"])].knobs == self.records[int(self.plain_recipe["number"])].knobs

    @property
    def accuracy_measure(self) -> tuple[str, str]:
        """The frame's column, and its heading, that says how a trial trained against FP32: the
        held-out accuracy drop; where no check had a held-out set (a language model's own batches),
        the training loss drift (the share of FP32's loss decrease the run lost); where the checks
        were numerics parity, the loss trajectory's largest deviation from FP32's."""
        for column, heading in (("accuracy_drop", "accuracy drop"), ("loss_drift", "loss drift"),
                                ("loss_deviation", "loss deviation")):
            values = self.frame[column] if column in self.frame else pd.Series(dtype=float)
            if pd.to_numeric(values, errors="coerce").notna().any():
                return column, heading
        return "loss_drift", "loss drift"


_FRAME_COLUMNS = ["number", "role", "state", "status", "reason", "duplicate_of", "warm_from", "config", "samples_per_s", "tokens_per_s",
                  "ddp_world_size", "per_gpu_samples_per_s", "single_gpu_samples_per_s", "scaling_efficiency",
                  "loader_fed_samples_per_s", "compute_only_samples_per_s", "loader_wait_share", "data_bound",
                  "step_time_ms", "spread", "noisy", "peak_memory_gb", "worker_start_s", "build_s", "warmup_s",
                  "measure_s", "trial_wall_s", "compile_s", "compile_cache", "joules_per_sample", "avg_power_w", "accuracy",
                  "accuracy_drop", "loss_drift", "loss_deviation"]


_ACCURACY_COLUMNS = ("accuracy_verdict", "accuracy_reason", "accuracy", "accuracy_drop", "loss_drift", "loss_deviation",
                     "accuracy_allowed",
                     "accuracy_key")
"""The frame's columns that come from a trial's accuracy check (its numerics' check)."""


def collect(study: optuna.Study, out_dir: Path, config: dict[str, Any] | None) -> ReportData:
    """The report's data for ``study``, written into ``out_dir``; ``config`` is its config.json, or None."""
    from autotune.accuracy.study.gate import accuracy_of

    trials = study.get_trials(deepcopy=False)
    records = {t.number: TrialRecord.of(t) for t in trials}
    for t in trials:  # a trial checked after it finished (at export) has its evidence in the study
        if records[t.number].accuracy is None and (accuracy := accuracy_of(study, t)) is not None:
            records[t.number] = dataclasses.replace(records[t.number], accuracy=accuracy)
    # trials_frame reads energy and accuracy from the same evidence (accuracy_of included)
    frame = trials_frame(study)
    for column in _FRAME_COLUMNS:  # a study without trials gives a frame without columns
        if column not in frame:
            frame[column] = pd.Series(dtype=object)
    by_number = {t.number: t for t in trials}
    extra = []
    for number in frame["number"]:
        record = records[number]
        acc = record.accuracy or {}
        row = {
            "unstable": record.unstable,
            "note": _trial_note(record, by_number[number].system_attrs.get("fail_reason")),
            # the drop or drift the check allowed, and which numerics (precision mode, GradScaler) it
            # trained: every trial of the same numerics shares one check
            "accuracy_allowed": acc.get("allowed"),
            "accuracy_key": acc.get("numerics_key"),
        }
        knobs = record.knobs
        for knob in KNOBS:
            row[f"knob.{knob.key}"] = knob.get(knobs) if knobs and knob.only(knobs) else None
        extra.append(row)
    extra_columns = ["unstable", "note", "accuracy_allowed", "accuracy_key", *(f"knob.{knob.key}" for knob in KNOBS)]
    extra_frame = pd.DataFrame(extra, index=range(len(extra)), columns=extra_columns)
    frame = pd.concat([frame.reset_index(drop=True), extra_frame], axis=1)
    # a trial that ran out of memory, was stopped early or failed trained nothing: the check of its
    # numerics (shared with the trials that completed) is not its own, so it shows none
    unmeasured = (frame["state"] != "COMPLETE") | frame["samples_per_s"].isna()
    for column in _ACCURACY_COLUMNS:
        if column in frame:
            frame[column] = frame[column].astype(object).where(~unmeasured, None)
    measured = frame[(frame["state"] == "COMPLETE") & frame["samples_per_s"].notna() & frame["duplicate_of"].isna()]

    best_t, base_t, plain_t = best_trial(study), baseline_trial(study), plain_recipe_trial(study)
    if config and "study" in config and config["study"].get("trial_number") in by_number:
        best_t = by_number[config["study"]["trial_number"]]
    row_of = {n: frame.loc[i] for i, n in enumerate(frame["number"])}
    best = row_of.get(best_t.number) if best_t is not None else None
    baseline = row_of.get(base_t.number) if base_t is not None else None
    plain = row_of.get(plain_t.number) if plain_t is not None else None

    workload = (config or {}).get("workload") or study.user_attrs.get("workload") or {}
    device = (config or {}).get("device") or study.user_attrs.get("device") or "unknown"
    provenance = (config or {}).get("provenance") or study.user_attrs.get("provenance") or {}
    data = ReportData(study_name=study.study_name, out_dir=Path(out_dir), config=config, workload=workload,
                 device=device, provenance=provenance, frame=frame, measured=measured, best=best,
                 baseline=baseline, records=records, cost=_search_cost(study, config))
    data.has = {key: any(getattr(r, key) for r in records.values()) for key in ("energy", "profile", "findings", "accuracy")}
    data.effects = measure(study, KNOBS)
    data.units = Units.from_dict((config or {}).get("units") or study.user_attrs.get(UNITS_ATTR))
    data.plain_recipe = plain
    data.plain_recipe_missing = plain_recipe_missing(study) if plain is None else None
    data.warm_start = study.user_attrs.get(WARM_ATTR)
    return data


def _trial_note(record: TrialRecord, fail_reason: str | None) -> str:
    notes = []
    if not record.reason and fail_reason:
        notes.append(str(fail_reason))
    if record.duplicate_of is not None:
        notes.append(f"same configuration as #{record.duplicate_of}, not measured again")
    if record.warm_from is not None:
        notes.append(f"measured by an earlier search ({warm_source(record.warm_from)}), not by this one")
    if record.retry_of is not None:
        notes.append(f"re-run of #{record.retry_of}")
    if record.unstable:
        notes.append("loss not finite: never chosen as best")
    return "; ".join(notes)


def _search_cost(study: optuna.Study, config: dict[str, Any] | None) -> dict[str, Any]:
    """The search's own cost: from config.json when exported, else added up as export does."""
    if config and config.get("search"):
        return dict(config["search"])
    return search_cost(study)

