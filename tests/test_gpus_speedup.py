"""scripts/gpus_speedup.py: the same search on one GPU and on several, summarized from each arm's
wall time and study (here the two H200 runs committed under reports/gpus-speedup-h200-12trials)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("gpus_speedup", ROOT / "scripts" / "gpus_speedup.py")
gpus_speedup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpus_speedup)

RUNS = ROOT / "reports" / "gpus-speedup-h200-12trials"


def test_the_committed_h200_runs_summarize_to_their_figures(tmp_path):
    out = tmp_path / "runs"
    shutil.copytree(RUNS, out)
    assert gpus_speedup.main(["--trials", "12", "--out", str(out)]) == 0  # both arms finished: nothing runs
    summary = json.loads((out / "gpus-speedup.json").read_text())
    one, both = summary["one"], summary["all"]
    assert one["trials"] == both["trials"] == 12 and one["gpus"] == ["0"] and both["gpus"] == ["0", "1"]
    assert summary["speedup"] == pytest.approx(213.9 / 127.3)
    # the trial phase is read from the studies: the first trial's start to the last one's end
    assert one["trial_phase_s"] == pytest.approx(183.1, abs=0.1) and both["trial_phase_s"] == pytest.approx(94.7, abs=0.1)
    assert summary["trial_phase_speedup"] == pytest.approx(1.93, abs=0.01)
    assert one["fixed_s"] == pytest.approx(213.9 - one["trial_phase_s"])
    assert "**1.68x**" in (out / "gpus-speedup.md").read_text()


@pytest.mark.slow
def test_arms_that_measured_different_numbers_of_configurations_are_also_compared_at_equal_work(tmp_path):
    # the 28-trial H200 pair: the two-GPU arm repeated trial 20's configuration twice (copied, not
    # measured), so it measured 26 configurations against the one-GPU arm's 28
    runs = ROOT / "reports" / "gpus-speedup-h200-28trials"
    out = tmp_path / "runs"
    shutil.copytree(runs / "one", out / "one")
    shutil.copytree(runs / "first-all", out / "all")
    assert gpus_speedup.main(["--trials", "28", "--out", str(out)]) == 0
    summary = json.loads((out / "gpus-speedup.json").read_text())
    one, both = summary["one"], summary["all"]
    assert (one["trials"], one["measured"], both["trials"], both["measured"]) == (28, 28, 28, 26)
    assert summary["speedup"] == pytest.approx(1.81, abs=0.005)
    # two more trials at the two-GPU arm's median measured pace, spread over its two GPUs
    assert summary["same_measured_speedup"] == pytest.approx(
        one["wall_s"] / (both["wall_s"] + 2 * both["median_trial_s"] / 2))
    assert summary["same_measured_speedup"] == pytest.approx(1.71, abs=0.005)
    text = (out / "gpus-speedup.md").read_text()
    assert "| all | 0, 1 | 28 | 26 |" in text and "**1.71x** (estimated, not measured)" in text


def test_the_rerun_two_gpu_arm_shows_where_side_by_side_trials_lose_time(tmp_path):
    # the same one-GPU arm against the two-GPU arm re-run after the stop rule's wait was fixed:
    # both measured 28 configurations; the phases of the configurations both measured say where
    # two trials side by side are slower than one alone
    out = tmp_path / "runs"
    shutil.copytree(ROOT / "reports" / "gpus-speedup-h200-28trials", out)
    assert gpus_speedup.main(["--trials", "28", "--out", str(out)]) == 0
    summary = json.loads((out / "gpus-speedup.json").read_text())
    assert (summary["one"]["measured"], summary["all"]["measured"]) == (28, 28)
    assert "same_measured_speedup" not in summary
    assert summary["speedup"] == pytest.approx(469.2 / 268.4, abs=0.005)
    assert summary["all"]["tail_s"] == pytest.approx(17.4, abs=0.1) and summary["one"]["tail_s"] == 0
    side = summary["side_by_side"]
    assert side["configurations"] == 15
    phases = side["phases"]
    assert phases["worker_start_s"]["extra_s"] == pytest.approx(0.70, abs=0.01)
    assert phases["build_s"]["extra_s"] == pytest.approx(0.39, abs=0.01)
    assert abs(phases["measure_s"]["extra_s"]) < 0.01  # the measurement itself is not disturbed
    assert "timing_by_config" not in summary["one"]  # kept out of the JSON
    assert "| worker start | 3.37 s | +0.70 s |" in (out / "gpus-speedup.md").read_text()


def test_arms_of_different_searches_are_not_compared(tmp_path):
    out = tmp_path / "runs"
    shutil.copytree(RUNS, out)
    one = gpus_speedup.read_arm(out / "one")
    with pytest.raises(SystemExit, match="finished 12 and 11 trials"):
        gpus_speedup.summarize(one, {**one, "trials": 11})
    # an arm short of --trials is not finished: the script would run it, not compare it
    assert gpus_speedup.finished_arm(out / "all", 16) is None


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "0"], "two GPUs or more"),
    (["--arms", "two"], "choose from one, all"),
    (["--", "--model", "resnet18", "--trials", "3"], "--trials after -- is set by the script"),
])
def test_bad_options_say_what_to_do(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpus_speedup.parse_args(argv)
    assert message in capsys.readouterr().err


def test_each_arm_runs_the_same_search_on_its_gpus(tmp_path):
    args = gpus_speedup.parse_args(["--gpus", "2,3", "--trials", "20", "--out", str(tmp_path), "--",
                                    "--model", "resnet18", "--no-compile"])
    one = gpus_speedup.arm_command(args, "one", tmp_path / "one")
    both = gpus_speedup.arm_command(args, "all", tmp_path / "all")
    assert one[3:one.index("--gpus")] == both[3:both.index("--gpus")]  # same options, trials and seed
    assert one[one.index("--gpus") + 1] == "2" and both[both.index("--gpus") + 1] == "2,3"
    assert "--trials" in one and one[one.index("--trials") + 1] == "20"


def test_a_fresh_run_warms_up_then_runs_each_arm_once(tmp_path, monkeypatch):
    """The subprocess side, with `autotune search` faked by copying a committed H200 study into
    the arm's --out: the warm-up runs first and untimed, each arm once, and a rerun reuses both."""
    ran = []

    def fake_run(command, **kwargs):
        out = command[command.index("--out") + 1]
        gpus = command[command.index("--gpus") + 1]
        ran.append((gpus, command[command.index("--trials") + 1], out))
        if "warmup" not in out:
            (tmp_path / "runs" / ("one" if gpus == "0" else "all")).mkdir(parents=True, exist_ok=True)
            shutil.copy(RUNS / ("one" if gpus == "0" else "all") / "study.db", out + "/study.db")
        return None

    monkeypatch.setattr(gpus_speedup.subprocess, "run", fake_run)
    out = tmp_path / "runs"
    assert gpus_speedup.main(["--trials", "12", "--out", str(out), "--", "--model", "resnet18"]) == 0
    assert [(g, t) for g, t, _ in ran] == [("0", "2"), ("0", "12"), ("0,1", "12")]  # warm-up, one, all
    assert "warmup" in ran[0][2] and ran[1][2] == str(out / "one") and ran[2][2] == str(out / "all")
    wall = json.loads((out / "one" / "wall.json").read_text())
    assert wall["command"][:2] == ["autotune", "search"] and "--gpus" in wall["command"]
    assert json.loads((out / "gpus-speedup.json").read_text())["one"]["trials"] == 12
    ran.clear()
    assert gpus_speedup.main(["--trials", "12", "--out", str(out)]) == 0
    assert ran == []  # both arms finished: summarized again, nothing run


def test_with_replay_arm_all_measures_arm_ones_configurations(tmp_path, capsys):
    args = gpus_speedup.parse_args(["--replay", "--trials", "20", "--out", str(tmp_path), "--", "--model", "resnet18"])
    one = gpus_speedup.arm_command(args, "one", tmp_path / "one")
    both = gpus_speedup.arm_command(args, "all", tmp_path / "all")
    assert "--replay" not in one and both[both.index("--replay") + 1] == str(tmp_path / "one")
    # arm all alone needs a finished arm one to replay
    with pytest.raises(SystemExit, match="run --arms one first"):
        gpus_speedup.main(["--replay", "--arms", "all", "--trials", "20", "--out", str(tmp_path), "--no-warmup",
                           "--", "--model", "resnet18"])
    with pytest.raises(SystemExit):
        gpus_speedup.parse_args(["--", "--model", "resnet18", "--replay", "x"])
    assert "--replay after -- is set by the script" in capsys.readouterr().err


RUNS_44 = ROOT / "reports" / "gpus-speedup-h200-44trials"


def test_the_44_trial_h200_pair_measured_the_same_trials_and_says_so(tmp_path):
    # arm all replayed arm one's configurations: both measured the same 41 and copied the same 3
    out = tmp_path / "runs"
    shutil.copytree(RUNS_44, out, ignore=shutil.ignore_patterns("natural"))
    assert gpus_speedup.main(["--trials", "44", "--out", str(out)]) == 0
    summary = json.loads((out / "gpus-speedup.json").read_text())
    one, both = summary["one"], summary["all"]
    assert (one["trials"], one["measured"], both["trials"], both["measured"]) == (44, 41, 44, 41)
    assert "--replay" in both["command"] and "same_measured_speedup" not in summary
    assert summary["speedup"] == pytest.approx(397.8 / 208.6, abs=0.005)
    assert summary["speedup"] >= 1.8  # issue 8's bar
    assert summary["trial_phase_speedup"] == pytest.approx(2.00, abs=0.005)
    assert summary["side_by_side"]["configurations"] == 41
    assert abs(summary["side_by_side"]["phases"]["wall_s"]["extra_s"]) < 0.05
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    params = [[t.params for t in sorted(optuna.load_study(study_name=None, storage=f"sqlite:///{out / arm / 'study.db'}")
                                        .trials, key=lambda t: t.number)] for arm in ("one", "all")]
    assert params[0] == params[1]
    assert "**1.91x**" in (out / "gpus-speedup.md").read_text()


@pytest.mark.slow
def test_without_replay_the_two_gpu_search_took_another_path(tmp_path):
    out = tmp_path / "runs"
    shutil.copytree(RUNS_44 / "natural", out)
    assert gpus_speedup.main(["--trials", "44", "--out", str(out)]) == 0
    summary = json.loads((out / "gpus-speedup.json").read_text())
    assert summary["speedup"] == pytest.approx(335.9 / 217.2, abs=0.005)
    assert summary["side_by_side"]["configurations"] == 19  # the rest differ between the two searches
    assert summary["side_by_side"]["phases"]["wall_s"]["extra_s"] == pytest.approx(0.06, abs=0.01)
