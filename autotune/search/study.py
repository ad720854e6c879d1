"""The search: create or resume the Optuna study, seed it with the baseline and known-good
configurations, run trials until the trial count or the wall-clock budget is reached, export."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

import strategies
from autotune.deploy.space import SearchSpace
from autotune.errors import ConfigError, WorkloadError
from autotune.search.distributed import SharedStudy, check_same_hardware, sampler_seed, setup_done, wait_for_setup
from autotune.search.knob_effects import apply_fixed_knobs, fix_no_effect_knobs
from autotune.search.machine import MACHINE_ATTR, check_resume, this_machine
from autotune.search.objective import Objective, TrialFailed, requeue, serve_urgent_first
from autotune.search.runlog import run_log
from autotune.search.storage import mask_url, open_storage
from autotune.search.trials import FINISHED, baseline_trial, best_trial, counted_trials
from autotune.trial.gpus import GpuPool, parse_gpus, pinned, probe_view
from autotune.trial.measure import MeasureSettings
from autotune.trial.runner import discard_spares, prestart_setting, run_worker
from autotune.workload.models import WorkloadSpec, check_spec
from strategies import batch_size as batch_size_strategy
from strategies import compile as compile_strategy
from strategies import dataloader as dataloader_strategy
from strategies import ddp as ddp_strategy
from strategies import fp32_layers as fp32_layers_strategy
from strategies import optimizer as optimizer_strategy
from strategies import threads as threads_strategy

DEFAULT_OUT = Path("runs")
"""Where searches write by default: <model>-<device>/ under it. Never reports/, whose committed
example studies a search would otherwise resume (ignored by git, so a clone stays clean)."""
DEFAULT_BUDGET_S = 600.0  # when neither --trials nor --budget is given
MIN_BUDGET_S = 10.0


@dataclass(kw_only=True)
class SearchConfig:
    """Everything `autotune search` was asked to do; validated on creation."""

    workload: WorkloadSpec
    device: str = "auto"
    """"cuda", "cpu" or "auto" (CUDA when there is a GPU)."""
    out_dir: Path | None = None
    """None: runs/<model>-<device>/ (ignored by git; the committed examples live in reports/)."""
    storage: str | None = None
    """Optuna storage URL; None: SQLite file study.db in the output folder."""
    study_name: str | None = None
    trials: int | None = None
    """Stop once this many trials are finished (resumed ones included)."""
    budget_s: float | None = None
    """Stop starting trials when the next one would end after this many seconds."""
    batch_size: int | None = None
    """Pin the batch size (no batch search)."""
    base_batch_size: int | None = None
    """The batch size the user trains with (the baseline's); default: the pinned one or 256 (GPU) / 16 (CPU)."""
    min_batch_size: int | None = None
    max_batch_size: int | None = None
    precisions: list[str] | None = None
    """Restrict (or, for bf16 on a CPU without native bf16, extend) the precision modes searched."""
    input_on_device: bool = False
    """Keep synthetic batches on the GPU instead of copying them from pinned host memory each step."""
    compile: bool | None = None
    """Search torch.compile modes: None (default) on a GPU only, True on a CPU too (a CPU compile of
    even a tiny model takes tens of seconds per trial), False never. Only where the probe compiled."""
    accuracy_check: bool = True
    """Train configurations near the speed frontier briefly against FP32; never recommend one that
    loses more than max_accuracy_drop (see autotune.accuracy.gate)."""
    max_accuracy_drop: float = 0.5
    """Held-out accuracy drop versus FP32 allowed, in percentage points."""
    max_loss_drift: float = 0.1
    """Without held-out accuracy: the share of FP32's training-loss decrease a configuration may lose."""
    accuracy_steps: int | None = None
    """Steps of the accuracy check's training run; None: 300 on a GPU, 100 on a CPU."""
    data: str | None = None
    """The accuracy check's data: None (synthetic), an ImageFolder folder, or package.module:factory."""
    profile: bool = True
    """Profile each GPU trial (torch.profiler and NVML) and derive its findings."""
    steer: bool = True
    """Queue the configurations the findings suggest, and stop exploring knobs shown to have no
    effect (autotune.search.knob_effects)."""
    objective: str = "throughput"
    """What the search optimizes: "throughput" (samples/s), "energy" (joules per sample, NVML) or
    "memory" (peak memory); see autotune.search.goal."""
    seed: int = 0
    trial_timeout_s: float = 600.0
    measure: MeasureSettings | None = None
    command: str = ""
    gpus: list[int] | str | None = None
    """CUDA GPUs to search on in parallel, one trial worker on each ("0,1", [0, 1] or "all");
    None: the first visible GPU. All must be the same model (autotune.trial.gpus)."""
    prestart_workers: bool | None = None
    """Start each trial's worker while the previous trial runs (autotune.trial.runner: spare workers),
    taking its imports off the trials' path; None: on a GPU without --ddp (on a CPU the spare's
    imports would compete with the trial measured on the same cores)."""
    ddp: int | None = None
    """--ddp N: measure every trial as an N-process DistributedDataParallel step, one GPU per
    process (autotune.trial.ddp_rank), and search DDP's bucket size, bucket views and static graph; None:
    single-process trials."""
    global_batch_size: int | None = None
    """--global-batch-size: keep this many samples per optimizer step; the batch size searched is
    then the micro-batch (a divisor of it), and gradient accumulation makes up the rest."""
    memory_limit: int | str | None = None
    """--memory-limit: every worker caps its GPU memory at this many bytes ("24GiB" is parsed), what
    lives outside PyTorch's allocator included, so an H200 tunes for a 24 GB card's memory."""
    memory_headroom: int | str | None = None
    """--memory-headroom: leave this much of the GPU's memory free (for other processes)."""
    resume: bool = False
    """Add trials to a study another machine wrote (a copied folder, a committed example): refused
    otherwise, since its figures are not this machine's (autotune.search.machine)."""
    replay: Path | None = None
    """An earlier search's output folder: its configurations are measured first, in its order
    (after this search's FP32 baseline and known-good ones), before the sampler proposes any: the
    same trials on another GPU, or with more GPUs (see replay_configurations)."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"--device {self.device!r}: use cuda, cpu or auto")
        if isinstance(self.gpus, str):
            self.gpus = parse_gpus(self.gpus)
        if self.gpus is not None and self.device == "cpu":
            raise ConfigError("--gpus runs one trial worker per CUDA GPU; it cannot go with --device cpu")
        if self.ddp is not None:
            if self.ddp < 2:
                raise ConfigError(f"--ddp {self.ddp}: give the number of processes (GPUs) of the data-parallel "
                                  "step, at least 2; without --ddp trials run in one process")
            if self.gpus is not None:
                raise ConfigError("--ddp N runs each trial on GPUs 0..N-1 together, --gpus runs separate trials on "
                                  "separate GPUs: give one of them (choose the GPUs of a --ddp search with "
                                  "CUDA_VISIBLE_DEVICES)")
            if self.data is not None:
                raise ConfigError("--data is not measured under --ddp yet (each rank would need its own "
                                  "DistributedSampler shard); drop --data, the accuracy check then uses "
                                  "synthetic data")
        if self.replay is not None:
            self.replay = Path(self.replay)
            if not (self.replay / "study.db").is_file():
                raise ConfigError(f"--replay {self.replay}: no study.db there; give the output folder of an "
                                  "earlier `autotune search` (the one holding its config.json and study.db)")
        from autotune.search.memory import parse_size

        if self.memory_limit is not None:
            self.memory_limit = parse_size(self.memory_limit, "--memory-limit")
        if self.memory_headroom is not None:
            self.memory_headroom = parse_size(self.memory_headroom, "--memory-headroom")
        if (self.memory_limit or self.memory_headroom) and self.device == "cpu":
            raise ConfigError("--memory-limit and --memory-headroom cap a GPU's memory; a CPU search has none "
                              "to cap (drop them, or search on --device cuda)")
        if self.trials is not None and self.trials < 1:
            raise ConfigError(f"--trials must be at least 1, got {self.trials}")
        if self.budget_s is not None and self.budget_s < MIN_BUDGET_S:
            raise ConfigError(f"--budget {self.budget_s:g}s cannot hold a single trial (a worker start, a warm-up "
                              f"and seconds of timed steps); give at least {MIN_BUDGET_S:.0f}s, typically 10m")
        if self.global_batch_size is not None:
            for given, option in ((self.batch_size, "--batch-size"), (self.ddp, "--ddp"), (self.data, "--data")):
                if given is not None:
                    raise ConfigError(f"--global-batch-size searches the micro-batch and accumulates to it; it does "
                                      f"not go with {option} yet (drop one of them)")
            if self.base_batch_size is not None and self.base_batch_size != self.global_batch_size:
                raise ConfigError(f"--global-batch-size {self.global_batch_size} is the batch you train with, so "
                                  f"--base-batch-size {self.base_batch_size} contradicts it: drop --base-batch-size")
        for name in ("batch_size", "base_batch_size", "min_batch_size", "max_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.min_batch_size and self.max_batch_size and self.min_batch_size > self.max_batch_size:
            raise ConfigError(f"--min-batch-size {self.min_batch_size} is larger than --max-batch-size {self.max_batch_size}")
        known = ("fp32", "tf32", "fp16", "bf16")
        for mode in self.precisions or []:
            if mode not in known:
                raise ConfigError(f"--precisions: unknown mode {mode!r}; choose from {', '.join(known)}")
        if self.precisions is not None and "fp32" not in self.precisions:
            raise ConfigError("--precisions must include fp32: the FP32 baseline is what every figure is compared with")
        if self.trial_timeout_s <= 0:
            raise ConfigError("--trial-timeout must be positive")
        from autotune.search.goal import goal

        goal(self.objective)  # an unknown name gets the list of objectives
        if self.accuracy_check:
            from autotune.accuracy.settings import AccuracySettings
            from autotune.workload.data import check_data_spec

            self.accuracy_settings("cpu")  # validates the thresholds and the step count
            check_data_spec(self.data)
        elif self.data is not None:
            from autotune.workload.data import check_data_spec

            check_data_spec(self.data)  # it still feeds the timed steps, through a DataLoader
        if self.data is not None and self.input_on_device:
            raise ConfigError("--input-on-device keeps synthetic batches on the GPU, but --data feeds the timed "
                              "steps from a DataLoader; drop one of them")

    def accuracy_settings(self, device: str):
        """The accuracy check's settings on ``device`` (validated: a bad value raises ConfigError)."""
        from autotune.accuracy.settings import AccuracySettings

        return AccuracySettings.for_device(device, steps=self.accuracy_steps, seed=self.seed, data=self.data,
                                           max_accuracy_drop=self.max_accuracy_drop,
                                           max_loss_drift=self.max_loss_drift)


def parse_duration(text: str) -> float:
    """'10m' -> 600.0; accepts s, m, h and plain seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match:
        raise ConfigError(f"--budget {text!r}: write a duration like 90s, 10m or 1.5h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def device_slug(provenance: dict[str, Any], device: str) -> str:
    """'NVIDIA H200' -> 'h200'; the CPU -> 'cpu'."""
    if device != "cuda":
        return "cpu"
    name = provenance.get("gpu", "gpu").lower().replace("nvidia", "").replace("geforce", "")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is False); "
                          "use --device cpu, or install a CUDA build of torch")
    return requested


def _check_writable(out_dir: Path, min_free_bytes: int = 50 * 2**20) -> None:
    """Fail before any device time is spent when results could not be saved."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe_file = out_dir / ".write-test"
        probe_file.write_text("ok")
        probe_file.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write to the output folder {out_dir} ({exc.strerror or exc}); "
                          "choose another with --out") from None
    import shutil

    free = shutil.disk_usage(out_dir).free
    if free < min_free_bytes:
        raise ConfigError(f"only {free / 2**20:.0f} MiB free under {out_dir}; free some space or choose "
                          "another --out (the study, logs and report need about 50 MiB)")


def memory_limit_bytes(config: SearchConfig, device: str, info: dict[str, Any]) -> int | None:
    """The device memory each trial may use: --memory-limit, and the GPU's memory less
    --memory-headroom, whichever is less; None when neither is given (or on a CPU)."""
    if device != "cuda" or not (config.memory_limit or config.memory_headroom):
        return None
    total = int(info["provenance"].get("gpu_memory_bytes") or 0)
    limits = [int(config.memory_limit)] if config.memory_limit else []
    if config.memory_headroom:
        limits.append(total - int(config.memory_headroom))
    limit = min(limits)
    if limit <= 0:
        raise ConfigError(f"--memory-headroom {config.memory_headroom / 2**30:.1f} GiB leaves nothing of this GPU's "
                          f"{total / 2**30:.1f} GiB; give a smaller headroom")
    return limit


def probe(config: SearchConfig, device: str, list_devices: bool = False) -> dict[str, Any]:
    """Ask a worker what the device can do, and check the model builds; with list_devices, also
    the names of the CUDA devices it sees ("cuda_devices"; only those when it sees none)."""
    result = run_worker({"mode": "probe", "device": device, "workload": config.workload.to_dict(),
                         "check_compile": compile_wanted(config, device), "list_devices": list_devices},
                        timeout_s=600)
    if result["status"] != "ok":
        if "WorkloadError" in result.get("reason", "") or "ConfigError" in result.get("reason", ""):
            raise WorkloadError(result["reason"].split(": ", 1)[-1])
        raise WorkloadError(f"the model {config.workload.model!r} could not be built: {result.get('reason')}\n"
                            f"{result.get('traceback', '')}")
    return result


def compile_wanted(config: SearchConfig, device: str) -> bool:
    """Whether to search torch.compile: on a GPU unless refused, on a CPU only when asked for."""
    return config.compile if config.compile is not None else device == "cuda"


def _compile_modes(config: SearchConfig, device: str, info: dict[str, Any]) -> list[str]:
    if not compile_wanted(config, device):
        return ["off"]
    check = info.get("compile") or {"works": False, "reason": "the probe did not check it"}
    if not check.get("works"):
        warnings.warn(f"torch.compile is not searched: it does not work on this {device} "
                      f"({check.get('reason')}); the search goes on without it", stacklevel=3)
        return ["off"]
    return compile_strategy.candidates(device)


def _prestart_workers(config: SearchConfig, device: str) -> bool:
    """Whether each trial's worker starts while the previous trial runs: config.prestart_workers,
    else $AUTOTUNE_PRESTART (autotune.trial.runner.prestart_setting), else on a GPU without --ddp."""
    if config.prestart_workers is not None:
        return config.prestart_workers
    setting = prestart_setting()
    return setting if setting is not None else device == "cuda" and not config.ddp


def check_ddp(config: SearchConfig, device: str) -> None:
    """Refuse a --ddp search this machine cannot run, before any device time."""
    if config.ddp is None:
        return
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("--ddp needs torch.distributed, which this build of torch lacks; install a torch "
                          "build with distributed support")
    if device == "cuda":
        import torch

        visible = torch.cuda.device_count()
        if config.ddp > visible:
            raise ConfigError(f"--ddp {config.ddp}: PyTorch sees {visible} CUDA GPU{'s' if visible != 1 else ''} "
                              f"here; give --ddp {visible} or less (CUDA_VISIBLE_DEVICES chooses which)")
        if not dist.is_nccl_available():
            raise ConfigError("--ddp on CUDA runs NCCL, which this build of torch lacks; install a CUDA build "
                              "of torch with NCCL")
    elif not dist.is_gloo_available():
        raise ConfigError("--ddp on a CPU runs gloo, which this build of torch lacks")


def _cpus_per_rank(config: SearchConfig) -> int | None:
    """Under --ddp on a CPU, each rank's share of the cores (ranks run at once); else None (all)."""
    if not config.ddp:
        return None
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // config.ddp)


def build_space(config: SearchConfig, device: str, info: dict[str, Any]) -> SearchSpace:
    cuda = device == "cuda"
    if config.batch_size:
        batches = [config.batch_size]
    else:
        low = config.min_batch_size or (16 if cuda else 4)
        high = config.max_batch_size or (1024 if cuda else 32)
        if low > high:
            raise ConfigError(f"batch range {low}..{high} is empty; set --min-batch-size/--max-batch-size")
        batches = batch_size_strategy.candidates(low, high)
    if config.global_batch_size:
        # micro-batches that divide the global batch; the baseline is one plain step over all of it
        # when that fits (else the largest micro-batch, after the out-of-memory back-off)
        wanted = config.global_batch_size
        batches = sorted({b for b in batches if wanted % b == 0} | ({wanted} if low <= wanted <= high else set()))
        if not batches:
            raise ConfigError(f"no batch in {low}..{high} divides --global-batch-size {wanted}; give a global batch "
                              "with small divisors (a power of two, say) or widen --min/--max-batch-size")
    base = config.global_batch_size or config.base_batch_size or config.batch_size or (256 if cuda else 16)
    if not config.global_batch_size:  # the global batch itself need not be a micro-batch
        base = min(max(base, batches[0]), batches[-1]) if base not in batches else base
        if base not in batches:
            batches = sorted(set(batches) | {base})
    image_like = info.get("input_dim") == 4
    alignments = [1]
    if cuda:
        alignments += [m for m in (8, 16) if info.get("misaligned", {}).get(str(m))]
    precisions = info["precisions"]
    if config.precisions is not None:
        unsupported = [m for m in config.precisions if m not in precisions and not (m == "bf16" and not cuda)]
        if unsupported:
            raise ConfigError(f"--precisions {','.join(config.precisions)}: this device does not support "
                              f"{', '.join(unsupported)} (it supports {', '.join(precisions)})")
        precisions = [m for m in ("fp32", "tf32", "fp16", "bf16") if m in config.precisions]
    return SearchSpace(
        device=device,
        precisions=precisions,
        batch_sizes=batches,
        base_batch_size=base,
        alignments=alignments,
        memory_formats=["contiguous", "channels_last"] if image_like else ["contiguous"],
        stream_counts=[1, 2] if cuda and not config.input_on_device else [1],
        cudnn_benchmark=[False, True] if cuda else [False],
        thread_counts=[] if cuda else threads_strategy.candidates(_cpus_per_rank(config)),
        # keeping layers in FP32 only trades speed for accuracy: offered where the accuracy check
        # can tell whether it is needed, under autocast, for the kinds the model has
        fp32_layer_sets=(fp32_layers_strategy.combinations(info.get("fp32_layer_kinds") or [])
                         if config.accuracy_check and {"fp16", "bf16"} & set(precisions) else ["none"]),
        optimizer_implementations=optimizer_strategy.candidates(device),
        # zeroing in place keeps gradient memory allocated; on a CPU the difference is noise
        zero_grad_set_to_none=[True, False] if cuda else [True],
        compile_modes=_compile_modes(config, device, info),
        # not under DDP: its all-reduces run from autograd hooks on NCCL's own stream, outside a
        # whole-step capture (the compile modes with CUDA graphs graph only the compiled pieces)
        # nor with accumulation: a graph replays one optimizer step, not k micro-steps and one step
        cuda_graphs=[False, True] if cuda and not config.ddp and not config.global_batch_size else [False],
        # with real data the timed steps are fed by a DataLoader, whose settings are searched too
        dataloader_workers=dataloader_strategy.candidates() if config.data else [],
        dataloader_pin_memory=[False, True] if cuda and config.data else [False],
        dataloader_prefetch_factors=dataloader_strategy.PREFETCH_FACTORS if config.data else [2],
        ddp_world_size=config.ddp or 1,
        global_batch_size=config.global_batch_size,
        **(ddp_strategy.candidates() if config.ddp else {}),
    )


def _same_space(stored: dict[str, Any], space: SearchSpace) -> bool:
    """Whether a study's stored space is ``space``; a field added since the study was made (the
    dataloader's, say) takes its default, which is what the study's trials ran with."""
    try:
        return SearchSpace.from_dict(stored).to_dict() == space.to_dict()
    except TypeError:  # a field this version does not know: made by a newer autotune
        return False


def _limit_words(limit: int | None) -> str:
    return "no memory limit" if limit is None else f"a memory limit of {limit / 2**30:.1f} GiB"


def _ddp_words(world_size: Any) -> str:
    return "single-process" if world_size == 1 else f"{world_size}-process DDP"


def _nearest(values: list[int], target: int) -> int:
    return min(values, key=lambda v: (abs(v - target), v))


def _offered(space: SearchSpace, step: dict[str, Any]) -> bool:
    """Whether the space offers a seed's optimizer, compile and CUDA-graph values."""
    offers = {"optimizer.implementation": space.optimizer_implementations, "compile.mode": space.compile_modes,
              "cuda_graphs.enabled": space.cuda_graphs}
    return all(value in offers[key] for key, value in step.items() if key in offers)


def replay_configurations(folder: Path, space: SearchSpace) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """The configurations the search in ``folder`` measured, in its trial order, as this space's
    complete parameters: (trial number, params) pairs, and how many were left out because this
    space does not offer one of their values (a batch size another GPU's memory allowed, say).
    Repeats stay in: the search measured them once and copied the rest, and so will this one."""
    from autotune.search.steering import complete_params

    url = f"sqlite:///{folder / 'study.db'}"
    names = optuna.get_all_study_names(storage=url)
    if len(names) != 1:
        raise ConfigError(f"--replay {folder}: its study.db holds {len(names)} studies ({', '.join(names) or 'none'}); "
                          "give the folder of a search that ran one")
    earlier = optuna.load_study(study_name=names[0], storage=url)
    kept, left_out = [], 0
    for trial in sorted(earlier.get_trials(deepcopy=False, states=FINISHED), key=lambda t: t.number):
        if not trial.params:
            continue
        params = complete_params(trial.params, space)
        if any(params.get(name) != value for name, value in trial.params.items()):
            left_out += 1
        else:
            kept.append((trial.number, params))
    if not kept:
        raise ConfigError(f"--replay {folder}: none of its {left_out} configurations is in this search's space; "
                          "run this search with the options of that one (batch sizes, precisions, --ddp)")
    return kept, left_out


def _enqueue_replay(study: optuna.Study, folder: Path, space: SearchSpace, seeds: list[dict[str, Any]]) -> None:
    """Queue the configurations of the search in ``folder`` behind this one's seeds (which that
    search measured first too: they are not queued twice)."""
    from autotune.search.steering import complete_params

    replayed, left_out = replay_configurations(folder, space)
    seeded = [complete_params(params, space) for params in seeds]
    for number, params in replayed:
        if params in seeded:
            seeded.remove(params)  # its first one is this search's seed; a repeat of it is replayed
            continue
        study.enqueue_trial(params, user_attrs={"role": "replayed", "replay_of": number})
    if left_out:
        warnings.warn(f"--replay {folder}: {left_out} of its configurations are not in this search's space "
                      "and are not replayed", stacklevel=2)


def seed_configurations(space: SearchSpace) -> list[tuple[str, dict[str, Any]]]:
    """The FP32 baseline first, then configurations the guides call good, as Optuna params."""
    def params(**values: Any) -> dict[str, Any]:
        out = {}
        for strategy in strategies.REGISTRY:
            if not strategy.applies(space):
                continue
            for key, value in values.items():
                if key.startswith(strategy.name + "."):
                    out[key] = value
        return out

    base = _nearest(space.batch_sizes, space.base_batch_size)  # the global batch's largest micro-batch
    # the optimizer as a user builds it with default arguments, eager, no graph capture
    implementations = space.optimizer_implementations
    untuned_step = {
        "optimizer.implementation": (optimizer_strategy.UNTUNED[space.device]
                                     if optimizer_strategy.UNTUNED[space.device] in implementations
                                     else implementations[0]),
        "optimizer.set_to_none": True, "compile.mode": "off", "cuda_graphs.enabled": False,
        # under --ddp: DistributedDataParallel as a user builds it, with PyTorch's defaults
        "ddp.bucket_cap_mb": ddp_strategy.DDP.Config.bucket_cap_mb, "ddp.gradient_as_bucket_view": False,
        "ddp.static_graph": False}
    baseline = params(**{
        "precision.mode": "fp32", "batch_size.batch_size": base, "channel_alignment.multiple": 1,
        "memory_format.format": "contiguous", "cudnn.benchmark": False, "streams.num_streams": 1,
        "threads.num_threads": max(space.thread_counts) if space.thread_counts else 0,
        **dataloader_strategy.seed_params(space, tuned=False),
        **untuned_step,
    })
    seeds = [("baseline", baseline)]
    fast_format = "channels_last" if "channels_last" in space.memory_formats else "contiguous"
    common = {"memory_format.format": fast_format, "cudnn.benchmark": True, "channel_alignment.multiple": 1,
              "fp32_layers.layers": "none",
              "streams.num_streams": max(space.stream_counts),
              "threads.num_threads": max(space.thread_counts) if space.thread_counts else 0,
              **dataloader_strategy.seed_params(space, tuned=True),
              **untuned_step}
    scaler = {"grad_scaler.init_scale": 2.0**16, "grad_scaler.growth_factor": 2.0,
              "grad_scaler.backoff_factor": 0.5, "grad_scaler.growth_interval": 2000}
    wanted: list[tuple[str, int, dict[str, Any]]]
    if space.device == "cuda":
        fused = {"optimizer.implementation": "fused"}
        wanted = [
            # what the reference figures call top, first, so a 10-minute search measures them:
            # bf16 + channels_last + torch.compile (the hand-tuned ~7,200 img/s ResNet-50 step on
            # an H200) at two batches, and fp16 with the whole step in a CUDA graph (MLPerf's
            # recipe; legal with fp16 thanks to the fused optimizer's device-side GradScaler step)
            ("bf16", 256, {**fused, "compile.mode": "default"}),
            ("bf16", 512, {**fused, "compile.mode": "default"}),
            ("fp16", 256, {**fused, "cuda_graphs.enabled": True}),
            # the guides' recipe (fp16 AMP + channels_last) at growing batches, and bf16 at a middle one
            ("fp16", 256, {}), ("fp16", 512, {}), ("fp16", 1024, {}), ("bf16", 512, {}),
            # both: the compiled step captured whole
            ("bf16", 256, {**fused, "compile.mode": "default", "cuda_graphs.enabled": True}),
        ]
    else:
        wanted = [("bf16", base, {}), ("fp32", max(space.batch_sizes), {})]
    seen = [baseline]
    for mode, batch, step in wanted:
        if mode not in space.precisions or not _offered(space, step):
            continue
        p = params(**{**common, **(scaler if mode == "fp16" else {}), **step,
                      "precision.mode": mode, "batch_size.batch_size": _nearest(space.batch_sizes, batch)})
        if p not in seen:
            seen.append(p)
            seeds.append(("known-good", p))
    return seeds


def _compiles(trial: optuna.trial.FrozenTrial) -> bool:
    return trial.user_attrs.get("knobs", {}).get("compile", {}).get("mode", "off") != "off"


def estimate_next_wall(study: optuna.Study, walls: list[tuple[float, bool]]) -> float:
    """Expected seconds of the next trial, from past trials' walls ``(seconds, compiled)``.

    A trial that compiles takes minutes where an eager one takes seconds, so the two kinds are
    estimated apart: the next queued configuration's own kind when one is queued (the seeds),
    otherwise both kinds weighted by how often they came so far.
    """
    if not walls:
        return 0.0
    by_kind = {kind: [w for w, c in walls if c == kind] for kind in (False, True)}
    median = {kind: statistics.median(v) for kind, v in by_kind.items() if v}

    def kind_median(kind: bool) -> float:
        return median.get(kind, median.get(not kind, 0.0))

    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    if waiting:
        fixed = waiting[0].params or waiting[0].system_attrs.get("fixed_params", {})
        return kind_median(fixed.get("compile.mode", "off") != "off")
    share = len(by_kind[True]) / len(walls)
    return share * kind_median(True) + (1 - share) * kind_median(False)


def _write_outputs(study: optuna.Study, out_dir: Path, config: SearchConfig, space: SearchSpace,
                   info: dict[str, Any]) -> dict[str, Path]:
    """config.json and trials.csv, then report.html and report.md."""
    from autotune.report.export import export
    from autotune.report.render import write_report

    files = export(study, out_dir, config=config, space=space, probe=info)
    files.update(keep_traces(study, out_dir))
    exported = json.loads(files["config.json"].read_text()) if "config.json" in files else None
    files.update(write_report(study, out_dir, exported))
    return files


def keep_traces(study: optuna.Study, out_dir: Path) -> dict[str, Path]:
    """The Chrome traces (Perfetto opens them) of the baseline and the best trial, copied next to
    the report as trace-baseline.json.gz and trace-best.json.gz; the other trials' traces are
    deleted from logs/ (half a megabyte each)."""
    import shutil

    logs = out_dir / "logs"
    sources = {label: logs / f"trace-{trial.number:04d}.json.gz"
               for label, trial in (("baseline", baseline_trial(study)), ("best", best_trial(study)))
               if trial is not None}
    keep = {}
    for label, source in sources.items():
        if source.exists():
            target = out_dir / f"trace-{label}.json.gz"
            shutil.copyfile(source, target)
            keep[target.name] = target
    for trace in logs.glob("trace-*.json*"):
        if trace not in sources.values():
            trace.unlink()
    return keep


@dataclass
class SearchResult:
    study: optuna.Study
    out_dir: Path
    space: SearchSpace
    probe: dict[str, Any]
    elapsed_s: float
    new_trials: int
    files: dict[str, Path] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of this run outside its trials: "probe", "final accuracy checks", "export"."""


class _Lock:
    """One search per output folder at a time; holding it also proves that RUNNING trials in the
    folder's own SQLite study belong to a search process that died."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "w")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise ConfigError(f"another `autotune search` is running on {path.parent}; wait for it to end, "
                              "or give this one another --out (to search one study with several processes, "
                              "give each its own --out and the same --storage postgresql://USER@HOST/DB "
                              "--study-name NAME; on one machine, --gpus)") from None

    def release(self) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def open_study(storage: optuna.storages.BaseStorage, name: str, seed: int,
               objective: str = "throughput") -> optuna.Study:
    """Create the study for ``objective`` (its direction, recorded as a user attribute), or load
    it; a study made for another objective is refused (Optuna's load_if_exists would silently
    keep the stored direction, and the values of the two objectives must never be mixed)."""
    from autotune.search.goal import OBJECTIVE_ATTR, goal, goal_of

    wanted = goal(objective)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed)
    study = optuna.create_study(storage=storage, study_name=name, direction=wanted.direction,
                                sampler=sampler, load_if_exists=True)
    if OBJECTIVE_ATTR not in study.user_attrs and not study.trials and study.direction.name.lower() == wanted.direction:
        study.set_user_attr(OBJECTIVE_ATTR, wanted.name)
    stored = goal_of(study)
    if stored != wanted or study.direction.name.lower() != wanted.direction:
        raise ConfigError(f"study {name!r} was created with --objective {stored.name} ({stored.text}); resuming it "
                          f"with --objective {wanted.name} would mix the two objectives' values. Resume it with "
                          f"--objective {stored.name}, or start a new search with another --study-name or --out")
    return study


def recover_dead_trials(study: optuna.Study) -> list[int]:
    """Fail the trials a killed search left RUNNING and queue each for one re-run.

    Only called while holding the output folder's lock on its own SQLite study, which proves no
    other process is running them.
    """
    recovered = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study._storage.set_trial_system_attr(trial._trial_id, "fail_reason", "search process died; re-queued")
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        if "retry_of" not in trial.user_attrs:  # re-run once: a trial that dies twice stays failed
            requeue(study, trial)
        recovered.append(trial.number)
    return recovered


def run_search(config: SearchConfig, *, on_event: Callable[[str, Any], None] | None = None) -> SearchResult:
    """Run (or resume) a search and export its results. ``on_event(kind, payload)`` reports
    progress: ("start", info), ("trial", FrozenTrial), ("end", None)."""
    emit = on_event or (lambda kind, payload: None)
    if config.trials is None and config.budget_s is None:
        config.budget_s = DEFAULT_BUDGET_S
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    check_spec(config.workload)
    device = resolve_device(config.device)
    check_ddp(config, device)
    prestart = _prestart_workers(config, device)
    GpuPool.check_device(config.gpus, device)  # --gpus on a CPU: refused before any device time
    # before any device time: the folder (or, by default, runs/) must take the results
    _check_writable(Path(config.out_dir) if config.out_dir else DEFAULT_OUT)
    # a user's storage URL is checked (and its tables created) before any device time
    storage = open_storage(config.storage) if config.storage else None
    from autotune.search.goal import goal, nvml_refusal

    target = goal(config.objective)
    if target.needs_nvml and device != "cuda":  # known before the probe: refuse at once
        raise ConfigError(nvml_refusal(device, None))
    started = time.time()
    phases: dict[str, float] = {}
    # --gpus: the probe sees the requested GPUs (its device 0 the first) and names them, which
    # makes the pool; a mix of GPU models or a missing one is refused here
    with pinned(probe_view(config.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))):
        info = probe(config, device, list_devices=config.gpus is not None)
    phases["probe"] = time.time() - started
    gpu_pool = GpuPool.for_search(config.gpus, device, probed=info.get("cuda_devices"))
    if target.needs_nvml and (refusal := nvml_refusal(device, info.get("nvml"))):
        raise ConfigError(refusal)
    space = build_space(config, device, info)
    nvml = info.get("nvml") or {}
    if device == "cuda" and config.profile and nvml.get("available") is False:
        warnings.warn(f"NVML is not usable here ({nvml.get('reason')}): energy, power, clock and throttling "
                      "figures are missing; everything else is measured", stacklevel=2)
    slug = device_slug(info["provenance"], device)
    if config.ddp:
        # a study of N-process DDP steps never mixes with single-process ones (nor another N):
        # its own folder and study name by default, and refused on resume below
        slug = f"{slug}-ddp{config.ddp}"
    out_dir = Path(config.out_dir or DEFAULT_OUT / f"{config.workload.short_name}-{slug}")
    _check_writable(out_dir)
    (out_dir / "logs").mkdir(exist_ok=True)
    lock = _Lock(out_dir / ".search.lock")
    logged = contextlib.ExitStack()
    try:
        # Optuna's per-trial messages and tracebacks go to logs/search.log, not the terminal
        logged.enter_context(run_log(out_dir / "logs"))
        if gpu_pool:
            gpu_pool.activate()
        name = config.study_name or f"{config.workload.short_name}-{slug}"
        own_storage = config.storage is None
        storage = storage or open_storage(f"sqlite:///{out_dir / 'study.db'}")
        study = open_study(storage, name, config.seed, config.objective)
        machine = this_machine(info["provenance"])
        if own_storage:
            # before anything is written to it: a committed example or another machine's study
            # is never resumed by accident (a shared --storage is many machines by design)
            check_resume(study, machine, where=str(out_dir / "study.db"), resume=config.resume)
        if study.trials or not own_storage:
            # a resumed study gets a fresh sampler seed, so it does not re-propose the same sequence;
            # on a shared storage, neither does another process joining it at the same moment
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.sampler = optuna.samplers.TPESampler(
                    seed=sampler_seed(config.seed, len(study.trials), shared=not own_storage))
        serve_urgent_first(study)  # a baseline backed off to a batch that fits runs next
        if config.steer:
            # knobs an earlier run of this study found to have no effect stay fixed
            apply_fixed_knobs(study)
        # several processes may join the study at once: one sets it up, the others wait for it
        stored_space = wait_for_setup(storage, study)
        check_same_hardware(study, device, info["provenance"], suggestion=f"{name}-{slug}",
                            where=mask_url(config.storage or str(out_dir / "study.db")))
        # a space stored before --ddp existed has no ddp_world_size: single-process trials
        theirs = None if stored_space is None else stored_space.get("ddp_world_size", 1)
        if theirs is not None and theirs != space.ddp_world_size:
            raise ConfigError(
                f"study {name!r} in {mask_url(config.storage or str(out_dir / 'study.db'))} holds "
                f"{_ddp_words(theirs)} measurements and this search measures {_ddp_words(space.ddp_world_size)}: "
                "one study must not mix them. Resume it with " + (f"--ddp {theirs}" if theirs != 1 else "no --ddp")
                + ", or start a new search with another --study-name or --out")
        limit = memory_limit_bytes(config, device, info)
        if stored_space is not None and study.user_attrs.get("memory_limit_bytes") != limit:
            raise ConfigError(
                f"study {name!r} in {mask_url(config.storage or str(out_dir / 'study.db'))} was measured under "
                f"{_limit_words(study.user_attrs.get('memory_limit_bytes'))} and this search runs under "
                f"{_limit_words(limit)}: "
                "what fits differs. Resume it with the same limit, or start a new one with another --out")
        if stored_space is not None and not _same_space(stored_space, space):
            raise ConfigError(
                f"study {name!r} in {mask_url(config.storage or str(out_dir / 'study.db'))} was made with another search space ({stored_space}); "
                "resume it with the same options, or start a new one with another --study-name or --out")
        if stored_space is None:
            study.set_user_attr("space", space.to_dict())
            study.set_user_attr("workload", config.workload.to_dict())
            study.set_user_attr("device", device)
            study.set_user_attr("provenance", info["provenance"])
            study.set_user_attr(MACHINE_ATTR, machine)
            study.set_user_attr("memory_limit_bytes", limit)
            seeds = seed_configurations(space)
            for role, params in seeds:
                study.enqueue_trial(params, user_attrs={"role": role})
            if config.replay is not None:
                _enqueue_replay(study, config.replay, space, [params for _, params in seeds])
            setup_done(study)
        recovered = recover_dead_trials(study) if own_storage else []
        shared = SharedStudy(study, storage, config.storage or f"sqlite:///{out_dir / 'study.db'}", config.trials)
        measure = config.measure = config.measure or MeasureSettings.for_device(device)
        gate = None
        if config.accuracy_check:
            from autotune.accuracy.gate import AccuracyGate

            gate = AccuracyGate(settings=config.accuracy_settings(device), space=space,
                                workload=config.workload.to_dict(), timeout_s=config.trial_timeout_s,
                                log_dir=out_dir / "logs")
            gate.attach(study)
        objective = Objective(accuracy=gate, space=space, workload=config.workload.to_dict(), measure=measure.to_dict(),
                              input_on_device=config.input_on_device, seed=config.seed, data=config.data,
                              trial_timeout_s=config.trial_timeout_s, log_dir=out_dir / "logs",
                              deadline=None if config.budget_s is None else started + config.budget_s,
                              profile=config.profile, steer=config.steer, goal=target,
                              misaligned=(info.get("misaligned") or {}).get("8"),
                              prestart_workers=prestart,
                              memory_limit_bytes=limit,
                              device_memory_bytes=info["provenance"].get("gpu_memory_bytes") if device == "cuda" else None)
        emit("start", {"space": space, "probe": info, "out_dir": out_dir, "study": study,
                       "recovered": recovered, "done": len(counted_trials(study)), "config": config})
        walls: list[tuple[float, bool]] = []  # (wall seconds, compiled) of each measured trial
        new_trials = 0

        def stop_rule(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            nonlocal new_trials
            if "status" in trial.user_attrs:
                new_trials += 1
                if "duplicate_of" not in trial.user_attrs:
                    walls.append((trial.user_attrs.get("timing", {}).get("wall_s", 0.0), _compiles(trial)))
            if config.steer and "status" in trial.user_attrs:
                # knobs whose measured effect is below noise stop being explored
                newly = fix_no_effect_knobs(study)
                if newly:
                    emit("fixed", newly)
            emit("trial", trial)
            # other processes of the study (and other GPUs' threads) count: finished, or running
            # and waited for (a process that dies has its trial re-run here)
            if config.trials is not None and shared.has_its_trials(
                    deadline=None if config.budget_s is None else started + config.budget_s):
                study.stop()
            if config.budget_s is not None:
                elapsed = time.time() - started
                expected = estimate_next_wall(study, walls)
                if elapsed + expected > config.budget_s:
                    study.stop()

        remaining = None if config.trials is None else config.trials - len(counted_trials(study))
        interrupted = None
        if remaining is None or remaining > 0:
            timeout = None if config.budget_s is None else max(1.0, config.budget_s - (time.time() - started))
            try:
                # --gpus: Optuna's own parallel loop, a thread (and a GPU) per trial in flight
                guarded = shared.guard(objective)
                study.optimize(gpu_pool.wrap(guarded) if gpu_pool else guarded, n_trials=None, timeout=timeout,
                               n_jobs=len(gpu_pool) if gpu_pool else 1, callbacks=[stop_rule],
                               catch=(TrialFailed,), gc_after_trial=False, show_progress_bar=False)
            except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: what was measured is still exported
                interrupted = exc
            finally:
                discard_spares()  # no more trials: the worker started for the next one is not needed
        if gate is not None and interrupted is None:
            # the recommendation must have passing accuracy evidence: check the fastest trials
            # that have none, fastest first, until one passes
            t = time.time()
            # within the budget: a recommendation left unchecked says so (export)
            gate.ensure_recommendation(study, deadline=None if config.budget_s is None else started + config.budget_s)
            phases["final accuracy checks"] = time.time() - t
        t = time.time()
        files = _write_outputs(study, out_dir, config, space, info)
        phases["export"] = time.time() - t
        emit("end", None)
        if interrupted is not None:
            raise interrupted
        return SearchResult(study=study, out_dir=out_dir, space=space, probe=info,
                            elapsed_s=time.time() - started, new_trials=new_trials, files=files, phases=phases)
    finally:
        discard_spares()
        GpuPool.deactivate()
        logged.close()
        lock.release()


