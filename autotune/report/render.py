"""The search report: ``report.html``, one self-contained page (summary, plots as inline SVG,
every trial in a sortable table, how to reproduce) that opens offline, and ``report.md``, the
summary and main tables for GitHub.

Everything is read back from the study's trials (their user attributes, as the search records
them) and the exported config.json; sections for figures a search did not measure (energy,
profile, findings, accuracy) say so in one line instead of showing anything invented.

This module renders both pages; data collects what they show, summary and sections put it in words
and tables, plots draws the figures and format writes the numbers.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any, Iterable

import jinja2
import optuna
import pandas as pd

import autotune
from autotune.report.data import ReportData, collect
from autotune.report.format import (
    as_float,
    fmt_g,
    fmt_gib,
    fmt_ms,
    fmt_pct,
    fmt_rate,
    fmt_ratio,
    fmt_s,
)
from autotune.report.plots import (
    inline_svg,
    plot_batch,
    plot_energy,
    plot_knob,
    plot_paired,
    plot_precision_format,
    plot_profile,
    plot_speed_accuracy,
    speed_accuracy_flat,
    plot_throughput_memory,
)
from autotune.report.sections import (
    best_vs_note,
    best_vs_rows,
    failed_rows,
    finding_rows,
    is_ddp,
    knob_effects,
    paired_intro,
    paired_rows,
    profile_rows,
    snippet,
    trial_rows,
)
from autotune.report.summary import NOT_MEASURED, device_title, kpis, summary_items

__all__ = ["render_html", "render_markdown", "write_report",
           # defined in format and plots, importable from here as before the report was split by role
           "inline_svg", "fmt_rate", "fmt_ms", "fmt_gib", "fmt_pct", "fmt_s", "fmt_g", "fmt_ratio"]


def _context(d: ReportData) -> dict[str, Any]:
    effects, fixed = knob_effects(d)
    profiles = profile_rows(d)
    columns, rows = trial_rows(d)
    plots_knobs = [p for p in [plot_precision_format(d)] if p is not None]
    plots_knobs += [plot_knob(e) for e in effects if e["key"] not in ("precision", "memory_format", "batch_size")]
    cfg = d.config or {}
    title_device = device_title(d)
    return {
        "title": f"autotune report: {d.workload.get('model', 'model')} on {title_device}",
        "generated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "version": autotune.__version__,
        "study_name": d.study_name,
        "completed": d.best is not None,
        "summary": summary_items(d),
        "kpis": kpis(d),
        "best_vs": best_vs_rows(d) if d.best is not None else None,
        "best_vs_note": best_vs_note(d),
        "notes": cfg.get("notes") or [],
        "failed": failed_rows(d),
        "has": d.has,
        "not_measured": NOT_MEASURED,
        "plot_accuracy": plot_speed_accuracy(d),
        "accuracy_flat": speed_accuracy_flat(d),
        "plot_memory": plot_throughput_memory(d),
        "plots_knobs": plots_knobs,
        "fixed_knobs": fixed,
        "paired_intro": paired_intro(d),
        "paired": paired_rows(d),
        "plot_paired": plot_paired(d),
        "importance_note": d.effects.importance_note if d.effects is not None else "",
        "plot_batch": plot_batch(d),
        "plot_energy": plot_energy(d),
        "plot_profile": plot_profile(profiles),
        "profiles": profiles,
        "findings": finding_rows(d),
        "columns": columns,
        "rows": rows,
        "command": cfg.get("command"),
        "snippet": snippet(d) if d.config else None,
        "config_path": str(d.out_dir / "config.json"),
    }


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("autotune.report", "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def render_html(d: ReportData) -> str:
    return _environment().get_template("report.html.j2").render(**_context(d))


def _md(text: Any) -> str:
    """One Markdown table cell or line: no HTML, no table breaks."""
    s = " ".join(str(text).split())
    return re.sub(r"([\\`*\[\]<>|])", r"\\\1", s)


def _md_table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_md(h) for h in header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return lines


def render_markdown(d: ReportData) -> str:
    cfg = d.config or {}
    title_device = device_title(d)
    out = [f"# autotune report: {_md(d.workload.get('model', 'model'))} on {_md(title_device)}", ""]
    if d.best is None:
        out += ["**No configuration completed**, so nothing was exported"
                + (": the reasons are listed below." if failed_rows(d) else "."), ""]
    for item in summary_items(d):
        out.append(f"- **{_md(item['label'])}:** {_md(item['text'])}")
    for note in cfg.get("notes") or []:
        out.append(f"- **Note:** {_md(note)}")
    out.append("")

    if d.best is not None:
        out += _md_best_vs_baseline(d)
        out += _md_top(d, cfg)
        out += _md_knob_effects(d)

    out += _md_findings(d)

    failed = failed_rows(d)
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
                "The tuned configuration in your training loop:", "", "```python", snippet(d).rstrip(), "```", ""]
    out += [f"Study `{d.study_name}`, {len(d.frame)} trials; report by autotune {autotune.__version__}.", ""]
    return "\n".join(out)


def _md_best_vs_baseline(d: ReportData) -> list[str]:
    """The best, plain recipe and baseline trials side by side, and the best's ratios over the two."""
    header, rows = best_vs_rows(d)
    out = ["## Best vs baseline", "", *_md_table(header, rows), ""]
    note = best_vs_note(d)
    return out + [_md(note), ""] if note else out


def _md_top(d: ReportData, cfg: dict[str, Any]) -> list[str]:
    """The ten best measured configurations under the search's objective (a search that completed)."""
    from autotune.search.goal import goal_of_config

    ranking = goal_of_config(cfg)  # the top configurations under the search's objective
    top = d.measured.sort_values(ranking.column, ascending=not ranking.maximize).head(10)
    base_rate = as_float(d.baseline["samples_per_s"]) if d.baseline is not None else None
    plain_rate = as_float(d.plain_recipe["samples_per_s"]) if d.plain_recipe is not None else None
    out = ["## Top 10 configurations", ""]
    ddp = is_ddp(d)  # --ddp: total samples/s, per GPU, and scaling efficiency versus one GPU
    tokens = d.units.has_tokens
    out += _md_table(
        ["rank", "trial", "role", "configuration", "samples/s", *(["tokens/s"] if tokens else []),
         *(["samples/s per GPU", "scaling efficiency"] if ddp else []),
         "step ms", "spread", "peak GiB", "vs baseline", *(["vs plain recipe"] if plain_rate else [])],
        [[i + 1, f"#{int(r['number'])}", r["role"],
          r["config"] + (" (unstable: loss not finite, never chosen as best)" if r["unstable"] else ""),
          fmt_rate(r["samples_per_s"]), *([fmt_rate(r["tokens_per_s"])] if tokens else []),
          *([fmt_rate(r["per_gpu_samples_per_s"]), fmt_pct(r["scaling_efficiency"], 0)] if ddp else []),
          fmt_ms(r["step_time_ms"]), fmt_pct(r["spread"]), fmt_gib(r["peak_memory_gb"]),
          fmt_ratio(r["samples_per_s"] / base_rate) if base_rate else "",
          *([fmt_ratio(r["samples_per_s"] / plain_rate)] if plain_rate else [])]
         for i, (_, r) in enumerate(top.iterrows())])
    out.append("")
    return out


def _md_knob_effects(d: ReportData) -> list[str]:
    """Each knob's effect from pairs of trials that differ in it alone, with its PED-ANOVA importance;
    then, secondary, the median and best samples/s by value over all trials, and the knobs held fixed."""
    effects, fixed = knob_effects(d)
    out = ["## Effect of each knob", "", _md(paired_intro(d)), ""]
    rows = []
    for p in paired_rows(d, noun="figures"):
        first = [p["label"], p["importance"]]
        if p["alone"]:
            rows.append([*first, "", 0, "", "", "", p["alone"]])
        for i, r in enumerate(p["rows"]):
            rows.append([*(first if i == 0 else ["", ""]), r["change"], r["n"], r["ratio"], r["range"], r["noise"],
                         f"{r['verdict']} ({r['pairs']})"])
    if rows:
        out += _md_table(["knob", "importance", "change", "pairs", "samples/s ratio", "range", "noise band",
                          "verdict (pairs: before/after)"], rows)
        out.append("")
    if d.effects is not None:
        out += [_md(d.effects.importance_note), ""]
    out += ["### Marginal: all trials with each value", "",
            ("Median and best samples/s of the measured configurations, by the value of one knob. The other knobs "
             "changed too, so these mix their effects with this knob's: the pairs above are the knob's own."), ""]
    for e in effects:
        out += [f"#### {_md(e['label'])}", ""]
        out += _md_table([e["label"], "trials", "median samples/s", "best samples/s"],
                         [[r["label"], r["n"], fmt_rate(r["median"]), fmt_rate(r["best"])] for r in e["rows"]])
        out.append("")
    if fixed:
        out += ["Fixed in this search: " + _md("; ".join(fixed)) + ".", ""]
    return out


def _md_findings(d: ReportData) -> list[str]:
    """One line per kind of finding with the trials it applies to and an example (the best trial's first)."""
    lines = []
    for f in finding_rows(d):
        if f["title"] is None:  # a trial recorded before findings named their rule: its text is the kind
            lines.append(f"- {_md(f['text'])} ({_md(f['trials'])})")
        elif f["count"] == 1:
            lines.append(f"- **{_md(f['title'])}:** {_md(f['text'])} ({_md(f['trials'])})")
        else:
            lines.append(f"- **{_md(f['title'])}** in {f['count']} trials ({_md(f['trials'])}); "
                         f"#{f['example']}: {_md(f['text'])}")
    return ["## Findings", "", *lines, ""] if lines else []


def write_report(study: optuna.Study, out_dir: Path, config: dict | None = None) -> dict[str, Path]:
    """Write report.html and report.md for ``study`` into ``out_dir``.

    ``config`` is that folder's parsed config.json, or None when no trial completed (the report
    then says so and still lists every trial with its reason). Returns the paths by file name.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = collect(study, out_dir, config)
    files = {"report.html": out_dir / "report.html", "report.md": out_dir / "report.md"}
    files["report.html"].write_text(render_html(data), encoding="utf-8")
    files["report.md"].write_text(render_markdown(data), encoding="utf-8")
    return files
