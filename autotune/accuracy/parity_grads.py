"""The first gradients a numerics parity check compares (autotune.accuracy.parity): read in an optimizer
step pre-hook, kept (the reference's) or compared (every other run's) per tensor, on a sample of each
large tensor, and kept in a file between a search's checks.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

SUMS_CHUNK = 1 << 22
"""Elements a gradient's figures are summed over at a time (tensor_sums): 32 MiB of FP64 a copy."""
GRAD_SAMPLE = 1 << 14
"""Elements of a parameter's first gradient that are kept and compared where it has more (sample_indices):
drawn at random, the same ones in every run of a check. Kept whole, a large model's reference gradients take
gigabytes and seconds to copy to the host, too much to keep for later checks, each of which would then take
an FP32 step again for them. A sample of 16,384 elements estimates a tensor's relative error to about 1% of
itself where the error is spread over the tensor (its spread falls as one over the square root of the
sample: tests/test_parity.py measures it); the tensor's finiteness is checked whole."""


def sample_indices(name: str, numel: int, seed: int):
    """The GRAD_SAMPLE elements (flat indices, sorted; CPU int64) of a parameter ``name`` of ``numel``
    elements whose first gradient a check keeps and compares, drawn from ``seed`` and the name by a
    generator of their own on the host (the same in every run and on every device); None where the
    tensor is kept whole (GRAD_SAMPLE elements or fewer)."""
    import zlib

    import torch

    if numel <= GRAD_SAMPLE:
        return None
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randint(0, numel, (GRAD_SAMPLE,), generator=g).sort().values


class FirstGradients:
    """An optimizer step pre-hook that reads the first step's gradients: unscaled where a fused
    optimizer unscales them itself (GradScaler then sets ``optimizer.grad_scale``), already unscaled
    otherwise. Against ``reference`` (name -> CPU tensor: a parameter's sampled elements, or all of
    them; sample_indices) it keeps per-tensor sums only (|g-r|^2, |r|^2, |g|^2, g.r); without one it
    keeps the gradients' sampled elements (CPU, FP32)."""

    def __init__(self, names: dict[int, str], reference: Mapping[str, Any] | None, seed: int = 0) -> None:
        self.names = names
        self.reference = reference
        self.seed = seed
        self.active = True
        self.kept: dict[str, Any] = {}
        self.sums: dict[str, tuple[float, float, float, float]] = {}

    def __call__(self, optimizer, args, kwargs) -> None:
        if not self.active:
            return
        scale = getattr(optimizer, "grad_scale", None)
        self.kept, self.sums = {}, {}  # a step taken again replaces the one the scaler skipped
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = self.names.get(id(p))
                if name is None or p.grad is None:
                    continue
                g = p.grad.detach()
                idx = sample_indices(name, g.numel(), self.seed)
                if self.reference is None:
                    g = g.reshape(-1) if idx is None else g.reshape(-1)[idx.to(g.device)]
                    g = g.float() if scale is None else g.float() / scale.float()
                    self.kept[name] = g.to("cpu", copy=True)
                elif name in self.reference and self.reference[name].numel() == (g.numel() if idx is None else len(idx)):
                    self.sums[name] = tensor_sums(g, self.reference[name], scale=scale, idx=idx)


def tensor_sums(g, r, *, scale=None, idx=None, chunk: int = SUMS_CHUNK) -> tuple[float, float, float, float]:
    """(|g-r|^2, |r|^2, |g|^2, g.r) in FP64 of a gradient ``g`` (on its device; divided by the
    GradScaler's ``scale`` where given) against the reference's ``r`` (CPU), ``chunk`` elements at a
    time: whole, a 1B Llama's embedding gradient (262M elements) took 2 GB a copy in FP64, four
    copies on a card its FP32 step had filled to 23.9 of 24 GiB. With ``idx`` (sample_indices), ``r``
    holds those elements of the reference, and the sums are over them, scaled to the whole tensor; a
    NaN or Inf anywhere in ``g`` makes them infinite, as it would whole."""
    import torch

    g = g.reshape(-1)
    factor, finite = 1.0, True
    if idx is not None:
        finite = bool(torch.isfinite(g).all())
        factor = g.numel() / len(idx)
        g = g[idx.to(g.device)]
    r = r.reshape(-1)
    sums = torch.zeros(4, dtype=torch.float64, device=g.device)
    for start in range(0, g.numel(), chunk):
        gc = g[start:start + chunk].double()
        if scale is not None:
            gc = gc / scale.double()
        rc = r[start:start + chunk].to(gc.device).double()
        sums += torch.stack([(gc - rc).pow(2).sum(), rc.pow(2).sum(), gc.pow(2).sum(), (gc * rc).sum()])
    d2, r2, g2, dot = (float(v) * factor for v in sums.cpu())
    return (d2, r2, g2, dot) if finite else (math.inf, r2, math.inf, math.nan)


def grads_writer(path: str):
    """Where a worker keeps the reference's first gradients (sampled: GRAD_SAMPLE elements a tensor at
    most) for the checks after it, whole or not at all: with them a later check takes no FP32 step."""

    def write(grads: Mapping[str, Any]) -> None:
        import os
        import sys

        import torch

        tmp = f"{path}.tmp"
        torch.save(dict(grads), tmp)
        os.replace(tmp, path)
        print(f"parity: reference gradients written to {path}", file=sys.stderr, flush=True)

    return write


def read_grads(path) -> dict[str, Any] | None:
    """The reference's first gradients a worker kept (_grads_writer), or None where there are none."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError):
        return None
