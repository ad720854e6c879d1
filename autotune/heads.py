"""What a model's output is to its loss, shared by the workloads and the knobs that replace the loss (the fused
linear cross-entropy, strategies.loss_kernel): the main logits of an output that carries extras, and the
causal language model's loss. Nothing here imports the rest of autotune."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def logits(output: Any) -> Any:
    """The main output of a model whose training forward returns extras (Inception, GoogLeNet)."""
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return output


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position, in FP32 whatever autocast made the logits."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
