"""The search report: ``report.html``, one self-contained page (summary, plots as inline SVG,
every trial in a sortable table, how to reproduce) that opens offline, and ``report.md``, the
summary and main tables for GitHub.

Everything is read back from the study's trials (their user attributes, as the search records
them) and the exported config.json; sections for figures a search did not measure (energy,
profile, findings, accuracy) say so in one line instead of showing anything invented.
"""

from __future__ import annotations

import datetime as dt
import html
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import jinja2
import matplotlib
import optuna
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

import autotune
from autotune.report.export import trials_frame
from autotune.search.objective import describe
from autotune.search.trials import baseline_trial, best_trial, counted_trials

GIB = 2**30
NOT_MEASURED = "not measured in this search"
PRECISION_ORDER = ["fp32", "tf32", "fp16", "bf16"]
PRECISION_COLORS = {"fp32": "#5b6b7f", "tf32": "#1b9e77", "fp16": "#d95f02", "bf16": "#7570b3"}
FORMAT_MARKERS = {"contiguous": "o", "channels_last": "s"}
FORMAT_COLORS = {"contiguous": "#8da0cb", "channels_last": "#fc8d62"}
PROFILE_PARTS = [  # (key in the profile attribute, label, colour)
    ("tensor_core_share", "Tensor Core GEMM/conv", "#1b9e77"),
    ("other_gemm_conv_share", "other GEMM/conv", "#66a61e"),
    ("elementwise_share", "elementwise", "#7570b3"),
    ("layout_share", "layout (transpose/copy)", "#e7298a"),
    ("memcpy_share", "memcpy", "#e6ab02"),
    ("idle_share", "GPU idle", "#bbbbbb"),
]


# ----------------------------------------------------------------------------------------------
# the data the report shows


@dataclass
class _Knob:
    """One dimension of the search, read from the recorded knobs of each trial."""

    key: str
    label: str
    get: Callable[[dict[str, Any]], Any]
    only: Callable[[dict[str, Any]], bool] = lambda knobs: True
    """Trials this knob means something for (GradScaler settings only with fp16)."""


def _knob_value(strategy: str, name: str, default: Any = None) -> Callable[[dict[str, Any]], Any]:
    return lambda knobs: (knobs.get(strategy) or {}).get(name, default)


def _ddp_on(knobs: dict[str, Any]) -> bool:
    return (knobs.get("ddp") or {}).get("world_size", 1) > 1


def _scaler_on(knobs: dict[str, Any]) -> bool:
    return bool((knobs.get("grad_scaler") or {}).get("enabled"))


KNOBS = [
    _Knob("precision", "precision", _knob_value("precision", "mode", "fp32")),
    _Knob("memory_format", "memory format", _knob_value("memory_format", "format", "contiguous")),
    _Knob("batch_size", "batch size", _knob_value("batch_size", "batch_size")),
    _Knob("channel_alignment", "channel padding (multiple)", _knob_value("channel_alignment", "multiple", 1)),
    _Knob("cudnn", "cudnn.benchmark", _knob_value("cudnn", "benchmark", False)),
    _Knob("streams", "CUDA streams", _knob_value("streams", "num_streams", 1)),
    _Knob("threads", "CPU threads", _knob_value("threads", "num_threads", 0)),
    _Knob("grad_scaler.init_scale", "GradScaler init_scale", _knob_value("grad_scaler", "init_scale"), _scaler_on),
    _Knob("grad_scaler.growth_factor", "GradScaler growth_factor", _knob_value("grad_scaler", "growth_factor"),
          _scaler_on),
    _Knob("grad_scaler.backoff_factor", "GradScaler backoff_factor", _knob_value("grad_scaler", "backoff_factor"),
          _scaler_on),
    _Knob("grad_scaler.growth_interval", "GradScaler growth_interval", _knob_value("grad_scaler", "growth_interval"),
          _scaler_on),
    _Knob("ddp.bucket_cap_mb", "DDP bucket_cap_mb", _knob_value("ddp", "bucket_cap_mb"), lambda k: _ddp_on(k)),
    _Knob("ddp.gradient_as_bucket_view", "DDP gradient_as_bucket_view", _knob_value("ddp", "gradient_as_bucket_view"),
          lambda k: _ddp_on(k)),
    _Knob("ddp.static_graph", "DDP static_graph", _knob_value("ddp", "static_graph"), lambda k: _ddp_on(k)),
]


@dataclass
class _Data:
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
    attrs: dict[int, dict[str, Any]]
    """Each trial's user attributes, by number."""
    cost: dict[str, Any]
    has: dict[str, bool] = field(default_factory=dict)
    """Which optional sections some trial has: energy, profile, findings, accuracy."""


_FRAME_COLUMNS = ["number", "role", "state", "status", "reason", "duplicate_of", "config", "samples_per_s",
                  "ddp_world_size", "per_gpu_samples_per_s", "single_gpu_samples_per_s", "scaling_efficiency",
                  "loader_fed_samples_per_s", "compute_only_samples_per_s", "loader_wait_share", "data_bound",
                  "step_time_ms", "spread", "noisy", "peak_memory_gb", "worker_start_s", "build_s", "warmup_s",
                  "measure_s", "trial_wall_s", "compile_s", "joules_per_sample", "avg_power_w", "accuracy",
                  "accuracy_drop"]


def _collect(study: optuna.Study, out_dir: Path, config: dict[str, Any] | None) -> _Data:
    from autotune.accuracy.gate import accuracy_of

    trials = study.get_trials(deepcopy=False)
    attrs = {t.number: dict(t.user_attrs) for t in trials}
    for t in trials:  # a trial checked after it finished (at export) has its evidence in the study
        if "accuracy" not in attrs[t.number] and (accuracy := accuracy_of(study, t)) is not None:
            attrs[t.number]["accuracy"] = accuracy
    # trials_frame reads energy and accuracy from the same evidence (accuracy_of included)
    frame = trials_frame(study)
    for column in _FRAME_COLUMNS:  # a study without trials gives a frame without columns
        if column not in frame:
            frame[column] = pd.Series(dtype=object)
    by_number = {t.number: t for t in trials}
    extra = []
    for number in frame["number"]:
        t = by_number[number]
        a = attrs[number]
        row = {
            "unstable": bool(a.get("unstable")),
            "note": _trial_note(t),
        }
        knobs = a.get("knobs") or {}
        for knob in KNOBS:
            row[f"knob.{knob.key}"] = knob.get(knobs) if knobs and knob.only(knobs) else None
        extra.append(row)
    extra_columns = ["unstable", "note", *(f"knob.{knob.key}" for knob in KNOBS)]
    extra_frame = pd.DataFrame(extra, index=range(len(extra)), columns=extra_columns)
    frame = pd.concat([frame.reset_index(drop=True), extra_frame], axis=1)
    measured = frame[(frame["state"] == "COMPLETE") & frame["samples_per_s"].notna() & frame["duplicate_of"].isna()]

    best_t, base_t = best_trial(study), baseline_trial(study)
    if config and "study" in config and config["study"].get("trial_number") in by_number:
        best_t = by_number[config["study"]["trial_number"]]
    row_of = {n: frame.loc[i] for i, n in enumerate(frame["number"])}
    best = row_of.get(best_t.number) if best_t is not None else None
    baseline = row_of.get(base_t.number) if base_t is not None else None

    workload = (config or {}).get("workload") or study.user_attrs.get("workload") or {}
    device = (config or {}).get("device") or study.user_attrs.get("device") or "unknown"
    provenance = (config or {}).get("provenance") or study.user_attrs.get("provenance") or {}
    data = _Data(study_name=study.study_name, out_dir=Path(out_dir), config=config, workload=workload,
                 device=device, provenance=provenance, frame=frame, measured=measured, best=best,
                 baseline=baseline, attrs=attrs, cost=_search_cost(study, config))
    data.has = {key: any(a.get(key) for a in attrs.values()) for key in ("energy", "profile", "findings", "accuracy")}
    return data


def _trial_note(t: optuna.trial.FrozenTrial) -> str:
    a = t.user_attrs
    notes = []
    if not a.get("reason") and t.system_attrs.get("fail_reason"):
        notes.append(str(t.system_attrs["fail_reason"]))
    if a.get("duplicate_of") is not None:
        notes.append(f"same configuration as #{a['duplicate_of']}, not measured again")
    if a.get("retry_of") is not None:
        notes.append(f"re-run of #{a['retry_of']}")
    if a.get("unstable"):
        notes.append("loss not finite: never chosen as best")
    return "; ".join(notes)


def _search_cost(study: optuna.Study, config: dict[str, Any] | None) -> dict[str, Any]:
    """The search's own cost: from config.json when exported, else added up as export does."""
    if config and config.get("search"):
        return dict(config["search"])
    counted = counted_trials(study)
    timing = [t.user_attrs.get("timing", {}) for t in counted if "duplicate_of" not in t.user_attrs]
    cost: dict[str, Any] = {"num_trials": len(counted), "num_measured": len(timing)}
    for key, name in (("worker_start_s", "worker_start_s"), ("build_s", "build_s"), ("warmup_s", "warmup_s"),
                      ("measure_s", "measure_s"), ("wall_s", "trial_wall_s"), ("compile_s", "compile_s")):
        cost[name] = round(sum(x.get(key) or 0.0 for x in timing), 2)
    return cost


# ----------------------------------------------------------------------------------------------
# numbers in words


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def fmt_rate(v: Any) -> str:
    f = _num(v)
    if f is None:
        return ""
    return f"{f:,.0f}" if f >= 100 else f"{f:,.1f}"


def fmt_ms(v: Any) -> str:
    f = _num(v)
    return "" if f is None else (f"{f:,.1f}" if f >= 10 else f"{f:.2f}")


def fmt_gib(v: Any) -> str:
    f = _num(v)
    return "" if f is None else f"{f:.2f}"


def fmt_pct(v: Any, digits: int = 1) -> str:
    f = _num(v)
    return "" if f is None else f"{100 * f:.{digits}f}%"


def fmt_s(v: Any) -> str:
    f = _num(v)
    if f is None:
        return ""
    if f >= 3600:
        return f"{f / 3600:.1f} h"
    if f >= 120:
        return f"{f / 60:.1f} min"
    return f"{f:.1f} s"


def fmt_g(v: Any, digits: int = 4) -> str:
    f = _num(v)
    return "" if f is None else f"{f:.{digits}g}"


def fmt_ratio(v: Any) -> str:
    f = _num(v)
    return "" if f is None else f"{f:.2f}×"


def _value_label(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float) and v.is_integer():
        return f"{v:g}"
    return str(v)


# ----------------------------------------------------------------------------------------------
# what the page says


def _device_text(d: _Data) -> str:
    p = d.provenance
    if d.device not in ("cuda", "cpu") and not p:
        return "not recorded"
    if d.device == "cuda" or p.get("gpu"):
        parts = [p.get("gpu", "CUDA GPU")]
        extra = [f"{k} {p[k]}" for k in ("driver", "cuda", "cudnn") if p.get(k)]
        text = f"{parts[0]} ({', '.join(extra)})" if extra else parts[0]
    else:
        cores = f", {p['num_cpus']} cores" if p.get("num_cpus") else ""
        text = f"CPU ({p.get('cpu', 'unknown')}{cores})"
    if p.get("torch"):
        text += f", torch {p['torch']}"
    return text


def _title_device(d: _Data) -> str:
    if d.device == "cuda":
        return d.provenance.get("gpu") or "CUDA GPU"
    return "CPU" if d.device == "cpu" else d.device


def _model_text(d: _Data) -> str:
    w = d.workload
    text = str(w.get("model", "unknown model"))
    shape = w.get("input_shape")
    details = []
    if shape:
        details.append("input " + "x".join(str(s) for s in shape))
    if w.get("num_classes"):
        details.append(f"{w['num_classes']} classes")
    return f"{text} ({', '.join(details)})" if details else text


def _energy_of(d: _Data, row: pd.Series | None) -> dict[str, Any]:
    return (d.attrs.get(int(row["number"]), {}).get("energy") or {}) if row is not None else {}


def _summary(d: _Data) -> list[dict[str, str]]:
    """The summary, as (label, text) items shared by HTML and Markdown."""
    items = [{"label": "Device", "text": _device_text(d)}, {"label": "Model", "text": _model_text(d)}]
    best, base, cfg = d.best, d.baseline, d.config or {}
    from autotune.search.goal import goal_of_config

    items.append({"label": "Objective", "text": goal_of_config(cfg).text + ": the best configuration is ranked by it"})
    fixed = cfg.get("fixed_knobs") or {}
    if fixed:
        items.append({"label": "Knobs no longer explored", "text": "; ".join(
            f"{param} = {entry['value']!r} ({entry['reason']})" for param, entry in fixed.items())})
    if best is None:
        items.append({"label": "Best configuration", "text": "none: no configuration completed"})
    else:
        items.append({"label": "Best configuration", "text": f"{best['config']} (trial #{int(best['number'])})"})
        rate = f"{fmt_rate(best['samples_per_s'])} samples/s"
        rate += f" (FP32 baseline: {fmt_rate(base['samples_per_s'])} samples/s)" if base is not None else \
            " (the FP32 baseline did not complete)"
        items.append({"label": "Throughput", "text": rate})
        if _num(best.get("ddp_world_size")):
            items.append({"label": "Data parallel (DDP)", "text": _ddp_text(best, d.device)})
        if best.get("data_bound") is not None and not pd.isna(best.get("data_bound")):
            items.append({"label": "Data pipeline", "text": _data_text(best, d.device)})
        if (_num(best.get("compile_s")) or 0.0) > 0:
            # paid once per training run, before the first step; not in the step time above
            items.append({"label": "Compile time", "text": (
                f"{fmt_s(best['compile_s'])} once, in the first steps (compiling and/or capturing the "
                "CUDA graph), before the throughput above is reached")})
        speedup = cfg.get("speedup_vs_baseline")
        if speedup is None and base is not None:
            speedup = best["samples_per_s"] / base["samples_per_s"]
        items.append({"label": "Speed-up over the FP32 baseline",
                      "text": fmt_ratio(speedup) if speedup is not None else "no baseline to compare with"})
        items.append({"label": "Peak memory", "text": _memory_text(best, base)})
        note = (cfg.get("baseline") or {}).get("note")
        if note:
            items.append({"label": "FP32 baseline", "text": note})
        limit = (cfg.get("memory") or {}).get("limit_bytes")
        if limit:
            items.append({"label": "Memory limit", "text": f"every trial capped at {fmt_gib(limit / 2**30)} GiB (--memory-limit), "
                                                           "what lives outside PyTorch's allocator included"})
    if d.has["energy"]:
        e_best, e_base = _energy_of(d, best), _energy_of(d, base)
        if e_best.get("joules_per_sample") is not None:
            text = f"{fmt_g(e_best['joules_per_sample'], 3)} J/sample"
            if e_best.get("avg_power_w") is not None:
                text += f" at {e_best['avg_power_w']:.0f} W"
            if e_base.get("joules_per_sample") is not None:
                text += f" (baseline {fmt_g(e_base['joules_per_sample'], 3)} J/sample)"
        else:
            text = "measured on some trials, not on the best one"
        items.append({"label": "Energy", "text": text})
    else:
        items.append({"label": "Energy", "text": f"{NOT_MEASURED}"})
    if d.has["accuracy"]:
        acc = (d.attrs.get(int(best["number"]), {}).get("accuracy") or {}) if best is not None else {}
        if acc.get("accuracy_drop") is not None:
            text = f"accuracy drop {fmt_g(acc['accuracy_drop'], 3)} vs FP32"
            if acc.get("accuracy") is not None:
                text += f" (accuracy {fmt_g(acc['accuracy'])})"
            if acc.get("stable") is False:
                text += ", training was not stable"
        elif acc.get("accuracy") is not None:
            text = f"accuracy {fmt_g(acc['accuracy'])}"
        else:
            text = "measured on some trials, not on the best one"
        items.append({"label": "Accuracy", "text": text})
    else:
        items.append({"label": "Accuracy", "text": NOT_MEASURED})
    c = d.cost
    items.append({"label": "Search cost", "text": (
        f"{c.get('num_trials', 0)} trials ({c.get('num_measured', 0)} measured), "
        f"{fmt_s(c.get('trial_wall_s'))} of trials: worker start {fmt_s(c.get('worker_start_s'))}, "
        f"build {fmt_s(c.get('build_s'))}, "
        + (f"compiling {fmt_s(c['compile_s'])}, " if c.get("compile_s") else "")
        + f"warm-up {fmt_s(c.get('warmup_s'))}, measuring {fmt_s(c.get('measure_s'))}")})
    return items


def _ddp_text(best: pd.Series, device: str) -> str:
    """With --ddp N: the best trial's throughput per GPU and its scaling efficiency."""
    n = int(_num(best["ddp_world_size"]))
    unit, units = ("GPU", "GPUs") if device == "cuda" else ("process", "processes")
    return (f"{n} processes" + (", one GPU each" if device == "cuda" else " on the CPU")
            + f": {fmt_rate(best['samples_per_s'])} samples/s in total, "
            f"{fmt_rate(best['per_gpu_samples_per_s'])} per {unit}; the same configuration alone on one {unit} "
            f"(measured in the same trial) runs {fmt_rate(best['single_gpu_samples_per_s'])} samples/s, so the "
            f"scaling efficiency is {fmt_pct(best['scaling_efficiency'], 0)} ({n} {units} train "
            f"{fmt_ratio(_num(best['scaling_efficiency']) * n)} as fast as one); batch sizes are per {unit}")


def _data_text(best: pd.Series, device: str) -> str:
    """With --data: whether the DataLoader keeps the device busy, from the best trial's two rates."""
    fed, compute = fmt_rate(best["loader_fed_samples_per_s"]), fmt_rate(best["compute_only_samples_per_s"])
    unit = "GPU" if device == "cuda" else "CPU"
    wait = _num(best.get("loader_wait_share"))
    waited = f"; the step waited for data {fmt_pct(wait, 0)} of the time" if wait is not None else ""
    if str(best["data_bound"]).lower() == "true":
        workers = _num(best.get("param.dataloader.num_workers"))
        from autotune.search.findings import CONTENTION_WAIT_SHARE

        if wait is not None and wait < CONTENTION_WAIT_SHARE and workers:
            # the step seldom waited, yet ran slower than fed from memory: the workers' decoding
            # took CPU time from the training process itself (the data-bound finding says the same)
            remedy = (f"the {workers:.0f} loader workers compete with the training process for the CPUs, so a "
                      "cheaper decode (DALI, smaller or pre-resized images) or fewer workers would help")
        else:
            remedy = "more loader workers, DALI or a faster decode would help"
        return (f"data-bound: the data pipeline delivers {fed} samples/s, the {unit} could train {compute} "
                f"samples/s{waited}; {remedy}")
    return f"the data pipeline keeps the {unit} busy (loader-fed {fed} samples/s vs {compute} compute-only{waited})"


def _kpis(d: _Data) -> list[dict[str, str]]:
    """The headline figures, large at the top of the page."""
    best, base, cfg = d.best, d.baseline, d.config or {}
    if best is None:
        return []
    out = []
    speedup = cfg.get("speedup_vs_baseline")
    if speedup is None and base is not None:
        speedup = best["samples_per_s"] / base["samples_per_s"]
    if speedup is not None:
        out.append({"key": "speedup", "value": repr(float(speedup)), "text": fmt_ratio(speedup),
                    "label": "speed-up over the FP32 baseline"})
    out.append({"key": "best-rate", "value": repr(float(best["samples_per_s"])),
                "text": fmt_rate(best["samples_per_s"]), "label": "samples/s, best"})
    if base is not None:
        out.append({"key": "baseline-rate", "value": repr(float(base["samples_per_s"])),
                    "text": fmt_rate(base["samples_per_s"]), "label": "samples/s, FP32 baseline"})
        b, r = _num(best.get("peak_memory_gb")), _num(base.get("peak_memory_gb"))
        if b is not None and r:
            out.append({"key": "memory-ratio", "value": repr(b / r), "text": fmt_ratio(b / r),
                        "label": f"peak memory vs baseline ({fmt_gib(b)} GiB)"})
    joules = _energy_of(d, best).get("joules_per_sample")
    if joules is not None:
        out.append({"key": "joules", "value": repr(float(joules)), "text": fmt_g(joules, 3),
                    "label": "J/sample, best"})
    drop = ((d.attrs.get(int(best["number"]), {}).get("accuracy") or {}).get("accuracy_drop"))
    if drop is not None:
        out.append({"key": "accuracy-drop", "value": repr(float(drop)), "text": fmt_g(drop, 3),
                    "label": "accuracy drop, best"})
    c = d.cost
    out.append({"key": "trials", "value": str(c.get("num_trials", 0)), "text": str(c.get("num_trials", 0)),
                "label": f"trials, {fmt_s(c.get('trial_wall_s'))}"})
    return out


def _memory_text(best: pd.Series, base: pd.Series | None) -> str:
    b = _num(best.get("peak_memory_gb"))
    if b is None:
        return "not recorded"
    text = f"{fmt_gib(b)} GiB"
    if base is None or _num(base.get("peak_memory_gb")) is None:
        return text
    r = _num(base["peak_memory_gb"])
    diff = r - b
    if abs(diff) < 0.005:
        return text + f", the same as the baseline ({fmt_gib(r)} GiB)"
    if diff > 0:
        return text + f", {fmt_gib(diff)} GiB less than the baseline's {fmt_gib(r)} GiB ({fmt_pct(diff / r, 0)} saved)"
    return text + f", {fmt_gib(-diff)} GiB more than the baseline's {fmt_gib(r)} GiB ({b / r:.2f}× the memory)"


_STATE_WORDS = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running",
                "WAITING": "waiting"}


def _is_ddp(d: _Data) -> bool:
    """Whether the study measured DDP steps (--ddp): its rates are then totals over its GPUs."""
    return bool(pd.to_numeric(d.frame["ddp_world_size"], errors="coerce").fillna(0).gt(1).any())


def _trial_rows(d: _Data) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The table of all trials: (columns, rows); each cell has its text and a sort value."""
    cols = [("number", "#", "number"), ("role", "role", "text"), ("state", "state", "text"),
            ("config", "configuration", "text"), ("samples_per_s", "samples/s", "number"),
            ("step_time_ms", "step ms", "number"), ("spread", "spread", "number"),
            ("peak_memory_gb", "peak GiB", "number")]
    if _is_ddp(d):
        cols[5:5] = [("per_gpu_samples_per_s", "samples/s per GPU", "number"),
                     ("scaling_efficiency", "scaling efficiency", "number")]
    if d.has["energy"]:
        cols.append(("joules_per_sample", "J/sample", "number"))
    if d.has["accuracy"]:
        cols.append(("accuracy_drop", "accuracy drop", "number"))
    if (pd.to_numeric(d.frame["compile_s"], errors="coerce").fillna(0) > 0).any():
        cols.append(("compile_s", "compile s", "number"))
    cols += [("reason", "reason", "text"), ("trial_wall_s", "time s", "number")]
    formats = {"samples_per_s": fmt_rate, "per_gpu_samples_per_s": fmt_rate,
               "scaling_efficiency": lambda v: fmt_pct(v, 0), "step_time_ms": fmt_ms, "spread": lambda v: fmt_pct(v, 1),
               "peak_memory_gb": fmt_gib, "joules_per_sample": lambda v: fmt_g(v, 3),
               "accuracy_drop": lambda v: fmt_g(v, 3), "trial_wall_s": lambda v: fmt_g(v, 3),
               "compile_s": lambda v: fmt_g(v, 3)}
    best_n = int(d.best["number"]) if d.best is not None else None
    rows = []
    for _, r in d.frame.sort_values("number").iterrows():
        cells = []
        for key, _, kind in cols:
            v = r.get(key)
            if key == "state":
                text = _STATE_WORDS.get(r["state"], r["state"].lower())
                if r.get("status") and r["status"] != "ok":
                    text += f" ({r['status']})"
                if r.get("unstable"):
                    text += " (unstable)"
            elif key == "reason":
                text = "; ".join(x for x in (str(r.get("reason") or ""), r.get("note") or "") if x)
            elif key == "number":
                text = str(int(v))
            elif key in formats:
                text = formats[key](v)
            else:
                text = "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
            if kind == "number":
                value = "" if _num(v) is None else repr(_num(v))
            else:
                value = text
            cell = {"key": key, "text": text, "value": value}
            if key == "trial_wall_s" and _num(v) is not None:
                cell["title"] = (f"worker start {fmt_s(r.get('worker_start_s'))}, build {fmt_s(r.get('build_s'))}, "
                                 + (f"compiling {fmt_s(r['compile_s'])}, " if (_num(r.get("compile_s")) or 0) > 0 else "")
                                 + f"warm-up {fmt_s(r.get('warmup_s'))}, measuring {fmt_s(r.get('measure_s'))}")
            if key == "spread" and r.get("noisy") is True:
                cell["title"] = "noisy: p90-p10 above the tolerance after re-measuring"
                cell["text"] += " ⚠"
            cells.append(cell)
        css = {"COMPLETE": "ok", "PRUNED": "pruned", "FAIL": "failed"}.get(r["state"], "other")
        if int(r["number"]) == best_n:
            css += " best"
        if r.get("role") == "baseline":
            css += " baseline"
        rows.append({"number": int(r["number"]), "css": css, "cells": cells})
    return [{"key": k, "label": label, "type": kind} for k, label, kind in cols], rows


def _failed(d: _Data) -> list[dict[str, Any]]:
    rows = []
    for _, r in d.frame.sort_values("number").iterrows():
        if r["state"] in ("PRUNED", "FAIL"):
            reason = "; ".join(x for x in (str(r.get("reason") or ""), r.get("note") or "") if x)
            rows.append({"number": int(r["number"]), "state": _STATE_WORDS[r["state"]], "status": r.get("status") or "",
                         "config": r.get("config") or "", "reason": reason or "no reason recorded"})
    return rows


# knobs that exist only on the other kind of device: not worth listing as "fixed"
_IRRELEVANT = {"cuda": ("threads",), "cpu": ("channel_alignment", "cudnn", "streams")}


def _knob_effects(d: _Data) -> tuple[list[dict[str, Any]], list[str]]:
    """Per knob with more than one value among the measured trials: median and best samples/s
    by value. Knobs that took one value are listed as fixed."""
    effects, fixed = [], []
    m = d.measured
    for knob in KNOBS:
        col = f"knob.{knob.key}"
        if m.empty or col not in m or m[col].isna().all():
            continue
        values = m[col].dropna()
        distinct = sorted(set(values), key=_sort_key)
        if len(distinct) < 2:
            if knob.key in _IRRELEVANT.get(d.device, ()):
                continue
            fixed.append(f"{knob.label} = {_value_label(distinct[0])}")
            continue
        rows = []
        for value in distinct:
            rates = m.loc[m[col] == value, "samples_per_s"].astype(float)
            rows.append({"value": value, "label": _value_label(value), "n": int(rates.size),
                         "median": float(rates.median()), "best": float(rates.max())})
        effects.append({"key": knob.key, "label": knob.label, "rows": rows})
    return effects, fixed


def _sort_key(v: Any) -> tuple:
    if isinstance(v, str) and v in PRECISION_ORDER:
        return (0, PRECISION_ORDER.index(v), "")
    if isinstance(v, (int, float)):
        return (1, float(v), "")
    return (2, 0, str(v))


def _findings(d: _Data) -> list[dict[str, Any]]:
    """Each distinct finding once, with the trials that report it; the best trial's first."""
    order = [int(d.best["number"])] if d.best is not None else []
    if d.baseline is not None:
        order.append(int(d.baseline["number"]))
    order += sorted(n for n in d.attrs if n not in order)
    seen: dict[str, list[int]] = {}
    for n in order:
        for text in d.attrs[n].get("findings") or []:
            seen.setdefault(str(text), []).append(n)
    reporting = sum(1 for a in d.attrs.values() if a.get("findings"))

    def which(numbers: list[int]) -> str:
        if len(numbers) == reporting > 3:
            return f"all {reporting} trials that report findings"
        shown = ", ".join(f"#{n}" for n in sorted(numbers)[:8])
        return shown + (f" and {len(numbers) - 8} more" if len(numbers) > 8 else "")

    return [{"text": text, "trials": which(ns)} for text, ns in seen.items()]


def _profile(d: _Data) -> list[dict[str, Any]]:
    """The profiled trials to compare: the baseline and the best when profiled, else the fastest profiled."""
    chosen = []
    for label, row in (("baseline", d.baseline), ("best", d.best)):
        if row is not None and d.attrs[int(row["number"])].get("profile"):
            chosen.append((label, int(row["number"])))
    if not chosen:
        profiled = [n for n, a in d.attrs.items() if a.get("profile")]
        rates = {n: (d.attrs[n].get("figures") or {}).get("samples_per_s") or 0 for n in profiled}
        chosen = [("fastest profiled", max(profiled, key=lambda n: rates[n]))] if profiled else []
    out = []
    for label, n in chosen:
        p = d.attrs[n]["profile"]
        parts = [{"label": name, "share": _num(p.get(key)), "color": color} for key, name, color in PROFILE_PARTS]
        known = sum(x["share"] or 0 for x in parts)
        if known < 0.995:
            parts.append({"label": "other", "share": max(0.0, 1 - known), "color": "#eeeeee"})
        out.append({
            "label": f"{label} (#{n})", "number": n,
            "config": describe(d.attrs[n]["knobs"]) if d.attrs[n].get("knobs") else "",
            "parts": parts,
            "kernels_per_step": p.get("kernels_per_step"),
            "copy_overlap": p.get("copy_overlap"),
            "top_kernels": [{"name": str(k.get("name", "")), "share": fmt_pct(k.get("share"))}
                            for k in (p.get("top_kernels") or [])[:10]],
        })
    return out


def _snippet(d: _Data) -> str:
    """The README's training loop, with this report's config path and model."""
    model = str(d.workload.get("model", "your_model"))
    path = d.out_dir / "config.json"
    if ":" in model:
        module, factory = model.split(":", 1)
        imports = f"import torch\nimport autotune\nfrom {module} import {factory}\n"
        build = f"model = {factory}()  # the model you tuned (--model {model})"
    else:
        imports = "import torch, torchvision\nimport autotune\n"
        build = f"model = torchvision.models.{model}(num_classes={d.workload.get('num_classes', 1000)})"
    if _is_ddp(d):
        # --ddp N: the script runs once per GPU under torchrun, in a process group, each rank on its shard
        n = int(pd.to_numeric(d.frame["ddp_world_size"], errors="coerce").max())
        backend = "nccl" if d.device == "cuda" else "gloo"
        imports = imports.replace("import torch", "import torch, torch.distributed as dist", 1)
        group = f'dist.init_process_group("{backend}")  # launch: torchrun --nproc-per-node {n} train.py\n'
        done = "padding, memory format, flags, device, DDP wrap"
        feed = ("sampler = torch.utils.data.distributed.DistributedSampler(dataset)  # your dataset, a shard per rank\n"
                "loader = torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler,  # per GPU\n")
    else:
        group, done = "", "padding, memory format, backend flags, device"
        feed = "loader = torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True,  # your dataset\n"
    return (
        f"{imports}\n"
        f"{group}"
        f"cfg = autotune.load({json.dumps(str(path))})\n"
        f"{build}\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=cfg.scaled_lr(0.1), momentum=0.9)\n"
        f"model, optimizer = cfg.prepare(model, optimizer)  # {done}\n"
        "scaler = cfg.grad_scaler()                        # a GradScaler, disabled unless fp16 needs it\n"
        "loss_fn = torch.nn.CrossEntropyLoss()\n"
        f"{feed}"
        "                                     **cfg.dataloader_kwargs(num_workers=4))  # workers, pinning: tuned with --data\n"
        "for x, y in cfg.loader(loader):               # to the device, in the tuned memory format and streams\n"
        "    optimizer.zero_grad(set_to_none=True)\n"
        "    with cfg.autocast():\n"
        "        loss = loss_fn(model(x), y)\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(optimizer)\n"
        "    scaler.update()\n"
    )


# ----------------------------------------------------------------------------------------------
# plots: matplotlib figures rendered to inline SVG


@dataclass
class _Plot:
    name: str
    title: str
    svg: str
    caption: str = ""


def _figure(width: float, height: float, ncols: int = 1) -> tuple[Figure, Any]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=True)
    for ax in (axes if ncols > 1 else [axes]):
        ax.grid(True, color="#e5e5e5", linewidth=0.6)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    return fig, axes


_RC = {"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8,
       "xtick.labelsize": 8, "ytick.labelsize": 8, "svg.fonttype": "path"}


def inline_svg(fig: Figure, name: str) -> str:
    """The figure as an <svg> element fit to inline in HTML: no XML prolog, DOCTYPE, namespace
    URLs or metadata, and ids unique to this plot (several SVGs share one document)."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": f"autotune-{name}"}):
        fig.savefig(buf, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r'\s+xmlns(:xlink)?="[^"]*"', "", text, count=2)
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    text = re.sub(r"<style[^>]*>.*?</style>", "", text, flags=re.S)  # moved to the page's CSS
    text = re.sub(r'<g id="[^"]*"', "<g", text)  # figure_1, axes_1, ... would repeat in every plot
    text = text.replace("<svg ", f'<svg role="img" aria-label="{html.escape(name)}" ', 1)
    return text.strip()


def _pareto(xs: list[float], ys: list[float], x_low: bool, y_high: bool = True) -> list[int]:
    """Indices of the points no other point beats on both axes."""
    def better_eq(a: float, b: float, low: bool) -> bool:
        return a <= b if low else a >= b

    front = []
    for i in range(len(xs)):
        dominated = any(
            better_eq(xs[j], xs[i], x_low) and better_eq(ys[j], ys[i], not y_high)
            and (xs[j] != xs[i] or ys[j] != ys[i])
            for j in range(len(xs)))
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: xs[i])


def _scatter(ax, m: pd.DataFrame, x: str, y: str) -> None:
    """Measured trials, coloured by precision, shaped by memory format."""
    for (mode, fmt), group in m.groupby(["knob.precision", "knob.memory_format"], sort=False, dropna=False):
        flagged = group["unstable"].astype(bool)
        stable, unstable = group[~flagged], group[flagged]
        ax.scatter(stable[x], stable[y], s=34, color=PRECISION_COLORS.get(mode, "#333333"),
                   marker=FORMAT_MARKERS.get(fmt, "D"), alpha=0.85, edgecolors="white", linewidths=0.6,
                   label=f"{mode}, {fmt}", zorder=3)
        if not unstable.empty:
            ax.scatter(unstable[x], unstable[y], s=34, color=PRECISION_COLORS.get(mode, "#333333"), marker="x",
                       label=f"{mode}, {fmt} (unstable)", zorder=3)


def _label_points(ax, d: _Data, m: pd.DataFrame, x: str, y: str) -> None:
    """Mark best and baseline, with text placed away from the data's edge."""
    xs, ys = m[x].astype(float), m[y].astype(float)
    x_mid = (xs.min() + xs.max()) / 2
    y_mid = (ys.min() + ys.max()) / 2
    best_n = int(d.best["number"]) if d.best is not None else None
    base_n = int(d.baseline["number"]) if d.baseline is not None else None
    for n, text, color in ((best_n, "best", "#b30000"), (base_n, "baseline", "#222222")):
        if n is None or n not in set(m["number"]):
            continue
        row = m[m["number"] == n].iloc[0]
        if n == best_n and n == base_n:
            text = "best = baseline"
        elif n == base_n and best_n is not None and best_n in set(m["number"]):
            other = m[m["number"] == best_n].iloc[0]
            if other[x] == row[x] and other[y] == row[y]:
                continue
        px, py = float(row[x]), float(row[y])
        dx = -14 if px > x_mid else 14
        dy = -16 if py > y_mid else 14
        if text == "baseline":
            dy = -dy if best_n is not None and abs(py - float(d.best[y] if d.best is not None else py)) < 1e-9 else dy
        ax.scatter([px], [py], s=110, facecolors="none", edgecolors=color, linewidths=1.4, zorder=4)
        ax.annotate(f"{text} #{n}", (px, py), xytext=(dx, dy), textcoords="offset points",
                    ha="right" if dx < 0 else "left", va="top" if dy < 0 else "bottom", fontsize=8,
                    color=color, fontweight="bold", zorder=5,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8},
                    arrowprops={"arrowstyle": "-", "color": color, "lw": 0.8})


def _front_line(ax, m: pd.DataFrame, x: str, y: str, x_low: bool) -> int:
    stable = m[~m["unstable"].astype(bool)]
    xs, ys = stable[x].astype(float).tolist(), stable[y].astype(float).tolist()
    idx = _pareto(xs, ys, x_low=x_low)
    if idx:
        fx, fy = [xs[i] for i in idx], [ys[i] for i in idx]
        ax.plot(fx, fy, color="#b30000", linewidth=1.2, linestyle="--", alpha=0.8, zorder=2,
                drawstyle="steps-post" if x_low else "steps-pre", label="Pareto front")
        ax.scatter(fx, fy, s=70, facecolors="none", edgecolors="#b30000", linewidths=0.9, zorder=2)
    return len(idx)


def _legend(ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # outside the axes, so it never hides a point
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0.0)


def _front_plot(d: _Data, column: str, xlabel: str, name: str, height: float) -> tuple[str, int, int] | None:
    """samples/s against a cost to minimise (memory, energy), with the Pareto front dashed:
    (svg, configurations on the front, configurations plotted)."""
    m = d.measured[d.measured[column].notna()]
    if m.empty:
        return None
    with matplotlib.rc_context(_RC):
        fig, ax = _figure(7.2, height)
        n = _front_line(ax, m, column, "samples_per_s", x_low=True)
        _scatter(ax, m, column, "samples_per_s")
        _label_points(ax, d, m, column, "samples_per_s")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("samples/s")
        ax.ticklabel_format(axis="both", useOffset=False, style="plain")
        ax.margins(x=0.15, y=0.15)
        _legend(ax)
        return inline_svg(fig, name), n, len(m)


def _plot_throughput_memory(d: _Data) -> _Plot | None:
    made = _front_plot(d, "peak_memory_gb", "peak memory (GiB)", "throughput-memory", 4.2)
    if made is None:
        return None
    svg, n, count = made
    return _Plot("throughput-memory", "Throughput versus peak memory", svg,
                 f"{count} measured configurations; the dashed line is the Pareto front ({n} configurations "
                 "no other one beats on both speed and memory).")


def _plot_speed_accuracy(d: _Data) -> _Plot | None:
    m = d.measured
    use_drop = "accuracy_drop" in m and m["accuracy_drop"].notna().any()
    col = "accuracy_drop" if use_drop else "accuracy"
    m = m[m[col].notna()] if col in m else m.iloc[0:0]
    if m.empty:
        return None
    with matplotlib.rc_context(_RC):
        fig, ax = _figure(7.2, 4.2)
        n = _front_line(ax, m, col, "samples_per_s", x_low=use_drop)
        _scatter(ax, m, col, "samples_per_s")
        _label_points(ax, d, m, col, "samples_per_s")
        ax.set_xlabel("accuracy drop vs FP32 (lower is better)" if use_drop else "accuracy (higher is better)")
        ax.set_ylabel("samples/s")
        ax.margins(x=0.15, y=0.15)
        _legend(ax)
        svg = inline_svg(fig, "speed-accuracy")
    return _Plot("speed-accuracy", "Speed versus accuracy", svg,
                 f"{len(m)} configurations with an accuracy check; the dashed line is the Pareto front ({n}).")


def _bars(ax, labels: list[str], best: list[float], median: list[float], counts: list[int], colors: list[str],
          offset: float = 0.0, width: float = 0.8, legend: str | None = None) -> None:
    xs = [i + offset for i in range(len(labels))]
    ax.bar(xs, best, width=width, color=colors, edgecolor="white", linewidth=0.5, label=legend, zorder=2)
    ax.scatter(xs, median, marker="_", s=220 * width, color="#111111", linewidths=1.6, zorder=3)
    for x, b, n in zip(xs, best, counts):
        ax.annotate(f"n={n}" if n else "not run", (x, b), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize=7, color="#444444")


def _plot_precision_format(d: _Data) -> _Plot | None:
    m = d.measured
    if m.empty:
        return None
    modes = sorted(m["knob.precision"].dropna().unique(), key=_sort_key)
    formats = [f for f in ("contiguous", "channels_last") if f in set(m["knob.memory_format"])]
    formats += sorted(set(m["knob.memory_format"].dropna()) - set(formats))
    with matplotlib.rc_context(_RC):
        fig, ax = _figure(max(4.2, 1.3 + 1.2 * len(modes) * max(1, len(formats)) * 0.6), 3.4)
        width = 0.8 / max(1, len(formats))
        for j, fmt in enumerate(formats):
            best, median, counts, labels = [], [], [], []
            for mode in modes:
                rates = m.loc[(m["knob.precision"] == mode) & (m["knob.memory_format"] == fmt), "samples_per_s"]
                labels.append(mode)
                best.append(float(rates.max()) if len(rates) else 0.0)
                median.append(float(rates.median()) if len(rates) else float("nan"))
                counts.append(int(len(rates)))
            offset = (j - (len(formats) - 1) / 2) * width
            _bars(ax, labels, best, median, counts, [FORMAT_COLORS.get(fmt, "#999999")] * len(labels),
                  offset=offset, width=width * 0.95, legend=fmt)
        ax.set_ylim(0, 1.15 * float(m["samples_per_s"].max()))  # room for the n= labels
        ax.set_xticks(range(len(modes)), modes)
        ax.set_xlim(-0.6, len(modes) - 0.4)
        ax.set_ylabel("samples/s (bar: best, line: median)")
        ax.legend(title="memory format", loc="lower left", bbox_to_anchor=(0.0, 1.02), ncols=len(formats),
                  frameon=False, borderaxespad=0.0)
        svg = inline_svg(fig, "knob-precision-memory_format")
    return _Plot("knob-precision-memory_format", "Precision × memory format", svg,
                 "Best (bar) and median (black line) samples/s of the measured configurations; n: how many.")


def _plot_knob(effect: dict[str, Any]) -> _Plot:
    rows = effect["rows"]
    name = f"knob-{effect['key']}"
    with matplotlib.rc_context(_RC):
        fig, ax = _figure(3.3, 2.5)
        _bars(ax, [r["label"] for r in rows], [r["best"] for r in rows], [r["median"] for r in rows],
              [r["n"] for r in rows], ["#4c78a8"] * len(rows))
        ax.set_ylim(0, 1.15 * max(r["best"] for r in rows))  # room for the n= labels
        ax.set_xticks(range(len(rows)), [r["label"] for r in rows])
        ax.set_title(effect["label"])
        ax.set_ylabel("samples/s")
        svg = inline_svg(fig, name)
    return _Plot(name, effect["label"], svg)


def _plot_batch(d: _Data) -> _Plot | None:
    m = d.measured[d.measured["knob.batch_size"].notna()]
    if m.empty:
        return None
    with matplotlib.rc_context(_RC):
        fig, (ax_rate, ax_mem) = _figure(8.0, 3.4, ncols=2)
        batches = sorted({int(b) for b in m["knob.batch_size"]})
        for mode in sorted(m["knob.precision"].dropna().unique(), key=_sort_key):
            sub = m[m["knob.precision"] == mode]
            # the fastest configuration at each batch size, and the memory that one needed
            top = sub.loc[sub.groupby("knob.batch_size")["samples_per_s"].idxmax()].sort_values("knob.batch_size")
            color = PRECISION_COLORS.get(mode, "#333333")
            ax_rate.plot(top["knob.batch_size"], top["samples_per_s"], marker="o", color=color, label=mode)
            ax_mem.plot(top["knob.batch_size"], top["peak_memory_gb"], marker="o", color=color, label=mode)
        for ax in (ax_rate, ax_mem):
            if len(batches) > 1 and batches[0] > 0:
                ax.set_xscale("log", base=2)
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.minorticks_off()
            ax.set_xlabel("batch size")
            ax.margins(y=0.15)
            ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        if len(batches) > 8:
            for ax in (ax_rate, ax_mem):
                ax.tick_params(axis="x", labelrotation=45)
        ax_rate.set_ylabel("samples/s")
        ax_mem.set_ylabel("peak memory (GiB)")
        ax_rate.set_title("throughput")
        ax_mem.set_title("memory")
        ax_rate.legend(title="precision", frameon=False)
        svg = inline_svg(fig, "batch-size")
    return _Plot("batch-size", "Throughput and memory versus batch size", svg,
                 "One line per precision: the fastest configuration measured at each batch size.")


def _plot_energy(d: _Data) -> _Plot | None:
    made = _front_plot(d, "joules_per_sample", "energy per sample (J)", "energy", 3.8)
    if made is None:
        return None
    svg, n, count = made
    return _Plot("energy", "Throughput versus energy per sample", svg,
                 f"{count} configurations with energy measured; dashed: Pareto front ({n}).")


def _plot_profile(profiles: list[dict[str, Any]]) -> _Plot | None:
    if not profiles:
        return None
    with matplotlib.rc_context(_RC):
        fig, ax = _figure(7.2, 1.0 + 0.55 * len(profiles))
        ax.grid(False)
        labels = [p["label"] for p in profiles]
        for i, p in enumerate(profiles):
            left = 0.0
            for part in p["parts"]:
                share = part["share"] or 0.0
                ax.barh(i, share, left=left, color=part["color"], edgecolor="white", linewidth=0.6,
                        label=part["label"] if i == 0 else None)
                if share >= 0.06:
                    ax.text(left + share / 2, i, f"{100 * share:.0f}%", ha="center", va="center", fontsize=7)
                left += share
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.xaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_xlabel("share of GPU time per step")
        handles, names = ax.get_legend_handles_labels()
        fig.legend(handles, names, loc="outside lower center", ncols=4, frameon=False)
        svg = inline_svg(fig, "profile")
    return _Plot("profile", "Where the step time goes", svg)


# ----------------------------------------------------------------------------------------------
# rendering


def _context(d: _Data) -> dict[str, Any]:
    effects, fixed = _knob_effects(d)
    profiles = _profile(d)
    columns, rows = _trial_rows(d)
    plots_knobs = [p for p in [_plot_precision_format(d)] if p is not None]
    plots_knobs += [_plot_knob(e) for e in effects if e["key"] not in ("precision", "memory_format", "batch_size")]
    cfg = d.config or {}
    title_device = _title_device(d)
    return {
        "title": f"autotune report: {d.workload.get('model', 'model')} on {title_device}",
        "generated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "version": autotune.__version__,
        "study_name": d.study_name,
        "completed": d.best is not None,
        "summary": _summary(d),
        "kpis": _kpis(d),
        "notes": cfg.get("notes") or [],
        "failed": _failed(d),
        "has": d.has,
        "not_measured": NOT_MEASURED,
        "plot_accuracy": _plot_speed_accuracy(d),
        "plot_memory": _plot_throughput_memory(d),
        "plots_knobs": plots_knobs,
        "fixed_knobs": fixed,
        "plot_batch": _plot_batch(d),
        "plot_energy": _plot_energy(d),
        "plot_profile": _plot_profile(profiles),
        "profiles": profiles,
        "findings": _findings(d),
        "columns": columns,
        "rows": rows,
        "command": cfg.get("command"),
        "snippet": _snippet(d) if d.config else None,
        "config_path": str(d.out_dir / "config.json"),
    }


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("autotune.report", "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def render_html(d: _Data) -> str:
    return _environment().get_template("report.html.j2").render(**_context(d))


def _md(text: Any) -> str:
    """One Markdown table cell or line: no HTML, no table breaks."""
    s = " ".join(str(text).split())
    return re.sub(r"([\\`*\[\]<>|])", r"\\\1", s)


def _md_table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_md(h) for h in header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return lines


def render_markdown(d: _Data) -> str:
    cfg = d.config or {}
    title_device = _title_device(d)
    out = [f"# autotune report: {_md(d.workload.get('model', 'model'))} on {_md(title_device)}", ""]
    if d.best is None:
        out += ["**No configuration completed**, so nothing was exported"
                + (": the reasons are listed below." if _failed(d) else "."), ""]
    for item in _summary(d):
        out.append(f"- **{_md(item['label'])}:** {_md(item['text'])}")
    for note in cfg.get("notes") or []:
        out.append(f"- **Note:** {_md(note)}")
    out.append("")

    if d.best is not None:
        extra_cols = (["J/sample"] if d.has["energy"] else []) + (["accuracy drop"] if d.has["accuracy"] else [])
        out += ["## Best vs baseline", ""]

        def line(label: str, r: pd.Series) -> list[Any]:
            cells = [label, f"#{int(r['number'])}", r["config"], fmt_rate(r["samples_per_s"]),
                     fmt_ms(r["step_time_ms"]), fmt_gib(r["peak_memory_gb"])]
            if d.has["energy"]:
                cells.append(fmt_g(r.get("joules_per_sample"), 3))
            if d.has["accuracy"]:
                cells.append(fmt_g(r.get("accuracy_drop"), 3))
            return cells

        rows = [line("best", d.best)]
        if d.baseline is not None:
            rows.append(line("baseline", d.baseline))
            b, r = d.best, d.baseline
            ratio = ["best / baseline", "", "", fmt_ratio(b["samples_per_s"] / r["samples_per_s"]),
                     fmt_ratio(b["step_time_ms"] / r["step_time_ms"]) if _num(r["step_time_ms"]) else "",
                     fmt_ratio(b["peak_memory_gb"] / r["peak_memory_gb"]) if _num(r["peak_memory_gb"]) else ""]
            if d.has["energy"]:
                e_b, e_r = _num(b.get("joules_per_sample")), _num(r.get("joules_per_sample"))
                ratio.append(fmt_ratio(e_b / e_r) if e_b is not None and e_r else "")
            if d.has["accuracy"]:
                ratio.append("")
            rows.append(ratio)
        out += _md_table(["", "trial", "configuration", "samples/s", "step ms", "peak GiB", *extra_cols], rows)
        out.append("")

        from autotune.search.goal import goal_of_config

        ranking = goal_of_config(cfg)  # the top configurations under the search's objective
        top = d.measured.sort_values(ranking.column, ascending=not ranking.maximize).head(10)
        base_rate = _num(d.baseline["samples_per_s"]) if d.baseline is not None else None
        out += ["## Top 10 configurations", ""]
        ddp = _is_ddp(d)  # --ddp: total samples/s, per GPU, and scaling efficiency versus one GPU
        out += _md_table(
            ["rank", "trial", "role", "configuration", "samples/s",
             *(["samples/s per GPU", "scaling efficiency"] if ddp else []),
             "step ms", "spread", "peak GiB", "vs baseline"],
            [[i + 1, f"#{int(r['number'])}", r["role"],
              r["config"] + (" (unstable: loss not finite, never chosen as best)" if r["unstable"] else ""),
              fmt_rate(r["samples_per_s"]),
              *([fmt_rate(r["per_gpu_samples_per_s"]), fmt_pct(r["scaling_efficiency"], 0)] if ddp else []),
              fmt_ms(r["step_time_ms"]), fmt_pct(r["spread"]), fmt_gib(r["peak_memory_gb"]),
              fmt_ratio(r["samples_per_s"] / base_rate) if base_rate else ""]
             for i, (_, r) in enumerate(top.iterrows())])
        out.append("")

        effects, fixed = _knob_effects(d)
        out += ["## Effect of each knob", "",
                "Median and best samples/s of the measured configurations, by the value of one knob.", ""]
        for e in effects:
            out += [f"### {_md(e['label'])}", ""]
            out += _md_table([e["label"], "trials", "median samples/s", "best samples/s"],
                             [[r["label"], r["n"], fmt_rate(r["median"]), fmt_rate(r["best"])] for r in e["rows"]])
            out.append("")
        if fixed:
            out += ["Fixed in this search: " + _md("; ".join(fixed)) + ".", ""]

    findings = _findings(d)
    if findings:
        out += ["## Findings", ""] + [f"- {_md(f['text'])} ({_md(f['trials'])})" for f in findings] + [""]

    failed = _failed(d)
    out += ["## Failed and pruned trials", ""]
    if failed:
        out += _md_table(["trial", "state", "configuration", "reason"],
                         [[f"#{f['number']}", f"{f['state']} ({f['status']})" if f["status"] else f["state"],
                           f["config"], f["reason"]] for f in failed])
    else:
        out.append("None.")
    out.append("")

    if cfg.get("command"):
        out += ["## Reproduce", "", "The search:", "", "```bash", str(cfg["command"]), "```", "",
                "The tuned configuration in your training loop:", "", "```python", _snippet(d).rstrip(), "```", ""]
    out += [f"Study `{d.study_name}`, {len(d.frame)} trials; report by autotune {autotune.__version__}.", ""]
    return "\n".join(out)


def write_report(study: optuna.Study, out_dir: Path, config: dict | None = None) -> dict[str, Path]:
    """Write report.html and report.md for ``study`` into ``out_dir``.

    ``config`` is that folder's parsed config.json, or None when no trial completed (the report
    then says so and still lists every trial with its reason). Returns the paths by file name.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = _collect(study, out_dir, config)
    files = {"report.html": out_dir / "report.html", "report.md": out_dir / "report.md"}
    files["report.html"].write_text(render_html(data), encoding="utf-8")
    files["report.md"].write_text(render_markdown(data), encoding="utf-8")
    return files
