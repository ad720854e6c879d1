"""What Inductor's tuning options do to a compiled plain-recipe training step: torchvision's
ResNet-50 or ViT-B/16 (bf16 autocast, TF32, channels_last for the ConvNet, cudnn.benchmark, fused
AdamW, torch.compile), compiled once per arm, the arms alternating so that clocks and heat treat
them alike.

    python3 scripts/inductor_options_bench.py --model resnet50 --batch 1024 --arms default,coordinate_descent

Arms (each a ``torch.compile`` of the same forward and loss):

* ``default``: ``torch.compile(fn)``, the plain recipe's;
* ``coordinate_descent``: ``options={"coordinate_descent_tuning": True}``: Inductor benchmarks each
  generated Triton kernel's block sizes and warps around its heuristic choice and keeps the fastest
  (the part of max-autotune that touches only Inductor's own kernels: no GEMM or convolution
  templates, so no template benchmarking at compile);
* ``pointwise``: ``options={"max_autotune_pointwise": True}``: more candidate configurations for the
  pointwise and reduction kernels, benchmarked.

It prints one JSON line per arm with its compile seconds (the warm-up steps' wall time, which is
mostly compiling), one per round and arm (median step milliseconds by CUDA events), then a summary
with each arm's median and its speed over ``default``. GPU only.

On the H100 (torch 2.11.0+cu130), ResNet-50 at batch 1,024 compiled in 42 s by default and had not
finished compiling with coordinate_descent after 158 s more; ViT-B/16 at 512, 20.7 s against more
than 149 s (reports/inductor-options-h100): too slow for a 5-minute search.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_parts_bench import alternate, image_step  # noqa: E402  (this script's folder is on sys.path)

ARMS = {"default": None, "coordinate_descent": {"coordinate_descent_tuning": True},
        "pointwise": {"max_autotune_pointwise": True}}
"""Each arm's ``torch.compile`` options (None: the default mode, no options)."""


def step_fn(model_name: str, options: dict | None, batch: int):
    """The model's compiled training step at ``batch``, compiled with ``options``."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)()
    convnet = model_name.startswith(("resnet", "convnext", "efficientnet", "mobilenet", "regnet"))
    model = model.cuda()
    if convnet:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    return image_step(model, optimizer, batch, channels_last=convnet, options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", help="a torchvision classification model's name")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--arms", default="default,coordinate_descent",
                        help=f"comma-separated, from {', '.join(ARMS)}; the first is the one the others are compared with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    names = args.arms.split(",")
    if unknown := [n for n in names if n not in ARMS]:
        parser.error(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    arms = {}
    for name in names:
        step = step_fn(args.model, ARMS[name], args.batch)
        start = time.perf_counter()
        for _ in range(args.warmup):  # compiles (and tunes), and cuDNN picks its algorithms
            step()
        torch.cuda.synchronize()
        arms[name] = step
        print(json.dumps({"arm": name, "options": ARMS[name], "warmup_s": round(time.perf_counter() - start, 1)}),
              flush=True)
    summary = alternate(arms, args.rounds, args.steps, args.batch, warmup=1)
    base = summary[names[0]]
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
                      "batch": args.batch, "median_step_ms": summary,
                      f"speed_over_{names[0]}": {n: round(base / ms, 4) for n, ms in summary.items()}}))


if __name__ == "__main__":
    main()
