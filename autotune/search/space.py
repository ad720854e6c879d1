"""The search space: the probe (what the device can do, whether the model builds), the knobs' choices
it allows (build_space), and whether a stored space is this one."""

from __future__ import annotations

import warnings
from typing import Any

from autotune.deploy.space import SearchSpace
from autotune.errors import ConfigError, WorkloadError
from autotune.search.options import SearchConfig
from autotune.trial.runner import run_worker
from strategies import batch_size as batch_size_strategy
from strategies import compile as compile_strategy
from strategies import dataloader as dataloader_strategy
from strategies import ddp as ddp_strategy
from strategies import fp32_layers as fp32_layers_strategy
from strategies import optimizer as optimizer_strategy
from strategies import threads as threads_strategy


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


def same_space(stored: dict[str, Any], space: SearchSpace) -> bool:
    """Whether a study's stored space is ``space``; a field added since the study was made (the
    dataloader's, say) takes its default, which is what the study's trials ran with."""
    try:
        return SearchSpace.from_dict(stored).to_dict() == space.to_dict()
    except TypeError:  # a field this version does not know: made by a newer autotune
        return False
