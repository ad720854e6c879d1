"""The priors table (autotune.priors): every row says where it was measured, the code reads its
beliefs from it, and no identifier in the engine or the knobs is named after a benchmark model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autotune import priors
from autotune.search import levers, neighbours

ROOT = Path(__file__).resolve().parents[1]


def test_every_row_names_a_report_that_exists() -> None:
    for row in priors.PRIORS:
        path = row.source.split("#")[0]
        assert path.startswith("reports/"), row
        assert (ROOT / path).exists(), f"{row.knob}={row.value!r} ({row.what}): {row.source} does not exist"
        assert row.means, row


def test_a_section_of_the_measurement_log_a_row_names_is_in_it() -> None:
    log = (ROOT / priors.LOG).read_text()
    anchors = {_anchor(line.lstrip("#").strip()) for line in log.splitlines() if line.startswith("#")}
    for row in priors.PRIORS:
        if "#" in row.source:
            assert row.source.split("#")[1] in anchors, row


def _anchor(heading: str) -> str:
    """A Markdown heading's anchor, as GitHub writes it."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_rows_are_looked_up_by_knob_value_and_quantity() -> None:
    assert priors.prior("compile.mode", "default", "speed over eager") == 1.3
    assert priors.prior("stem_conv.stem", "space_to_depth", "per-sample share", 1.0) == 1.0  # none: the default
    with pytest.raises(KeyError, match="no prior for"):
        priors.prior("compile.mode", "default", "per-sample share")
    assert priors.values("compile.mode", "compile cost") == {
        "max-autotune-no-cudagraphs": 7.0, "max-autotune": 7.0, "regional": 0.4}


def test_the_moves_and_the_memory_knobs_take_their_speed_from_the_table() -> None:
    speeds = priors.table("speed")
    assert {(m.param, m.value): m.gain for m in neighbours.MOVES}.items() <= speeds.items()
    assert {(lever.param, lever.value): lever.speed for lever in levers.LEVERS}.items() <= speeds.items()
    assert neighbours.PRIORS == speeds
    # every speed row is a move's, a memory knob's or liger's kernels'
    offered = {(m.param, m.value) for m in neighbours.MOVES} | {(lever.param, lever.value) for lever in levers.LEVERS}
    assert set(speeds) - offered == {("llm_kernels.kernels", "liger")}


def test_the_stem_prior_is_scaled_by_the_share_it_was_measured_at() -> None:
    measured = priors.prior("stem_conv.stem", "space_to_depth", "measured stem share")
    gain = priors.prior("stem_conv.stem", "space_to_depth", "speed")
    assert neighbours.stem_speed({"stem_share": measured}) == pytest.approx(gain)
    assert neighbours.stem_speed({"stem_share": measured / 2}) == pytest.approx(1 + (gain - 1) / 2)


MODEL_NAMED = re.compile(r"\b[A-Z0-9_]*(RESNET|LLAMA|CONVNEXT|GPT2_|VIT_)[A-Z0-9_]*\b")


def test_no_identifier_is_named_after_a_benchmark_model() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in ("autotune", "strategies") for path in sorted((ROOT / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if MODEL_NAMED.search(line)]
    assert not found, "\n".join(found)
