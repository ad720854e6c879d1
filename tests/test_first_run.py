"""A newcomer's first hour: the README's commands on a fresh clone, a study from another machine
refused, one line per trial, and a whole search's failure explained."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from autotune.errors import ConfigError
from autotune.search.machine import MACHINE_ATTR, check_resume, same_machine
from autotune.search.outcome import explain
from autotune.trial.process import crash_reason
from autotune.search.options import DEFAULT_OUT
from conftest import ROOT, TINY_CPU_SEARCH, QuickTier, run_cli, subprocess_env

HERE = {"host": "here", "machine_id": "m-here", "gpu_uuid": "GPU-1111"}
THERE = {"host": "there", "machine_id": "m-there", "gpu_uuid": "GPU-2222"}


# --- which machine a study belongs to ------------------------------------------------------------

def test_one_machine_is_the_same_gpu_or_the_same_host():
    assert same_machine(HERE, dict(HERE))
    assert same_machine(HERE, {**THERE, "gpu_uuid": "GPU-1111"})  # a container's new host name, same GPU
    assert same_machine(HERE, {**THERE, "host": "here"})  # --gpus 1 on the same host: another GPU
    assert same_machine({"host": "cpu-box", "machine_id": None}, {"host": "cpu-box", "machine_id": None})
    assert not same_machine(HERE, THERE)
    assert not same_machine({"host": None, "machine_id": None}, {"host": None, "machine_id": None})


def _study_from(machine: dict | None) -> optuna.Study:
    study = optuna.create_study(study_name="resnet50-h200")
    study.set_user_attr("space", {"device": "cuda"})
    if machine is not None:
        study.set_user_attr(MACHINE_ATTR, machine)
    return study


def test_a_study_from_another_machine_is_refused_with_the_two_ways_on():
    with pytest.raises(ConfigError) as refused:
        check_resume(_study_from(THERE), HERE, where="reports/resnet50-h200/study.db", resume=False)
    said = str(refused.value)
    assert "host there" in said and "host here" in said and "reports/resnet50-h200/study.db" in said
    assert "--resume" in said and "fresh --out" in said
    check_resume(_study_from(THERE), HERE, where="x", resume=True)  # asked for: allowed
    check_resume(_study_from(HERE), HERE, where="x", resume=False)  # its own machine: resumed as before
    check_resume(optuna.create_study(), HERE, where="x", resume=False)  # a new study: nothing to refuse


def test_a_study_written_before_machines_were_recorded_is_refused_too():
    with pytest.raises(ConfigError, match="written before autotune recorded machines"):
        check_resume(_study_from(None), HERE, where="x", resume=False)


def test_the_default_output_is_ignored_by_git_and_holds_nothing_committed():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert DEFAULT_OUT == Path("runs")
    ignored = subprocess.run(["git", "check-ignore", "-q", "runs/resnet50-cpu/study.db"], cwd=ROOT)
    assert ignored.returncode == 0
    tracked = subprocess.run(["git", "ls-files", "runs"], cwd=ROOT, capture_output=True, text=True).stdout
    assert tracked == ""


# --- a dead worker's reason in one line ------------------------------------------------------------

FAULT_LOG = """\
Fatal Python error: Segmentation fault

Thread 0x00007f04140286c0 (most recent call first):
  File "/work/autotune/orphan.py", line 22 in watch
  File "{lib}/threading.py", line 982 in run

Current thread 0x00007f0414e8fb80 (most recent call first):
  File "{lib}/ctypes/__init__.py", line 519 in string_at
  File "/home/me/project/model.py", line 8 in forward
  File "{lib}/site-packages/torch/nn/modules/module.py", line 1794 in _call_impl
"""


def test_a_segfault_names_the_users_frame():
    import sysconfig

    log = FAULT_LOG.format(lib=sysconfig.get_paths()["stdlib"])
    assert crash_reason(-11, log) == ("worker was killed by signal 11 (SIGSEGV) with no result: "
                                      "Fatal Python error: Segmentation fault, in forward at model.py:8")


def test_an_empty_log_is_said_not_left_as_an_empty_colon():
    assert crash_reason(9, "") == "worker exited with code 9 with no result and an empty log"


# --- a whole search's outcome ------------------------------------------------------------------------

def _trial(number_role: str, status: str, *, mode: str = "fp16", batch: int = 256, unstable: bool = False,
           reason: str | None = None):
    attrs = {"status": status, "knobs": {"precision": {"mode": mode}, "batch_size": {"batch_size": batch}}}
    if number_role != "search":
        attrs["role"] = number_role
    if unstable:
        attrs["unstable"] = True
    if reason:
        attrs["reason"] = reason
    if status == "ok":
        return create_trial(state=TrialState.COMPLETE, value=100.0, user_attrs=attrs)
    if status == "oom":
        return create_trial(state=TrialState.PRUNED, user_attrs=attrs)
    return create_trial(state=TrialState.FAIL, user_attrs=attrs)


def _study(*trials) -> optuna.Study:
    study = optuna.create_study(direction="maximize")
    for t in trials:
        study.add_trial(t)
    return study


def test_every_configuration_unstable_with_the_baseline_points_at_the_model():
    study = _study(_trial("baseline", "ok", mode="fp32", unstable=True), _trial("search", "ok", unstable=True))
    [line] = explain(study)
    assert "every configuration measured (2 of 2 trials) gave a non-finite loss" in line
    assert "the FP32 baseline (#0) too: the model itself produces NaN" in line


def test_unstable_only_in_low_precision_points_at_precision():
    study = _study(_trial("search", "ok", unstable=True), _trial("search", "ok", mode="bf16", unstable=True))
    [line] = explain(study)
    assert "FP32 was not among them" in line and "--precisions fp32,tf32" in line


def test_nothing_fits_names_the_smallest_batch_and_the_option_that_goes_lower():
    study = _study(_trial("baseline", "oom", batch=256), _trial("search", "oom", batch=64),
                   _trial("search", "oom", batch=128))
    [line] = explain(study, min_batch_size=64)
    assert line == "nothing fits: all 3 trials ran out of memory; the smallest batch tried was 64; " \
                   "--min-batch-size 32 goes lower"
    [line] = explain(study, min_batch_size=16)
    assert "had not reached --min-batch-size 16 yet" in line


def test_every_trial_crashed_gives_their_common_reason():
    segv = "worker was killed by signal 11 (SIGSEGV) with no result: Fatal Python error: Segmentation fault"
    study = _study(_trial("baseline", "crashed", reason=segv), _trial("search", "crashed", reason=segv),
                   _trial("search", "timeout", reason="no result after 600 s; the worker was killed"))
    [line] = explain(study)
    assert line == f"every trial failed (3 of 3); the common reason (2 of them): {segv}"


def test_a_mix_is_counted_with_the_failures_reason():
    study = _study(_trial("baseline", "oom"), _trial("search", "error", reason="ValueError: bad shape"))
    lines = explain(study)
    assert lines == ["none of the 2 trials can be recommended: 1 ran out of memory, 1 failed",
                     "the failures' common reason (1 of 1): ValueError: bad shape"]


def test_no_trial_measured_says_to_give_more_budget():
    assert "give a longer --budget" in explain(_study())[0]


# --- whole searches on the CPU, as a user sees them ---------------------------------------------------

TINY = ["--device", "cpu", "--input-shape", "3x32x32", "--num-classes", "10", "--no-accuracy-check"]


@pytest.mark.slow
def test_a_model_that_segfaults_gets_one_line_per_trial_and_the_common_reason(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("search", "--model", "fake_models:segfaults", *TINY, "--trials", "2", "--out", str(out),
                   check=False)
    said = " ".join(proc.stderr.split())  # rich wraps long lines
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "failed with parameters" not in proc.stderr
    assert "Fatal Python error: Segmentation fault, in forward at fake_models.py" in said
    # the probe's forward pass met the crash first: it was probed again without it, in one line
    assert "warning: the model's forward pass killed the probe (worker was killed by signal 11" in said
    assert f"(log:{out / 'logs' / 'trial-0000.log'})" in "".join(said.split())  # rich may break a long path
    assert "every trial failed (2 of 2); the common reason (2 of them): worker was killed by signal 11" in said
    run_log = (out / "logs" / "search.log").read_text()
    assert "Trial 0 failed with parameters" in run_log and "Traceback" in run_log
    assert "Current thread" in (out / "logs" / "trial-0000.log").read_text()  # faulthandler's dump


@pytest.mark.slow
def test_a_model_whose_loss_is_nan_everywhere_is_named_as_the_cause(tmp_path):
    proc = run_cli("search", "--model", "fake_models:nan_loss", *TINY, "--trials", "2",
                   "--out", str(tmp_path / "out"), check=False)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 1, proc.stderr
    assert "loss not finite (unstable: never recommended)" in said
    assert "the FP32 baseline (#0) too: the model itself produces NaN" in said


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.mark.slow
def test_the_readme_main_command_on_a_fresh_clone(tmp_path):
    """Clone with the committed reports, run the README's main command's shape from the clone's
    root as a new user would (small model, short budget): exit 0, and the clone stays clean. The
    committed CPU example, given as --out, is refused and left as it was."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs git and a git checkout to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    example = clone / "reports" / "resnet50-cpu" / "study.db"
    before = _digest(example)
    command = [shutil.which("autotune")] if shutil.which("autotune") else [sys.executable, "-m", "autotune"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([*command, "search", "--model", "resnet18", "--input-shape", "3x32x32", "--num-classes",
                          "10", "--budget", "30s", "--accuracy-steps", "20"], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-6000:]
    assert (clone / "runs" / "resnet18-cpu" / "config.json").is_file()
    assert "speed-up over the FP32 baseline" in run.stderr
    assert _git("status", "--porcelain", cwd=clone) == ""

    refused = subprocess.run([*command, "search", "--model", "resnet50", "--out", "reports/resnet50-cpu",
                              "--trials", "1"], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2, refused.stderr[-4000:]
    assert "not on this machine" in said and "--resume" in said and "fresh --out" in said
    assert _digest(example) == before
    assert _git("status", "--porcelain", cwd=clone) == ""


@pytest.mark.slow
def test_another_machines_study_resumes_only_with_resume(tiny_cpu_search, tmp_path):
    # the session's finished 3-trial search, copied: this test writes to its study
    out = tmp_path / "out"
    shutil.copytree(tiny_cpu_search[0], out)
    search = [*TINY_CPU_SEARCH, "--out", str(out)]
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    assert study.user_attrs[MACHINE_ATTR]["host"] == os.uname().nodename
    assert _completed(out) == 3
    study.set_user_attr(MACHINE_ATTR, THERE)  # as if the folder had been copied from another machine
    refused = run_cli(*search, "--trials", "4", check=False)
    assert refused.returncode == 2 and "--resume" in " ".join(refused.stderr.split())
    assert _completed(out) == 3  # nothing was added
    run_cli(*search, "--trials", "4", "--resume")
    assert _completed(out) == 4


def _completed(out: Path) -> int:
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    return len(study.get_trials(states=(TrialState.COMPLETE,)))


QUICK_TIER_LIMIT_S = 210.0
"""The README's quick check, `python3 -m pytest -q -m "not slow"`, on a 2-core machine. Run alone it took
140-160 s on 2026-12-07 (the same machine, three runs); summed inside a whole-suite run the same
tests take 1.16-1.26x that (CI's slower machine, and the slow tier's processes around them: 184 s here
and 201 s on CI where 159 s alone), so the limit leaves that room and still catches a search moved
into the quick tier."""


@pytest.mark.slow
def test_the_quick_tier_passes_within_three_minutes():
    """A test that starts searches or workers belongs in the slow tier: this keeps the quick one
    quick (about 90 s on 2 cores when it was made, 50 s here on 2026-12-02). In a session of the
    whole suite (CI's) it sums what the quick tests took there, collection included, rather than
    running them a second time; run alone, it runs the quick tier."""
    import time

    if QuickTier.whole_suite and QuickTier.items and QuickTier.finished == QuickTier.items:
        assert not QuickTier.failed, QuickTier.failed
        elapsed = QuickTier.collect_s + QuickTier.seconds
        said = f"{len(QuickTier.items)} quick tests in {QuickTier.seconds:.0f} s after {QuickTier.collect_s:.0f} s of collection"
    else:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider"],
                              cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                              timeout=QUICK_TIER_LIMIT_S + 120)
        elapsed = time.monotonic() - started
        assert proc.returncode == 0, proc.stdout[-4000:]
        said = proc.stdout[-2000:]
    assert elapsed < QUICK_TIER_LIMIT_S, f"the quick tier took {elapsed:.0f} s:\n{said}"
