"""Start a worker process for one request, with a watchdog, and read back its result."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


# The worker is started through -c rather than -m: -m would put the current directory first on
# sys.path before any of our code runs, and a file there (torch.py, optuna.py) would replace the
# real module. The current directory goes last instead: a module the user names with --model
# still imports from it.
_BOOT = ("import os, sys; cwd = os.getcwd(); "
         "sys.path[:] = [p for p in sys.path if p not in ('', cwd)] + [cwd]; "
         "import runpy; runpy.run_module('autotune.worker', run_name='__main__', alter_sys=True)")


def _worker_env() -> dict[str, str]:
    # the worker must import what the study process imports (autotune, the user's model module)
    env = dict(os.environ)
    cwd = os.getcwd()
    paths = [p for p in sys.path if p and p != cwd] + [cwd]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("PYTHONUNBUFFERED", "1")
    from autotune.gpus import current_pin

    pin = current_pin()  # --gpus: this trial's GPU, and only it
    if pin is not None:
        env["CUDA_VISIBLE_DEVICES"] = pin
    return env


def worker_command(*args: str) -> list[str]:
    """The command line of a worker process (``args`` become its sys.argv[1:])."""
    return [sys.executable, "-c", _BOOT, *args]


def run_worker(request: dict[str, Any], *, timeout_s: float | None = None,
               log_path: Path | None = None) -> dict[str, Any]:
    """Run ``python -m autotune.worker`` on ``request``; always returns a result dict.

    status is "ok", "oom", "error" (an exception in the trial), "crashed" (the process died
    without a result: segfault, kill, sticky CUDA error) or "timeout" (the watchdog killed it).
    ``worker_start_s`` is the time from spawn until the worker had imported everything.
    A trial of a ``--ddp N`` search runs in N rank processes instead (``autotune.ddp.run_ranks``).
    """
    from autotune.ddp import request_world_size, run_ranks

    world_size = request_world_size(request)
    if world_size > 1:
        return run_ranks(request, world_size=world_size, timeout_s=timeout_s, log_path=log_path)
    with tempfile.TemporaryDirectory(prefix="autotune-") as tmp:
        result_path = Path(tmp) / "result.json"
        log = open(log_path, "w") if log_path else tempfile.TemporaryFile("w+", dir=tmp)
        spawned = time.time()
        proc = subprocess.Popen(worker_command(str(result_path), str(os.getpid())),
                                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                env=_worker_env(), text=True)
        try:
            proc.stdin.write(json.dumps(request))
            proc.stdin.close()
            proc.wait(timeout=timeout_s)
            status = None
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            status = "timeout"
        except BaseException:  # Ctrl-C in the study: do not leave the worker on the GPU
            proc.kill()
            proc.wait()
            raise
        finished = time.time()
        if log_path:
            log.close()
            text = log_path.read_text(errors="replace")[-50_000:]
        else:
            log.seek(0)
            text = log.read()[-50_000:]
            log.close()
        tail = text[-2000:]
        if status == "timeout":
            result = {"status": "timeout", "reason": f"no result after {timeout_s:.0f} s; the worker was killed"}
        elif result_path.exists():
            result = json.loads(result_path.read_text())
        else:
            result = {"status": "crashed",
                      "reason": f"worker {_exit_description(proc.returncode)} and no result: {salient_error(text)}"}
    result["wall_s"] = finished - spawned
    if "ready_at" in result:
        result["worker_start_s"] = result["ready_at"] - spawned
    result["log_tail"] = tail
    return result


# what a dying worker prints before its last words (a C++ stack trace after an abort, say), most
# telling first: the CUDA error itself, then a kernel's assertion, a Python exception, the abort
_ERROR_LINES = [re.compile(p, re.I) for p in (
    r"CUDA error: |device-side assert|illegal memory access|misaligned address",
    r"Assertion .* failed",
    r"\w+(Error|Exception): ",
    r"terminate called|Segmentation fault|Fatal Python error|out of memory|Killed",
)]


def salient_error(log_text: str, limit: int = 500) -> str:
    """The line of a worker's log that says what went wrong, else the end of the log: a crash's
    reason should read "CUDA error: device-side assert triggered", not a stack frame."""
    lines = log_text.splitlines()
    for pattern in _ERROR_LINES:
        for line in lines:
            if pattern.search(line):
                return line.strip().removeprefix("what():").strip()[:limit]
    return log_text.strip()[-limit:]


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
