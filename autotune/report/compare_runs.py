"""One output folder of `autotune search` read back for `autotune compare`: its config.json (the best
configuration, the FP32 baseline, the plain recipe, where it ran) and trials.csv."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from autotune.errors import ConfigError
from autotune.report.format import describe, plural_fix


@dataclass(kw_only=True, slots=True)
class Measured:
    """One measured configuration of a run (its best, its FP32 baseline or its plain recipe)."""

    summary: str
    """Short description, e.g. "fp16, channels_last, batch 1024, cudnn.benchmark, 2 streams"."""
    knobs: dict[str, dict[str, Any]]
    """Every knob's value, as config.json records it: {"precision": {"mode": "fp16"}, ...}."""
    figures: dict[str, Any]
    """What the worker measured: samples_per_s, step_time_ms, peak_memory_bytes, ..."""
    trial_number: int | None = None

    @property
    def samples_per_s(self) -> float:
        return float(self.figures["samples_per_s"])

    @property
    def step_time_ms(self) -> float | None:
        return _number(self.figures.get("step_time_ms"))

    @property
    def peak_memory_gib(self) -> float | None:
        peak = _number(self.figures.get("peak_memory_bytes"))
        return None if peak is None else peak / 2**30

    @property
    def joules_per_sample(self) -> float | None:
        """Energy per training sample when the trial measured it (NVML), else None."""
        energy = self.figures.get("energy")
        if isinstance(energy, dict):
            return _number(energy.get("joules_per_sample"))
        return _number(self.figures.get("joules_per_sample"))


@dataclass(kw_only=True, slots=True)
class Run:
    """One output folder of `autotune search`: where it ran, its best configuration and its trials."""

    folder: Path
    label: str
    """E.g. "resnet50 on NVIDIA GeForce RTX 4090, torch 2.11.0+cu130"."""
    model: str
    workload: dict[str, Any]
    """config.json's workload: model, input_shape (None: the model's default), num_classes."""
    device: str
    """"cuda" or "cpu"."""
    provenance: dict[str, Any]
    best: Measured
    baseline: Measured | None
    """The FP32 baseline trial; None when the search has none that completed."""
    plain_recipe: Measured | None
    """The plain recipe's trial (autotune.search.plain_recipe); None when it did not complete, or the
    config.json is from before the recipe existed."""
    trials: pd.DataFrame
    """trials.csv: every trial, its state and figures (empty when the file is missing)."""
    info: dict[str, Any] = field(repr=False)
    """The whole of config.json."""

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def where(self) -> str:
        """The device in words: "NVIDIA GeForce RTX 4090", "CPU (2 cores)"."""
        if self.device == "cuda":
            return str(self.provenance.get("gpu", "GPU"))
        cores = self.provenance.get("num_cpus")
        return f"CPU ({cores} cores)" if cores else "CPU"

    @property
    def workload_key(self) -> tuple[str, tuple[int, ...] | None, int | None]:
        """What makes two runs' figures comparable: the same model on the same inputs and labels."""
        shape = self.workload.get("input_shape")
        return self.model, tuple(shape) if shape else None, self.workload.get("num_classes")

    @property
    def workload_text(self) -> str:
        """E.g. "resnet50 (1000 classes)", "fake_models:tiny_cnn (3x32x32, 10 classes)"."""
        _, shape, num_classes = self.workload_key
        details = (["x".join(map(str, shape))] if shape else []) + \
            ([f"{num_classes} classes"] if num_classes is not None else [])
        return f"{self.model} ({', '.join(details)})" if details else self.model

    @property
    def speedup(self) -> float | None:
        """Best samples/s over the run's own FP32 baseline samples/s; None without a baseline."""
        if self.baseline is None:
            return None
        return self.best.samples_per_s / self.baseline.samples_per_s

    @property
    def speedup_vs_plain_recipe(self) -> float | None:
        """Best samples/s over the run's plain recipe's (config.json's figure); None without one."""
        if self.plain_recipe is None:
            return None
        exported = _number(self.info.get("speedup_vs_plain_recipe"))
        return exported if exported is not None else self.best.samples_per_s / self.plain_recipe.samples_per_s

    @property
    def best_is_plain_recipe(self) -> bool:
        """Nothing the run measured beat its plain recipe: the recipe is its recommendation."""
        return self.plain_recipe is not None and bool(self.info.get("best_is_plain_recipe"))

    @property
    def plain_recipe_missing(self) -> str | None:
        """Why the run has no plain recipe, as config.json says (None: it has one, or the file is older)."""
        return None if self.plain_recipe is not None else self.info.get("plain_recipe_missing")

    @property
    def joules_per_sample(self) -> float | None:
        """The best configuration's energy per sample, from config.json or, failing that, from
        its row of trials.csv; None when it was not measured."""
        value = self.best.joules_per_sample
        if value is not None or self.best.trial_number is None or "number" not in self.trials:
            return value
        row = self.trials[self.trials["number"] == self.best.trial_number]
        for column in ("joules_per_sample", "energy.joules_per_sample"):
            if column in row and len(row):
                value = _number(row[column].iloc[0])
                if value is not None:
                    return value
        return None

    def best_by_precision(self) -> dict[str, float]:
        """The best samples/s among completed trials of each precision mode the run measured."""
        trials = self.trials
        if trials.empty or "state" not in trials or "samples_per_s" not in trials:
            return {}
        # the mode from the Optuna parameter, or (a mode that was not searched has no parameter)
        # from the description, which always starts with it: "fp16, channels_last, batch 512, ..."
        described = trials["config"].fillna("").astype(str).str.split(",").str[0].str.strip() \
            if "config" in trials else pd.Series("", index=trials.index)
        modes = trials["param.precision.mode"].where(trials["param.precision.mode"].notna(), described) \
            if "param.precision.mode" in trials else described
        rates = pd.to_numeric(trials["samples_per_s"], errors="coerce")
        ok = (trials["state"] == "COMPLETE") & rates.gt(0) & modes.astype(str).ne("")
        if "final_loss" in trials:
            # a trial whose loss went inf/NaN is not a usable configuration (the search's best skips
            # it too); trials.csv writes NaN as an empty cell, so an empty one counts as NaN only
            # where the file records losses at all
            loss = pd.to_numeric(trials["final_loss"], errors="coerce")
            ok &= ~loss.isin([math.inf, -math.inf]) & (loss.notna() | loss.isna().all())
        best = rates[ok].groupby(modes[ok].astype(str)).max()
        return {str(mode): float(rate) for mode, rate in best.items()}

    def precision_speedups(self) -> dict[str, float | None]:
        """Each measured precision mode's best samples/s over the FP32 baseline's (None without one)."""
        base = None if self.baseline is None else self.baseline.samples_per_s
        return {mode: None if not base else rate / base for mode, rate in self.best_by_precision().items()}


def load_run(folder: Path) -> Run:
    """Read an output folder of `autotune search` (config.json and trials.csv)."""
    folder = Path(folder)
    if folder.is_file() and folder.suffix == ".json":
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder; give the output folder of `autotune search` (its --out)")
    path = folder / "config.json"
    if not path.exists():
        hint = f"; {folder / 'trials.csv'} says why each trial did not" if (folder / "trials.csv").exists() else ""
        raise ConfigError(f"{folder} has no config.json: no configuration completed there{hint}. "
                          "Compare folders whose search finished at least one trial")
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); re-export it with `autotune search`") from exc
    missing = [key for key in ("workload", "figures", "knobs", "provenance") if key not in info]
    if missing:
        raise ConfigError(f"{path} lacks {', '.join(missing)}: not a config.json written by `autotune search`")
    trials_path = folder / "trials.csv"
    trials = pd.read_csv(trials_path) if trials_path.exists() else pd.DataFrame()
    base = info.get("baseline")
    best = Measured(summary=plural_fix(info.get("summary") or "") or describe(info["knobs"]), knobs=info["knobs"],
                    figures=info["figures"], trial_number=(info.get("study") or {}).get("trial_number"))
    baseline, plain = _measured(base), _measured(info.get("plain_recipe"))
    device = info.get("device") or ("cuda" if info["provenance"].get("gpu") else "cpu")
    run = Run(folder=folder, label="", model=str(info["workload"]["model"]), workload=info["workload"],
              device=device, provenance=info["provenance"], best=best, baseline=baseline, plain_recipe=plain,
              trials=trials, info=info)
    run.label = f"{run.model} on {run.where}, torch {run.provenance.get('torch', '?')}"
    return run


def _measured(entry: Any) -> Measured | None:
    """config.json's baseline or plain recipe entry; None where it is absent or has no samples/s."""
    if not isinstance(entry, dict) or _number((entry.get("figures") or {}).get("samples_per_s")) is None:
        return None
    return Measured(summary=plural_fix(entry.get("summary") or "") or describe(entry.get("knobs", {})),
                    knobs=entry.get("knobs", {}), figures=entry["figures"], trial_number=entry.get("trial_number"))


def _number(x: Any) -> float | None:
    # not format.as_float: here a flag counts as 1.0 and an infinite figure as not recorded
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None
