"""dataloader: how a ``torch.utils.data.DataLoader`` feeds the step (worker processes, pinned
memory, prefetch depth), searched only when the search has real data (``--data``).

Without ``--data`` the timed steps are fed ready-made batches, so there is no loader to tune.
With it, every trial feeds its steps from a DataLoader over the training split (JPEG decode,
resize, normalise in the loader's workers), built with this knob's settings; the streams knob
copies its batches to the device (on a side stream with 2 streams, which overlaps compute only
from pinned memory). A configuration the loader cannot keep busy is "data-bound": the worker
measures the same step fed from memory too and records both rates (``autotune.trial.loader_feed``).

* ``num_workers``: 0 decodes in the training process, in series with the step (the untuned
  DataLoader); more overlap decoding with compute, up to the CPUs this process may use.
* ``pin_memory``: batches land in page-locked memory (a pinning thread), so the host-to-device
  copy is asynchronous; only offered on a GPU.
* ``prefetch_factor``: batches each worker keeps ready; deeper absorbs slow images, costs memory.

``persistent_workers`` is not searched: a trial measures one endless epoch (no epoch boundary
inside its window), and keeping the workers between epochs only saves their restart, so
:func:`loader_kwargs` turns it on whenever there are workers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy

PREFETCH_FACTORS = [2, 4]
"""2 is the DataLoader's default."""


def num_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def candidates(cpus: int | None = None) -> list[int]:
    """Worker counts worth measuring: 0 (decode in the training process), then 1, 2, 4, ... up
    to the CPUs this process may use, and that number itself; never more workers than CPUs."""
    n = max(1, num_cpus() if cpus is None else cpus)
    values, v = {0, n}, 1
    while v < n:
        values.add(v)
        v *= 2
    return sorted(values)


# its Optuna parameters, named here once (Strategy.param): the engine names them by these
NUM_WORKERS_PARAM = "dataloader.num_workers"
PIN_MEMORY_PARAM = "dataloader.pin_memory"
PREFETCH_FACTOR_PARAM = "dataloader.prefetch_factor"


class DataLoaderStrategy(Strategy):
    name = "dataloader"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        num_workers: int = 0
        """DataLoader worker processes; 0 loads in the training process (the DataLoader's default)."""
        pin_memory: bool = False
        """Collate into page-locked host memory, so host-to-device copies run asynchronously."""
        prefetch_factor: int = 2
        """Batches each worker loads ahead (meaningful only with workers)."""

        def __post_init__(self) -> None:
            if self.num_workers < 0:
                raise ValueError(f"dataloader.num_workers must not be negative, got {self.num_workers}")
            if self.prefetch_factor < 1:
                raise ValueError(f"dataloader.prefetch_factor must be at least 1, got {self.prefetch_factor}")

    def applies(self, space: SearchSpace) -> bool:
        return bool(space.dataloader_workers)

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        # with real data the timed steps are fed by a DataLoader, whose settings are searched too
        data = bool(options.data)
        return {"dataloader_workers": candidates() if data else [],
                "dataloader_pin_memory": [False, True] if device == "cuda" and data else [False],
                "dataloader_prefetch_factors": PREFETCH_FACTORS if data else [2]}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        return seed_params(space, tuned=tuned)

    def words(self, values: Mapping[str, Any]) -> str:
        if not (values.get("num_workers") or values.get("pin_memory")):
            return ""
        return f"{values.get('num_workers', 0)} loader workers" + (", pinned" if values.get("pin_memory") else "")

    def report_knobs(self) -> list[ReportKnob]:
        return []  # named in each configuration's description

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        workers = self.choose(trial, "num_workers", space.dataloader_workers)
        # without workers there is nothing to prefetch: no parameter, the default value
        prefetch = self.choose(trial, "prefetch_factor", space.dataloader_prefetch_factors) if workers else 2
        return self.Config(num_workers=workers, pin_memory=self.choose(trial, "pin_memory", space.dataloader_pin_memory),
                           prefetch_factor=prefetch)

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.dataloader = loader_kwargs(config)


def loader_kwargs(config: DataLoaderStrategy.Config) -> dict[str, Any]:
    """DataLoader keyword arguments for ``config``: what the trial built its loader with, plus
    ``persistent_workers`` (see the module docstring) and ``drop_last=True`` (every step has the
    measured batch shape, which a CUDA graph or a compiled step needs)."""
    kwargs: dict[str, Any] = {"num_workers": config.num_workers, "pin_memory": config.pin_memory,
                              "drop_last": True}
    if config.num_workers > 0:
        # the DataLoader refuses prefetch_factor and persistent_workers without workers
        kwargs.update(prefetch_factor=config.prefetch_factor, persistent_workers=True)
    return kwargs


def seed_params(space: SearchSpace, *, tuned: bool) -> dict[str, Any]:
    """Optuna parameters of the seed configurations: the untuned DataLoader (no workers, no
    pinning) for the baseline, every CPU decoding into pinned memory for the known-good ones."""
    if not tuned:
        return {NUM_WORKERS_PARAM: 0, PIN_MEMORY_PARAM: False}
    params: dict[str, Any] = {NUM_WORKERS_PARAM: max(space.dataloader_workers or [0]),
                              PIN_MEMORY_PARAM: max(space.dataloader_pin_memory)}
    if params[NUM_WORKERS_PARAM]:
        params[PREFETCH_FACTOR_PARAM] = min(space.dataloader_prefetch_factors)
    return params


class EndlessSampler(Sampler[int]):
    """Sample indices as epoch after epoch of seeded shuffles, without end: a trial's steps are
    fed as from the middle of a long epoch, never paying an epoch boundary inside its window, and
    a dataset smaller than a batch still fills every batch."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        if num_samples < 1:
            raise ValueError("the training dataset is empty")
        self.num_samples = num_samples
        self.seed = seed

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield from torch.randperm(self.num_samples, generator=g).tolist()


def endless_loader(dataset: Dataset, batch_size: int, kwargs: Mapping[str, Any], *, seed: int = 0) -> DataLoader:
    """The DataLoader a trial feeds its steps from: ``kwargs`` (the knob's), an endless shuffle.

    Without ``persistent_workers``: there is no second epoch to keep them for, and a persistent
    loader would hold its iterator, so dropping the iterator would not stop the workers."""
    kwargs = {k: v for k, v in kwargs.items() if k != "persistent_workers"}
    return DataLoader(dataset, batch_size=batch_size, sampler=EndlessSampler(len(dataset), seed), **kwargs)
