"""The Strategy contract: every knob samples its Optuna parameters and applies its value.

A strategy does two things and nothing else:

* ``suggest(trial, space, chosen)``: sample its parameters, named ``"<name>.<field>"``, only
  when they mean something (``chosen`` holds the configs of the strategies before it, so
  GradScaler settings are sampled only when precision is fp16), and return its typed ``Config``.
* ``apply(config, recipe)``: write that value into the :class:`~autotune.deploy.recipe.Recipe`: the
  model transforms, the backend switches, the autocast dtype, the step's input pipeline.

Because sampling goes through an Optuna trial, replaying a stored trial's parameters with
``optuna.trial.FixedTrial`` through the same ``suggest`` gives back the same configs; that is how
``autotune.load`` rebuilds exactly what was measured.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping

import optuna

from autotune.deploy.recipe import Recipe
from autotune.deploy.space import SearchSpace


class Strategy(abc.ABC):
    """One tuning knob. Subclasses define ``name``, a nested frozen dataclass ``Config``
    (its defaults are the untuned behaviour), ``suggest`` and ``apply``."""

    name: ClassVar[str]
    Config: ClassVar[type]

    def applies(self, space: SearchSpace) -> bool:
        """Whether this knob exists at all on this space (threads only on a CPU, say)."""
        return True

    @abc.abstractmethod
    def suggest(self, trial: optuna.trial.BaseTrial, space: SearchSpace,
                chosen: Mapping[str, Any]) -> Any:
        """Sample this knob's parameters from ``trial`` and return its Config."""

    @abc.abstractmethod
    def apply(self, config: Any, recipe: Recipe) -> None:
        """Write ``config`` into ``recipe``."""

    # helpers shared by every strategy -------------------------------------------------------

    def param(self, field: str) -> str:
        """The Optuna parameter name of one of this strategy's fields."""
        return f"{self.name}.{field}"

    def choose(self, trial: optuna.trial.BaseTrial, field: str, choices: list[Any]) -> Any:
        """Sample ``field`` among ``choices``; a single choice is taken as it is, with no Optuna
        parameter (nothing to search, and replay gives the same value from the same space)."""
        if len(choices) == 1:
            return choices[0]
        return trial.suggest_categorical(self.param(field), choices)

    def default(self) -> Any:
        """The untuned value, used when the knob does not apply."""
        return self.Config()

    def to_dict(self, config: Any) -> dict[str, Any]:
        return dataclasses.asdict(config)

    def from_dict(self, data: Mapping[str, Any]) -> Any:
        return self.Config(**data)
