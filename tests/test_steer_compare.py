"""scripts/steer_compare.py's yardstick: trials until the first usable one within 2% of one shared
reference, "not reached" otherwise, and the medians per arm with not-reached counted as worst."""

from __future__ import annotations

import importlib.util
import math

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("steer_compare", ROOT / "scripts" / "steer_compare.py")
steer_compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(steer_compare)


def test_counts_trials_to_within_the_tolerance_of_the_reference():
    count = steer_compare.trials_to_reach
    values = [100.0, None, 950.0, 985.0, 1000.0]
    assert count(values, 1000.0) == 4               # 985 >= 0.98 x 1000; None (a failed trial) still counts
    assert count(values, 1000.0, tolerance=0.05) == 3
    assert count(values, 1000.0, tolerance=0.0) == 5
    assert count(values[:3], 1000.0) is None        # never got there
    assert count([], 1000.0) is None
    # minimized objectives (joules per sample, memory): within 2% above the reference
    assert count([3.0, 2.03, 2.0], 2.0, maximize=False) == 2
    assert count([3.0, 2.05], 2.0, maximize=False) is None
    with pytest.raises(ValueError):
        count(values, 0.0)
    with pytest.raises(ValueError):
        count(values, 1000.0, tolerance=1.5)


def test_one_reference_for_every_run_of_both_arms():
    runs = [{"arm": "steered", "values": [500.0, 1000.0]}, {"arm": "plain", "values": [500.0, 600.0, 990.0]},
            {"arm": "steered", "values": [None, 985.0]}, {"arm": "plain", "values": [600.0]}]
    summary = steer_compare.summarize(runs, maximize=True, tolerance=0.02)
    assert summary["reference"] == 1000.0
    # the plain run whose own best is 600 does not "reach" its own best: it is not reached
    assert [r["trials_to_reach"] for r in runs] == [2, 3, 2, None]
    assert summary["medians"] == {"steered": 2, "plain": math.inf}


def test_the_median_counts_not_reached_as_worst():
    assert steer_compare.arm_median([2, 3, None]) == 3
    assert steer_compare.arm_median([2, None, None]) == math.inf


def test_finished_runs_are_reused_and_summarized_with_one_reference(tmp_path, capsys):
    """The H200 comparison in reports/steer-compare (4 seeds per arm, run on two GPUs over two device
    calls) is summarized again from its runs' studies, without running anything."""
    import json
    import shutil

    out = tmp_path / "steer-compare"
    shutil.copytree(ROOT / "reports" / "steer-compare", out)
    (out / "steer-compare.json").unlink()
    assert steer_compare.main(["--seeds", "4", "--trials", "6", "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("reused the finished run") == 8
    report = json.loads((out / "steer-compare.json").read_text())
    committed = json.loads((ROOT / "reports" / "steer-compare" / "steer-compare.json").read_text())
    counts = {(r["arm"], r["seed"]): r["trials_to_reach"] for r in report["runs"]}
    assert counts == {(r["arm"], r["seed"]): r["trials_to_reach"] for r in committed["runs"]}
    assert report["reference"] == max(v for r in report["runs"] for v in r["values"] if v is not None)
    assert report["medians"] == committed["medians"]

    # a run that did not finish, or ran another number of trials, is refused rather than counted
    with pytest.raises(SystemExit, match="not --trials 8"):
        steer_compare.main(["--seeds", "1", "--trials", "8", "--out", str(out)])
    (out / "plain-seed0" / "config.json").unlink()
    with pytest.raises(SystemExit, match="did not finish"):
        steer_compare.main(["--seeds", "1", "--trials", "6", "--out", str(out)])
