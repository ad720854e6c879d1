"""The report's tables and lists, as plain data both renderings share: every trial, the failed
ones, each knob's effect, the findings, the profiled step and the snippet that reproduces the search."""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from autotune.report.data import KNOBS, ReportData
from autotune.report.effects import LEFT_OUT
from autotune.report.format import (
    as_float,
    describe,
    fmt_g,
    fmt_gib,
    fmt_ms,
    fmt_pct,
    fmt_rate,
    fmt_ratio,
    fmt_s,
    sort_key,
    value_label,
)
from autotune.search.knob_effects import NOISE_FLOOR

PROFILE_PARTS = [  # (key in the profile attribute, label, colour)
    ("tensor_core_share", "Tensor Core GEMM/conv", "#1b9e77"),
    ("other_gemm_conv_share", "other GEMM/conv", "#66a61e"),
    ("elementwise_share", "elementwise", "#7570b3"),
    ("layout_share", "layout (transpose/copy)", "#e7298a"),
    ("memcpy_share", "memcpy", "#e6ab02"),
    ("idle_share", "GPU idle", "#bbbbbb"),
]


_STATE_WORDS = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running",
                "WAITING": "waiting"}


def is_ddp(d: ReportData) -> bool:
    """Whether the study measured DDP steps (--ddp): its rates are then totals over its GPUs."""
    return bool(pd.to_numeric(d.frame["ddp_world_size"], errors="coerce").fillna(0).gt(1).any())


_FORMATS = {"samples_per_s": fmt_rate, "tokens_per_s": fmt_rate, "per_gpu_samples_per_s": fmt_rate,
            "scaling_efficiency": lambda v: fmt_pct(v, 0), "step_time_ms": fmt_ms, "spread": lambda v: fmt_pct(v, 1),
            "peak_memory_gb": fmt_gib, "joules_per_sample": lambda v: fmt_g(v, 3),
            "accuracy_drop": lambda v: fmt_g(v, 3), "loss_drift": lambda v: fmt_g(v, 3),
            "loss_deviation": lambda v: fmt_g(v, 3), "trial_wall_s": lambda v: fmt_g(v, 3), "compile_s": lambda v: fmt_g(v, 3),
            "vs_baseline": fmt_ratio, "vs_plain_recipe": fmt_ratio}
"""How the table of all trials writes each numeric column."""


def _trial_columns(d: ReportData, bars: dict[str, float]) -> list[tuple[str, str, str]]:
    """The table of all trials' columns: (key, heading, kind); ``bars``: the ratio columns there are."""
    cols = [("number", "#", "number"), ("role", "role", "text"), ("state", "state", "text"),
            ("config", "configuration", "text"), ("samples_per_s", "samples/s", "number"),
            ("step_time_ms", "step ms", "number"), ("spread", "spread", "number"),
            ("peak_memory_gb", "peak GiB", "number")]
    if is_ddp(d):
        cols[5:5] = [("per_gpu_samples_per_s", "samples/s per GPU", "number"),
                     ("scaling_efficiency", "scaling efficiency", "number")]
    if d.units.has_tokens:  # a language model: samples/s times its sequence length
        cols.insert(5, ("tokens_per_s", "tokens/s", "number"))
    # each trial's samples/s over the FP32 baseline's and over the plain recipe's
    cols += [(key, label, "number") for key, label in (("vs_baseline", "vs baseline"),
                                                       ("vs_plain_recipe", "vs plain recipe")) if key in bars]
    if d.has["energy"]:
        cols.append(("joules_per_sample", "J/sample", "number"))
    if d.has["accuracy"]:
        cols.append((*d.accuracy_measure, "number"))
    if (pd.to_numeric(d.frame["compile_s"], errors="coerce").fillna(0) > 0).any():
        cols.append(("compile_s", "compile s", "number"))
    return cols + [("reason", "reason", "text"), ("trial_wall_s", "time s", "number")]


def _rate_bars(d: ReportData) -> dict[str, float]:
    """The samples/s the table's ratio columns divide by: the FP32 baseline's, the plain recipe's."""
    rows = {"vs_baseline": d.baseline, "vs_plain_recipe": d.plain_recipe}
    rates = {key: as_float(row["samples_per_s"]) for key, row in rows.items() if row is not None}
    return {key: rate for key, rate in rates.items() if rate}


def _trial_cell(r: pd.Series, key: str, kind: str, bars: dict[str, float]) -> dict[str, Any]:
    """One cell of the table of all trials: its text, its sort value and, for some, a tooltip."""
    v = r.get(key)
    if key in bars:
        rate = as_float(r.get("samples_per_s"))
        v = rate / bars[key] if rate is not None else None
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
    elif key in _FORMATS:
        text = _FORMATS[key](v)
    else:
        text = "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
    value = ("" if as_float(v) is None else repr(as_float(v))) if kind == "number" else text
    cell = {"key": key, "text": text, "value": value}
    if key == "trial_wall_s" and as_float(v) is not None:
        compiled = (as_float(r.get("compile_s")) or 0) > 0
        cell["title"] = (f"worker start {fmt_s(r.get('worker_start_s'))}, build {fmt_s(r.get('build_s'))}, "
                         + (f"compiling {fmt_s(r['compile_s'])}"
                            + (" (from the cache)" if r.get("compile_cache") == "hit" else "") + ", "
                            if compiled else "")
                         + f"warm-up {fmt_s(r.get('warmup_s'))}, measuring {fmt_s(r.get('measure_s'))}")
    if key == "spread" and r.get("noisy") is True:
        cell["title"] = "noisy: p90-p10 above the tolerance after re-measuring"
        cell["text"] += " ⚠"
    return cell


def trial_rows(d: ReportData) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The table of all trials: (columns, rows); each cell has its text and a sort value. The best
    trial, the FP32 baseline and the plain recipe are marked by their row's css class."""
    bars = _rate_bars(d)
    cols = _trial_columns(d, bars)
    best_n = int(d.best["number"]) if d.best is not None else None
    rows = []
    for _, r in d.frame.sort_values("number").iterrows():
        cells = [_trial_cell(r, key, kind, bars) for key, _, kind in cols]
        css = {"COMPLETE": "ok", "PRUNED": "pruned", "FAIL": "failed"}.get(r["state"], "other")
        if int(r["number"]) == best_n:
            css += " best"
        if r.get("role") in ("baseline", "plain-recipe"):
            css += f" {r['role']}"
        rows.append({"number": int(r["number"]), "css": css, "cells": cells})
    return [{"key": k, "label": label, "type": kind} for k, label, kind in cols], rows


def best_vs_rows(d: ReportData) -> tuple[list[str], list[list[str]]]:
    """"Best vs baseline" (a search that completed): the best, the plain recipe and the FP32 baseline
    side by side, then the best over each of the two: (header, rows of cell texts)."""
    accuracy_key, accuracy_label = d.accuracy_measure
    tokens = d.units.has_tokens  # a language model: tokens/s next to samples/s
    header = ["", "trial", "configuration", "samples/s", *(["tokens/s"] if tokens else []), "step ms", "peak GiB",
              *(["J/sample"] if d.has["energy"] else []), *([accuracy_label] if d.has["accuracy"] else [])]

    def line(label: str, r: pd.Series) -> list[str]:
        cells = [label, f"#{int(r['number'])}", str(r["config"]), fmt_rate(r["samples_per_s"]),
                 *([fmt_rate(r["tokens_per_s"])] if tokens else []),
                 fmt_ms(r["step_time_ms"]), fmt_gib(r["peak_memory_gb"])]
        if d.has["energy"]:
            cells.append(fmt_g(r.get("joules_per_sample"), 3))
        if d.has["accuracy"]:
            cells.append(fmt_g(r.get(accuracy_key), 3))
        return cells

    def ratio(label: str, b: pd.Series, r: pd.Series) -> list[str]:
        def over(key: str) -> str:
            x, y = as_float(b.get(key)), as_float(r.get(key))
            return fmt_ratio(x / y) if x is not None and y else ""

        speed = over("samples_per_s")
        return [label, "", "", speed, *([speed] if tokens else []), over("step_time_ms"), over("peak_memory_gb"),
                *([over("joules_per_sample")] if d.has["energy"] else []), *([""] if d.has["accuracy"] else [])]

    rows = [line("best", d.best)]
    if d.plain_recipe is not None:
        rows.append(line("plain recipe" + (" (= best)" if d.best_is_plain_recipe else ""), d.plain_recipe))
    if d.baseline is not None:
        rows.append(line("baseline", d.baseline))
    if d.plain_recipe is not None:
        rows.append(ratio("best / plain recipe", d.best, d.plain_recipe))
    if d.baseline is not None:
        rows.append(ratio("best / baseline", d.best, d.baseline))
    return header, rows


def best_vs_note(d: ReportData) -> str | None:
    """What "Best vs baseline" says below its table about the plain recipe: that nothing measured beat
    it, or why it is missing (None: it was beaten, or the search had none)."""
    if d.best is None:
        return None
    if d.best_is_plain_recipe:
        return "Nothing measured beat the plain recipe: it is the recommendation."
    if d.plain_recipe is None and d.plain_recipe_missing:
        return f"Plain recipe: {d.plain_recipe_missing}."
    return None


def failed_rows(d: ReportData) -> list[dict[str, Any]]:
    rows = []
    for _, r in d.frame.sort_values("number").iterrows():
        if r["state"] in ("PRUNED", "FAIL"):
            reason = "; ".join(x for x in (str(r.get("reason") or ""), r.get("note") or "") if x)
            status = r.get("status") or ""
            state = "stopped early" if status == "pruned" else _STATE_WORDS[r["state"]]
            rows.append({"number": int(r["number"]), "state": state, "status": "" if status == "pruned" else status,
                         "config": r.get("config") or "", "reason": reason or "no reason recorded"})
    return rows


# knobs that exist only on the other kind of device: not worth listing as "fixed"
_IRRELEVANT = {"cuda": ("threads",), "cpu": ("channel_alignment", "cudnn", "streams")}


def knob_effects(d: ReportData) -> tuple[list[dict[str, Any]], list[str]]:
    """Per knob with more than one value among the measured trials: median and best samples/s
    by value. Knobs that took one value are listed as fixed."""
    effects, fixed = [], []
    m = d.measured
    for knob in KNOBS:
        col = f"knob.{knob.key}"
        if m.empty or col not in m or m[col].isna().all():
            continue
        values = m[col].dropna()
        distinct = sorted(set(values), key=sort_key)
        if len(distinct) < 2:
            if knob.key in _IRRELEVANT.get(d.device, ()):
                continue
            fixed.append(f"{knob.label} = {value_label(distinct[0])}")
            continue
        rows = []
        for value in distinct:
            rates = m.loc[m[col] == value, "samples_per_s"].astype(float)
            rows.append({"value": value, "label": value_label(value), "n": int(rates.size),
                         "median": float(rates.median()), "best": float(rates.max())})
        effects.append({"key": knob.key, "label": knob.label, "rows": rows})
    return effects, fixed


RULE_TITLES = {  # a finding's kind in a few words (autotune.search.findings names its rules)
    "compile-inert": "torch.compile compiled nothing",
    "data-bound": "data-bound",
    "ddp-scaling": "DDP scales below 90%",
    "layout": "layout conversions",
    "idle": "GPU idle",
    "copies": "host-to-device copies exposed",
    "copies-hidden": "copies overlap compute",
    "no-tensor-cores": "no Tensor Cores",
    "misaligned": "misaligned channels",
    "misaligned-gemms": "GEMM/conv widths off the Tensor Core multiple",
    "elementwise": "memory-bound elementwise kernels",
    "power-cap": "power-capped",
    "thermal": "thermal throttling",
}
_SHOWN_TRIALS = 20
"""Trial numbers a finding's line lists before "and N more"."""


def finding_rows(d: ReportData) -> list[dict[str, Any]]:
    """One line per kind of finding (its rule; a trial recorded before rules were stored: its text),
    with the trials it applies to and each trial's own text; the best trial's kinds first, then the
    baseline's. A kind's example text is that of the first trial in that order."""
    order = [int(d.best["number"])] if d.best is not None else []
    if d.baseline is not None and int(d.baseline["number"]) not in order:
        order.append(int(d.baseline["number"]))
    order += sorted(n for n in d.records if n not in order)
    groups: dict[str, dict[str, Any]] = {}
    for n in order:
        record = d.records[n]
        found = [(r.get("rule"), str(r.get("text", ""))) for r in record.finding_rules] or \
                [(None, str(text)) for text in record.findings]
        for rule, text in found:
            group = groups.setdefault(rule or text, {"rule": rule, "items": []})
            if all(item["number"] != n or item["text"] != text for item in group["items"]):
                group["items"].append({"number": n, "text": text})
    reporting = sum(1 for r in d.records.values() if r.findings or r.finding_rules)

    def which(numbers: list[int]) -> str:
        if len(numbers) == reporting > 3:
            return f"all {reporting} trials that report findings"
        shown = ", ".join(f"#{n}" for n in numbers[:_SHOWN_TRIALS])
        return shown + (f" and {len(numbers) - _SHOWN_TRIALS} more" if len(numbers) > _SHOWN_TRIALS else "")

    rows = []
    for group in groups.values():
        numbers = sorted({item["number"] for item in group["items"]})
        first = group["items"][0]
        rule = group["rule"]
        rows.append({"rule": rule, "title": RULE_TITLES.get(rule, rule) if rule else None, "text": first["text"],
                     "example": first["number"], "count": len(numbers), "trials": which(numbers),
                     "items": sorted(group["items"], key=lambda item: item["number"])})
    return rows


def paired_intro(d: ReportData) -> str:
    """What the paired table shows, in one paragraph both renderings print above it."""
    n = d.effects.trials if d.effects is not None else 0
    if not any(p.changes for p in (d.effects.params if d.effects is not None else [])):
        return (f"No two of the {n} measured trials ({LEFT_OUT}) differ in one knob alone, so no knob's own effect can be "
                "told apart from the others': the marginal figures below mix them.")
    return ("From pairs of measured trials that differ in that knob alone (every other parameter equal), so no "
            "other knob is mixed in: for each change of value, the median ratio of the two trials' samples/s "
            "(after over before) and its range over the pairs, against the noise band within which a difference "
            f"says nothing ({fmt_pct(NOISE_FLOOR, 0)}, or half the larger step-time spread of the two). "
            f"{n} measured trials compared ({LEFT_OUT}).")


def paired_rows(d: ReportData, noun: str = "bars") -> list[dict[str, Any]]:
    """Each parameter that took several values: its PED-ANOVA importance and, per change of value
    that pairs of trials make alone, the median ratio of their samples/s, the range, the noise band
    and the verdict; or that no pair isolates it (then its marginal ``noun`` are confounded)."""
    out = []
    for p in d.effects.params if d.effects is not None else []:
        rows = []
        for c in p.changes:
            shown = ", ".join(f"#{a}/#{b}" for a, b in c.pairs[:6]) + (" ..." if len(c.pairs) > 6 else "")
            rows.append({"change": c.label, "n": len(c.pairs),
                         "pairs": shown, "ratio": fmt_ratio(c.ratio), "ratio_value": c.ratio,
                         "range": f"{min(c.ratios):.2f}–{max(c.ratios):.2f}×" if len(c.ratios) > 1 else "",
                         "noise": f"±{fmt_pct(c.noise)}", "verdict": c.verdict()})
        if p.changes:
            alone = None
        elif p.knob is not None:
            alone = f"no pair of trials differs in this knob alone: its marginal {noun} are confounded"
        else:
            alone = "no pair of trials differs in this parameter alone"
        out.append({"param": p.param, "label": p.label, "key": p.knob.key if p.knob is not None else None,
                    "importance": fmt_pct(p.importance, 0) if p.importance is not None else "",
                    "importance_value": p.importance, "rows": rows, "alone": alone})
    return out


def profile_rows(d: ReportData) -> list[dict[str, Any]]:
    """The profiled trials to compare: the baseline and the best when profiled, else the fastest profiled."""
    chosen = []
    for label, row in (("baseline", d.baseline), ("best", d.best)):
        if row is not None and d.records[int(row["number"])].profile:
            chosen.append((label, int(row["number"])))
    if not chosen:
        profiled = [n for n, r in d.records.items() if r.profile]
        rates = {n: d.records[n].samples_per_s or 0 for n in profiled}
        chosen = [("fastest profiled", max(profiled, key=lambda n: rates[n]))] if profiled else []
    out = []
    for label, n in chosen:
        p = d.records[n].profile
        parts = [{"label": name, "share": as_float(p.get(key)), "color": color} for key, name, color in PROFILE_PARTS]
        known = sum(x["share"] or 0 for x in parts)
        if known < 0.995:
            parts.append({"label": "other", "share": max(0.0, 1 - known), "color": "#eeeeee"})
        out.append({
            "label": f"{label} (#{n})", "number": n,
            "config": describe(d.records[n].knobs) if d.records[n].knobs else "",
            "parts": parts,
            "kernels_per_step": p.get("kernels_per_step"),
            "copy_overlap": p.get("copy_overlap"),
            "top_kernels": [{**kernel_name(str(k.get("name", ""))), "share": fmt_pct(k.get("share"))}
                            for k in (p.get("top_kernels") or [])[:10]],
        })
    return out


KERNEL_NAME_CHARS = 160
"""A kernel's name longer than this (a mangled C++ template: one ran to 12,680 px on one line) is cut,
its whole name in the cell's title."""


def kernel_name(name: str) -> dict[str, str]:
    """A kernel's name as its table cell shows it: cut after KERNEL_NAME_CHARS with "…", the whole
    name then as the cell's title (shown on hover); the page breaks what is left anywhere."""
    if len(name) <= KERNEL_NAME_CHARS:
        return {"name": name, "title": ""}
    return {"name": name[:KERNEL_NAME_CHARS - 1] + "…", "title": name}


def _model_lines(model: str, workload: dict[str, Any]) -> tuple[str, str]:
    """The snippet's imports and the line that builds the tuned model, by how --model named it."""
    num_classes = workload.get("num_classes", 1000)
    if model.startswith(("hf:", "timm:")):
        library, name = model.split(":", 1)
        if library == "timm":
            return ("import torch, timm\nimport autotune\n",
                    f"model = timm.create_model({name!r}, num_classes={num_classes})")
        fields = "".join(f", {k}={v!r}" for k, v in (workload.get("model_config") or {}).items())
        return ("import torch\nimport autotune\nfrom transformers import AutoConfig, AutoModelForCausalLM\n",
                f"model = AutoModelForCausalLM.from_config(AutoConfig.for_model({name!r}, use_cache=False{fields}))")
    if ":" in model:
        module, factory = model.split(":", 1)
        return (f"import torch\nimport autotune\nfrom {module} import {factory}\n",
                f"model = {factory}()  # the model you tuned (--model {model})")
    return ("import torch, torchvision\nimport autotune\n",
            f"model = torchvision.models.{model}(num_classes={num_classes})")


def snippet(d: ReportData) -> str:
    """The README's training loop, with this report's config path and model."""
    model = str(d.workload.get("model", "your_model"))
    path = d.out_dir / "config.json"
    imports, build = _model_lines(model, d.workload)
    if is_ddp(d):
        # --ddp N: the script runs once per GPU under torchrun, in a process group, each rank on its shard
        n = int(pd.to_numeric(d.frame["ddp_world_size"], errors="coerce").max())
        backend = "nccl" if d.device == "cuda" else "gloo"
        imports = imports.replace("import torch", "import torch, torch.distributed as dist", 1)
        group = f'dist.init_process_group("{backend}")  # launch: torchrun --nproc-per-node {n} train.py\n'
        done = "padding, memory format, flags, device, DDP wrap"
        feed = ("sampler = torch.utils.data.distributed.DistributedSampler(dataset)"
                "  # your dataset, a shard per rank\n"
                "loader = torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler,"
                "  # per GPU\n")
    else:
        group, done = "", "padding, memory format, backend flags, device"
        feed = ("loader = torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True,"
                "  # your dataset\n")
    if model.startswith("hf:"):
        # a causal LM returns an output object: the loss is next-token cross-entropy on its logits, each
        # position predicting the next token, as the search trained it (autotune.workload.hub)
        optimizer = ("optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.scaled_lr(6e-4), betas=(0.9, 0.95), "
                     "weight_decay=0.1)\n")
        feed = feed.replace("# your dataset", "# your dataset: token ids, seq_len + 1 a sample")
        loop = ("for tokens in cfg.loader(loader):            # to the device, on the tuned streams\n"
                "    optimizer.zero_grad(set_to_none=True)\n"
                "    with cfg.autocast():\n"
                "        logits = model(input_ids=tokens[:, :-1]).logits  # the output object's logits\n"
                "        # next-token cross-entropy, in FP32: position i predicts token i + 1\n"
                "        loss = loss_fn(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())\n")
    else:
        optimizer = "optimizer = torch.optim.SGD(model.parameters(), lr=cfg.scaled_lr(0.1), momentum=0.9)\n"
        loop = ("for x, y in cfg.loader(loader):               # to the device, in the tuned memory format and "
                "streams\n"
                "    optimizer.zero_grad(set_to_none=True)\n"
                "    with cfg.autocast():\n"
                "        loss = loss_fn(model(x), y)\n")
    return (
        f"{imports}\n"
        f"{group}"
        f"cfg = autotune.load({json.dumps(str(path))})\n"
        f"{build}\n"
        f"{optimizer}"
        f"model, optimizer = cfg.prepare(model, optimizer)  # {done}\n"
        "scaler = cfg.grad_scaler()                        # a GradScaler, disabled unless fp16 needs it\n"
        "loss_fn = torch.nn.CrossEntropyLoss()\n"
        f"{feed}"
        "                                     **cfg.dataloader_kwargs(num_workers=4))"
        "  # workers, pinning: tuned with --data\n"
        f"{loop}"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(optimizer)\n"
        "    scaler.update()\n"
    )
