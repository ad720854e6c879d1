"""What a search optimizes (`--objective`): throughput, energy per sample or peak memory.

The objective decides the Optuna study's direction and each completed trial's value; everything
that ranks trials (the best trial, the accuracy gate's frontier, the export, the report, the
comparison) reads it from here. A study records its objective as the user attribute
``OBJECTIVE_ATTR`` when it is created; a study without it (written before the option existed)
optimized throughput.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from autotune.errors import ConfigError

OBJECTIVE_ATTR = "objective"
DEFAULT_OBJECTIVE = "throughput"


@dataclass(frozen=True)
class Goal:
    name: str
    """"throughput", "energy" or "memory" (the --objective value)."""
    direction: str
    """Optuna's study direction: "maximize" or "minimize"."""
    unit: str
    """The unit of the value, for humans."""
    column: str
    """The trials.csv column that holds the value (peak memory: bytes in the study, GiB in the table)."""
    needs_nvml: bool = False

    @property
    def maximize(self) -> bool:
        return self.direction == "maximize"

    @property
    def text(self) -> str:
        """E.g. "throughput (samples/s, higher is better)"."""
        return f"{self.name} ({self.unit}, {'higher' if self.maximize else 'lower'} is better)"

    def value(self, figures: Mapping[str, Any] | None, energy: Mapping[str, Any] | None) -> float | None:
        """A measured trial's value under this objective; None when the figure was not measured."""
        figures, energy = figures or {}, energy or {}
        raw = {"throughput": figures.get("samples_per_s"), "energy": energy.get("joules_per_sample"),
               "memory": figures.get("peak_memory_bytes")}[self.name]
        return None if raw is None else float(raw)

    def format(self, value: float | None) -> str:
        if value is None:
            return "-"
        if self.name == "throughput":
            return f"{value:,.0f} samples/s"
        if self.name == "energy":
            return f"{value:.3g} J/sample"
        return f"{value / 2**30:.2f} GiB"


GOALS: dict[str, Goal] = {
    "throughput": Goal("throughput", "maximize", "samples/s", "samples_per_s"),
    "energy": Goal("energy", "minimize", "joules per sample", "joules_per_sample", needs_nvml=True),
    "memory": Goal("memory", "minimize", "peak memory", "peak_memory_gb"),
}


def goal(name: str | None) -> Goal:
    """The Goal named ``name`` (None: throughput); a clear error for another name."""
    name = name or DEFAULT_OBJECTIVE
    if name not in GOALS:
        raise ConfigError(f"--objective {name!r}: choose throughput (samples/s), energy (joules per sample, "
                          "needs NVML on a GPU) or memory (peak memory)")
    return GOALS[name]


def goal_of(study) -> Goal:
    """The objective ``study`` was created with (throughput for a study older than the option)."""
    return goal(study.user_attrs.get(OBJECTIVE_ATTR))


def goal_of_config(info: Mapping[str, Any] | None) -> Goal:
    """The objective recorded in a parsed config.json (throughput for one older than the option)."""
    recorded = (info or {}).get("objective")
    return goal(recorded.get("name") if isinstance(recorded, Mapping) else recorded)


def nvml_refusal(device: str, nvml: Mapping[str, Any] | None) -> str | None:
    """Why ``--objective energy`` cannot run on ``device`` (the probe's ``nvml`` entry), or None."""
    if device != "cuda":
        return ("--objective energy needs NVML's energy counter on an NVIDIA GPU, and this search runs on the "
                "CPU; use --objective throughput or --objective memory here, or search on a GPU")
    if not (nvml or {}).get("available"):
        reason = (nvml or {}).get("reason") or "the probe could not open NVML"
        return (f"--objective energy needs NVML, which is not usable here ({reason}); install the NVIDIA driver's "
                "NVML (pip install nvidia-ml-py) or use --objective throughput or --objective memory")
    return None
