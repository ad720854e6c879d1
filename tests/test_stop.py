"""A stop request is not lost when Python swallows its KeyboardInterrupt (seen in CI: SIGTERM
arrived during a weakref callback, "Exception ignored in ...", and the search ran to its end)."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import time
import weakref

import pytest

from autotune import stop
from autotune.trial import runner


@pytest.fixture
def handler():
    old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop.install()
    yield
    stop._requested = False
    signal.signal(signal.SIGTERM, old_term)
    signal.signal(signal.SIGINT, old_int)


def _swallowed_sigterm() -> None:
    """Deliver SIGTERM inside a weakref callback, where Python prints and drops the exception."""
    class Thing:
        pass

    thing = Thing()
    ref = weakref.ref(thing, lambda _ref: signal.raise_signal(signal.SIGTERM))
    del thing
    gc.collect()
    assert ref() is None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_swallowed_sigterm_still_ends_the_wait_for_a_worker(handler):
    _swallowed_sigterm()  # returns: the interrupt was dropped
    assert stop.requested()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner._wait(proc, 60)
    finally:
        proc.kill()
        proc.wait()
    assert time.monotonic() - started < 5


def test_without_a_request_the_wait_returns_or_times_out(handler):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    runner._wait(proc, 30)
    assert proc.returncode == 0
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            runner._wait(slow, 0.3)
    finally:
        slow.kill()
        slow.wait()


def test_install_forgets_an_earlier_request(handler):
    with pytest.raises(KeyboardInterrupt):
        stop.request()
    assert stop.requested()
    stop.install()
    assert not stop.requested()
    stop.check()  # nothing to raise


@pytest.mark.parametrize(("command", "said"), [
    ("search", "finished trials are kept in the study"),
    ("accuracy", "the configurations checked so far are printed above"),
    ("verify", "nothing was written"),
])
def test_an_interrupted_command_says_what_it_kept(cli_main, monkeypatch, command, said):
    """`autotune accuracy` stopped by a time limit on the H200 said "finished trials are kept in the
    study ... run the same command to resume", which only a search does."""
    from autotune import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, f"cmd_{command}", interrupted)
    argv = {"search": ["search", "--model", "resnet18"], "accuracy": ["accuracy", "--model", "resnet18"],
            "verify": ["verify", "runs/x"]}[command]
    result = cli_main(*argv)
    out = " ".join(result.stderr.split())  # the terminal console writes to stderr
    assert result.returncode == 130
    assert "interrupted:" in out and said in out
    assert ("resume" in out) is (command == "search")
