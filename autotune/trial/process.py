"""A worker process from outside: the environment it starts with, its Python flags, and why it
died when it left no result. Shared by the runner (one worker) and the DDP launcher (its ranks)."""

from __future__ import annotations

import os
import re
import signal
import sys
from typing import Any

from autotune.cache import INDUCTOR_ENV, compile_cache_dir, users_inductor_cache

# what a worker does before its request, after importing torch and autotune (autotune.worker.serve)
PRELOAD_IMPORTS = "AUTOTUNE_WORKER_IMPORTS"



PRELOAD_CUDA = "AUTOTUNE_WORKER_CUDA"



def preload(request: dict[str, Any] | None) -> dict[str, str]:
    """The environment that has a worker ready for ``request`` before the request arrives: the
    model's module imported (torchvision's models import torch._dynamo: 1-3 s) and, for a GPU,
    its CUDA context made (about a second). A spare does this while the trial before it runs; a
    worker started with its request does the same work, only earlier than its build."""
    if not request or "workload" not in request:  # `autotune verify`: the config names the model
        return {}
    model = request["workload"]["model"]
    # hf:TYPE and timm:NAME as they are (the worker preloads their library's model module)
    hub = model.startswith(("hf:", "timm:"))
    env = {PRELOAD_IMPORTS: model if hub else model.split(":", 1)[0] if ":" in model else "torchvision"}
    device = request.get("device") or (request.get("space") or {}).get("device")
    if device in ("cuda", "auto"):  # "auto" (the CLI's probe, started first): where torch sees a GPU
        env[PRELOAD_CUDA] = "1"
    return env



def worker_env(request: dict[str, Any] | None = None) -> dict[str, str]:
    # the worker must import what the study process imports (autotune, the user's model module)
    env = dict(os.environ)
    for name in (PRELOAD_IMPORTS, PRELOAD_CUDA):
        env.pop(name, None)
    env.update(preload(request))
    cwd = os.getcwd()
    paths = [p for p in sys.path if p and p != cwd] + [cwd]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # compiled graphs kept across trials and searches (a user's own setting wins)
    env[INDUCTOR_ENV] = users_inductor_cache() or str(compile_cache_dir())
    from autotune.trial.gpus import current_pin

    pin = current_pin()  # --gpus: this trial's GPU, and only it
    if pin is not None:
        env["CUDA_VISIBLE_DEVICES"] = pin
    return env



PYTHON_FLAGS = ("-X", "faulthandler")
"""A worker that dies of a signal (a segfault in an extension, an abort) prints its Python stack
to its log first, so its trial's reason says where (crash_reason)."""



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



def crash_reason(code: int | None, log_text: str) -> str:
    """Why a worker that left no result died, in one line: its exit, then what its log says
    ("worker was killed by signal 11 (SIGSEGV): Fatal Python error: Segmentation fault, in
    forward at model.py:7"), or that the log is empty."""
    said = salient_error(log_text)
    if not said:
        return f"worker {exit_description(code)} with no result and an empty log"
    where = _fault_location(log_text) if said.startswith("Fatal Python error") else None
    return f"worker {exit_description(code)} with no result: {said}" + (f", in {where}" if where else "")



_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')



def _fault_location(log_text: str) -> str | None:
    """From faulthandler's dump, the innermost frame of the user's code (outside the standard
    library and installed packages), else the innermost frame: "forward at model.py:7"."""
    import sysconfig

    libraries = {sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")}
    frames = []
    # the crashing thread's stack, which faulthandler names "Current thread"
    dump = log_text.split("Current thread", 1)[-1] if "Current thread" in log_text else log_text
    for line in dump.split("most recent call first", 1)[-1].splitlines()[1:]:
        match = _FRAME.match(line)
        if not match:
            if frames:
                break
            continue
        frames.append(match)
    if not frames:
        return None
    own = [m for m in frames if not any(m["file"].startswith(lib) for lib in libraries)]
    m = (own or frames)[0]
    return f"{m['func']} at {os.path.basename(m['file'])}:{m['line']}"



def exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
