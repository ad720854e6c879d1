"""scripts/search_yield.py: the benchmark's workloads (a GPT-style LM and an MLP of odd widths), its
reading of a search's output folder into one row (trials by role, best against the reference, the
wall clock by phase), and one real run of the script on a CPU."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import subprocess
import sys

import optuna
import pytest
import torch

from conftest import ROOT, subprocess_env

spec = importlib.util.spec_from_file_location("search_yield", ROOT / "scripts" / "search_yield.py")
search_yield = importlib.util.module_from_spec(spec)
spec.loader.exec_module(search_yield)

T0 = dt.datetime(2025, 1, 1, 12, 0, 0)


@pytest.fixture
def yield_models(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import yield_models

    return yield_models


@pytest.mark.slow
def test_the_workloads_build_through_model_and_train_a_step(yield_models):
    from autotune.workload.models import WorkloadSpec, build
    from strategies.channel_alignment import misaligned_layers
    from strategies.fp32_layers import kinds_present

    lm = build(WorkloadSpec(model="yield_models:gpt_lm_tiny"))
    x, y = lm.batch(3, torch.Generator().manual_seed(0))
    assert x.dtype == torch.int64 and x.shape == (3, 32) and torch.equal(x[:, 1:], y[:, :-1])  # next token
    loss = lm.loss_fn(lm.model(x), y)
    loss.backward()
    assert loss.item() == pytest.approx(torch.log(torch.tensor(1003.0)).item(), rel=0.05)  # a fresh model guesses
    assert kinds_present(lm.model) == ["norm", "attention", "head"]
    assert lm.model.lm_head.out_features == 1003 and misaligned_layers(lm.model, 8) == ["lm_head"]

    mlp = build(WorkloadSpec(model="yield_models:odd_mlp_tiny"))
    x, y = mlp.batch(4, torch.Generator().manual_seed(0))
    assert mlp.loss_fn(mlp.model(x), y).shape == () and mlp.num_classes == 10
    widths = [m.out_features for m in mlp.model if isinstance(m, torch.nn.Linear)]
    assert widths == [301, 299, 10] and misaligned_layers(mlp.model, 8) == ["0", "2", "4"]

    # the full sizes, without a step: GPT-2's vocabulary, 6 layers of width 512 and 8 heads, 256 tokens
    full = yield_models.gpt_lm()
    assert full.num_classes == 50257 and full.input_shape == (256,) and len(full.model.blocks) == 6
    assert full.model.blocks[0].attn.num_heads == 8 and full.model.wte.embedding_dim == 512
    widths = [m.out_features for m in yield_models.odd_mlp().model if isinstance(m, torch.nn.Linear)]
    assert widths == [3001, 2999, 1000]


def test_arguments_after_a_double_dash_go_to_every_search(tmp_path):
    args = search_yield.parse_args(["--models", "gpt_lm,resnet18", "--budgets", "3m,10m", "--out", str(tmp_path),
                                    "--reference", "gpt_lm=some/dir", "--", "--no-accuracy-check", "--seed", "3"])
    assert args.models == ["gpt_lm", "resnet18"] and args.budgets == ["3m", "10m"]
    assert args.extra == ["--no-accuracy-check", "--seed", "3"]
    command = search_yield.search_command(search_yield.model_target("gpt_lm"), "3m", tmp_path / "x", "cpu", args.extra)
    assert command[1:] == ["-m", "autotune", "search", "--model", "yield_models:gpt_lm", "--budget", "3m", "--out",
                           str(tmp_path / "x"), "--device", "cpu", "--no-accuracy-check", "--seed", "3"]
    assert search_yield.model_target("resnet18") == "resnet18"
    with pytest.raises(SystemExit):
        search_yield.parse_args(["--reference", "gpt_lm"])
    with pytest.raises(Exception, match="duration"):
        search_yield.parse_args(["--budgets", "ten minutes"])


def _trial(start_s: float, length_s: float, value=None, state=optuna.trial.TrialState.COMPLETE, **attrs):
    trial = optuna.trial.create_trial(
        state=state, value=value, params={"batch_size.batch_size": 16 + int(start_s)},
        distributions={"batch_size.batch_size": optuna.distributions.IntDistribution(1, 1000)},
        user_attrs={k: v for k, v in attrs.items() if v is not None})
    trial.datetime_start = T0 + dt.timedelta(seconds=start_s)
    trial.datetime_complete = trial.datetime_start + dt.timedelta(seconds=length_s)
    return trial


def _timing(wall_s, measure=True):
    timing = {"worker_start_s": 1.0, "build_s": 0.5, "warmup_s": 0.5, "compile_s": 0.0, "wall_s": wall_s}
    return {**timing, "measure_s": 2.0} if measure else timing


def plant_run(folder, *, workload="yield_models:odd_mlp_tiny", best=300.0, wall_s=45.0, budget_s=35.0):
    """A finished run as the script leaves it: a real study, config.json and the script's record."""
    from optuna.trial import TrialState

    folder.mkdir(parents=True)
    study = optuna.create_study(storage=f"sqlite:///{folder / 'study.db'}", direction="maximize")
    study.set_user_attr("accuracy_reference:abc", {"wall_s": 3.0, "reshuffled": {"wall_s": 2.5}})
    study.set_user_attr("accuracy_run:abc:def", {"wall_s": 1.5})
    trials = [
        _trial(5, 9, 100.0, role="baseline", status="ok", timing=_timing(5.0)),   # + 4 s of accuracy check
        _trial(14, 4, 200.0, role="known-good", status="ok", timing=_timing(4.0)),
        _trial(18, 3, None, TrialState.PRUNED, role="known-good", status="pruned", timing=_timing(3.0, False)),
        _trial(21, 5, best, status="ok", timing=_timing(5.0)),            # sampled by TPE
        _trial(26, 5, 250.0, role="steered", status="ok", timing=_timing(5.0)),
        _trial(31, 1, None, TrialState.PRUNED, role="backed-off", status="oom", timing=_timing(1.0, False)),
        _trial(32, 7, None, TrialState.FAIL, role="known-good",       # cut off by the budget: not counted
               reason="the search budget ran out 7 s into this trial; re-queued for the next run"),
        _trial(39, 0.5, best, status="ok", timing=_timing(5.0), duplicate_of=3),  # a repeat: no worker ran
    ]
    for trial in trials:
        study.add_trial(trial)
    config = {"objective": {"name": "throughput", "direction": "maximize", "unit": "samples/s", "value": best,
                            "baseline_value": 100.0},
              "figures": {"samples_per_s": best}, "summary": f"bf16, batch 24 ({best})", "study": {"trial_number": 3},
              "accuracy": {"verdict": "passed"}, "workload": {"model": workload}, "provenance": {"torch": "2.x"},
              "space": {"device": "cpu"}, "search": {"num_trials": 7}}
    (folder / "config.json").write_text(json.dumps(config))
    console = [("search cost over 7 trials (7 measured): ...; this run 38s (probe 2.0s, final accuracy checks 0.5s, "
                "export 1.2s)")]
    record = {"command": ["autotune"], "started": T0.isoformat(), "wall_s": wall_s, "budget_s": budget_s,
              "returncode": 0, "console": console}
    (folder / search_yield.MARKER).write_text(json.dumps(record))
    return study


def test_a_run_folder_reads_as_trials_by_role_the_best_and_the_wall_clock_by_phase(tmp_path):
    folder = tmp_path / "odd_mlp_tiny-30s"
    plant_run(folder)
    run = search_yield.summarize_run(folder, json.loads((folder / search_yield.MARKER).read_text()))
    assert run["trials"] == 7 and run["completed"] == 4        # the cut-off trial is not counted, nor the repeat run
    assert run["statuses"] == {"ok": 5, "pruned": 1, "oom": 1}
    assert (run["seeded"], run["sampled"], run["steered"], run["other_roles"]) == (3, 2, 1, 1)
    assert run["best_value"] == 300.0 and run["accuracy"] == "passed" and run["over_budget_s"] == 10.0
    phases = run["phases"]
    assert phases["startup_s"] == 5.0                              # to the first trial's start
    assert phases["measure_s"] == 8.0 and phases["worker_start_s"] == 6.0
    assert phases["trial_rest_s"] == pytest.approx(23.0 - 6.0 - 3.0 - 3.0 - 8.0)
    assert phases["in_trial_s"] == pytest.approx(4.5) and phases["cut_s"] == 7.0
    assert phases["final_accuracy_s"] == 0.5 and phases["export_s"] == 1.2
    assert phases["other_s"] == pytest.approx(45.0 - 5.0 - 23.0 - 4.5 - 7.0 - 0.5 - 1.2)
    assert sum(phases[k] for k in search_yield.PHASES) == pytest.approx(45.0)  # they add up to the wall time
    assert phases["accuracy_training_s"] == 7.0     # the cached checks' own training time, wherever it fell
    assert run["cli_phases"] == {"probe": 2.0, "final accuracy checks": 0.5, "export": 1.2}


@pytest.mark.slow
def test_finished_runs_are_reused_and_compared_with_the_reference(tmp_path, capsys):
    out = tmp_path / "yield"
    plant_run(out / "odd_mlp_tiny-30s", best=300.0, wall_s=45.0)
    plant_run(out / "odd_mlp_tiny-30s-r2", best=240.0, wall_s=31.0)
    plant_run(out / "odd_mlp_tiny-30s-r3", best=330.0, wall_s=29.0)
    plant_run(tmp_path / "reference", best=400.0)
    assert search_yield.main(["--models", "odd_mlp_tiny", "--budgets", "30s", "--repeats", "3", "--out", str(out),
                              "--reference", f"odd_mlp_tiny={tmp_path / 'reference'}"]) == 0
    assert capsys.readouterr().out.count("reused the finished run") == 3   # nothing was run
    result = json.loads((out / "results.json").read_text())
    (row,) = result["rows"]
    assert row["best_value"] == 300.0 and row["reference_value"] == 400.0 and row["ratio"] == 0.75  # medians
    assert row["wall_s"] == 31.0 and row["over_budget_s"] == -4.0 and row["max_over_budget_s"] == 10.0 and row["best_config"] == "bf16, batch 24 (330.0)"
    assert len(result["runs"]) == 3 and str(tmp_path / "reference") in row["reference_source"]
    markdown = (out / "results.md").read_text()
    assert "| odd_mlp_tiny | 30s | 31 | -4.0 | 7 | 4 | 3 / 2 / 1 / 1 | 300 samples/s | 400 | 75.0% | - |" in markdown
    assert (out / "results.csv").read_text().startswith("model,target,budget,budget_s,runs")
    # the plain recipe's loop ran on the same model (the real script, on the CPU), after the searches
    plain = result["meta"]["plain_recipes"]["odd_mlp_tiny"]
    assert plain["model"] == "yield_models:odd_mlp_tiny" and plain["device"] == "cpu" and plain["batch"] == 64
    assert row["plain_samples_per_s"] == plain["samples_per_s"] > 0 and row["plain_batch"] == 64
    assert row["plain_ratio"] == round(300.0 / plain["samples_per_s"], 4) == result["meta"]["plain_median_ratio"]
    assert f"| {row['plain_ratio']:.1%} |" in markdown and "Median best / plain recipe across 1 rows" in markdown
    assert (out / "plain-recipe" / "odd_mlp_tiny.json").exists()
    # --no-plain-recipe: the columns stay, empty
    assert search_yield.main(["--models", "odd_mlp_tiny", "--budgets", "30s", "--repeats", "3", "--out", str(out),
                              "--reference", f"odd_mlp_tiny={tmp_path / 'reference'}", "--no-plain-recipe"]) == 0
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["plain_samples_per_s"] is None and row["plain_ratio"] is None

    # a reference of another workload is refused rather than compared
    plant_run(tmp_path / "other", workload="resnet18")
    with pytest.raises(SystemExit, match="workload"):
        search_yield.main(["--models", "odd_mlp_tiny", "--budgets", "30s", "--out", str(out),
                           "--reference", f"odd_mlp_tiny={tmp_path / 'other'}"])


def test_a_reference_from_an_older_config_json_is_the_same_workload_and_a_copy_without_git_names_its_commit(
        tmp_path, monkeypatch):
    # the H200 run of 0cbb071 refused reports/resnet50-h200-compile: its config.json was written
    # before workloads carried model_config and seq_len, which mean the same when unset
    old = {"workload": {"model": "resnet50", "input_shape": None, "num_classes": 1000}, "gpu": "H200",
           "objective": "throughput", "space": {}, "out_dir": "old"}
    run = {"workload": {"model": "resnet50", "input_shape": None, "num_classes": 1000, "model_config": {},
                        "seq_len": None}, "gpu": "H200", "objective": "throughput", "space": {}, "out_dir": "new",
           "best_value": 1.0}
    assert search_yield.check_reference("resnet50", old, [run]) == []
    with pytest.raises(SystemExit, match="workload"):  # a set option still tells two workloads apart
        search_yield.check_reference("resnet50", old, [{**run, "workload": {**run["workload"], "seq_len": 256}}])
    # the GPU machine gets the working tree without .git: the commit comes from AUTOTUNE_COMMIT
    monkeypatch.setattr(search_yield, "ROOT", tmp_path)
    monkeypatch.setenv("AUTOTUNE_COMMIT", "0cbb071")
    assert search_yield.checkout() == "0cbb071"


def test_an_unfinished_run_is_run_again_from_a_fresh_folder(tmp_path, monkeypatch):
    folder = tmp_path / "odd_mlp_tiny-30s"
    folder.mkdir()
    (folder / "study.db").write_text("left by a killed run")
    ran = []
    monkeypatch.setattr(search_yield, "run_command", lambda command, out_dir, budget_s, cold: ran.append(
        (command, out_dir.exists(), budget_s, cold)) or {"wall_s": 1.0})
    args = search_yield.parse_args(["--out", str(tmp_path), "--device", "cpu"])
    search_yield.ensure_run("yield_models:odd_mlp_tiny", "30s", folder, args)
    # the old folder is gone before the search starts, which gets empty caches of its own
    assert ran == [(search_yield.search_command("yield_models:odd_mlp_tiny", "30s", folder, "cpu", []), False, 30.0, True)]

    # a run that ended before it opened a study (a crash at start-up) is not reused either
    folder.mkdir()
    (folder / search_yield.MARKER).write_text(json.dumps({"wall_s": 2.0, "returncode": 1}))
    search_yield.ensure_run("yield_models:odd_mlp_tiny", "30s", folder, args)
    assert len(ran) == 2


@pytest.mark.slow
def test_one_cpu_run_of_the_script_reports_what_its_search_did(tmp_path):
    """The script as a user runs it: a real 30-second search of the tiny MLP, then its row."""
    from autotune.search.trials import best_trial, counted_trials

    out = tmp_path / "yield"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "search_yield.py"), "--device", "cpu",
                           "--models", "odd_mlp_tiny", "--budgets", "30s", "--out", str(out),
                           "--", "--min-measure-time", "0.3"],
                          cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "results.json").read_text())
    (row,), (run,) = result["rows"], result["runs"]
    folder = out / "odd_mlp_tiny-30s"
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{folder / 'study.db'}")
    config = json.loads((folder / "config.json").read_text())
    assert row["trials"] == len(counted_trials(study)) == config["search"]["num_trials"] >= 2
    assert row["best_value"] == config["objective"]["value"] == best_trial(study).value
    assert row["ratio"] == 1.0 and "best of these runs" in row["reference_source"]   # no reference given
    assert row["seeded"] >= 1 and run["roles"]["baseline"] == 1
    assert json.loads((folder / search_yield.MARKER).read_text())["caches"] == "cold"   # its own empty caches
    assert row["wall_s"] <= 30 + 20 and row["over_budget_s"] == pytest.approx(row["wall_s"] - 30)
    assert sum(row[k] for k in search_yield.PHASES) == pytest.approx(row["wall_s"], abs=0.1)
    assert row["measure_s"] > 0 and row["startup_s"] > 0
    assert "| odd_mlp_tiny | 30s |" in (out / "results.md").read_text()
    assert (out / "results.csv").read_text().startswith("model,target,budget")
    assert row["plain_samples_per_s"] > 0 and row["plain_ratio"] == round(row["best_value"] / row["plain_samples_per_s"], 4)
    assert "plain_ratio" in (out / "results.csv").read_text().splitlines()[0]


def test_the_plain_recipe_gets_the_searches_workload_and_memory_options():
    extra = ["--no-accuracy-check", "--model-config", "num_hidden_layers=16,hidden_size=2048", "--seq-len=1024",
             "--memory-limit", "24GiB", "--seed", "3", "--input-on-device", "--no-compile", "--base-batch-size", "8"]
    assert search_yield.plain_recipe_args(extra) == [
        "--model-config", "num_hidden_layers=16,hidden_size=2048", "--seq-len=1024", "--memory-limit", "24GiB",
        "--input-on-device", "--no-compile", "--base-batch-size", "8"]
    command = search_yield.plain_recipe_command("hf:llama", "cuda", extra)
    assert command[1] == str(ROOT / "scripts" / "plain_recipe_loop.py")
    assert command[2:6] == ["--model", "hf:llama", "--device", "cuda"]
    assert search_yield.parse_args([]).plain_recipe is True
    assert search_yield.parse_args(["--no-plain-recipe"]).plain_recipe is False
    assert "--batch-size" not in command
    pinned = search_yield.plain_recipe_command("hf:llama", "cuda", extra, search_yield.parse_args(
        ["--plain-recipe-batch", "2"]).plain_recipe_batch)
    assert pinned[-2:] == ["--batch-size", "2"]


PLAIN = {"model": "resnet50", "batch": 512, "samples_per_s": 2000.0, "tokens_per_s": None, "base_batch": 256,
         "tried": [{"batch": 1024, "outcome": "oom"}, {"batch": 768, "outcome": "oom"}, {"batch": 512, "outcome": "ok"}],
         "peak_memory_gib": 21.5, "memory_limit_gib": 24.0, "precision": "bf16", "grad_scaler": False,
         "compile": True, "optimizer": "fused adamw"}


def test_a_row_gives_the_plain_recipe_and_best_over_it_and_the_summary_their_median(tmp_path):
    folder = tmp_path / "odd_mlp_tiny-30s"
    plant_run(folder, best=300.0)
    run = search_yield.summarize_run(folder, json.loads((folder / search_yield.MARKER).read_text()))
    reference = {"best_value": 400.0, "source": "a long search"}
    row = search_yield.aggregate("odd_mlp_tiny", "30s", [run], reference, {**PLAIN, "samples_per_s": 250.0})
    assert (row["plain_samples_per_s"], row["plain_batch"], row["plain_ratio"]) == (250.0, 512, 1.2)
    assert row["plain_tokens_per_s"] is None and row["plain_error"] is None
    slower = search_yield.aggregate("odd_mlp_tiny", "3m", [run], reference, {**PLAIN, "samples_per_s": 400.0})
    assert slower["plain_ratio"] == 0.75                       # the search lost to the plain recipe here
    lm = search_yield.aggregate("odd_mlp_tiny", "10m", [run], reference,
                                {**PLAIN, "samples_per_s": 150.0, "tokens_per_s": 153600.0, "batch": 16})
    failed = search_yield.aggregate("odd_mlp_tiny", "1h", [run], reference, {"error": "no batch fitted"})
    skipped = search_yield.aggregate("odd_mlp_tiny", "2h", [run], reference)        # --no-plain-recipe
    assert failed["plain_ratio"] is None and failed["plain_error"] == "no batch fitted"
    assert skipped["plain_samples_per_s"] is None and skipped["plain_ratio"] is None
    # another objective's best (joules per sample) is not set against samples/s
    assert search_yield.plain_figures({"best_value": 0.5, "unit": "J/sample"}, PLAIN)["plain_ratio"] is None

    rows = [row, slower, lm, failed, skipped]
    meta = {"where": "H200", "torch": "2.x", "command": "python3 scripts/search_yield.py", "checkouts": ["abc"],
            "references": {"odd_mlp_tiny": (400.0, "a long search")}, "repeats": 1,
            "plain_recipes": {"resnet50": PLAIN, "hf:gpt2": {"error": "the plain recipe's loop exited 1: boom"}},
            "plain_median_ratio": search_yield.median([r["plain_ratio"] for r in rows])}
    assert meta["plain_median_ratio"] == 1.2                   # of 1.2, 0.75 and 2.0
    markdown = search_yield.markdown(rows, meta, [])
    assert "| verified | plain recipe | best / plain | accuracy | best configuration |" in markdown
    assert "| 250 at batch 512 | 120.0% | passed |" in markdown
    assert "| 150 (153,600 tokens/s) at batch 16 | 200.0% |" in markdown
    assert "| - | - | passed |" in markdown
    assert ("- resnet50: 2,000 samples/s at batch 512 (base 256; out of memory at 1024, 768), peak 21.5 GiB "
            "(capped at 24 GiB); bf16, compiled, fused adamw") in markdown
    assert "- hf:gpt2: the plain recipe's loop exited 1: boom" in markdown
    assert "Median best / plain recipe across 3 rows: 120.0%" in markdown
    header, separator = [line for line in markdown.splitlines() if line.startswith("| model | budget | wall")][0], \
        markdown.splitlines()[5]
    assert header.count("|") == separator.count("|") == row_pipes(markdown, "| odd_mlp_tiny | 30s |")


def row_pipes(markdown: str, start: str) -> int:
    return next(line for line in markdown.splitlines() if line.startswith(start)).count("|")


def test_the_plain_recipe_runs_once_per_model_and_is_reused(tmp_path, monkeypatch):
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        assert "scripts" in kwargs["env"]["PYTHONPATH"]           # yield_models is importable
        return subprocess.CompletedProcess(command, 0, stdout="compiling\n" + json.dumps(PLAIN) + "\n", stderr="")

    monkeypatch.setattr(search_yield.subprocess, "run", fake_run)
    args = search_yield.parse_args(["--out", str(tmp_path), "--device", "cuda", "--", "--memory-limit", "24GiB"])
    assert search_yield.plain_recipe("resnet50", args) == PLAIN
    assert calls[0][2:] == ["--model", "resnet50", "--device", "cuda", "--memory-limit", "24GiB"]
    assert search_yield.plain_recipe("resnet50", args) == PLAIN and len(calls) == 1     # reused
    args.extra = ["--memory-limit", "40GiB"]                                           # another command: run again
    search_yield.plain_recipe("resnet50", args)
    assert len(calls) == 2

    # a loop that fails is an error in the row, not a crash of the benchmark
    monkeypatch.setattr(search_yield.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(
        command, 1, stdout="", stderr="Traceback ...\nRuntimeError: CUDA error: an illegal memory access"))
    result = search_yield.plain_recipe("vit_b_16", args)
    assert result["error"] == "the plain recipe's loop exited 1: RuntimeError: CUDA error: an illegal memory access"


def test_a_row_gives_the_same_searchs_best_with_the_memory_knobs_off(tmp_path):
    """Issue 36 asks, beside the recommendation, the best of the same search with the new knobs off."""
    folder = tmp_path / "odd_mlp_tiny-30s"
    study = plant_run(folder, best=300.0)
    levered = {"precision": {"mode": "bf16"}, "batch_size": {"batch_size": 64}, "optimizer_state": {"state": "8bit-bnb"},
               "activation_checkpointing": {"every": 1}}
    study.add_trial(_trial(40, 5, 360.0, role="steered", status="ok", timing=_timing(5.0), knobs=levered))
    off = search_yield.best_without_memory_knobs(study)
    assert off["value"] == 300.0 and off["trial"] == 3  # the levered one is faster, and left out
    run = search_yield.summarize_run(folder, json.loads((folder / search_yield.MARKER).read_text()))
    run["best_value"] = 360.0  # as config.json would say for the levered recommendation
    row = search_yield.aggregate("odd_mlp_tiny", "30s", [run], {}, {**PLAIN, "samples_per_s": 250.0})
    assert row["without_memory_knobs_value"] == 300.0 and row["without_memory_knobs_plain_ratio"] == 1.2
    meta = {"where": "H200", "torch": "2.x", "command": "x", "checkouts": ["abc"], "references": {}, "repeats": 1,
            "plain_recipes": {"odd_mlp_tiny": PLAIN}, "plain_median_ratio": None}
    assert ("- odd_mlp_tiny (30s), the same search's best with the memory knobs off: 300 (120.0% of the plain "
            "recipe)") in search_yield.markdown([row], meta, [])
