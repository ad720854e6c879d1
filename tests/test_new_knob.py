"""A new knob is one module in strategies/ plus one registry line: with nothing else changed, the
search samples it, config.json records it, autotune.load replays it and the report shows it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import optuna
import pytest

from conftest import ROOT, subprocess_env

KNOB = textwrap.dedent('''
    """throwaway: a knob written for a test, to show what a new knob takes."""

    from __future__ import annotations

    from dataclasses import dataclass
    from typing import Any, Mapping

    from autotune.recipe import Recipe
    from autotune.space import SearchSpace
    from strategies.base import Strategy


    def _mark(model):
        model.throwaway_marked = True
        return model


    class Throwaway(Strategy):
        name = "throwaway"
        label = "throwaway knob"

        @dataclass(kw_only=True, frozen=True)
        class Config:
            marked: bool = False

        def offer(self, options, device, probe, offered) -> dict[str, Any]:
            return {"choices": {self.name: [False, True]}}

        def words(self, values: Mapping[str, Any]) -> str:
            return "marked" if values.get("marked") else ""

        def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
            return self.Config(marked=self.choose(trial, "marked", space.choices[self.name]))

        def apply(self, config: Config, recipe: Recipe) -> None:
            if config.marked:
                recipe.model_transforms.append(_mark)
                recipe.notes.append("the throwaway knob marked the model")
''')

LOAD = textwrap.dedent('''
    import sys, torch, autotune, fake_models
    cfg = autotune.load(sys.argv[1])
    model, _ = cfg.prepare(fake_models.tiny_cnn(10), torch.optim.SGD(fake_models.tiny_cnn(10).parameters(), lr=0.1))
    print(cfg.knobs["throwaway"].marked, getattr(model, "throwaway_marked", False), cfg.notes)
''')


@pytest.mark.slow
def test_a_knob_in_one_module_and_one_registry_line_is_searched_exported_loaded_and_reported(tmp_path):
    code = tmp_path / "code"
    shutil.copytree(ROOT / "strategies", code / "strategies", ignore=shutil.ignore_patterns("__pycache__"))
    (code / "strategies" / "throwaway.py").write_text(KNOB)
    registry = code / "strategies" / "__init__.py"
    text = registry.read_text()
    # the one registry line, last in REGISTRY (whichever knob is last today)
    head, sep, tail = text.partition("REGISTRY: list[Strategy] = [")
    end = tail.index("\n]")
    assert sep and end > 0
    registry.write_text(head + sep + tail[:end] + "\n    __import__('strategies.throwaway').throwaway.Throwaway()," + tail[end:])
    env = subprocess_env()
    env["PYTHONPATH"] = f"{code}{__import__('os').pathsep}{env['PYTHONPATH']}"  # this copy of strategies/ first
    out = tmp_path / "out"
    search = subprocess.run([sys.executable, "-m", "autotune", "search", "--model", "fake_models:tiny_cnn", "--device",
                             "cpu", "--input-shape", "3x32x32", "--num-classes", "10", "--min-measure-time", "0.2",
                             "--precisions", "fp32", "--trials", "6", "--no-accuracy-check", "--out", str(out)],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert search.returncode == 0, search.stderr[-3000:]

    # searched: both values measured, under the knob's own parameter name
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    values = {t.params.get("throwaway.marked") for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert values == {False, True}
    # exported: config.json records the knob, its parameter and its choices in the space
    exported = json.loads((out / "config.json").read_text())
    assert "throwaway" in exported["knobs"] and exported["space"]["choices"] == {"throwaway": [False, True]}
    # loaded: autotune.load replays it and applies it to the user's model
    marked = exported["knobs"]["throwaway"]["marked"]
    loaded = subprocess.run([sys.executable, "-c", LOAD, str(out / "config.json")], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split()[:2] == [str(marked), str(marked)]
    # reported: the knob's effect section and the words of the marked configurations
    report = (out / "report.md").read_text()
    assert "throwaway knob" in report
    rows = [t for t in study.trials if t.params.get("throwaway.marked")]
    assert any("marked" in line for line in (out / "trials.csv").read_text().splitlines()[1:]) == bool(rows)
