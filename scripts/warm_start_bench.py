"""How long a search's recommendation takes to its first training step in a fresh process: compiled from
nothing, and with the compile it carries (compile-cache.zip beside config.json, issue 59).

    python3 scripts/warm_start_bench.py OUT_DIR [--repeats 1]

Each arm is a fresh process with an empty TORCHINDUCTOR_CACHE_DIR of its own, which builds the search's
workload (its model, random batches at the tuned batch), calls ``cfg.prepare`` and ``cfg.train_step``
as the README's loop does, and times from ``cfg.prepare`` to the end of the first step (the CUDA
context is made before the clock starts). The cold arm reads a copy of config.json that names no
archive; the carried arm reads the search's own. Prints one JSON line an arm, then the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ARM = """
import json, sys, time, warnings
from pathlib import Path
import torch
import autotune
from autotune.workload.models import WorkloadSpec, build

config = sys.argv[1]
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    cfg = autotune.load(config)
    spec = WorkloadSpec.from_dict(json.loads(Path(config).read_text())["workload"])
    torch.manual_seed(0)
    workload = build(spec, init_device=cfg.device)
    model, loss_fn = workload.model, workload.loss_fn
    optimizer = workload.optimizer(model)
    g = torch.Generator().manual_seed(1)
    if workload.make_batch is not None:
        x, y = workload.make_batch(cfg.batch_size, g)
    else:
        x = torch.randn(cfg.batch_size, *workload.input_shape, generator=g)
        y = torch.randint(0, workload.num_classes, (cfg.batch_size,), generator=g)
    x, y = x.to(cfg.device), y.to(cfg.device)
    if cfg.device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    model, optimizer = cfg.prepare(model, optimizer)
    prepare_s = time.perf_counter() - started
    step = cfg.train_step(model, optimizer, loss_fn)
    loss = step(x, y)
    if cfg.device == "cuda":
        torch.cuda.synchronize()
    first_step_s = time.perf_counter() - started
from torch._dynamo.utils import compile_times, counters
# where the step's time went: Dynamo's timed phases (tracing, the caches' loads, Inductor), slowest first
names, seconds = compile_times(repr="csv", aggregate=True)
phases = dict(sorted(((n, round(float(s), 2)) for n, s in zip(names, seconds)), key=lambda p: -p[1])[:8])
print(json.dumps({"first_step_s": round(first_step_s, 2), "prepare_s": round(prepare_s, 2), "loss": float(loss),
                  "fx_graph_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
                  "fx_graph_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
                  "aot_autograd_hits": int(counters["aot_autograd"]["autograd_cache_hit"]),
                  "aot_autograd_misses": int(counters["aot_autograd"]["autograd_cache_miss"]),
                  "warnings": [str(w.message) for w in said], "phases": phases}))
"""


def run_arm(config: Path, work: Path, name: str) -> dict:
    script = work / "arm.py"
    script.write_text(ARM)
    cache = work / f"inductor-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script), str(config)], env=env, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{name} arm failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return {"arm": name, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="a search's output folder (config.json, compile-cache.zip)")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of arms, alternating")
    args = parser.parse_args(argv)
    data = json.loads((args.out_dir / "config.json").read_text())
    if not data.get("compile_cache"):
        raise SystemExit(f"{args.out_dir}: its config.json names no compile cache (not a compiled recommendation?)")
    print(json.dumps({"compile_cache": data["compile_cache"]}))
    with tempfile.TemporaryDirectory(prefix="warm-start-") as tmp:
        work = Path(tmp)
        cold_dir = work / "cold"
        cold_dir.mkdir()
        (cold_dir / "config.json").write_text(json.dumps({k: v for k, v in data.items() if k != "compile_cache"}))
        pairs = []
        for i in range(args.repeats):
            cold = run_arm(cold_dir / "config.json", work, f"cold{i}")
            carried = run_arm(args.out_dir / "config.json", work, f"carried{i}")
            print(json.dumps(cold))
            print(json.dumps(carried))
            pairs.append((cold["first_step_s"], carried["first_step_s"]))
    for cold_s, carried_s in pairs:
        print(f"first compiled step: cold {cold_s:.1f} s, with the carried compile {carried_s:.1f} s "
              f"({100 * carried_s / cold_s:.0f}% of cold)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
