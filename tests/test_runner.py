"""A dying worker's reason names the error, not the last stack frame."""

from __future__ import annotations

from autotune.trial.process import exit_description, salient_error

# the end of a real worker log on the H200 after a device-side assert (torch 2.11): the error comes
# first, then an abort with a C++ stack trace
ABORT_LOG = """\
/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1553: indexSelectLargeIndex: block: [0,0,0] Assertion `srcIndex < srcSelectDimSize` failed.
terminate called after throwing an instance of 'c10::AcceleratorError'
  what():  CUDA error: device-side assert triggered
Exception raised from c10_cuda_check_implementation at /pytorch/c10/cuda/CUDAException.cpp:44
frame #26: PyRun_SimpleStringFlags + 0x3e (0x6b40de in /opt/torch/.venv/bin/python3)
frame #31: _start + 0x25 (0x657a05 in /opt/torch/.venv/bin/python3)
"""


def test_the_error_line_is_the_reason():
    assert salient_error(ABORT_LOG) == "CUDA error: device-side assert triggered"
    assert "Assertion `srcIndex < srcSelectDimSize` failed" in salient_error(ABORT_LOG.replace("  what():  CUDA error: device-side assert triggered\n", ""))
    reason = salient_error("loading\nRuntimeError: CUDA error: an illegal memory access was encountered\nframe #1")
    assert reason == "RuntimeError: CUDA error: an illegal memory access was encountered"


def test_without_an_error_line_the_end_of_the_log_is_kept():
    assert salient_error("step 1\nstep 2\n" + "x" * 900, limit=50) == "x" * 50


def test_signals_are_named():
    assert exit_description(-6) == "was killed by signal 6 (SIGABRT)"
    assert exit_description(11) == "exited with code 11"


# --- spare workers: a trial's worker started while the previous trial runs ----------------------

import os  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from autotune.trial import process, runner  # noqa: E402
from autotune.trial.gpus import pinned  # noqa: E402
from conftest import wait_ready  # noqa: E402

PROBE = {"mode": "probe", "device": "cpu",
         "workload": {"model": "fake_models:tiny_cnn", "num_classes": 4, "input_shape": [3, 16, 16]}}


@pytest.fixture
def no_spares_left(monkeypatch):
    """Spares on this CPU: its requests are otherwise forked from a fork server (tests/test_zygote.py),
    which AUTOTUNE_PRESTART=0 turns off while a caller may still ask for spares."""
    monkeypatch.setenv("AUTOTUNE_PRESTART", "0")
    yield
    runner.discard_spares()
    assert not runner._spares




@pytest.mark.slow
def test_a_spare_worker_imports_during_the_request_before_it_and_serves_the_next(tmp_path, no_spares_left):
    first = runner.run_worker(PROBE, timeout_s=120, log_path=tmp_path / "trial-0000.log", spare=True)
    assert first["status"] == "ok", first
    assert first["worker_start_s"] > 0.3  # a worker started with its request waits for its imports
    (spare,) = runner._spares.values()
    assert spare.proc.pid != first["pid"]
    assert spare.log_path.parent == tmp_path and spare.log_path.name.startswith(".spare-")
    wait_ready(spare)
    second = runner.run_worker(PROBE, timeout_s=120, log_path=tmp_path / "trial-0001.log")
    assert second["status"] == "ok", second
    # a fresh process, already imported: the request hardly waited for it
    assert second["pid"] == spare.proc.pid != first["pid"]
    assert second["worker_start_s"] < 0.3 and second["wall_s"] < first["wall_s"]
    assert not runner._spares  # taken, and no new spare asked for
    # its log was renamed to the trial's and nothing else is left in the folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trial-0000.log", "trial-0001.log"]


@pytest.mark.slow
def test_a_spare_serves_only_its_own_gpu_and_a_dead_one_is_replaced(tmp_path, no_spares_left):
    with pinned("0"):
        runner.run_worker(PROBE, timeout_s=120, spare=True)
    (key, spare), = runner._spares.items()
    assert dict(key)["CUDA_VISIBLE_DEVICES"] == "0"
    # what importing torch adds to this process's environment (its own defaults) does not matter
    assert runner._env_key(dict(process.worker_env(PROBE), TORCHINDUCTOR_CACHE_DIR="/tmp/x")) != key  # another pin
    with pinned("0"):
        assert runner._env_key(dict(process.worker_env(PROBE), TORCHINDUCTOR_CACHE_DIR="/tmp/x")) == key
    with pinned("1"):  # another GPU's thread starts its own worker
        other = runner.run_worker(PROBE, timeout_s=120)
    assert other["status"] == "ok" and other["pid"] != spare.proc.pid
    assert runner._spares == {key: spare}
    spare.proc.kill()  # a spare that dies while waiting (killed, out of memory) is not used
    spare.proc.wait()
    with pinned("0"):
        again = runner.run_worker(PROBE, timeout_s=120)
    assert again["status"] == "ok" and again["pid"] != spare.proc.pid
    assert not runner._spares


@pytest.mark.slow
def test_spares_nobody_takes_are_killed_and_their_files_removed(tmp_path, no_spares_left):
    runner.run_worker(PROBE, timeout_s=120, log_path=tmp_path / "trial-0000.log", spare=True)
    (spare,) = runner._spares.values()
    tmp = spare.tmp.name
    runner.discard_spares()
    assert spare.proc.poll() is not None and not runner._spares
    assert not os.path.exists(tmp) and sorted(p.name for p in tmp_path.iterdir()) == ["trial-0000.log"]


@pytest.mark.slow
def test_a_trial_log_is_readable_while_it_runs_and_complete_when_a_spare_cannot_be_renamed(tmp_path, monkeypatch,
                                                                                          no_spares_left):
    fresh = runner._Worker(process.worker_env(), log_path=tmp_path / "trial-0000.log")
    assert fresh.log_path == tmp_path / "trial-0000.log"  # written where the trial's log is, from the start
    fresh.discard()
    assert (tmp_path / "trial-0000.log").exists()  # a trial's log is kept, even when its run is cut
    runner.run_worker(PROBE, timeout_s=120, log_path=tmp_path / "trial-0001.log", spare=True)
    (spare,) = runner._spares.values()
    with open(spare.log_path, "a") as f:  # what the spare printed while it imported
        f.write("spare: imported\n")

    def cross_device(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(runner.os, "replace", cross_device)  # the trial logs on another file system
    result = runner.run_worker(PROBE, timeout_s=120, log_path=tmp_path / "trial-0002.log")
    assert result["status"] == "ok" and result["pid"] == spare.proc.pid
    assert "spare: imported" in (tmp_path / "trial-0002.log").read_text()  # copied when it was done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trial-0000.log", "trial-0001.log", "trial-0002.log"]


def test_a_worker_is_made_ready_for_its_model_and_device_before_the_request():
    trial = {"mode": "trial", "space": {"device": "cuda"}, "workload": {"model": "resnet18"}}
    assert process.preload(trial) == {process.PRELOAD_IMPORTS: "torchvision", process.PRELOAD_CUDA: "1"}
    custom = {"mode": "probe", "device": "cpu", "workload": {"model": "my_pkg.models:build"}}
    assert process.preload(custom) == {process.PRELOAD_IMPORTS: "my_pkg.models"}  # no CUDA context on a CPU
    # a model of a library by name: the worker preloads that library's model module (hub.preload)
    for hub in ("hf:gpt2", "timm:resnet18"):
        assert process.preload({"device": "cpu", "workload": {"model": hub}}) == {process.PRELOAD_IMPORTS: hub}
    # the CLI's probe, started before --device auto is resolved: a context where torch sees a GPU
    assert process.PRELOAD_CUDA in process.preload({"device": "auto", "workload": {"model": "resnet18"}})
    assert process.preload({"mode": "trial", "config_path": "config.json"}) == {}  # `autotune verify`
    # the search process's own environment never leaks one request's preparation into another's
    os.environ[process.PRELOAD_CUDA] = "1"
    try:
        assert process.PRELOAD_CUDA not in process.worker_env(custom)
    finally:
        del os.environ[process.PRELOAD_CUDA]
    # the model is part of which spare may serve a request
    assert runner._env_key(process.worker_env(custom)) != runner._env_key(process.worker_env(PROBE))


@pytest.mark.slow
def test_a_spare_imports_the_model_module_ahead_and_a_failing_one_is_reported_by_the_request(tmp_path,
                                                                                            no_spares_left):
    runner.run_worker(PROBE, timeout_s=120, spare=True)
    (spare,) = runner._spares.values()
    wait_ready(spare)
    result = runner.run_worker(PROBE, timeout_s=120)
    assert result["status"] == "ok" and result["pid"] == spare.proc.pid
    assert result["preloaded"] == ["fake_models"]  # on a CPU: no CUDA context, and torch._dynamo waits
    broken = dict(PROBE, workload=dict(PROBE["workload"], model="fake_models_missing:tiny_cnn"))
    result = runner.run_worker(broken, timeout_s=120)
    assert result["status"] == "error" and result["preloaded"] == []
    assert "cannot import module 'fake_models_missing'" in result["reason"]


@pytest.mark.slow
def test_a_worker_for_an_hf_model_has_its_transformers_modules_imported_before_the_request():
    """hf:gpt2's build spent 5.3 of its 7.7 s importing transformers' GPT-2 and attention modules (2
    cores), in every trial: the preload named the module "hf", which does not exist, and failed
    without a word. The worker now imports them before its request, as a spare or the fork server."""
    import subprocess
    import sys

    from conftest import subprocess_env

    env = {**subprocess_env(), process.PRELOAD_IMPORTS: "hf:gpt2"}
    code = ("import sys; from autotune.worker import serve as worker; "
            "print(worker.PRELOADED, 'transformers.models.gpt2.modeling_gpt2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["['hf:gpt2']", "True"], out.stderr[-2000:]


@pytest.mark.slow
def test_a_worker_for_a_model_of_its_own_has_imported_what_its_first_optimizer_needs():
    """torch.optim's first optimizer imports torch._dynamo (1-4 s). On the H200 the yield benchmark's
    MLP and LM (``module:factory`` models, whose modules import torch alone) spent 3.5-5.6 s a trial
    building their model and optimizer, against 0.2-0.4 s for ResNet-50, whose torchvision import
    brings torch._dynamo in ahead; a GPU worker now imports it before its request (the CUDA context
    is only made where torch sees a GPU, so on a CPU this checks the import alone)."""
    import subprocess
    import sys

    from conftest import subprocess_env

    env = {**subprocess_env(), process.PRELOAD_IMPORTS: "fake_models", process.PRELOAD_CUDA: "1"}
    code = ("import sys; from autotune.worker import serve as worker; print(worker.PRELOADED[:3], 'torch._dynamo' in sys.modules); "
            "import time, torch; t = time.perf_counter(); torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1); "
            "print(f'{time.perf_counter() - t:.3f}'); t = time.perf_counter(); torch.nn.Linear(2, 2).compile(); "
            "print(f'{time.perf_counter() - t:.3f}')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    preloaded, imported, first_optimizer_s, first_compile_call_s = out.stdout.rsplit(maxsplit=3)
    assert (preloaded, imported) == ("['fake_models', 'torch._dynamo', 'torch._inductor']", "True"), out.stderr[-2000:]
    assert float(first_optimizer_s) < 0.5  # nothing left to import (without the preload: 2.9-3.8 s on 2 cores)
    # torch.compile reads Inductor's config at the call (without the preload 2.3-3.7 s here; 2.8 s in a
    # compiled ResNet-50 trial's preparation on an H100)
    assert float(first_compile_call_s) < 0.5


@pytest.mark.slow
def test_the_live_line_hears_what_a_trial_worker_does(tmp_path, no_spares_left):
    """The worker's phases reach ``on_progress`` while it runs (the search's live line shows them)."""
    import optuna

    import strategies
    from autotune.space import SearchSpace
    from autotune.trial.measure import MeasureSettings

    space = SearchSpace(device="cpu")
    knobs = strategies.sample(optuna.trial.FixedTrial({}), space)
    request = {"mode": "trial", "space": space.to_dict(), "knobs": strategies.knobs_to_dict(knobs),
               "workload": PROBE["workload"], "seed": 0,
               "measure": MeasureSettings(min_warmup_steps=1, max_warmup_s=5, min_steps=3, min_time_s=1.0,
                                          max_steps=200, max_remeasure=0).to_dict()}
    heard: list[str] = []
    result = runner.run_worker(request, timeout_s=120, log_path=tmp_path / "trial.log", on_progress=heard.append)
    assert result["status"] == "ok", result.get("reason")
    assert heard and heard[0].split(",")[0] in ("starting", "building the model")
    assert any(words.startswith("warming up and measuring, ") for words in heard)
    # without a listener no progress file is asked for
    quiet = runner.run_worker(request, timeout_s=120, log_path=tmp_path / "quiet.log")
    assert quiet["status"] == "ok"


def test_progress_in_words():
    from autotune import progress

    assert progress.words(None) == "starting"
    assert progress.words({"phase": "FP32 reference", "done": 40, "total": 100, "since": 0}) == \
        "FP32 reference 40/100 steps"
    import time

    assert progress.words({"phase": "compiling", "since": time.time() - 35}) == "compiling, 35 s"


def test_cpu_requests_are_forked_and_gpu_ones_never(monkeypatch):
    monkeypatch.delenv("AUTOTUNE_PRESTART", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    trial = {"mode": "trial", "space": {"device": "cpu"}}
    assert runner.forks(PROBE) and runner.forks(trial)
    assert not runner.forks({**PROBE, "device": "cuda"}) and not runner.forks({"space": {"device": "cuda"}})
    assert not runner.forks({**PROBE, "device": "auto"})  # the CLI's early probe: a GPU may be there
    monkeypatch.setenv("AUTOTUNE_PRESTART", "0")  # every worker afresh
    assert not runner.forks(PROBE)
    monkeypatch.setenv("AUTOTUNE_PRESTART", "1")
    assert runner.forks(PROBE)
    monkeypatch.setattr(sys, "platform", "darwin")  # forking after torch's import is not safe there
    assert not runner.forks(PROBE)


def test_without_an_nvidia_driver_the_clis_early_probe_is_a_cpu_one(monkeypatch):
    """`--device auto` on a Linux machine without /dev/nvidiactl will search on the CPU: the worker
    started at the top of `autotune search` is then its fork server, not a spare for a GPU."""
    import argparse

    from autotune import cli

    started = []
    monkeypatch.delenv("AUTOTUNE_PRESTART", raising=False)
    monkeypatch.setattr(runner, "start_spare", lambda request, log_dir=None: started.append(request["device"]))
    monkeypatch.setattr(sys, "platform", "linux")
    args = argparse.Namespace(model="resnet18", device="auto", gpus=None)
    for driver, expected in ((False, "cpu"), (True, "auto")):
        monkeypatch.setattr(os.path, "exists", lambda path, driver=driver: driver if path == "/dev/nvidiactl" else False)
        cli._prestart_probe(args)
        assert started.pop() == expected
    cli._prestart_probe(argparse.Namespace(model="resnet18", device="cuda", gpus=None))
    assert started == ["cuda"]


def test_the_probe_and_the_accuracy_checks_leave_a_spare_for_the_next_trial(tmp_path, monkeypatch):
    """hf:gpt2 and hf:llama on the H200: the first trial waited 13 s for its worker (none was started
    during the probe), and each trial after an accuracy check 13-15 s (the check's worker had taken
    the spare started for it). A spare any of the three starts serves the next trial: their requests
    share a worker environment."""
    import optuna

    from autotune.accuracy.settings import AccuracySettings
    from autotune.accuracy.study.gate import AccuracyGate
    from autotune.accuracy.study.reference_cache import ReferenceCache
    from autotune.space import SearchSpace
    from autotune.cli import run as search_run
    from autotune.search.options import SearchConfig
    from autotune.workload.models import WorkloadSpec

    monkeypatch.delenv("AUTOTUNE_PRESTART", raising=False)  # GPU workers prestart by default
    workload = PROBE["workload"]
    space = SearchSpace(device="cuda", precisions=["fp32", "bf16"])
    trial = {"mode": "trial", "space": space.to_dict(), "workload": workload}
    accuracy = {"mode": "accuracy", "workload": workload, "space": space.to_dict()}
    probe = {**PROBE, "device": "cuda"}
    keys = {runner._env_key(process.worker_env(r)) for r in (trial, accuracy, probe)}
    assert len(keys) == 1

    asked: list[dict] = []

    def fake_worker(request, **options):
        asked.append({"mode": request["mode"], "spare": options.get("spare", False)})
        return {"status": "crashed", "reason": "stopped here"}

    monkeypatch.setattr(runner, "run_worker", fake_worker)
    for prestart in (True, False):
        gate = AccuracyGate(settings=AccuracySettings.for_device("cuda"), space=space, workload=workload,
                            timeout_s=60, cache=ReferenceCache(tmp_path), prestart=prestart)
        gate.attach(optuna.create_study())
        gate.evidence(optuna.create_study(), {"precision": {"mode": "bf16"}}, check=True)
    assert asked == [{"mode": "accuracy", "spare": True}, {"mode": "accuracy", "spare": False}]

    probed: list[bool] = []

    def fake_probe(config, device, list_devices=False, spare=False):
        probed.append(spare)
        raise KeyboardInterrupt  # stop the search here

    monkeypatch.setattr(search_run, "probe", fake_probe)
    monkeypatch.setattr(search_run, "resolve_device", lambda device: "cuda")  # no GPU here: none is used
    for options in ({}, {"prestart_workers": False}, {"gpus": "0,1"}):
        config = SearchConfig(workload=WorkloadSpec(model="fake_models:tiny_cnn"), device="cuda", trials=1,
                              out_dir=str(tmp_path / "out"), **options)
        with pytest.raises(KeyboardInterrupt):
            search_run.run_search(config)
    assert probed == [True, False, False]


def test_autotune_accuracy_starts_each_next_modes_worker_while_one_runs(monkeypatch):
    from autotune.accuracy.settings import AccuracySettings
    from autotune.accuracy.study.compare import compare_modes, mode_configurations
    from autotune.space import SearchSpace

    spares: list[bool] = []

    def fake_worker(request, **options):
        spares.append(options.get("spare", False))
        return {"status": "crashed", "reason": "stopped here"} if spares[1:] else {
            "status": "ok", "run": {"steps": 1, "final_loss": 1.0}, "reference": {"initial_loss": 2.0, "final_loss": 1.0}}

    monkeypatch.delenv("AUTOTUNE_PRESTART", raising=False)
    monkeypatch.setattr(runner, "run_worker", fake_worker)
    rows = compare_modes(workload=PROBE["workload"], space=SearchSpace(device="cuda", precisions=["fp32", "bf16", "fp8"]),
                         settings=AccuracySettings.for_device("cuda"), configurations=mode_configurations(["fp32", "bf16", "fp8"]))
    assert [r["mode"] for r in rows] == ["fp32", "bf16", "fp8"]
    assert spares == [True, True, False]  # none left waiting after the last
    monkeypatch.setenv("AUTOTUNE_PRESTART", "0")
    spares.clear()
    compare_modes(workload=PROBE["workload"], space=SearchSpace(device="cuda", precisions=["fp32", "bf16"]),
                  settings=AccuracySettings.for_device("cuda"), configurations=mode_configurations(["fp32", "bf16"]))
    assert spares == [False, False]


def test_the_worker_started_for_the_next_trial_is_kept_for_the_recommendations_check(monkeypatch):
    """The trials' loop ending on its own leaves the spare to the final accuracy check (on the H100 the
    1B Llama's took 10.4 s of its 31.5 s starting a fresh one); a Ctrl-C discards it at once."""
    from types import SimpleNamespace

    from autotune.cli import run

    discarded = []
    monkeypatch.setattr(run, "discard_spares", lambda: discarded.append(True))
    config = SimpleNamespace(trials=None, budget_s=None)
    monkeypatch.setattr(run, "_deadline", lambda config, started: None)

    class Study:
        def __init__(self, raises=None):
            self.raises = raises

        def optimize(self, *args, **kwargs):
            if self.raises:
                raise self.raises

    shared = SimpleNamespace(guard=lambda objective: objective)
    feeder = SimpleNamespace(feed=lambda study: None)  # nothing queued
    assert run._optimize(config, Study(), None, shared, None, [], 0.0, feeder) is None
    assert not discarded
    assert isinstance(run._optimize(config, Study(KeyboardInterrupt()), None, shared, None, [], 0.0, feeder),
                      KeyboardInterrupt)
    assert discarded == [True]
