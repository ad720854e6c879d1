"""Numbers and knob values in words, as the report (report.md/.html) and the comparison
(compare.md/.html) print them: one place for every formatter the pages share."""

from __future__ import annotations

import math
from typing import Any

from strategies.precision import MODES

GIB = 2**30
MISSING = "-"
"""What the comparison prints for a figure a run did not record."""
PRECISION_ORDER = list(MODES)


def as_float(v: Any) -> float | None:
    """``v`` as a float; None for None, a bool, text that is no number, or NaN."""
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def fmt_rate(v: Any) -> str:
    f = as_float(v)
    if f is None:
        return ""
    return f"{f:,.0f}" if f >= 100 else f"{f:,.1f}"


def fmt_ms(v: Any) -> str:
    f = as_float(v)
    return "" if f is None else (f"{f:,.1f}" if f >= 10 else f"{f:.2f}")


def fmt_fixed(v: Any, digits: int) -> str:
    f = as_float(v)
    return "" if f is None else f"{f:.{digits}f}"


def fmt_gib(v: Any) -> str:
    return fmt_fixed(v, 2)


def fmt_pct(v: Any, digits: int = 1) -> str:
    f = as_float(v)
    return "" if f is None else f"{100 * f:.{digits}f}%"


def fmt_s(v: Any) -> str:
    f = as_float(v)
    if f is None:
        return ""
    if f >= 3600:
        return f"{f / 3600:.1f} h"
    if f >= 120:
        return f"{f / 60:.1f} min"
    return f"{f:.1f} s"


def fmt_g(v: Any, digits: int = 4) -> str:
    f = as_float(v)
    return "" if f is None else f"{f:.{digits}g}"


def fmt_ratio(v: Any) -> str:
    f = as_float(v)
    return "" if f is None else f"{f:.2f}×"


def fmt_times(x: float | None) -> str:
    """The comparison's ratio: an ASCII "x", and two significant digits below 0.095 (the report's
    fmt_ratio prints "×" and always two decimals, so the two pages keep their own)."""
    if x is None:
        return MISSING
    return f"{x:.2f}x" if x >= 0.095 else f"{x:.2g}x"


def value_label(v: Any) -> str:
    """A knob's value in words: on/off for a flag, 2 rather than 2.0."""
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float) and v.is_integer():
        return f"{v:g}"
    return str(v)


def sort_key(v: Any) -> tuple:
    """The order knob values are listed in: precision modes by PRECISION_ORDER, then numbers, then text."""
    if isinstance(v, str) and v in PRECISION_ORDER:
        return (0, PRECISION_ORDER.index(v), "")
    if isinstance(v, (int, float)):
        return (1, float(v), "")
    return (2, 0, str(v))


def trial_counts(cost: dict[str, Any], early: str = "") -> str:
    """'18 measured, 5 stopped early; 7 run without a figure: 5 out of memory, 2 failed', from a
    search's cost (autotune.search.trials.search_cost; config.json's ``search``). A config.json
    from before 2026-12-03 counted every trial run as measured and has no out-of-memory count.
    ``early`` follows "stopped early" (the report says why)."""
    text = f"{cost.get('num_measured', 0)} measured"
    if cost.get("num_stopped_early"):
        text += f", {cost['num_stopped_early']} stopped early{early}"
    oom, failed = cost.get("num_out_of_memory") or 0, cost.get("num_failed") or 0
    if oom or failed:
        parts = ([f"{oom} out of memory"] if oom else []) + ([f"{failed} failed"] if failed else [])
        text += f"; {oom + failed} run without a figure: {', '.join(parts)}"
    return text
