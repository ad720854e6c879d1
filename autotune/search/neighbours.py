"""Neighbours of the bar: the plain recipe with one knob changed, compiled as it is, and under a
memory cap the plain recipe at a larger batch with the memory knobs that make it fit.

The plain recipe (autotune.search.plain_recipe) is the bar every recommendation must clear, and it
is compiled, so an eager candidate says little about beating it: an eager candidate is predicted well
below it, and a search that spends its time after the bar on eager candidates recommends the bar
itself. What can beat it is the plain recipe and one
change a user would try next: the vocabulary padded to a multiple of 64 (nanoGPT's), fp16 in place of
bf16, another compile mode, the whole step in a CUDA graph, a larger batch; and where memory caps the
batch (a 1B Llama under 24 GiB fits the plain recipe at batch 1 or 2), the knobs that buy memory:
8-bit optimizer states, a fused linear cross-entropy, recomputed activations, the allocator's
expandable segments, traded for a batch that fits and runs faster.

``Neighbours`` is a proposer after each trial (autotune.search.queue.Feeder): once the plain recipe is
measured, it proposes those candidates, each one that no trial has measured, runs or queued, as steered
trials of RULE, from the fastest plain recipe measured, at the batch its measured step predicts fits
where the eager memory probe sized it smaller (``start``), and again from a larger batch of it,
GrowToFit's, once that one is measured faster. The
planner (autotune.search.planner) orders them by expected gain per second, from each move's prior
(autotune.priors: what the knob gave elsewhere) until this search measures it. They
are compiled like the bar and skip eager screening: a compiled configuration one knob away from a
measured compiled one is ranked from it. A move (or a profile finding's remedy)
that beats the bar and every trial so far gets the other moves on top of it (``climb``): each move
starts from the bar, so without it a side stream that beat the bar would never be tried in fp16, nor
with the stem as space-to-depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

import strategies
from autotune.space import SearchSpace
from autotune.search import plain_recipe
from autotune.search.levers import LEVER_SETS, LEVERS, untuned
from autotune.priors import prior, table, values
from autotune.search.queue import Candidate, trials as queued_and_run
from autotune.search.steering import complete_params
from autotune.search.trials import planned_params
from autotune.trial.record import TrialRecord

RULE = "one knob from the plain recipe"


@dataclass(frozen=True)
class Move:
    """One change of the plain recipe, in words."""

    param: str
    value: Any
    why: str

    @property
    def gain(self) -> float:
        """Expected speed over the plain recipe, its prior (1.0: none known; the planner adds its novelty)."""
        return prior(self.param, self.value, "speed")


MOVES: tuple[Move, ...] = (
    Move(strategies.vocab_padding.MULTIPLE_PARAM, 64,
         "a vocabulary padded to a multiple of 64 (nanoGPT's 50,304 for GPT-2's 50,257)"),
    Move(strategies.compile.MODE_PARAM, "max-autotune-no-cudagraphs",
         "Inductor's autotuned GEMM and Triton configurations"),
    Move(strategies.precision.MODE_PARAM, "fp16", "fp16 autocast in place of bf16"),
    # the planner's prior for it is fp8_speed, from the model's sizes; its row's 1.0 where they are not known
    Move(strategies.precision.MODE_PARAM, "fp8", "the Linear layers in float8 (torchao)"),
    # the planner's prior for it is streams_factor, from the copies the bar's profile measured; 1.0 without one
    Move(strategies.streams.NUM_STREAMS_PARAM, 2, "the next batch copied on a side stream while the step computes"),
    Move(strategies.cuda_graphs.ENABLED_PARAM, True, "the whole step in one CUDA graph: no launch gaps"),
    # a model with fewer of its layers depthwise gains less than its prior, which its trial measures
    Move(strategies.depthwise_conv.INPUT_GRAD_PARAM, "flipped",
         "a depthwise convolution's input gradient computed by the forward kernel, with its filters turned"),
    # the planner scales its prior by the model's stem share (stem_speed)
    Move(strategies.stem_conv.STEM_PARAM, "space_to_depth",
         "the stem convolution as a stride-1 convolution on its input rearranged into stride x stride blocks"),
    Move(strategies.compile.MODE_PARAM, "reduce-overhead", "compiled with CUDA graphs (cudagraph trees)"),
    # not gradients zeroed in place (optimizer.set_to_none False): it measured no faster than the bar, and,
    # loaded from the bar's compile, it was cheap enough to run before moves the profile bounded higher.
    # Regional compile is expected slower than the whole-model compile: it starts sooner, which a search
    # saves and a training run does not
    Move(strategies.compile.MODE_PARAM, "regional", "each repeated block compiled once: a shorter first step"),
)
"""The one-knob moves, in the order the guides rank them (the queue's order breaks the planner's ties);
what each is expected to give is its "speed" row in autotune.priors."""


PRIORS: dict[tuple[str, Any], float] = table("speed")
"""Expected speed of each move and memory knob (and liger's kernels) over the plain recipe's value of that
knob, as the table holds them: the planner's factor for a knob it has no measured pair for
(autotune.search.planner)."""
COMPILED_PRIORS: dict[tuple[str, Any], float] = table("compiled speed")
"""PRIORS where the configurations on both sides compile: Inductor already pads a GEMM's odd dimension
(its shape_padding), so a padded vocabulary gives a compiled step less than an eager one."""


def fp8_speed(sizes: dict[str, Any], layers: str = "all") -> float | None:
    """Expected speed of fp8 over bf16 for a model of ``sizes`` (the probe's fp8_eligible_share and
    fp8_width; with ``layers`` "feed-forward", fp8_ff_share and fp8_ff_width: strategies.fp8_layers):
    Amdahl's law over the share of its parameters fp8 runs, at the layers' matmul gain for their width.
    That gain is fp8's "gemm speed" prior at its "full width" and up, on a line down to the "knee width"
    and below it on a line to the "narrow gemm speed" at the "narrow width" (autotune.priors):
    float8's casts and scales cost about the same per element whatever the width, while a matmul's work
    grows with it, so a narrow model runs fp8 slower than bf16 (break-even near width 1,000). None where
    the probe did not size them. For the 1B Llama shape (every parameter in layers of mean width 2,006:
    its tied head is a Linear) about 1.35, its feed-forward layers alone (65% at 2,048) about 1.20;
    ViT-B/16 (74% at 768) 0.86: slower than bf16."""
    keys = ("fp8_eligible_share", "fp8_width") if layers == "all" else ("fp8_ff_share", "fp8_ff_width")
    share, width = (float(sizes.get(key) or 0) for key in keys)
    if not share or not width:
        return None
    precision = strategies.precision.MODE_PARAM
    full_gain, full_width = prior(precision, "fp8", "gemm speed"), prior(precision, "fp8", "full width")
    narrow_gain, narrow_width = prior(precision, "fp8", "narrow gemm speed"), prior(precision, "fp8", "narrow width")
    knee = prior(precision, "fp8", "knee width")
    # the upper line, at the width (from the knee up) or at the knee (below it, where the gain falls)
    gemm = 1.0 + (full_gain - 1.0) * min(1.0, max(width, knee) / full_width)
    if width < knee:
        along = (width - narrow_width) / (knee - narrow_width)
        gemm = max(0.5, narrow_gain + (gemm - narrow_gain) * along)
    return 1.0 / ((1.0 - share) + share / gemm)


def stem_speed(sizes: dict[str, Any]) -> float | None:
    """Expected speed of the stem_conv move for a model of ``sizes`` (the probe's stem_share): the move's
    prior scaled by the stem's share of the model's multiply-adds against that of the model the prior was
    measured on (its "measured stem share"), never above the prior (a larger share is not measured). A
    16x16 patchify stem is about 1.0% of ViT-B/16's work (1.013x), ConvNeXt-T's 4x4 0.32% (1.004x). None
    where the probe did not measure it."""
    share = sizes.get("stem_share")
    if share is None:
        return None
    gain = PRIORS[(strategies.stem_conv.STEM_PARAM, "space_to_depth")]
    measured = prior(strategies.stem_conv.STEM_PARAM, "space_to_depth", "measured stem share")
    return 1.0 + (gain - 1.0) * min(1.0, float(share) / measured)


def streams_factor(profile: dict[str, Any] | None, was: int, now: int,
                   overlap: float | None = None) -> float | None:
    """Expected speed of ``now`` CUDA streams over ``was`` for a trial measured with ``was`` and this
    ``profile`` (autotune.trial.profile): one stream to two hides ``overlap`` (default: the "copy
    overlap" prior) of the copies exposed in the step (memcpy_share; 1.0: the most it can give); two to
    one adds back the copy time that overlapped. None where the profile did not see the copies. A plain
    recipe that spends 7.8% of its step copying its images in series with compute gets about 1.07x."""
    if overlap is None:
        overlap = prior(strategies.streams.NUM_STREAMS_PARAM, 2, "copy overlap")
    if was == now:
        return 1.0
    if not profile or not profile.get("steps"):
        return None
    if was == 1:
        exposed = float(profile.get("memcpy_share") or 0.0)
        return 1.0 / (1.0 - min(exposed, 0.9) * overlap)
    step, copy, hidden = (profile.get(k) for k in ("gpu_time_per_step_ms", "h2d_ms_per_step", "copy_overlap"))
    if not step or copy is None or hidden is None:
        return None
    return float(step) / (float(step) + float(hidden) * float(copy))


def graphs_factor(profile: dict[str, Any] | None, prior: float | None) -> float | None:
    """A CUDA graph's expected speed (the whole step's, or cudagraph trees'), ``prior`` at most, for a
    trial measured without one and this ``profile``: it removes the gaps between launches, so it can
    give no more than the share of the step the GPU sat idle (idle_share): a step never idle has
    nothing to win."""
    if prior is None or not profile or not profile.get("steps") or profile.get("idle_share") is None:
        return prior
    return min(prior, 1.0 / (1.0 - min(float(profile["idle_share"]), 0.9)))


def profiled_factor(key: str, measured: dict[str, Any], params: dict[str, Any], profile: dict[str, Any] | None,
                    f: float | None) -> tuple[float | None, float | None]:
    """The factor ``f`` of the knob ``key`` from ``measured`` (a trial with this ``profile``) to
    ``params``, where the profile bounds it, and the most the profile allows over it (None where it does
    not bound it): a side stream from the copies the trial saw in series with compute, up to every copy
    hidden; a CUDA graph at most the time the GPU sat idle (compiling's own gain aside)."""
    if key == strategies.streams.NUM_STREAMS_PARAM:
        was, now = int(measured.get(key, 1)), int(params.get(key, 1))
        seen = streams_factor(profile, was, now)
        return (f, None) if seen is None else (seen, streams_factor(profile, was, now, overlap=1.0) / seen)
    # from a trial that recorded the knob (for compile.mode: a compiled one, compiling's own gain aside)
    if _graphed(params, key) and not _graphed(measured, key) and measured.get(key, "off") != "off":
        bound = graphs_factor(profile, f)
        return (f, None) if bound == f else (bound, 1.0)
    return f, None


def _graphed(params: dict[str, Any], key: str) -> bool:
    """Whether ``params`` run their step in a CUDA graph by ``key`` (the whole step, or cudagraph trees)."""
    if key == strategies.cuda_graphs.ENABLED_PARAM:
        return bool(params.get(key))
    return key == strategies.compile.MODE_PARAM and params.get(key) == "reduce-overhead"


def offered(space: SearchSpace, params: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any] | None:
    """``params`` with ``changes``, completed through the strategies; None where the space does not
    offer one of them with the rest (a CUDA graph with a fused loss, say: the knob drops it)."""
    changed = complete_params({**params, **changes}, space)
    return changed if all(changed.get(k) == v for k, v in changes.items()) else None


class Neighbours:
    """A proposer after each trial: the plain recipe's neighbours once it is measured, and the climbs
    from a trial that beat it."""

    def __init__(self, space: SearchSpace, limit_bytes: float | None) -> None:
        self.space = space
        self.limit_bytes = limit_bytes

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> list[Candidate]:
        if trial.state != TrialState.COMPLETE or trial.value is None:
            return []
        if TrialRecord.of(trial).role != plain_recipe.ROLE:
            return self.climb(study, trial)
        trials = queued_and_run(study)
        # from the fastest plain recipe measured, even while a larger batch of it is queued (GrowToFit):
        # the planner weighs them against it. Held back until that one ran, the moves may never run: the
        # grown batch is hoped little for a cold compile, and the budget may end first
        bar = max((t for t in trials if TrialRecord.of(t).role == plain_recipe.ROLE
                   and t.state == TrialState.COMPLETE and t.value is not None), key=lambda t: t.value)
        return self._steered(trials, bar, self.candidates(study, bar))

    def _steered(self, trials: list[optuna.trial.FrozenTrial], start: optuna.trial.FrozenTrial,
                 proposals: list[tuple[dict[str, Any], str]]) -> list[Candidate]:
        """Each of ``proposals`` (complete parameters, why) that none of ``trials`` (measured, running or
        queued) has, once, as a candidate steered from ``start`` by RULE."""
        known = [complete_params(planned_params(t), self.space) for t in trials]
        steered = []
        for params, why in proposals:
            if params in known:
                continue
            known.append(params)
            steered.append(Candidate.of(params, role="steered",
                                        steered_by={"trial": start.number, "rule": RULE, "why": why}))
        return steered

    def climb(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> list[Candidate]:
        """A move that beat the plain recipe and every trial measured so far gets the other moves on
        top of it, once each: a side stream and fp16 each measured alone would not add up otherwise
        (the moves all start from the bar). So does a finding's remedy that did (a side stream from the
        bar's profile, rule "copies", say). The planner weighs them from this trial."""
        if TrialRecord.of(trial).role != "steered":
            return []
        trials = queued_and_run(study)
        done = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None and t.number != trial.number]
        measured = [t.value for t in done]
        bar_measured = any(TrialRecord.of(t).role == plain_recipe.ROLE for t in done)
        if (not bar_measured or trial.value <= max(measured)
                or study.direction != optuna.study.StudyDirection.MAXIMIZE):
            return []
        return self._steered(trials, trial, [(params, f"{why}, on #{trial.number}, which beat the plain recipe")
                                             for params, why in self._moves(trial.params, self._climbs)])

    def _climbs(self, move: Move) -> bool:
        """Whether ``move`` goes on a move that won: not one expected slower (regional compile); under a
        memory cap, not a CUDA graph, whose pool holds memory the winner, sized near the cap, does not have."""
        if move.gain < 1.0:
            return False
        graphs = (move.param == strategies.cuda_graphs.ENABLED_PARAM
                  or (move.param, move.value) == (strategies.compile.MODE_PARAM, "reduce-overhead"))
        return not (graphs and self.limit_bytes)

    def candidates(self, study: optuna.Study, bar: optuna.trial.FrozenTrial) -> list[tuple[dict[str, Any], str]]:
        """The moves and the memory levers offered here, as complete parameters with their words."""
        start = self.start(study, bar)
        out = self._moves(start)
        size = strategies.batch_size.BATCH_SIZE_PARAM
        batch = int(bar.params.get(size, 0))
        if start is not bar.params:
            grown = start[size]
            out = [(p, f"{why}, at batch {grown}: the bar's measured step predicts it fits") for p, why in out]
        larger = [b for b in self.space.batch_sizes if b > batch]
        if larger:  # the planner sizes it down first where the memory model says it does not fit
            out.append((offered(self.space, bar.params, {size: min(larger)}) or bar.params,
                        "a larger batch than the plain recipe's"))
        out += self.levers(study, bar)
        return [(p, why) for p, why in out if p != bar.params]

    def start(self, study: optuna.Study, bar: optuna.trial.FrozenTrial) -> dict[str, Any]:
        """What the moves change: the bar's parameters, at GrowToFit's batch where the bar's measured peak
        scaled to it stays within SIBLING_FILL of the limit (where the memory model holds a move to that
        peak, so it runs at that batch rather than being sized down). Held at the bar's batch, a move
        measures less than a user's plain recipe at the batch that fits already has, where the eager probe
        sized the bar smaller than that batch."""
        from autotune.search.memory import SIBLING_FILL

        batch = int(bar.params.get(strategies.batch_size.BATCH_SIZE_PARAM, 0))
        grown = plain_recipe.grown_batch(study, bar, self.space, self.limit_bytes)
        peak = TrialRecord.of(bar).peak_memory_bytes
        if grown is None or not peak or peak * grown / batch > self.limit_bytes * SIBLING_FILL:
            return bar.params
        return offered(self.space, bar.params, {strategies.batch_size.BATCH_SIZE_PARAM: grown}) or bar.params

    def _moves(self, start: dict[str, Any], keep=lambda move: True) -> list[tuple[dict[str, Any], str]]:
        """``start`` with each of MOVES that ``keep`` and the space offer and that changes it, with its words."""
        out = []
        for move in MOVES:
            if start.get(move.param) == move.value or not keep(move):
                continue
            params = offered(self.space, start, {move.param: move.value})
            if params is not None and params != start:
                out.append((params, move.why))
        return out

    def levers(self, study: optuna.Study, bar: optuna.trial.FrozenTrial) -> list[tuple[dict[str, Any], str]]:
        """Under a memory cap that holds the plain recipe below MAX_BATCH_FACTOR x the base batch: for
        each LEVER_SETS combination offered, the plain recipe with it at the largest batch the memory
        model predicts to fit (MemoryModel.lever_predict: the plain recipe's measured peaks less what
        the knobs save; for expandable segments, less the gap it reserved above its allocated peak),
        where that is larger than the bar's; at most one per batch, the cheapest in speed first."""
        from autotune.search.memory import BACKOFF_FILL, MemoryModel

        if not self.limit_bytes:
            return []
        batch = int(bar.params.get(strategies.batch_size.BATCH_SIZE_PARAM, 0))
        ceiling = plain_recipe.MAX_BATCH_FACTOR * self.space.base_batch_size
        larger = [b for b in self.space.batch_sizes if batch < b <= ceiling]
        if not larger:
            return []
        model = MemoryModel.from_study(study, self.limit_bytes)
        out = []
        for start in self._lever_starts(bar):
            batches: set[int] = set()
            for combo in LEVER_SETS:
                levers = tuple(LEVERS[i] for i in combo)
                params = offered(self.space, start, {lever.param: lever.value for lever in levers})
                if params is None:
                    continue
                knobs = strategies.knobs_of(params, self.space)
                # the memory model's prediction, which also sizes the trial before it runs
                fits = [b for b in larger if (need := model.predict(knobs, b)) is not None
                        and need <= self.limit_bytes * BACKOFF_FILL]
                if not fits or max(fits) in batches:
                    continue
                target = max(fits)
                batches.add(target)
                words = " + ".join(f"{lever.param.split('.')[0]} {lever.value}" for lever in levers)
                if start is not bar.params:
                    layers = start.get(strategies.fp8_layers.LAYERS_PARAM, "all")
                    words = ("fp8 + " if layers == "all" else f"fp8 ({layers} layers) + ") + words
                out.append((offered(self.space, params, {strategies.batch_size.BATCH_SIZE_PARAM: target}) or params,
                            f"{words}: batch {target} predicted to fit where the plain recipe's {batch} is the largest"))
        return out

    def _lever_starts(self, bar: optuna.trial.FrozenTrial) -> list[dict[str, Any]]:
        """What the memory knobs are added to: the plain recipe, and its fp8 twin where the space offers
        fp8 beside a bf16 bar (fp8 keeps bf16 autocast and FP32 master weights, so it needs what the bar
        needs: the memory model predicts it from the bar's peaks; the planner ranks it by fp8_speed)."""
        starts = [bar.params]
        if bar.params.get(strategies.precision.MODE_PARAM) == "bf16" and "fp8" in self.space.precisions:
            twin = offered(self.space, bar.params, {strategies.precision.MODE_PARAM: "fp8"})
            if twin is not None:
                starts.append(twin)
            # and fp8 on the feed-forward layers alone, where offered (strategies.fp8_layers): the attention
            # projections and the head in bf16, for numerics closer to FP32's
            twin = offered(self.space, bar.params,
                           {strategies.precision.MODE_PARAM: "fp8", strategies.fp8_layers.LAYERS_PARAM: "feed-forward"})
            if twin is not None:
                starts.append(twin)
        return starts


def compile_mode_factor(was: str, now: str) -> float | None:
    """One compile mode against another, from the moves' priors (each against the plain recipe's
    default mode); None where either has none: two compiled configurations differ by their modes'
    priors too, not only an eager one from a compiled one."""
    a = 1.0 if was == "default" else PRIORS.get((strategies.compile.MODE_PARAM, was))
    b = 1.0 if now == "default" else PRIORS.get((strategies.compile.MODE_PARAM, now))
    return None if a is None or b is None else b / a


def prior_factor(key: str, before: dict[str, Any], after: dict[str, Any], stem: float | None = None) -> float | None:
    """The planner's factor for one knob from PRIORS (COMPILED_PRIORS where both sides compile; ``stem``:
    this model's stem_speed, where the probe measured it): ``after``'s value against ``before``'s, where
    one of them is a move's or lever's value and the other the knob's untuned one; None otherwise."""
    was, now = before.get(key), after.get(key)
    default = untuned(key)
    priors = {**PRIORS, **COMPILED_PRIORS} if _compiles(before) and _compiles(after) else PRIORS
    if stem is not None:
        priors = {**priors, (strategies.stem_conv.STEM_PARAM, "space_to_depth"): stem}
    if (key, now) in priors and was in (None, default):
        return priors[(key, now)]
    if (key, was) in priors and now in (None, default):
        return 1.0 / priors[(key, was)]
    return None


def _compiles(params: dict[str, Any]) -> bool:
    return params.get(strategies.compile.MODE_PARAM, "off") != "off"


SIXTEEN = {"fp16", "bf16", "fp8"}
"""The 16-bit precision modes, one group of the priors' precision speeds."""


def precision_factor(before: str, after: str, fp8: float | None = None) -> float | None:
    """One precision mode's speed over another's, from the priors; ``fp8``: fp8's over the other 16-bit
    modes for this model (neighbours.fp8_speed), None where its sizes are not known."""
    group = {m: ("16" if m in SIXTEEN else m) for m in (before, after)}
    a, b = group[before], group[after]
    if a == b:
        if fp8 is not None and (before == "fp8") != (after == "fp8"):
            return fp8 if after == "fp8" else 1.0 / fp8
        return None  # fp16 against bf16, say: measured, not assumed
    speeds = values(strategies.precision.MODE_PARAM, "speed over")  # (before, after) -> after's speed over before's
    if (a, b) in speeds:
        return speeds[(a, b)]
    if (b, a) in speeds:
        return 1.0 / speeds[(b, a)]
    return None
