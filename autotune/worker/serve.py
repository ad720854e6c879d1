"""The isolated worker: one process per trial builds the model, runs the measured steps, exits.

A fresh process per trial means global flags (TF32, cudnn.benchmark, threads), the caching
allocator's state, cuDNN's algorithm cache and a sticky CUDA error never reach the next trial
(timm's bulk_runner does the same). The study process talks to it through a JSON request on
stdin and a JSON result file.

    python -m autotune.worker.serve RESULT.json STUDY_PID < REQUEST.json
"""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__" and len(sys.argv) > 2:
    from autotune.trial.orphan import watch_parent

    watch_parent(int(sys.argv[2]))  # before the heavy imports below

import importlib  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from autotune import progress  # noqa: E402
from autotune.trial.memory_fit import cap_memory, is_out_of_memory  # noqa: E402
from autotune.trial.process import PRELOAD_CUDA, PRELOAD_IMPORTS  # noqa: E402
from autotune.trial.work import probe, probe_memory, run_trial  # noqa: E402  (torch, strategies, the model builders)
from autotune.workload.hub import is_hub_model, preload as preload_hub_model  # noqa: E402


def _preload() -> list[str]:
    """What autotune.trial.runner.preload asked for, done before the request: the model's module
    imported and, for a GPU, torch._dynamo and Inductor's compiler imported and the CUDA context made. Each is done again by
    the trial if it fails here, and says what went wrong then."""
    done = []
    module = os.environ.get(PRELOAD_IMPORTS)
    if module:
        try:
            if is_hub_model(module):
                preload_hub_model(module)
            else:
                importlib.import_module(module)
            done.append(module)
        except Exception:
            pass
    if os.environ.get(PRELOAD_CUDA) == "1":
        if module:
            try:
                # a trial's first optimizer imports it (torch.optim does), 1-4 s: a model that does not
                # import it itself (torchvision's do) would spend them building its optimizer. A GPU
                # worker does it here, as a spare while the trial before it runs; a CPU's fork server has
                # it already (autotune.worker.zygote), and a CPU spare (the probe's) would take a core
                # from the search
                importlib.import_module("torch._dynamo")
                done.append("torch._dynamo")
                # and a compiled step's first call imports Inductor's compiler (torch.compile reads its config
                # there: 2-3 s), in every compiled trial and in a check whose configuration compiles a part
                # (8-bit Adam's update): a GPU spare takes it off their clocks too
                importlib.import_module("torch._inductor.compile_fx")
                done.append("torch._inductor")
            except Exception:
                pass
        try:
            if torch.cuda.is_available():
                torch.empty(1, device="cuda")  # the first allocation makes the context
                torch.cuda.empty_cache()  # and nothing of it stays reserved
                done.append("cuda")
        except Exception:
            pass
    return done


PRELOADED = _preload()
READY_AT = time.time()


def main(argv: list[str]) -> int:
    return serve(json.load(sys.stdin), argv[1])


def serve(request: dict[str, Any], result_path: str, ready_at: float | None = None) -> int:
    """Answer one request into ``result_path`` (written atomically); ``ready_at``: when this process
    was ready for it (a worker forked by autotune.worker.zygote: the fork), else when its imports ended."""
    progress.start(request.get("progress_path"))
    try:
        if request.get("mode") == "probe":
            result = {"status": "ok", **probe(request)}
        elif request.get("mode") == "memory":
            result = probe_memory(request)
        elif request.get("mode") == "accuracy":
            from autotune.accuracy.worker.check import run_check

            result = run_check(request)
        elif request.get("mode") == "parity":
            from autotune.accuracy.worker.parity import run_parity

            if request.get("memory_limit_bytes") and request.get("device") == "cuda":
                cap_memory(int(request["memory_limit_bytes"]))  # --memory-limit: as on a card of that size
            result = run_parity(request)
        else:
            result = run_trial(request)
    except Exception as exc:  # reported to the study, which records it on the trial
        if is_out_of_memory(exc):
            result = {"status": "oom", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        else:
            result = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
    result["ready_at"] = READY_AT if ready_at is None else ready_at
    result["preloaded"] = PRELOADED
    result["done_at"] = time.time()
    result["pid"] = os.getpid()
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, default=str)
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
