"""The memory probe's premise, measured: what cudnn.benchmark costs the probe, and what it does to the
line through its peaks (autotune.search.fit.PROBE_BATCHES).

The search's memory probe runs the plain recipe eagerly (bf16 autocast, channels_last, fused AdamW)
for two steps at batch 1 and at batch 8; a line through the two peaks sizes every trial. With
cudnn.benchmark on (the plain recipe's), each new shape times every convolution's algorithms afresh.
This script does what the probe does, with cudnn.benchmark on and off, each in a process of its own,
then three steps at --check-batch to see how far the line's prediction is from the peak there:

    python3 scripts/memory_probe_bench.py --models resnet50 timm:convnext_tiny

It prints one JSON line per (model, benchmark): the seconds and peak MiB at each probed batch, the
line's prediction at --check-batch and the peak measured there. GPU only; nothing here is autotune's
own code but the probe's batches (fit.PROBE_BATCHES), so that it measures the ones the probe steps at.

On the H100 80GB HBM3 (torch 2.11.0+cu130, timm 1.0.31; measured at ec835cb by this script's first
form, the same steps in one file), the probe's two batches took, with cudnn.benchmark on and off:
ResNet-50 13.4 s and 0.8 s, the line's batch-256 peak 2.5% over and 3.3% under the measured 11,369
MiB; ConvNeXt-T 9.8 s and 4.5 s, 3.9% over and 1.6% under 15,847 MiB. Step times at 256 were the same
(64.2 and 64.1 ms; 92.1 and 92.0 ms).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.search.fit import PROBE_BATCHES  # noqa: E402


def build(name: str):
    """A torchvision model by name, or timm's for ``timm:NAME`` (1,000 classes)."""
    if name.startswith("timm:"):
        import timm

        return timm.create_model(name[5:], num_classes=1000)
    import torchvision

    return getattr(torchvision.models, name)()


def one(name: str, benchmark: bool, check_batch: int) -> dict:
    """The probe's steps and the check, in this process."""
    import torch

    t0 = time.perf_counter()
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model = build(name).cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    loss_fn = torch.nn.CrossEntropyLoss()

    def steps(batch: int, n: int) -> float:
        x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            with torch.autocast("cuda", torch.bfloat16):
                loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    out = {"model": name, "benchmark": benchmark, "build_s": round(time.perf_counter() - t0, 2), "batches": {}}
    for batch in PROBE_BATCHES:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        seconds = steps(batch, 2)
        out["batches"][batch] = {"s": round(seconds, 2), "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)}
    (low, a), (high, b) = [(k, v["peak_mib"]) for k, v in out["batches"].items()]
    out["predicted_mib"] = round(a + (b - a) / (high - low) * (check_batch - low), 1)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    out["check"] = {"batch": check_batch, "ms_a_step": round(steps(check_batch, 3) / 3 * 1e3, 1),
                    "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)}
    out["prediction_off_by"] = round(out["predicted_mib"] / out["check"]["peak_mib"] - 1, 4)
    out["probe_s"] = round(sum(v["s"] for v in out["batches"].values()), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet50"])
    parser.add_argument("--check-batch", type=int, default=256)
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "ON_OFF"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1] == "on", args.check_batch)))
        return
    for name in args.models:
        for state in ("on", "off"):  # a process each: cuDNN's choices and the allocator start clean
            done = subprocess.run([sys.executable, __file__, "--one", name, state, "--check-batch",
                                   str(args.check_batch)], capture_output=True, text=True)
            print(done.stdout.strip().splitlines()[-1] if done.returncode == 0 else
                  json.dumps({"model": name, "benchmark": state == "on", "error": done.stderr.strip()[-500:]}),
                  flush=True)


if __name__ == "__main__":
    main()
