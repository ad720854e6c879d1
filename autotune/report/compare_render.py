"""How `autotune compare` shows a comparison: its sections of rows as a rich Table for the terminal,
compare.md, and compare.html (templates/compare.html.j2) with a bar chart as inline SVG."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from rich.table import Table
from rich.text import Text

from autotune.report.compare_runs import Run
from autotune.report.format import fmt_rate, fmt_times
from autotune.report.plots import inline_svg


@dataclass(kw_only=True, slots=True)
class Row:
    label: str
    cells: list[str]
    marked: list[bool] = field(default_factory=list)
    """Cells that differ from the first run's value (highlighted)."""


@dataclass(kw_only=True, slots=True)
class Section:
    title: str
    rows: list[Row]
    note: str = ""


def render_table(title: str, columns: list[str], sections: list[Section], *, headline: str = "",
                 flags: list[str] = ()) -> Table:
    table = Table(title=title + (f"\n{headline}" if headline else ""),
                  caption="\n".join(f"note: {f}" for f in flags) or None)
    table.add_column("")
    for name in columns:
        table.add_column(name, overflow="fold")
    for i, section in enumerate(sections):
        if i:
            table.add_section()
        table.add_row(Text(section.title, style="bold"), *[""] * len(columns))
        rows = section.rows or [Row(label=section.note, cells=[""] * len(columns))]
        for row in rows:
            marked = row.marked or [False] * len(row.cells)
            table.add_row(Text(row.label),
                          *[Text(c, style="bold yellow" if m else "") for c, m in zip(row.cells, marked)])
    return table


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(title: str, runs: list[Run], columns: list[str], sections: list[Section], *,
                    headline: str = "", flags: list[str] = ()) -> str:
    lines = [f"# {title}", ""]
    if headline:
        lines += [f"**{_md_cell(headline)}**", ""]
    lines += [f"- **Note:** {_md_cell(f)}" for f in flags] + ([""] if flags else [])
    lines += [f"{i}. **{_md_cell(c)}**: {_md_cell(r.label)} (`{r.folder}`)"
              for i, (c, r) in enumerate(zip(columns, runs), 1)]
    for section in sections:
        lines += ["", f"## {section.title}", ""]
        if section.note:
            lines += [f"_{section.note}_", ""]
        if not section.rows:
            continue
        lines.append("| | " + " | ".join(_md_cell(c) for c in columns) + " |")
        lines.append("| --- " * (len(columns) + 1) + "|")
        for row in section.rows:
            marked = row.marked or [False] * len(row.cells)
            cells = [f"**{_md_cell(c)}**" if m else _md_cell(c) for c, m in zip(row.cells, marked)]
            lines.append(f"| {_md_cell(row.label)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_html(title: str, runs: list[Run], columns: list[str], sections: list[Section], svg: str | None, *,
                headline: str = "", flags: list[str] = ()) -> str:
    import jinja2
    from markupsafe import Markup

    import autotune

    env = jinja2.Environment(loader=jinja2.PackageLoader("autotune.report", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined)
    return env.get_template("compare.html.j2").render(
        title=title, headline=headline, flags=list(flags), runs=list(zip(columns, runs)), columns=columns,
        sections=sections,
        svg=Markup(svg) if svg else None, version=autotune.__version__,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))


def chart_svg(runs: list[Run], columns: list[str], speedups: dict[str, list[float | None]]) -> str | None:
    """Two bar charts as inline SVG: best samples/s per run, and each precision mode's speed-up."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:  # the tables say it all; the chart is a convenience
        return None
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "autotune", "font.size": 9}):
        fig = Figure(figsize=(10, max(2.5, 1.0 + 0.22 * len(runs) * max(1, len(speedups)))), layout="constrained")
        left, right = fig.subplots(1, 2)
        y = list(range(len(runs)))
        rates = [r.best.samples_per_s for r in runs]
        left.barh(y, rates, color="#4c72b0")
        left.set_yticks(y, columns)
        left.invert_yaxis()
        if max(rates) / max(min(rates), 1e-9) > 30:  # a CPU next to a GPU: keep both bars visible
            left.set_xscale("log")
        for yi, rate in zip(y, rates):
            left.annotate(fmt_rate(rate), (rate, yi), xytext=(3, 0), textcoords="offset points", va="center")
        left.set_xlabel("best samples/s")
        left.margins(x=0.15)
        modes = list(speedups)
        height = 0.8 / max(1, len(runs))
        colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
        for i, (column, run) in enumerate(zip(columns, runs)):
            values = [speedups[m][i] for m in modes]
            ys = [m + i * height for m in range(len(modes))]
            shown = [(yy, v) for yy, v in zip(ys, values) if v is not None]
            if shown:
                bars = right.barh([yy for yy, _ in shown], [v for _, v in shown], height=height,
                                       color=colors[i % len(colors)], label=column)
                right.bar_label(bars, labels=[fmt_times(v) for _, v in shown], padding=2)
        right.set_yticks([m + height * (len(runs) - 1) / 2 for m in range(len(modes))], modes)
        right.invert_yaxis()
        right.axvline(1.0, color="#888", linewidth=0.8)
        right.set_xlabel("speed-up over the run's FP32 baseline")
        right.margins(x=0.15)
        if modes:
            right.legend(loc="lower right", fontsize=8)
        return inline_svg(fig, "compare")
