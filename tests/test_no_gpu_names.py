"""No module of the engine or the knobs names a GPU but the priors table: a run's GPU, commit and figures
live in reports/ (reports/measurement-log.md and the report folders), and a measured number lives in
autotune/priors.py beside its source."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_NAMED = re.compile(r"H100|H200")
"""The GPUs the reports were measured on, as `grep -rn "H100\\|H200" autotune strategies` finds them (a report
folder's lower-case name, reports/resnet50-h200, is a path, not a GPU named)."""
TABLE = ROOT / "autotune" / "priors.py"


def test_no_module_but_the_priors_table_names_a_gpu() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in ("autotune", "strategies") for path in sorted((ROOT / folder).rglob("*.py"))
             if path != TABLE
             for n, line in enumerate(path.read_text().splitlines(), 1) if GPU_NAMED.search(line)]
    assert not found, "\n".join(found)
