"""Does compiling a language model's forward and its loss as one graph keep less for backward?

A benchmark, not a test. ``TrainStep`` compiled the model in place and its loss apart (two graphs:
the logits leave the model's graph as an output and enter the loss's as an input); a hand-written
loop compiles ``loss(model(x), y)`` as one function, as nanoGPT does. On the H200 (torch 2.11) a
1.24B Llama shape peaked 23.2 GiB at batch 1 under autotune's step and 20.2 GiB under the hand loop.

Each variant runs in a fresh process (nothing of one compile or allocator leaks into the next):

* eager: nothing compiled (the reference);
* separate: ``model.compile()`` in place and ``torch.compile(loss_fn)`` apart (TrainStep before the
  joint compile);
* joint: ``model.compile()`` in place and one ``torch.compile``'d ``loss_fn(logits(model(x)), y)``;
* trainstep: ``runtime.TrainStep`` of this checkout, prepared by ``runtime.prepare_model``;
* interleaved: separate and joint timed in alternating blocks in one process (step time only).

For each, after the warm-up (the compile): the graphs dynamo compiled; the bytes of the tensors
saved for backward during one step's forward (``saved_tensors_hooks``, deduplicated by storage,
parameters apart: device-independent, and what the backward holds); the peak of the step's
allocations above its start (the profiler's CPU memory events); the step's peak resident memory
(VmHWM after resetting it); and the median step time over ``--steps`` steps (on a CPU only indicative).

    python3 scripts/joint_compile_bench.py                       # the small Llama, bf16, batch 4
    python3 scripts/joint_compile_bench.py --dtype fp32 --variants separate,joint
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.deploy import runtime  # noqa: E402
from autotune.recipe import Recipe  # noqa: E402
from autotune.workload import hub  # noqa: E402
from autotune.workload.models import Workload, WorkloadSpec, build, logits  # noqa: E402

VARIANTS = ("eager", "separate", "joint", "trainstep", "interleaved")
DTYPES = {"bf16": torch.bfloat16, "fp32": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # a child process's one variant
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--mode", default="default", help="torch.compile mode of the compiled variants")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    return p.parse_args(argv)


def workload(args: argparse.Namespace) -> Workload:
    config = {"num_hidden_layers": args.layers, "hidden_size": args.hidden, "intermediate_size": args.hidden * 8 // 3,
              "num_attention_heads": max(1, args.hidden // 64), "num_key_value_heads": max(1, args.hidden // 64),
              "vocab_size": args.vocab}
    torch.manual_seed(0)
    return build(WorkloadSpec(model="hf:llama", model_config=config, seq_len=args.seq_len))


def make_step(variant: str, w: Workload, args: argparse.Namespace) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """One training step of ``variant``: zero_grad, forward and loss under autocast, backward, AdamW."""
    dtype = DTYPES[args.dtype]
    compile_mode = None if variant == "eager" else args.mode
    recipe = Recipe(device="cpu", autocast_dtype=dtype, compile_mode=compile_mode)
    model = runtime.prepare_model(w.model, recipe)  # compiled in place where the variant compiles
    optimizer = hub.nanogpt_adamw(model)
    if variant == "trainstep":
        return runtime.TrainStep(model, optimizer, w.loss_fn, recipe)
    loss_fn = w.loss_fn

    def forward_loss(x: Any, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits(model(x)), y)

    if variant == "separate":
        compiled = runtime.compiled_loss(loss_fn, recipe)  # the loss apart, in default mode, as TrainStep had it

        def forward(x: Any, y: torch.Tensor) -> torch.Tensor:
            return compiled(logits(model(x)), y)
    else:
        forward = torch.compile(forward_loss, mode=args.mode) if variant == "joint" else forward_loss

    def step(x: Any, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = forward(x, y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def saved_bytes(step: Callable[..., torch.Tensor], x: Any, y: torch.Tensor,
                parameters: set[int]) -> tuple[int, int, list[tuple[int, tuple[int, ...], str]]]:
    """Bytes of the storages saved for backward during one step (parameters apart), the parameters'
    bytes saved, and the five largest saved storages (bytes, a shape seen, dtype)."""
    seen: dict[int, tuple[int, tuple[int, ...], str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape), str(t.dtype).removeprefix("torch."))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(x, y)
    activations = {ptr: v for ptr, v in seen.items() if ptr not in parameters}
    params = sum(v[0] for ptr, v in seen.items() if ptr in parameters)
    return sum(v[0] for v in activations.values()), params, sorted(activations.values(), reverse=True)[:5]


def profiled_peak(step: Callable[..., torch.Tensor], x: Any, y: torch.Tensor) -> int:
    """The peak of one step's CPU allocations above what was allocated when it began."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(x, y)
    # each allocation and free of the CPU allocator, in order (the parsed events attribute
    # allocations to the operator around them, so the raw ones are read)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak


def rss_peak(step: Callable[..., torch.Tensor], x: Any, y: torch.Tensor) -> int:
    """The step's peak resident memory (VmHWM, reset before it), in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    step(x, y)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The child process's one variant."""
    from torch._dynamo.utils import counters

    w = workload(args)
    g = torch.Generator().manual_seed(1)
    batches = [w.batch(args.batch, g) for _ in range(2)]
    step = make_step(args.variant, w, args)
    parameters = {p.untyped_storage().data_ptr() for p in w.model.parameters()}
    torch._dynamo.reset()
    counters.clear()
    start = time.perf_counter()
    for i in range(args.warmup):
        float(step(*batches[i % 2]))
    warmup_s = time.perf_counter() - start
    graphs = counters["stats"]["unique_graphs"]
    times: list[float] = []
    for i in range(args.steps):
        start = time.perf_counter()
        loss = float(step(*batches[i % 2]))
        times.append((time.perf_counter() - start) * 1e3)
    saved, params_saved, largest = saved_bytes(step, *batches[0], parameters)
    peak = profiled_peak(step, *batches[1])
    rss = rss_peak(step, *batches[0])
    assert counters["stats"]["unique_graphs"] == graphs, "a measured step compiled again"
    return {"variant": args.variant, "graphs": graphs, "saved_mib": saved / 2**20,
            "params_saved_mib": params_saved / 2**20, "peak_alloc_mib": peak / 2**20, "rss_peak_mib": rss / 2**20,
            "step_ms": statistics.median(times), "step_ms_min": min(times), "warmup_s": round(warmup_s, 1), "loss": loss,
            "largest_saved": largest}


def interleaved(args: argparse.Namespace, rounds: int = 8, block: int = 4) -> dict[str, Any]:
    """The separate and the joint step of one model in one process, timed in alternating blocks of
    ``block`` steps (the order flipped each round), so a busy machine's drift falls on both alike."""
    w = workload(args)
    x, y = w.batch(args.batch, torch.Generator().manual_seed(1))
    steps = {name: make_step(name, w, args) for name in ("separate", "joint")}
    for step in [*steps.values(), *steps.values()]:
        step(x, y)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            for _ in range(block):
                start = time.perf_counter()
                float(steps[name](x, y))
                times[name].append((time.perf_counter() - start) * 1e3)
    return {"variant": "interleaved", **{f"{name}_ms": statistics.median(t) for name, t in times.items()},
            **{f"{name}_ms_min": min(t) for name, t in times.items()}}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.variant:
        print(json.dumps(interleaved(args) if args.variant == "interleaved" else measure(args)))
        return
    print(f"hf:llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq_len}, "
          f"batch {args.batch}, {args.dtype}, compile {args.mode}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'variant':<10} {'graphs':>6} {'saved MiB':>10} {'peak MiB':>9} {'RSS MiB':>8} {'step ms':>8} {'min ms':>7} "
          f"{'warm-up s':>9} {'loss':>8}")
    forwarded = [f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()
                 if key not in ("variants", "variant")]
    # a compile of its own in each process: Inductor's graph caches off (its C++ kernels' cache stays)
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    for variant in args.variants.split(","):
        out = subprocess.run([sys.executable, __file__, *forwarded, "--variant", variant],
                             capture_output=True, text=True, check=False, env=env)
        if out.returncode != 0:
            print(f"{variant:<10} failed:\n{out.stderr[-3000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if variant == "interleaved":
            print(f"interleaved in one process: separate {r['separate_ms']:.1f} ms (min {r['separate_ms_min']:.1f}), "
                  f"joint {r['joint_ms']:.1f} ms (min {r['joint_ms_min']:.1f})")
            continue
        print(f"{variant:<10} {r['graphs']:>6} {r['saved_mib']:>10.1f} {r['peak_alloc_mib']:>9.1f} "
              f"{r['rss_peak_mib']:>8.0f} {r['step_ms']:>8.1f} {r['step_ms_min']:>7.1f} {r['warmup_s']:>9.1f} {r['loss']:>8.4f}")
        print(f"{'':<10} largest saved: " + ", ".join(f"{b / 2**20:.1f} MiB {list(s)} {d}"
                                                       for b, s, d in r["largest_saved"][:3]))


if __name__ == "__main__":
    main()
