"""fp8_layers: which Linear layers fp8 trains in float8 (sampled only with fp8): all the eligible ones,
or the feed-forward blocks' alone, the attention projections and the output head staying in bf16.

fp8 on every eligible layer can fail the parity check where the attention projections drift most: a 1B
Llama's first gradients 45% off FP32's, the worst tensor an attention projection. On a 2-core CPU (torchao's
emulated float8, a 2-layer Llama of hidden size 256 and a 32,000-token vocabulary, one sequence of 128), fp8
on every eligible layer put the first gradients 12% off FP32's, the worst tensor an attention projection at
16%; on the feed-forward layers alone 8.3%, the worst 11%; every layer but the head 11% and 16%. The
feed-forward layers hold most of a transformer's matmul work (two thirds of the 1B Llama's, its tied head a
fifth), so they keep most of fp8's speed (the planner's prior: neighbours.fp8_speed over their share), and
they pass checks that fp8 on every layer fails. A layer is feed-forward where a part of its qualified name
is one of FEED_FORWARD (HF's Llama, Qwen and Mistral ``mlp``, timm's and torchvision's ViT ``mlp``). Like
precision, it changes the arithmetic: the accuracy check judges each value apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy

LAYERS = ("all", "feed-forward")


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
LAYERS_PARAM = "fp8_layers.layers"


class FP8Layers(Strategy):
    name = "fp8_layers"
    label = "fp8 layers"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        layers: str = "all"
        """all | feed-forward: the eligible Linear layers fp8 trains in float8."""

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        # only where fp8 is searched and the model has feed-forward layers beside others fp8 would take
        share, ff = probe.get("fp8_eligible_share") or 0.0, probe.get("fp8_ff_share") or 0.0
        fp8 = "fp8" in (offered.get("precisions") or [])
        # nothing to choose: no entry, so a study's stored space from before this knob is the same space
        return {"choices": {self.name: list(LAYERS)}} if fp8 and 0 < ff < share else {}

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        precision = chosen.get("precision")
        if precision is None or precision.mode != "fp8":
            return self.Config()
        return self.Config(layers=self.choose(trial, "layers", space.choices.get(self.name) or ["all"]))

    def apply(self, config: Config, recipe: Recipe) -> None:
        from strategies.precision import to_float8_training

        if config.layers == "all":
            return
        recipe.model_transforms[:] = [functools.partial(to_float8_training, layers=config.layers)
                                      if t is to_float8_training else t for t in recipe.model_transforms]

    def words(self, values: Mapping[str, Any]) -> str:
        return "fp8 on feed-forward layers only" if values.get("layers") == "feed-forward" else ""

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("fp8_layers", "fp8 layers", self.name, "layers", "all",
                           lambda knobs: (knobs.get("precision") or {}).get("mode") == "fp8")]
