"""Steering: the findings of a measured trial propose the configurations they suggest.

A finding such as "38% of GPU time is in layout conversions: channels_last removes them" comes
with the parameters of its remedy (``autotune.search.findings``). The remedy applied to the trial's own
parameters is a concrete configuration; it is completed through the strategies (a switch to fp16
brings the GradScaler's parameters, at their defaults) and returned as a candidate, which the objective
puts in the queue (``autotune.search.queue.put``), so the next trials test what the profile says instead
of what TPE guesses. A configuration already measured or queued is not proposed again (every one compared
in its completed form, so a seed queued with fewer parameters still counts), and a remedy that changes a
knob ``autotune.search.knob_effects`` found to have no effect is not proposed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import optuna

import strategies
from autotune.space import SearchSpace
from autotune.search.findings import Finding
from autotune.search.queue import Candidate
from autotune.search.trials import planned_params

MAX_STEERED_PER_TRIAL = 2
"""Remedies proposed from one trial, the first findings first (they are ordered by the rules)."""


CHOICE_PARAMS = (strategies.vocab_padding.MULTIPLE_PARAM, strategies.depthwise_conv.INPUT_GRAD_PARAM,
                 strategies.stem_conv.STEM_PARAM)
"""The parameters findings and moves may set whose knobs keep their choices in ``SearchSpace.choices``."""


def offered(space: SearchSpace) -> dict[str, list[Any]]:
    """Parameter -> the values the space offers, for the knobs findings may suggest."""
    return {
        strategies.precision.MODE_PARAM: list(space.precisions),
        strategies.batch_size.BATCH_SIZE_PARAM: list(space.batch_sizes),
        strategies.memory_format.FORMAT_PARAM: list(space.memory_formats),
        strategies.streams.NUM_STREAMS_PARAM: list(space.stream_counts),
        strategies.channel_alignment.MULTIPLE_PARAM: list(space.alignments),
        strategies.cuda_graphs.ENABLED_PARAM: list(space.cuda_graphs),
        strategies.compile.MODE_PARAM: list(space.compile_modes),
        strategies.dataloader.NUM_WORKERS_PARAM: list(space.dataloader_workers),
        **({strategies.ddp.BUCKET_CAP_MB_PARAM: list(space.ddp_bucket_caps_mb),
            strategies.ddp.GRADIENT_AS_BUCKET_VIEW_PARAM: list(space.ddp_gradient_as_bucket_view),
            strategies.ddp.STATIC_GRAPH_PARAM: list(space.ddp_static_graph)} if space.ddp_world_size > 1 else {}),
        # knobs of their own modules (strategies/vocab_padding.py, depthwise_conv.py, stem_conv.py) keep their choices
        # in space.choices, under the knob's name
        **{param: list(space.choices[param.partition(".")[0]]) for param in CHOICE_PARAMS
           if param.partition(".")[0] in space.choices},
    }


class _Completing:
    """A stand-in for an Optuna trial that answers with the given parameters, and for a parameter
    the given ones lack (or give a value the space does not offer) with the knob's untuned default."""

    def __init__(self, given: Mapping[str, Any]) -> None:
        self.given = dict(given)
        self.params: dict[str, Any] = {}

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        value = self.given.get(name)
        if value not in choices:
            value = _default(name, choices)
        self.params[name] = value
        return value


def _default(name: str, choices: list[Any]) -> Any:
    strategy, _, field = name.partition(".")
    config = strategies.BY_NAME[strategy].Config() if strategy in strategies.BY_NAME else None
    value = getattr(config, field, None) if config is not None and field in {f.name for f in dataclasses.fields(config)} else None
    return value if value in choices else choices[0]


def complete_params(params: Mapping[str, Any], space: SearchSpace) -> dict[str, Any]:
    """The full parameter set of a configuration: ``params`` replayed through every strategy,
    with the conditional parameters a change brings in set to their defaults and the ones it
    removes dropped."""
    trial = _Completing(params)
    strategies.sample(trial, space)
    return trial.params


def steer(study: optuna.Study, trial: optuna.trial.FrozenTrial | optuna.Trial, findings: list[Finding],
          space: SearchSpace, *, limit: int = MAX_STEERED_PER_TRIAL) -> list[Candidate]:
    """The remedies of ``findings`` on top of ``trial``'s parameters, as candidates (role "steered"), none
    that the study has measured, runs or queued."""
    from autotune.search.knob_effects import fixed_knobs

    from autotune.search.queue import trials

    known = [complete_params(planned_params(t), space) for t in trials(study)]
    fixed = {param: entry["value"] for param, entry in fixed_knobs(study).items()}
    proposed: list[Candidate] = []
    for finding in findings:
        if len(proposed) >= limit:
            break
        if not finding.suggest:
            continue
        if any(param in fixed and value != fixed[param] for param, value in finding.suggest.items()):
            continue  # measured to make no difference
        params = complete_params({**trial.params, **finding.suggest}, space)
        if params == trial.params or params in known or any(params == c.params for c in proposed):
            continue
        proposed.append(Candidate.of(params, role="steered", steered_by={"trial": trial.number, "rule": finding.rule}))
    return proposed
