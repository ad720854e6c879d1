"""Measure the accuracy check's synthetic data (issue 37, item 2): train FP32 twice per seed with the
check's own code path (``autotune.accuracy.worker.check.datasets`` and ``train_run``: the reference, and its
twin with the data in another order, as ``run_check`` trains them) and print, per model, the median
over seeds of FP32's final held-out accuracy and of the reshuffle noise (|reference - twin|, in
points); for a language model, of the held-out loss against the uniform entropy and of its noise as a
share of FP32's loss decrease. ``--configs bf16`` also trains bf16 autocast and prints its drop.

    python3 scripts/teacher_calibration.py                                 # CPU defaults, 3 seeds
    python3 scripts/teacher_calibration.py --models mlp --steps 300 --batch 64 --held-out 1024 4096
    python3 scripts/teacher_calibration.py --models resnet18 --steps 300 --batch 64 --held-out 1024 4096 \
        --seeds 0 --log runs/teacher.jsonl                                 # then --seeds 1, 2: 5 min each

The targets: FP32 between 60% and 90% held-out accuracy, reshuffle noise at most 1 point (medians).
Models (``--models``): tiny_cnn, mlp (tests/fake_models.py's tiny_cnn and fp8_mlp), resnet18
(torchvision), tiny_vit (a 4-layer ViT on 4x4 patches, below), all at 3x32x32 unless ``--size``;
tiny_lm (tests/fake_models.py, 1,003 tokens) and gpt2_tiny (hf:gpt2's 50,257 tokens, 2 layers of 64).

Measured on 2 shared CPU cores, one thread, seeds 0-2, at the GPU defaults (300 steps of 64), FP32
held-out accuracy and reshuffle noise, medians on 4,096 held-out samples (on the first 1,024):
ResNet-18 86.2% (86.6%), noise 0.24 (0.39) points, 80 s a run; the MLP 74.8% (76.9%), 0.10 (0.68);
tiny_vit 65.4% (67.2%), 3.1 (3.2): its runs differ, not its samples; tiny_cnn 52.3% (50.5%), 0.39
(0.88): its 7-pixel receptive field sees less than the teacher's pattern. TinyLM's held-out loss went
from 6.77 (its first steps' training loss; ln 1,003 = 6.91) to 6.12, noise 0.0008 of that decrease.
At the CPU defaults (100 steps of 16, 512 held out) the MLP read 66.8%, noise 1.2 points; tiny_cnn
39.3%, 2.7; TinyLM 6.90 -> 6.15, noise 0.003; gpt2_tiny 10.70 -> 8.95 (uniform 10.82), noise 0.003.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # autotune, strategies
sys.path.insert(0, str(ROOT / "tests"))  # fake_models
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this file's tiny_vit

MODELS = {
    "tiny_cnn": "fake_models:tiny_cnn",
    "mlp": "fake_models:fp8_mlp",
    "resnet18": "resnet18",
    "tiny_vit": "teacher_calibration:tiny_vit",
    "tiny_lm": "fake_models:tiny_lm",
    "gpt2_tiny": "hf:gpt2",
}
GPT2_TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2}
"""hf:gpt2's architecture and 50,257-token vocabulary at a CPU's size (sequences of 32 tokens)."""
CONFIGS = {"bf16": {"precision": {"mode": "bf16"}}, "fp16_no_scaler": {"precision": {"mode": "fp16"}}}


def tiny_vit(num_classes: int = 10):
    """A ViT small enough for a CPU: 3x32x32 images in 4x4 patches, 4 layers of width 128."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=256,
                             num_classes=num_classes)


def measure(name: str, seed: int, args) -> dict:
    """FP32 and its reshuffled twin (and each of ``--configs``) on ``name`` with ``seed``."""
    from autotune.accuracy.settings import AccuracySettings
    from autotune.accuracy.worker.check import datasets, train_run
    from autotune.space import SearchSpace
    from autotune.workload.models import WorkloadSpec

    if name == "gpt2_tiny":
        spec = WorkloadSpec(model="hf:gpt2", model_config=GPT2_TINY, seq_len=32)
    else:
        spec = WorkloadSpec(model=MODELS[name], input_shape=None if name == "tiny_lm" else (3, args.size, args.size),
                            num_classes=10)
    settings = AccuracySettings(steps=args.steps, batch_size=args.batch, held_out_size=max(args.held_out),
                                seed=seed)
    space = SearchSpace(device="cpu", precisions=["fp32", "bf16"])
    data = datasets(spec, settings, "cpu")
    with prefixes_evaluated(sorted(args.held_out)[:-1]):
        reference = train_run(spec, {}, space, settings, data, label="FP32")
        twin = train_run(spec, {}, space, settings, data, order_seed=seed + 1, label="FP32, reshuffled")
        row = {"data": data.source, "ref": reference, "twin": twin}
        for config in args.configs:
            row[config] = train_run(spec, CONFIGS[config], space, settings, data, label=config)
    return row


@contextlib.contextmanager
def prefixes_evaluated(sizes: list[int]):
    """The check's held-out evaluation, also on the first ``n`` held-out samples for each ``n`` in
    ``sizes`` (a held-out set of n is those samples: each is a function of its index), reported as
    ``held_out_accuracy@n`` and ``held_out_loss@n``: one training run gives the noise at each size."""
    import dataclasses

    from torch.utils.data import Subset

    from autotune.accuracy.worker import check

    original = check._evaluate

    def evaluate(model, workload, recipe, data, settings, device):
        out = original(model, workload, recipe, data, settings, device)
        for n in sizes:
            prefix = dataclasses.replace(data, held_out=Subset(data.held_out, range(n)))
            part = original(model, workload, recipe, prefix, settings, device)
            out.update({f"{key}@{n}": value for key, value in part.items() if key != "held_out_size"})
        return out

    check._evaluate = evaluate
    try:
        yield
    finally:
        check._evaluate = original


def summary(name: str, rows: list[dict], configs: list[str], size: int, largest: bool) -> str:
    """One model's medians over seeds at held-out size ``size``, in words."""
    med = statistics.median
    at = "" if largest else f"@{size}"
    if rows[0]["ref"].get("held_out_accuracy") is not None:
        key = "held_out_accuracy" + at
        acc = [r["ref"][key] for r in rows]
        noise = [abs(r["ref"][key] - r["twin"][key]) for r in rows]
        text = (f"{name}, held-out {size}: FP32 accuracy median {med(acc):.2f}% (seeds: "
                f"{', '.join(f'{a:.1f}' for a in acc)}), reshuffle noise median {med(noise):.2f} points "
                f"(max {max(noise):.2f})")
        for config in configs:
            drops = [r["ref"][key] - r[config][key] for r in rows]
            text += f"; {config} drop median {med(drops):.2f} points (max {max(drops):.2f})"
        return text
    key = "held_out_loss" + at

    def drift(run, ref):  # the share of FP32's held-out loss decrease (from its initial training loss) lost
        return (run[key] - ref[key]) / (ref["initial_loss"] - ref[key])

    loss = [r["ref"][key] for r in rows]
    noise = [abs(drift(r["twin"], r["ref"])) for r in rows]
    text = (f"{name}, held-out {size}: FP32 held-out loss median {med(loss):.3f} (initial training loss "
            f"{med(r['ref']['initial_loss'] for r in rows):.3f}; seeds: {', '.join(f'{v:.3f}' for v in loss)}), "
            f"reshuffle noise median {med(noise):.4f} of FP32's decrease (max {max(noise):.4f}; |difference| "
            f"median {med(abs(r['ref'][key] - r['twin'][key]) for r in rows):.4f})")
    for config in configs:
        drifts = [drift(r[config], r["ref"]) for r in rows]
        text += f"; {config} drift median {med(drifts):.4f} (max {max(drifts):.4f})"
    return text


def logged(path: Path | None) -> list[dict]:
    if path is None or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny_cnn", "mlp", "tiny_lm"], choices=sorted(MODELS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="seeds (each: initial weights, teacher, data order)")
    parser.add_argument("--log", type=Path, help="a JSON-lines file: each seed's runs are added to it, and the "
                        "medians are over every seed in it of the same model and settings (seeds run apart)")
    parser.add_argument("--steps", type=int, default=100, help="the check's CPU default: 100 (GPU: 300)")
    parser.add_argument("--batch", type=int, default=16, help="the check's CPU default: 16 (GPU: 64)")
    parser.add_argument("--held-out", type=int, nargs="+", default=[512],
                        help="held-out sizes (the check's CPU default: 512, GPU: 1024); several: one run, each prefix")
    parser.add_argument("--size", type=int, default=32, help="image side (3 x size x size)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared CPU)")
    parser.add_argument("--configs", nargs="*", default=[], choices=sorted(CONFIGS))
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(f"{args.steps} steps, batch {args.batch}, held-out {max(args.held_out)}, seeds {args.seeds}, "
          f"images 3x{args.size}x{args.size}, {args.threads} thread(s)", flush=True)
    started = time.perf_counter()
    for name in args.models:
        key = json.dumps([name, args.steps, args.batch, sorted(args.held_out), args.size, sorted(args.configs)])
        rows = [row for row in logged(args.log) if row["key"] == key]
        for seed in args.seeds:
            rows = [row for row in rows if row["seed"] != seed] + [{"key": key, "seed": seed,
                                                                      **measure(name, seed, args)}]
            r = rows[-1]
            if args.log is not None:
                with args.log.open("a") as f:
                    f.write(json.dumps(r) + "\n")
            metric = "held_out_accuracy" if r["ref"].get("held_out_accuracy") is not None else "held_out_loss"
            extra = "".join(f", {c} {r[c][metric]:.4g}" for c in args.configs)
            print(f"  {name} seed {seed}: FP32 {metric} {r['ref'][metric]:.4g}, reshuffled {r['twin'][metric]:.4g}{extra} "
                  f"({r['ref']['wall_s']:.1f} s a run)", flush=True)
        print(f"  data: {rows[0]['data']}; seeds {sorted(r['seed'] for r in rows)}; "
              f"{statistics.median(r['ref']['wall_s'] for r in rows):.1f} s a run")
        for size in sorted(args.held_out):
            print(summary(name, rows, args.configs, size, size == max(args.held_out)), flush=True)
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
