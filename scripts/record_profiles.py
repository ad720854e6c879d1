"""Record profiler windows of known configurations on a GPU: the test fixtures of the profile
analysis (tests/fixtures/profile-*.json.gz), their Chrome traces, and a real NVML window of the
same steps.

    python3 scripts/record_profiles.py OUT_DIR [--steps 3]

Prints, per configuration, the analysis (shares of GPU time, kernels per step, copy overlap) and
the NVML figures of a timed window, so a fixture comes with what it showed when recorded.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
import time
from pathlib import Path

import torch

import strategies
from autotune.deploy.config import TunedConfig
from autotune.trial.nvml import NvmlMonitor
from autotune.trial.profile import analyze, record, save_fixture
from autotune.space import SearchSpace
from autotune.workload.models import WorkloadSpec, build

CONFIGS = {
    # name: (model, batch, params)
    "resnet50-fp32-nchw": ("resnet50", 64, {"precision.mode": "fp32", "memory_format.format": "contiguous",
                                            "streams.num_streams": 1}),
    "resnet50-fp16-nchw": ("resnet50", 128, {"precision.mode": "fp16", "memory_format.format": "contiguous",
                                             "streams.num_streams": 1}),
    "resnet50-fp16-cl-2streams": ("resnet50", 128, {"precision.mode": "fp16", "memory_format.format": "channels_last",
                                                    "streams.num_streams": 2}),
    "vit_b_16-bf16": ("vit_b_16", 32, {"precision.mode": "bf16", "memory_format.format": "contiguous",
                                       "streams.num_streams": 1}),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", help="comma-separated names: " + ",".join(CONFIGS))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(CONFIGS)
    summary = {}
    for name in names:
        model_name, batch, params = CONFIGS[name]
        space = SearchSpace(device="cuda", precisions=["fp32", "tf32", "fp16", "bf16"], batch_sizes=[batch],
                            base_batch_size=batch, memory_formats=["contiguous", "channels_last"],
                            stream_counts=[1, 2], cudnn_benchmark=[True])
        full = {"grad_scaler.init_scale": 2.0**16, "grad_scaler.growth_factor": 2.0, "grad_scaler.backoff_factor": 0.5,
                "grad_scaler.growth_interval": 2000, **params} if params["precision.mode"] == "fp16" else dict(params)
        cfg = TunedConfig.from_params(full, space)
        torch.manual_seed(0)
        workload = build(WorkloadSpec(model=model_name))
        model = workload.model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model, optimizer = cfg.prepare(model, optimizer)
        step = cfg.train_step(model, optimizer, workload.loss_fn)
        gen = torch.Generator(device="cuda").manual_seed(0)
        host = [(torch.randn((batch, *workload.input_shape), generator=gen, device="cuda").cpu().pin_memory(),
                 torch.randint(0, workload.num_classes, (batch,), generator=gen, device="cuda").cpu().pin_memory())
                for _ in range(3)]
        stream = iter(cfg.loader(itertools.cycle(host)))

        def one() -> None:
            x, y = next(stream)
            step(x, y)

        for _ in range(15):  # cudnn.benchmark picks its algorithms here
            one()
        torch.cuda.synchronize()
        # a timed window with NVML sampling (no profiler)
        monitor = NvmlMonitor(interval_s=0.05)
        try:
            monitor.begin_window()
            t0 = time.perf_counter()
            steps = 0
            while time.perf_counter() - t0 < 3.0:
                one()
                steps += 1
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            window = monitor.end_window()
        finally:
            monitor.close()
        trace = record(one, args.steps, chrome_trace=args.out / f"{name}.trace.json",
                       meta={"config": name, "model": model_name, "batch": batch, "params": full,
                             "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__})
        # what the timed window (no profiler) saw goes with the fixture: its step time is the
        # denominator of the shares (analyze(step_time_ms=...)), its NVML window the energy figures
        trace.meta["timed_samples_per_s"] = steps * batch / elapsed
        trace.meta["nvml"] = window.to_dict() if window else None
        save_fixture(trace, args.out / f"profile-{name}.json.gz")
        with open(args.out / f"{name}.trace.json", "rb") as src, gzip.open(args.out / f"{name}.trace.json.gz", "wb") as dst:
            dst.write(src.read())
        (args.out / f"{name}.trace.json").unlink()
        result = analyze(trace, step_time_ms=elapsed / steps * 1e3)
        result["timed_samples_per_s"] = steps * batch / elapsed
        result["nvml"] = window.to_dict() if window else None
        if window:
            result["joules_per_sample"] = window.joules_per_sample(steps * batch)
        summary[name] = result
        top = "; ".join(f"{k['name'][:70]} [{k['category']}] {k['share']:.1%}" for k in result["top_kernels"][:5])
        print(f"{name}: {result['timed_samples_per_s']:.0f} samples/s, TC {result['tensor_core_share']:.1%}, "
              f"other gemm/conv {result['other_gemm_conv_share']:.1%}, elementwise {result['elementwise_share']:.1%}, "
              f"layout {result['layout_share']:.1%}, memcpy {result['memcpy_share']:.1%}, idle {result['idle_share']:.1%}, "
              f"kernels/step {result['kernels_per_step']:.0f}, launches/step {result['launches_per_step']:.0f}, "
              f"copy overlap {result['copy_overlap']}, J/sample {result.get('joules_per_sample')}\n  top: {top}",
              flush=True)
        del model, optimizer, step, stream, host
        torch.cuda.empty_cache()
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
