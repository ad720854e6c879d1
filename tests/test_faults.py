"""The fault-injection script (scripts/faults.py) on the faults the other tests do not cover."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_hung_and_raising_trials_are_survived_and_nothing_is_lost():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "faults.py"), "--only", "hang,raise,nan",
                           "--device", "cpu", "--jobs", "3"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "faults survived: 3/3, trials lost: 0"


@pytest.mark.slow
def test_unknown_fault_names_are_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "faults.py"), "--only", "meteor"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown faults ['meteor']" in proc.stderr
