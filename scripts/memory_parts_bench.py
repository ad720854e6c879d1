"""What each memory knob of issue 36 costs and saves, part by part, on one GPU: the optimizer step
and the loss of a language model, timed with CUDA events and measured with the allocator's peaks.

    python3 scripts/memory_parts_bench.py --model hf:llama --seq-len 1024 --batch 4 \\
        --model-config num_hidden_layers=16,hidden_size=2048,intermediate_size=8192,num_attention_heads=32,num_key_value_heads=8,vocab_size=128256,tie_word_embeddings=true

Optimizer: the model's parameters (FP32, on the GPU) with random gradients, stepped by fused AdamW
(the plain recipe's), torchao's AdamW8bit and bitsandbytes' AdamW8bit where installed: milliseconds a
step (median of --steps after --warmup) and the bytes of optimizer state.

Loss: the last hidden states of --batch sequences (bf16, as autocast leaves them) and the LM head's
FP32 weight: the head and the FP32 next-token cross-entropy under torch.compile (the plain recipe's
compiled loss), eager, and liger-kernel's fused linear cross-entropy, forward and backward: milliseconds
and the peak memory above what the inputs hold.

It prints one JSON line per measurement; nothing here is autotune's own code but the model builder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.workload import hub  # noqa: E402


def timed(fn: Callable[[], None], steps: int, warmup: int) -> float:
    """Median milliseconds of ``fn`` over ``steps`` calls after ``warmup``, by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def alternate(arms: dict[str, Callable[[], None]], rounds: int, steps: int, batch: int,
              warmup: int = 0) -> dict[str, float]:
    """Each arm timed (:func:`timed`, after ``warmup`` calls) in turn, ``rounds`` times, so that clocks and heat
    treat them alike; prints a JSON line per round and arm, returns each arm's median milliseconds."""
    medians: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(rounds):
        for name, step in arms.items():
            ms = timed(step, steps, warmup)
            medians[name].append(ms)
            print(json.dumps({"round": round_, "arm": name, "step_ms": round(ms, 2),
                              "images_per_s": round(batch * 1e3 / ms, 1)}), flush=True)
    return {name: round(statistics.median(v), 2) for name, v in medians.items()}


def image_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int, *, channels_last: bool = True,
               options: dict | None = None) -> Callable[[], None]:
    """An image classifier's plain-recipe training step at ``batch`` (the image benchmarks'): ``model`` (on the
    GPU) and its cross-entropy under bf16 autocast, compiled (with Inductor ``options``, if any), on random
    224x224 inputs made on the GPU, in channels_last where ``channels_last``; backward; ``optimizer``'s step."""
    loss_fn = torch.nn.CrossEntropyLoss()

    def forward_loss(x, y):
        with torch.autocast("cuda", torch.bfloat16):
            return loss_fn(model(x), y)

    compiled = torch.compile(forward_loss) if options is None else torch.compile(forward_loss, options=options)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step():
        compiled(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def optimizers() -> dict[str, Callable]:
    made: dict[str, Callable] = {"fused AdamW": lambda p: torch.optim.AdamW(p, lr=6e-4, betas=(0.9, 0.95), fused=True)}
    try:
        from torchao.optim import AdamW8bit

        made["torchao AdamW8bit"] = lambda p: AdamW8bit(p, lr=6e-4, betas=(0.9, 0.95))
    except ImportError as exc:
        print(json.dumps({"part": "optimizer", "name": "torchao AdamW8bit", "skipped": str(exc)}))
    try:
        import bitsandbytes as bnb

        made["bitsandbytes AdamW8bit"] = lambda p: bnb.optim.AdamW8bit(p, lr=6e-4, betas=(0.9, 0.95))
    except ImportError as exc:
        print(json.dumps({"part": "optimizer", "name": "bitsandbytes AdamW8bit", "skipped": str(exc)}))
    return made


def bench_optimizers(model: torch.nn.Module, args: argparse.Namespace) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    count = sum(p.numel() for p in params)
    for name, make in optimizers().items():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        opt = make(params)
        try:
            opt.step()  # states exist from here
            torch.cuda.synchronize()
            state = torch.cuda.memory_allocated() - before
            ms = timed(opt.step, args.steps, args.warmup)
            print(json.dumps({"part": "optimizer", "name": name, "parameters": count, "ms": round(ms, 2),
                              "state_gib": round(state / 2**30, 3), "state_bytes_per_parameter": round(state / count, 3)}))
        except Exception as exc:  # a library that does not run here: say so, measure the rest
            print(json.dumps({"part": "optimizer", "name": name, "failed": f"{type(exc).__name__}: {exc}"[:300]}))
        del opt
        torch.cuda.empty_cache()
    for p in params:
        p.grad = None


def losses(vocab: int) -> dict[str, Callable]:
    def framework(hidden, weight, targets):
        logits = F.linear(hidden, weight.to(hidden.dtype))
        return F.cross_entropy(logits.float(), targets)

    made: dict[str, Callable] = {"eager CE": framework, "compiled CE": torch.compile(framework)}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        fused = LigerFusedLinearCrossEntropyLoss()
        made["liger fused linear CE"] = lambda hidden, weight, targets: fused(weight.to(hidden.dtype), hidden, targets)
    except ImportError as exc:
        print(json.dumps({"part": "loss", "name": "liger fused linear CE", "skipped": str(exc)}))
    return made


def bench_losses(hidden_size: int, vocab: int, args: argparse.Namespace) -> None:
    tokens = args.batch * args.seq_len
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) * 0.02).requires_grad_()
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    reference = None
    for name, loss_fn in losses(vocab).items():
        def step() -> torch.Tensor:
            weight.grad = hidden.grad = None
            loss = loss_fn(hidden, weight, targets)
            loss.backward()
            return loss

        try:
            value = float(step())
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = timed(step, args.steps, args.warmup)
            peak = torch.cuda.max_memory_allocated() - base
            reference = value if reference is None else reference
            print(json.dumps({"part": "loss", "name": name, "tokens": tokens, "vocab": vocab, "ms": round(ms, 2),
                              "peak_above_inputs_gib": round(peak / 2**30, 3), "loss": round(value, 5),
                              "loss_minus_eager": round(value - reference, 6)}))
        except Exception as exc:
            print(json.dumps({"part": "loss", "name": name, "failed": f"{type(exc).__name__}: {exc}"[:300]}))
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="hf:llama")
    p.add_argument("--model-config", default="")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="sequences in the loss's batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark measures a GPU: run it on one")
    torch.backends.cuda.matmul.allow_tf32 = True
    built = hub.build_hf(args.model, hub.parse_model_config(args.model_config), args.seq_len)
    model = built["model"].cuda()
    config = model.config
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "model": args.model,
                      "parameters": sum(p.numel() for p in model.parameters())}))
    bench_optimizers(model, args)
    hidden_size, vocab = int(config.hidden_size), int(config.vocab_size)
    del model
    torch.cuda.empty_cache()
    bench_losses(hidden_size, vocab, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
