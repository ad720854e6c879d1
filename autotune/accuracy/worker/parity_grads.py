"""What a numerics parity run keeps of its tensors (autotune.accuracy.worker.parity): per parameter tensor,
its first gradient and its update over the run (``w_T - w_0``), read by an optimizer step pre-hook
and after the run's last step, on a sample of each large tensor; kept (the reference's) or compared
with the reference's (every other run's) as a few sums; and kept in a file between a search's checks.

The update is what the optimizer made of every step's gradients, rounding and state included: a
tensor whose gradient is zeroed, whose gradients underflow, whose updates round away in low-precision
weights, or whose optimizer states are too coarse moves too little, not at all or wrongly, whatever
its first gradient said. Under AdamW an update integrates the gradients' signs over the steps, so its
size is far steadier from run to run than a first gradient's direction on a BatchNorm network.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

SUMS_CHUNK = 1 << 22
"""Elements a tensor's figures are summed over at a time (tensor_sums): 32 MiB of FP64 a copy."""
GRAD_SAMPLE = 1 << 14
"""Elements of a parameter's first gradient and of its update that are kept and compared where it has
more (sample_indices): drawn at random, the same ones in every run of a check. Kept whole, a large
model's reference tensors take gigabytes and seconds to copy to the host, too much to keep for later
checks. A sample of 16,384 elements estimates a tensor's relative error to about 1% of
itself where the error is spread over the tensor (its spread falls as one over the square root of the
sample: tests/test_parity.py measures it); the tensor's finiteness is checked whole."""
KINDS = ("grads", "updates")
"""What a run keeps of each tensor: its first gradient, its update over the run."""
SUMS = ("d2", "r2", "g2", "dot", "vanished", "nonzero")
"""A tensor's sums against the reference's, r: |g-r|^2, |r|^2, |g|^2, g.r, and how many of the
elements where r is not zero are zero in g (vanished) out of how many r has (nonzero)."""
FORMAT = 2
"""What a kept file holds (read_grads): 2, the first gradients and the updates."""


def sample_indices(name: str, numel: int, seed: int):
    """The GRAD_SAMPLE elements (flat indices, sorted; CPU int64) of a parameter ``name`` of ``numel``
    elements whose first gradient and update a check keeps and compares, drawn from ``seed`` and the
    name by a generator of their own on the host (the same in every run and on every device); None
    where the tensor is kept whole (GRAD_SAMPLE elements or fewer)."""
    import zlib

    import torch

    if numel <= GRAD_SAMPLE:
        return None
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randint(0, numel, (GRAD_SAMPLE,), generator=g).sort().values


def _sampled(t, idx):
    """``t``'s elements at ``idx`` (all where None), flat, FP32, on the host."""
    flat = t.detach().reshape(-1)
    if idx is not None:
        flat = flat[idx.to(flat.device)]
    return flat.float().to("cpu", copy=True)


class RunTensors:
    """An optimizer step pre-hook that reads the first step's gradients (unscaled where a fused
    optimizer unscales them itself: GradScaler then sets ``optimizer.grad_scale``; already unscaled
    otherwise) and the weights they update, and, called after the run's last step (``finish``), the
    weights then. Against ``reference`` ({"grads", "updates"}: name -> CPU tensor of a parameter's
    sampled elements, or all of them; sample_indices) it keeps per-tensor sums only (SUMS); without
    one it keeps the sampled gradients and updates (CPU, FP32). A parameter with no gradient (frozen)
    counts as a zero gradient."""

    def __init__(self, names: dict[int, str], reference: Mapping[str, Mapping[str, Any]] | None,
                 seed: int = 0) -> None:
        self.names = names
        self.reference = reference
        self.seed = seed
        self.active = True
        """The next step is the first (one the GradScaler skips is read again when it is taken)."""
        self.kept: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
        self.sums: dict[str, dict[str, tuple[float, ...]]] = {kind: {} for kind in KINDS}
        self._start: dict[str, Any] = {}

    def _params(self, optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = self.names.get(id(p))
                if name is not None:
                    yield name, p, sample_indices(name, p.numel(), self.seed)

    def _keep_grad(self, name: str, g, *, idx, scale) -> None:
        if self.reference is None:
            kept = _sampled(g, idx)
            self.kept["grads"][name] = kept if scale is None else kept / scale.float().cpu()
            return
        ref = self.reference.get("grads", {}).get(name)
        if ref is not None and ref.numel() == (g.numel() if idx is None else len(idx)):
            self.sums["grads"][name] = tensor_sums(g, ref, scale=scale, idx=idx)

    def __call__(self, optimizer, args, kwargs) -> None:
        import torch

        if not self.active:
            return
        scale = getattr(optimizer, "grad_scale", None)
        self.kept["grads"], self.sums["grads"], self._start = {}, {}, {}  # a skipped step's, replaced
        for name, p, idx in self._params(optimizer):
            self._start[name] = _sampled(p, idx)
            g = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            self._keep_grad(name, g, idx=idx, scale=scale)

    def finish(self, optimizer) -> None:
        """After the run's last step: each tensor's update since its first step (NaN where a weight
        anywhere in the tensor is NaN/Inf)."""
        import torch

        for name, p, idx in self._params(optimizer):
            if name not in self._start:
                continue
            update = _sampled(p, idx) - self._start[name]
            if not bool(torch.isfinite(p.detach()).all()):
                update = torch.full_like(update, math.nan)
            if self.reference is None:
                self.kept["updates"][name] = update
            else:
                ref = self.reference.get("updates", {}).get(name)
                if ref is not None and ref.numel() == update.numel():
                    factor = p.numel() / update.numel()
                    self.sums["updates"][name] = tuple(v * factor for v in tensor_sums(update, ref))


def tensor_sums(g, r, *, scale=None, idx=None, chunk: int = SUMS_CHUNK) -> tuple[float, ...]:
    """SUMS, in FP64, of ``g`` (on its device; divided by the GradScaler's ``scale`` where given)
    against the reference's ``r`` (CPU), ``chunk`` elements at a time: whole, a 1B Llama's embedding
    gradient (262M elements) took 2 GB a copy in FP64. With ``idx`` (sample_indices), ``r`` holds
    those elements of the reference, and the sums are over them, scaled to the whole tensor; a NaN or
    Inf anywhere in ``g`` makes them infinite, as it would whole."""
    import torch

    g = g.reshape(-1)
    factor, finite = 1.0, True
    if idx is not None:
        finite = bool(torch.isfinite(g).all())
        factor = g.numel() / len(idx)
        g = g[idx.to(g.device)]
    r = r.reshape(-1)
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=g.device)
    for start in range(0, g.numel(), chunk):
        gc = g[start:start + chunk].double()
        if scale is not None:
            gc = gc / scale.double()
        rc = r[start:start + chunk].to(gc.device).double()
        moved = rc != 0
        sums += torch.stack([(gc - rc).pow(2).sum(), rc.pow(2).sum(), gc.pow(2).sum(), (gc * rc).sum(),
                             (moved & (gc == 0)).sum().double(), moved.sum().double()])
    d2, r2, g2, dot, vanished, nonzero = (float(v) * factor for v in sums.cpu())
    if not (finite and math.isfinite(d2) and math.isfinite(g2)):
        return (math.inf, r2, math.inf, math.nan, 0.0, nonzero)
    return (d2, r2, g2, dot, vanished, nonzero)


def grads_writer(path: str):
    """Where a worker keeps the reference's first gradients and updates (sampled: GRAD_SAMPLE
    elements a tensor at most) for the checks after it, whole or not at all: with them a later check
    runs the configuration alone."""

    def write(kept: Mapping[str, Any]) -> None:
        import os
        import sys

        import torch

        tmp = f"{path}.tmp"
        torch.save({"format": FORMAT, **{kind: dict(kept[kind]) for kind in KINDS}}, tmp)
        os.replace(tmp, path)
        print(f"parity: reference gradients and updates written to {path}", file=sys.stderr, flush=True)

    return write


def read_grads(path) -> dict[str, Any] | None:
    """The reference's first gradients and updates a worker kept (grads_writer), or None where there
    are none (or of an older format)."""
    import torch

    try:
        kept = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError):
        return None
    if not isinstance(kept, dict) or kept.get("format") != FORMAT:
        return None
    return {kind: kept[kind] for kind in KINDS}
