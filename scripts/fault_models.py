"""Models that fail on purpose, for scripts/faults.py: importable as fault_models:NAME.

Each misbehaves only at batch sizes of 24 and more, so one search holds healthy trials (the
baseline at batch 16) and faulty ones (the seed at the largest batch); the fault kind comes from
the AUTOTUNE_FAULT environment variable, which the worker inherits.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

FAULTY_FROM_BATCH = 24


class Faulty(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fault = os.environ.get("AUTOTUNE_FAULT", "")
        if x.shape[0] >= FAULTY_FROM_BATCH:
            if fault == "oom":
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} GiB (injected)")
            if fault == "wrapped-oom":
                try:
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                except torch.OutOfMemoryError as exc:
                    raise RuntimeError("forward failed") from exc
            if fault == "hang":
                time.sleep(3600)
            if fault == "crash":
                os._exit(11)
            if fault == "nan":
                return self.net(x) * float("nan")
            if fault == "raise":
                raise ValueError("injected bug in the user's model")
            if fault == "cuda-oom" and x.is_cuda:
                torch.empty(1 << 50, dtype=torch.uint8, device=x.device)  # a petabyte: a real CUDA OOM
            if fault == "device-assert" and x.is_cuda:
                index = torch.tensor([1 << 40], device=x.device)
                x = x + x.flatten()[index].reshape(1, 1, 1, 1)
        return self.net(x)


def faulty(num_classes: int = 10) -> nn.Module:
    return Faulty(num_classes)
