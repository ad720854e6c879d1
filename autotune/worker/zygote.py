"""The fork server of trial workers on a CPU: one process imports torch, autotune and the model's
module once, then forks a fresh worker for each request.

On a CPU, a spare worker started ahead would import on the cores the trial before it is measured
on, so each worker started with its request and paid its imports (torch and torchvision's models:
2-5 s on 2 cores) before building anything. A worker forked from here starts within milliseconds
with all of that done, and is still a process of its own for one request: this server imports and
forks, never builds a model or runs a step, so no trial's flags, threads or allocator reach the
next (PyTorch's DataLoader forks its workers from a process that imported torch the same way).
It never makes a CUDA context either: the runner forks only CPU requests from it.

    python -c BOOT STUDY_PID    (autotune.trial.runner starts it; it ends with its study)

Its stdin takes one JSON line per worker, ``{"request", "result_path", "log_path", "env"}``;
its stdout answers ``{"pid": N}`` once the worker is forked, and ``{"exited": N, "returncode": C}``
when it ends (C as subprocess gives it: negative for the signal that killed it). A worker's
stdout and stderr go to its log_path, and it answers through autotune.worker.serve.serve.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and len(sys.argv) > 1:
    from autotune.trial.orphan import watch_parent

    watch_parent(int(sys.argv[1]))  # before the heavy imports below

import json  # noqa: E402
import random  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from typing import Any, TextIO  # noqa: E402

from autotune.trial.process import PRELOAD_CUDA  # noqa: E402

os.environ.pop(PRELOAD_CUDA, None)  # a CUDA context does not survive a fork: none is made here

import torch._dynamo  # noqa: E402, F401  (a worker's first optimizer step would import it: 1-3 s)

from autotune.worker import serve as worker  # noqa: E402  (torch, strategies, and the model's module: preloaded)
from autotune.trial.orphan import watch_parent  # noqa: E402

REAP_EVERY_S = 0.05
"""How often an ended worker is looked for between commands (its exit reaches the runner this late at most)."""


def fork_worker(command: dict[str, Any], replies: TextIO) -> int:
    """Fork one worker for ``command``; returns its pid (the worker itself never returns)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.close(replies.fileno())  # the server's end alone: its death must reach the runner as EOF
        ready_at = _become_worker(command["log_path"], command.get("env"))
        code = worker.serve(command["request"], command["result_path"], ready_at=ready_at)
    except BaseException:  # a bug of ours: its traceback in the worker's log, then exit code 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never back into the server's loop, nor its exit handlers


def _become_worker(log_path: str, env: dict[str, str] | None) -> float:
    """In the forked child: its own log on stdout and stderr, nothing on stdin, the environment its
    request was made under (what torch reads after its import, e.g. TORCHINDUCTOR_CACHE_DIR, sees
    it), Ctrl-C as a fresh worker takes it, a watch on the server (which ends with its study), and
    a random state of its own."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    watch_parent(os.getppid())
    random.seed()
    return time.time()


def reap(children: set[int], replies: TextIO) -> None:
    """Answer the end of each worker that has ended (and leave no zombie)."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            replies.write(json.dumps({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)}) + "\n")


def serve(commands: int, replies: TextIO) -> None:
    """Fork a worker per command line until ``commands`` closes, answering each fork and each end;
    workers still running then are killed (the runner has gone)."""
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([commands], [], [], REAP_EVERY_S)
        if readable:
            chunk = os.read(commands, 1 << 16)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = fork_worker(json.loads(line), replies)
                children.add(pid)
                replies.write(json.dumps({"pid": pid}) + "\n")
        reap(children, replies)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> None:
    # Ctrl-C reaches the whole process group: the study handles it and ends this server itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Python 3.12+ warns at each fork of a process with threads; torch's import starts one native
    # thread, which (as for the DataLoader's forked workers) holds nothing a worker needs
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints of the imports go to the server's log, not into the replies
    serve(0, replies)
    # nothing of the server's outlives it (the runner removes its folder): exit without the interpreter's
    # teardown, which with torch imported took 1.5 s of each search's end
    replies.flush()
    sys.stdout.flush()  # a stray print of the imports, buffered for the log
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
