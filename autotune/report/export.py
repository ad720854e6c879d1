"""Write the output folder: config.json (the best configuration, ready for autotune.load) and
trials.csv (every trial with its state, reason and figures)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

import autotune
import strategies
from autotune.accuracy.study.gate import SETTINGS_ATTR, UNAVAILABLE_ATTR, accuracy_of
from autotune.accuracy.study.plan import PLAN_ATTR
from autotune.deploy import compile_cache
from autotune.deploy.config import TunedConfig
from autotune.space import SearchSpace
from autotune.report.format import describe, warm_source
from autotune.search.trials import (baseline_trial, best_trial, best_without_memory_knobs, plain_recipe_trial,
                                    search_cost)
from autotune.trial.record import TrialRecord
from autotune.workload.units import ATTR as UNITS_ATTR, Units


def _why_it_ran(record: TrialRecord) -> dict[str, Any]:
    """trials.csv's columns on why a trial ran: the finding that queued it, and why the planner ran it
    when it did (autotune.search.planner: its words, predicted value and cost)."""
    planned = record.planned or {}
    return {"steered_by": f"#{record.steered_by['trial']} {record.steered_by['rule']}" if record.steered_by else "",
            "planned_why": planned.get("why") or ("" if record.role else "sampled by TPE: nothing was queued"),
            "planned_value": planned.get("predicted"), "planned_cost_s": planned.get("cost_s")}


def trials_frame(study: optuna.Study) -> pd.DataFrame:
    """One row per trial: identity, outcome, figures, the search's own cost, and the parameters."""
    rows = []
    units = Units.from_dict(study.user_attrs.get(UNITS_ATTR))
    for t in study.get_trials(deepcopy=False):
        record = TrialRecord.of(t)
        fig, timing = record.figures, record.timing
        row: dict[str, Any] = {
            "number": t.number,
            "role": record.role or "search",
            "state": t.state.name,
            "status": record.status if record.status is not None else t.system_attrs.get("fail_reason", ""),
            "reason": record.reason if record.reason is not None else "",
            "duplicate_of": record.duplicate_of,
            "warm_from": warm_source(record.warm_from),  # an earlier search's folder and trial (autotune.search.warm)
            "config": describe(record.knobs) if record.knobs else "",
            "samples_per_s": fig.get("samples_per_s"),
            # a language model's samples/s times its tokens per sample (sequence length); None otherwise
            "tokens_per_s": units.tokens_per_s(fig.get("samples_per_s")),
            # with --ddp N: samples_per_s is over all N GPUs; per GPU, and against the same
            # configuration alone on one GPU measured in the same trial; then the step's times
            **{name: fig.get(name) for name in (
                "ddp_world_size", "per_gpu_samples_per_s", "single_gpu_samples_per_s", "scaling_efficiency",
                "step_time_ms", "step_time_p10_ms", "step_time_p90_ms", "spread", "noisy", "num_steps")},
            "peak_memory_gb": fig["peak_memory_bytes"] / 2**30 if "peak_memory_bytes" in fig else None,
            "final_loss": fig.get("final_loss"),
            # False: the step's loss was NaN/inf; such a trial is never chosen as the best
            "loss_finite": fig.get("loss_finite"),
            # with --data: the rate the DataLoader fed (samples_per_s) against the step fed from memory
            "loader_fed_samples_per_s": fig.get("loader_fed_samples_per_s"),
            "compute_only_samples_per_s": fig.get("compute_only_samples_per_s"),
            "loader_wait_share": fig.get("loader_wait_share"),
            "data_bound": fig.get("data_bound"),
            "worker_start_s": timing.get("worker_start_s"),
            "build_s": timing.get("build_s"),
            "compile_s": timing.get("compile_s"),
            "compile_cache": timing.get("compile_cache"),
            "warmup_s": timing.get("warmup_s"),
            "measure_s": timing.get("measure_s"),
            "trial_wall_s": timing.get("wall_s"),
        }
        acc = accuracy_of(study, t) or {}
        row.update({
            "accuracy_verdict": acc.get("verdict"),
            "accuracy_reason": acc.get("reason"),
            "accuracy": acc.get("accuracy"),
            "accuracy_drop": acc.get("accuracy_drop"),
            "loss_drift": acc.get("loss_drift"),
            "loss_deviation": acc.get("loss_deviation"),  # a numerics parity check's, relative
            "accuracy_steps": acc.get("steps"),
            "accuracy_final_loss": acc.get("final_loss"),
            "skipped_steps": acc.get("skipped_steps"),
            "grad_cosine_vs_fp32": (acc.get("numerics") or {}).get("grad_cosine_vs_fp32"),
        })
        energy = record.energy or {}
        profile = record.profile or {}
        row.update({
            # NVML, over the timed steps
            "joules_per_sample": energy.get("joules_per_sample"),
            "avg_power_w": energy.get("avg_power_w"),
            "peak_power_w": energy.get("peak_power_w"),
            "avg_sm_clock_mhz": energy.get("avg_sm_clock_mhz"),
            "max_temperature_c": energy.get("max_temperature_c"),
            "throttled": energy.get("throttled"),
            # the profiled window, as shares of the timed step
            **{key: profile.get(key) for key in ("tensor_core_share", "other_gemm_conv_share", "elementwise_share",
                                                 "layout_share", "memcpy_share", "idle_share", "kernels_per_step",
                                                 "copy_overlap")},
            "findings": " | ".join(record.findings),
            **_why_it_ran(record),
        })
        row.update({f"param.{k}": v for k, v in sorted(t.params.items())})
        rows.append(row)
    return pd.DataFrame(rows)


def baseline_batch(base: optuna.trial.FrozenTrial, space: SearchSpace) -> dict[str, Any]:
    """The FP32 baseline's batch, and why it is not --base-batch-size when it is not: the baseline
    backed off to the largest batch that fits (autotune.search.memory)."""
    knob = TrialRecord.of(base).knobs["batch_size"]
    batch, steps = knob["batch_size"], knob.get("accumulation_steps", 1)
    out: dict[str, Any] = {"batch_size": batch, "accumulation_steps": steps, "base_batch_size": space.base_batch_size}
    if batch * steps != space.base_batch_size:
        out["note"] = (f"the FP32 baseline ran at batch {batch}, the largest that fits: the base batch size "
                       f"{space.base_batch_size} does not fit")
    return out


def export(study: optuna.Study, out_dir: Path, *, config, space: SearchSpace, probe: dict[str, Any],
           device: str) -> dict[str, Path]:
    """Write trials.csv and, when a trial completed, config.json (the best configuration, with the
    evidence for it) into ``out_dir``; returns the paths by file name. ``device``: the one the trials
    ran on ("cuda" or "cpu"), whose timing settings config.json records."""
    out_dir = Path(out_dir)
    files = {}
    frame = trials_frame(study)
    files["trials.csv"] = out_dir / "trials.csv"
    frame.to_csv(files["trials.csv"], index=False)
    best = best_trial(study)
    if best is None:
        return files
    info = _config_info(study, out_dir, best, config=config, space=space, probe=probe, device=device)
    cfg = TunedConfig.from_params(best.params, space, info=info)
    # a study resumed by a newer autotune: its older trials ran knobs added since at their defaults
    recorded = strategies.knobs_from_dict(TrialRecord.of(best).knobs, fill_missing=True)
    if cfg.knobs != recorded:
        raise AssertionError(f"replaying trial {best.number}'s params gives {cfg.knobs}, not {recorded}")
    files["config.json"] = out_dir / "config.json"
    cfg.save(files["config.json"])
    return files


def _config_info(study: optuna.Study, out_dir: Path, best: optuna.trial.FrozenTrial, *, config, space: SearchSpace,
                 probe: dict[str, Any], device: str) -> dict[str, Any]:
    """What config.json records besides the knobs: how the search ran, the best, baseline and plain
    recipe figures, where it ran, the search's cost, the objective and the accuracy evidence."""
    base = baseline_trial(study)
    best_record, base_record = TrialRecord.of(best), None if base is None else TrialRecord.of(base)

    from autotune.search.storage import mask_url

    url = mask_url(config.storage) if config.storage else f"sqlite:///{out_dir.resolve() / 'study.db'}"
    # what a sample is; for a language model tokens_per_s joins the figures (samples/s x sequence length)
    units = Units.from_dict(study.user_attrs.get(UNITS_ATTR) or probe)
    info: dict[str, Any] = {
        "autotune_version": autotune.__version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": config.command,
        "workload": config.workload.to_dict(),
        "input_on_device": config.input_on_device,
        # with --data the timed steps were fed by a DataLoader over it (`autotune verify` does so again)
        "data": config.data,
        "measure": config.measure_settings(device).to_dict(),
        "summary": describe(best_record.knobs),
        "units": units.to_dict(),
        "figures": units.with_tokens(best_record.figures),
        "baseline": None if base is None else {
            "summary": describe(base_record.knobs),
            "knobs": base_record.knobs,
            "figures": units.with_tokens(base_record.figures),
            "trial_number": base.number,
            **baseline_batch(base, space),
        },
        # what fits: the cap each trial ran under (--memory-limit / --memory-headroom) and the GPU's memory
        "memory": {"limit_bytes": study.user_attrs.get("memory_limit_bytes"),
                   "device_total_bytes": probe["provenance"].get("gpu_memory_bytes")},
        "provenance": probe["provenance"],
        # the optimizer class the trials stepped (the workload's: SGD for an image classifier, AdamW for a
        # language model); the optimizer knob tuned its implementation, and the exports keep it
        "optimizer": {"class": probe.get("optimizer_class")},
        "study": {"storage": url, "study_name": study.study_name, "trial_number": best.number},
        "search": search_cost(study),
    }
    if base is not None:
        b, f = base_record.figures, best_record.figures
        info["speedup_vs_baseline"] = f["samples_per_s"] / b["samples_per_s"]
        info["memory_vs_baseline"] = f["peak_memory_bytes"] / b["peak_memory_bytes"]
    plain = plain_recipe_trial(study)
    info.update(_plain_recipe_info(study, best, plain, units))
    info.update(_memory_knobs_info(study, best, units))
    _add_objective_and_accuracy(info, study, best, base)
    info["objective"]["plain_recipe_value"] = plain.value if plain is not None else None
    # the best's compile, beside config.json (autotune.search.outputs.keep_compile_cache): what it is
    # valid for and its size; cfg.prepare loads it before the first compiled step
    archive = compile_cache.describe(out_dir / compile_cache.ARCHIVE)
    if archive is not None:
        info["compile_cache"] = archive
    return info


def _plain_recipe_info(study: optuna.Study, best: optuna.trial.FrozenTrial, plain: optuna.trial.FrozenTrial | None,
                       units: Units) -> dict[str, Any]:
    """config.json's plain recipe (autotune.search.plain_recipe), the bar the recommendation must clear:
    its figures, the best's speed-up and memory over it, and whether the best is the recipe itself;
    or, where it did not complete, why (``plain_recipe_missing``; absent where the search has none)."""
    if plain is None:
        missing = plain_recipe_missing(study)
        return {"plain_recipe": None, **({"plain_recipe_missing": missing} if missing else {})}
    record, best_record = TrialRecord.of(plain), TrialRecord.of(best)
    p, f = record.figures, best_record.figures
    return {
        "plain_recipe": {"summary": describe(record.knobs), "knobs": record.knobs,
                         "figures": units.with_tokens(p), "trial_number": plain.number},
        "speedup_vs_plain_recipe": f["samples_per_s"] / p["samples_per_s"],
        "memory_vs_plain_recipe": (f["peak_memory_bytes"] / p["peak_memory_bytes"]
                                   if f.get("peak_memory_bytes") and p.get("peak_memory_bytes") else None),
        # nothing measured beat it: the recommendation is the recipe (or a trial of the same knobs)
        "best_is_plain_recipe": best.number == plain.number or best_record.knobs == record.knobs,
    }


def _memory_knobs_info(study: optuna.Study, best: optuna.trial.FrozenTrial, units: Units) -> dict[str, Any]:
    """Where the best has memory knobs on (autotune.search.levers): which, and the best of the same
    search without any of them (``without_memory_knobs``, None where none completed) with the best's
    speed-up over it; nothing otherwise."""
    from autotune.search.levers import levers_of

    best_record = TrialRecord.of(best)
    levers = levers_of(best_record.knobs or {})
    if not levers:
        return {}
    words = [strategies.BY_NAME[lever.param.split(".")[0]].words(
        {lever.param.split(".")[1]: lever.value}) or lever.param for lever in levers]
    other = best_without_memory_knobs(study)
    if other is None:
        return {"memory_knobs": words, "without_memory_knobs": None}
    record = TrialRecord.of(other)
    return {"memory_knobs": words,
            "without_memory_knobs": {"summary": describe(record.knobs), "figures": units.with_tokens(record.figures),
                                     "trial_number": other.number},
            "speedup_vs_without_memory_knobs": best_record.figures["samples_per_s"] / record.figures["samples_per_s"]}


def plain_recipe_missing(study: optuna.Study) -> str | None:
    """Why a search has no completed plain recipe, in a few words: it did not complete (and why), or it
    was queued but the search ended first; None where the search has no plain-recipe trial at all
    (one from before the recipe existed, or a device with neither bf16 nor fp16)."""
    from autotune.search.plain_recipe import ROLE

    tried = [t for t in study.get_trials(deepcopy=False) if TrialRecord.of(t).role == ROLE]
    if not tried:
        return None
    finished = [t for t in tried if TrialRecord.of(t).counted]
    if not finished:
        return f"not measured: trial #{tried[0].number} was queued, and the search ended before it ran"
    last = TrialRecord.of(finished[-1])
    if last.status == "pruned":
        return (f"did not complete: trial #{last.number} was stopped in its warm-up as clearly slower "
                "than the best")
    return f"did not complete: trial #{last.number}, {last.status}" + (f": {last.reason}" if last.reason else "")


def _add_objective_and_accuracy(info: dict[str, Any], study: optuna.Study, best: optuna.trial.FrozenTrial,
                                base: optuna.trial.FrozenTrial | None) -> None:
    """Add to ``info`` what the best was ranked by (the study's objective), the knobs the search
    stopped exploring, and the accuracy evidence for the best (or why there is none)."""
    from autotune.search.goal import goal_of
    from autotune.search.knob_effects import fixed_knobs

    target = goal_of(study)
    info["objective"] = {"name": target.name, "direction": target.direction, "unit": target.unit,
                         "value": best.value, "baseline_value": base.value if base is not None else None}
    if fixed_knobs(study):
        info["fixed_knobs"] = fixed_knobs(study)
    accuracy = accuracy_of(study, best)
    if accuracy is not None:
        # the evidence that this configuration trains as well as FP32 (steps, loss, accuracy,
        # drop versus FP32, skipped steps), and how the check ran
        info["accuracy"] = {**accuracy, "settings": study.user_attrs.get(SETTINGS_ATTR)}
    elif study.user_attrs.get(UNAVAILABLE_ATTR):
        info["accuracy"] = {"verdict": "not checked", "reason": study.user_attrs[UNAVAILABLE_ATTR]}
    elif (study.user_attrs.get(PLAN_ATTR) or {}).get("fits") is False:
        # said before the checks: no parity verdict fits the budget (autotune.accuracy.study.parity_gate)
        from autotune.accuracy.study.parity_gate import no_verdict_notice

        info["accuracy"] = {"verdict": "not checked", "reason": no_verdict_notice(study.user_attrs[PLAN_ATTR])}
    elif study.user_attrs.get(SETTINGS_ATTR):
        # the check was on, but the budget ended before this configuration's numerics were checked
        from autotune.accuracy.study.plan import checks_spent

        spent = checks_spent(study)
        info["accuracy"] = {"verdict": "not checked", "reason": (
            "the search budget ran out before this configuration's numerics were checked against FP32"
            + (f" ({spent})" if spent else "") + ": not "
            "checked within the budget, so it is recommended for its speed alone; give a longer --budget or a "
            "larger --accuracy-share, or check it with `autotune accuracy`")}
    if "accuracy" in info and study.user_attrs.get(PLAN_ATTR):
        info["accuracy"]["plan"] = study.user_attrs[PLAN_ATTR]  # how the check's steps were chosen
