"""The search space: the probe (what the device can do, whether the model builds), the knobs' choices
it allows (build_space), and whether a stored space is this one."""

from __future__ import annotations

import warnings
from typing import Any

import strategies
from autotune.space import SearchSpace
from autotune.errors import ConfigError, WorkloadError
from autotune.search.options import SearchConfig
from autotune.trial.runner import run_worker
from strategies import compile as compile_strategy


def probe(config: SearchConfig, device: str, list_devices: bool = False, spare: bool = False) -> dict[str, Any]:
    """Ask a worker what the device can do, and check the model builds; with list_devices, also
    the names of the CUDA devices it sees ("cuda_devices"; only those when it sees none). ``spare``:
    the first trial's worker starts while the probe runs (a search whose GPU workers prestart), so
    the first trial does not wait for a worker of its own. Not
    with --gpus: a trial's worker sees its own GPU, not the probe's view of them all."""
    request = {"mode": "probe", "device": device, "workload": config.workload.to_dict(),
               "check_compile": compile_strategy.wanted(config, device), "list_devices": list_devices}
    result = run_worker(request, timeout_s=600, spare=spare)
    if result["status"] == "crashed":
        # the probe's one forward pass (it counts attention calls) is the first time the model's own
        # code runs: a model that kills its process there (a broken extension) is probed again
        # without it, so that its trials run on the device and each says how it ends
        crashed = result["reason"]
        result = run_worker({**request, "forward": False}, timeout_s=600)
        if result["status"] == "ok":
            warnings.warn(f"the model's forward pass killed the probe ({crashed}); the attention knob is not "
                          "offered, and each trial says how the model runs on the device", stacklevel=3)
    if result["status"] != "ok":
        if "WorkloadError" in result.get("reason", "") or "ConfigError" in result.get("reason", ""):
            raise WorkloadError(result["reason"].split(": ", 1)[-1])
        raise WorkloadError(f"the model {config.workload.model!r} could not be built: {result.get('reason')}\n"
                            f"{result.get('traceback', '')}")
    return result


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


def build_space(config: SearchConfig, device: str, info: dict[str, Any]) -> SearchSpace:
    """Every knob's choices on ``device`` for this search, given the probe's findings: each strategy
    offers its own (Strategy.offer), in registry order."""
    return strategies.offer(config, device, info)


def same_space(stored: dict[str, Any], space: SearchSpace) -> bool:
    """Whether a study's stored space is ``space``; a field added since the study was made (the
    dataloader's, say) takes its default, which is what the study's trials ran with."""
    try:
        return SearchSpace.from_dict(stored).to_dict() == space.to_dict()
    except TypeError:  # a field this version does not know: made by a newer autotune
        return False
