"""Repeat the numerics parity check's controls and must-fail cases with different seeds on the CPU,
and print per case and model how often it passed, the median deviation and the median band of the
figure that decided it (issue 58's done-when: each must-fail configuration failing every time on each
model, each control passing at least 19 times in 20). Exits 1 when a case misses its expectation.

    python3 scripts/parity_calibration.py                      # 20 seeds, 40 steps, every model
    python3 scripts/parity_calibration.py --repeats 3 --models llama,convnext
    python3 scripts/parity_calibration.py --save runs.jsonl    # each verdict, to re-read with --load
    python3 scripts/parity_calibration.py --load runs.jsonl --k 2.5 --size-floor 0.1   # judged again
    python3 scripts/parity_calibration.py --load reports/parity-calibration/*.jsonl.xz   # the committed table

Each seed draws new initial weights, data and calibration directions; each model's FP32 reference
and calibrations are trained once per seed (and per loss weighting) and shared by its cases. The
models and the faults no knob offers are parity_models.py's. Runs at one thread (torch.set_num_threads),
so that the "other thread count" control runs at two. ResNet-18's 16-bit rows run channels_last: on a
CPU without bf16 or fp16 matrix instructions its contiguous bf16 convolutions take a slow path
(about 5 s a step), and the memory format is not a numerics knob.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # parity_models
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # autotune, strategies

import parity_models  # noqa: E402

from autotune.accuracy.worker.parity import ParitySettings, check_parity, parity_recipe  # noqa: E402
from autotune.accuracy.worker.parity_verdict import (  # noqa: E402
    ParityResult,
    apply_bands,
    describe,
    figures_out_of_band,
    global_checks,
    verdict_of,
)
from autotune.workload.models import WorkloadSpec  # noqa: E402

FP16 = {"precision": {"mode": "fp16"}}
FP16_SCALED = {"precision": {"mode": "fp16"}, "grad_scaler": {"enabled": True, "init_scale": 65536.0}}
BF16 = {"precision": {"mode": "bf16"}}
CHANNELS_LAST = {"memory_format": {"format": "channels_last"}}
MODELS = ("resnet18", "convnext", "llama")

# (case, model ("{m}" for each of MODELS), knobs, transform or None, expectation: "pass", "fail" or "report")
REAL = [
    ("MUST FAIL bf16 weights, no FP32 master copy", "{m}", BF16, parity_models.bf16_weights, "fail"),
    ("MUST FAIL one norm gain's gradient zeroed", "{m}", {}, parity_models.zero_grad_of(), "fail"),
    ("MUST FAIL fp16, no GradScaler, underflowing gradients", "{m}_underflow", FP16, None, "fail"),
    ("MUST FAIL fp16, no GradScaler, loss x 2^-14", "{m}_loss_2m14", FP16, None, "fail"),
    ("MUST FAIL Adam states rounded to 4 bits", "{m}", {}, parity_models.coarse_optimizer_states(4), "fail"),
    ("MUST FAIL weights in a 3-bit mantissa", "{m}", {}, parity_models.weights_in_mantissa(3), "fail"),
    ("control: FP32, 2 threads (another reduction order)", "{m}", {"threads": {"num_threads": 2}}, None, "pass"),
    ("control: bf16 autocast (FP32 master weights)", "{m}", BF16, None, "pass"),
    # reported, not a control: its second moment's 8-bit codes are coarsest for the smallest values of a block, and
    # an element whose v is rounded far down moves by about m / sqrt(v): on ResNet-18 a conv weight's update was
    # 24x FP32's, on the Llama rarely seen embedding rows 67x (Li et al. 2023's zero-point problem, arXiv 2309.01507)
    ("8-bit AdamW states (torchao)", "{m}", {"optimizer_state": {"state": "8bit"}}, None, "report"),
    ("control: space-to-depth stem", "resnet18", {"stem_conv": {"stem": "space_to_depth"}}, None, "pass"),
]
SMALL = [
    ("MUST FAIL fp16, no GradScaler, underflowing gradients", "underflow_mlp", FP16, None, "fail"),
    ("control: fp16 + GradScaler, underflowing gradients", "underflow_mlp", FP16_SCALED, None, "pass"),
    ("MUST FAIL fp16, overflowing activations", "overflow_mlp", FP16, None, "fail"),
    ("MUST FAIL fp16 + GradScaler, overflowing activations", "overflow_mlp", FP16_SCALED, None, "fail"),
    ("MUST FAIL bf16 weights, no FP32 master copy", "wide_linear", BF16, parity_models.bf16_weights, "fail"),
    ("control: bf16 autocast (FP32 master weights)", "wide_linear", BF16, None, "pass"),
    ("control: FP32, activation checkpointing every block", "mlp", {"activation_checkpointing": {"every": 1}}, None,
     "pass"),
    ("control: bf16 autocast", "mlp", BF16, None, "pass"),
]


def cases(models: list[str], small: bool) -> list[tuple]:
    """The rows to run: each of REAL on each model it names (ResNet-18's 16-bit ones channels_last),
    then SMALL's on parity_models' small models."""
    rows = []
    for case, model, knobs, transform, expect in REAL:
        for m in models:
            if "{m}" not in model and model != m:
                continue
            name = model.format(m=m)
            if m == "resnet18" and "precision" in knobs:
                knobs = {**knobs, **CHANNELS_LAST}
            rows.append((case, m, name, knobs, transform, expect))
    if small:
        rows += [(case, model, model, knobs, transform, expect) for case, model, knobs, transform, expect in SMALL]
    return rows


def run(args, rows) -> dict[tuple[str, str], list[dict]]:
    """Every row at every seed: the verdicts' dicts by (case, model)."""
    import torch

    torch.set_num_threads(1)
    results: dict[tuple[str, str], list[dict]] = {(row[0], row[1]): [] for row in rows}
    saved = open(args.save, "a") if args.save else None
    for seed in range(args.first_seed, args.first_seed + args.repeats):
        settings = ParitySettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=seed,
                                  calibrations=args.calibrations)
        references: dict[str, dict] = {}
        for case, model, name, knobs, transform, _ in rows:
            started = time.perf_counter()
            recipe = parity_recipe(knobs, "cpu")
            if transform is not None:
                recipe.model_transforms.append(transform)
            result, references[name] = check_parity(WorkloadSpec(model=f"parity_models:{name}"), knobs, settings,
                                                    reference=references.get(name), recipe=recipe, label=case)
            entry = {"case": case, "model": model, "seed": seed, "result": result.to_dict()}
            results[(case, model)].append(entry["result"])
            if saved:
                saved.write(json.dumps(entry) + "\n")
                saved.flush()
            print(f"seed {seed} {model:9s} {time.perf_counter() - started:6.1f} s  {result.reason}", file=sys.stderr,
                  flush=True)
    return results


def rejudged(result: dict, settings: ParitySettings) -> dict:
    """A saved verdict judged again by ``settings``' bands (its figures and noise kept): what other
    ``k`` and floors would have said. A run that stopped on its first gradients stays stopped."""
    r = ParityResult.from_dict(result)
    apply_bands(r.tensors, settings)
    loss = next(f for f in r.figures if f["figure"] == "loss")["measured"]
    r.figures = global_checks(loss, r.progress_drift, {"loss_deviation": r.calibration_loss_deviation,
                                                       "progress_drift": r.calibration_drift}, settings)
    r.figures += figures_out_of_band(r.tensors)
    r.verdict = verdict_of(r.figures, unstable=r.verdict == "unstable", stopped=r.stopped)
    r.reason = describe(r)
    return r.to_dict()


def _deciding(r: dict, expect: str) -> dict | None:
    """The figure that decided a verdict: a failure's furthest past its band, a pass's closest to it."""
    judged = [f for f in r["figures"] if f["band"] is not None]
    return max(judged, key=lambda f: f["share"]) if judged else None


def _fmt(x) -> str:
    return "-" if x is None else ("inf" if x == math.inf else f"{x:.3g}")


def table(results: dict[tuple[str, str], list[dict]]) -> tuple[list[str], bool, float]:
    """The printed table, whether every case met its expectation, and the widest band of any judged
    figure relative to its quantity."""
    expects = {(c[0], m): c[-1] for c in REAL + SMALL for m in (*MODELS, c[1])}
    head = (f"{'case':54s} {'model':13s} {'expect':6s} {'passed':>7s} {'deciding figure (most often)':28s} "
            f"{'med dev':>8s} {'med band':>8s} {'margin':>7s} verdicts")
    lines, ok, widest = [head, "-" * len(head)], True, 0.0
    for (case, model), rs in results.items():
        if not rs:
            continue
        expect = expects.get((case, model), "report")
        passed = sum(r["verdict"] == "passed" for r in rs)
        decided = [d for d in (_deciding(r, expect) for r in rs) if d is not None]
        for r in rs:
            widest = max([widest] + [f["band"] for f in r["figures"] if f["band"] is not None])
        kinds = [d["figure"] for d in decided]
        kind = max(set(kinds), key=kinds.count) if kinds else "-"
        same = [d for d in decided if d["figure"] == kind]
        shares = [d["share"] for d in decided]
        margin = (min(shares) if expect == "fail" else max(shares)) if shares else math.nan
        verdicts = ", ".join(f"{v} {sum(r['verdict'] == v for r in rs)}" for v in ("passed", "violated", "unstable")
                             if any(r["verdict"] == v for r in rs))
        lines.append(f"{case:54s} {model:13s} {expect:6s} {passed:>4d}/{len(rs):<2d} {kind:28s} "
                     f"{_fmt(statistics.median(d['measured'] for d in same) if same else None):>8s} "
                     f"{_fmt(statistics.median(d['band'] for d in same) if same else None):>8s} "
                     f"{_fmt(margin):>6s}x {verdicts}")
        if expect == "pass" and passed < len(rs) - len(rs) // 20 or expect == "fail" and passed > 0:
            ok = False
    return lines, ok, widest



def _read_text(path: str) -> str:
    """A saved file's text, read through xz or gzip where its name ends so (the committed runs are xz)."""
    import gzip
    import lzma

    opener = {".xz": lzma.open, ".gz": gzip.open}.get(Path(path).suffix, open)
    with opener(path, "rt") as f:
        return f.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = ParitySettings()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--calibrations", type=int, default=defaults.calibrations)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--no-small", action="store_true", help="leave out the rows on parity_models' small models")
    parser.add_argument("--cases", default="", help="comma-separated words: only the cases whose name holds one")
    parser.add_argument("--skip", default="", help="comma-separated words: not the cases whose name holds one")
    parser.add_argument("--save", help="append each verdict to this JSON-lines file")
    parser.add_argument("--load", nargs="+", help="judge the verdicts of these files again (no runs)")
    for name in ("k", "loss_floor", "grad_floor", "size_floor", "share_floor", "drift_floor", "max_band"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    args = parser.parse_args(argv)
    settings = ParitySettings(k=args.k, loss_floor=args.loss_floor, grad_floor=args.grad_floor,
                              size_floor=args.size_floor, share_floor=args.share_floor, drift_floor=args.drift_floor,
                              max_band=args.max_band)
    started = time.perf_counter()
    if args.load:
        entries: dict[tuple[str, str, int], dict] = {}  # a row run again (a run cut and resumed): its last
        for path in args.load:
            for line in _read_text(path).splitlines():
                entry = json.loads(line)
                entries[(entry["case"], entry["model"], entry["seed"])] = entry
        results: dict[tuple[str, str], list[dict]] = {}
        for (case, model, _), entry in sorted(entries.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            results.setdefault((case, model), []).append(rejudged(entry["result"], settings))
        counts = sorted({len(rs) for rs in results.values()})
        seeds = f"saved ({'-'.join(map(str, counts[::max(1, len(counts) - 1)]))} seeds a row)"
    else:
        rows = cases([m for m in args.models.split(",") if m], small=not args.no_small)
        words = [w for w in args.cases.split(",") if w]
        rows = [row for row in rows if not words or any(w in row[0] for w in words)]
        rows = [row for row in rows if not any(w in row[0] for w in args.skip.split(",") if w)]
        results = run(args, rows)
        seeds = f"{args.repeats} seeds ({args.first_seed}-{args.first_seed + args.repeats - 1})"
    lines, ok, widest = table(results)
    print(f"{seeds}, {args.steps} steps, batch {args.batch_size}, AdamW lr {args.lr:g}, {args.calibrations} "
          f"calibrations; band = {settings.k:g} x the calibrations' largest + a floor (loss {settings.loss_floor:.3g}, "
          f"progress {settings.drift_floor:.3g}, error {settings.grad_floor:.3g}, size {settings.size_floor:.3g}, "
          f"share {settings.share_floor:.3g}), judged where at most {settings.max_band:g}. 'deciding figure': a "
          f"failure's furthest past its band, a pass's closest to it; 'margin': its deviation / band, the smallest of "
          f"a must-fail's runs, the largest of the others'")
    print("\n".join(lines))
    print(f"widest band judged by: {widest:.3g} of its quantity")
    print(f"{'every case as expected' if ok else 'A CASE MISSED ITS EXPECTATION'} "
          f"({time.perf_counter() - started:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
