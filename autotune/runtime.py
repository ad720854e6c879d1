"""The one training step that trials measure and user code runs: autocast, GradScaler, optimizer.

One path for every precision (as nanoGPT does): autocast is entered with ``enabled=False`` for
fp32, and the GradScaler is built with ``enabled=False`` unless fp16 needs loss scaling.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from autotune.recipe import Recipe, apply_backend_flags
from autotune.workloads import logits


def autocast(recipe: Recipe) -> torch.autocast:
    dtype = recipe.autocast_dtype
    return torch.autocast(recipe.device, dtype=dtype or torch.float32, enabled=dtype is not None)


def grad_scaler(recipe: Recipe) -> torch.amp.GradScaler:
    kwargs = recipe.grad_scaler or {}
    return torch.amp.GradScaler(recipe.device, enabled=recipe.grad_scaler is not None, **kwargs)


def prepare_model(model: nn.Module, recipe: Recipe, *, set_flags: bool = True) -> nn.Module:
    """Apply the recipe's model transforms, then move the model to the device and memory format.

    Parameters keep their identity (padding shares them, ``Module.to`` converts in place), so an
    optimizer created before this call still steps the prepared model.
    """
    if set_flags:
        apply_backend_flags(recipe.backend_flags)
    for transform in recipe.model_transforms:
        model = transform(model)
    model = model.to(recipe.device)
    if recipe.memory_format is not torch.contiguous_format:
        model = model.to(memory_format=recipe.memory_format)
    return model


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    """Optimizer state (momentum buffers, Adam moments) follows the parameters to the device."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != torch.device(device) and value.dim() > 0:
                state[key] = value.to(device)


class TrainStep:
    """zero_grad -> forward under autocast -> scaled backward -> optimizer step -> scaler update.

    Returns the loss as a device tensor (no host synchronisation, so steps queue up on the GPU).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], recipe: Recipe,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.recipe = recipe
        self.scaler = scaler if scaler is not None else grad_scaler(recipe)

    def __call__(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self.recipe):
            loss = self.loss_fn(logits(self.model(inputs)), targets)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()
