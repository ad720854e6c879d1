"""Start a worker process for one request, with a watchdog, and read back its result."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from autotune import stop
from autotune import progress
from autotune.trial.process import (
    PRELOAD_IMPORTS,
    PYTHON_FLAGS,
    crash_reason,
    exit_description,
    worker_env,
)

# The worker is started through -c rather than -m: -m would put the current directory first on
# sys.path before any of our code runs, and a file there (torch.py, optuna.py) would replace the
# real module. The current directory goes last instead: a module the user names with --model
# still imports from it.
_BOOT = ("import os, sys; cwd = os.getcwd(); "
         "sys.path[:] = [p for p in sys.path if p not in ('', cwd)] + [cwd]; "
         "import runpy; runpy.run_module('autotune.worker.serve', run_name='__main__', alter_sys=True)")


def worker_command(*args: str, module: str = "autotune.worker.serve") -> list[str]:
    """The command line of a worker process (``args`` become its sys.argv[1:]), or of another
    module booted the same way (the fork server, autotune.worker.zygote)."""
    return [sys.executable, *PYTHON_FLAGS, "-c", _BOOT.replace("autotune.worker.serve", module), *args]


class _Worker:
    """A worker process, started before its request: it imports torch and autotune, then waits
    for the request on stdin. A spare (``run_worker(..., spare=True)``) is started while the
    previous trial runs, so its 3-4 s of imports are off the next trial's path."""

    def __init__(self, env: dict[str, str], *, log_path: Path | None = None, log_dir: Path | None = None,
                 zygote: _Zygote | None = None) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="autotune-")
        self.zygote = zygote  # a worker forked from it (on a CPU) starts with its request, in milliseconds
        self.result_path = Path(self.tmp.name) / "result.json"
        # a worker started with its request logs to the request's log; a spare next to the trial
        # logs, so that handing it over renames its log in place (readable while the trial runs)
        if log_path is not None:
            self.log_path = log_path
        elif log_dir is not None and log_dir.is_dir():
            self.log_path = log_dir / f".spare-{os.getpid()}-{id(self):x}.log"
        else:
            self.log_path = Path(self.tmp.name) / "worker.log"
        self.env = env
        self.log = None
        self.proc: subprocess.Popen | _Forked | None = None
        if zygote is None:
            self._spawn()

    def _spawn(self) -> None:
        """Start the worker's own interpreter: it imports, then waits for its request on stdin."""
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(worker_command(str(self.result_path), str(os.getpid())),
                                     stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env, text=True)

    def run(self, request: dict[str, Any], timeout_s: float | None, log_path: Path | None,
            on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        started = time.time()  # a spare's imports before this are not the request's time
        watch = None
        if on_progress is not None:
            request = {**request, "progress_path": str(self.result_path) + ".progress"}
            watch = _progress_watch(request["progress_path"], on_progress)
        if log_path is not None and log_path != self.log_path:
            try:
                os.replace(self.log_path, log_path)
                self.log_path = log_path
            except OSError:  # another file system: copied when the worker is done
                pass
        self._start(request)
        try:
            _wait(self.proc, timeout_s, watch)
            status = None
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            status = "timeout"
        except BaseException:  # Ctrl-C in the study: do not leave the worker on the GPU
            self.discard()
            raise
        finished = time.time()
        if self.log is not None:
            self.log.close()
        text = self.log_path.read_text(errors="replace")[-50_000:] if self.log_path.exists() else ""
        if log_path is not None and self.log_path != log_path:
            shutil.copyfile(self.log_path, log_path)
            if self.log_path.name.startswith(".spare-"):
                self.log_path.unlink(missing_ok=True)
        if status == "timeout":
            result = {"status": "timeout", "reason": f"no result after {timeout_s:.0f} s; the worker was killed"}
        elif self.result_path.exists():
            result = json.loads(self.result_path.read_text())
        elif isinstance(self.proc, _Forked) and self.proc.returncode is None:
            self.proc.kill()  # it ends by itself once it sees its server gone (orphan.watch_parent)
            result = {"status": "crashed", "reason": f"the fork server of this worker "
                                                     f"{exit_description(_exit_code(self.zygote.proc))} while it ran"}
        else:
            result = {"status": "crashed", "reason": crash_reason(self.proc.returncode, text)}
        self.tmp.cleanup()
        result["wall_s"] = finished - started
        if "ready_at" in result:
            # what the request waited for the worker's imports: all of them for a worker started
            # with it, the rest of them (or none) for a spare
            result["worker_start_s"] = max(0.0, result["ready_at"] - started)
        result["log_tail"] = text[-2000:]
        return result

    def _start(self, request: dict[str, Any]) -> None:
        """Hand the request over: forked with it, or written to the started worker's stdin."""
        if self.zygote is not None:
            try:
                self.proc = self.zygote.fork({"request": request, "result_path": str(self.result_path),
                                              "log_path": str(self.log_path), "env": self.env})
                return
            except RuntimeError as exc:  # the fork server died: this request's worker starts afresh
                print(f"autotune: {exc}; starting the worker afresh", file=sys.stderr)
                self.zygote = None
                self._spawn()
        try:
            self.proc.stdin.write(json.dumps(request))
            self.proc.stdin.close()
        except BrokenPipeError:  # it died before its request (killed, out of memory): said below
            pass

    def discard(self) -> None:
        """Kill it (a spare never used, or a run interrupted) and remove its files."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        if self.log is not None:
            self.log.close()
        if self.log_path.name.startswith(".spare-"):
            self.log_path.unlink(missing_ok=True)
        self.tmp.cleanup()


def _exit_code(proc: subprocess.Popen) -> int | None:
    """A process's exit code, waiting a little for one whose end is on its way (its pipe closed)."""
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None


class _Forked:
    """A worker forked by a fork server, seen as subprocess.Popen shows a child: poll, wait, kill
    and returncode (its exit, which the server reaps and answers)."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.args = [f"autotune worker {pid}, forked"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        with self.zygote.changed:
            self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        with self.zygote.changed:
            if not self.zygote.changed.wait_for(self._read, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _read(self) -> bool:
        """Under the server's lock: whether it ended (its code read, or the server gone)."""
        if self.pid in self.zygote.exited:
            self.returncode = self.zygote.exited[self.pid]
            return True
        return self.zygote.gone

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:  # ended already: its code is on its way
            pass


class _Zygote:
    """The fork server (autotune.worker.zygote) of one worker environment, and what it answers: a
    reader thread files each forked pid and each ended worker's exit code."""

    def __init__(self, env: dict[str, str]) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="autotune-zygote-")
        self.log_path = Path(self.tmp.name) / "zygote.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(worker_command(str(os.getpid()), module="autotune.worker.zygote"),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env=env, text=True, bufsize=1)
        self.changed = threading.Condition()
        self.forked: list[int] = []
        self.exited: dict[int, int] = {}
        self.gone = False
        self.one_fork = threading.Lock()  # a fork's answer is the next pid: one command at a time
        threading.Thread(target=self._read_answers, daemon=True, name="autotune-zygote").start()

    def _read_answers(self) -> None:
        for line in self.proc.stdout:
            answer = json.loads(line)
            with self.changed:
                if "pid" in answer:
                    self.forked.append(answer["pid"])
                else:
                    self.exited[answer["exited"]] = answer["returncode"]
                self.changed.notify_all()
        with self.changed:
            self.gone = True
            self.changed.notify_all()

    def alive(self) -> bool:
        return not self.gone and self.proc.poll() is None

    def fork(self, command: dict[str, Any]) -> _Forked:
        """A fresh worker forked for ``command`` (it starts on its request at once)."""
        with self.one_fork:
            with self.changed:
                had = len(self.forked)
            if self._send(command):
                with self.changed:
                    # its imports first, if it is still at them: as long as a fresh worker's
                    self.changed.wait_for(lambda: len(self.forked) > had or self.gone, timeout=600)
                    if len(self.forked) > had:
                        return _Forked(self, self.forked[had])
        self.discard()
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise RuntimeError(f"the trial workers' fork server {exit_description(_exit_code(self.proc))}: {tail}")

    def _send(self, command: dict[str, Any]) -> bool:
        """Write one command line; False when the server is gone (its stdin closed with it)."""
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
            return True
        except OSError:  # BrokenPipeError among them
            return False

    def discard(self) -> None:
        """End it (its stdin closes: it kills any worker still running, then exits) and remove its files."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        self.tmp.cleanup()


def _progress_watch(path: str, on_progress: Callable[[str], None]) -> Callable[[], None]:
    """A poll of the worker's progress file that passes its last state on, in words (the seconds
    in them move on between states)."""
    last: list[Any] = [None]

    def poll() -> None:
        last[0] = progress.read(path) or last[0]
        on_progress(progress.words(last[0]))

    return poll


def _wait(proc: subprocess.Popen, timeout_s: float | None, poll: Callable[[], None] | None = None) -> None:
    """``proc.wait(timeout_s)`` that also ends on a stop request whose interrupt was swallowed,
    and calls ``poll`` about twice a second (the worker's progress)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        stop.check()
        if poll is not None:
            poll()
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        try:
            proc.wait(timeout=0.5 if left is None else min(0.5, left))
            return
        except subprocess.TimeoutExpired:
            continue


_spares: dict[tuple[tuple[str, str], ...], _Worker] = {}
_zygotes: dict[tuple[tuple[str, str], ...], _Zygote] = {}
_spares_lock = threading.Lock()


_KEY_VARIABLES = ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", PRELOAD_IMPORTS)


def _env_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """Which spare or fork server may serve a request: one started for the same GPUs, import path
    and model (a forked worker takes the rest of its request's environment with its request). The
    rest of a spare's environment is the search process's own, which autotune never changes; importing
    torch there adds its defaults (TORCHINDUCTOR_CACHE_DIR), which the worker's own imports set
    alike. A CUDA context made ahead does not matter: the probe's spare is started before
    ``--device auto`` is resolved, and where torch sees no GPU none is made."""
    return tuple((name, env.get(name, "")) for name in _KEY_VARIABLES)


def discard_spares() -> None:
    """Kill the spare workers no trial took (the search is over)."""
    with _spares_lock:
        spares: list[_Worker | _Zygote] = [*_spares.values(), *_zygotes.values()]
        _spares.clear()
        _zygotes.clear()
    for worker in spares:
        worker.discard()


atexit.register(discard_spares)


def prestart_setting() -> bool | None:
    """$AUTOTUNE_PRESTART: True (1: every worker is started before its request, a trial's during
    the trial before; on a CPU, forked), False (0: each started afresh with its request, the
    probe's too, none forked), None (unset: the probe's ahead, trials' on a GPU ahead, CPU
    workers forked)."""
    text = os.environ.get("AUTOTUNE_PRESTART")
    if not text:
        return None
    if text not in ("0", "1"):
        from autotune.errors import ConfigError

        raise ConfigError(f"AUTOTUNE_PRESTART={text!r}: write 1 (start each worker before its request: a "
                          "trial's during the trial before) or 0 (start each with its request), or leave it unset")
    return text == "1"


def forks(request: dict[str, Any]) -> bool:
    """Whether ``request``'s worker is forked from a fork server (autotune.worker.zygote): a CPU
    request's, unless $AUTOTUNE_PRESTART=0 starts every worker afresh with its request. A GPU
    request's never is (a CUDA context does not survive a fork): spares serve those."""
    device = request.get("device") or (request.get("space") or {}).get("device")
    # Linux only: macOS's system libraries are not safe to use in a forked child (multiprocessing
    # spawns there for that reason), and Windows has no fork
    return device == "cpu" and sys.platform.startswith("linux") and prestart_setting() is not False


def _zygote(env: dict[str, str]) -> _Zygote:
    """The fork server of this worker environment, started now if there is none (or it died)."""
    key = _env_key(env)
    with _spares_lock:
        zygote = _zygotes.get(key)
        if zygote is not None and zygote.alive():
            return zygote
        _zygotes[key] = _Zygote(env)
    if zygote is not None:
        zygote.discard()
    return _zygotes[key]


def start_spare(request: dict[str, Any], log_dir: Path | None = None) -> None:
    """Start a worker for a request like ``request`` to come (the same model and device; its
    environment is this thread's worker environment), unless one waits already: the search's
    probe, started before the search process imports torch itself (the two imports run at once),
    or the next trial's. On a CPU this starts the fork server instead, which imports once for
    every worker to come."""
    env = worker_env(request)
    if forks(request):
        _zygote(env)
        return
    key = _env_key(env)
    with _spares_lock:
        if key not in _spares:
            _spares[key] = _Worker(env, log_dir=log_dir)


def run_worker(request: dict[str, Any], *, timeout_s: float | None = None,
               log_path: Path | None = None, spare: bool = False,
               on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``python -m autotune.worker.serve`` on ``request``; always returns a result dict.

    status is "ok", "oom", "error" (an exception in the trial), "crashed" (the process died
    without a result: segfault, kill, sticky CUDA error) or "timeout" (the watchdog killed it).
    ``worker_start_s`` is how long the request waited for the worker to have imported everything;
    ``wall_s`` runs from the request to the result.

    Every request gets a fresh process (one trial's state or crash never reaches the next), but
    not necessarily a freshly started one: on a CPU it is forked from a fork server that imported
    everything once (``forks``); on a GPU a spare started under the same environment (the same
    GPU) is taken if there is one, and ``spare=True`` starts the next one now, to import while
    this request runs (the search's trials on a GPU: their measurement is on the GPU, which the
    spare's imports on another CPU core leave alone).
    A trial of a ``--ddp N`` search runs in N rank processes instead (``autotune.trial.ddp_launch.run_ranks``).
    ``on_progress(words)`` hears what the worker is doing while it runs (autotune.progress).
    """
    from autotune.trial.ddp_launch import request_world_size, run_ranks

    world_size = request_world_size(request)
    if world_size > 1:
        return run_ranks(request, world_size=world_size, timeout_s=timeout_s, log_path=log_path)
    env = worker_env(request)
    key = _env_key(env)
    with _spares_lock:
        worker = _spares.pop(key, None)
    if worker is not None and worker.proc.poll() is not None:  # a spare that died waiting
        worker.discard()
        worker = None
    if worker is None:
        worker = _Worker(env, log_path=log_path, zygote=_zygote(env) if forks(request) else None)
    if spare and worker.zygote is None:
        start_spare(request, log_dir=log_path.parent if log_path is not None else None)
    return worker.run(request, timeout_s, log_path, on_progress)


