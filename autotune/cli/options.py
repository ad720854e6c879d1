"""The command line's options: `autotune search`'s, in four groups (what to tune, budget and limits, output and
storage, scale-out; most used first), and those several commands share (add_option)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_search(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="run (or resume) a search and export the best configuration",
                       description="Find the fastest way to train a model on this machine: each configuration of "
                                   "the knobs (precision, batch size, memory format, torch.compile, CUDA graphs and "
                                   "the rest; docs/knobs.md) is measured in an isolated worker, and the best is "
                                   "exported as config.json.")
    # grouped by what a user decides, in the order they decide it; the most used first within each
    _add_tune_options(p.add_argument_group("what to tune", "the model, the device and the space searched"))
    _add_limit_options(p.add_argument_group("budget and limits", "how long the search runs, what each trial may use, "
                                                                 "and how much accuracy a configuration may cost"))
    _add_output_options(p.add_argument_group("output and storage", "where the config, the report and the study go"))
    _add_scale_options(p.add_argument_group("scale-out (several GPUs or processes)",
                                            "several machines share one study through --storage and --study-name"))


def _add_tune_options(tune: argparse._ArgumentGroup) -> None:
    add_option(tune, "--model")
    tune.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                      help="where to tune (default: cuda when a GPU is present)")
    tune.add_argument("--precisions", help="comma-separated modes to search, e.g. fp32,bf16 (default: all the "
                                           "device runs natively; fp32 is always the baseline)")
    tune.add_argument("--batch-size", type=int, help="pin the batch size instead of searching it")
    tune.add_argument("--base-batch-size", type=int,
                      help="the batch size you train with today: the baseline's, and the reference for "
                           "learning-rate scaling (default: --batch-size, else 256 on GPU, 16 on CPU)")
    add_option(tune, "--input-shape", "--num-classes", "--data")
    tune.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                      help="search torch.compile modes (default: on a GPU yes, on a CPU no: a CPU compile takes "
                           "tens of seconds per trial); --no-compile never compiles")
    tune.add_argument("--objective", default="throughput", choices=["throughput", "energy", "memory"],
                      help="what to optimize: throughput (samples/s, the default), energy (joules per sample; "
                           "needs NVML on an NVIDIA GPU) or memory (peak memory)")
    tune.add_argument("--global-batch-size", type=int, metavar="N",
                      help="keep N samples per optimizer step (your batch, your learning rate): search the micro-batch "
                           "(a divisor of N) and accumulate gradients over N / micro-batch steps")
    tune.add_argument("--min-batch-size", type=int, help="smallest batch to try (default 16 GPU, 4 CPU)")
    tune.add_argument("--max-batch-size", type=int, help="largest batch to try (default 1024 GPU, 32 CPU)")
    add_option(tune, "--model-config", "--seq-len")
    tune.add_argument("--input-on-device", action="store_true",
                      help="keep synthetic batches on the GPU (default: copy them from pinned host memory "
                           "each step, as a data loader does)")
    tune.add_argument("--no-steer", dest="steer", action="store_false",
                      help="plain TPE over the whole space: do not queue the configurations the findings suggest, "
                           "nor stop exploring knobs measured to have no effect")
    tune.add_argument("--no-profile", dest="profile", action="store_false",
                      help="do not profile trials (torch.profiler and NVML, on a GPU) nor derive findings")
    tune.add_argument("--seed", type=int, default=0, help="sampler and data seed")


def _add_limit_options(limits: argparse._ArgumentGroup) -> None:
    limits.add_argument("--budget", help="wall-clock budget, e.g. 10m, 90s, 1h (default 10m when --trials is not given)")
    limits.add_argument("--trials", type=int, help="stop when this many trials are finished (resumed ones count)")
    limits.add_argument("--memory-limit", metavar="SIZE",
                        help="cap every trial's GPU memory at SIZE, e.g. 24GiB: tune on a large GPU for a smaller card "
                             "(what lives outside PyTorch's allocator counts too); recorded in config.json")
    limits.add_argument("--memory-headroom", metavar="SIZE",
                        help="leave SIZE of the GPU's memory free for other processes, e.g. 4GiB")
    limits.add_argument("--no-accuracy-check", action="store_true",
                        help="skip the accuracy check (speed only: a configuration may then cost accuracy)")
    limits.add_argument("--accuracy-method", choices=("parity", "held-out"), default="parity",
                        help="how a configuration is judged against FP32: parity (default: its loss trajectory, "
                             "progress and first gradients from the same weights on the same batches, within a band "
                             "a harmless change calibrates; a few dozen steps) or held-out (hundreds of steps, "
                             "held-out accuracy)")
    limits.add_argument("--accuracy-share", type=float, metavar="SHARE",
                        help="what the accuracy checks may spend of --budget (default 0.15 for parity, the "
                             "recommendation's verdict included; 0.25 for held-out, while trials run); without "
                             "--accuracy-steps their steps are scaled to fit in it")
    add_option(limits, "--accuracy-steps", "--max-accuracy-drop", "--max-loss-drift")
    limits.add_argument("--early-stop-below", type=float, default=0.5, metavar="SHARE",
                        help="stop a trial in its warm-up when it runs below this share of the best throughput so far "
                             "(default 0.5; 0 measures every trial in full)")
    limits.add_argument("--trial-timeout", type=float, default=600.0, help="seconds before a hung trial is killed")
    limits.add_argument("--min-measure-time", type=float, help="seconds of timed steps per trial (default 2)")


def _add_output_options(output: argparse._ArgumentGroup) -> None:
    output.add_argument("--out", type=Path, help="output folder (default runs/<model>-<gpu>/; a folder holding a study "
                                                 "resumes it)")
    output.add_argument("--resume", action="store_true",
                        help="add trials to a study written on another machine (a copied or committed folder); "
                             "without it such a study is refused, since its figures are not this machine's")
    output.add_argument("--replay", metavar="DIR",
                        help="measure the configurations of an earlier search first (its output folder), in its "
                             "order, before sampling new ones: the same trials on another GPU, or with --gpus")
    output.add_argument("--fresh", action="store_true",
                        help="start without the trials earlier searches of this model measured on this GPU (by default "
                             "a new search starts with them: the baseline and the plain recipe are not run again)")
    output.add_argument("--cache-limit", metavar="SIZE",
                        help="what autotune's cache (~/.cache/autotune or $AUTOTUNE_CACHE_DIR: compiles, FP32 "
                             "references, earlier searches) may hold, e.g. 5GiB (default 20GiB); the least recently "
                             "used entries are deleted at the end of a search")
    output.add_argument("--storage", help="Optuna storage URL (default: sqlite study.db in the output folder); "
                                          "processes and machines given the same postgresql://USER@HOST/DB and "
                                          "--study-name search one study together")
    output.add_argument("--study-name", help="study name (default <model>-<gpu>)")
    output.add_argument("--mlflow", metavar="URI",
                        help="also log each trial (parameters, figures), the best config and the report to this "
                             "MLflow tracking store, e.g. sqlite:///mlflow.db or http://HOST:5000 (needs mlflow-skinny)")


def _add_scale_options(scale: argparse._ArgumentGroup) -> None:
    scale.add_argument("--gpus", help="CUDA GPUs to search on in parallel, one trial worker pinned to each: 0,1 "
                                      "or all (same GPU model; default: one GPU)")
    scale.add_argument("--ddp", type=int, metavar="N",
                       help="measure each trial as an N-process DistributedDataParallel step on GPUs 0..N-1 "
                            "(NCCL; gloo on a CPU): total and per-GPU throughput, scaling efficiency versus one GPU, "
                            "and DDP's bucket size, gradient_as_bucket_view and static_graph are searched; the "
                            "exported config wraps your model in DDP (launch your training with torchrun)")


_SHARED_OPTIONS: dict[str, dict[str, Any]] = {
    "--model": dict(required=True,
                    help="a torchvision classification model (see `autotune models`), hf:TYPE (a transformers "
                         "causal LM, e.g. hf:gpt2), timm:NAME (a timm classifier) or package.module:factory"),
    "--input-shape": dict(help="one sample's shape, e.g. 3x224x224 (default: the model's)"),
    "--num-classes": dict(type=int, default=1000, help="classes of the synthetic labels (default 1000)"),
    "--model-config": dict(metavar="FIELD=VALUE,...",
                           help="an hf: model's configuration fields overriding its defaults, e.g. n_layer=2,n_embd=64 "
                                "(ints, floats, true/false)"),
    "--seq-len": dict(type=int, metavar="N",
                      help="an hf: model's sequence length: tokens per sample (default 1024, or the model's "
                           "longest if shorter); the report shows tokens/s next to samples/s"),
    "--max-accuracy-drop": dict(type=float, default=0.5,
                                help="held-out accuracy drop versus FP32 allowed, in percentage points (default 0.5); "
                                     "a configuration that drops more is never recommended"),
    "--max-loss-drift": dict(type=float, default=0.1, help="when the data has no held-out set: the share of FP32's "
                                                           "training-loss decrease a configuration may lose (default 0.1)"),
    "--accuracy-steps": dict(type=int, help="training steps of the accuracy check (default: in a search with --budget, "
                                            "scaled to the measured step time and --accuracy-share; at most 300 on GPU, "
                                            "100 on CPU)"),
    "--data": dict(help="real data: a folder in ImageFolder layout (DIR/<class>/<image>) or package.module:factory "
                        "returning (train, held_out) datasets; it feeds the timed steps through a DataLoader (whose "
                        "workers, pinning and prefetch are searched) and the accuracy check; default: synthetic "
                        "batches, and a learnable synthetic set at the model's input size for the accuracy check"),
}
"""The workload's and the accuracy check's options, which `search` and `accuracy` share: each places them in its help."""


def add_option(p: argparse.ArgumentParser | argparse._ArgumentGroup, *flags: str) -> None:
    for flag in flags:
        p.add_argument(flag, **_SHARED_OPTIONS[flag])
