"""The example reports committed under reports/ load through autotune.load as user code would."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch

import autotune
from conftest import ROOT

REPORTS = sorted((ROOT / "reports").glob("*/config.json"))


def test_there_is_a_gpu_report():
    assert any(json.loads(p.read_text())["device"] == "cuda" for p in REPORTS)


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.parent.name)
def test_report_replays_and_is_consistent(path: Path, monkeypatch):
    data = json.loads(path.read_text())
    if data["device"] == "cuda" and not torch.cuda.is_available():
        # replay only; nothing runs on the (absent) GPU
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: data["provenance"]["gpu"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = autotune.load(path)
    said = " ".join(str(w.message) for w in caught)
    if data["provenance"]["torch"] != torch.__version__:  # measured elsewhere: the user is told
        assert f"torch {data['provenance']['torch']} (here {torch.__version__})" in said
    assert cfg.batch_size == data["knobs"]["batch_size"]["batch_size"]
    trials = pd.read_csv(path.parent / "trials.csv")
    # never the best: a trial whose loss was not finite (files older than the column have none), or
    # one whose numerics failed the accuracy check
    finite = trials[trials["loss_finite"] != False] if "loss_finite" in trials else trials  # noqa: E712
    if "accuracy_verdict" in finite:
        finite = finite[~finite["accuracy_verdict"].isin(["violated", "unstable"])]
    best = finite.loc[finite["samples_per_s"].idxmax()]
    assert data["figures"]["samples_per_s"] == pytest.approx(best["samples_per_s"])
    # the measured one: a baseline that did not fit backed off to a batch that does, as a baseline too
    baseline = trials[(trials["role"] == "baseline") & (trials["state"] == "COMPLETE")].iloc[0]
    assert baseline["config"].startswith("fp32, contiguous")
    assert data["speedup_vs_baseline"] == pytest.approx(best["samples_per_s"] / baseline["samples_per_s"])
    for key in ("torch", "gpu", "driver", "cuda", "cudnn") if data["device"] == "cuda" else ("torch",):
        assert data["provenance"].get(key), key


def test_a_gpu_study_from_before_the_newest_knobs_exports_again(tmp_path, monkeypatch):
    """A study resumed by a newer autotune: its trials recorded no dataloader knob (it did not exist),
    and replaying the best one with the knob at its default is the same configuration."""
    import shutil
    from types import SimpleNamespace

    import optuna

    from autotune.report.export import export
    from autotune.trial.measure import MeasureSettings
    from autotune.space import SearchSpace
    from autotune.workload.models import WorkloadSpec

    shutil.copy(ROOT / "reports" / "resnet50-h200-4m" / "study.db", tmp_path / "study.db")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert all("dataloader" not in t.user_attrs["knobs"] for t in study.trials if "knobs" in t.user_attrs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    attrs = study.user_attrs
    config = SimpleNamespace(storage=None, command="autotune search --model resnet50", input_on_device=False, data=None,
                             workload=WorkloadSpec.from_dict(attrs["workload"]),
                             measure_settings=MeasureSettings.for_device)
    files = export(study, tmp_path, config=config, space=SearchSpace.from_dict(attrs["space"]),
                   probe={"provenance": attrs["provenance"]}, device="cuda")
    cfg = autotune.load(files["config.json"])
    assert cfg.knobs["dataloader"] == type(cfg.knobs["dataloader"])()  # the untuned loader, as it ran
    assert json.loads(files["config.json"].read_text())["knobs"]["compile"] == {"mode": "default"}


CHECKED = [p for p in REPORTS if (p.parent / "study.db").exists()
           and (json.loads(p.read_text()).get("accuracy") or {}).get("verdict") in ("passed", "violated", "unstable")]


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: p.parent.name)
def test_the_reports_accuracy_line_gives_the_verdict_config_json_gives(path: Path):
    """A language model's check judges the training loss alone (no held-out accuracy): its summary
    said "measured on some trials, not on the best one" beside a config.json that says passed."""
    import optuna

    from autotune.report.data import collect
    from autotune.report.summary import summary_items

    config = json.loads(path.read_text())
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{path.parent / 'study.db'}")
    line = next(i["text"] for i in summary_items(collect(study, path.parent, config)) if i["label"] == "Accuracy")
    accuracy = config["accuracy"]
    if accuracy.get("accuracy_drop") is not None:
        assert line.startswith("accuracy drop "), line
    elif accuracy.get("method") == "parity":  # its reason names the configuration and the verdict
        assert line.startswith(accuracy["reason"]) and f": {accuracy['verdict']}: " in line, line
    else:
        assert line.startswith(f"{accuracy['verdict']}: {accuracy['reason']}"), line


LANGUAGE = [p for p in CHECKED if (json.loads(p.read_text()).get("units") or {}).get("tokens_per_sample")]


@pytest.mark.parametrize("path", LANGUAGE, ids=lambda p: p.parent.name)
def test_a_language_models_report_shows_the_loss_drift_and_plots_speed_against_it(path: Path):
    """Its checks have no held-out accuracy: the tables' "accuracy drop" column was empty and the
    speed-versus-accuracy plot missing; the training loss drift against FP32 is what they give."""
    import optuna

    from autotune.report.data import collect
    from autotune.report.plots import plot_speed_accuracy
    from autotune.report.render import render_markdown

    study = optuna.load_study(study_name=None, storage=f"sqlite:///{path.parent / 'study.db'}")
    data = collect(study, path.parent, json.loads(path.read_text()))
    assert data.accuracy_measure == ("loss_drift", "loss drift")
    md = render_markdown(data)
    best = md.split("## Best vs baseline")[1].split("\n## ")[0]
    assert "| loss drift |" in best and "accuracy drop" not in best
    drift = data.best["loss_drift"]
    assert f"| {drift:.3g} |" in best.splitlines()[4]  # the best's row gives its drift
    plot = plot_speed_accuracy(data)
    assert plot is not None and "loss drift" in plot.svg
