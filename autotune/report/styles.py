"""The plots' colours and markers: each precision mode's colour and each memory format's marker, and
for a plot's series a (colour, marker) pair of its own, so that no two configurations read as one."""

from __future__ import annotations

from typing import Any

from autotune.report.format import sort_key

PRECISION_COLORS = {"fp32": "#333333", "tf32": "#1b9e77", "fp16": "#d95f02", "bf16": "#7570b3", "fp8": "#e7298a"}
"""Each precision mode's colour in every plot: ColorBrewer's Dark2, and for fp32 a near-black, far enough
from bf16's purple that the eye never takes one for the other (a slate grey is not)."""
FORMAT_MARKERS = {"contiguous": "o", "channels_last": "s"}
FORMAT_COLORS = {"contiguous": "#8da0cb", "channels_last": "#fc8d62"}
SERIES_COLORS = tuple(PRECISION_COLORS.values()) + ("#66a61e", "#e6ab02", "#a6761d")
"""The colours a plot's series take: the named modes' first, then the rest of Dark2 for other modes."""
SERIES_MARKERS = tuple(FORMAT_MARKERS.values()) + ("^", "D", "v", "P", "h", "p")
"""The markers a plot's series take; "x" is left to the unstable and failed marks."""


def own_styles(values: list[Any], fixed: dict[Any, str], palette: tuple[str, ...]) -> dict[Any, str]:
    """Each value's style: its own in ``fixed``, else the palette's next one that no value here has,
    cycling once every one is taken."""
    free = [style for style in palette if style not in {fixed[v] for v in values if v in fixed}] or list(palette)
    others = [v for v in values if v not in fixed]
    return {v: fixed[v] if v in fixed else free[others.index(v) % len(free)] for v in values}


def series_styles(keys: list[tuple[Any, Any]]) -> dict[tuple[Any, Any], tuple[str, str]]:
    """The (colour, marker) of each (precision, memory format) series of a plot, no two alike, so that no
    two configurations read as one: the colour by precision and the marker by format where those pairs
    are free (PRECISION_COLORS, FORMAT_MARKERS, then the palettes' next), else the next free pair in
    colour-major order. Sorted first, so the trials' order changes nothing; pairs repeat only beyond
    len(SERIES_COLORS) * len(SERIES_MARKERS) series."""
    keys = sorted(dict.fromkeys(keys), key=lambda k: (sort_key(str(k[0])), sort_key(str(k[1]))))
    colors = own_styles(list(dict.fromkeys(k[0] for k in keys)), PRECISION_COLORS, SERIES_COLORS)
    markers = own_styles(list(dict.fromkeys(k[1] for k in keys)), FORMAT_MARKERS, SERIES_MARKERS)
    pairs = [(c, m) for c in SERIES_COLORS for m in SERIES_MARKERS]
    taken: set[tuple[str, str]] = set()
    styles = {}
    for key in keys:
        style = (colors[key[0]], markers[key[1]])
        if style in taken:  # the next pair no series has, from this one on
            start = pairs.index(style)
            style = next(p for i in range(len(pairs)) if (p := pairs[(start + i) % len(pairs)]) not in taken)
        taken.add(style)
        if len(taken) == len(pairs):  # every pair taken: the cycle starts again
            taken = set()
        styles[key] = style
    return styles
