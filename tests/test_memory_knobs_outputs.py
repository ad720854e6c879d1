"""Where the best configuration has memory knobs on (8-bit optimizer states, a fused loss, recomputed
activations, expandable segments: autotune.search.levers), config.json, the terminal and the report
say what it gives over the best of the same search without them (issue 36).

The study is the committed H200 search of the 1B Llama shape under 24 GiB
(reports/search-yield/h200-3445a3e/llama-24gib-5m): its best, #13, has 8-bit states, a fused linear
cross-entropy and every block checkpointed (50.9 samples/s); the best without any memory knob is the
plain recipe, #1 (33.5 samples/s)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch
from rich.console import Console

from autotune.cli import terminal
from autotune.report.format import memory_knobs_line
from autotune.search.trials import best_trial, best_without_memory_knobs
from conftest import ROOT

SOURCE = ROOT / "reports" / "search-yield" / "h200-3445a3e" / "llama-24gib-5m"


def _study() -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=None, storage=f"sqlite:///{SOURCE / 'study.db'}")


def _export(study: optuna.Study, out: Path) -> dict:
    from autotune.space import SearchSpace
    from autotune.report.export import export
    from autotune.trial.measure import MeasureSettings
    from autotune.workload.models import WorkloadSpec

    attrs = study.user_attrs
    config = SimpleNamespace(storage=None, command="autotune search --model hf:llama", input_on_device=False,
                             data=None, workload=WorkloadSpec.from_dict(attrs["workload"]),
                             measure_settings=MeasureSettings.for_device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
        files = export(study, out, config=config, space=SearchSpace.from_dict(attrs["space"]),
                       probe={"provenance": attrs["provenance"]}, device="cuda")
    return json.loads(files["config.json"].read_text())


def test_the_best_without_memory_knobs_is_the_fastest_trial_with_none_on():
    study = _study()
    assert best_trial(study).number == 13
    assert best_without_memory_knobs(study).number == 1


def test_config_json_the_terminal_and_the_report_give_the_memory_knobs_speed_up(tmp_path, monkeypatch):
    study = _study()
    data = _export(study, tmp_path)
    assert data["memory_knobs"] == ["8-bit optimizer states (bitsandbytes)", "fused linear CE", "checkpointing every block"]
    assert data["without_memory_knobs"]["trial_number"] == 1
    ratio = study.trials[13].value / study.trials[1].value
    assert data["speedup_vs_without_memory_knobs"] == pytest.approx(ratio)
    line = memory_knobs_line(data)
    assert line.startswith("memory knobs (8-bit optimizer states (bitsandbytes), fused linear CE, checkpointing")
    assert f"{ratio:.2f}x the best without them" in line and "34,259 tokens/s" in line
    buffer = io.StringIO()
    monkeypatch.setattr(terminal, "console", Console(file=buffer, width=400, color_system=None))
    assert terminal.print_summary(tmp_path)
    assert line in " ".join(buffer.getvalue().split())
    from autotune.report.render import write_report

    report = write_report(study, tmp_path, data)["report.md"].read_text()
    assert f"{ratio:.2f}x the best without them" in report
    # a best without memory knobs says nothing of them
    assert memory_knobs_line({**data, "memory_knobs": None}) is None


def test_the_report_shows_each_memory_knob_paired_where_verify_measured_them(tmp_path):
    """`autotune verify --memory-knobs` writes its pairs beside config.json (autotune.search.verify); the
    report's summary then gives them, and says nothing of pairs where none were measured."""
    from autotune.search.verify import MEMORY_KNOB_PAIRS
    from autotune.report.render import write_report

    study = _study()
    data = _export(study, tmp_path)
    assert "Each memory knob, paired" not in write_report(study, tmp_path, data)["report.md"].read_text()
    lines = ["checkpointing: 0.862x the speed of the same configuration without it; peak 18.00 GiB against 31.00 GiB "
             "without it (over the search's --memory-limit of 24.0 GiB)"]
    (tmp_path / MEMORY_KNOB_PAIRS).write_text(json.dumps({"lines": lines, "repeat": 3}))
    report = write_report(study, tmp_path, data)
    md, html = report["report.md"].read_text(), report["report.html"].read_text()
    assert "Each memory knob, paired" in md and lines[0] in md and "median of 3 re-measurements each" in md
    assert "0.862x the speed of the same configuration without it" in html
