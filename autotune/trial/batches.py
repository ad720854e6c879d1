"""The synthetic input batches a trial's measured steps cycle through: shared by the worker, its
out-of-memory probe (autotune.trial.memory_fit) and the DDP ranks (autotune.trial.ddp_rank)."""

from __future__ import annotations

from typing import Any

import torch

NUM_HOST_BATCHES = 3  # distinct batches, cycled, so consecutive steps never reuse one buffer


def input_batches(workload, batch_size: int, device: str, on_device: bool, seed: int) -> list[Any]:
    """Distinct random batches, cycled by the measured loop: in pinned host memory (copied each
    step, as from a DataLoader with pin_memory=True) or, with on_device, already on the GPU."""
    if device == "cuda" and workload.make_batch is None:
        # generating a large batch on the CPU takes seconds per trial; on the GPU, milliseconds
        generator = torch.Generator(device="cuda").manual_seed(seed)
        batches = []
        for _ in range(NUM_HOST_BATCHES):
            x = torch.randn((batch_size, *workload.input_shape), generator=generator, device="cuda")
            y = torch.randint(0, workload.num_classes, (batch_size,), generator=generator, device="cuda")
            batches.append((x, y) if on_device else (x.cpu().pin_memory(), y.cpu().pin_memory()))
        return batches
    generator = torch.Generator().manual_seed(seed)
    batches = [workload.batch(batch_size, generator) for _ in range(NUM_HOST_BATCHES)]
    if device == "cuda":
        if on_device:
            return [tuple(t.to("cuda") for t in b) for b in batches]
        return [tuple(t.pin_memory() for t in b) for b in batches]
    return batches
