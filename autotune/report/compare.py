"""Compare `autotune search` output folders (GPUs, drivers, torch versions): the best configuration
of each run side by side (with its speed-up over its own plain recipe and FP32 baseline), the knobs
in which they differ, each run's throughput and memory relative to the first, and what each
precision mode buys on each run over that run's own FP32 baseline.

    comparison = compare([Path("reports/resnet50-h200"), Path("reports/resnet50-a100")], Path("cmp"))
    console.print(comparison.table)       # and cmp/compare.html, cmp/compare.md

Only recorded figures are shown: a figure a run did not measure (no baseline trial, no energy,
a precision mode not searched) reads "-" or "not measured", never an estimate.

This module builds the comparison; compare_runs reads each folder and compare_render shows the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from rich.table import Table

import strategies
from autotune.errors import ConfigError
from autotune.report.compare_render import (
    Row,
    Section,
    chart_svg,
    render_html,
    render_markdown,
    render_table,
)
from autotune.report.compare_runs import Run, load_run
from autotune.report.format import MISSING, fmt_fixed, fmt_gib, fmt_rate, fmt_times
from strategies.precision import MODES

PRECISION_MODES = MODES
"""The precision modes the search knows, in the order the speed-up table lists them."""

NOT_MEASURED = "not measured"
DOES_NOT_APPLY = "n/a"
"""A knob's value in a run it does not apply to (a GradScaler setting without fp16)."""


@dataclass(kw_only=True, slots=True)
class Comparison:
    """What `compare` wrote and found; `table` is for the terminal."""

    runs: list[Run]
    columns: list[str]
    """One column name per run (its folder name, numbered when two are alike)."""
    sections: list[Section]
    differing_knobs: dict[str, list[Any]]
    """Knob field ("batch_size.batch_size") -> each run's value, only where the best configurations differ
    (differing_knobs: a knob at its default in one run and not recorded in another is no difference)."""
    ratios: dict[str, list[float | None]]
    """"samples_per_s" / "peak_memory" -> each run's figure over the first run's."""
    precision_speedups: dict[str, list[float | None]]
    """Precision mode -> each run's best samples/s with it over its FP32 baseline; None: not measured."""
    plain_recipe_speedups: list[float | None]
    """Each run's best samples/s over its own plain recipe's; None: no plain recipe in its config.json."""
    headline: str
    """Which run is faster and by how much, in one sentence."""
    flags: list[str]
    """What differs between the runs besides the device that bears on the figures (torch, batch size)."""
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
    svg = chart_svg(runs, columns, speedups)
    headline, flags = _headline(runs, columns), _flags(runs, columns)
    html_path, md_path = out_dir / "compare.html", out_dir / "compare.md"
    html_path.write_text(render_html(title, runs, columns, sections, svg, headline=headline, flags=flags))
    md_path.write_text(render_markdown(title, runs, columns, sections, headline=headline, flags=flags))
    return Comparison(runs=runs, columns=columns, sections=sections, differing_knobs=differing, ratios=ratios,
                      precision_speedups=speedups, plain_recipe_speedups=[r.speedup_vs_plain_recipe for r in runs],
                      headline=headline, flags=flags, html=html_path, markdown=md_path,
                      table=render_table(title, columns, sections, headline=headline, flags=flags),
                      chart=svg is not None)


def times_words(x: float) -> str:
    """A factor of 1 or more in words a reader compares at a glance: "1.18x", "1,633x"."""
    return f"{x:,.0f}x" if x >= 100 else f"{x:.2f}x"


def relative_words(x: float | None, more: str, less: str) -> str:
    """A run's figure over the first run's, as how many times more or less: "1.18x faster", "1,633x
    slower", "the same" (not "0.00061x")."""
    if x is None:
        return MISSING
    if abs(x - 1) < 0.005:
        return "the same"
    return f"{times_words(x)} {more}" if x > 1 else f"{times_words(1 / x)} {less}"


def _headline(runs: list[Run], columns: list[str]) -> str:
    """Which run's best configuration is the fastest, and by how much over each other run."""
    order = sorted(range(len(runs)), key=lambda i: -runs[i].best.samples_per_s)
    top = order[0]
    fast = runs[top].best.samples_per_s
    parts = []
    for i in order[1:]:
        rate = runs[i].best.samples_per_s
        ratio = fast / rate if rate else None
        if ratio is None:
            continue
        if ratio < 1.005:
            parts.append(f"as fast as {columns[i]} ({fmt_rate(rate)} samples/s)")
        else:
            parts.append(f"{times_words(ratio)} as fast as {columns[i]} ({fmt_rate(rate)} samples/s)")
    return (f"{columns[top]} is the fastest: its best configuration trains {fmt_rate(fast)} samples/s, "
            + "; ".join(parts) + ".")


def _flags(runs: list[Run], columns: list[str]) -> list[str]:
    """What else differs between the runs and bears on the figures: torch versions, and the best
    configurations' batch sizes (a throughput at another batch is not the same step)."""
    flags = []
    versions = [str(r.provenance.get("torch") or MISSING) for r in runs]
    if len(set(versions)) > 1:
        flags.append("torch versions differ (" + ", ".join(f"{c}: {v}" for c, v in zip(columns, versions))
                     + "): part of the difference may be torch's, not the device's")
    batches = [((r.best.knobs.get("batch_size") or {}).get("batch_size")) for r in runs]
    if len({b for b in batches if b is not None}) > 1:
        flags.append("batch sizes differ (" + ", ".join(f"{c}: {_value(b)}" for c, b in zip(columns, batches))
                     + "): each run's samples/s is at its own best batch, so a step of one is not a step of "
                     "the other")
    return flags


def _column_names(runs: list[Run]) -> list[str]:
    names = [r.name or str(r.folder) for r in runs]
    if len(set(names)) < len(names):
        names = [f"{i}: {name}" for i, name in enumerate(names, 1)]
    return names


def _flatten(knobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {f"{knob}.{key}": value for knob, values in knobs.items() for key, value in (values or {}).items()}


def _differing_knobs(runs: list[Run]) -> dict[str, list[Any]]:
    return differing_knobs([r.best.knobs for r in runs])


def _applies(name: str, knobs: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether the knob ``name`` means something in a configuration (its recorded knobs), as its strategy
    says of the fields it reports (ReportKnob.only: GradScaler settings only with fp16); a knob that
    reports none, or that this autotune does not know, applies."""
    strategy = strategies.BY_NAME.get(name)
    reported = strategy.report_knobs() if strategy is not None else []
    return not reported or any(knob.only(knobs) for knob in reported)


def differing_knobs(configs: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, list[Any]]:
    """Knob field ("batch_size.batch_size") -> each configuration's recorded value, for the fields in which
    the configurations differ. A field a configuration does not record (written by an older autotune) is
    compared as its untuned default, which is what ran (strategies.with_untuned), and shown as not recorded
    (None); in a configuration a knob does not apply to (fp8_layers without fp8), it is DOES_NOT_APPLY."""
    recorded = [_flatten(dict(c)) for c in configs]
    ran = []
    for config in configs:
        knobs = strategies.with_untuned(config)
        ran.append({f"{name}.{key}": value if _applies(name, knobs) else DOES_NOT_APPLY
                    for name, values in knobs.items() for key, value in values.items()})
    order = list(dict.fromkeys(k for f in recorded for k in f))
    return {k: [DOES_NOT_APPLY if r.get(k) == DOES_NOT_APPLY else f.get(k) for f, r in zip(recorded, ran)]
            for k in order if any(r.get(k) != ran[0].get(k) for r in ran)}


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


# values in words (the number formatters the report shares are in autotune.report.format) ------------


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
        row("samples/s", [fmt_rate(r.best.samples_per_s) for r in runs]),
        row("step ms", [fmt_fixed(r.best.step_time_ms, 1) or MISSING for r in runs]),
        row("peak memory GiB", [fmt_gib(r.best.peak_memory_gib) or MISSING for r in runs]),
        row("FP32 baseline", [MISSING if r.baseline is None else
                              f"{r.baseline.summary}: {fmt_rate(r.baseline.samples_per_s)} samples/s" for r in runs]),
        row("plain recipe", [_plain_recipe_text(r) for r in runs]),
        row("speed-up over own plain recipe", [_over_plain_recipe(r) for r in runs]),
        row("speed-up over own FP32 baseline", [fmt_times(r.speedup) for r in runs]),
        row("joules per sample", [energy(r) for r in runs]),
    ], note=_objective_note(runs))


def _plain_recipe_text(run: Run) -> str:
    """The run's plain recipe and its samples/s; why it has none (config.json says), or "-" for a
    config.json written before the recipe was measured."""
    if run.plain_recipe is None:
        return run.plain_recipe_missing or MISSING
    return f"{run.plain_recipe.summary}: {fmt_rate(run.plain_recipe.samples_per_s)} samples/s"


def _over_plain_recipe(run: Run) -> str:
    """The run's best over its plain recipe; that nothing beat the recipe where it is the best."""
    text = fmt_times(run.speedup_vs_plain_recipe)
    return f"{text} (nothing beat it: the recipe is the best)" if run.best_is_plain_recipe else text


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
    note = (f"highlighted: differs from the first run; {MISSING}: not recorded by that run's autotune, which ran "
            f"the knob's default; {DOES_NOT_APPLY}: the knob does not apply to that run's configuration" if rows
            else "none: every knob that applies is set the same in the best configurations")
    return Section(title="Knobs that differ between the best configurations", rows=rows, note=note)


def _ratio_section(runs: list[Run], columns: list[str], ratios: dict[str, list[float | None]]) -> Section:
    labels = {"samples_per_s": "samples/s", "peak_memory": "peak memory", "joules_per_sample": "joules per sample"}
    words = {"samples_per_s": ("faster", "slower"), "peak_memory": ("more", "less"),
             "joules_per_sample": ("more", "less")}
    rows = [Row(label=labels[k], cells=[relative_words(x, *words[k]) if i else
                                        ("the reference" if x is not None else MISSING)
                                        for i, x in enumerate(v)]) for k, v in ratios.items()]
    return Section(title=f"Relative to {columns[0]}", rows=rows,
                   note="each run's best configuration over the first run's: how many times faster or slower, "
                        "more or less")


def _precision_section(runs: list[Run], speedups: dict[str, list[float | None]]) -> Section:
    best = [r.best_by_precision() for r in runs]
    rows = []
    for mode, values in speedups.items():
        cells = []
        for s, b in zip(values, best):
            rate = b.get(mode)
            cells.append(MISSING if rate is None else f"{fmt_times(s)} ({fmt_rate(rate)} samples/s)")
        rows.append(Row(label=mode, cells=cells))
    return Section(title="Speed-up of each precision mode over the run's own FP32 baseline", rows=rows,
                   note="the best samples/s among completed trials with that mode (in brackets) over the "
                        f"run's FP32 baseline samples/s; {MISSING} where the mode was not measured on that run, "
                        f"or, before the bracket, where the run has no baseline")
