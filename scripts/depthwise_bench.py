"""What the depthwise_conv knob's flipped input gradient does on a GPU: torchvision's ConvNeXt-T, a
training step in the plain recipe (bf16 autocast, TF32, channels_last, cudnn.benchmark, fused AdamW,
torch.compile), with its 18 depthwise convolutions' input gradient computed by cuDNN's backward-data
kernel ("framework") and by the forward kernel with the filters turned ("flipped",
strategies.depthwise_conv), alternating so that clocks and heat treat both alike.

    python3 scripts/depthwise_bench.py --batch 256 --rounds 3

It prints one JSON line per round and arm (median step milliseconds by CUDA events, images/s), then
one with each arm's median and the ratio flipped / framework. GPU only; the knob's own code is all of
autotune it uses. On the H100 (torch 2.11.0+cu130): 1.072x at batch 256 (65.11 against 60.76 ms), 1.077x
at 768 (187.80 against 174.33 ms): reports/depthwise-h100.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memory_parts_bench import alternate, image_step  # noqa: E402  (this script's folder is on sys.path)
from strategies.depthwise_conv import depthwise_layers, flip_input_grad  # noqa: E402


def step_fn(flipped: bool, batch: int):
    """ConvNeXt-T's compiled training step at ``batch``, and how many depthwise layers it has."""
    model = torchvision.models.convnext_tiny()
    layers = depthwise_layers(model)
    if flipped:
        flip_input_grad(model)
    model = model.cuda().to(memory_format=torch.channels_last)
    return layers, image_step(model, torch.optim.AdamW(model.parameters(), fused=True), batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    arms = {}
    for name in ("framework", "flipped"):
        layers, step = step_fn(name == "flipped", args.batch)
        for _ in range(args.warmup):  # compiles, and cuDNN picks its algorithms
            step()
        arms[name] = step
        print(json.dumps({"arm": name, "depthwise_convs": layers}), flush=True)
    summary = alternate(arms, args.rounds, args.steps, args.batch)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
                      "median_step_ms": summary, "flipped_over_framework_speed":
                      round(summary["framework"] / summary["flipped"], 4)}))


if __name__ == "__main__":
    main()
