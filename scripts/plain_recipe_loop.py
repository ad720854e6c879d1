"""The plain recipe, hand-written: the training loop a careful user writes in five lines, which every
search must beat (issue 35). The benchmark's own side: it shares no code with autotune's training
step, only the workload builders (the same model, batches of the same kind), as
scripts/lm_baseline.py does for language models.

The recipe: bf16 autocast (fp16 with ``torch.amp.GradScaler`` where the GPU has no bf16), TF32 for
what stays in FP32, channels_last for an image model, ``cudnn.benchmark``, fused AdamW, the model
and its loss under ``torch.compile`` (default mode; one function, as nanoGPT compiles the loss with
its forward), and the largest batch that fits, up to 4x the base batch (256 images; 16,384 tokens
of a language model, i.e. 16 sequences of 1,024): the largest candidate first, and after it ran
out of memory a bisection of the smaller ones, each in a fresh compile, memory freed between them. ``--memory-limit 24GiB`` caps this process's GPU memory there, as the search's
``--memory-limit`` caps its trials. Inputs are random (normal images, uniform labels; random tokens
and next-token cross-entropy for a language model), copied from pinned host memory each step as a
data loader does (``--input-on-device`` keeps them on the GPU, as the search's option does).

It times ``--steps`` steps after ``--warmup`` with CUDA events (wall clock on a CPU) and prints one
JSON line: the model, the batch, samples/s (tokens/s for a language model), the median step time,
the peak memory and every batch tried with its outcome.

    python3 scripts/plain_recipe_loop.py --model resnet50
    python3 scripts/plain_recipe_loop.py --model hf:llama --seq-len 1024 --memory-limit 24GiB \\
        --model-config num_hidden_layers=16,hidden_size=2048,intermediate_size=8192,num_attention_heads=32,num_key_value_heads=8,vocab_size=128256
    python3 scripts/plain_recipe_loop.py --model timm:resnet18 --input-shape 3x32x32 --device cpu \\
        --base-batch-size 2 --steps 3 --warmup 1

Models: a torchvision name (resnet50, vit_b_16), timm:NAME, hf:TYPE (with --model-config and
--seq-len, as the search takes them) or package.module:factory (the factory's own batches and loss).
On a CPU it compiles only with --compile, and the base batch is 16 (the search's CPU default).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.errors import ConfigError  # noqa: E402
from autotune.search.memory import parse_size  # noqa: E402  (--memory-limit read as the search reads it)
from autotune.trial.memory_fit import is_out_of_memory  # noqa: E402  (out of memory as the search knows it)
from autotune.workload import hub  # noqa: E402  (the search's own builders, read-only)

IMAGE_BASE_BATCH = 256
LM_BASE_TOKENS = 16_384
CPU_BASE_BATCH = 16
MAX_BATCH_FACTOR = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="resnet50, vit_b_16, timm:NAME, hf:TYPE or package.module:factory")
    p.add_argument("--model-config", default="", help="an hf: model's configuration fields, e.g. n_layer=12,n_embd=768")
    p.add_argument("--seq-len", type=int, help="an hf: model's tokens per sequence (default 1024, or its longest)")
    p.add_argument("--input-shape", help="an image model's sample shape, e.g. 3x224x224 (default: the model's)")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--memory-limit", metavar="SIZE", help="cap this process's GPU memory, e.g. 24GiB")
    p.add_argument("--memory-headroom", metavar="SIZE", help="leave SIZE of the GPU's memory free")
    p.add_argument("--base-batch-size", type=int,
                   help="the base batch (default: 256 images or 16,384 tokens of sequences on a GPU, 16 on a CPU)")
    p.add_argument("--batch-size", type=int, help="run this batch only, instead of finding the largest that fits")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16"],
                   help="autocast dtype (default: bf16 where the device has it, else fp16 with a GradScaler)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="fused AdamW (the recipe; a language model gets nanoGPT's, as the search trains it), or "
                        "fused SGD with momentum (what the search trains image models with)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile (default: on a GPU yes, on a CPU no)")
    p.add_argument("--input-on-device", action="store_true", help="keep the random batches on the GPU")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (the compile among them)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.compile is None:
        args.compile = args.device == "cuda"
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be at least 1")
    if (args.memory_limit or args.memory_headroom) and args.device != "cuda":
        p.error("--memory-limit and --memory-headroom cap a GPU's memory; drop them on a CPU")
    for name in ("base_batch_size", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


@dataclass
class Workload:
    """What the loop trains: the model (on the CPU), random batches on the CPU, the loss."""

    model: torch.nn.Module
    make_batch: Callable[[int, torch.Generator], tuple[Any, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    tokens_per_sample: int | None = None
    language_model: bool = False


def logits(output: Any) -> Any:
    """A model's main output: Hugging Face's .logits, Inception's first of a tuple, else itself."""
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, tuple):
        return output[0]
    return output


def next_token_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    z = logits(out)
    return F.cross_entropy(z.reshape(-1, z.size(-1)), targets.reshape(-1))


def class_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits(out), targets)


def random_images(shape: tuple[int, ...], num_classes: int) -> Callable[[int, torch.Generator], tuple[Any, torch.Tensor]]:
    def make(batch: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn((batch, *shape), generator=g), torch.randint(0, num_classes, (batch,), generator=g)
    return make


def input_shape(args: argparse.Namespace) -> tuple[int, ...] | None:
    return tuple(int(d) for d in args.input_shape.lower().split("x")) if args.input_shape else None


def build(args: argparse.Namespace) -> Workload:
    """The model the search trains for ``--model`` (random weights, on the CPU, in training mode)."""
    torch.manual_seed(0)
    if args.model.startswith(hub.HF_PREFIX):
        # the search's own builder: the model type's configuration, --model-config, its attention
        built = hub.build_hf(args.model, hub.parse_model_config(args.model_config), args.seq_len)
        seq_len, vocab = built["input_shape"][0], built["num_classes"]

        def tokens(batch: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return hub.random_tokens(batch, g, vocab_size=vocab, seq_len=seq_len)
        return Workload(built["model"].train(), tokens, next_token_loss, seq_len, language_model=True)
    if args.model_config or args.seq_len is not None:
        raise SystemExit(f"--model-config and --seq-len shape an hf: model; --model {args.model} takes neither")
    if args.model.startswith(hub.TIMM_PREFIX):
        built = hub.build_timm(args.model, args.num_classes, input_shape(args))
        return Workload(built["model"].train(), random_images(built["input_shape"], args.num_classes), class_loss)
    if ":" in args.model:  # package.module:factory: its own batches and loss
        from autotune.workload.models import WorkloadSpec
        from autotune.workload.models import build as build_workload

        w = build_workload(WorkloadSpec(model=args.model, input_shape=input_shape(args), num_classes=args.num_classes))
        return Workload(w.model.train(), w.batch, lambda out, y: w.loss_fn(logits(out), y), w.tokens_per_sample,
                        language_model=w.tokens_per_sample is not None)
    import torchvision

    extra = {"init_weights": True} if args.model in ("inception_v3", "googlenet") else {}
    model = torchvision.models.get_model(args.model, weights=None, num_classes=args.num_classes, **extra)
    shape = input_shape(args) or ((3, 299, 299) if args.model == "inception_v3" else (3, 224, 224))
    return Workload(model.train(), random_images(shape, args.num_classes), class_loss)


def base_batch(args: argparse.Namespace, workload: Workload) -> int:
    if args.base_batch_size:
        return args.base_batch_size
    if args.device != "cuda":
        return CPU_BASE_BATCH
    if workload.tokens_per_sample:
        return max(1, LM_BASE_TOKENS // workload.tokens_per_sample)
    return IMAGE_BASE_BATCH


def candidates(base: int, factor: int = MAX_BATCH_FACTOR) -> list[int]:
    """The batches a person tries, largest first: ``factor`` x base, then the powers of two and their
    halfway points (1.5 x) below it, down to 1."""
    top = factor * base
    grid = {v for k in range(40) for v in (2**k, 3 * 2**k) if v <= top}
    return sorted(grid | {top}, reverse=True)


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def largest_batch(batches: list[int], attempt: Callable[[int], dict[str, Any]],
                  free: Callable[[], None] = lambda: None) -> tuple[int | None, dict[str, Any] | None, list[dict[str, Any]]]:
    """The largest of ``batches`` at which ``attempt`` does not run out of memory: (that batch, its
    result, every batch tried with its outcome). The largest first (it fits where memory is ample);
    after it ran out of memory, a bisection of the rest, since each try compiles afresh (on the H200
    the 1B Llama shape under 24 GiB took 7.5 minutes going down one candidate at a time). Out of
    memory frees memory and goes on; any other error (an illegal memory access leaves the process
    unusable) is raised."""
    tried: list[dict[str, Any]] = []

    def fits(batch: int) -> dict[str, Any] | None:
        error = None
        try:
            result = attempt(batch)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        # outside the except: its traceback (and the tensors its frames hold) is gone now
        if error is None:
            tried.append({"batch": batch, "outcome": "ok"})
            return result
        tried.append({"batch": batch, "outcome": "oom", "error": error})
        print(f"batch {batch}: out of memory; trying a smaller one", file=sys.stderr, flush=True)
        free()
        return None

    ordered = sorted(batches)
    best: tuple[int | None, dict[str, Any] | None] = (None, None)
    result = fits(ordered[-1])
    if result is not None:
        return ordered[-1], result, tried
    low, high = 0, len(ordered) - 2
    while low <= high:
        mid = (low + high) // 2
        result = fits(ordered[mid])
        if result is not None:
            best, low = (ordered[mid], result), mid + 1
        else:
            high = mid - 1
    return best[0], best[1], tried


def cap_memory(args: argparse.Namespace) -> int | None:
    """--memory-limit (or the GPU less --memory-headroom): this process's allocator gets the limit
    less what already lives outside it (the CUDA context), as on a GPU of that size."""
    if args.device != "cuda" or not (args.memory_limit or args.memory_headroom):
        return None
    free, total = torch.cuda.mem_get_info()  # creates the context
    limits = [parse_size(args.memory_limit)] if args.memory_limit else []
    if args.memory_headroom:
        limits.append(total - parse_size(args.memory_headroom, "--memory-headroom"))
    limit = min(limits)
    outside = max(0, total - free - torch.cuda.memory_reserved())
    torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, (limit - outside) / total)))
    return limit


def set_backend_flags(device: str) -> None:
    """TF32 for FP32 matmuls and convolutions, cuDNN's autotuner."""
    if device != "cuda":
        return
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True


def autocast_dtype(args: argparse.Namespace) -> torch.dtype:
    if args.precision == "fp16" or (args.precision == "auto" and args.device == "cuda"
                                    and not torch.cuda.is_bf16_supported()):
        return torch.float16
    return torch.bfloat16


def make_optimizer(args: argparse.Namespace, workload: Workload) -> torch.optim.Optimizer:
    fused = True if args.device == "cuda" else None
    if args.optimizer == "sgd":
        return torch.optim.SGD(workload.model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4, fused=fused)
    if workload.language_model:
        return hub.nanogpt_adamw(workload.model, fused=fused)  # the search's, as lm_baseline.py trains
    return torch.optim.AdamW(workload.model.parameters(), lr=1e-3, weight_decay=0.05, fused=fused)


def to_device(x: Any, device: str, channels_last: bool) -> Any:
    x = x.to(device, non_blocking=True)
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x


def train_at(batch: int, args: argparse.Namespace, workload: Workload, dtype: torch.dtype) -> dict[str, Any]:
    """Compile afresh (as a new process would), warm up, then time ``args.steps`` steps at ``batch``."""
    device = args.device
    if args.compile:
        torch._dynamo.reset()  # a fresh compile at this batch: static shapes, as in a run of its own
    free_memory(device)
    optimizer = make_optimizer(args, workload)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    g = torch.Generator().manual_seed(1)
    host = [workload.make_batch(batch, g) for _ in range(4)]
    images = isinstance(host[0][0], torch.Tensor) and host[0][0].dim() == 4
    if device == "cuda" and not args.input_on_device:
        host = [(x.pin_memory(), y.pin_memory()) for x, y in host]
    batches = [(to_device(x, device, images), y.to(device)) for x, y in host] if args.input_on_device else host
    model = workload.model

    def forward_loss(x: Any, y: torch.Tensor) -> torch.Tensor:
        return workload.loss(model(x), y)

    forward = torch.compile(forward_loss) if args.compile else forward_loss

    last: list[torch.Tensor] = []

    def step(i: int) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        if not args.input_on_device:
            x, y = to_device(x, device, images), y.to(device, non_blocking=True)
        with torch.autocast(device, dtype=dtype):
            loss = forward(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        last[:] = [loss.detach()]
        return last[0]

    try:
        start = time.perf_counter()
        for i in range(args.warmup):
            step(i)
        float(last[0])  # synchronises
        warmup_s = time.perf_counter() - start
        times = timed(step, args.steps, device)
        final_loss = float(last[0])
    finally:
        last.clear()
        optimizer.zero_grad(set_to_none=True)  # an attempt that ran out leaves nothing behind
        optimizer.state.clear()
    step_ms = statistics.median(times)
    return {"step_ms": step_ms, "step_ms_p10": quantile(times, 0.1), "step_ms_p90": quantile(times, 0.9),
            "samples_per_s": batch / (step_ms / 1e3),
            "tokens_per_s": batch * workload.tokens_per_sample / (step_ms / 1e3) if workload.tokens_per_sample else None,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else None,
            "warmup_s": round(warmup_s, 2), "final_loss": final_loss, "channels_last": images}


def timed(step: Callable[[int], torch.Tensor], steps: int, device: str) -> list[float]:
    """Each step's time in ms. On a GPU: a CUDA event at every step boundary, recorded without
    waiting (steps queue up as in training), read after the last; on a CPU: the wall clock, the
    loss read at each step's end."""
    if device == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            step(i)
            events[i + 1].record()
        events[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    times = []
    for i in range(steps):
        start = time.perf_counter()
        float(step(i))
        times.append((time.perf_counter() - start) * 1e3)
    return times


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    limit = cap_memory(args)
    set_backend_flags(args.device)
    workload = build(args)
    dtype = autocast_dtype(args)
    workload.model.to(args.device)
    base = base_batch(args, workload)
    probe_x, _ = workload.make_batch(1, torch.Generator().manual_seed(0))
    images = isinstance(probe_x, torch.Tensor) and probe_x.dim() == 4
    if images:  # channels_last for an image model (a ConvNet's convolutions; harmless for a ViT)
        workload.model.to(memory_format=torch.channels_last)
    batches = [args.batch_size] if args.batch_size else candidates(base)
    batch, result, tried = largest_batch(batches, lambda b: train_at(b, args, workload, dtype),
                                         lambda: free_memory(args.device))
    out = {"model": args.model, "model_config": args.model_config, "seq_len": workload.tokens_per_sample,
           "device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
           "torch": torch.__version__, "precision": "fp16" if dtype == torch.float16 else "bf16",
           "grad_scaler": dtype == torch.float16, "compile": args.compile, "channels_last": images,
           "optimizer": f"{'fused ' if args.device == 'cuda' else ''}{args.optimizer}",
           "memory_limit_gib": limit / 2**30 if limit else None,
           "parameters": sum(p.numel() for p in workload.model.parameters()),
           "base_batch": base, "batch": batch, "tried": tried, "steps": args.steps, "warmup": args.warmup,
           "samples_per_s": None, "tokens_per_s": None}
    if result is None:
        out["error"] = f"no batch fitted (tried {', '.join(str(t['batch']) for t in tried)})"
        return out
    result.pop("channels_last", None)
    return {**out, **result}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except ConfigError as exc:  # a size like --memory-limit 24GiB mistyped
        raise SystemExit(str(exc)) from None
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    return 0 if result.get("batch") else 1


if __name__ == "__main__":
    sys.exit(main())
