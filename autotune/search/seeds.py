"""The candidates proposed before the sampler proposes any: the FP32 baseline and known-good
configurations (seed_configurations), then, with --replay, an earlier search's configurations in its
order; and the seed feeder, which proposes the rest of the known-good ones as the search's own trials
catch up. Each returns candidates (autotune.search.queue.Candidate) and its caller puts them in the
queue: the study's setup (autotune.search.study), the queue's Feeder after each trial."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

import strategies
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from autotune.search import plain_recipe, queue
from autotune.search.queue import Candidate
from autotune.search.trials import FINISHED, planned_params
from autotune.trial.record import TrialRecord
from strategies.batch_size import LM_BASE_TOKENS, nearest


def _offered(space: SearchSpace, step: dict[str, Any]) -> bool:
    """Whether the space offers a seed's optimizer, compile and CUDA-graph values."""
    offers = {strategies.optimizer.IMPLEMENTATION_PARAM: space.optimizer_implementations,
              strategies.compile.MODE_PARAM: space.compile_modes, strategies.cuda_graphs.ENABLED_PARAM: space.cuda_graphs}
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
    # in the order it ran them: its planner did not run its queue in the order of the trial numbers
    for trial in sorted(earlier.get_trials(deepcopy=False, states=FINISHED),
                        key=lambda t: (t.datetime_start is None, t.datetime_start or 0, t.number)):
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


def replay_candidates(study: optuna.Study, folder: Path, space: SearchSpace,
                      seeds: list[tuple[str, dict[str, Any]]]) -> list[Candidate]:
    """The configurations of the search in ``folder`` in the order it ran them, then this search's
    seeds it did not measure, as candidates; the backlog is left empty. ``seeds`` are
    seed_configurations' (role, complete parameters); a replayed configuration that is one of them
    takes its role (the baseline stays the baseline), once: a repeat of it is replayed. The planner
    runs them in this order (--replay)."""
    replayed, left_out = replay_configurations(folder, space)
    unused = list(seeds)
    proposed = []
    for number, params in replayed:
        seed = next((s for s in unused if s[1] == params), None)
        if seed is not None:
            unused.remove(seed)
            proposed.append(Candidate.of(params, role=seed[0]))
        else:
            proposed.append(Candidate.of(params, role="replayed", replay_of=number))
    proposed += [Candidate.of(params, role=role) for role, params in unused]
    study.set_user_attr(BACKLOG_ATTR, [])
    if left_out:
        # stacklevel: shown at run_search's line (through study.prepare_study), where the replay was asked for
        warnings.warn(f"--replay {folder}: {left_out} of its configurations are not in this search's space "
                      "and are not replayed", stacklevel=4)
    return proposed


LM_SEED_TOKENS = (LM_BASE_TOKENS, 4 * LM_BASE_TOKENS)
"""Tokens per step of the language-model recipes: nanoGPT's micro-batch (the language-model
baseline's, 16k tokens) and four times that, where a hand-written hf:gpt2 loop ran fastest."""


def seed_configurations(space: SearchSpace, tokens_per_sample: int | None = None,
                        plain_batch: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The FP32 baseline first, the plain recipe (autotune.search.plain_recipe, at ``plain_batch``,
    else the base batch) second, then configurations the guides call good, as Optuna params. Each
    knob gives its own values in both (Strategy.seed); the list below names only the recipes: a
    precision, a batch and what a recipe changes of the step. A language model (``tokens_per_sample``)
    on a GPU gets nanoGPT's recipes, sized in tokens: the image guides' batches of 256 to 1,024
    sequences ran out of memory, and their optimizer was not the fused AdamW nanoGPT trains with."""
    from autotune.search.steering import complete_params

    # as a trial records them: a knob with one value offered (the memory format of a language
    # model) is not a parameter; left in, a seed never equals the measured trial it repeats
    baseline = complete_params(strategies.seed_params(space, tuned=False), space)
    seeds = [("baseline", baseline)]
    plain = plain_recipe.params(space, plain_batch or plain_recipe.batch(space))
    if plain is not None and plain != baseline:
        seeds.append((plain_recipe.ROLE, plain))
    if space.device == "cuda" and tokens_per_sample:
        fused = {strategies.optimizer.IMPLEMENTATION_PARAM: "fused"}
        compiled = {**fused, strategies.compile.MODE_PARAM: "default"}
        small, large = (max(1, tokens // tokens_per_sample) for tokens in LM_SEED_TOKENS)
        wanted = [
            # eager first, screened in seconds each: bf16 as nanoGPT at its batch and four times it,
            # fp16 beside it; then nanoGPT's whole recipe (bf16 + compile + fused AdamW), compiled
            # once its eager twin ranks among the fastest (the fastest eager one is compiled anyway);
            # fp8 (where offered: Linear layers on FP8 Tensor Cores) compiled, beside the large bf16
            ("bf16", small, fused), ("bf16", large, fused), ("fp16", large, fused),
            ("bf16", large, compiled), ("fp8", large, compiled), ("bf16", small, compiled),
        ]
    elif space.device == "cuda":
        fused = {strategies.optimizer.IMPLEMENTATION_PARAM: "fused"}
        compiled = {**fused, strategies.compile.MODE_PARAM: "default"}
        wanted = [
            # eager first, screened in seconds each (autotune.search.screening): the guides' recipe
            # (fp16 AMP + channels_last) at the batches the reference figures call top, bf16 at a
            # middle one, and fp16 with the whole step in a CUDA graph (MLPerf's recipe; legal with
            # fp16 thanks to the fused optimizer's device-side GradScaler step); the fastest eager
            # configuration is then compiled (CompileFinalist)
            ("fp16", 256, {}), ("fp16", 1024, {}), ("bf16", 512, {}), ("fp16", 512, {}),
            ("fp16", 256, {**fused, strategies.cuda_graphs.ENABLED_PARAM: True}),
            # the hand-tuned top: bf16 + channels_last +
            # torch.compile, compiled once its eager twin ranks among the fastest; and the compiled
            # step captured whole
            ("bf16", 512, compiled), ("bf16", 256, compiled),
            ("bf16", 256, {**compiled, strategies.cuda_graphs.ENABLED_PARAM: True}),
            # FP8 Tensor Cores (Ada, Hopper) where the probe found Linear layers to run on them
            # (a ViT's, not a ResNet's): compiled straight away, as torchao's float8 is meant to run
            ("fp8", 512, compiled),
        ]
    else:
        base = nearest(space.batch_sizes, space.base_batch_size)
        # bf16 at the base batch is the plain recipe on a CPU (where it has bf16: seeded above)
        wanted = [*([] if plain is not None else [("bf16", base, {})]), ("fp32", max(space.batch_sizes), {})]
    seen = [params for _, params in seeds]
    for mode, batch, step in wanted:
        if mode not in space.precisions or not _offered(space, step):
            continue
        fixed = {**step, strategies.precision.MODE_PARAM: mode,
                 strategies.batch_size.BATCH_SIZE_PARAM: nearest(space.batch_sizes, batch)}
        p = complete_params(strategies.seed_params(space, tuned=True, fixed=fixed), space)
        if p not in seen:
            seen.append(p)
            seeds.append(("known-good", p))
    return seeds


SEEDS_UPFRONT = 2
"""Seeds proposed at the start, after the FP32 baseline: the plain recipe and the guides' best.
The rest are proposed one at a time (SeedFeeder), so they never outnumber the search's own trials
by more than this."""
BACKLOG_ATTR = "seed_backlog"
"""The study's user attribute holding the known-good configurations not proposed yet."""


def seed_candidates(study: optuna.Study, seeds: list[tuple[str, dict[str, Any]]], *, all_now: bool = False
                    ) -> list[Candidate]:
    """The baseline and the first SEEDS_UPFRONT seeds after it (the plain recipe first), as candidates; the
    rest are kept in the study's backlog for SeedFeeder (``all_now``: every one now, as --replay's order
    needs)."""
    upfront = len(seeds) if all_now else 1 + SEEDS_UPFRONT  # the plain recipe, where there is one, among them
    study.set_user_attr(BACKLOG_ATTR, [params for _, params in seeds[upfront:]])
    return [Candidate.of(params, role=role) for role, params in seeds[:upfront]]


class SeedFeeder:
    """A proposer after each trial (autotune.search.queue.Feeder): the next known-good configuration
    from the backlog, as a candidate, once the search's own trials (sampled, steered, backed off) have
    caught up with the seeds, so seeds serve the search instead of replacing it. A seed of a precision
    mode no trial has run or queued yet goes first and does not wait: every offered mode gets measured
    early, rather than behind more trials of a mode already measured. A seed is dropped from the backlog
    when what was measured already answers it: the same configuration measured or queued, or its
    precision mode unstable or failing the accuracy check."""

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> Candidate | None:
        backlog = list(study.user_attrs.get(BACKLOG_ATTR) or [])
        if not backlog:
            return None
        trials, left = queue.trials(study), len(backlog)
        fed = self._new_precision(study, trials, backlog) or self._caught_up(study, trials, backlog)
        if len(backlog) < left:  # taken from the backlog: proposed, or answered already
            study.set_user_attr(BACKLOG_ATTR, backlog)
        return fed

    @staticmethod
    def _new_precision(study: optuna.Study, trials: list[optuna.trial.FrozenTrial], backlog: list[dict]
                       ) -> Candidate | None:
        """The first backlog seed whose precision mode no trial has (run, running or queued), taken from the
        backlog; None where there is none."""
        modes = {planned_params(t).get(strategies.precision.MODE_PARAM) for t in trials}
        for i, params in enumerate(backlog):
            if params.get(strategies.precision.MODE_PARAM) not in modes and not _answered(study, trials, params):
                return Candidate.of(backlog.pop(i), role="known-good")
        return None

    @staticmethod
    def _caught_up(study: optuna.Study, trials: list[optuna.trial.FrozenTrial], backlog: list[dict]
                   ) -> Candidate | None:
        """The next backlog seed once the search's own trials have caught up with the seeds, taken from the
        backlog with those already answered on the way; None when it is not their turn or none is left."""
        roles = [TrialRecord.of(t).role for t in trials]
        if any(t.state == TrialState.WAITING and role == "known-good" for t, role in zip(trials, roles)):
            return None
        seeded = sum(role in ("known-good", plain_recipe.ROLE) for role in roles)
        others = sum(role not in ("known-good", "baseline", plain_recipe.ROLE) for t, role in zip(trials, roles)
                     if t.state != TrialState.WAITING)
        if seeded - SEEDS_UPFRONT >= others:
            return None
        while backlog:
            params = backlog.pop(0)
            if not _answered(study, trials, params):
                return Candidate.of(params, role="known-good")
        return None


def _answered(study: optuna.Study, trials: list[optuna.trial.FrozenTrial], params: dict[str, Any]) -> bool:
    """Whether measuring ``params`` would tell nothing new (see SeedFeeder)."""
    from autotune.accuracy.study.gate import accuracy_of, failed

    for t in trials:
        if planned_params(t) == params:
            return True
    mode = params.get(strategies.precision.MODE_PARAM)
    for t in trials:
        if t.state != TrialState.COMPLETE or t.params.get(strategies.precision.MODE_PARAM) != mode:
            continue
        record = TrialRecord.of(t)
        if record.unstable or (failed(accuracy_of(study, t)) and _same_numerics(t.params, params)):
            return True
    return False


def _same_numerics(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The two configurations compute alike (their numerics knobs' parameters agree)."""
    from autotune.accuracy.settings import NUMERICS_KNOBS

    keys = {k for k in (*a, *b) if k.split(".")[0] in NUMERICS_KNOBS}
    return all(a.get(k) == b.get(k) for k in keys)
