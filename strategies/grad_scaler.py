"""grad_scaler: loss-scaling settings of torch.amp.GradScaler, sampled only with fp16.

bf16 and fp32 keep float32's exponent range and need no loss scaling, so the scaler is disabled
for them (as nanoGPT does: ``GradScaler(enabled=dtype == float16)``). The settings change how
often steps are skipped on overflow, which matters for accuracy more than for speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy
from strategies.precision import MODE_PARAM as PRECISION_MODE_PARAM


def _scaler_on(knobs: Mapping[str, Any]) -> bool:
    return bool((knobs.get("grad_scaler") or {}).get("enabled"))


# its Optuna parameters, named here once (Strategy.param): the engine names them by these
INIT_SCALE_PARAM = "grad_scaler.init_scale"
GROWTH_FACTOR_PARAM = "grad_scaler.growth_factor"
BACKOFF_FACTOR_PARAM = "grad_scaler.backoff_factor"
GROWTH_INTERVAL_PARAM = "grad_scaler.growth_interval"


class GradScalerStrategy(Strategy):
    name = "grad_scaler"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        enabled: bool = False
        """Whether loss scaling is on (only with fp16)."""
        init_scale: float = 65536.0
        """Initial loss scale."""
        growth_factor: float = 2.0
        """Scale multiplier after growth_interval steps without overflow."""
        backoff_factor: float = 0.5
        """Scale multiplier when a step overflows (that step is skipped)."""
        growth_interval: int = 2000
        """Overflow-free steps before the scale grows."""

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        if not tuned or chosen.get(PRECISION_MODE_PARAM) != "fp16":
            return {}
        # torch.amp.GradScaler's defaults: what the guides' fp16 recipe uses
        defaults = self.Config()
        return {self.param(f): getattr(defaults, f)
                for f in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")}

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob(f"grad_scaler.{f}", f"GradScaler {f}", self.name, f, None, _scaler_on)
                for f in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")]

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        precision = chosen.get("precision")
        if precision is None or precision.mode != "fp16":
            return self.Config()
        return self.Config(
            enabled=True,
            init_scale=trial.suggest_categorical(self.param("init_scale"), [2.0**10, 2.0**13, 2.0**16]),
            growth_factor=trial.suggest_categorical(self.param("growth_factor"), [1.5, 2.0, 4.0]),
            backoff_factor=trial.suggest_categorical(self.param("backoff_factor"), [0.25, 0.5]),
            growth_interval=trial.suggest_categorical(self.param("growth_interval"), [500, 1000, 2000, 4000]),
        )

    def apply(self, config: Config, recipe: Recipe) -> None:
        if not config.enabled:
            recipe.grad_scaler = None
            return
        recipe.grad_scaler = {
            "init_scale": config.init_scale,
            "growth_factor": config.growth_factor,
            "backoff_factor": config.backoff_factor,
            "growth_interval": config.growth_interval,
        }
