"""threads: intra-op CPU threads (torch.set_num_threads), searched on CPU only.

More threads are not always faster: small ops pay synchronisation, and hyper-threads share
execution units. Measured per model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy
from strategies.dataloader import num_cpus as cpus_available


def candidates(num_cpus: int | None = None) -> list[int]:
    """1, 2, 4, ... up to the CPUs this process may use, and that number itself."""
    n = cpus_available() if num_cpus is None else num_cpus
    values, v = set(), 1
    while v < n:
        values.add(v)
        v *= 2
    values.add(n)
    return sorted(values)


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
NUM_THREADS_PARAM = "threads.num_threads"


class Threads(Strategy):
    name = "threads"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        num_threads: int = 0
        """torch.set_num_threads value; 0 leaves PyTorch's default."""

    def applies(self, space: SearchSpace) -> bool:
        return bool(space.thread_counts)

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        if device == "cuda":
            return {"thread_counts": []}
        # under --ddp on a CPU the ranks run at once, each on its share of the cores
        return {"thread_counts": candidates(max(1, cpus_available() // options.ddp) if options.ddp else None)}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        return {NUM_THREADS_PARAM: max(space.thread_counts) if space.thread_counts else 0}

    def words(self, values: Mapping[str, Any]) -> str:
        n = values.get("num_threads")
        return f"{n} thread{'' if n == 1 else 's'}" if n else ""

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("threads", "CPU threads", self.name, "num_threads", 0)]

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(num_threads=self.choose(trial, "num_threads", space.thread_counts))

    def apply(self, config: Config, recipe: Recipe) -> None:
        if config.num_threads > 0:
            recipe.backend_flags["num_threads"] = config.num_threads
