"""End to end, as a user runs it: `autotune search` in a subprocess, with real trial workers and
a real SQLite study, then the exported config trained through autotune.load."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import time

import optuna
import pandas as pd
import pytest
import torch

import autotune
import strategies
from autotune.errors import ConfigError
from conftest import ROOT, first_seen, newly_in_worker, run_cli, subprocess_env

# every trial measured in full: these tests count completed trials (screening: tests/test_early_stop.py)
SMALL = ["--device", "cpu", "--input-shape", "3x32x32", "--num-classes", "10", "--min-measure-time", "0.3",
         "--early-stop-below", "0"]
BF16 = ["--precisions", "fp32,bf16"]  # on every CPU, native bf16 or not


def _study(out):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")


def _train_through_config(path, steps=8):
    """The README's loop's calls (load, prepare, grad_scaler, loader, autocast) on a tiny model and one
    batch repeated; tests/test_readme.py runs the README's loop itself, as written."""
    cfg = autotune.load(path)
    torch.manual_seed(0)
    model = __import__("fake_models").tiny_cnn(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.scaled_lr(0.05), momentum=0.9)
    model, optimizer = cfg.prepare(model, optimizer)
    scaler = cfg.grad_scaler()
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(cfg.batch_size, 3, 32, 32)
    y = torch.randint(0, 10, (cfg.batch_size,))
    losses = []
    for xb, yb in cfg.loader([(x, y)] * steps):
        optimizer.zero_grad(set_to_none=True)
        with cfg.autocast():
            loss = loss_fn(model(xb), yb)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def cpu_search(tmp_path_factory):
    """A finished 6-trial CPU search: its output folder, and the search's console output. bf16 is asked
    for, so that a CPU without native bf16 (emulated: slower, but it runs) searches the space one with
    it does, plain recipe included."""
    out = tmp_path_factory.mktemp("cpu-search") / "out"
    proc = run_cli("search", "--model", "fake_models:tiny_cnn", *SMALL, *BF16, "--trials", "6", "--out", str(out))
    return out, proc


@pytest.mark.slow
def test_cpu_search_exports_a_config_that_trains(cpu_search, tmp_path, cli_main):
    out, proc = cpu_search
    assert "speed-up over the FP32 baseline" in proc.stderr
    data = json.loads((out / "config.json").read_text())
    trials = pd.read_csv(out / "trials.csv")
    assert len(trials) == 6
    assert trials.loc[0, "role"] == "baseline" and trials.loc[0, "config"].startswith("fp32, contiguous")
    assert (trials["state"] == "COMPLETE").all()
    # each trial says why the planner ran it when it did: the bars by their roles, the rest by prediction
    assert trials.loc[0, "planned_why"] == "the FP32 baseline: every figure is compared with it"
    assert trials.loc[1, "role"] == "plain-recipe" and trials.loc[1, "planned_why"].startswith("the plain recipe")
    queued = trials["role"] != "search"
    assert trials.loc[queued, "planned_cost_s"].notna().all() and trials["planned_why"].notna().all()
    assert (trials.loc[~queued, "planned_why"] == "sampled by TPE: nothing was queued").all()
    best = trials.loc[trials["samples_per_s"].idxmax()]
    assert data["figures"]["samples_per_s"] == pytest.approx(best["samples_per_s"])
    assert data["study"]["trial_number"] == best["number"]
    # every knob's value, the parameters that replay it, provenance and the search's own cost
    assert set(data["knobs"]) >= {"precision", "batch_size", "memory_format", "threads"}
    assert data["params"]["batch_size.batch_size"] == data["knobs"]["batch_size"]["batch_size"]
    assert data["provenance"]["torch"] == torch.__version__
    assert data["search"]["num_trials"] == 6 and data["search"]["measure_s"] > 0
    assert (trials["worker_start_s"] > 0).all() and (trials["measure_s"] > 0).all()
    assert data["baseline"]["figures"]["samples_per_s"] > 0
    losses = _train_through_config(out)
    assert losses[-1] < losses[0]

    # the same command again resumes: nothing new to do at 6 trials, the study is unchanged
    run_cli("search", "--model", "fake_models:tiny_cnn", *SMALL, *BF16, "--trials", "6", "--out", str(out))
    assert len(_study(out).trials) == 6
    # ... and asking for more runs only the difference
    run_cli("search", "--model", "fake_models:tiny_cnn", *SMALL, *BF16, "--trials", "7", "--out", str(out))
    assert len(_study(out).trials) == 7

    # the report came with the search, and `autotune report` rewrites it, from the folder or a URL
    # (report and compare run in this process: their own processes are the searches' above)
    html = (out / "report.html").read_text()
    assert "fake_models:tiny_cnn" in html and 'id="trials"' in html
    (out / "report.html").unlink()
    assert cli_main("report", str(out)).returncode == 0
    assert (out / "report.html").exists()
    elsewhere = tmp_path / "again"
    assert cli_main("report", "--storage", f"sqlite:///{out / 'study.db'}", "--study-name",
                    data["study"]["study_name"], "--out", str(elsewhere)).returncode == 0
    assert {p.name for p in elsewhere.iterdir()} == {"report.html", "report.md", "trials.csv"}
    assert pd.read_csv(elsewhere / "trials.csv").shape[0] == 7
    bad = cli_main("report", "--storage", f"sqlite:///{out / 'study.db'}", "--study-name", "nope")
    assert bad.returncode == 2 and "cannot load study 'nope'" in bad.stderr

    # compare against the committed GPU report: a different model is refused unless asked for
    gpu = ROOT / "reports" / "resnet50-h200"
    refused = cli_main("compare", str(gpu), str(out), "--out", str(tmp_path / "cmp"))
    assert refused.returncode == 2 and "--allow-different-models" in " ".join(refused.stderr.split())
    assert cli_main("compare", str(gpu), str(out), "--out", str(tmp_path / "cmp"),
                    "--allow-different-models").returncode == 0
    assert (tmp_path / "cmp" / "compare.html").exists() and (tmp_path / "cmp" / "compare.md").exists()

    # re-measuring the exported config through autotune.load in a fresh worker (the 7th trial may have
    # become the best since config.json was read above: compare with the file as it is now)
    proc = run_cli("verify", str(out))
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    data = json.loads((out / "config.json").read_text())
    assert verdict["recorded"] == pytest.approx(data["figures"]["samples_per_s"])
    assert verdict["median"] > 0


@pytest.mark.slow
def test_cpu_trial_workers_are_forked_with_their_imports_done(tiny_cpu_search, tmp_path):
    """On a CPU every trial's worker is forked from the fork server the search started with its
    probe (tests/test_zygote.py tests the server): no trial waits for imports, the first included.
    The search is the session's 3-trial one (conftest.TINY_CPU_SEARCH: SMALL, no accuracy check)."""
    out, proc = tiny_cpu_search
    assert proc.returncode == 0, proc.stderr
    # run ones: what the proposers queued behind them (the plain recipe's neighbours) waits for a resume
    trials = [t for t in _study(out).trials if t.state.is_finished()]
    assert len(trials) == 3 and all(t.user_attrs["status"] == "ok" for t in trials)
    starts = [t.user_attrs["timing"]["worker_start_s"] for t in trials]
    assert max(starts) < 0.5, starts  # a fresh interpreter's imports take seconds here
    # each trial's log is its own worker's (search.log is the run's own log)
    logs = sorted(p.name for p in (out / "logs").iterdir() if p.suffix == ".log" and p.name != "search.log")
    assert logs == [f"trial-{t.number:04d}.log" for t in trials]
    bad = subprocess.run([sys.executable, "-m", "autotune", "search", "--model", "fake_models:tiny_cnn", *SMALL,
                          "--trials", "1", "--out", str(tmp_path / "bad")],
                         cwd=ROOT, env=subprocess_env(AUTOTUNE_PRESTART="yes"), capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode != 0 and "AUTOTUNE_PRESTART='yes': write 1" in bad.stderr


@pytest.mark.slow
def test_resume_after_the_search_process_is_killed(tmp_path):
    out = tmp_path / "out"
    # no accuracy check: what is resumed is the trials (the checks' own resume: test_accuracy_budget)
    args = ["search", "--model", "fake_models:slow_cnn", *SMALL, "--min-measure-time", "1.0",
            "--no-accuracy-check", "--trials", "5", "--out", str(out)]
    env = subprocess_env()
    proc = subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # kill it once two trials are finished and a third is running. The states are read straight
    # from the SQLite file, read-only: loading the study through Optuna while the search writes
    # can fail with "database is locked" for long stretches on a busy machine, and a poll that
    # kept failing missed the running trials until the search had finished (a CI failure)
    deadline = time.time() + 300
    killed = None
    seen: set[int] = set()
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
        try:
            with contextlib.closing(sqlite3.connect(f"file:{out / 'study.db'}?mode=ro", uri=True, timeout=5)) as db:
                states = dict(db.execute("SELECT number, state FROM trials"))
                # running trials that have chosen all their parameters (the objective records the
                # knobs once every one is sampled): one killed while sampling is re-run with the
                # parameters it had plus fresh samples, not "the same parameters" (checked below)
                running = [n for (n,) in db.execute(
                    "SELECT number FROM trials t WHERE state = 'RUNNING' AND EXISTS "
                    "(SELECT 1 FROM trial_user_attributes a WHERE a.trial_id = t.trial_id AND a.key = 'knobs')")]
        except sqlite3.Error:  # no file yet, the study is being created, or a write holds the lock
            continue
        # at the first poll that sees it so (it measures for 1 s or more after that): one seen on a later
        # poll may be ending as the kill lands (conftest.newly_in_worker)
        new = first_seen(running, seen)
        if sum(state in ("COMPLETE", "PRUNED", "FAIL") for state in states.values()) >= 2 and new:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed = new[0]
            break
    assert killed is not None, f"the search never had a trial running after two finished (exit code {proc.poll()})"
    finished_before = [(t.number, t.params, t.value) for t in _study(out).trials if t.state.is_finished()]
    assert len(finished_before) >= 2
    for _ in range(20):  # the orphaned worker notices its parent is gone and exits
        time.sleep(0.5)
        workers = subprocess.run(["pgrep", "-f", "autotune.worker.serve"], capture_output=True, text=True).stdout.split()
        if not workers:
            break
    assert not workers, f"workers left running after the search was killed: {workers}"

    run_cli("search", *args[1:])
    study = _study(out)
    trials = study.trials
    by_number = {t.number: t for t in trials}
    for number, params, value in finished_before:  # completed trials are kept as they were
        assert by_number[number].params == params and by_number[number].value == value
    assert by_number[killed].state == optuna.trial.TrialState.FAIL
    assert "status" not in by_number[killed].user_attrs
    retried = [t for t in trials if t.user_attrs.get("retry_of") == killed]
    assert len(retried) == 1 and retried[0].params == by_number[killed].params
    assert retried[0].state == optuna.trial.TrialState.COMPLETE
    counted = [t for t in trials if "status" in t.user_attrs]
    assert len(counted) == 5  # no trial counted twice
    assert pd.read_csv(out / "trials.csv").shape[0] == len(trials)


@pytest.mark.slow
def test_a_batch_that_does_not_fit_is_recorded_and_the_study_goes_on(tmp_path):
    out = tmp_path / "out"
    run_cli("search", "--model", "fake_models:oom_above_16", *SMALL, "--min-batch-size", "8",
            "--max-batch-size", "32", "--trials", "5", "--out", str(out))
    trials = pd.read_csv(out / "trials.csv")
    big = trials[trials["param.batch_size.batch_size"] > 16]
    assert len(big) >= 1  # the known-good seed at the largest batch
    assert (big["state"] == "PRUNED").all()
    assert big["reason"].str.contains("does not fit at batch").all()
    small = trials[trials["param.batch_size.batch_size"] <= 16]
    assert (small["state"] == "COMPLETE").all()
    assert json.loads((out / "config.json").read_text())["knobs"]["batch_size"]["batch_size"] <= 16


@pytest.mark.slow
def test_a_crashing_worker_fails_its_trial_and_the_study_goes_on(tmp_path):
    out = tmp_path / "out"
    run_cli("search", "--model", "fake_models:crash_under_autocast", *SMALL, "--precisions", "fp32,bf16",
            "--trials", "4", "--out", str(out))
    trials = pd.read_csv(out / "trials.csv")
    crashed = trials[trials["param.precision.mode"] == "bf16"]
    assert len(crashed) >= 1
    assert (crashed["state"] == "FAIL").all()
    assert crashed["reason"].str.contains("exited with code 9").all()
    assert (trials[trials["param.precision.mode"] == "fp32"]["state"] == "COMPLETE").all()
    assert len(trials) == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "resnet5"], "did you mean resnet50"),
        (["--model", "no_such_pkg.models:build"], "cannot import module 'no_such_pkg.models'"),
        (["--model", "fake_models:tiny_cn"], "did you mean tiny_cnn"),
        # the probe's worker process builds the model: seconds, so in the slow tier
        pytest.param(["--model", "fake_models:not_a_model"], "must return an nn.Module", marks=pytest.mark.slow),
        (["--model", "resnet18", "--budget", "ten minutes"], "write a duration like"),
        (["--model", "resnet18", "--input-shape", "3xx4"], "CxHxW"),
        (["--model", "resnet18", "--precisions", "fp9"], "unknown mode 'fp9'"),
        (["--model", "resnet18", "--precisions", "fp8"], "--precisions must include fp32"),
        (["--model", "resnet18", "--trials", "0"], "--trials must be at least 1"),
        (["--model", "resnet18", "--budget", "3s"], "cannot hold a single trial"),
        (["--model", "resnet18", "--min-batch-size", "64", "--max-batch-size", "8"], "is larger than --max-batch-size"),
        (["--model", "resnet18", "--min-measure-time", "-1"], "--min-measure-time -1: MeasureSettings.min_time_s must not be negative"),
    ],
)
def test_bad_input_gets_a_clear_error(tmp_path, args, message, cli_main):
    proc = cli_main("search", *args, "--device", "cpu", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2, proc.stderr
    assert message in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o" / "study.db").exists()


@pytest.mark.slow
def test_bad_input_in_a_process_of_its_own_exits_2_with_the_fix(tmp_path):
    """As a user's shell sees it: the exit status and the one line (the rest in this process above)."""
    proc = run_cli("search", "--model", "resnet5", "--device", "cpu", "--out", str(tmp_path / "o"), check=False,
                   timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "did you mean resnet50" in " ".join(proc.stderr.split())


@pytest.mark.slow
def test_models_lists_torchvision_names():
    proc = run_cli("models")
    names = proc.stdout.split()
    assert "resnet50" in names and "vit_b_16" in names


@pytest.mark.slow
def test_the_budget_is_a_limit_and_a_cut_trial_is_not_lost(tmp_path):
    out = tmp_path / "out"
    # fp32 only: the same seeds ahead of the re-queued baseline on a CPU with native bf16 as without
    slow = ["search", "--model", "fake_models:slow_cnn", "--device", "cpu", "--input-shape", "3x32x32",
            "--num-classes", "10", "--precisions", "fp32", "--out", str(out)]
    started = time.time()
    # 100 steps of 60 ms (a CPU's max_steps) and a warm-up: about 7 s, which 10 s less the start-up and the export's reserve cannot hold
    proc = run_cli(*slow, "--budget", "10s", "--min-measure-time", "60", check=False)
    elapsed = time.time() - started
    said = " ".join(proc.stderr.split())  # rich wraps long lines
    assert proc.returncode == 1 and "no configuration to recommend" in said and "no trial was measured" in said
    assert elapsed < 10 + 15, f"a 10 s budget took {elapsed:.0f} s"  # interpreter start and export aside
    first = _study(out).trials[0]
    assert first.state == optuna.trial.TrialState.FAIL and "budget ran out" in first.user_attrs["reason"]
    assert "status" not in first.user_attrs  # not counted as a measured trial
    # the next run measures the cut baseline again (after the seeds queued before it)
    run_cli(*slow, "--trials", "2", "--min-measure-time", "0.3")
    retried = [t for t in _study(out).trials if t.user_attrs.get("retry_of") == 0]
    assert len(retried) == 1 and retried[0].user_attrs["role"] == "baseline"
    assert retried[0].state == optuna.trial.TrialState.COMPLETE and retried[0].params == first.params
    assert json.loads((out / "config.json").read_text())["baseline"]["trial_number"] == retried[0].number


@pytest.mark.slow
def test_sigterm_stops_cleanly_writes_the_outputs_and_the_next_run_resumes(tmp_path):
    out = tmp_path / "out"
    args = ["search", "--model", "fake_models:slow_cnn", *SMALL, "--min-measure-time", "1.0",
            "--no-accuracy-check", "--trials", "4", "--out", str(out)]
    env = subprocess_env()
    proc = subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    seen: set[int] = set()
    while time.time() < deadline:
        time.sleep(0.5)
        try:
            trials = _study(out).trials
        except Exception:
            continue
        # a trial seen later than its first poll may have ended already (seen once in CI); one
        # measures for 1 s or more here
        new = newly_in_worker(trials, seen)
        if sum(t.state.is_finished() for t in trials) >= 1 and new:
            break
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "outputs were written" in stderr
    assert (out / "config.json").exists() and (out / "report.html").exists()
    trials = _study(out).trials
    cut = [t for t in trials if "interrupted" in t.user_attrs.get("reason", "")]
    assert len(cut) == 1 and cut[0].state == optuna.trial.TrialState.FAIL and "status" not in cut[0].user_attrs
    run_cli(*args)
    trials = _study(out).trials
    retried = [t for t in trials if t.user_attrs.get("retry_of") == cut[0].number]
    assert len(retried) == 1 and retried[0].state == optuna.trial.TrialState.COMPLETE
    assert sum("status" in t.user_attrs for t in trials) == 4


@pytest.mark.slow
def test_storage_passwords_never_reach_messages(tmp_path):
    secret = "s3cret-pw"
    proc = run_cli("search", "--model", "fake_models:tiny_cnn", *SMALL, "--trials", "1", "--out", str(tmp_path / "o"),
                   "--storage", f"mysql://bob:{secret}@127.0.0.1:1/tune", check=False, timeout=120)
    assert proc.returncode == 2 and "cannot be opened" in proc.stderr
    assert secret not in proc.stderr + proc.stdout and "bob:***@" in proc.stderr
    from autotune.search.storage import mask_url

    assert mask_url(f"postgresql://bob:{secret}@db:5432/tune") == "postgresql://bob:***@db:5432/tune"
    assert mask_url("sqlite:///reports/x/study.db") == "sqlite:///reports/x/study.db"


@pytest.mark.slow
def test_an_unwritable_output_folder_is_refused_before_any_trial(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = run_cli("search", "--model", "fake_models:tiny_cnn", *SMALL, "--trials", "1",
                   "--out", str(blocker / "out"), check=False, timeout=120)
    assert proc.returncode == 2 and "cannot write to the output folder" in proc.stderr
    assert "choose another with --out" in " ".join(proc.stderr.split())


@pytest.mark.slow
def test_replay_measures_an_earlier_searchs_configurations_in_its_order(cpu_search, tmp_path):
    first, second = cpu_search[0], tmp_path / "second"
    # the accuracy check on, as in the first search: on a CPU with native bf16 it offers fp32_layers,
    # and without it this space would leave those configurations out of the replay
    common = ["search", "--model", "fake_models:tiny_cnn", *SMALL, *BF16, "--min-measure-time", "0.2", "--trials", "4"]
    # another seed: on its own, this search would sample other configurations after its seeds
    proc = run_cli(*common, "--seed", "7", "--replay", str(first), "--out", str(second))
    assert proc.returncode == 0
    # what the first search measured, in the order it ran them (a candidate it queued and never ran is
    # not replayed)
    # a repeat of a measured configuration is copied, not measured, whenever the planner reaches it
    def ran(study):
        return sorted((t for t in study.trials if t.state.is_finished() and "duplicate_of" not in t.user_attrs),
                      key=lambda t: t.datetime_start)

    # the rest of the replay stays queued, as a resumed search would run it
    replayed = ran(_study(second))
    earlier = ran(_study(first))[:len(replayed)]
    assert len(replayed) >= 3
    assert [t.params for t in replayed] == [t.params for t in earlier]
    roles = [t.user_attrs.get("role", "search") for t in replayed]
    # the earlier search's seeds keep their roles where it measured them; the rest are replayed
    assert roles[0] == "baseline" and "replayed" in roles and "search" not in roles
    assert [t.user_attrs["replay_of"] for t in replayed if t.user_attrs.get("role") == "replayed"] == \
        [t.number for t in earlier if t.user_attrs.get("role", "search") not in ("baseline", "plain-recipe", "known-good")]
    bad = run_cli(*common, "--replay", str(tmp_path), "--out", str(tmp_path / "third"), check=False)
    assert bad.returncode != 0 and f"--replay {tmp_path}: no study.db there" in " ".join(bad.stderr.split())


def test_replay_leaves_out_configurations_this_space_does_not_offer(tmp_path):
    from autotune.space import SearchSpace
    from autotune.search.seeds import replay_configurations
    from autotune.search.steering import complete_params

    wide = SearchSpace(device="cpu", precisions=["fp32", "bf16"], batch_sizes=[8, 16, 32], base_batch_size=8)
    narrow = SearchSpace(device="cpu", precisions=["fp32", "bf16"], batch_sizes=[8, 16], base_batch_size=8)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="earlier")
    for batch in (16, 32, 8, 16):
        params = complete_params({"batch_size.batch_size": batch, "precision.mode": "bf16"}, wide)
        study.enqueue_trial(params)
        study.optimize(lambda trial: float(len(strategies.sample(trial, wide))), n_trials=1)
    kept, left_out = replay_configurations(tmp_path, narrow)
    assert [number for number, _ in kept] == [0, 2, 3] and left_out == 1  # batch 32 is not offered
    assert [params["batch_size.batch_size"] for _, params in kept] == [16, 8, 16]
    with pytest.raises(ConfigError, match="none of its 4 configurations"):
        replay_configurations(tmp_path, SearchSpace(device="cpu", precisions=["fp32"], batch_sizes=[4],
                                                    base_batch_size=4))
