"""The report's plots: matplotlib figures of the measured trials, rendered to SVG that inlines in
one HTML page (inline_svg, which the comparison page uses too)."""

from __future__ import annotations

import html
import io
import math
import re
from dataclasses import dataclass
from typing import Any

import matplotlib
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, PercentFormatter

from autotune.report.data import ReportData
from autotune.report.format import sort_key, value_label
from autotune.report.styles import FORMAT_COLORS, PRECISION_COLORS, SERIES_COLORS, own_styles, series_styles

@dataclass
class Plot:
    """One figure of the page: its name (the figure's data-plot), title, inline SVG and caption."""

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
    """Measured trials, coloured by precision, shaped by memory format (series_styles); an unstable
    trial hollow, in its configuration's style."""
    groups = list(m.groupby(["knob.precision", "knob.memory_format"], sort=False, dropna=False))
    styles = series_styles([key for key, _ in groups])
    for (mode, fmt), group in groups:
        color, marker = styles[(mode, fmt)]
        flagged = group["unstable"].astype(bool)
        stable, unstable = group[~flagged], group[flagged]
        ax.scatter(stable[x], stable[y], s=34, color=color, marker=marker, alpha=0.85, edgecolors="white",
                   linewidths=0.6, label=f"{mode}, {fmt}", zorder=3)
        if not unstable.empty:
            ax.scatter(unstable[x], unstable[y], s=34, facecolors="none", edgecolors=color, marker=marker,
                       linewidths=1.2, label=f"{mode}, {fmt} (unstable)", zorder=3)


def _label_points(ax, d: ReportData, m: pd.DataFrame, x: str, y: str) -> None:
    """Mark the best, the plain recipe and the FP32 baseline, with text placed away from the data's
    edge; one trial that is two of them gets one mark ("best = plain recipe"), and a mark at the best's
    point is left out."""
    xs, ys = m[x].astype(float), m[y].astype(float)
    x_mid = (xs.min() + xs.max()) / 2
    y_mid = (ys.min() + ys.max()) / 2
    shown = set(m["number"])
    marks: dict[int, tuple[str, str]] = {}
    for row, text, color in ((d.best, "best", "#b30000"), (d.plain_recipe, "plain recipe", "#1f5fa8"),
                             (d.baseline, "baseline", "#222222")):
        if row is not None and int(row["number"]) in shown:
            n = int(row["number"])
            marks[n] = (f"{marks[n][0]} = {text}", marks[n][1]) if n in marks else (text, color)
    best_n = int(d.best["number"]) if d.best is not None else None
    best = m[m["number"] == best_n].iloc[0] if best_n in marks else None
    for n, (text, color) in marks.items():
        row = m[m["number"] == n].iloc[0]
        if n != best_n and best is not None and best[x] == row[x] and best[y] == row[y]:
            continue
        px, py = float(row[x]), float(row[y])
        dx = -14 if px > x_mid else 14
        dy = -16 if py > y_mid else 14
        if n != best_n and best is not None and abs(py - float(best[y])) < 1e-9:
            dy = -dy  # level with the best: its label on the other side
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


def _front_plot(d: ReportData, column: str, xlabel: str, name: str, height: float) -> tuple[str, int, int] | None:
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


def plot_throughput_memory(d: ReportData) -> Plot | None:
    made = _front_plot(d, "peak_memory_gb", "peak memory (GiB)", "throughput-memory", 4.2)
    if made is None:
        return None
    svg, n, count = made
    return Plot("throughput-memory", "Throughput versus peak memory", svg,
                 f"{count} measured configurations; the dashed line is the Pareto front ({n} configurations "
                 "no other one beats on both speed and memory).")


SPEED_ACCURACY_AXES = {
    "accuracy_drop": "accuracy drop vs FP32 (lower is better)",
    "accuracy": "accuracy (higher is better)",
    "loss_drift": "training loss drift vs FP32, share of FP32's loss decrease (lower is better)",
    "loss_deviation": "largest loss deviation from FP32 over the parity run, relative (lower is better)",
}
"""The accuracy axis, by the first column some measured trial has (a language model has no held-out
accuracy: its checks give the loss drift)."""


FAILED = ("violated", "unstable", "error")
"""Accuracy verdicts that fail a configuration (autotune.accuracy.study.gate)."""
_ALLOWED_WORDS = {"accuracy_drop": "drop", "loss_drift": "drift", "loss_deviation": "deviation"}


def speed_accuracy_column(d: ReportData) -> str | None:
    """The accuracy axis's column: the first in SPEED_ACCURACY_AXES some measured trial has."""
    m = d.measured
    return next((c for c in SPEED_ACCURACY_AXES if c in m and pd.to_numeric(m[c], errors="coerce").notna().any()),
                None)


def _checked(d: ReportData, col: str) -> pd.DataFrame:
    m = d.measured
    return m[pd.to_numeric(m[col], errors="coerce").notna()]


def _per_mode_groups(m: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The checked trials by the check they share (their numerics: precision mode and GradScaler
    settings), where some check stands for more than one trial; {} where each trial had its own."""
    keys = m["accuracy_key"].fillna("") if "accuracy_key" in m else pd.Series("", index=m.index)
    groups = {key: group for key, group in m.groupby(keys, sort=False)}
    if not any(len(g) > 1 for key, g in groups.items() if key):
        return {}
    return groups


def _mode_name(group: pd.DataFrame) -> str:
    modes = sorted({str(v) for v in group["knob.precision"].dropna()}, key=sort_key)
    return "/".join(modes) or "?"


def speed_accuracy_flat(d: ReportData) -> str | None:
    """The sentence that stands for the speed-versus-accuracy plot when every configuration checked
    gave the same accuracy figure (a plot would be one vertical line); None where they differ."""
    col = speed_accuracy_column(d)
    if col is None:
        return None
    m = _checked(d, col)
    values = m[col].astype(float).round(9)
    if values.nunique() != 1 or len(m) < 2:
        return None
    from autotune.report.format import fmt_g

    what = SPEED_ACCURACY_AXES[col].split(" (")[0]
    allowed = pd.to_numeric(m.get("accuracy_allowed"), errors="coerce").dropna()
    limit = f" (allowed {fmt_g(allowed.max(), 3)})" if col in _ALLOWED_WORDS and len(allowed) else ""
    failed = int(m["accuracy_verdict"].isin(FAILED).sum()) if "accuracy_verdict" in m else 0
    verdict = (f"all {len(m)} failed the check" if failed == len(m) else
               f"{failed} of them failed the check" if failed else "every one passed the check")
    return (f"All {len(m)} configurations checked have the same {what}, {fmt_g(values.iloc[0], 3)}{limit}: "
            f"the check cannot tell them apart, so there is no plot of speed against it; {verdict}.")


def plot_speed_accuracy(d: ReportData) -> Plot | None:
    """samples/s against the accuracy figure: the allowed drop or drift drawn as a line, the
    configurations that failed the check marked, the Pareto front among those that passed. Where one
    check stands for every trial of a precision mode (the check trains the numerics, not each
    configuration), the plot says so and labels each mode's column of points. None without an
    accuracy figure, or when every point is equal (speed_accuracy_flat says so in words)."""
    col = speed_accuracy_column(d)
    if col is None or speed_accuracy_flat(d) is not None:
        return None
    m = _checked(d, col)
    verdicts = m["accuracy_verdict"] if "accuracy_verdict" in m else pd.Series(None, index=m.index)
    failed = verdicts.isin(FAILED)
    allowed = sorted(set(pd.to_numeric(m.get("accuracy_allowed"), errors="coerce").dropna().round(6)))
    allowed = allowed if col in _ALLOWED_WORDS else []
    groups = _per_mode_groups(m)
    with matplotlib.rc_context(_RC):
        fig, ax = _figure(7.2, 4.2)
        n = _front_line(ax, m[~failed], col, "samples_per_s", x_low=col != "accuracy")
        _scatter(ax, m, col, "samples_per_s")
        if failed.any():
            ax.scatter(m.loc[failed, col].astype(float), m.loc[failed, "samples_per_s"].astype(float), marker="x",
                       s=90, color="#b30000", linewidths=1.8, zorder=5, label="failed the check")
        for i, limit in enumerate(allowed):
            ax.axvline(limit, color="#b30000", linestyle=":", linewidth=1.4, zorder=3,
                       label=f"allowed {_ALLOWED_WORDS[col]}" if i == 0 else None)
        _label_points(ax, d, m, col, "samples_per_s")
        xs = m[col].astype(float).tolist() + list(allowed)
        span = (max(xs) - min(xs)) or abs(max(xs)) or 1.0
        if groups:  # each mode's column of points labelled above its highest, staggered where two are close
            previous, level = None, 0
            shared = [g for g in groups.values() if len(g) > 1]  # a check of one trial is that trial's own
            for group in sorted(shared, key=lambda g: float(g[col].astype(float).median())):
                x = float(group[col].astype(float).median())
                level = 1 - level if previous is not None and abs(x - previous) < 0.3 * span else 0
                previous = x
                ax.annotate(f"{_mode_name(group)}: 1 check, {len(group)} trials",
                            (x, float(group["samples_per_s"].max())),
                            xytext=(0, 10 + 13 * level), textcoords="offset points",
                            ha="center", va="bottom", fontsize=7, color="#444444",
                            arrowprops={"arrowstyle": "-", "color": "#bbbbbb", "lw": 0.6})
            ax.set_title("one accuracy check per precision mode: the points of a mode share its value",
                         fontsize=8, color="#444444", loc="left")
        ax.set_xlabel(SPEED_ACCURACY_AXES[col])
        ax.set_ylabel("samples/s")
        ax.set_xlim(min(xs) - 0.15 * span, max(xs) + 0.15 * span)
        ax.margins(y=0.25)
        _legend(ax)
        svg = inline_svg(fig, "speed-accuracy")
    from autotune.report.format import fmt_g

    caption = f"{len(m)} configuration{'s' if len(m) != 1 else ''} with an accuracy check"
    if allowed:
        caption += (f"; red dotted line: the allowed {_ALLOWED_WORDS[col]} "
                    f"({', '.join(fmt_g(a, 3) for a in allowed)}, FP32's own reshuffle noise included)")
    caption += (f"; × marks the {int(failed.sum())} that failed the check" if failed.any()
                else "; every one passed the check")
    caption += f"; the dashed line is the Pareto front of those that passed ({n})."
    if groups:
        caption += (" The check trains each precision mode's numerics once, not each configuration: every "
                    "trial of a mode shares its mode's value (each column of points is labelled with its mode "
                    "and how many trials share that one check).")
    return Plot("speed-accuracy", "Speed versus accuracy", svg, caption)


def _bars(ax, labels: list[str], best: list[float], median: list[float], counts: list[int], colors: list[str],
          offset: float = 0.0, width: float = 0.8, legend: str | None = None) -> None:
    xs = [i + offset for i in range(len(labels))]
    ax.bar(xs, best, width=width, color=colors, edgecolor="white", linewidth=0.5, label=legend, zorder=2)
    ax.scatter(xs, median, marker="_", s=220 * width, color="#111111", linewidths=1.6, zorder=3)
    for x, b, n in zip(xs, best, counts):
        ax.annotate(f"n={n}" if n else "not run", (x, b), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize=7, color="#444444")


def plot_precision_format(d: ReportData) -> Plot | None:
    m = d.measured
    if m.empty:
        return None
    modes = sorted(m["knob.precision"].dropna().unique(), key=sort_key)
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
    return Plot("knob-precision-memory_format", "Precision × memory format", svg,
                 "Best (bar) and median (black line) samples/s of the measured configurations; n: how many.")


def plot_knob(effect: dict[str, Any]) -> Plot:
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
    return Plot(name, effect["label"], svg)


PAIR_COLORS = {1: "#1b9e77", -1: "#d95f02", 0: "#888888"}
"""A pair's dot: faster beyond its noise, slower beyond it, within it."""
_RATIO_TICKS = [1.05, 1.1, 1.25, 1.5, 2, 3, 5, 10, 20, 50, 100]


def _ratio_ticks(high: float) -> list[float]:
    """Ticks of a log axis of ratios from 1/high to high: at most four each side of 1, symmetric
    (0.5x as far from 1 as 2x), where the decades matplotlib places would leave only 1."""
    # ticks closer to 1 than a sixth of the axis's half-width print over the 1x label
    up = [t for t in _RATIO_TICKS if t <= high and math.log(t) >= math.log(high) / 6]
    while len(up) > 4:
        up = up[1::2]
    return [1 / t for t in reversed(up)] + [1.0] + up


def plot_paired(d: ReportData) -> Plot | None:
    """Each change of a knob's value that pairs of trials make alone: one dot per pair (its samples/s
    ratio, log scale), the median, and the noise band within which a ratio says nothing."""
    effects = d.effects
    changes = [(f"{p.label}: {c.label}", c)
               for p in (effects.params if effects is not None else []) for c in p.changes]
    if not changes:
        return None
    with matplotlib.rc_context(_RC):
        fig, ax = _figure(7.2, 0.9 + 0.3 * len(changes))
        for i, (_, c) in enumerate(changes):
            low, high = 1 / (1 + c.noise), 1 + c.noise  # a ratio in [low, high] is within the noise
            ax.barh(i, high - low, left=low, height=0.7, color="#e8e8e8", zorder=1)
            ax.scatter(c.ratios, [i] * len(c.ratios), s=22, color=[PAIR_COLORS[s] for s in c.signs],
                       edgecolors="white", linewidths=0.5, zorder=3)
            ax.scatter([c.ratio], [i], marker="|", s=160, color="#111111", linewidths=1.6, zorder=4)
        ax.axvline(1.0, color="#777777", linewidth=0.8, zorder=2)
        ax.set_xscale("log")
        values = [r for _, c in changes for r in c.ratios] + [1 + max(c.noise for _, c in changes)]
        high = 1.15 * max(max(values), 1 / min(values))  # symmetric: a halving as wide as a doubling
        ax.set_xlim(1 / high, high)
        ax.set_xticks(_ratio_ticks(high))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}×"))
        ax.set_xticks([], minor=True)
        ax.set_yticks(range(len(changes)), [label for label, _ in changes])
        ax.set_ylim(len(changes) - 0.5, -0.5)
        ax.set_xlabel("samples/s after the change / before it (log scale)")
        svg = inline_svg(fig, "knob-pairs")
    return Plot("knob-pairs", "Paired effects", svg,
                "One dot per pair of trials that differ in that knob alone (green: faster, orange: slower beyond "
                "the noise, grey: within it); black line: the median; grey band: the noise, within which a "
                "difference says nothing.")


def plot_batch(d: ReportData) -> Plot | None:
    m = d.measured[d.measured["knob.batch_size"].notna()]
    if m.empty:
        return None
    with matplotlib.rc_context(_RC):
        fig, (ax_rate, ax_mem) = _figure(8.0, 3.4, ncols=2)
        batches = sorted({int(b) for b in m["knob.batch_size"]})
        modes = sorted(m["knob.precision"].dropna().unique(), key=sort_key)
        colors = own_styles(modes, PRECISION_COLORS, SERIES_COLORS)
        for mode in modes:
            sub = m[m["knob.precision"] == mode]
            # the fastest configuration at each batch size, and the memory that one needed
            top = sub.loc[sub.groupby("knob.batch_size")["samples_per_s"].idxmax()].sort_values("knob.batch_size")
            color = colors[mode]
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
    return Plot("batch-size", "Throughput and memory versus batch size", svg,
                 "One line per precision: the fastest configuration measured at each batch size.")


def plot_energy(d: ReportData) -> Plot | None:
    made = _front_plot(d, "joules_per_sample", "energy per sample (J)", "energy", 3.8)
    if made is None:
        return None
    svg, n, count = made
    return Plot("energy", "Throughput versus energy per sample", svg,
                 f"{count} configurations with energy measured; dashed: Pareto front ({n}).")


def plot_profile(profiles: list[dict[str, Any]]) -> Plot | None:
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
    return Plot("profile", "Where the step time goes", svg)
