"""fp32_layers: keep chosen layer kinds in FP32 under autocast, as the mixed-precision guides
advise for numerically sensitive layers.

Kinds: normalization layers (BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm), attention
and softmax (``nn.MultiheadAttention``, ``nn.Softmax`` and modules whose class name says
"Attention"), and the classifier head (the model's last ``nn.Linear``). A chosen layer runs with
autocast disabled on float32 inputs, so its output is float32 too. It costs speed and may buy
accuracy; the study measures both, and a configuration gets it only when the accuracy constraint
needs it. Sampled only with fp16/bf16 autocast (fp32 and tf32 already run every layer in FP32),
among the kinds the probe found in the model (``SearchSpace.fp32_layer_sets``).
"""

from __future__ import annotations

import functools
import itertools
import types
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy

KINDS = ("norm", "attention", "head")
"""Layer kinds, in the order a combination is written ("norm+head")."""

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
_MARK = "_autotune_fp32"


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
LAYERS_PARAM = "fp32_layers.layers"


class FP32Layers(Strategy):
    name = "fp32_layers"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        layers: str = "none"
        """"none", or layer kinds joined by "+" in KINDS order: "norm", "head", "norm+attention+head"."""

    def applies(self, space: SearchSpace) -> bool:
        return len(space.fp32_layer_sets) > 1

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        # keeping layers in FP32 only trades speed for accuracy: offered where the accuracy check
        # can tell whether it is needed, under autocast, for the kinds the model has
        autocast = {"fp16", "bf16"} & set(offered["precisions"])
        return {"fp32_layer_sets": combinations(probe.get("fp32_layer_kinds") or [])
                if options.accuracy_check and autocast else ["none"]}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        return {LAYERS_PARAM: "none"} if tuned else {}  # not a parameter of the FP32 baseline

    def words(self, values: Mapping[str, Any]) -> str:
        return f"fp32 {values['layers']}" if values.get("layers", "none") != "none" else ""

    def report_knobs(self) -> list[ReportKnob]:
        return []  # named in each configuration's description; its effect is on accuracy

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        precision = chosen.get("precision")
        if precision is None or precision.mode not in ("fp16", "bf16"):
            return self.Config()
        return self.Config(layers=self.choose(trial, "layers", list(space.fp32_layer_sets)))

    def apply(self, config: Config, recipe: Recipe) -> None:
        kinds = parse(config.layers)
        if kinds:
            recipe.model_transforms.append(functools.partial(keep_fp32, kinds=kinds))


def parse(layers: str) -> tuple[str, ...]:
    """'norm+head' -> ('norm', 'head'); 'none' -> (). Unknown kinds are an error that lists the known."""
    if layers == "none":
        return ()
    kinds = tuple(layers.split("+"))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"fp32_layers {layers!r}: unknown kind(s) {unknown}; write 'none' or kinds among "
                         f"{', '.join(KINDS)} joined by '+', e.g. 'norm+head'")
    return tuple(k for k in KINDS if k in kinds)


def combinations(kinds: list[str] | tuple[str, ...]) -> list[str]:
    """'none' and every non-empty combination of ``kinds``, written in KINDS order."""
    present = [k for k in KINDS if k in kinds]
    out = ["none"]
    for n in range(1, len(present) + 1):
        out += ["+".join(c) for c in itertools.combinations(present, n)]
    return out


def layers_of_kind(model: nn.Module, kind: str) -> list[nn.Module]:
    """The modules of ``model`` that the kind names (outermost only for attention)."""
    if kind == "norm":
        return [m for m in model.modules() if isinstance(m, _NORM_TYPES)]
    if kind == "attention":
        found: list[nn.Module] = []
        inside: set[int] = set()
        for m in model.modules():  # pre-order: a parent comes before its children
            if id(m) in inside:
                continue
            if isinstance(m, (nn.MultiheadAttention, nn.Softmax)) or "attention" in type(m).__name__.lower():
                found.append(m)
                inside.update(id(c) for c in m.modules())
        return found
    if kind == "head":
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        return linears[-1:]
    raise ValueError(f"unknown layer kind {kind!r}; known: {', '.join(KINDS)}")


def kinds_present(model: nn.Module) -> list[str]:
    """Which kinds this model has (what the probe reports, so the space offers only those)."""
    return [k for k in KINDS if layers_of_kind(model, k)]


def keep_fp32(model: nn.Module, kinds: tuple[str, ...]) -> nn.Module:
    """Make the layers of ``kinds`` run in FP32 under autocast. In place; returns ``model``.

    The layer's forward is replaced on the instance only: parameters, buffers, the state_dict and
    the class stay as they are (checkpoints load either way), and the class's forward is looked
    up at call time, so a class swapped later (channel padding) is still honoured.
    """
    for kind in kinds:
        for layer in layers_of_kind(model, kind):
            if not getattr(layer, _MARK, False):
                object.__setattr__(layer, _MARK, True)
                layer.forward = types.MethodType(_fp32_forward, layer)
    return model


def _fp32_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    device_type = _device_type(args, kwargs)
    if device_type is None or not torch.is_autocast_enabled(device_type):
        return type(self).forward(self, *args, **kwargs)
    with torch.autocast(device_type, enabled=False):
        return type(self).forward(self, *_to_float32(args), **_to_float32(kwargs))


def _device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return None


def _to_float32(value: Any) -> Any:
    """fp16/bf16 tensors (also inside tuples, lists and dicts) as float32; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, tuple):
        return tuple(_to_float32(v) for v in value)
    if isinstance(value, list):
        return [_to_float32(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_float32(v) for k, v in value.items()}
    return value
