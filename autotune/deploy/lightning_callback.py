"""The Lightning export's callback: what a ``lightning.Trainer`` has no flag for, applied to its run.

    exp = autotune.load("runs/resnet50-h200/config.json").lightning()
    trainer = lightning.Trainer(**exp.trainer_kwargs, max_epochs=10)   # precision, callback, ...
    trainer.fit(module, DataLoader(dataset, shuffle=True, **exp.dataloader_kwargs))

Importing this module imports Lightning (``pip install lightning``): autotune itself never does.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autotune.deploy.compile_cache import load_once
from autotune.deploy.exports import LightningExport, lightning_settings, require
from autotune.recipe import Recipe, apply_backend_flags
from autotune.deploy.runtime import in_format
from autotune.errors import ConfigError
from strategies.compile import compile_regions

pl = require("lightning", "lightning.pytorch")

# the optimizer flags of each implementation (as strategies.optimizer rebuilds with them)
IMPLEMENTATION_FLAGS = {"plain": {"foreach": False, "fused": False},
                        "foreach": {"foreach": True, "fused": False},
                        "fused": {"foreach": False, "fused": True}}


def inputs_in_format(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                     memory_format: torch.memory_format) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook: 4-D tensor inputs in the tuned memory format (as cfg.loader gives them)."""
    return tuple(in_format(a, memory_format) for a in args), {k: in_format(v, memory_format) for k, v in kwargs.items()}


def set_implementation(optimizer: torch.optim.Optimizer, implementation: str) -> None:
    """Switch the optimizer's implementation in place: its param_groups' foreach/fused flags, which
    its step reads each time. In place, unlike cfg.prepare's rebuild, so the LR schedulers Lightning
    built around this optimizer keep stepping it."""
    flags = IMPLEMENTATION_FLAGS.get(implementation)
    if flags is None:  # "default": the optimizer as configure_optimizers built it
        return
    accepted = inspect.signature(type(optimizer).__init__).parameters
    missing = [k for k, v in flags.items() if v and k not in accepted]
    if missing:
        raise ConfigError(f"this configuration runs the optimizer's {implementation} implementation, but "
                          f"{type(optimizer).__name__} has none (no {missing[0]!r} argument); return torch.optim.SGD, "
                          "Adam or AdamW from configure_optimizers, or use a configuration with another "
                          "optimizer.implementation")
    for group in optimizer.param_groups:
        group.update({k: v for k, v in flags.items() if k in accepted})


class AutotuneCallback(pl.Callback):
    """Applies a tuned recipe's settings that the Trainer has no flag for (the Recipe fields
    exports.LIGHTNING_CALLBACK_FIELDS names): the backend switches (TF32 or true FP32,
    cudnn.benchmark, threads), every model transform (channel padding, FP32 layers, swapped layers,
    ...), the memory format (parameters, and 4-D inputs of the LightningModule's forward),
    torch.compile of the LightningModule in place, the optimizer implementation and fp16's
    GradScaler settings.

    The compile and the input conversion act on the LightningModule's own ``forward`` (``self(x)``
    in ``training_step``); a channels_last model's convolutions run channels_last either way.
    ``compile_cache_path``: the search's compile cache (autotune.deploy.compile_cache), loaded before
    the module is compiled.
    """

    def __init__(self, recipe: Recipe, compile_cache_path: Path | None = None) -> None:
        self.recipe = recipe
        self.compile_cache_path = compile_cache_path
        self.prepared: set[int] = set()  # modules already prepared (fit called again: not twice)

    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        # before the strategy moves the module and configure_optimizers runs: padding keeps the
        # parameter objects, Module.to keeps their memory format when it moves them
        apply_backend_flags(self.recipe.backend_flags)
        if stage != "fit" or id(pl_module) in self.prepared:
            return
        self.prepared.add(id(pl_module))
        for transform in self.recipe.model_transforms:
            if transform(pl_module) is not pl_module:
                raise ConfigError("a model transform of this configuration returned a new module, which a Lightning "
                                  "callback cannot put in place of the LightningModule; use cfg.prepare(model)")
        if self.recipe.memory_format is not torch.contiguous_format:
            pl_module.to(memory_format=self.recipe.memory_format)
            hook = functools.partial(inputs_in_format, memory_format=self.recipe.memory_format)
            pl_module.register_forward_pre_hook(hook, with_kwargs=True)
        if self.recipe.compile_mode is not None and self.compile_cache_path is not None:
            load_once(self.compile_cache_path, self.recipe.device)  # one warning where it cannot
        if self.recipe.compile_mode == "regional":
            compile_regions(pl_module)  # its repeated blocks, each in place
        elif self.recipe.compile_mode is not None:
            pl_module.compile(mode=self.recipe.compile_mode)

    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        # the optimizers exist from here on (the strategy's setup ran configure_optimizers)
        for optimizer in trainer.optimizers:
            set_implementation(optimizer, self.recipe.optimizer_implementation)
        plugin = trainer.precision_plugin
        if self.recipe.grad_scaler is not None and getattr(plugin, "scaler", None) is not None:
            plugin.scaler = torch.amp.GradScaler(self.recipe.device, **self.recipe.grad_scaler)


def lightning_export(cfg: Any) -> LightningExport:
    """The Lightning export of a TunedConfig, with its callback and, for ``--ddp``, its DDPStrategy."""
    data = lightning_settings(cfg)
    callback = AutotuneCallback(cfg.recipe, cfg.compile_cache_path)
    kwargs = dict(data["trainer"], callbacks=[callback])
    if data["strategy"] is not None:
        kwargs["strategy"] = pl.strategies.DDPStrategy(**data["strategy"]["kwargs"])
    return LightningExport(data["precision"], callback, kwargs, data["dataloader"], data["unsupported"])
