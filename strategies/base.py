"""The Strategy contract: every knob samples its Optuna parameters and applies its value.

A strategy owns its knob. It must do two things:

* ``suggest(trial, space, chosen)``: sample its parameters, named ``"<name>.<field>"``, only
  when they mean something (``chosen`` holds the configs of the strategies before it, so
  GradScaler settings are sampled only when precision is fp16), and return its typed ``Config``.
* ``apply(config, recipe)``: write that value into the :class:`~autotune.recipe.Recipe`: the
  model transforms, the backend switches, the autocast dtype, the step's input pipeline.

and it may say, where the defaults below do not fit:

* ``offer(options, device, probe, offered)``: its choices on this device for this search (the
  SearchSpace fields it owns, or its own entry in ``SearchSpace.choices``);
* ``seed(space, tuned=..., chosen=...)``: its Optuna parameters in the FP32 baseline
  (``tuned=False``) and in the known-good configurations the search measures first;
* ``words(values)``: its part of a configuration's one-line description;
* ``report_knobs()``: the dimensions the report shows the effect of (``label`` names the knob).

The search space, the seeds, the descriptions and the report's list of knobs are all derived
from ``strategies.REGISTRY``: a new knob is one module here plus one line there.

Because sampling goes through an Optuna trial, replaying a stored trial's parameters with
``optuna.trial.FixedTrial`` through the same ``suggest`` gives back the same configs; that is how
``autotune.load`` rebuilds exactly what was measured.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import optuna

from autotune.recipe import Recipe
from autotune.space import SearchSpace


@dataclasses.dataclass(frozen=True)
class ReportKnob:
    """One dimension the report shows the effect of: a field of a strategy's recorded values."""

    key: str
    """Its column in the report's data: "precision", "grad_scaler.init_scale"."""
    label: str
    strategy: str
    field: str
    default: Any = None
    """The value of a trial recorded before the field existed."""
    only: Callable[[Mapping[str, Any]], bool] = lambda knobs: True
    """Which trials (by their recorded knobs) the field means something for (GradScaler settings
    only with fp16)."""

    def get(self, knobs: Mapping[str, Any]) -> Any:
        return (knobs.get(self.strategy) or {}).get(self.field, self.default)


class Strategy(abc.ABC):
    """One tuning knob. Subclasses define ``name``, a nested frozen dataclass ``Config``
    (its defaults are the untuned behaviour), ``suggest`` and ``apply``."""

    name: ClassVar[str]
    Config: ClassVar[type]
    label: ClassVar[str] = ""
    """The knob in the report's words ("CUDA streams"); the name when empty."""

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

    def offer(self, options: Any, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        """This knob's choices for a search: keyword arguments of SearchSpace (the fields it owns,
        or ``{"choices": {self.name: ...}}`` for a knob without fields there), from the search's
        options (autotune.search.options.SearchConfig), the device, the probe's findings about the
        model and device, and what the strategies before it offered. Raise ConfigError for options
        this device cannot honour. Default: nothing (the knob samples from its own constants)."""
        return {}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        """This knob's Optuna parameters in a seed configuration: the FP32 baseline as a user
        writes it (``tuned=False``), or a known-good configuration (``tuned=True``), given the
        parameters fixed so far (``chosen``: precision, batch). Default: none (Optuna samples)."""
        return {}

    def words(self, values: Mapping[str, Any]) -> str:
        """This knob's part of a configuration's one-line description, from its recorded values
        (of any autotune version: missing fields take their defaults); "" says nothing."""
        return ""

    def report_knobs(self) -> list[ReportKnob]:
        """The fields whose effect the report shows. Default: each field of Config, labelled
        "<label> <field>" when the knob has several fields."""
        fields = [f.name for f in dataclasses.fields(self.Config)]
        label = self.label or self.name
        return [ReportKnob(key=self.name if len(fields) == 1 else f"{self.name}.{f}",
                           label=label if len(fields) == 1 else f"{label} {f}", strategy=self.name, field=f,
                           default=getattr(self.Config(), f)) for f in fields]

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


def swap_layers(model: Any, eligible: Callable[[Any], bool], cls: type) -> Any:
    """Swap the class of every module of ``model`` that ``eligible`` accepts to ``cls``, in place (the
    same module objects and parameters: a subclass that computes the same function another way).
    Returns ``model``."""
    for module in model.modules():
        if eligible(module):
            module.__class__ = cls
    return model


class LayerSwap(Strategy):
    """A knob of two choices for some of the model's layers: "framework" (the layers as they are) or
    ``swapped`` (their class swapped by ``transform``, a staticmethod calling :func:`swap_layers`, to compute the same function
    another way). Offered on CUDA for a model in which the probe counted such layers (``probe_key``).
    Subclasses set those, ``words_swapped`` (the description's words for it) and a one-field ``Config``
    whose field is ``field``, defaulting to "framework"."""

    field: ClassVar[str]
    swapped: ClassVar[str]
    probe_key: ClassVar[str]
    words_swapped: ClassVar[str]
    transform: ClassVar[Callable[[Any], Any]]

    @property
    def choices(self) -> tuple[str, str]:
        return ("framework", self.swapped)

    def applies(self, space: SearchSpace) -> bool:
        return len(space.choices.get(self.name, [])) > 1

    def offer(self, options: Any, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        return {"choices": {self.name: list(self.choices)}} if device == "cuda" and probe.get(self.probe_key) else {}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        return {self.param(self.field): "framework"} if self.applies(space) else {}

    def words(self, values: Mapping[str, Any]) -> str:
        return self.words_swapped if values.get(self.field, "framework") == self.swapped else ""

    def suggest(self, trial: optuna.trial.BaseTrial, space: SearchSpace, chosen: Mapping[str, Any]) -> Any:
        return self.Config(**{self.field: self.choose(trial, self.field, space.choices[self.name])})

    def apply(self, config: Any, recipe: Recipe) -> None:
        value = getattr(config, self.field)
        if value not in self.choices:
            raise ValueError(f"{self.param(self.field)} {value!r}: write one of {', '.join(self.choices)}")
        if value == self.swapped:
            recipe.model_transforms.append(self.transform)
