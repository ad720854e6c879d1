"""ddp: DistributedDataParallel's own settings, for a search run with ``--ddp N``.

With ``--ddp N`` every trial runs its step in N processes of one torch.distributed group, one GPU
each, the model wrapped in ``torch.nn.parallel.DistributedDataParallel`` (``autotune.trial.ddp_rank``). DDP
averages gradients across the processes with all-reduces that overlap the backward pass, bucket
by bucket; three of its arguments change how well that overlap works (PyTorch's DDP notes and
``DistributedDataParallel``'s documentation):

* ``bucket_cap_mb``: the size of a gradient bucket. Small buckets start all-reducing earlier in
  the backward pass (more overlap) but pay a collective's launch cost more often; one bucket the
  size of the model overlaps nothing. Offered: 10, 25 (PyTorch's default), 50 and 100 MB, which
  for a ResNet-50 (about 100 MB of FP32 gradients) span ten buckets down to one.
* ``gradient_as_bucket_view``: gradients are views into the buckets instead of copies, which
  saves a copy per step and the memory of one gradient-sized buffer.
* ``static_graph``: DDP may assume the same parameters are used in the same order every step and
  skip its per-step bookkeeping. Offered only for eager steps: with torch.compile, DDP must keep
  ``static_graph=False`` (pytorch/pytorch#93672; TorchDynamo's DDPOptimizer splits the graph at
  the bucket boundaries itself).

``world_size`` is not searched: it is the space's ``ddp_world_size`` (the ``--ddp N`` the study
was made with), recorded in the config so that ``autotune.load`` knows the configuration was
measured under DDP and wraps the model (``autotune.deploy.runtime.prepare_model``). Its default, 1, is
the untuned behaviour: no DDP at all, which is what every search without ``--ddp`` (and every
config.json written before this knob existed) ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy

BUCKET_CAPS_MB = [10, 25, 50, 100]
"""The bucket sizes ``--ddp`` searches; 25 MB is PyTorch's default."""


def candidates() -> dict[str, list[Any]]:
    """The SearchSpace choices of a ``--ddp`` search, by field."""
    return {"ddp_bucket_caps_mb": list(BUCKET_CAPS_MB), "ddp_gradient_as_bucket_view": [False, True],
            "ddp_static_graph": [False, True]}


def _ddp_on(knobs: Mapping[str, Any]) -> bool:
    return (knobs.get("ddp") or {}).get("world_size", 1) > 1


# its Optuna parameters, named here once (Strategy.param): the engine names them by these
BUCKET_CAP_MB_PARAM = "ddp.bucket_cap_mb"
GRADIENT_AS_BUCKET_VIEW_PARAM = "ddp.gradient_as_bucket_view"
STATIC_GRAPH_PARAM = "ddp.static_graph"


class DDP(Strategy):
    name = "ddp"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        world_size: int = 1
        """Processes (GPUs) of the DDP step: the space's ddp_world_size; 1 means no DDP."""
        bucket_cap_mb: int = 25
        """DistributedDataParallel(bucket_cap_mb=...); 25 is PyTorch's default."""
        gradient_as_bucket_view: bool = False
        """DistributedDataParallel(gradient_as_bucket_view=...)."""
        static_graph: bool = False
        """DistributedDataParallel(static_graph=...); only for eager (uncompiled) steps."""

        def __post_init__(self) -> None:
            if self.world_size < 1:
                raise ValueError(f"ddp.world_size must be at least 1, got {self.world_size}")
            if self.bucket_cap_mb <= 0:
                raise ValueError(f"ddp.bucket_cap_mb must be positive, got {self.bucket_cap_mb}")

    def applies(self, space: SearchSpace) -> bool:
        return space.ddp_world_size > 1

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        return {"ddp_world_size": options.ddp or 1, **(candidates() if options.ddp else {})}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        # DistributedDataParallel as a user builds it, with PyTorch's defaults
        return {BUCKET_CAP_MB_PARAM: self.Config.bucket_cap_mb, GRADIENT_AS_BUCKET_VIEW_PARAM: False,
                STATIC_GRAPH_PARAM: False}

    def words(self, values: Mapping[str, Any]) -> str:
        if values.get("world_size", 1) <= 1:
            return ""
        parts = [f"DDP x{values['world_size']}", f"bucket {values.get('bucket_cap_mb', 25)} MB"]
        if values.get("gradient_as_bucket_view"):
            parts.append("grads as bucket views")
        if values.get("static_graph"):
            parts.append("static graph")
        return ", ".join(parts)

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob(f"ddp.{f}", f"DDP {f}", self.name, f, None, _ddp_on)
                for f in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph")]

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        compile_config = chosen.get("compile")
        compiled = compile_config is not None and compile_config.mode != "off"
        return self.Config(
            world_size=space.ddp_world_size,
            bucket_cap_mb=self.choose(trial, "bucket_cap_mb", space.ddp_bucket_caps_mb),
            gradient_as_bucket_view=self.choose(trial, "gradient_as_bucket_view", space.ddp_gradient_as_bucket_view),
            static_graph=False if compiled else self.choose(trial, "static_graph", space.ddp_static_graph),
        )

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.ddp_world_size = config.world_size
        if config.world_size > 1:
            recipe.ddp = {"bucket_cap_mb": config.bucket_cap_mb,
                          "gradient_as_bucket_view": config.gradient_as_bucket_view,
                          "static_graph": config.static_graph}
        else:
            recipe.ddp = None
