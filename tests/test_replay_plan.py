"""scripts/replay_plan.py: a stored study rebuilt as it stood after its plain recipe, the proposers
run again, the planner's order printed. On a CPU with a scripted study in a SQLite file."""

from __future__ import annotations

import importlib.util
import json
import sys

import optuna
import pytest

from autotune.space import SearchSpace
from autotune.search import plain_recipe
from autotune.search.neighbours import RULE
from conftest import ROOT, measured

IMAGE_SPACE = SearchSpace(device="cuda", precisions=["fp32", "fp16", "bf16"], batch_sizes=[256, 512, 1024],
                          base_batch_size=256, memory_formats=["contiguous", "channels_last"],
                          compile_modes=["off", "default", "regional"], optimizer_implementations=["foreach", "fused"],
                          cuda_graphs=[False], stream_counts=[1, 2])
# ConvNeXt-T's plain recipe on the H100 (5ece370): 4.5% of its step copying images, compiled in 68 s
PROFILE = {"steps": 3, "memcpy_share": 0.0447, "copy_overlap": 0.0, "idle_share": 0.0,
           "gpu_time_per_step_ms": 194.3, "h2d_ms_per_step": 8.4}


@pytest.fixture(scope="module")
def replay_plan():
    spec = importlib.util.spec_from_file_location("replay_plan", ROOT / "scripts" / "replay_plan.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_plan_after_the_plain_recipe_is_rebuilt_from_the_stored_study(tmp_path, replay_plan):
    path = tmp_path / "study.db"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=f"sqlite:///{path}", direction="maximize")
    study.set_user_attr("space", IMAGE_SPACE.to_dict())
    baseline = {**plain_recipe.params(IMAGE_SPACE, 256), "precision.mode": "fp32", "compile.mode": "off"}
    measured(study, IMAGE_SPACE, baseline, 337.0, role="baseline", status="ok", timing={"wall_s": 20.6})
    bar = plain_recipe.params(IMAGE_SPACE, 512)
    measured(study, IMAGE_SPACE, bar, 3953.0, role=plain_recipe.ROLE, status="ok", profile=PROFILE,
             timing={"compile_s": 67.9, "compile_cache": "miss", "wall_s": 116.6})
    # what the search's callbacks queued after it, and ran: not in the replay
    regional = {**bar, "compile.mode": "regional"}
    measured(study, IMAGE_SPACE, regional, 3050.0, role="steered", status="ok", steered_by={"trial": 1, "rule": RULE})
    out = replay_plan.replay(str(path), left_s=150.0)
    assert out["after"] == 1 and out["limit_bytes"] is None
    assert out["rows"][0]["change"] == {"streams.num_streams": 2}  # its compile loaded from the bar's
    assert out["choice"]["number"] == out["rows"][0]["number"]
    assert all(row["number"] >= 2 for row in out["rows"])  # queued afresh, after the bar
    # the regional compile ran after the bar's callbacks: in the replay it is queued again, not measured
    [regional] = [row for row in out["rows"] if row["change"] == {"compile.mode": "regional"}]
    assert regional["rank"] == 5 and regional["predicted"] != 3050.0
    # the stored study is read, never written
    assert len(optuna.load_study(study_name=None, storage=f"sqlite:///{path}").trials) == 3


def test_it_prints_the_order_and_says_what_to_give_when_nothing_finished(tmp_path, replay_plan, capsys):
    path = tmp_path / "study.db"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=f"sqlite:///{path}", direction="maximize")
    study.set_user_attr("space", IMAGE_SPACE.to_dict())
    measured(study, IMAGE_SPACE, plain_recipe.params(IMAGE_SPACE, 512), 3953.0, role=plain_recipe.ROLE, profile=PROFILE)
    assert replay_plan.main([str(path), "--left", "100"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("after #0 (no memory limit), the queue in the planner's order:")
    assert "{'streams.num_streams': 2}" in printed and "with 100 s left it runs #" in printed
    empty = tmp_path / "empty.db"
    other = optuna.create_study(storage=f"sqlite:///{empty}", direction="maximize")
    other.set_user_attr("space", IMAGE_SPACE.to_dict())
    with pytest.raises(SystemExit, match="no plain-recipe trial finished; give --after N"):
        replay_plan.replay(str(empty))


FIRST_8 = ROOT / "tests" / "fixtures" / "replay-first-8.json"
"""The first 8 candidates the planner ran after the plain recipe in three committed searches (a ResNet-50,
a GPT-2 and a 1B Llama under a memory cap), as the planner chose them before the proposers returned to
one queue (autotune.search.queue): a change to the planner or a proposer that changes them says so here."""


@pytest.mark.parametrize("path", sorted(json.loads(FIRST_8.read_text())))
def test_three_committed_searches_plan_their_first_8_candidates_as_before(path, replay_plan):
    rows = replay_plan.replay(str(ROOT / path))["rows"][:8]
    expected = json.loads(FIRST_8.read_text())[path]
    assert [(r["role"], r["change"], r["rank"]) for r in rows] == [(r["role"], r["change"], r["rank"]) for r in expected]
    assert [r["predicted"] for r in rows] == pytest.approx([r["predicted"] for r in expected], rel=1e-9)
    assert [r["cost_s"] for r in rows] == pytest.approx([r["cost_s"] for r in expected], rel=1e-9)


def test_the_choice_names_its_runner_up_and_why_it_lost(tmp_path, replay_plan):
    path = tmp_path / "study.db"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=f"sqlite:///{path}", direction="maximize")
    study.set_user_attr("space", IMAGE_SPACE.to_dict())
    measured(study, IMAGE_SPACE, plain_recipe.params(IMAGE_SPACE, 512), 3953.0, role=plain_recipe.ROLE, profile=PROFILE,
             timing={"compile_s": 67.9, "compile_cache": "miss", "wall_s": 116.6})
    choice = replay_plan.replay(str(path), left_s=150.0)["choice"]
    runner = choice["runner_up"]
    assert runner is not None and runner["number"] != choice["number"] and runner["lost"]
    assert runner["lost"].startswith(("less gain a second", "as much gain", "about"))
