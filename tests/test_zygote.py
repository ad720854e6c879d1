"""CPU workers forked from a fork server (autotune.worker.zygote): each request still gets a
process of its own, with none of an earlier worker's state, in milliseconds instead of a fresh
interpreter's imports; a crash, a hang or the server's own death is one result, and the next
request is served."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from autotune.trial import runner
from conftest import ROOT, subprocess_env

pytestmark = pytest.mark.slow  # they start worker processes


def probe(model: str) -> dict:
    return {"mode": "probe", "device": "cpu",
            "workload": {"model": f"fake_models:{model}", "num_classes": 4, "input_shape": [3, 16, 16]}}


@pytest.fixture
def servers():
    runner.discard_spares()
    yield runner._zygotes
    runner.discard_spares()
    assert not runner._zygotes and not runner._spares


def test_each_request_gets_a_fresh_forked_worker_with_none_of_the_last_ones_state(tmp_path, monkeypatch, servers):
    marker = tmp_path / "builds"
    monkeypatch.setenv("AUTOTUNE_TEST_MARKER", str(marker))
    results = [runner.run_worker(probe("leaves_state"), timeout_s=120, log_path=tmp_path / f"trial-{i}.log")
               for i in range(3)]
    assert [r["status"] for r in results] == ["ok"] * 3, results
    (server,) = servers.values()
    pids = [r["pid"] for r in results]
    assert len(set(pids)) == 3 and server.proc.pid not in pids
    assert all(r["preloaded"] == ["fake_models"] for r in results)  # imported once, in the server
    # each build found what the server imported: no earlier build counted, threads as they were
    found = [line.split() for line in marker.read_text().splitlines()]
    assert [int(pid) for pid, _, _ in found] == pids
    assert [builds for _, builds, _ in found] == ["0", "0", "0"]
    assert len({threads for _, _, threads in found}) == 1
    # the server's imports were the first request's wait; the next ones wait for a fork
    assert all(r["worker_start_s"] < 0.5 for r in results[1:]), [r["worker_start_s"] for r in results]
    assert all((tmp_path / f"trial-{i}.log").exists() for i in range(3))
    # the request's own environment reaches a forked worker, not the one the server started with
    monkeypatch.setenv("AUTOTUNE_TEST_MARKER", str(tmp_path / "later"))
    assert runner.run_worker(probe("leaves_state"), timeout_s=120)["status"] == "ok"
    assert (tmp_path / "later").read_text().split()[1] == "0"
    assert list(servers.values()) == [server]


def test_a_crash_and_a_hang_are_each_one_result_and_the_server_serves_on(tmp_path, servers):
    crashed = runner.run_worker(probe("segfaults"), timeout_s=120, log_path=tmp_path / "crash.log")
    assert crashed["status"] == "crashed"
    assert "killed by signal 11 (SIGSEGV)" in crashed["reason"] and "fake_models.py" in crashed["reason"]
    assert "Segmentation fault" in (tmp_path / "crash.log").read_text()  # faulthandler's dump, in its own log
    started = time.monotonic()
    hung = runner.run_worker(probe("hangs"), timeout_s=3, log_path=tmp_path / "hang.log")
    assert hung["status"] == "timeout" and time.monotonic() - started < 15
    (server,) = servers.values()
    assert server.alive()
    ok = runner.run_worker(probe("tiny_cnn"), timeout_s=120)
    assert ok["status"] == "ok" and list(servers.values()) == [server]


def test_a_server_that_dies_ends_its_running_worker_and_is_replaced(tmp_path, servers):
    assert runner.run_worker(probe("tiny_cnn"), timeout_s=120)["status"] == "ok"
    (server,) = servers.values()
    threading.Timer(1.0, server.proc.kill).start()
    started = time.monotonic()
    lost = runner.run_worker(probe("hangs"), timeout_s=60, log_path=tmp_path / "lost.log")
    assert lost["status"] == "crashed" and "fork server of this worker was killed by signal 9" in lost["reason"]
    assert time.monotonic() - started < 15
    again = runner.run_worker(probe("tiny_cnn"), timeout_s=120)
    assert again["status"] == "ok" and list(servers.values()) != [server]


def test_a_killed_study_takes_its_server_and_workers_with_it(tmp_path):
    """The study process dies (kill -9) while a forked worker runs: neither is left behind."""
    script = textwrap.dedent(f"""
        import sys, threading
        sys.path[:0] = [{str(ROOT / 'tests')!r}, {str(ROOT)!r}]
        from autotune.trial import runner
        request = {probe('hangs')!r}
        threading.Timer(5, lambda: (print(*[z.proc.pid for z in runner._zygotes.values()], flush=True))).start()
        runner.run_worker(request, timeout_s=600)
    """)
    study = subprocess.Popen([sys.executable, "-c", script], env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    server = int(study.stdout.readline())
    children = _children(server)
    assert children, "the hung worker was never forked"
    study.kill()
    study.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in [server, *children]):
        time.sleep(0.2)
    assert not any(_alive(p) for p in [server, *children])


def _children(pid: int) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                found = [int(c) for c in f.read().split()]
        except OSError:
            found = []
        if found:
            return found
        time.sleep(0.2)
    return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False
