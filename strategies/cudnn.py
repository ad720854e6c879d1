"""cudnn: torch.backends.cudnn.benchmark on or off.

With benchmark on, cuDNN times its convolution algorithms for each new input shape and keeps
the fastest; it costs time in the first steps (which the measurement's warm-up absorbs) and
may pick algorithms with larger workspaces (which the memory figure includes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
BENCHMARK_PARAM = "cudnn.benchmark"


class Cudnn(Strategy):
    name = "cudnn"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        benchmark: bool = False
        """torch.backends.cudnn.benchmark."""

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        return {"cudnn_benchmark": [False, True] if device == "cuda" else [False]}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        return {BENCHMARK_PARAM: tuned}

    def words(self, values: Mapping[str, Any]) -> str:
        return "cudnn.benchmark" if values.get("benchmark") else ""

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("cudnn", "cudnn.benchmark", self.name, "benchmark", False)]

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(benchmark=self.choose(trial, "benchmark", space.cudnn_benchmark))

    def apply(self, config: Config, recipe: Recipe) -> None:
        if recipe.device == "cuda":
            recipe.backend_flags["cudnn_benchmark"] = config.benchmark
