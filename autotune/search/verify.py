"""``autotune verify``: a search's recommendation re-measured through ``autotune.load`` in fresh workers,
alone or alternating with variants of it (drift on the machine then hits every arm alike):

- ``--set PARAM=VALUE``: one change of its parameters, what that knob buys on this configuration;
- ``--memory-knobs``: each memory knob it has on (autotune.search.levers: 8-bit optimizer states, a
  fused linear cross-entropy, activation checkpointing, expandable segments) turned off in turn, at the
  same batch: what each bought in speed and in memory, paired on the same configuration rather than
  read off the search's trials as a marginal. A knob whose absence does not fit the card is a result
  ("out of memory"), not a failure; one whose absence fits the card but not the search's
  --memory-limit is measured and flagged. The pairs are written beside config.json
  (MEMORY_KNOB_PAIRS), where ``autotune report`` shows them.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import strategies
from autotune.deploy.config import TunedConfig, variant
from autotune.search import plain_recipe
from autotune.search.levers import LEVERS, untuned
from autotune.trial.runner import run_worker

MEMORY_KNOB_PAIRS = "memory-knob-pairs.json"
"""Beside config.json: what ``autotune verify --memory-knobs`` measured of it, which ``autotune report`` shows
(autotune.report.format.memory_knob_pairs_text)."""

@dataclass
class Arm:
    """One configuration re-measured: the one exported, or a variant of it."""

    label: str
    changes: dict[str, Any]
    path: Path
    rates: list[float] = field(default_factory=list)
    peaks: list[float] = field(default_factory=list)
    failed: str | None = None
    """Why a variant did not run (its worker's status and reason: out of memory, say)."""
    knob: str | None = None
    """The memory knob this variant turns off ("optimizer_state.state=8bit-bnb"); None for the others."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.label, "set": self.changes}
        if self.rates:
            out.update(remeasured=self.rates, median=statistics.median(self.rates),
                       peak_memory_bytes=max(self.peaks) if self.peaks else None)
        if self.failed:
            out["failed"] = self.failed
        return out


def memory_knob_changes(cfg: TunedConfig) -> list[tuple[str, dict[str, Any]]]:
    """(knob as set, the parameters that turn it off) for each memory knob ``cfg`` has on. A parameter
    that only exists with the knob off (the optimizer's implementation, once 8-bit states are off)
    takes the plain recipe's value: the pair is the knob against what the plain recipe runs."""
    plain = plain_recipe.params(cfg.space, int(cfg.params.get(strategies.batch_size.BATCH_SIZE_PARAM, 1))) or {}
    out = []
    for lever in LEVERS:
        if cfg.params.get(lever.param) != lever.value:
            continue
        changes = {lever.param: untuned(lever.param)}
        try:
            TunedConfig.from_params({**cfg.params, **changes}, cfg.space, info=cfg.info)
        except ValueError:  # a parameter the knob's absence brings back, with no value given
            changes.update({k: v for k, v in plain.items() if k not in cfg.params})
        out.append((f"{lever.param}={lever.value}", changes))
    return out


def arms_for(path: Path, cfg: TunedConfig, sets: dict[str, Any], memory_knobs: bool) -> list[Arm]:
    """The exported configuration, then its ``--set`` variant, then each memory knob off."""
    arms = [Arm("exported", {}, path.resolve())]
    folder = Path(tempfile.mkdtemp(prefix="autotune-verify-"))
    wanted = ([("with " + ", ".join(f"{k}={v}" for k, v in sets.items()), sets, None)] if sets else [])
    if memory_knobs:
        wanted += [(f"without {knob}", changes, knob) for knob, changes in memory_knob_changes(cfg)]
    for i, (label, changes, knob) in enumerate(wanted):
        target = folder / f"variant-{i}.json"
        # turning a memory knob off may bring back a parameter (the optimizer's implementation)
        target.write_text(json.dumps(variant(path, changes, new_params=knob is not None), indent=2,
                                     default=str) + "\n")
        arms.append(Arm(label, changes, target, knob=knob))
    return arms


def measure(arms: list[Arm], repeat: int, say: Callable[[str], None], rate: Callable[[float], str]) -> str | None:
    """``repeat`` rounds over ``arms``, alternating; None, or why the exported arm failed. A variant that
    does not run is recorded (its first failure) and left out of later rounds."""
    for _ in range(repeat):
        for arm in arms:
            if arm.failed:
                continue
            result = run_worker({"mode": "trial", "config_path": str(arm.path), "seed": 0}, timeout_s=900)
            if result["status"] != "ok":
                first = (str(result.get("reason") or "").splitlines() or [""])[0]
                why = f"{result['status']}: {first[:200]}"
                if arm.label == "exported":
                    return why
                arm.failed = why
                say(f"{arm.label}: did not run ({why})")
                continue
            figures = result["figures"]
            arm.rates.append(figures["samples_per_s"])
            peak = figures.get("peak_memory_bytes")
            if peak:
                arm.peaks.append(float(peak))
            label = "" if arm.label == "exported" else f" {arm.label}"
            say(f"re-measured {rate(figures['samples_per_s'])}{label}"
                + (f", peak {peak / 2**30:.2f} GiB" if peak else "")
                + f" (worker start {result.get('worker_start_s', 0):.1f}s)")
    return None


def pair_lines(arms: list[Arm], limit_bytes: float | None) -> list[str]:
    """What each memory knob bought, in words: speed and peak memory with it against without it."""
    exported = arms[0]
    med, peak = statistics.median(exported.rates), max(exported.peaks, default=None)
    lines = []
    for arm in arms[1:]:
        if arm.knob is None:
            continue
        knob = arm.knob
        if arm.failed:
            lines.append(f"{knob}: without it the configuration did not run ({arm.failed})")
            continue
        other, other_peak = statistics.median(arm.rates), max(arm.peaks, default=None)
        text = f"{knob}: {med / other:.3f}x the speed of the same configuration without it"
        if peak and other_peak:
            text += f"; peak {peak / 2**30:.2f} GiB against {other_peak / 2**30:.2f} GiB without it"
            if limit_bytes and other_peak > limit_bytes:
                text += f" (over the search's --memory-limit of {limit_bytes / 2**30:.1f} GiB)"
        lines.append(text)
    return lines


def verify(config: Path, *, repeat: int, sets: dict[str, Any], memory_knobs: bool, say: Callable[[str], None],
           rate: Callable[[float], str]) -> tuple[int, dict[str, Any]]:
    """Re-measure ``config`` (config.json or its folder) and its variants; (exit status, the figures).
    ``rate`` words a samples/s figure (a language model's tokens/s beside it)."""
    path = config / "config.json" if config.is_dir() else config
    cfg = TunedConfig.load(path, here=False)  # the workers load it where it runs (the caller checked here)
    recorded = cfg.info["figures"]["samples_per_s"]
    arms = arms_for(path, cfg, sets, memory_knobs)
    if memory_knobs and not any(arm.knob for arm in arms):
        say("this configuration has no memory knob on: nothing to pair")
    failed = measure(arms, repeat, say, rate)
    if failed:
        say(f"re-measurement failed (exported): {failed}")
        return 1, {}
    med = statistics.median(arms[0].rates)
    diff = (med - recorded) / recorded
    say(f"config.json says {rate(recorded)}; re-measured median {rate(med)} ({diff:+.1%})")
    out: dict[str, Any] = {"recorded": recorded, "remeasured": arms[0].rates, "median": med,
                           "relative_difference": diff, "peak_memory_bytes": max(arms[0].peaks, default=None)}
    if sets and arms[1].rates:
        other = statistics.median(arms[1].rates)
        say(f"{arms[1].label}: median {rate(other)}, {other / med:.3f}x the config as exported (measured alternately)")
        out["variant"] = {"set": sets, "remeasured": arms[1].rates, "median": other, "ratio": other / med}
    if memory_knobs:
        limit = (cfg.info.get("memory") or {}).get("limit_bytes")
        lines = pair_lines(arms, limit)
        for line in lines:
            say(line)
        out["memory_knobs"] = {"arms": [a.to_dict() for a in arms if a.knob is not None],
                               "exported": arms[0].to_dict(), "lines": lines, "repeat": repeat,
                               "limit_bytes": limit}
        (path.parent / MEMORY_KNOB_PAIRS).write_text(json.dumps(out["memory_knobs"], indent=2, default=str) + "\n")
    return 0, out
