"""A hand-written nanoGPT-style training loop: the figure a search of a language model must beat.

Issue 19 asks that ``autotune search --model hf:gpt2 --seq-len 1024`` recommend a configuration
faster than what a careful engineer writes by hand, measured in the same device call. This is that
hand-written loop, as nanoGPT's train.py does it: the same Hugging Face model built offline from
its model type's default configuration, bf16 autocast, TF32 matmuls, torch.compile, fused AdamW (lr
6e-4, betas 0.9/0.95, weight decay 0.1), flash attention through SDPA, random tokens (the search's
own batches), the loss on next-token prediction (cross-entropy on the logits, computed inside the
compiled function as nanoGPT's forward does). It times
``--steps`` steps after ``--warmup`` with CUDA events (wall clock on a CPU) and prints one JSON
line: the median step time, tokens/s, samples/s and the peak memory.

    python3 scripts/lm_baseline.py --model-type gpt2 --seq-len 1024 --batch-size 16
    python3 scripts/lm_baseline.py --model-type gpt2 --model-config n_layer=2,n_embd=64,n_head=2 \\
        --seq-len 32 --batch-size 4 --device cpu --no-compile --steps 5 --warmup 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.workload.hub import (  # noqa: E402  (the search's own)
    causal_sdpa, hf_config, nanogpt_adamw, parse_model_config, random_tokens)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-type", default="gpt2", help="a transformers model type (default gpt2)")
    p.add_argument("--model-config", default="", help="config overrides, e.g. n_layer=12,n_embd=768")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--no-compile", action="store_true", help="eager (torch.compile off)")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (the compile among them)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.seq_len < 2 or args.batch_size < 1 or args.steps < 1 or args.warmup < 1:
        p.error("--seq-len must be >= 2, --batch-size, --steps and --warmup >= 1")
    return args


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import AutoModelForCausalLM

    config = hf_config(f"hf:{args.model_type}", parse_model_config(args.model_config))
    torch.manual_seed(0)
    # SDPA with is_causal=True and no mask, as nanoGPT calls it (flash attention, also compiled)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=causal_sdpa()).to(args.device).train()
    # nanoGPT's AdamW (no decay on biases and norms), the one the search trains language models with
    return model, nanogpt_adamw(model, fused=args.device == "cuda")


def attention_kernel(device: str) -> contextlib.AbstractContextManager[Any]:
    """Flash attention on a GPU (as nanoGPT's F.scaled_dot_product_attention gets it); PyTorch's
    choice on a CPU."""
    if device != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    model, optimizer = build(args)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    # the search's own batches: seq_len + 1 random tokens a sequence, the targets shifted by one
    batches = [tuple(t.to(args.device) for t in random_tokens(args.batch_size, g, vocab_size=vocab,
                                                              seq_len=args.seq_len)) for _ in range(4)]

    def forward_loss(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens).logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    # nanoGPT computes the loss inside the forward it compiles: one graph, logits to loss
    forward = forward_loss if args.no_compile else torch.compile(forward_loss)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        with attention_kernel(args.device):
            with torch.autocast(args.device, dtype=torch.bfloat16):  # the forward only, as nanoGPT
                loss = forward(tokens, targets)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    for i in range(args.warmup):
        loss = step(batches[i % len(batches)])
    float(loss.detach())  # synchronises
    warmup_s = time.perf_counter() - start
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [timed_step(step, batches[i % len(batches)], args.device) for i in range(args.steps)]
    step_ms = statistics.median(times)
    tokens = args.batch_size * args.seq_len
    return {"model_type": args.model_type, "model_config": args.model_config, "seq_len": args.seq_len,
            "batch_size": args.batch_size, "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__,
            "compile": not args.no_compile, "parameters": sum(p.numel() for p in model.parameters()),
            "step_ms": step_ms, "step_ms_p10": quantile(times, 0.1), "step_ms_p90": quantile(times, 0.9),
            "tokens_per_s": tokens / (step_ms / 1e3), "samples_per_s": args.batch_size / (step_ms / 1e3),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
            "warmup_s": warmup_s, "steps": args.steps, "final_loss": float(loss.detach())}


def timed_step(step, batch: tuple[torch.Tensor, torch.Tensor], device: str) -> float:
    """One step's time in ms: CUDA events on a GPU, the wall clock (after the loss is read) on a CPU."""
    if device == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step(batch)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)
    start = time.perf_counter()
    float(step(batch).detach())
    return (time.perf_counter() - start) * 1e3


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
