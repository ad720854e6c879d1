"""Numbers and knob values in words, as the report (report.md/.html) and the comparison
(compare.md/.html) print them: one place for every formatter the pages share."""

from __future__ import annotations

import math
import re
from pathlib import Path
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
    """A rate (samples/s, tokens/s): whole numbers from 100 up, three significant digits below, so
    that a speed-up beside two small rates adds up ("3.94 ... 13.4 ... 3.40x", not "4 ... 13 ...")."""
    f = as_float(v)
    if f is None:
        return ""
    if abs(f) >= 100 or f == 0 or math.isinf(f):
        return f"{f:,.0f}"
    decimals = max(0, 2 - math.floor(math.log10(abs(f))))
    text = f"{f:.{decimals}f}"
    return f"{f:,.0f}" if abs(float(text)) >= 100 else text  # 99.96 rounds up to 100


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


def plural_fix(text: str) -> str:
    """A configuration's words with a count of one in the singular: "1 thread", "1 stream", also in
    the config.json files written before the strategies said so themselves ("1 threads")."""
    return re.sub(r"\b1 (thread|stream|process|GPU|worker)s\b", r"1 \1", text)


def describe(knobs: Any) -> str:
    """strategies.describe in the words the pages print (plural_fix)."""
    import strategies

    return plural_fix(strategies.describe(knobs))


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


def repeats_of(cost: dict[str, Any]) -> int:
    """How many of a search's counted trials (config.json's ``search``) were repeats: a configuration
    already measured, whose result was copied (``duplicate_of``), not run again. A config.json from
    before the out-of-memory and failed counts existed cannot tell: 0."""
    if "num_failed" not in cost:
        return 0
    ran = (cost.get("num_measured") or 0) + (cost.get("num_out_of_memory") or 0) + (cost.get("num_failed") or 0)
    return max(0, (cost.get("num_trials") or 0) - ran)


def trials_text(cost: dict[str, Any], early: str = "") -> str:
    """'34 trials (30 measured; 4 run without a figure: 4 out of memory; 7 repeats of an earlier
    trial, its result reused)': the trials run, repeats named apart and not counted as trials."""
    repeats = repeats_of(cost)
    n = (cost.get("num_trials") or 0) - repeats
    text = f"{n} trial{'' if n == 1 else 's'} ({trial_counts(cost, early)}"
    if repeats:
        text += f"; {repeats} repeat{'' if repeats == 1 else 's'} of an earlier trial, its result reused"
    return text + ")"


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


def memory_knob_pairs_text(folder: Path) -> str | None:
    """Each memory knob of the recommendation against the same configuration without it, as
    ``autotune verify --memory-knobs`` measured them (MEMORY_KNOB_PAIRS in ``folder``); None without."""
    import json

    from autotune.search.verify import MEMORY_KNOB_PAIRS

    path = Path(folder) / MEMORY_KNOB_PAIRS
    if not path.exists():
        return None
    pairs = json.loads(path.read_text())
    if not pairs.get("lines"):
        return None
    repeat = pairs.get("repeat") or 1
    return ("; ".join(pairs["lines"]) + f" (autotune verify --memory-knobs: median of {repeat} "
            f"re-measurement{'s' if repeat != 1 else ''} each, alternating)")


def memory_knobs_line(data: dict[str, Any]) -> str | None:
    """Where the best has memory knobs on, what it gives over the best of the same search without them,
    from config.json: "memory knobs (8-bit optimizer states, checkpointing every block): 1.52x the best
    without them (bf16, ...: 33.5 samples/s)"; None where the best has none."""
    knobs = data.get("memory_knobs")
    if not knobs:
        return None
    head = f"memory knobs ({', '.join(knobs)})"
    other = data.get("without_memory_knobs")
    if not other:
        return f"{head}: no configuration without them completed"
    rate = f"{fmt_rate(other['figures']['samples_per_s'])} samples/s"
    if other["figures"].get("tokens_per_s"):
        rate += f", {fmt_rate(other['figures']['tokens_per_s'])} tokens/s"
    return (f"{head}: {data['speedup_vs_without_memory_knobs']:.2f}x the best without them "
            f"({plural_fix(other['summary'])}: {rate})")


def warm_source(warm_from: dict | None) -> str | None:
    """Where a trial an earlier search measured comes from (autotune.search.warm): "runs/x #3"."""
    return None if not warm_from else f"{warm_from.get('out_dir')} #{warm_from.get('number')}"


def warm_words(used: list[dict] | None) -> str | None:
    """The earlier searches a search started with (the study's ``warm_start`` attribute), in words."""
    if not used:
        return None
    n = sum(run["trials"] for run in used)
    runs = ", ".join(f"{run['out_dir']} ({run['finished'][:16].replace('T', ' ')}, {run['trials']})" for run in used)
    searches = "an earlier search" if len(used) == 1 else f"{len(used)} earlier searches"
    return (f"warm start: {n} trial{'s' if n != 1 else ''} measured by {searches} of this workload on this kind of "
            f"machine ({runs}) are evidence; configurations they measured are not run again (--fresh: without them)")


def fmt_bytes(n: float) -> str:
    """A size on disk in the unit that reads best: "512 KiB", "37.2 MiB", "20 GiB"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
