"""A trial request read: the configuration to measure (the search's knobs, or an exported config.json
under `autotune verify`), its workload, its measure settings and where its input batches live."""

from __future__ import annotations

import dataclasses
from typing import Any

import strategies
from autotune.deploy.config import TunedConfig, load
from autotune.space import SearchSpace
from autotune.trial.measure import MeasureSettings
from autotune.workload.models import WorkloadSpec


@dataclasses.dataclass(frozen=True)
class TrialSetup:
    """What a trial measures, read from its request (a worker's, or each DDP rank's)."""

    cfg: TunedConfig
    spec: WorkloadSpec
    settings: MeasureSettings
    input_on_device: bool


def read_request(request: dict[str, Any]) -> TrialSetup:
    """The configuration the search sampled (its knobs, the space, the workload), or with
    ``config_path`` an exported config.json, which records all of that itself."""
    if request.get("config_path"):
        cfg = load(request["config_path"])  # `autotune verify`: re-measure an exported config
        spec = WorkloadSpec.from_dict(cfg.info["workload"])
        settings = (MeasureSettings(**cfg.info["measure"]) if "measure" in cfg.info
                    else MeasureSettings.for_device(cfg.device))
        input_on_device = cfg.info.get("input_on_device", False)
    else:
        space = SearchSpace.from_dict(request["space"])
        cfg = TunedConfig(strategies.knobs_from_dict(request["knobs"]), space)
        spec = WorkloadSpec.from_dict(request["workload"])
        settings = MeasureSettings(**request["measure"])
        input_on_device = request.get("input_on_device", False)
    return TrialSetup(cfg=cfg, spec=spec, settings=settings, input_on_device=input_on_device)
