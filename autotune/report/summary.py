"""The report's headline, as plain data both renderings share: the summary items (device, model,
objective, best configuration, throughput, memory, energy, accuracy, search cost) and the KPIs."""

from __future__ import annotations

from typing import Any

import pandas as pd

from autotune.report.data import ReportData
from autotune.report.format import (
    as_float,
    fmt_g,
    fmt_gib,
    fmt_pct,
    fmt_rate,
    fmt_ratio,
    fmt_s,
    memory_knob_pairs_text,
    memory_knobs_line,
    repeats_of,
    trials_text,
    warm_words,
)

NOT_MEASURED = "not measured in this search"


def _device_text(d: ReportData) -> str:
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


def device_title(d: ReportData) -> str:
    if d.device == "cuda":
        return d.provenance.get("gpu") or "CUDA GPU"
    return "CPU" if d.device == "cpu" else d.device


def _model_text(d: ReportData) -> str:
    w = d.workload
    text = str(w.get("model", "unknown model"))
    shape = w.get("input_shape")
    details = []
    if d.units.has_tokens:  # a language model: sequences of tokens over a vocabulary
        details.append(f"{d.units.tokens_per_sample:,} tokens a {d.units.sample_unit}")
        details += [f"{key}={value}" for key, value in (w.get("model_config") or {}).items()]
        return f"{text} ({', '.join(details)})"
    if shape:
        details.append("input " + "x".join(str(s) for s in shape))
    if w.get("num_classes"):
        details.append(f"{w['num_classes']} classes")
    return f"{text} ({', '.join(details)})" if details else text


def _energy_of(d: ReportData, row: pd.Series | None) -> dict[str, Any]:
    return (d.records[int(row["number"])].energy or {}) if row is not None else {}


def _accuracy_text(d: ReportData, best: pd.Series | None) -> str:
    """The best's accuracy evidence; or, as config.json says, why it was not checked (the budget ran
    out, the reference failed); and how many steps the check trained (autotune.accuracy.study.plan)."""
    from autotune.accuracy.study.plan import describe as describe_plan

    acc = (d.records[int(best["number"])].accuracy or {}) if best is not None else {}
    exported = (d.config or {}).get("accuracy") or {}
    if acc.get("accuracy_drop") is not None:
        text = f"accuracy drop {fmt_g(acc['accuracy_drop'], 3)} vs FP32"
        if acc.get("accuracy") is not None:
            text += f" (accuracy {fmt_g(acc['accuracy'])})"
        if acc.get("stable") is False:
            text += ", training was not stable"
    elif acc.get("accuracy") is not None:
        text = f"accuracy {fmt_g(acc['accuracy'])}"
    elif acc.get("method") == "parity":
        text = acc.get("reason") or acc["verdict"]  # the verdict's whole line, band included
    elif acc.get("verdict"):
        # judged on the training loss alone: a workload with no held-out set (a language model's)
        text = acc["verdict"] + (f": {acc['reason']}" if acc.get("reason") else "")
    elif exported.get("verdict") == "not checked":
        text = f"not checked: {exported.get('reason')}"
    elif d.has["accuracy"]:
        text = "measured on some trials, not on the best one"
    else:
        return NOT_MEASURED
    plan = describe_plan(exported.get("plan"))
    return f"{text}; accuracy check: {plan}" if plan else text


def summary_items(d: ReportData) -> list[dict[str, str]]:
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
        if (runner := runner_up_text(d)) is not None:
            if runner.startswith("a tie"):
                items[-1]["text"] += f"; a tie with the runner-up, #{int(runner_up(d)[0]['number'])}, within the noise"
            items.append({"label": "Runner-up", "text": runner})
        rate = f"{fmt_rate(best['samples_per_s'])} samples/s"
        rate += f" (FP32 baseline: {fmt_rate(base['samples_per_s'])} samples/s)" if base is not None else \
            " (the FP32 baseline did not complete)"
        if d.units.has_tokens:
            rate += (f"; {fmt_rate(best['tokens_per_s'])} tokens/s ({d.units.tokens_per_sample:,} tokens a "
                     f"{d.units.sample_unit})")
        items.append({"label": "Throughput", "text": rate})
        if as_float(best.get("ddp_world_size")):
            items.append({"label": "Data parallel (DDP)", "text": _ddp_text(best, d.device)})
        if best.get("data_bound") is not None and not pd.isna(best.get("data_bound")):
            items.append({"label": "Data pipeline", "text": data_text(best, d.device)})
        if (as_float(best.get("compile_s")) or 0.0) > 0:
            # paid once per training run, before the first step; not in the step time above
            items.append({"label": "Compile time", "text": (
                f"{fmt_s(best['compile_s'])} once, in the first steps (compiling and/or capturing the "
                "CUDA graph), before the throughput above is reached")})
        speedup = cfg.get("speedup_vs_baseline")
        if speedup is None and base is not None:
            speedup = best["samples_per_s"] / base["samples_per_s"]
        items.append({"label": "Speed-up over the FP32 baseline",
                      "text": fmt_ratio(speedup) if speedup is not None else "no baseline to compare with"})
        if (plain := plain_recipe_text(d)) is not None:
            items.append({"label": "Speed-up over the plain recipe", "text": plain})
        if (memory := memory_knobs_line(cfg)) is not None:
            items.append({"label": "Memory knobs", "text": memory})
        if (pairs := memory_knob_pairs_text(d.out_dir)) is not None:
            items.append({"label": "Each memory knob, paired", "text": pairs})
        items.append({"label": "Peak memory", "text": _memory_text(best, base)})
        note = (cfg.get("baseline") or {}).get("note")
        if note:
            items.append({"label": "FP32 baseline", "text": note})
        limit = (cfg.get("memory") or {}).get("limit_bytes")
        if limit:
            items.append({"label": "Memory limit", "text": (
                f"every trial capped at {fmt_gib(limit / 2**30)} GiB (--memory-limit), "
                "what lives outside PyTorch's allocator included")})
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
    items.append({"label": "Accuracy", "text": _accuracy_text(d, best)})
    c = d.cost
    early = " in their warm-up as clearly slower than the best"
    items.append({"label": "Search cost", "text": (
        f"{trials_text(c, early)}, "
        f"{fmt_s(c.get('trial_wall_s'))} of trials: worker start {fmt_s(c.get('worker_start_s'))}, "
        f"build {fmt_s(c.get('build_s'))}, "
        + (f"compiling {fmt_s(c['compile_s'])}, " if c.get("compile_s") else "")
        + f"warm-up {fmt_s(c.get('warmup_s'))}, measuring {fmt_s(c.get('measure_s'))}")})
    if words := warm_words(d.warm_start):
        items.append({"label": "Earlier searches", "text": words})
    return items


def runner_up(d: ReportData) -> tuple[pd.Series, float, float] | None:
    """The next best configuration after the best under the search's objective (measured, loss finite,
    not failed its accuracy check, another configuration than the best's), the best's relative lead
    over it, and the pair's noise band (autotune.search.knob_effects: 3%, or half the larger step-time
    spread of the two); None where there is none."""
    from autotune.search.goal import goal_of_config
    from autotune.search.knob_effects import NOISE_FLOOR

    best = d.best
    if best is None:
        return None
    goal = goal_of_config(d.config)
    column = goal.column if goal.column in d.measured else "samples_per_s"
    m = d.measured[(d.measured["number"] != best["number"]) & (d.measured["config"] != best["config"])
                   & ~d.measured["unstable"].astype(bool)]
    if "accuracy_verdict" in m:
        m = m[~m["accuracy_verdict"].isin(("violated", "unstable", "error"))]
    values = pd.to_numeric(m[column], errors="coerce")
    b = as_float(best.get(column))
    if b is None or values.notna().sum() == 0:
        return None
    other = m.loc[values.idxmax() if goal.maximize else values.idxmin()]
    o = as_float(other[column])
    if not o or not b:
        return None
    lead = (b - o) / o if goal.maximize else (o - b) / b
    spreads = [as_float(r.get("spread")) or 0.0 for r in (best, other)]
    return other, lead, max(NOISE_FLOOR, 0.5 * max(spreads))


def runner_up_text(d: ReportData) -> str | None:
    """The runner-up in words, and whether the best's lead over it is beyond the noise: within it,
    the two are a tie, and either serves."""
    found = runner_up(d)
    if found is None:
        return None
    other, lead, noise = found
    who = f"{other['config']} (trial #{int(other['number'])}): {fmt_rate(other['samples_per_s'])} samples/s"
    behind = fmt_pct(lead, 1 if abs(lead) >= 0.01 else 2)
    if lead <= noise:
        return (f"a tie: {who}, {behind} behind the best, within the ±{fmt_pct(noise)} noise of two "
                "measurements; the measurements cannot tell the two apart, so either serves")
    return f"{who}, {behind} behind the best, beyond the ±{fmt_pct(noise)} noise"


def plain_recipe_speedup(d: ReportData) -> float | None:
    """The best's samples/s over the plain recipe's (config.json's figure where exported); None without one."""
    if d.best is None or d.plain_recipe is None:
        return None
    exported = (d.config or {}).get("speedup_vs_plain_recipe")
    if exported is not None:
        return float(exported)
    rate = as_float(d.plain_recipe["samples_per_s"])
    return as_float(d.best["samples_per_s"]) / rate if rate else None


def plain_recipe_text(d: ReportData) -> str | None:
    """The best against the plain recipe, in words: its speed-up over it and the recipe's figures; that
    nothing beat the recipe (it is the recommendation); or why the recipe is missing. None where the
    search has no plain-recipe trial (one from before the recipe existed, or a device without 16-bit)."""
    plain = d.plain_recipe
    if plain is None:
        return d.plain_recipe_missing
    recipe = f"{plain['config']} (trial #{int(plain['number'])}): {fmt_rate(plain['samples_per_s'])} samples/s"
    if d.best_is_plain_recipe:
        return f"nothing measured beat the plain recipe: it is the recommendation ({recipe})"
    return f"{fmt_ratio(plain_recipe_speedup(d))} (the plain recipe: {recipe})"


def _ddp_text(best: pd.Series, device: str) -> str:
    """With --ddp N: the best trial's throughput per GPU and its scaling efficiency."""
    n = int(as_float(best["ddp_world_size"]))
    unit, units = ("GPU", "GPUs") if device == "cuda" else ("process", "processes")
    return (f"{n} processes" + (", one GPU each" if device == "cuda" else " on the CPU")
            + f": {fmt_rate(best['samples_per_s'])} samples/s in total, "
            f"{fmt_rate(best['per_gpu_samples_per_s'])} per {unit}; the same configuration alone on one {unit} "
            f"(measured in the same trial) runs {fmt_rate(best['single_gpu_samples_per_s'])} samples/s, so the "
            f"scaling efficiency is {fmt_pct(best['scaling_efficiency'], 0)} ({n} {units} train "
            f"{fmt_ratio(as_float(best['scaling_efficiency']) * n)} as fast as one); batch sizes are per {unit}")


def data_text(best: pd.Series, device: str) -> str:
    """With --data: whether the DataLoader keeps the device busy, from the best trial's two rates."""
    fed, compute = fmt_rate(best["loader_fed_samples_per_s"]), fmt_rate(best["compute_only_samples_per_s"])
    unit = "GPU" if device == "cuda" else "CPU"
    wait = as_float(best.get("loader_wait_share"))
    waited = f"; the step waited for data {fmt_pct(wait, 0)} of the time" if wait is not None else ""
    if str(best["data_bound"]).lower() == "true":
        workers = as_float(best.get("param.dataloader.num_workers"))
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


def kpis(d: ReportData) -> list[dict[str, str]]:
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
    over_plain = plain_recipe_speedup(d)
    if over_plain is not None:
        label = "speed-up over the plain recipe" + (" (it is the best)" if d.best_is_plain_recipe else "")
        out.append({"key": "speedup-plain-recipe", "value": repr(float(over_plain)), "text": fmt_ratio(over_plain),
                    "label": label})
    out.append({"key": "best-rate", "value": repr(float(best["samples_per_s"])),
                "text": fmt_rate(best["samples_per_s"]), "label": "samples/s, best"})
    if d.units.has_tokens:
        out.append({"key": "best-tokens", "value": repr(float(best["tokens_per_s"])),
                    "text": fmt_rate(best["tokens_per_s"]), "label": "tokens/s, best"})
    if base is not None:
        out.append({"key": "baseline-rate", "value": repr(float(base["samples_per_s"])),
                    "text": fmt_rate(base["samples_per_s"]), "label": "samples/s, FP32 baseline"})
        b, r = as_float(best.get("peak_memory_gb")), as_float(base.get("peak_memory_gb"))
        if b is not None and r:
            out.append({"key": "memory-ratio", "value": repr(b / r), "text": fmt_ratio(b / r),
                        "label": f"peak memory vs baseline ({fmt_gib(b)} GiB)"})
    joules = _energy_of(d, best).get("joules_per_sample")
    if joules is not None:
        out.append({"key": "joules", "value": repr(float(joules)), "text": fmt_g(joules, 3),
                    "label": "J/sample, best"})
    drop = (d.records[int(best["number"])].accuracy or {}).get("accuracy_drop")
    if drop is not None:
        out.append({"key": "accuracy-drop", "value": repr(float(drop)), "text": fmt_g(drop, 3),
                    "label": "accuracy drop, best"})
    c = d.cost
    run = c.get("num_trials", 0) - repeats_of(c)  # a repeat reused an earlier trial's result
    out.append({"key": "trials", "value": str(run), "text": str(run),
                "label": f"trials, {fmt_s(c.get('trial_wall_s'))}"})
    return out


def _memory_text(best: pd.Series, base: pd.Series | None) -> str:
    b = as_float(best.get("peak_memory_gb"))
    if b is None:
        return "not recorded"
    text = f"{fmt_gib(b)} GiB"
    if base is None or as_float(base.get("peak_memory_gb")) is None:
        return text
    r = as_float(base["peak_memory_gb"])
    diff = r - b
    if abs(diff) < 0.005:
        return text + f", the same as the baseline ({fmt_gib(r)} GiB)"
    if diff > 0:
        return text + f", {fmt_gib(diff)} GiB less than the baseline's {fmt_gib(r)} GiB ({fmt_pct(diff / r, 0)} saved)"
    return text + f", {fmt_gib(-diff)} GiB more than the baseline's {fmt_gib(r)} GiB ({b / r:.2f}× the memory)"
