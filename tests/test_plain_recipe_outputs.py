"""Every place a user reads a search's result shows the best's speed-up over the plain recipe
(autotune.search.plain_recipe) beside the one over FP32: config.json, the terminal summary, report.md
and report.html, and `autotune compare`; and says so plainly when nothing beat the recipe.

The studies are the committed H200 ResNet-50 search (reports/resnet50-h200-8m, its trials as the
search recorded them), copied in memory with one trial given the plain recipe's role: #15 (bf16,
channels_last, batch 512, fused optimizer: 4,923 samples/s), which the best (#5, 7,275 samples/s)
beat; or #5 itself, which nothing beat."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch
from optuna.trial import TrialState
from rich.console import Console

import strategies
from autotune.cli import terminal
from autotune.report.compare import compare
from autotune.report.render import write_report
from conftest import ROOT

SOURCE = ROOT / "reports" / "resnet50-h200-8m"
BEST, RECIPE, BASELINE = 5, 15, 0
"""The source study's best trial, the trial these tests give the plain recipe's role, and the FP32 baseline."""


def _study(plain: int | None, extra: list[optuna.trial.FrozenTrial] = ()) -> optuna.Study:
    """The source study in memory, trial ``plain`` given the role "plain-recipe" (None: no trial has
    it, as in a search from before the recipe), and ``extra`` trials added after its own."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    source = optuna.load_study(study_name=None, storage=f"sqlite:///{SOURCE / 'study.db'}")
    study = optuna.create_study(direction="maximize", study_name=source.study_name)
    for key, value in source.user_attrs.items():
        study.set_user_attr(key, value)
    for t in source.get_trials():
        attrs = {**t.user_attrs, **({"role": "plain-recipe"} if t.number == plain else {})}
        study.add_trial(optuna.trial.create_trial(
            state=t.state, value=t.value if t.state == TrialState.COMPLETE else None, params=t.params,
            distributions=t.distributions, user_attrs=attrs, system_attrs=t.system_attrs))
    for t in extra:
        study.add_trial(t)
    return study


def _export(study: optuna.Study, out: Path) -> dict:
    """Export ``study`` into ``out`` as the search does (on this GPU-less machine, replay only) and
    return its config.json."""
    from autotune.space import SearchSpace
    from autotune.report.export import export
    from autotune.trial.measure import MeasureSettings
    from autotune.workload.models import WorkloadSpec

    attrs = study.user_attrs
    config = SimpleNamespace(storage=None, command="autotune search --model resnet50", input_on_device=False,
                             data=None, workload=WorkloadSpec.from_dict(attrs["workload"]),
                             measure_settings=MeasureSettings.for_device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
        files = export(study, out, config=config, space=SearchSpace.from_dict(attrs["space"]),
                       probe={"provenance": attrs["provenance"]}, device="cuda")
    return json.loads(files["config.json"].read_text())


def _summary(out: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """What the terminal says at the end of the search, its lines unwrapped."""
    buffer = io.StringIO()
    monkeypatch.setattr(terminal, "console", Console(file=buffer, width=300, color_system=None))
    assert terminal.print_summary(out)
    return " ".join(buffer.getvalue().split())


def _failed_recipe(number: int) -> optuna.trial.FrozenTrial:
    """A plain recipe that did not fit (as the search records an out-of-memory trial)."""
    return optuna.trial.create_trial(state=TrialState.PRUNED, user_attrs={
        "role": "plain-recipe", "status": "oom", "reason": "does not fit at batch 2048: CUDA out of memory",
        "knobs": {"precision": {"mode": "bf16"}, "batch_size": {"batch_size": 2048, "base_batch_size": 256}},
        "timing": {"worker_start_s": 1.0, "wall_s": 9.0}})


def _searched(tmp_path_factory, name: str, study: optuna.Study) -> SimpleNamespace:
    out = tmp_path_factory.mktemp(name)
    config = _export(study, out)
    files = write_report(study, out, config)
    return SimpleNamespace(out=out, study=study, config=config, md=files["report.md"].read_text(),
                           html=files["report.html"].read_text())


@pytest.fixture(scope="module")
def beaten(tmp_path_factory) -> SimpleNamespace:
    return _searched(tmp_path_factory, "beaten", _study(RECIPE))


@pytest.fixture(scope="module")
def unbeaten(tmp_path_factory) -> SimpleNamespace:
    return _searched(tmp_path_factory, "unbeaten", _study(BEST))


def _rate(study: optuna.Study, number: int) -> float:
    return study.trials[number].user_attrs["figures"]["samples_per_s"]


# --- config.json ----------------------------------------------------------------------------------

def test_config_json_records_the_plain_recipe_and_the_bests_speedup_over_it(beaten):
    config, study = beaten.config, beaten.study
    recipe = study.trials[RECIPE].user_attrs
    assert config["study"]["trial_number"] == BEST
    plain = config["plain_recipe"]
    assert plain["trial_number"] == RECIPE
    assert plain["summary"] == strategies.describe(recipe["knobs"]) == \
        "bf16, channels_last, batch 512, cudnn.benchmark, 2 streams, fused optimizer"
    assert plain["knobs"] == recipe["knobs"]
    assert plain["figures"]["samples_per_s"] == pytest.approx(recipe["figures"]["samples_per_s"])
    assert config["speedup_vs_plain_recipe"] == pytest.approx(_rate(study, BEST) / _rate(study, RECIPE))
    assert config["speedup_vs_plain_recipe"] == pytest.approx(1.478, abs=1e-3)
    assert config["memory_vs_plain_recipe"] == pytest.approx(
        study.trials[BEST].user_attrs["figures"]["peak_memory_bytes"] / recipe["figures"]["peak_memory_bytes"])
    assert config["best_is_plain_recipe"] is False
    assert "plain_recipe_missing" not in config
    assert config["objective"]["plain_recipe_value"] == pytest.approx(study.trials[RECIPE].value)
    # the two speed-ups are of one best: their quotient is the recipe's own speed-up over FP32
    assert config["speedup_vs_baseline"] / config["speedup_vs_plain_recipe"] == \
        pytest.approx(_rate(study, RECIPE) / _rate(study, BASELINE))


def test_config_json_says_when_the_best_is_the_plain_recipe(unbeaten):
    config = unbeaten.config
    assert config["study"]["trial_number"] == config["plain_recipe"]["trial_number"] == BEST
    assert config["best_is_plain_recipe"] is True
    assert config["speedup_vs_plain_recipe"] == 1.0 and config["memory_vs_plain_recipe"] == 1.0
    assert config["objective"]["plain_recipe_value"] == config["objective"]["value"]


def test_a_search_without_a_plain_recipe_trial_exports_none_and_says_nothing(tmp_path, monkeypatch):
    config = _export(_study(None), tmp_path)
    assert config["plain_recipe"] is None and config["objective"]["plain_recipe_value"] is None
    assert not {"speedup_vs_plain_recipe", "memory_vs_plain_recipe", "best_is_plain_recipe",
                "plain_recipe_missing"} & set(config)
    said = _summary(tmp_path, monkeypatch)
    assert "speed-up over the FP32 baseline" in said and "plain recipe" not in said


def test_a_plain_recipe_that_did_not_complete_is_said_with_its_reason(tmp_path, monkeypatch):
    study = _study(None, [_failed_recipe(35)])
    config = _export(study, tmp_path)
    assert config["plain_recipe"] is None and "speedup_vs_plain_recipe" not in config
    assert config["plain_recipe_missing"] == \
        "did not complete: trial #35, oom: does not fit at batch 2048: CUDA out of memory"
    said = _summary(tmp_path, monkeypatch)
    assert "plain recipe: did not complete: trial #35, oom: does not fit at batch 2048" in said
    md = write_report(study, tmp_path, config)["report.md"].read_text()
    assert "- **Speed-up over the plain recipe:** did not complete: trial #35, oom" in md
    assert "Plain recipe: did not complete: trial #35" in md.split("## Best vs baseline")[1].split("\n## ")[0]


def test_a_plain_recipe_still_queued_when_the_search_ended_is_not_measured(tmp_path, monkeypatch):
    study = _study(None)
    study.enqueue_trial({"precision.mode": "bf16"}, user_attrs={"role": "plain-recipe"})
    queued = study.trials[-1].number
    config = _export(study, tmp_path)
    assert config["plain_recipe_missing"] == \
        f"not measured: trial #{queued} was queued, and the search ended before it ran"
    assert f"plain recipe: not measured: trial #{queued}" in _summary(tmp_path, monkeypatch)


# --- the terminal summary --------------------------------------------------------------------------

def test_the_summary_gives_the_speedup_over_the_plain_recipe_beside_fp32(beaten, monkeypatch):
    config = beaten.config
    said = _summary(beaten.out, monkeypatch)
    rate = f"{_rate(beaten.study, RECIPE):,.0f}"
    assert rate == "4,923"
    expected = (f"best: {config['speedup_vs_plain_recipe']:.2f}x the plain recipe "
                f"({config['plain_recipe']['summary']}: {rate} samples/s), {config['speedup_vs_baseline']:.2f}x FP32")
    assert expected in said
    assert expected.startswith("best: 1.48x the plain recipe (bf16, channels_last, batch 512,")
    assert "nothing measured beat" not in said
    assert f"plain recipe {rate} samples/s, FP32 baseline" in said  # the objective line
    assert f"│ plain recipe │ {config['plain_recipe']['summary']} │ {rate} │" in said  # its row of the table


def test_the_summary_says_plainly_when_nothing_beat_the_plain_recipe(unbeaten, monkeypatch):
    config = unbeaten.config
    said = _summary(unbeaten.out, monkeypatch)
    assert (f"nothing measured beat the plain recipe: it is the recommendation ({config['summary']}: "
            f"{_rate(unbeaten.study, BEST):,.0f} samples/s), {config['speedup_vs_baseline']:.2f}x FP32") in said
    assert "x the plain recipe" not in said


# --- report.md and report.html ----------------------------------------------------------------------

def _part(md: str, heading: str) -> str:
    return md.split(f"## {heading}")[1].split("\n## ")[0]


def test_report_md_has_the_plain_recipe_row_and_the_bests_ratio_over_it(beaten):
    config, study = beaten.config, beaten.study
    best_vs = _part(beaten.md, "Best vs baseline")
    rows = [line for line in best_vs.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[2:]] == ["| best", "| plain recipe", "| baseline", "| best / plain recipe",
                                                     "| best / baseline"]
    assert f"| plain recipe | #{RECIPE} | {config['plain_recipe']['summary']} | 4,923 |" in best_vs
    assert f"| best / plain recipe |  |  | {config['speedup_vs_plain_recipe']:.2f}× |" in best_vs
    assert f"| best / baseline |  |  | {config['speedup_vs_baseline']:.2f}× |" in best_vs
    assert "Nothing measured beat" not in beaten.md
    summary = f"- **Speed-up over the plain recipe:** {config['speedup_vs_plain_recipe']:.2f}× (the plain recipe: "
    assert summary in beaten.md
    top = _part(beaten.md, "Top 10 configurations")
    assert "| peak GiB | vs baseline | vs plain recipe |" in top
    base, recipe = _rate(study, BASELINE), _rate(study, RECIPE)
    best_row = next(line for line in top.splitlines() if line.startswith(f"| 1 | #{BEST} |"))
    assert best_row.endswith(f"| {_rate(study, BEST) / base:.2f}× | {config['speedup_vs_plain_recipe']:.2f}× |")
    recipe_row = next(line for line in top.splitlines() if f"| #{RECIPE} | plain-recipe |" in line)
    assert recipe_row.endswith(f"| {recipe / base:.2f}× | 1.00× |")


def test_report_html_marks_the_plain_recipe_and_gives_each_trials_ratio_over_it(beaten):
    page, config, study = beaten.html, beaten.config, beaten.study
    assert re.search(rf'<tr class="ok plain-recipe" data-number="{RECIPE}"', page)
    assert re.search(rf'<tr class="ok best" data-number="{BEST}"', page)
    headers = re.findall(r'<th data-key="([^"]+)"', page)
    assert headers.index("vs_plain_recipe") == headers.index("vs_baseline") + 1
    row = re.search(rf'<tr class="[^"]*" data-number="{BEST}">(.*?)</tr>', page, flags=re.S).group(1)
    cell = re.search(r'<td data-key="vs_plain_recipe" data-value="([^"]+)"[^>]*>([^<]*)<', row)
    assert float(cell.group(1)) == pytest.approx(config["speedup_vs_plain_recipe"])
    assert cell.group(2) == f"{config['speedup_vs_plain_recipe']:.2f}×"
    kpi = re.search(r'id="speedup-plain-recipe" data-value="([^"]+)">([^<]+)<', page)
    assert float(kpi.group(1)) == pytest.approx(_rate(study, BEST) / _rate(study, RECIPE))
    best_vs = re.search(r'<section id="best-vs-baseline">(.*?)</section>', page, flags=re.S).group(1)
    assert '<tr data-row="plain recipe">' in best_vs and '<tr data-row="best / plain recipe">' in best_vs


def test_the_report_says_the_best_is_the_plain_recipe(unbeaten):
    md, page = unbeaten.md, unbeaten.html
    best_vs = _part(md, "Best vs baseline")
    assert f"| plain recipe (= best) | #{BEST} |" in best_vs
    assert "| best / plain recipe |  |  | 1.00× |" in best_vs
    assert "Nothing measured beat the plain recipe: it is the recommendation." in best_vs
    said = "- **Speed-up over the plain recipe:** nothing measured beat the plain recipe: it is the recommendation"
    assert said in md
    assert re.search(rf'<tr class="ok best plain-recipe" data-number="{BEST}"', page)
    assert 'id="plain-recipe-note">Nothing measured beat the plain recipe' in page


def test_the_plots_mark_the_plain_recipe(beaten, monkeypatch):
    """The scatter plots circle and label the best, the plain recipe and the baseline."""
    from matplotlib.axes import Axes

    from autotune.report import plots
    from autotune.report.data import collect

    labels: list[str] = []
    original = Axes.annotate

    def annotate(self, text, *args, **kwargs):
        labels.append(text)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(Axes, "annotate", annotate)
    plots.plot_throughput_memory(collect(beaten.study, beaten.out, beaten.config))
    assert {f"best #{BEST}", f"plain recipe #{RECIPE}", f"baseline #{BASELINE}"} <= set(labels)


# --- autotune compare ----------------------------------------------------------------------------

def _folder(tmp_path: Path, name: str, source: SimpleNamespace, drop: tuple[str, ...] = ()) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(source.out / "trials.csv", folder / "trials.csv")
    config = {k: v for k, v in source.config.items() if k not in drop}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_compare_shows_each_runs_plain_recipe_and_the_speedup_over_it(beaten, unbeaten, tmp_path):
    old = ("plain_recipe", "speedup_vs_plain_recipe", "memory_vs_plain_recipe", "best_is_plain_recipe")
    folders = [_folder(tmp_path, "beaten", beaten), _folder(tmp_path, "unbeaten", unbeaten),
               _folder(tmp_path, "older", beaten, drop=old)]  # a config.json from before the recipe
    c = compare(folders, tmp_path / "cmp")
    assert c.plain_recipe_speedups == [pytest.approx(beaten.config["speedup_vs_plain_recipe"]), 1.0, None]
    rows = next({r.label: r.cells for r in s.rows} for s in c.sections if s.title.startswith("Best configuration"))
    assert rows["plain recipe"] == [f"{beaten.config['plain_recipe']['summary']}: 4,923 samples/s",
                                    f"{unbeaten.config['summary']}: 7,275 samples/s", "-"]
    assert rows["speed-up over own plain recipe"] == ["1.48x", "1.00x (nothing beat it: the recipe is the best)", "-"]
    assert rows["speed-up over own FP32 baseline"] == ["8.07x"] * 3
    md = c.markdown.read_text()
    assert "| speed-up over own plain recipe | 1.48x | 1.00x (nothing beat it: the recipe is the best) | - |" in md
    assert "speed-up over own plain recipe" in c.html.read_text()


def test_compare_shows_why_a_runs_plain_recipe_is_missing(beaten, tmp_path):
    folders = [_folder(tmp_path, "beaten", beaten), _folder(tmp_path, "failed", beaten, drop=(
        "plain_recipe", "speedup_vs_plain_recipe", "memory_vs_plain_recipe", "best_is_plain_recipe"))]
    config = json.loads((folders[1] / "config.json").read_text())
    config.update(plain_recipe=None, plain_recipe_missing="did not complete: trial #35, oom")
    (folders[1] / "config.json").write_text(json.dumps(config))
    rows = next({r.label: r.cells for r in s.rows} for s in compare(folders, tmp_path / "cmp").sections
                if s.title.startswith("Best configuration"))
    assert rows["plain recipe"][1] == "did not complete: trial #35, oom"
    assert rows["speed-up over own plain recipe"] == ["1.48x", "-"]
