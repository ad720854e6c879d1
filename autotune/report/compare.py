"""Compare `autotune search` output folders (GPUs, drivers, torch versions): the best configuration
of each run side by side, the knobs in which they differ, each run's throughput and memory relative
to the first, and what each precision mode buys on each run over that run's own FP32 baseline.

    comparison = compare([Path("reports/resnet50-h200"), Path("reports/resnet50-a100")], Path("cmp"))
    console.print(comparison.table)       # and cmp/compare.html, cmp/compare.md

Only recorded figures are shown: a figure a run did not measure (no baseline trial, no energy,
a precision mode not searched) reads "-" or "not measured", never an estimate.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
from rich.table import Table
from rich.text import Text

from autotune.errors import ConfigError
from autotune.report.render import inline_svg
from autotune.search.objective import describe

PRECISION_MODES = ("fp32", "tf32", "fp16", "bf16")
"""The precision modes the search knows, in the order the speed-up table lists them."""

MISSING = "-"
NOT_MEASURED = "not measured"


@dataclass(kw_only=True, slots=True)
class Measured:
    """One measured configuration of a run (its best, or its FP32 baseline)."""

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
    """E.g. "resnet50 on NVIDIA H200, torch 2.11.0+cu130"."""
    model: str
    workload: dict[str, Any]
    """config.json's workload: model, input_shape (None: the model's default), num_classes."""
    device: str
    """"cuda" or "cpu"."""
    provenance: dict[str, Any]
    best: Measured
    baseline: Measured | None
    """The FP32 baseline trial; None when the search has none that completed."""
    trials: pd.DataFrame
    """trials.csv: every trial, its state and figures (empty when the file is missing)."""
    info: dict[str, Any] = field(repr=False)
    """The whole of config.json."""

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def where(self) -> str:
        """The device in words: "NVIDIA H200", "CPU (2 cores)"."""
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
    best = Measured(summary=info.get("summary") or describe(info["knobs"]), knobs=info["knobs"],
                    figures=info["figures"], trial_number=(info.get("study") or {}).get("trial_number"))
    baseline = None if not base else Measured(summary=base.get("summary") or describe(base.get("knobs", {})),
                                              knobs=base.get("knobs", {}), figures=base["figures"],
                                              trial_number=base.get("trial_number"))
    device = info.get("device") or ("cuda" if info["provenance"].get("gpu") else "cpu")
    run = Run(folder=folder, label="", model=str(info["workload"]["model"]), workload=info["workload"],
              device=device, provenance=info["provenance"], best=best, baseline=baseline, trials=trials, info=info)
    run.label = f"{run.model} on {run.where}, torch {run.provenance.get('torch', '?')}"
    return run


# ------------------------------------------------------------------------------------------------
# the comparison: one model of rows, rendered to a rich Table, Markdown and HTML


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


@dataclass(kw_only=True, slots=True)
class Comparison:
    """What `compare` wrote and found; `table` is for the terminal."""

    runs: list[Run]
    columns: list[str]
    """One column name per run (its folder name, numbered when two are alike)."""
    sections: list[Section]
    differing_knobs: dict[str, list[Any]]
    """Knob field ("batch_size.batch_size") -> each run's value, only where the best configurations differ."""
    ratios: dict[str, list[float | None]]
    """"samples_per_s" / "peak_memory" -> each run's figure over the first run's."""
    precision_speedups: dict[str, list[float | None]]
    """Precision mode -> each run's best samples/s with it over its FP32 baseline; None: not measured."""
    html: Path
    markdown: Path
    table: Table
    chart: bool
    """Whether compare.html holds the bar chart (matplotlib available)."""


def compare(folders: Sequence[Path], out_dir: Path, *, allow_different_models: bool = False) -> Comparison:
    """Compare the runs in `folders` and write compare.html and compare.md into `out_dir`."""
    folders = [Path(f) for f in folders]
    if len(folders) < 2:
        given = f": only {folders[0]}" if folders else ""
        raise ConfigError(f"compare needs at least two output folders of `autotune search`{given}")
    runs = [load_run(f) for f in folders]
    if not allow_different_models and len({r.workload_key for r in runs}) > 1:
        which = "; ".join(f"{r.workload_text} in {r.folder}" for r in runs)
        raise ConfigError(f"these runs tuned different models ({which}), so their figures are not comparable; "
                          "pass --allow-different-models (allow_different_models=True) if that is what you mean")
    columns = _column_names(runs)
    differing = _differing_knobs(runs)
    ratios = _ratios(runs)
    speedups = _precision_speedups(runs)
    sections = [
        _side_by_side(runs),
        _knob_section(runs, differing),
        _ratio_section(runs, columns, ratios),
        _precision_section(runs, speedups),
    ]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"autotune: comparing {len(runs)} runs"
    svg = _chart_svg(runs, columns, speedups)
    html_path, md_path = out_dir / "compare.html", out_dir / "compare.md"
    html_path.write_text(_render_html(title, runs, columns, sections, svg))
    md_path.write_text(_render_markdown(title, runs, columns, sections))
    return Comparison(runs=runs, columns=columns, sections=sections, differing_knobs=differing, ratios=ratios,
                      precision_speedups=speedups, html=html_path, markdown=md_path,
                      table=_render_table(title, columns, sections), chart=svg is not None)


def _column_names(runs: list[Run]) -> list[str]:
    names = [r.name or str(r.folder) for r in runs]
    if len(set(names)) < len(names):
        names = [f"{i}: {name}" for i, name in enumerate(names, 1)]
    return names


def _flatten(knobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {f"{knob}.{key}": value for knob, values in knobs.items() for key, value in (values or {}).items()}


def _differing_knobs(runs: list[Run]) -> dict[str, list[Any]]:
    flat = [_flatten(r.best.knobs) for r in runs]
    order: list[str] = []
    for f in flat:
        order += [k for k in f if k not in order]
    return {k: [f.get(k) for f in flat] for k in order if any(f.get(k) != flat[0].get(k) for f in flat)}


def _ratios(runs: list[Run]) -> dict[str, list[float | None]]:
    first = runs[0]

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    out = {
        "samples_per_s": [ratio(r.best.samples_per_s, first.best.samples_per_s) for r in runs],
        "peak_memory": [ratio(r.best.peak_memory_gib, first.best.peak_memory_gib) for r in runs],
    }
    if any(r.joules_per_sample is not None for r in runs):
        out["joules_per_sample"] = [ratio(r.joules_per_sample, first.joules_per_sample) for r in runs]
    return out


def _precision_speedups(runs: list[Run]) -> dict[str, list[float | None]]:
    per_run = [r.precision_speedups() for r in runs]
    present = {m for s in per_run for m in s}
    modes = [m for m in PRECISION_MODES if m in present] + sorted(present - set(PRECISION_MODES))
    return {m: [s.get(m) for s in per_run] for m in modes}


# formatting --------------------------------------------------------------------------------------


def _number(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _rate(x: float | None) -> str:
    if x is None:
        return MISSING
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _times(x: float | None) -> str:
    if x is None:
        return MISSING
    return f"{x:.2f}x" if x >= 0.095 else f"{x:.2g}x"


def _fixed(x: float | None, digits: int) -> str:
    return MISSING if x is None else f"{x:.{digits}f}"


def _value(x: Any) -> str:
    if x is None:
        return MISSING
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x)


def cudnn_version(v: Any) -> str:
    """torch.backends.cudnn.version()'s integer in words: 91900 -> "9.19.0", 8907 -> "8.9.7"."""
    if isinstance(v, str) or v is None:
        return MISSING if not v else v
    v = int(v)
    major, rest = (v // 10000, v % 10000) if v >= 90000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _side_by_side(runs: list[Run]) -> Section:
    def row(label: str, values: list[str]) -> Row:
        return Row(label=label, cells=values)

    def prov(key: str) -> list[str]:
        return [str(r.provenance[key]) if r.provenance.get(key) not in (None, "") else MISSING for r in runs]

    def energy(r: Run) -> str:
        j = r.joules_per_sample
        return NOT_MEASURED if j is None else f"{j:.3g}"

    return Section(title="Best configuration side by side", rows=[
        row("model", [r.workload_text for r in runs]),
        row("device", [r.where for r in runs]),
        row("torch", prov("torch")),
        row("CUDA", prov("cuda")),
        row("cuDNN", [cudnn_version(r.provenance.get("cudnn")) for r in runs]),
        row("driver", prov("driver")),
        row("objective", [_objective_text(r) for r in runs]),
        row("best configuration", [r.best.summary for r in runs]),
        row("samples/s", [_rate(r.best.samples_per_s) for r in runs]),
        row("step ms", [_fixed(r.best.step_time_ms, 1) for r in runs]),
        row("peak memory GiB", [_fixed(r.best.peak_memory_gib, 2) for r in runs]),
        row("FP32 baseline", [MISSING if r.baseline is None else
                              f"{r.baseline.summary}: {_rate(r.baseline.samples_per_s)} samples/s" for r in runs]),
        row("speed-up over own FP32 baseline", [_times(r.speedup) for r in runs]),
        row("joules per sample", [energy(r) for r in runs]),
    ], note=_objective_note(runs))


def _objective_note(runs: list[Run]) -> str:
    from autotune.search.goal import goal_of_config

    names = [goal_of_config(r.info).name for r in runs]
    if len(set(names)) == 1:
        return f"each run's best configuration is the best by {names[0]}"
    return ("the runs optimized different objectives (" + ", ".join(names) + "): each best configuration is "
            "the best by its own run's objective, so their figures answer different questions")


def _objective_text(run: Run) -> str:
    """What the run's best configuration was ranked by (config.json's objective; throughput for a
    config.json written before --objective existed), with its value."""
    from autotune.search.goal import goal_of_config

    target = goal_of_config(run.info)
    value = (run.info.get("objective") or {}).get("value") if isinstance(run.info.get("objective"), dict) else None
    return target.name + (f": {target.format(value)}" if value is not None else "")


def _knob_section(runs: list[Run], differing: dict[str, list[Any]]) -> Section:
    rows = []
    for knob, values in differing.items():
        cells = [_value(v) for v in values]
        rows.append(Row(label=knob, cells=cells, marked=[c != cells[0] for c in cells]))
    note = ("highlighted: differs from the first run" if rows
            else "none: every knob is set the same in the best configurations")
    return Section(title="Knobs that differ between the best configurations", rows=rows, note=note)


def _ratio_section(runs: list[Run], columns: list[str], ratios: dict[str, list[float | None]]) -> Section:
    labels = {"samples_per_s": "samples/s", "peak_memory": "peak memory", "joules_per_sample": "joules per sample"}
    return Section(title=f"Relative to {columns[0]}",
                   rows=[Row(label=labels[k], cells=[_times(x) for x in v]) for k, v in ratios.items()],
                   note="each run's best configuration over the first run's")


def _precision_section(runs: list[Run], speedups: dict[str, list[float | None]]) -> Section:
    best = [r.best_by_precision() for r in runs]
    rows = []
    for mode, values in speedups.items():
        cells = []
        for s, b in zip(values, best):
            rate = b.get(mode)
            cells.append(MISSING if rate is None else f"{_times(s)} ({_rate(rate)} samples/s)")
        rows.append(Row(label=mode, cells=cells))
    return Section(title="Speed-up of each precision mode over the run's own FP32 baseline", rows=rows,
                   note="the best samples/s among completed trials with that mode (in brackets) over the "
                        f"run's FP32 baseline samples/s; {MISSING} where the mode was not measured on that run, "
                        f"or, before the bracket, where the run has no baseline")


# rendering ---------------------------------------------------------------------------------------


def _render_table(title: str, columns: list[str], sections: list[Section]) -> Table:
    table = Table(title=title)
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
            table.add_row(Text(row.label), *[Text(c, style="bold yellow" if m else "") for c, m in zip(row.cells, marked)])
    return table


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _render_markdown(title: str, runs: list[Run], columns: list[str], sections: list[Section]) -> str:
    lines = [f"# {title}", ""]
    lines += [f"{i}. **{_md_cell(c)}**: {_md_cell(r.label)} (`{r.folder}`)" for i, (c, r) in enumerate(zip(columns, runs), 1)]
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


_HTML = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{ title }}</title>
<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 72rem;
       padding: 0 1rem; color: #1d1d1f; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.15rem; margin-top: 2rem; }
table { border-collapse: collapse; margin: .5rem 0; }
th, td { border: 1px solid #d0d0d7; padding: .3rem .6rem; text-align: left; vertical-align: top; }
th { background: #f3f3f6; }
td.diff { background: #fff3c4; font-weight: 600; }
th[scope=row] { background: #fafafc; font-weight: 500; }
.note { color: #5f5f6a; font-size: .9rem; }
figure { margin: 1rem 0; } svg { max-width: 100%; height: auto; }
figure svg * { stroke-linejoin: round; stroke-linecap: butt; }
footer { margin-top: 2rem; color: #8a8a95; font-size: .8rem; }
</style>
</head>
<body>
<h1>{{ title }}</h1>
<ol>
{% for column, run in runs %}  <li><strong>{{ column }}</strong>: {{ run.label }} <code>{{ run.folder }}</code></li>
{% endfor %}</ol>
{% for section in sections %}
<section>
<h2>{{ section.title }}</h2>
{% if section.note %}<p class="note">{{ section.note }}</p>{% endif %}
{% if section.rows %}<table>
<thead><tr><th></th>{% for column in columns %}<th scope="col">{{ column }}</th>{% endfor %}</tr></thead>
<tbody>
{% for row in section.rows %}<tr><th scope="row">{{ row.label }}</th>{% for cell in row.cells %}<td{% if row.marked and row.marked[loop.index0] %} class="diff"{% endif %}>{{ cell }}</td>{% endfor %}</tr>
{% endfor %}</tbody>
</table>{% endif %}
</section>
{% endfor %}
{% if svg %}<section>
<h2>Best samples/s, and each precision mode's speed-up over the run's FP32 baseline</h2>
<figure>{{ svg }}</figure>
</section>{% endif %}
<footer>autotune {{ version }}, {{ created }}</footer>
</body>
</html>
"""


def _render_html(title: str, runs: list[Run], columns: list[str], sections: list[Section], svg: str | None) -> str:
    import jinja2
    from markupsafe import Markup

    import autotune

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(_HTML).render(
        title=title, runs=list(zip(columns, runs)), columns=columns, sections=sections,
        svg=Markup(svg) if svg else None, version=autotune.__version__,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))


def _chart_svg(runs: list[Run], columns: list[str], speedups: dict[str, list[float | None]]) -> str | None:
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
            left.annotate(_rate(rate), (rate, yi), xytext=(3, 0), textcoords="offset points", va="center")
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
                right.bar_label(bars, labels=[_times(v) for _, v in shown], padding=2)
        right.set_yticks([m + height * (len(runs) - 1) / 2 for m in range(len(modes))], modes)
        right.invert_yaxis()
        right.axvline(1.0, color="#888", linewidth=0.8)
        right.set_xlabel("speed-up over the run's FP32 baseline")
        right.margins(x=0.15)
        if modes:
            right.legend(loc="lower right", fontsize=8)
        return inline_svg(fig, "compare")
