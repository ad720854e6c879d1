"""Neighbours of the bar: the plain recipe with one knob changed, compiled as it is, and under a
memory cap the plain recipe at a larger batch with the memory knobs that make it fit.

The plain recipe (autotune.search.plain_recipe) is the bar every recommendation must clear, and it
is compiled, so an eager candidate says little about beating it: on the H200 a 3-minute hf:gpt2
search spent its time after the plain recipe on six eager candidates, each predicted at 0.77x of it,
and the recommendation was the plain recipe itself. What can beat it is the plain recipe and one
change a user would try next: the vocabulary padded to a multiple of 64 (nanoGPT's), fp16 in place of
bf16, another compile mode, the whole step in a CUDA graph, a larger batch; and where memory caps the
batch (a 1B Llama under 24 GiB fits the plain recipe at batch 1 or 2), the knobs that buy memory:
8-bit optimizer states, a fused linear cross-entropy, recomputed activations, the allocator's
expandable segments, traded for a batch that fits and runs faster.

``Neighbours`` is a proposer (Optuna's callback after each trial): once the plain recipe is measured,
it queues those candidates once each, as steered trials of RULE, from the fastest plain recipe
measured, at the batch its measured step predicts fits where the eager memory probe sized it smaller
(``start``: on the H100, 07cebda, hf:gpt2's CUDA graph at 64 sequences where its bar ran 48, 1.011x
the hand-written loop at 64), and again from a larger batch of it, GrowToFit's, once that one is
measured faster. The planner (autotune.search.planner) orders them by expected gain per second, from
each move's prior (MOVES, LEVERS: what the knob gave elsewhere) until this search measures it. They
are compiled like the bar and skip eager screening: a compiled configuration one knob away from a
measured compiled one is ranked from it. A move (or a profile finding's remedy)
that beats the bar and every trial so far gets the other moves on top of it (``climb``): each move
starts from the bar, so without it a side stream that beat ResNet-50's bar would never be tried in
fp16, nor with its stem as space-to-depth (1.044x on top of it on the H100, h100-b11ebb1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

import strategies
from autotune.deploy.space import SearchSpace
from autotune.search import plain_recipe
from autotune.search.levers import LEVER_SETS, LEVERS, untuned
from autotune.search.steering import complete_params
from autotune.search.trials import planned_params
from autotune.trial.record import TrialRecord, queue_attrs

RULE = "one knob from the plain recipe"


@dataclass(frozen=True)
class Move:
    """One change of the plain recipe and what it is expected to give before it is measured."""

    param: str
    value: Any
    gain: float
    """Expected speed over the plain recipe (1.0: none known; the planner adds its novelty)."""
    why: str


MOVES: tuple[Move, ...] = (
    Move("vocab_padding.multiple", 64, 1.04,
         "a vocabulary padded to a multiple of 64 (nanoGPT's 50,304 for GPT-2's 50,257)"),
    Move("compile.mode", "max-autotune-no-cudagraphs", 1.02, "Inductor's autotuned GEMM and Triton configurations"),
    Move("precision.mode", "fp16", 1.01, "fp16 beat bf16 for ResNet-50 on the H200 (7,346 img/s at batch 1,024)"),
    # the planner's prior for it is fp8_speed, from the model's sizes; 1.0 where they are not known
    Move("precision.mode", "fp8", 1.0, "the Linear layers in float8 (torchao): 1.51x bf16 for a 2-layer Llama "
                                       "of hidden size 4,096 on the H200"),
    # the planner's prior for it is streams_factor, from the copies the bar's profile measured; 1.0 without one
    Move("streams.num_streams", 2, 1.0, "the next batch copied on a side stream while the step computes"),
    Move("cuda_graphs.enabled", True, 1.02, "the whole step in one CUDA graph: no launch gaps"),
    # torchvision's ConvNeXt-T's compiled plain-recipe step on the H100: 1.072x at batch 256, 1.077x at 768
    # (reports/depthwise-h100); a model with fewer of its layers depthwise gains less, which its trial measures
    Move("depthwise_conv.input_grad", "flipped", 1.07,
         "a depthwise convolution's input gradient computed by the forward kernel, with its filters turned"),
    # torchvision's ResNet-50's compiled plain-recipe step on the H100 at batch 1,024, its stem padded to 8 channels
    # (the search's best there): 1.037x (1.033x with another max-pool backward that alone gave 0.996x,
    # reports/stem-h100); a model whose stem is a smaller share of its step gains less, which its trial measures
    Move("stem_conv.stem", "space_to_depth", 1.037,
         "the stem convolution as a stride-1 convolution on its input rearranged into stride x stride blocks"),
    Move("compile.mode", "reduce-overhead", 1.02, "compiled with CUDA graphs (cudagraph trees)"),
    # not gradients zeroed in place (optimizer.set_to_none False): measured at 0.998x the bar on the H200
    # (hf:gpt2, 3445a3e) and 0.997x on the H100 (5ece370), it was still hoped NOVELTY more and, loaded
    # from the bar's compile, ran first where a side stream the profile bounded at 1.047x waited
    # measured on the H200 against the whole-model compile (3445a3e): 0.96x on ViT-B/16, 0.61x on GPT-2;
    # it starts sooner (17 s and 10 s against 39 s and 25 s), which a search saves and a training run does not
    Move("compile.mode", "regional", 0.77, "each repeated block compiled once: a shorter first step"),
)
"""The one-knob moves, in the order the guides rank them (the queue's order breaks the planner's ties)."""


PRIORS: dict[tuple[str, Any], float] = {(m.param, m.value): m.gain for m in MOVES}
PRIORS.update({(lever.param, lever.value): lever.speed for lever in LEVERS})
"""Expected speed of each move and lever over the plain recipe's value of that knob: the planner's
factor for a knob it has no measured pair for (autotune.search.planner)."""
# liger-kernel's README claims up to 20% more throughput for its kernels together (its fused loss among
# them) on HF LLMs; a modest share of that for the layer kernels alone, a claim, not measured here
PRIORS[("llm_kernels.kernels", "liger")] = 1.05
COMPILED_PRIORS: dict[tuple[str, Any], float] = {("vocab_padding.multiple", 64): 0.99}
"""PRIORS where the configurations on both sides compile. A vocabulary padded to 64 against hf:gpt2's
compiled plain recipe measured 0.986x on the H100 at 5ece370 (with channels padded to 8), 0.988x twice at
2b09a74 (the same, and alone on the CUDA-graph best) and 1.012x on the H200 (reports/gpt2-h200's verify):
Inductor already pads a GEMM's odd dimension (its shape_padding). Its move's 1.04, eager's (1.27x on the
H200, with the Linear widths padded to 8), had queued it first after the bar in both H100 searches."""


FP8_GEMM_GAIN = 1.73
"""fp8's speed over bf16 for a model all of whose parameters are in eligible Linear layers of width
FP8_FULL_WIDTH and more, compiled: on the H200 (reports/llama-fp8-h200) a 2-layer Llama of hidden size
4,096 (80% of its parameters in such layers, the rest its embedding) ran 1.51x bf16 at batch 64, which
is 1.73x on those layers' share by Amdahl's law."""
FP8_FULL_WIDTH = 4096
"""The width from which fp8's matmuls are taken to give FP8_GEMM_GAIN."""
FP8_NARROW_GAIN, FP8_NARROW_WIDTH = 0.744, 585
"""fp8's speed over bf16 on the eligible layers of a narrow model, compiled: on the H100 (h100-b9cc902)
timm's ConvNeXt-T (90.5% of its parameters in eligible Linear layers of mean width 585) ran 2,847 img/s
in fp8 against 3,736 in bf16 at batch 192, 0.76x, which is 0.744x on those layers' share: float8's
casts and scales cost about the same per element whatever the width, while a matmul's work grows with
it. Taken from a share of FP8_GEMM_GAIN alone (1.09x there), fp8 was queued first and its compile took
94 s of a 5-minute budget."""
FP8_KNEE_WIDTH = 2048
"""From this width up, fp8's gain is on the line to FP8_GEMM_GAIN at FP8_FULL_WIDTH (1.37x here); below
it, on the line down to FP8_NARROW_GAIN (break-even near 1,000). The 1B Llama (width 2,006) ran fp8 at
63.4 sequences/s with the memory knobs on the H100 (de94c74), about 1.38x its bf16 twin as estimated
from the H200's 50.9 (3445a3e) and the hand loops' H100/H200 ratio (0.89): the upper line's value."""


def fp8_speed(sizes: dict[str, Any], layers: str = "all") -> float | None:
    """Expected speed of fp8 over bf16 for a model of ``sizes`` (the probe's fp8_eligible_share and
    fp8_width; with ``layers`` "feed-forward", fp8_ff_share and fp8_ff_width: strategies.fp8_layers):
    Amdahl's law over the share of its parameters fp8 runs, at FP8_GEMM_GAIN scaled by the layers'
    width (FP8_NARROW_GAIN at FP8_NARROW_WIDTH, FP8_KNEE_WIDTH's, FP8_GEMM_GAIN at FP8_FULL_WIDTH). None
    where the probe did not size them. For the 1B Llama shape (every parameter in layers of mean width
    2,006: its tied head is a Linear) about 1.35, its feed-forward layers alone (65% at 2,048) about
    1.20; ViT-B/16 (74% at 768) 0.86: slower than bf16."""
    keys = ("fp8_eligible_share", "fp8_width") if layers == "all" else ("fp8_ff_share", "fp8_ff_width")
    share, width = (float(sizes.get(key) or 0) for key in keys)
    if not share or not width:
        return None
    # the upper line, at the width (from the knee up) or at the knee (below it, where the gain falls)
    gemm = 1.0 + (FP8_GEMM_GAIN - 1.0) * min(1.0, max(width, FP8_KNEE_WIDTH) / FP8_FULL_WIDTH)
    if width < FP8_KNEE_WIDTH:
        along = (width - FP8_NARROW_WIDTH) / (FP8_KNEE_WIDTH - FP8_NARROW_WIDTH)
        gemm = max(0.5, FP8_NARROW_GAIN + (gemm - FP8_NARROW_GAIN) * along)
    return 1.0 / ((1.0 - share) + share / gemm)


RESNET50_STEM_SHARE = 0.0289
"""torchvision's ResNet-50's stem's share of its convolutions' and Linear layers' multiply-adds at 224x224
(strategies.stem_conv.stem_share): where the stem_conv move's prior was measured (reports/stem-h100)."""


def stem_speed(sizes: dict[str, Any]) -> float | None:
    """Expected speed of the stem_conv move for a model of ``sizes`` (the probe's stem_share): the move's
    prior, measured on ResNet-50, scaled by the stem's share of the model's multiply-adds against
    ResNet-50's, never above it (a share past ResNet-50's is not measured). ViT-B/16's 16x16 patchify is
    1.0% of its work (1.013x), ConvNeXt-T's 4x4 0.32% (1.004x). None where the probe did not measure it."""
    share = sizes.get("stem_share")
    if share is None:
        return None
    gain = PRIORS[("stem_conv.stem", "space_to_depth")]
    return 1.0 + (gain - 1.0) * min(1.0, float(share) / RESNET50_STEM_SHARE)


STREAM_OVERLAP = 0.82
"""The share of a step's host-to-device copy time that a side stream hides under compute: on the H200
(b092e42) ResNet-50's fp16 eager trials with 2 streams overlapped 74% of it at batch 256 and 90% at
1,024 (their profiles' copy_overlap)."""


def streams_factor(profile: dict[str, Any] | None, was: int, now: int,
                   overlap: float = STREAM_OVERLAP) -> float | None:
    """Expected speed of ``now`` CUDA streams over ``was`` for a trial measured with ``was`` and this
    ``profile`` (autotune.trial.profile): one stream to two hides ``overlap`` of the copies exposed in
    the step (memcpy_share; 1.0: the most it can give); two to one adds back the copy time that
    overlapped. None where the profile did not see the copies. On the H200 (b092e42) ResNet-50's plain recipe at batch 1,024 spent
    7.8% of its step copying its 616 MB of images in series with compute (about 53 GB/s): about 1.07x,
    where the move had no prior and the compiled trial waited behind regional compile's 0.77x until
    the budget ended."""
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
    give no more than the share of the step the GPU sat idle (idle_share). On the H200 ResNet-50's
    plain recipe at batch 1,024 was never idle (1.0: nothing to win) and GPT-2's at 64 idle 2%, where
    reduce-overhead ran at 0.98x (3445a3e)."""
    if prior is None or not profile or not profile.get("steps") or profile.get("idle_share") is None:
        return prior
    return min(prior, 1.0 / (1.0 - min(float(profile["idle_share"]), 0.9)))


def profiled_factor(key: str, measured: dict[str, Any], params: dict[str, Any], profile: dict[str, Any] | None,
                    f: float | None) -> tuple[float | None, float | None]:
    """The factor ``f`` of the knob ``key`` from ``measured`` (a trial with this ``profile``) to
    ``params``, where the profile bounds it, and the most the profile allows over it (None where it does
    not bound it): a side stream from the copies the trial saw in series with compute, up to every copy
    hidden; a CUDA graph at most the time the GPU sat idle (compiling's own gain aside)."""
    if key == "streams.num_streams":
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
    if key == "cuda_graphs.enabled":
        return bool(params.get(key))
    return key == "compile.mode" and params.get(key) == "reduce-overhead"


def offered(space: SearchSpace, params: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any] | None:
    """``params`` with ``changes``, completed through the strategies; None where the space does not
    offer one of them with the rest (a CUDA graph with a fused loss, say: the knob drops it)."""
    changed = complete_params({**params, **changes}, space)
    return changed if all(changed.get(k) == v for k, v in changes.items()) else None


class Neighbours:
    """Optuna's callback after each trial: queue the plain recipe's neighbours once it is measured."""

    def __init__(self, space: SearchSpace, limit_bytes: float | None) -> None:
        self.space = space
        self.limit_bytes = limit_bytes

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if trial.state != TrialState.COMPLETE or trial.value is None:
            return
        if TrialRecord.of(trial).role != plain_recipe.ROLE:
            self.climb(study, trial)
            return
        trials = study.get_trials(deepcopy=False)
        # from the fastest plain recipe measured, even while a larger batch of it is queued (GrowToFit):
        # the planner weighs them against it. Held back until that one ran, ConvNeXt-T's moves on the H100
        # (5ece370) never ran: the grown batch was hoped 0.5% for a cold compile, the budget ended first
        bar = max((t for t in trials if TrialRecord.of(t).role == plain_recipe.ROLE
                   and t.state == TrialState.COMPLETE and t.value is not None), key=lambda t: t.value)
        self._queue(study, trials, bar, self.candidates(study, bar))

    def _queue(self, study: optuna.Study, trials: list[optuna.trial.FrozenTrial], start: optuna.trial.FrozenTrial,
               proposals: list[tuple[dict[str, Any], str]]) -> None:
        """Queue each of ``proposals`` (complete parameters, why) that no trial of the study has, steered
        from ``start`` by RULE."""
        known = [complete_params(planned_params(t), self.space) for t in trials]
        for params, why in proposals:
            if params in known:
                continue
            known.append(params)
            study.enqueue_trial(params, user_attrs=queue_attrs(
                role="steered", steered_by={"trial": start.number, "rule": RULE, "why": why}))

    def climb(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        """A move that beat the plain recipe and every trial measured so far gets the other moves on
        top of it, once each: a side stream and fp16 each measured alone would not add up otherwise
        (the moves all start from the bar). So does a finding's remedy that did: on the H100
        (2b09a74) ResNet-50's side stream came from the bar's profile (rule "copies"), beat it 1.064x,
        and no move was ever tried on top of it. The planner weighs them from this trial."""
        if TrialRecord.of(trial).role != "steered":
            return
        trials = study.get_trials(deepcopy=False)
        done = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None and t.number != trial.number]
        measured = [t.value for t in done]
        bar_measured = any(TrialRecord.of(t).role == plain_recipe.ROLE for t in done)
        if (not bar_measured or trial.value <= max(measured)
                or study.direction != optuna.study.StudyDirection.MAXIMIZE):
            return
        self._queue(study, trials, trial, [(params, f"{why}, on #{trial.number}, which beat the plain recipe")
                                           for params, why in self._moves(trial.params, self._climbs)])

    def _climbs(self, move: Move) -> bool:
        """Whether ``move`` goes on a move that won: not one expected slower (regional compile); under a
        memory cap, not a CUDA graph, whose pool holds memory the winner, sized near the cap, does not have."""
        if move.gain < 1.0:
            return False
        graphs = move.param == "cuda_graphs.enabled" or (move.param, move.value) == ("compile.mode", "reduce-overhead")
        return not (graphs and self.limit_bytes)

    def candidates(self, study: optuna.Study, bar: optuna.trial.FrozenTrial) -> list[tuple[dict[str, Any], str]]:
        """The moves and the memory levers offered here, as complete parameters with their words."""
        start = self.start(study, bar)
        out = self._moves(start)
        batch = int(bar.params.get("batch_size.batch_size", 0))
        if start is not bar.params:
            grown = start["batch_size.batch_size"]
            out = [(p, f"{why}, at batch {grown}: the bar's measured step predicts it fits") for p, why in out]
        larger = [b for b in self.space.batch_sizes if b > batch]
        if larger:  # the planner sizes it down first where the memory model says it does not fit
            out.append((offered(self.space, bar.params, {"batch_size.batch_size": min(larger)}) or bar.params,
                        "a larger batch than the plain recipe's"))
        out += self.levers(study, bar)
        return [(p, why) for p, why in out if p != bar.params]

    def start(self, study: optuna.Study, bar: optuna.trial.FrozenTrial) -> dict[str, Any]:
        """What the moves change: the bar's parameters, at GrowToFit's batch where the bar's measured peak
        scaled to it stays within SIBLING_FILL of the limit (where the memory model holds a move to that
        peak, so it runs at that batch rather than being sized down). Held at the bar's batch, a move
        measures what a user's plain recipe at the batch that fits already has: on the H100 (2b09a74)
        hf:gpt2's bar was sized at 48 sequences by the eager probe, its hand-written loop ran 64, the grown
        batch was hoped 0.5% (measured 0.9% at 5ece370) and never ran, and the best, a CUDA graph at 48,
        measured 0.996x the loop."""
        from autotune.search.memory import SIBLING_FILL

        batch = int(bar.params.get("batch_size.batch_size", 0))
        grown = plain_recipe.grown_batch(study, bar, self.space, self.limit_bytes)
        peak = TrialRecord.of(bar).peak_memory_bytes
        if grown is None or not peak or peak * grown / batch > self.limit_bytes * SIBLING_FILL:
            return bar.params
        return offered(self.space, bar.params, {"batch_size.batch_size": grown}) or bar.params

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
        batch = int(bar.params.get("batch_size.batch_size", 0))
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
                    layers = start.get("fp8_layers.layers", "all")
                    words = ("fp8 + " if layers == "all" else f"fp8 ({layers} layers) + ") + words
                out.append((offered(self.space, params, {"batch_size.batch_size": target}) or params,
                            f"{words}: batch {target} predicted to fit where the plain recipe's {batch} is the largest"))
        return out

    def _lever_starts(self, bar: optuna.trial.FrozenTrial) -> list[dict[str, Any]]:
        """What the memory knobs are added to: the plain recipe, and its fp8 twin where the space offers
        fp8 beside a bf16 bar (fp8 keeps bf16 autocast and FP32 master weights, so it needs what the bar
        needs: the memory model predicts it from the bar's peaks; the planner ranks it by fp8_speed)."""
        starts = [bar.params]
        if bar.params.get("precision.mode") == "bf16" and "fp8" in self.space.precisions:
            twin = offered(self.space, bar.params, {"precision.mode": "fp8"})
            if twin is not None:
                starts.append(twin)
            # and fp8 on the feed-forward layers alone, where offered (strategies.fp8_layers): the attention
            # projections and the head in bf16, for numerics closer to FP32's
            twin = offered(self.space, bar.params, {"precision.mode": "fp8", "fp8_layers.layers": "feed-forward"})
            if twin is not None:
                starts.append(twin)
        return starts


def compile_mode_factor(was: str, now: str) -> float | None:
    """One compile mode against another, from the moves' priors (each against the plain recipe's
    default mode); None where either has none. On the H200 (b092e42) ResNet-50's regional compile was
    predicted at the default mode's 6,888 img/s, ran its 68 s of a 5 min budget and measured 6,068: the
    moves' 0.77 had not been applied between two compiled configurations."""
    a = 1.0 if was == "default" else PRIORS.get(("compile.mode", was))
    b = 1.0 if now == "default" else PRIORS.get(("compile.mode", now))
    return None if a is None or b is None else b / a


def prior_factor(key: str, before: dict[str, Any], after: dict[str, Any], stem: float | None = None) -> float | None:
    """The planner's factor for one knob from PRIORS (COMPILED_PRIORS where both sides compile; ``stem``:
    this model's stem_speed, where the probe measured it): ``after``'s value against ``before``'s, where
    one of them is a move's or lever's value and the other the knob's untuned one; None otherwise."""
    was, now = before.get(key), after.get(key)
    default = untuned(key)
    priors = {**PRIORS, **COMPILED_PRIORS} if _compiles(before) and _compiles(after) else PRIORS
    if stem is not None:
        priors = {**priors, ("stem_conv.stem", "space_to_depth"): stem}
    if (key, now) in priors and was in (None, default):
        return priors[(key, now)]
    if (key, was) in priors and now in (None, default):
        return 1.0 / priors[(key, was)]
    return None


def _compiles(params: dict[str, Any]) -> bool:
    return params.get("compile.mode", "off") != "off"


