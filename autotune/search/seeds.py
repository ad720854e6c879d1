"""The trials queued before the sampler proposes any: the FP32 baseline and known-good configurations
(seed_configurations), then, with --replay, an earlier search's configurations in its order."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import optuna

import strategies
from autotune.deploy.space import SearchSpace
from autotune.errors import ConfigError
from autotune.search.trials import FINISHED
from autotune.trial.record import queue_attrs
from strategies.batch_size import nearest


def _offered(space: SearchSpace, step: dict[str, Any]) -> bool:
    """Whether the space offers a seed's optimizer, compile and CUDA-graph values."""
    offers = {"optimizer.implementation": space.optimizer_implementations, "compile.mode": space.compile_modes,
              "cuda_graphs.enabled": space.cuda_graphs}
    return all(value in offers[key] for key, value in step.items() if key in offers)


def replay_configurations(folder: Path, space: SearchSpace) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """The configurations the search in ``folder`` measured, in its trial order, as this space's
    complete parameters: (trial number, params) pairs, and how many were left out because this
    space does not offer one of their values (a batch size another GPU's memory allowed, say).
    Repeats stay in: the search measured them once and copied the rest, and so will this one."""
    from autotune.search.steering import complete_params

    url = f"sqlite:///{folder / 'study.db'}"
    names = optuna.get_all_study_names(storage=url)
    if len(names) != 1:
        raise ConfigError(f"--replay {folder}: its study.db holds {len(names)} studies ({', '.join(names) or 'none'}); "
                          "give the folder of a search that ran one")
    earlier = optuna.load_study(study_name=names[0], storage=url)
    kept, left_out = [], 0
    for trial in sorted(earlier.get_trials(deepcopy=False, states=FINISHED), key=lambda t: t.number):
        if not trial.params:
            continue
        params = complete_params(trial.params, space)
        if any(params.get(name) != value for name, value in trial.params.items()):
            left_out += 1
        else:
            kept.append((trial.number, params))
    if not kept:
        raise ConfigError(f"--replay {folder}: none of its {left_out} configurations is in this search's space; "
                          "run this search with the options of that one (batch sizes, precisions, --ddp)")
    return kept, left_out


def enqueue_replay(study: optuna.Study, folder: Path, space: SearchSpace, seeds: list[dict[str, Any]]) -> None:
    """Queue the configurations of the search in ``folder`` behind this one's seeds (which that
    search measured first too: they are not queued twice)."""
    from autotune.search.steering import complete_params

    replayed, left_out = replay_configurations(folder, space)
    seeded = [complete_params(params, space) for params in seeds]
    for number, params in replayed:
        if params in seeded:
            seeded.remove(params)  # its first one is this search's seed; a repeat of it is replayed
            continue
        study.enqueue_trial(params, user_attrs=queue_attrs(role="replayed", replay_of=number))
    if left_out:
        # stacklevel: shown at run_search's line (through study.prepare_study), where the replay was asked for
        warnings.warn(f"--replay {folder}: {left_out} of its configurations are not in this search's space "
                      "and are not replayed", stacklevel=4)


def seed_configurations(space: SearchSpace) -> list[tuple[str, dict[str, Any]]]:
    """The FP32 baseline first, then configurations the guides call good, as Optuna params. Each
    knob gives its own values in both (Strategy.seed); the list below names only the recipes: a
    precision, a batch and what a recipe changes of the step."""
    baseline = strategies.seed_params(space, tuned=False)
    seeds = [("baseline", baseline)]
    if space.device == "cuda":
        fused = {"optimizer.implementation": "fused"}
        wanted = [
            # what the reference figures call top, first, so a 10-minute search measures them:
            # bf16 + channels_last + torch.compile (the hand-tuned ~7,200 img/s ResNet-50 step on
            # an H200) at two batches, and fp16 with the whole step in a CUDA graph (MLPerf's
            # recipe; legal with fp16 thanks to the fused optimizer's device-side GradScaler step)
            ("bf16", 256, {**fused, "compile.mode": "default"}),
            ("bf16", 512, {**fused, "compile.mode": "default"}),
            ("fp16", 256, {**fused, "cuda_graphs.enabled": True}),
            # the guides' recipe (fp16 AMP + channels_last) at growing batches, and bf16 at a middle one
            ("fp16", 256, {}), ("fp16", 512, {}), ("fp16", 1024, {}), ("bf16", 512, {}),
            # both: the compiled step captured whole
            ("bf16", 256, {**fused, "compile.mode": "default", "cuda_graphs.enabled": True}),
        ]
    else:
        base = nearest(space.batch_sizes, space.base_batch_size)
        wanted = [("bf16", base, {}), ("fp32", max(space.batch_sizes), {})]
    seen = [baseline]
    for mode, batch, step in wanted:
        if mode not in space.precisions or not _offered(space, step):
            continue
        fixed = {**step, "precision.mode": mode, "batch_size.batch_size": nearest(space.batch_sizes, batch)}
        p = strategies.seed_params(space, tuned=True, fixed=fixed)
        if p not in seen:
            seen.append(p)
            seeds.append(("known-good", p))
    return seeds
