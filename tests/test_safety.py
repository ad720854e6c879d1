"""Security of what autotune imports and loads: a file in the current directory never replaces a
real module (in the CLI or in a trial worker), the user's own module named with --model still
imports from there, and a config file is data (JSON), never code."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import autotune
from autotune.trial.runner import run_worker
from conftest import subprocess_env

SHADOWS = ("torch", "optuna", "rich", "json")


def _plant_shadows(folder) -> None:
    for name in SHADOWS:
        (folder / f"{name}.py").write_text(f"raise SystemExit('the {name}.py in the current directory was imported')\n")


@pytest.mark.slow
def test_the_cli_ignores_modules_planted_in_the_current_directory(tmp_path):
    _plant_shadows(tmp_path)
    env = subprocess_env()
    proc = subprocess.run([sys.executable, "-m", "autotune", "models"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "resnet50" in proc.stdout.split()


@pytest.mark.slow
def test_a_worker_ignores_them_and_still_imports_the_users_own_module(tmp_path, monkeypatch):
    _plant_shadows(tmp_path)
    (tmp_path / "my_nets.py").write_text(textwrap.dedent("""
        from torch import nn

        def small(num_classes=10):
            return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, num_classes))
    """))
    monkeypatch.chdir(tmp_path)
    workload = {"model": "my_nets:small", "input_shape": [3, 8, 8], "num_classes": 10}
    result = run_worker({"mode": "probe", "device": "cpu", "workload": workload}, timeout_s=120)
    assert result["status"] == "ok", result.get("reason") or result.get("log_tail")
    assert result["num_parameters"] == 3 * 8 * 8 * 10 + 10


def test_loading_a_config_never_runs_code(tmp_path, monkeypatch):
    """config.json is parsed as JSON: strings that look like code or pickles stay strings."""
    ran = tmp_path / "ran"
    payload = f"__import__('pathlib').Path({str(ran)!r}).write_text('x')"
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"format": 1, "space": {"device": "cpu"}, "params": {"precision.mode": payload},
                                "knobs": {"precision": {"mode": payload}}, "pickle": "gASVAAAAAAAAAACMBG9zlC4="}))
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("autotune.load unpickled something")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    with pytest.raises(autotune.ConfigError):
        autotune.load(path)
    assert not ran.exists()
