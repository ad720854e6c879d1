import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


QUICK_TIER_CHECK = "test_the_quick_tier_passes_within_three_minutes"


class QuickTier:
    """What the quick tier (`-m "not slow"`) cost inside this session: when a session runs the whole
    suite (as CI does), the quick tier's check reads these instead of running the tier again."""

    started = 0.0
    collect_s = 0.0
    whole_suite = False
    items: set[str] = set()
    seconds = 0.0
    finished: set[str] = set()
    failed: list[str] = []


def pytest_sessionstart(session):
    QuickTier.started = time.monotonic()


def pytest_collection_modifyitems(config, items):
    # the quick tier's check goes last, after every quick test it sums
    items.sort(key=lambda item: item.name == QUICK_TIER_CHECK)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    QuickTier.collect_s = time.monotonic() - QuickTier.started
    opt = session.config.option
    QuickTier.whole_suite = (not opt.keyword and not opt.markexpr and not getattr(opt, "deselect", None)
                             and [Path(a).resolve() for a in session.config.args] == [TESTS])
    QuickTier.items = {item.nodeid for item in session.items if "slow" not in item.keywords}


def pytest_runtest_logreport(report):
    if report.nodeid in QuickTier.items:
        QuickTier.seconds += report.duration
        if report.failed:
            QuickTier.failed.append(report.nodeid)
        if report.when == "teardown":
            QuickTier.finished.add(report.nodeid)


@pytest.fixture(scope="session", autouse=True)
def accuracy_cache_dir(tmp_path_factory):
    """autotune's caches (autotune.cache: compiled graphs, the accuracy check's FP32 references) are a
    folder of this test session, never the user's ~/.cache: searches run here, and their workers,
    inherit it."""
    from autotune.cache import CACHE_ENV

    from autotune.search.warm import FRESH_ENV

    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("autotune-cache"))
    # each test's search starts from nothing, whatever searches of the same model ran before it in
    # this session; tests of the warm start unset it (tests/test_warm_start.py)
    os.environ[FRESH_ENV] = "1"
    yield Path(os.environ[CACHE_ENV])
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before


def measured(study, space, params, value, **attrs):
    """A trial that ran, without a worker: queued with the user attributes ``attrs``, claimed, its
    ``params`` suggested as a trial's are (strategies.sample, from ``space``) and told its scripted
    ``value``. The frozen trial."""
    import strategies

    study.enqueue_trial(params, user_attrs=attrs)
    trial = study.ask()
    strategies.sample(trial, space)
    study.tell(trial, value)
    return study.trials[trial.number]


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python: tests/ (fake_models) and the checkout first on
    PYTHONPATH, and the caller's own PYTHONPATH kept (on the GPU machine it holds the carried wheels)."""
    path = [str(TESTS), str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), **extra)


def newly_in_worker(trials, seen: set[int]) -> list:
    """The RUNNING trials that have chosen all their parameters (the objective records its knobs
    then, just before it starts the trial's worker) and that this poll is the first to see so: a
    signal sent now lands while they are in their worker, for tests whose trials measure for longer
    than a poll takes. ``seen`` holds the trials earlier polls saw, and is updated.

    Timing from the trial's start instead missed every trial on a busy CI machine: the time
    between the start and the knobs (sampling, the search's bookkeeping) grew past the window."""
    import optuna

    running = [t for t in trials if t.state == optuna.trial.TrialState.RUNNING and "knobs" in t.user_attrs]
    new = first_seen([t.number for t in running], seen)
    return [t for t in running if t.number in new]


def first_seen(numbers: list[int], seen: set[int]) -> list[int]:
    """Of the trial ``numbers`` in their worker at this poll, those no earlier poll saw (``seen``, updated)."""
    new = [n for n in numbers if n not in seen]
    seen.update(numbers)
    return new


def workers_answer_ok(monkeypatch, asked=lambda request: None) -> None:
    """Every trial worker of autotune.search.objective answers a 5 s eager measurement of 100 samples/s;
    ``asked(request)`` first."""

    def fake_worker(request, *, timeout_s, log_path, spare=False, on_progress=None):
        asked(request)
        figures = {"samples_per_s": 100.0, "step_time_ms": 80.0, "peak_memory_bytes": 1, "warmup_s": 1.0,
                   "measure_s": 2.0, "build_s": 0.5, "compile_s": 0.0, "loss_finite": True}
        return {"status": "ok", "figures": figures, "wall_s": 5.0, "worker_start_s": 1.0}

    monkeypatch.setattr("autotune.search.objective.run_worker", fake_worker)


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run `python -m autotune ...` as a user would, with tests/ importable for fake_models."""
    proc = subprocess.run([sys.executable, "-m", "autotune", *args], cwd=cwd or ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"autotune {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


TINY_CPU_SEARCH = ["search", "--model", "fake_models:tiny_cnn", "--device", "cpu", "--input-shape", "3x32x32",
                   "--num-classes", "10", "--min-measure-time", "0.3", "--early-stop-below", "0",
                   "--no-accuracy-check"]
"""A whole CPU search of the tiny CNN, every trial measured in full, no accuracy check: about half a
minute at 3 trials. The session runs it once (``tiny_cpu_search``) for every test that needs a finished
search, rather than one search per test."""


@pytest.fixture(scope="session")
def tiny_cpu_search(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The output folder of one finished 3-trial ``TINY_CPU_SEARCH`` run as a user runs it, and that
    run's CompletedProcess. Shared by several modules: a test may read the folder, never write to it
    (one that resumes the study works on a copy)."""
    out = tmp_path_factory.mktemp("tiny-cpu-search") / "out"
    return out, run_cli(*TINY_CPU_SEARCH, "--trials", "3", "--out", str(out))


@pytest.fixture
def restore_backend_flags():
    """Code under test sets process-global switches (``prepare`` does, for good, as a user wants);
    the recipe's own scope puts every one of them back afterwards."""
    from autotune.recipe import BACKEND_FLAGS, backend_flags

    with backend_flags({name: get() for name, (get, _) in BACKEND_FLAGS.items()}):
        yield


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def cli_main(capsys, monkeypatch):
    """`autotune ARGS` run in this process, for checks of what the CLI says and returns without a
    new interpreter and its imports (seconds each on 2 cores): a function of the arguments that
    returns a subprocess.CompletedProcess. What the CLI installs (signal handlers, the warnings'
    display) is put back afterwards; a search's workers are still processes of their own."""
    import signal
    import warnings

    from autotune import cli as cli_module
    from autotune.trial import runner

    # no probe worker started ahead: most of these end at the checks, before any probe
    monkeypatch.setattr(cli_module, "_prestart_probe", lambda args: None)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = cli_module.main(list(args))
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
        finally:
            for s, handler in handlers.items():
                signal.signal(s, handler)
        said = capsys.readouterr()
        return subprocess.CompletedProcess(["autotune", *args], code, said.out, said.err)

    yield run
    runner.discard_spares()


def assert_attends_as_nanogpt(model, model_type: str, overrides: dict, monkeypatch) -> None:
    """``model``, a one-layer hf: causal LM, calls SDPA as nanoGPT does: once, with is_causal=True and
    no mask tensor (which SDPA's flash kernel refuses, and transformers' own "sdpa" builds while
    torch.compile traces), and computes the logits transformers' "sdpa" computes with its weights."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from autotune.workload.hub import hf_config

    calls, real = [], F.scaled_dot_product_attention

    def seen(*a, **kw):
        calls.append((kw.get("attn_mask", a[3] if len(a) > 3 else None), kw.get("is_causal")))
        return real(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", seen)
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    ours = model.eval()(input_ids=x).logits
    assert calls == [(None, True)]  # one layer: one call, causal by the flag, no mask
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)
    theirs = AutoModelForCausalLM.from_config(hf_config(model_type, dict(overrides)), attn_implementation="sdpa").eval()
    theirs.load_state_dict(model.state_dict())
    assert torch.allclose(ours, theirs(input_ids=x).logits, atol=1e-5)


def wait_ready(worker, timeout_s: float = 60) -> None:
    """Until the spare has imported everything and waits for its request: asleep in its read of
    stdin (the kernel names the wait pipe_read, anon_pipe_read...) or, where /proc does not say,
    asleep with its CPU time unchanged for a second."""
    deadline = time.time() + timeout_s
    last = None
    while time.time() < deadline:
        with open(f"/proc/{worker.proc.pid}/wchan") as f:
            if "pipe" in f.read():
                return
        with open(f"/proc/{worker.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        state, cpu = fields[0], int(fields[11]) + int(fields[12])
        if state == "S" and cpu == last:
            return
        last = cpu
        time.sleep(1.0)
    raise AssertionError("the spare worker never got ready")


@pytest.fixture
def no_op_cuda_graphs(monkeypatch):
    """CUDA's stream and graph objects as no-ops, so that a TrainStep's whole-step graph path (its
    warm-up on a side stream, then the capture) runs its Python on a CPU."""
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **kw: contextlib.nullcontext())


def assert_compiles_as_eager(framework, swapped, x, loss, rtol: float, atol: float) -> None:
    """A knob's swapped layers (``swapped``, loaded with ``framework``'s state) trace in one graph with no
    break, and ``loss(swapped, x)`` compiled gives ``loss(framework, x)``'s eager parameter gradients."""
    explained = torch._dynamo.explain(loss)(swapped, x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    loss(framework, x).backward()
    torch.compile(loss)(swapped, x).backward()
    for a, b in zip(framework.parameters(), swapped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=rtol, atol=atol)
