"""The study process's side of a ``--ddp N`` trial: start N rank processes
(``autotune.trial.ddp_rank``, whose docstring says how a rank measures), watch them, and read back
the trial, killing the group when one rank fails or the trial times out."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from autotune import stop

_BOOT = ("import os, sys; cwd = os.getcwd(); "
         "sys.path[:] = [p for p in sys.path if p not in ('', cwd)] + [cwd]; "
         "import runpy; runpy.run_module('autotune.trial.ddp_rank', run_name='__main__', alter_sys=True)")



_PEER_FAILURE = re.compile(r"DistBackendError|Connection closed by peer|Connection reset by peer|ProcessGroup"
                           r"|gloo|NCCL error|NCCL communicator|watchdog|Timed out|Broken pipe", re.I)
"""A rank's error that only says a peer went away: a rank's failure makes its peers fail in their
next collective, so such an error explains nothing when another rank failed by itself."""



def _blame(status: str, reason: str) -> int:
    """How well a failed rank's outcome explains the trial's failure, best (lowest) first: out of
    memory, died by itself, raised, and last an error that only reports a peer gone."""
    if status == "oom":
        return 0
    if status == "crashed":
        return 1
    return 3 if _PEER_FAILURE.search(reason or "") else 2




def request_world_size(request: dict[str, Any]) -> int:
    """The DDP world size a trial request asks for (1: a plain single-process trial)."""
    if request.get("mode", "trial") != "trial":
        return 1
    knobs = request.get("knobs")
    if knobs is None and request.get("config_path"):  # `autotune verify` of an exported config
        try:
            knobs = json.loads(Path(request["config_path"]).read_text()).get("knobs")
        except (OSError, ValueError):
            return 1  # the worker reports the unreadable file
    return int(((knobs or {}).get("ddp") or {}).get("world_size", 1))



def free_port() -> int:
    """A TCP port free on this host right now, for the group's rendezvous (MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def rank_command(result_path: Path, request_path: Path) -> list[str]:
    from autotune.trial.process import PYTHON_FLAGS

    return [sys.executable, *PYTHON_FLAGS, "-c", _BOOT, str(result_path), str(os.getpid()), str(request_path)]



def run_ranks(request: dict[str, Any], *, world_size: int, timeout_s: float | None = None,
              log_path: Path | None = None) -> dict[str, Any]:
    """Run one trial in ``world_size`` rank processes; returns a result like ``run_worker``'s.

    status is rank 0's ("ok", with the gathered figures) when every rank finished, else the
    failing rank's ("oom", "error", or "crashed" for a rank that died without a result), or
    "timeout" when the group was still running at ``timeout_s``; the other ranks are killed.
    """
    from autotune.trial.process import (
        crash_reason,
        exit_description,
        salient_error,
        worker_env,
    )

    with tempfile.TemporaryDirectory(prefix="autotune-ddp-") as tmp_name:
        tmp = Path(tmp_name)
        request_path = tmp / "request.json"
        request_path.write_text(json.dumps(request))
        results = [tmp / f"result-{rank}.json" for rank in range(world_size)]
        logs = [tmp / f"rank-{rank}.log" for rank in range(world_size)]
        env = worker_env()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size))
        # as torchrun does for several processes per node (unless the user set it): what the
        # exported config's training run will see; a CPU search's threads knob sets its own count
        env.setdefault("OMP_NUM_THREADS", "1")
        spawned = time.time()
        procs: list[subprocess.Popen] = []
        killed: set[int] = set()
        try:
            for rank in range(world_size):
                with open(logs[rank], "w") as log:
                    procs.append(subprocess.Popen(rank_command(results[rank], request_path), stdin=subprocess.DEVNULL,
                                                  stdout=log, stderr=subprocess.STDOUT, text=True,
                                                  env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
            outcome = _wait(procs, results, None if timeout_s is None else spawned + timeout_s)
        finally:  # a failed or hung group, or Ctrl-C in the study: no rank stays on its GPU
            for rank, proc in enumerate(procs):
                if proc.poll() is None:
                    proc.kill()
                    killed.add(rank)
            for proc in procs:
                proc.wait()
        finished = time.time()
        texts = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
        joined = "".join(f"==== rank {rank} ====\n{text}\n" for rank, text in enumerate(texts))
        if log_path:
            Path(log_path).write_text(joined)
        read = [_read(path) for path in results]
        if outcome == "timeout":
            result = {"status": "timeout",
                      "reason": f"no result from all {world_size} DDP ranks after {timeout_s:.0f} s; the ranks were killed"}
        elif outcome == "done":
            result = read[0] if read[0] is not None else {"status": "crashed", "reason": "rank 0 wrote no result"}
        else:
            failed = []
            for rank, proc in enumerate(procs):
                got = read[rank]
                if got is not None and got.get("status") not in (None, "ok"):
                    failed.append((_blame(got["status"], got.get("reason", "")), rank, got))
                elif got is None and rank not in killed:  # died by itself, without a word
                    failed.append((1, rank, {"status": "crashed", "reason": crash_reason(proc.returncode, texts[rank])}))
            if not failed:  # the rank that ended the wait left an "ok" result, yet exited with an error
                failed.append((1, outcome, {"status": "crashed", "reason": (
                    f"worker {exit_description(procs[outcome].returncode)}: {salient_error(texts[outcome])}")}))
            _, rank, got = min(failed, key=lambda f: (f[0], f[1]))
            result = dict(got)
            result["reason"] = f"DDP rank {rank} of {world_size}: {got.get('reason', '')}"
            result["failed_rank"] = rank
    result["wall_s"] = finished - spawned
    ready = [r["ready_at"] for r in read if r and "ready_at" in r]
    if ready:
        result["worker_start_s"] = max(ready) - spawned
    result["log_tail"] = joined[-2000:]
    return result



def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None



def _wait(procs: list[subprocess.Popen], results: list[Path], deadline: float | None) -> str | int:
    """Until every rank is done ("done"), one fails (its rank number) or the deadline ("timeout").
    A rank fails when it exits with an error code, without a result, or with a result that is
    not "ok": its peers would otherwise wait for it in a collective until their own timeout."""
    while True:
        stop.check()
        running = False
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code is None:
                running = True
                continue
            got = _read(results[rank])
            if code != 0 or got is None or got.get("status") != "ok":
                time.sleep(0.2)  # a peer failing at the same moment may still be writing its reason
                return rank
        if not running:
            return "done"
        if deadline is not None and time.time() > deadline:
            return "timeout"
        time.sleep(0.05)
