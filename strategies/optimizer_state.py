"""optimizer_state: Adam's two moment estimates in full precision, or in 8 bits (torchao).

Adam and AdamW keep two states per parameter, the running mean of the gradient and of its square,
each as large as the parameter: for a 1.24B-parameter model in FP32 that is 9.9 GB, more than the
weights and gradients together, and on a 24 GB card it is what keeps the batch small.

* "full" (the untuned value): the user's optimizer as it is.
* "8bit": ``torchao.optim.AdamW8bit`` (``Adam8bit`` for ``torch.optim.Adam``) in place of the user's
  ``torch.optim.AdamW`` / ``Adam``: the same parameters, param_groups and hyperparameters (lr, betas,
  eps, weight_decay, amsgrad, per group) and the same update, with each state of 4,096 values or
  more (and a multiple of 256) stored as 8-bit codes with one scale per block of 256 values
  (bitsandbytes' block-wise dynamic quantisation, arXiv 2110.02861): about 2 bytes a parameter for
  both states instead of 8. Smaller tensors (biases, norms) keep their states as the parameters'
  dtype. The update itself runs in FP32. AdamW's weight decay stays decoupled
  (``p -= lr * weight_decay * p``) and Adam's stays L2 (added to the gradient), as in torch.

What it changes, and how it composes:

* Numerics: the moments are rounded to 8 bits every step, so it is checked like a precision mode.
* The implementation: torchao's optimizer has one, a ``torch.compile``-d update per parameter
  (compiled once per shape, in the first step: the trial counts that step as compile time). So the
  ``optimizer`` knob's foreach/fused choice does not apply: with "8bit" it is not sampled (recorded
  "default"), and ``rebuild`` refuses a recipe that names one. Because the update is compiled, the
  knob is offered only where the probe compiled a small function (Triton on a GPU; on a CPU, where
  Inductor needs a C++ compiler, only when compile is searched: ``SearchConfig(compile=True)``).
* torch.compile of the model: independent (the optimizer compiles its own function); GradScaler
  (fp16): torchao's optimizer has no fused unscale, so GradScaler unscales the gradients and checks
  them for inf itself before ``step``, as for any optimizer.
* CUDA graphs of the whole step: refused. torchao counts steps in a CPU tensor (``state["step"] +=
  1`` on the host), which a captured step would not replay: every replay would use the bias
  correction of the captured step. ``strategies.cuda_graphs`` does not pair them.
* A resumed run: FP32 moments already in the user's optimizer (a checkpoint loaded before
  ``cfg.prepare``) are quantised into the 8-bit states, step counts kept; 8-bit states are kept as
  they are. Save and load the optimizer that ``cfg.prepare`` returns to resume an 8-bit run.
* torchao keeps each group's lr as a CPU tensor: LR schedulers set it (``fill_``); code that assigns
  ``group["lr"] = value`` gets torchao's error asking for ``fill_``.

* "8bit-bnb": bitsandbytes' ``AdamW8bit`` (``Adam8bit`` for an Adam), the same block-wise 8-bit
  states stepped by one fused CUDA kernel a parameter. torchao's update of a 1B model's parameters takes
  about ten times fused AdamW's (scripts/memory_parts_bench.py measures both): for a step of about 75 ms it
  alone is slower than the memory it frees can buy back, so both are offered and measured. bitsandbytes is
  offered on a GPU where it is installed (``pip install bitsandbytes``); a resumed run's FP32 moments are
  refused there (start from a fresh optimizer, or use "8bit"), and so are CUDA graphs and a torch
  implementation, as for torchao's.

Offered where it can work: the workload's optimizer is exactly ``torch.optim.Adam`` or ``AdamW``
(a subclass may change the update; torchao has 8-bit states for these two), torchao (0.11 or
later: ``pip install 'autotune[memory]'``) is installed, and torch.compile works (see above).
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from strategies.base import Strategy

STATES = ("full", "8bit", "8bit-bnb")
MEMORY_EXTRA = "pip install 'autotune[memory]' (torchao)"
TORCHAO_MIN = (0, 11)
"""torchao.optim (AdamW8bit out of torchao.prototype.low_bit_optim) from this release on."""

EIGHT_BIT = {"torch.optim.adam.Adam": "Adam8bit", "torch.optim.adamw.AdamW": "AdamW8bit"}
"""The user's optimizer class (module.qualname, as the probe reports it) -> its torchao 8-bit class."""

_TORCH_ONLY = frozenset({"foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay"})
"""Group keys of torch's Adam that say how torch runs it; torchao's optimizer has none of them."""
_STATE_KEYS = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}
"""Adam's moment tensors and whether their 8-bit codes are signed (the mean is; its square is not)."""


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
STATE_PARAM = "optimizer_state.state"


class OptimizerState(Strategy):
    """Keep Adam/AdamW's moments in FP32 or in 8 bits (torchao's AdamW8bit/Adam8bit)."""

    name = "optimizer_state"
    label = "optimizer state"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        state: str = "full"
        """full (the user's optimizer as it is) | 8bit (torchao's 8-bit Adam/AdamW states) | 8bit-bnb
        (bitsandbytes')."""

        def __post_init__(self) -> None:
            if self.state not in STATES:
                raise ValueError(f"optimizer_state.state {self.state!r}: choose from {', '.join(STATES)}")

    def applies(self, space: SearchSpace) -> bool:
        return len(space.choices.get(self.name, [])) > 1

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        reason = unavailable(device, probe)
        bnb = device == "cuda" and probe.get("optimizer_class") in EIGHT_BIT and bnb_version() is not None
        if reason is None or bnb:
            return {"choices": {self.name: ["full"] + (["8bit"] if reason is None else []) + (["8bit-bnb"] if bnb else [])}}
        # one line where the user can change it: an Adam workload on a GPU, or a CPU search that compiles
        # (an SGD workload has nothing to quantise, and a CPU search without compile never runs it)
        if probe.get("optimizer_class") in EIGHT_BIT and (device == "cuda" or "compile" in probe):
            warnings.warn(f"8-bit optimizer states are not searched: {reason}", stacklevel=4)
        return {}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        # the baseline and the known-good configurations keep the user's optimizer
        return {self.param("state"): "full"} if self.applies(space) else {}

    def words(self, values: Mapping[str, Any]) -> str:
        # "optimizer", not "AdamW": the recorded values do not say which of Adam and AdamW it was
        state = values.get("state", "full")
        return {"8bit": "8-bit optimizer states", "8bit-bnb": "8-bit optimizer states (bitsandbytes)"}.get(state, "")

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(state=self.choose(trial, "state", space.choices[self.name]))

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.optimizer_state = config.state
        if config.state == "8bit-bnb":
            recipe.notes.append("cfg.prepare returns your Adam/AdamW as bitsandbytes' 8-bit Adam (same param groups "
                                "and hyperparameters): save and load that optimizer's state_dict")
        elif config.state == "8bit":
            recipe.notes.append("cfg.prepare returns your Adam/AdamW as torchao's 8-bit Adam (same param groups and "
                                "hyperparameters): save and load that optimizer's state_dict, and change its "
                                "learning rate with an LR scheduler (torchao keeps it as a tensor)")


def class_name(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class as "module.qualname" ("torch.optim.adamw.AdamW"): what the probe reports."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def torchao_version() -> str | None:
    """The installed torchao's version (without importing it: that takes seconds), or None."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def torchao_missing() -> str | None:
    """Why torchao's 8-bit optimizers cannot be imported here, or None when they can."""
    version = torchao_version()
    if version is None:
        return f"they need torchao, which is not installed; {MEMORY_EXTRA}"
    release = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if release < TORCHAO_MIN:
        return (f"torchao {version} has no torchao.optim.AdamW8bit (torchao {'.'.join(map(str, TORCHAO_MIN))} and "
                f"later have); {MEMORY_EXTRA.replace('pip install', 'pip install -U')}")
    return None


def bnb_version() -> str | None:
    """The installed bitsandbytes' version (without importing it), or None."""
    try:
        return importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return None


def unavailable(device: str, probe: Mapping[str, Any]) -> str | None:
    """Why 8-bit optimizer states cannot be searched for this workload on ``device`` (None: they can),
    from the probe: the workload's optimizer class, and whether torch.compile works."""
    cls = probe.get("optimizer_class")
    if cls not in EIGHT_BIT:
        return (f"the workload's optimizer is {cls or 'unknown'}, not torch.optim.Adam or AdamW "
                "(torchao has 8-bit states for those two)")
    missing = torchao_missing()
    if missing:
        return missing
    check = probe.get("compile")
    if check is None:
        return ("torchao's 8-bit Adam compiles its update with torch.compile, which this search did not check "
                + ("on this GPU (--no-compile)" if device == "cuda" else "on a CPU (search compile: --compile)"))
    if not check.get("works"):
        return ("torchao's 8-bit Adam compiles its update with torch.compile, which does not work here "
                f"({check.get('reason')})")
    return None


def _eight_bit_class_name(optimizer: torch.optim.Optimizer) -> str:
    """"AdamW8bit" or "Adam8bit", the 8-bit class for this torch Adam/AdamW (both libraries name them so);
    ConfigError for an optimizer that cannot be replaced."""
    name = EIGHT_BIT.get(class_name(optimizer))
    if name is None:
        raise ConfigError(f"this configuration keeps Adam's states in 8 bits, but the optimizer is "
                          f"{class_name(optimizer)}, not torch.optim.Adam or AdamW; pass one of those, or choose a "
                          "configuration with optimizer_state 'full'")
    for key in ("maximize", "differentiable"):
        if any(group.get(key) for group in optimizer.param_groups):
            raise ConfigError(f"8-bit Adam has no {key}=True; build your optimizer without it, or choose a "
                              "configuration with optimizer_state 'full'")
    decoupled = {bool(group.get("decoupled_weight_decay", name == "AdamW8bit")) for group in optimizer.param_groups}
    if len(decoupled) > 1:
        raise ConfigError("your optimizer's param groups mix decoupled (AdamW) and L2 (Adam) weight decay; 8-bit "
                          "Adam does one for all groups: choose a configuration with optimizer_state 'full'")
    return "AdamW8bit" if decoupled.pop() else "Adam8bit"


def _eight_bit_class(optimizer: torch.optim.Optimizer) -> type:
    """torchao's 8-bit class for this torch Adam/AdamW; ConfigError for an optimizer it cannot replace."""
    name = _eight_bit_class_name(optimizer)
    missing = torchao_missing()
    try:
        import torchao.optim
    except ImportError as exc:
        raise ConfigError(f"this configuration keeps Adam's states in 8 bits through torchao ({missing or exc}); "
                          f"{MEMORY_EXTRA}") from None
    return getattr(torchao.optim, name)


def _hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A group's values as torchao takes them: torch's implementation flags left out, lr and betas
    as Python floats (torch allows tensors; torchao makes lr a CPU tensor of its own)."""
    out = {k: v for k, v in group.items() if k != "params" and k not in _TORCH_ONLY}
    for key in ("lr", "weight_decay", "eps"):
        if isinstance(out.get(key), torch.Tensor):
            out[key] = float(out[key])
    if "betas" in out:
        out["betas"] = tuple(float(b) for b in out["betas"])
    return out


def _built(cls: type, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An 8-bit Adam of ``cls`` (torchao's or bitsandbytes') over ``optimizer``'s parameter objects,
    each group's hyperparameters (and keys of the user's own) as they were; no state."""
    groups = [{**_hyperparameters(group), "params": group["params"]} for group in optimizer.param_groups]
    accepted = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    defaults = {k: v for k, v in _hyperparameters(optimizer.defaults).items() if k in accepted}
    return cls(groups, **defaults)


def _converted_state(new: torch.optim.Optimizer, param: torch.Tensor, old: Mapping[str, Any]) -> dict[str, Any]:
    """One parameter's torch Adam state as torchao's: the moments quantised into 8-bit buffers (or kept
    as the parameter's dtype where torchao keeps small tensors), the step count as torchao counts it."""
    unknown = set(old) - {"step", *_STATE_KEYS}
    if unknown:
        raise ConfigError(f"the optimizer's state holds {sorted(unknown)}, which torchao's 8-bit Adam does not "
                          "know; choose a configuration with optimizer_state 'full'")
    state: dict[str, Any] = {"step": torch.tensor(float(old.get("step", 0)))}  # torchao: a CPU float32 tensor
    for key, signed in _STATE_KEYS.items():
        if key in old:
            buffer = new._new_buffer(param, signed)  # torchao's own choice of 8 bits or not, by size
            buffer.copy_(old[key].to(device=param.device, dtype=torch.float32))
            state[key] = buffer
    return state


def is_8bit(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer already keeps 8-bit states (one of torchao's or bitsandbytes' 8-bit Adam classes)."""
    return (type(optimizer).__module__.startswith(("torchao.", "bitsandbytes."))
            and type(optimizer).__name__ in EIGHT_BIT.values())


def _bnb(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """bitsandbytes' 8-bit Adam/AdamW over the same parameters and groups; a fresh optimizer only."""
    cls_name = _eight_bit_class_name(optimizer)
    if any(optimizer.state.values()):
        raise ConfigError("this configuration keeps Adam's states in 8 bits with bitsandbytes, which cannot take over "
                          "the FP32 moments your optimizer already holds (a resumed run); prepare a fresh optimizer, "
                          "or choose a configuration with optimizer_state '8bit' (torchao's, which converts them)")
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise ConfigError(f"this configuration keeps Adam's states in 8 bits through bitsandbytes ({exc}); "
                          "pip install bitsandbytes") from None
    return _built(getattr(bnb.optim, cls_name), optimizer)


def rebuild(optimizer: torch.optim.Optimizer, state: str, *, implementation: str = "default",
            cuda_graphs: bool = False) -> torch.optim.Optimizer:
    """The user's optimizer with its states kept as ``state`` says.

    "full" returns ``optimizer`` itself, and so does "8bit" for an optimizer already 8-bit. "8bit" of
    a ``torch.optim.Adam``/``AdamW`` returns torchao's ``Adam8bit``/``AdamW8bit`` over the same
    parameter objects with every group's hyperparameters (and keys of your own, such as an LR
    scheduler's ``initial_lr``), and the state it had (moments quantised, step counts kept).
    Raises ConfigError for what it cannot run: another optimizer class, ``maximize``, a torch
    implementation (``implementation`` other than "default") or a step captured in a CUDA graph.
    """
    if state not in STATES:
        raise ConfigError(f"optimizer state {state!r}: choose from {', '.join(STATES)}")
    if state == "full" or is_8bit(optimizer):
        return optimizer
    if cuda_graphs:
        raise ConfigError("this configuration captures the step in a CUDA graph and keeps Adam's states in 8 bits; "
                          "torchao's 8-bit Adam counts its steps on the host (a CPU tensor), which a replayed graph "
                          "would not advance: choose a configuration with cuda_graphs off or optimizer_state 'full'")
    if implementation != "default":
        raise ConfigError(f"this configuration names the optimizer's {implementation} implementation and 8-bit "
                          "states; torchao's 8-bit Adam has one implementation of its own, so the search never pairs "
                          "them: choose optimizer.implementation 'default' with optimizer_state '8bit'")
    if state == "8bit-bnb":
        return _bnb(optimizer)
    cls = _eight_bit_class(optimizer)
    new = _built(cls, optimizer)
    for param, old in optimizer.state.items():
        if old:
            new.state[param] = _converted_state(new, param, old)
    return new
