"""Fit before running: what the model needs in memory, measured once before any trial.

The memory probe runs the plain recipe's configuration eagerly (autotune.search.plain_recipe: its
precision, memory format and optimizer, compile off) for two steps at a few small batches, under
the memory limit, in a worker of its own (autotune.trial.work.probe_memory). Its peaks give the
fixed part (weights, gradients, optimizer state, the CUDA context) and the per-sample part
(activations); the study keeps them (autotune.search.memory.PROBE_ATTR), and the memory model sizes
the baseline, the plain recipe and every proposal by them before it starts. Where the base batch
does not fit, the batch range goes down to 1. GPU only: a CPU's memory is the host's.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import strategies
from autotune.space import SearchSpace
from autotune.search import plain_recipe
from autotune.search.memory import BACKOFF_FILL, MemoryModel, family, gib
from autotune.search.options import SearchConfig
from autotune.trial.runner import run_worker

PROBE_BATCHES = (1, 8)
"""Batches the memory probe steps at, up to the first that does not fit: far enough apart that
their peaks' slope is a sample's activations, not the allocator's rounding. Two: each new batch is
new shapes, which cudnn.benchmark times afresh for every convolution (a convolutional model's probe at
four batches took a tenth of a 5-minute budget). Where
a batch does not fit, the probe also measures what the forward keeps at the smallest batch and at twice
the largest that fit (memory_fit.forward_held): near the limit the smaller batch's peak is the
optimizer's phase, and the peaks' slope says too little about a sample.

cudnn.benchmark stays on, as in the plain recipe the probe sizes: off, the probe is faster, but its
line puts the peak under the measured one (other algorithms, other workspaces), and a trial sized by
it may not fit; on, the line is a little over it (scripts/memory_probe_bench.py measures both)."""


@dataclass(frozen=True)
class Fit:
    """What the memory probe found, and what the search does with it."""

    probed: dict[str, Any]
    """The study's PROBE_ATTR: the probed family, its peaks by batch, the batch that did not fit."""
    limit_bytes: float
    base_fits: bool
    """The base batch is predicted to fit (else the batch range goes down to 1)."""

    def model(self) -> MemoryModel:
        model = MemoryModel(self.limit_bytes)
        model.add_probe(self.probed)
        return model

    def fits(self, knobs: dict[str, Any], batch: int) -> bool:
        predicted = self.model().predict(knobs, batch)
        return predicted is None or predicted <= self.limit_bytes * BACKOFF_FILL


def probe_fit(config: SearchConfig, device: str, space: SearchSpace, info: dict[str, Any],
              limit: int | None, *, spare: bool = False) -> Fit | None:
    """Run the memory probe on the GPU (None on a CPU, without a 16-bit precision, or for a search
    that pins its batch); the fit it finds."""
    total = info["provenance"].get("gpu_memory_bytes")
    cap = limit or total
    params = plain_recipe.params(space, min(space.batch_sizes))
    if device != "cuda" or not cap or params is None or len(space.batch_sizes) == 1 or config.ddp:
        return None
    eager = {**params, strategies.compile.MODE_PARAM: "off"} if strategies.compile.MODE_PARAM in params else params
    knobs = strategies.knobs_of(eager, space)
    request = {"mode": "memory", "space": space.to_dict(), "knobs": knobs, "workload": config.workload.to_dict(),
               "measure": config.measure_settings(device).to_dict(), "seed": config.seed,
               "batches": list(PROBE_BATCHES), **({"memory_limit_bytes": limit} if limit else {})}
    result = run_worker(request, timeout_s=config.trial_timeout_s, spare=spare)
    if result.get("status") != "ok":
        warnings.warn(f"the memory probe did not run ({result.get('status')}: {result.get('reason')}); trials are "
                      "sized by what they measure", stacklevel=3)
        return None
    # the sizes the memory knobs' savings follow from (autotune.search.levers), and fp8's and the stem's
    # priors (autotune.search.neighbours.fp8_speed, stem_speed)
    sizes = {key: info.get(key) for key in ("num_parameters", "tokens_per_sample", "vocab_size", "optimizer_class",
                                            "fp8_eligible_share", "fp8_width", "fp8_ff_share", "fp8_ff_width",
                                            "stem_share")
             if info.get(key)}
    probed = {"family": family(knobs), "peaks": result.get("peaks") or {}, "sizes": sizes,
              "does_not_fit_at": result.get("does_not_fit_at"), "forward_held": result.get("forward_held") or {},
              "seconds": result.get("seconds")}
    fit = Fit(probed=probed, limit_bytes=float(cap), base_fits=True)
    return dataclasses.replace(fit, base_fits=fit.fits(knobs, space.base_batch_size))


def widen_to_fit(config: SearchConfig, space: SearchSpace, fit: Fit | None) -> bool:
    """Whether, the base batch not fitting and the user having set no --min-batch-size, the batches
    from 1 are searched (the caller builds that space); says so in one line, with how the user's batch
    is kept."""
    if fit is None or fit.base_fits or config.min_batch_size is not None or config.batch_size:
        return False
    predicted = fit.model().prior_predict({"precision": {"mode": plain_recipe.precision(space)}},
                                          space.base_batch_size)
    need = f" (about {gib(predicted)} of {gib(fit.limit_bytes)})" if predicted else ""
    keep = ("the accumulation keeps it" if space.global_batch_size else
            "the learning rate is scaled linearly (cfg.scaled_lr); --global-batch-size "
            f"{space.base_batch_size} keeps it by accumulating micro-batches instead")
    warnings.warn(f"the base batch {space.base_batch_size} does not fit{need}: batches from 1 are searched, and {keep}",
                  stacklevel=3)
    return True


def plain_recipe_batch(space: SearchSpace, fit: Fit | None) -> int:
    """The plain recipe's batch: the largest the memory probe says fits, up to 4x the base batch."""
    params = plain_recipe.params(space, min(space.batch_sizes))
    if fit is None or params is None:
        return plain_recipe.batch(space)
    knobs = strategies.knobs_of(params, space)
    return plain_recipe.batch(space, fits=lambda b: fit.fits(knobs, b))
