"""The end of a search as a user reads it in the terminal: the last line names every file the search
wrote; repeats of a trial are not counted as trials; small rates carry enough digits for the speed-up
beside them to add up; "1 thread", not "1 threads"; a missing optional dependency names its extra.

The studies are committed ones (reports/), exported again in memory where a test needs a change."""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from rich.console import Console

from autotune.cli import terminal
from autotune.report.format import fmt_rate, trials_text
from conftest import ROOT, run_cli, subprocess_env


def _said(monkeypatch, out: Path, **kwargs) -> str:
    """What print_summary prints for ``out``, its lines unwrapped."""
    buffer = io.StringIO()
    monkeypatch.setattr(terminal, "console", Console(file=buffer, width=400, color_system=None))
    terminal.print_summary(out, **kwargs)
    return buffer.getvalue()


def _copy(name: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "trials.csv", "report.html", "report.md"):
        shutil.copy(ROOT / "reports" / name / f, dest / f)
    return dest


def test_the_last_line_names_every_file_the_search_wrote(tmp_path, monkeypatch):
    out = _copy("resnet50-cpu", tmp_path / "out")
    files = {name: out / name for name in ("config.json", "trials.csv", "report.html", "report.md")}
    last = _said(monkeypatch, out, files=files).strip().splitlines()[-1]
    assert last == (f"wrote {out / 'config.json'}, {out / 'trials.csv'}, {out / 'report.html'} and "
                    f"{out / 'report.md'}")


def test_repeats_of_a_trial_are_not_counted_as_trials(tmp_path, monkeypatch):
    """gpt_lm-h200-5m: 16 trials counted, of which 14 ran and 2 copied an earlier trial's result."""
    out = _copy("gpt_lm-h200-5m", tmp_path / "out")
    cost = json.loads((out / "config.json").read_text())["search"]
    assert cost["num_trials"] == 16 and cost["num_measured"] == 14  # the study as committed
    said = " ".join(_said(monkeypatch, out).split())
    assert "search cost over 14 trials (14 measured, 3 stopped early; 2 repeats of an earlier trial, its result " \
           "reused)" in said
    assert "over 16 trials" not in said


def test_small_rates_have_the_digits_their_speedup_needs(tmp_path, monkeypatch):
    """resnet50-cpu: 3.48 and 3.90 samples/s, 1.12x; written "3" and "4" the two did not give 1.12x."""
    out = _copy("resnet50-cpu", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    said = _said(monkeypatch, out)
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
            for line in said.splitlines() if line.startswith("│")}
    best, base = float(rows["best"][2]), float(rows["baseline"][2])
    assert (rows["best"][2], rows["baseline"][2]) == ("3.90", "3.48")
    # the speed-up printed beside them follows from the rates as printed, to its own two decimals
    printed = float(re.search(r"speed-up over the FP32 baseline: ([\d.]+)x", said).group(1))
    assert printed == pytest.approx(config["speedup_vs_baseline"], abs=0.005)
    assert best / base == pytest.approx(printed, abs=0.01)


@pytest.mark.parametrize("rate, text", [(3.9012, "3.90"), (11.23, "11.2"), (47.506, "47.5"), (0.5, "0.500"),
                                        (99.96, "100"), (6367.2, "6,367"), (None, "")])
def test_rates_under_100_keep_three_significant_digits(rate, text):
    assert fmt_rate(rate) == text


def test_one_thread_is_singular(tmp_path, monkeypatch):
    out = _copy("resnet50-cpu", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    for entry in (config, config["baseline"]):
        entry["summary"] = entry["summary"].replace("2 threads", "1 threads")
        entry["knobs"]["threads"]["num_threads"] = 1
    (out / "config.json").write_text(json.dumps(config))
    said = _said(monkeypatch, out)
    assert "1 thread" in said and "1 threads" not in said


def test_the_live_line_does_not_count_a_repeat_as_a_trial(monkeypatch):
    """The line under a search's trials: "14 trials (+2 repeats), best ...", not "16 trials"."""
    import optuna
    from types import SimpleNamespace

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=None,
                              storage=f"sqlite:///{ROOT / 'reports' / 'gpt_lm-h200-5m' / 'study.db'}")
    buffer = io.StringIO()
    monkeypatch.setattr(terminal, "console", Console(file=buffer, width=400, color_system=None))
    view = terminal.SearchView(SimpleNamespace(trials=None, budget_s=300.0, started_at=None,
                                               workload=SimpleNamespace(model="hf:gpt2")))
    view.study, view.out_dir = study, Path("out")
    view.task = view.progress.add_task("starting", total=300.0, status="")
    view._trial(study.trials[-2])
    assert view.summary.startswith("14 trials (+2 repeats), best "), view.summary


def test_trials_text_of_a_config_json_from_before_the_counts():
    # no out-of-memory or failed counts recorded: nothing to tell repeats apart by, so none are claimed
    assert trials_text({"num_trials": 5, "num_measured": 4}) == "5 trials (4 measured)"


@pytest.mark.slow
def test_a_missing_optional_dependency_names_its_extra(tmp_path):
    """rich read "[hf]" in "pip install 'autotune[hf]'" as markup and printed "pip install 'autotune'"."""
    for module, model, extra in (("transformers", "hf:gpt2", "hf"), ("timm", "timm:resnet18", "timm")):
        blocked = tmp_path / module
        (blocked / module).mkdir(parents=True)
        (blocked / module / "__init__.py").write_text(f"raise ImportError('no {module} here')\n")
        import subprocess

        env = subprocess_env()
        env["PYTHONPATH"] = f"{blocked}:{env['PYTHONPATH']}"
        proc = subprocess.run([sys.executable, "-m", "autotune", "search", "--model", model, "--device", "cpu",
                               "--trials", "1", "--out", str(tmp_path / "out")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        said = " ".join(proc.stderr.split())
        assert proc.returncode == 2, said
        assert f"pip install 'autotune[{extra}]'" in said, said
