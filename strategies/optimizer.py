"""optimizer: which implementation of the user's optimizer runs the step, and how gradients are cleared.

PyTorch's built-in optimizers have up to three implementations of the same update:

* "plain": a Python loop over the parameters, a few kernels per parameter (PyTorch's default on a CPU);
* "foreach": the multi-tensor ``torch._foreach_*`` ops, a few kernels per group of parameters
  (PyTorch's default when every parameter is on a GPU);
* "fused": one fused kernel does the whole update (``fused=True``; SGD, Adam, AdamW, Adagrad on
  CUDA and CPU). A fused optimizer also takes GradScaler's unscaling and inf check on the device
  (``_step_supports_amp_scaling``), so an fp16 step never waits for the host: that is what lets
  an fp16 step be captured in a CUDA graph (see ``strategies.cuda_graphs``).

They compute the same update; they differ in kernel launches, hence in speed. ``TunedConfig.prepare``
rebuilds the user's optimizer (same class, param_groups, hyperparameters and state) with the chosen
implementation, and refuses clearly when that class has no such implementation. "default" (the
untuned value) keeps the user's optimizer as it was built. With 8-bit optimizer states
(``strategies.optimizer_state``) it is "default", unsampled: torchao's 8-bit Adam has one implementation.

``set_to_none`` is ``optimizer.zero_grad(set_to_none=...)``: True (PyTorch's default) frees the
gradients and lets backward write them fresh; False zeroes them in place (a memset per gradient),
which keeps their memory allocated between steps.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from strategies.base import ReportKnob, Strategy

IMPLEMENTATIONS = ("default", "plain", "foreach", "fused")

# what a user's optimizer built with default arguments runs (torch.optim.optimizer's
# _default_to_fused_or_foreach): foreach when every parameter is on a GPU, the plain loop on a CPU
UNTUNED = {"cuda": "foreach", "cpu": "plain"}

_FLAGS = {"plain": {"foreach": False, "fused": False},
          "foreach": {"foreach": True, "fused": False},
          "fused": {"foreach": False, "fused": True}}


# its Optuna parameters, named here once (Strategy.param): the engine names them by these
IMPLEMENTATION_PARAM = "optimizer.implementation"
SET_TO_NONE_PARAM = "optimizer.set_to_none"


class Optimizer(Strategy):
    name = "optimizer"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        implementation: str = "default"
        """default (the user's optimizer as built) | plain | foreach | fused."""
        set_to_none: bool = True
        """optimizer.zero_grad(set_to_none=...)."""

        def __post_init__(self) -> None:
            if self.implementation not in IMPLEMENTATIONS:
                raise ValueError(f"optimizer.implementation {self.implementation!r}: choose from "
                                 f"{', '.join(IMPLEMENTATIONS)}")

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        # zeroing in place keeps gradient memory allocated; on a CPU the difference is noise
        return {"optimizer_implementations": candidates(device),
                "zero_grad_set_to_none": [True, False] if device == "cuda" else [True]}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        # the optimizer as a user builds it with default arguments (the known-good ones that want
        # the fused one say so)
        implementations = space.optimizer_implementations
        untuned = UNTUNED[space.device] if UNTUNED[space.device] in implementations else implementations[0]
        return {IMPLEMENTATION_PARAM: untuned, SET_TO_NONE_PARAM: True}

    def words(self, values: Mapping[str, Any]) -> str:
        parts = []
        if values.get("implementation", "default") != "default":
            parts.append(f"{values['implementation']} optimizer")
        if not values.get("set_to_none", True):
            parts.append("zero_grad in place")
        return ", ".join(parts)

    def report_knobs(self) -> list[ReportKnob]:
        return []  # named in each configuration's description

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        state = chosen.get("optimizer_state")
        # torchao's 8-bit Adam (strategies.optimizer_state) has one implementation: nothing to choose
        implementation = ("default" if state is not None and state.state != "full"
                          else self.choose(trial, "implementation", space.optimizer_implementations))
        return self.Config(implementation=implementation,
                           set_to_none=self.choose(trial, "set_to_none", space.zero_grad_set_to_none))

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.optimizer_implementation = config.implementation
        recipe.zero_grad_set_to_none = config.set_to_none


def candidates(device: str) -> list[str]:
    """The implementations worth measuring on ``device``, the untuned one first.

    On a GPU the plain loop is left out: it computes what foreach computes with a few kernel
    launches per parameter instead of per group, so it is never the faster one there.
    """
    return ["foreach", "fused"] if device == "cuda" else ["plain", "fused"]


def rebuild(optimizer: torch.optim.Optimizer, implementation: str, *,
            capturable: bool = False) -> torch.optim.Optimizer:
    """The user's optimizer with ``implementation`` (and, if asked, ``capturable=True``).

    Returns ``optimizer`` itself when nothing changes. Otherwise a new instance of the same class
    over the same parameter objects, with every param_group's hyperparameters and the whole state
    (momentum buffers, moments, step counts) loaded from the old one. Raises ConfigError when the
    class has no such implementation.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"optimizer implementation {implementation!r}: choose from {', '.join(IMPLEMENTATIONS)}")
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    flags: dict[str, Any] = dict(_FLAGS.get(implementation, {}))
    missing = [k for k, v in flags.items() if v and k not in accepted]
    if missing:
        raise ConfigError(f"this configuration runs the optimizer's {implementation} implementation, but "
                          f"{cls.__module__}.{cls.__name__} has none (no {missing[0]!r} argument); use an optimizer "
                          "that has one (torch.optim.SGD, Adam, AdamW ...), or tune with your optimizer's "
                          "class, or choose a configuration with optimizer.implementation 'default'")
    flags = {k: v for k, v in flags.items() if k in accepted}  # "plain" on a class without foreach: as built
    if capturable:
        if "capturable" in accepted:
            flags["capturable"] = True
        elif not _graph_safe_without_flag(cls):
            raise ConfigError(f"this configuration captures the training step in a CUDA graph, which needs an "
                              f"optimizer whose step never waits for the host; {cls.__name__} has no "
                              "capturable=True option; use SGD, Adam or AdamW, or a configuration with "
                              "cuda_graphs off")
    if not flags or all(group.get(k) == v for group in optimizer.param_groups for k, v in flags.items()):
        return optimizer
    state = optimizer.state_dict()
    groups = [{**{k: v for k, v in group.items() if k != "params"}, **flags, "params": group["params"]}
              for group in optimizer.param_groups]
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    defaults.update(flags)
    try:
        new = cls(groups, **defaults)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ConfigError(f"{cls.__name__} cannot run its {implementation} implementation here ({exc}); "
                          "choose a configuration with another optimizer.implementation") from None
    new.load_state_dict(state)
    # load_state_dict takes the saved groups' values, implementation flags included: set them again
    for group in new.param_groups:
        group.update(flags)
    return new


def prime_fused_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """Give a fused SGD with momentum zero momentum buffers before its first step; returns whether
    it made any.

    Fused SGD creates its buffers with ``torch.empty_like`` on its first step and has the kernel fill them.
    When GradScaler skips that step (fp16's usual overflow in the first steps), the kernel returns at once
    (``found_inf``), the buffers keep whatever the memory held, and the next step multiplies that into the
    weights: NaN right away on a GPU, where the caching allocator hands back the memory of freed tensors (an
    fp16 + fused SGD + CUDA graphs trial ends with a NaN loss; on a CPU the buffer after a skipped first
    step holds garbage such as 1.3e-13). A zero buffer makes the first step the same computation, ``0.9 * 0
    + g = g``, because the first step's ``buf = g`` equals ``momentum * 0 + (1 - dampening) * g`` when
    dampening is 0; a skipped step then leaves it zero, as the other implementations leave no buffer. Groups
    with dampening keep PyTorch's behaviour (their first step differs).
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    made = False
    for group in optimizer.param_groups:
        if not group.get("fused") or group.get("momentum", 0) == 0 or group.get("dampening", 0) != 0:
            continue
        for param in group["params"]:
            state = optimizer.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                made = True
    return made


def _graph_safe_without_flag(cls: type) -> bool:
    """SGD keeps no per-step host state (no step counter), so its step captures as it is."""
    return issubclass(cls, torch.optim.SGD)
