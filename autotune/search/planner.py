"""The planner: which queued configuration runs next, and why.

Proposers put candidates forward (autotune.search.queue): the seeds (the FP32 baseline, the plain
recipe, the known-good list and its feeder), the findings' remedies (steering), eager screening's
twins, the compile finalist and the out-of-memory back-off; Optuna's sampler (TPE) proposes when
the queue is empty. The planner decides among the queued ones (Ray Tune's split of a Searcher that
proposes from a TrialScheduler that chooses), from the whole picture:

* each candidate's predicted value: that of its nearest measured configuration (the fewest knobs
  apart whose effect is not known, then the fewest known, then the least extrapolated: the smallest
  sum of |log factor|), times what the differing knobs are known to give: compiling's
  gain as this search measured it for the precision (else its prior), 16-bit autocast over FP32, a
  larger batch (the half-speed batch), a side stream from the copies the measured trial's profile saw
  in series with compute, a CUDA graph at most the time it sat idle; every prior is a row of
  autotune.priors;
* its predicted cost in seconds: this run's measured walls of its kind (compiled or eager), a first
  compile's cost from the model's size before any compile ran, a measured graph's from Inductor's cache
  (autotune.search.walls);
* its predicted peak memory (autotune.search.memory, which the memory probe primes).

Fixed roles first: a baseline backed off to a batch that fits, then a configuration predicted not to fit
(sized down before it runs, at no cost), a repeat of a measured one (its result is copied), the FP32
baseline, the plain recipe (the bar every recommendation must clear, compiled early). The rest by expected
gain per second of budget: the predicted improvement on the best so far, where a knob value no trial
measured yet may give NOVELTY more than predicted (what it gives is unknown until it runs), but no more than
that: an eager candidate predicted far below a compiled best gains nothing by being new. When the budget
left holds the candidate of most gain but not after the one of most gain per second, and it is expected to
gain clearly more (by NOVELTY of the best so far), it runs first. The queue hands the chosen one to
Optuna with its plan (predicted value, cost, peak, why) as its ``planned`` user attribute: "why did this
trial run now?" is answered on the trial itself.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import optuna
from optuna.trial import TrialState

import strategies
from autotune.space import SearchSpace
from autotune.search.levers import step_costs
from autotune.search.neighbours import (compile_mode_factor, fp8_speed, precision_factor, prior_factor, profiled_factor,
                                        stem_speed)
from autotune.priors import prior
from autotune.search.trials import planned_params
from autotune.search.walls import cached_compile_saving, cut_floors, trial_cost_s
from autotune.trial.record import TrialRecord

NOVELTY = 0.05
"""How much more than predicted a candidate with a knob value no trial measured (a precision mode,
CUDA graphs, a compile mode) may give: about the run-to-run spread of the measured gains."""

_IGNORED = ("grad_scaler.",)  # settings of a knob another parameter decides (fp16's GradScaler)


@dataclass(frozen=True)
class Plan:
    """One queued candidate, as the planner sees it."""

    number: int
    """The candidate's number (autotune.search.queue), or a WAITING trial's."""
    role: str
    predicted: float | None
    """The predicted objective value; None before anything comparable was measured."""
    cost_s: float
    peak_bytes: float | None
    gain: float
    """Expected improvement on the best so far, in the objective's unit (0 when none is expected)."""
    rank: int
    """0-4: the fixed roles' order (see the module's docstring); 5: ranked by gain per second."""
    why: str
    runner_up: dict[str, Any] | None = None
    """The candidate that would have run in its place (number, role, predicted, cost_s, why) and why it
    lost ("lost"); set by ``choose``, None where nothing else was queued."""

    @property
    def gain_per_s(self) -> float:
        return self.gain / max(self.cost_s, 1e-3)

    def to_attr(self) -> dict[str, Any]:
        out = asdict(self)
        del out["number"], out["rank"]
        return out


class Planner:
    """Chooses the next queued candidate (autotune.search.queue hands it to Optuna)."""

    def __init__(self, space: SearchSpace, *, maximize: bool = True, limit_bytes: float | None = None,
                 walls: list[tuple[float, bool]] | None = None, compile_prior_s: float = 0.0,
                 deadline: float | None = None, unit: str = "samples/s", queue_order: bool = False) -> None:
        self.space = space
        self.maximize = maximize
        self.limit_bytes = limit_bytes
        self.walls = walls if walls is not None else []
        """This run's measured walls (seconds, compiled): the stop rule's list, shared."""
        self.compile_prior_s = compile_prior_s
        self.deadline = deadline
        self.unit = unit
        self.queue_order = queue_order
        """Run the queue in its order once the sized-down, urgent and repeated ones are out (--replay:
        an earlier search's configurations in the order it ran them)."""
        self.step_costs: dict[tuple[str, Any], float] = {}
        """(param, value) -> seconds a step of the memory knobs costing that much whatever the batch,
        for this model (levers.step_costs; set by ``plans``)."""
        self.cut_floors: dict[str, float] = {}
        """compile mode -> the least a trial in it costs, from trials the budget cut (walls.cut_floors; set by ``plans``)."""

    # -- the plan ------------------------------------------------------------------------------------

    def plans(self, study: optuna.Study) -> list[Plan]:
        """Every queued candidate with its prediction, in the order the planner would run them
        (before the look-ahead on the budget left, which ``choose`` adds)."""
        from autotune.search.memory import MemoryModel
        from autotune.search.queue import queued

        trials = study.get_trials(deepcopy=False)
        waiting = queued(study)
        if not waiting:
            return []
        done = self._measured(trials)
        self.cut_floors = cut_floors(trials)
        best = self._best(done, study)
        memory = MemoryModel.from_study(study, self.limit_bytes)
        seen = self._seen_values(done)
        gains = self.compile_gains(study)
        gains["batch half"] = _batch_half(study)
        gains.update((name, speed) for name, speed in (
            ("fp8 speed", fp8_speed(memory.sizes)), ("fp8 feed-forward speed", fp8_speed(memory.sizes, "feed-forward")),
            ("stem speed", stem_speed(memory.sizes))) if speed is not None)
        self.step_costs = step_costs(memory.sizes) if self.maximize else {}
        context = (done, best, memory, seen, [p for _, p, _ in done], gains,
                   suspects(trials) + accuracy_suspects(study, trials))
        plans = [self._plan(t, *context) for t in waiting]
        if self.queue_order:
            return sorted(plans, key=lambda p: (min(p.rank, 3), p.number))
        # fixed roles in their order (queue order within one); the rest by gain per second, the
        # queue's order breaking ties (the seeds' order says which the guides rank first)
        return sorted(plans, key=lambda p: (p.rank, -p.gain_per_s if p.rank == 5 else 0.0, p.number))

    def _plan(self, t: optuna.trial.FrozenTrial, done, best, memory, seen: dict[str, set],
              measured_params: list[dict], gains: dict[str, float],
              suspected: list[tuple[str, frozenset]] = ()) -> Plan:
        """One queued trial's plan: its predictions, its rank among the fixed roles, its words."""
        from autotune.search.steering import complete_params

        record = TrialRecord.of(t)
        params = complete_params(planned_params(t), self.space)
        # the graph a measured compile traced is loaded from Inductor's cache, not compiled again
        cost = self._cost(params.get(strategies.compile.MODE_PARAM, "off"),
                          params.get(strategies.precision.MODE_PARAM),
                          cached_compile_saving(params, [(p, r.timing) for _, p, r in done]))
        peak, verdict = self._memory(memory, params)
        predicted, source, profiled = self._predict(params, done, gains)
        new = [k for k, v in params.items()
               if k in seen and v not in seen[k] and k != strategies.batch_size.BATCH_SIZE_PARAM]
        novel = [f"{k}={params[k]}" for k in new if k not in profiled]
        gain = 0.0
        if best is not None and predicted is not None:
            # a knob value never measured may give NOVELTY more than predicted, not more than that:
            # an eager trial predicted far below a compiled best gains nothing by being new; one whose
            # factor the profile bounded, at most what the profile allows
            spread = max([1 + NOVELTY if novel else 1.0] + [profiled[k] for k in new if k in profiled])
            hope = predicted * spread if self.maximize else predicted / spread
            gain = max(0.0, (hope - best.value) if self.maximize else (best.value - hope))
        elif best is not None and novel:
            gain = NOVELTY * abs(best.value)
        items = set(params.items()) if suspected else set()
        failed = next((which for which, values in suspected if values <= items), None)
        if failed is not None:
            gain = 0.0  # it would fail as they did: last, after everything that may gain
        role = record.role or "search"
        if record.urgent:
            rank, why = 0, "the FP32 baseline at a batch that fits: every figure is compared with it"
        elif verdict is not None:
            rank, cost, why = 1, 0.0, f"sized before it runs: {verdict}"
        elif params in measured_params:
            rank, cost, why = 2, 0.0, "a repeat of a measured configuration: its result is copied"
        elif role == "baseline":
            rank, why = 3, "the FP32 baseline: every figure is compared with it"
        elif role == "plain-recipe" and record.grown_from is None:
            rank, why = 4, "the plain recipe: the bar every recommendation must clear"
        else:
            rank, why = 5, self._words(predicted, source, best, cost, gain, novel)
            if failed is not None:
                why += f"; last: {failed} failed with the same knob values"
        return Plan(number=t.number, role=role, predicted=predicted, cost_s=cost,
                    peak_bytes=peak, gain=gain, rank=rank, why=why)

    def choose(self, study: optuna.Study, left_s: float | None = None) -> Plan | None:
        """The queued candidate to run next, with the runner-up and why it lost; None when nothing is
        queued. ``left_s``: the budget's seconds left (default: until the deadline)."""
        plans = self.plans(study)
        if not plans:
            return None
        if plans[0].rank >= 5 and left_s is None and self.deadline is not None:
            left_s = self.deadline - time.time()
        chosen = self._pick(study, plans, left_s)
        others = [p for p in plans if p.number != chosen.number]
        if not others:
            return chosen
        runner = others[0]
        if chosen is plans[0] and chosen.rank >= 5 and left_s is not None:  # the next that the time left holds
            runner = next((p for p in others if p.cost_s <= left_s), runner)
        lost = _lost(chosen, runner, left_s, self.unit, self.queue_order)
        return replace(chosen, runner_up={"number": runner.number, "role": runner.role, "predicted": runner.predicted,
                                          "cost_s": runner.cost_s, "why": runner.why, "lost": lost})

    def _pick(self, study: optuna.Study, plans: list[Plan], left_s: float | None) -> Plan:
        """``choose``'s pick among ``plans`` (in the planner's order): the first, unless the budget left
        holds the one of most gain only before the one of most gain per second."""
        first = plans[0]
        if first.rank < 5 or left_s is None:
            return first
        affordable = [p for p in plans if p.cost_s <= left_s]
        if not affordable:
            return first  # nothing fits: the objective and the stop rule decide what is left
        first = affordable[0]
        most = max(affordable, key=lambda p: (p.gain, -p.number))
        if (most is not first and left_s - first.cost_s < most.cost_s
                and most.gain > first.gain + self._clear_gain(study)):
            # after the most gain per second, the budget would no longer hold the most gain
            return Plan(**{**asdict(most), "why": most.why + f"; the {left_s:.0f} s left hold it, but not after "
                                                          f"#{first.number} ({first.cost_s:.0f} s)"})
        return first

    def _clear_gain(self, study: optuna.Study) -> float:
        """How much more a candidate must be expected to gain than the one of most gain per second to
        run first in its place: NOVELTY of the best so far, the spread of the hopes themselves. Nearer,
        the two are a tie the cheaper one wins, and it leaves time for more."""
        best = self._best(self._measured(study.get_trials(deepcopy=False)), study)
        return NOVELTY * abs(best.value) if best is not None else 0.0

    def expects_better(self, study: optuna.Study, value: float, left_s: float | None = None) -> Plan | None:
        """A queued candidate the budget left still holds (``left_s``; default: until the deadline) that is
        predicted clearly past ``value``, beyond NEAR_FRONTIER of it: the one predicted best; None where
        there is none. An accuracy check of ``value``'s trial would be spent on a configuration
        predicted to be overtaken (autotune.search.objective)."""
        from autotune.accuracy.settings import NEAR_FRONTIER

        if left_s is None and self.deadline is not None:
            left_s = self.deadline - time.time()
        bar = value / NEAR_FRONTIER if self.maximize else value * NEAR_FRONTIER
        ahead = [p for p in self.plans(study) if p.rank != 1 and p.predicted is not None
                 and (left_s is None or p.cost_s <= left_s)
                 and (p.predicted > bar if self.maximize else p.predicted < bar)]
        if not ahead:
            return None
        return (max if self.maximize else min)(ahead, key=lambda p: p.predicted)

    # -- predictions -------------------------------------------------------------------------------------

    @staticmethod
    def _measured(trials: list[optuna.trial.FrozenTrial]) -> list[tuple[optuna.trial.FrozenTrial, dict, TrialRecord]]:
        """Completed, stable trials with a value, their parameters and records."""
        out = []
        for t in trials:
            if t.state != TrialState.COMPLETE or t.value is None:
                continue
            record = TrialRecord.of(t)
            if not record.unstable:
                out.append((t, dict(t.params), record))
        return out

    def _best(self, done, study: optuna.Study) -> optuna.trial.FrozenTrial | None:
        """The best measured trial that can be recommended: one that failed its accuracy check is still a
        measurement the predictions learn from (``done``), but no bar for a candidate's gain: against a
        winner that failed, the twin that might pass in its place would be expected to gain nothing, and
        never run."""
        from autotune.accuracy.study.gate import accuracy_of, failed

        eligible = [t for t, _, _ in done if not failed(accuracy_of(study, t))]
        if not eligible:
            return None
        pick = max if self.maximize else min
        return pick(eligible, key=lambda t: t.value)

    @staticmethod
    def _seen_values(done) -> dict[str, set]:
        seen: dict[str, set] = {}
        for _, params, _ in done:
            for k, v in params.items():
                seen.setdefault(k, set()).add(v)
        return seen

    def _cost(self, mode: str, precision: str | None = None, saved_s: float = 0.0) -> float:
        """A trial's expected seconds in ``mode`` and ``precision``, a cached compile's ``saved_s`` less (walls),
        and no less than a trial the budget cut in that mode says (cut_floors)."""
        return trial_cost_s(self.walls, mode, precision, self.compile_prior_s, prior("trial", None, "seconds"),
                            saved_s, floors=self.cut_floors)

    def _memory(self, memory, params: dict[str, Any]) -> tuple[float | None, str | None]:
        """Predicted peak bytes of ``params``, and the memory model's reason it cannot fit (None: it may)."""
        try:
            knobs = strategies.knobs_of(params, self.space)
        except (ValueError, KeyError):
            return None, None
        return memory.predict(knobs), memory.verdict(knobs)

    def _predict(self, params: dict[str, Any], done, gains: dict[str, float]
                 ) -> tuple[float | None, str, dict[str, float]]:
        """Predicted value of ``params`` from its nearest measured configuration, the words saying how,
        and the knobs whose factor that trial's profile bounded (a side stream, a CUDA graph), each with
        the most the profile allows over its prediction: their hope instead of NOVELTY (a 1B Llama's
        tokens take no time to copy, ConvNeXt-T's images 4.9% of its step)."""
        best: tuple[tuple, float, str, dict[str, float]] | None = None  # (rank; value; words; profiled knobs)
        for t, measured, record in done:
            apart, known, factor, stretch, notes, profiled = 0, 0, 1.0, 0.0, [], {}
            for key in sorted(set(params) | set(measured)):
                if key.startswith(_IGNORED) or params.get(key) == measured.get(key):
                    continue
                if key in {param for param, _ in self.step_costs}:
                    known += 1  # a cost a step, added below
                    continue
                f = self._factor(key, measured, params, gains)
                f, headroom = profiled_factor(key, measured, params, record.profile, f)
                if headroom is not None:
                    profiled[key] = headroom
                if f is None:  # what this knob gives is not known: the analog is that much further off
                    apart += 1
                    continue
                known += 1
                if f != 1.0:
                    factor *= f
                    stretch += abs(math.log(f)) if f > 0 else math.inf  # each factor's, not their product's
                    notes.append(f"{key.split('.')[0]} x{f:.2f}")
            value = self._step_costs_off(t.value, measured)
            value = value * factor if self.maximize else value / factor
            value, notes = self._with_step_costs(value, params, notes)
            words = f"#{t.number}" + (f" {' '.join(notes)}" if notes else "")
            # equally near: the least extrapolated (a compile mode is predicted from the default mode's
            # trial, not from another mode's trial times the ratio of two priors)
            rank = (apart, known, round(stretch, 3),
                    -value if self.maximize else value)
            if best is None or rank < best[0]:
                best = (rank, value, words, profiled)
        return (None, "", {}) if best is None else best[1:]

    def _step_cost_s(self, params: dict[str, Any]) -> float:
        """Seconds a step of ``params``' memory knobs whose cost is per optimizer step (levers.step_costs)."""
        return sum(cost for (param, value), cost in self.step_costs.items() if params.get(param) == value)

    def _step_costs_off(self, value: float, measured: dict[str, Any]) -> float:
        """A measured value (samples/s) without its per-step costs: what the factors of a batch, a compile
        or a precision scale (a cost a step scaled whole with the batch would predict a larger batch too
        slow, and the same configuration differently from each measured trial)."""
        cost, batch = self._step_cost_s(measured), measured.get(strategies.batch_size.BATCH_SIZE_PARAM)
        if not cost or not batch or value <= 0 or not self.maximize:
            return value
        step_s = float(batch) / value - cost
        return float(batch) / step_s if step_s > 0 else value

    def _with_step_costs(self, value: float, params: dict[str, Any], notes: list[str]) -> tuple[float, list[str]]:
        """``value`` (samples/s at ``params``' batch, without per-step costs) with ``params``' own: each
        optimizer step takes that much longer whatever the batch (levers.step_costs)."""
        cost, batch = self._step_cost_s(params), params.get(strategies.batch_size.BATCH_SIZE_PARAM)
        if not cost or not batch or value <= 0 or not self.maximize:
            return value, notes
        return float(batch) / (float(batch) / value + cost), notes + [f"step {cost * 1e3:+.0f} ms"]

    @staticmethod
    def _factor(key: str, before: dict[str, Any], after: dict[str, Any], gains: dict[str, float]) -> float | None:
        """How much faster ``after`` is expected to run than ``before`` for the one knob ``key``
        (``gains``: compiling's, by precision mode); None where that is not known (taken as 1)."""
        if key == strategies.compile.MODE_PARAM:
            was, now = before.get(key, "off"), after.get(key, "off")
            if (was == "off") == (now == "off"):
                return compile_mode_factor(was, now)  # one compile mode against another
            mode = (after if now != "off" else before).get(strategies.precision.MODE_PARAM)
            gain = gains.get(mode, prior(strategies.compile.MODE_PARAM, "default", "speed over eager"))
            return gain if was == "off" else 1.0 / gain
        if key == strategies.precision.MODE_PARAM:
            return precision_factor(before.get(key, "fp32"), after.get(key, "fp32"), gains.get("fp8 speed"))
        if key == strategies.fp8_layers.LAYERS_PARAM:  # fp8 on the feed-forward layers alone, against all of them (or back)
            speeds = {"all": gains.get("fp8 speed"), "feed-forward": gains.get("fp8 feed-forward speed")}
            was, now = speeds.get(before.get(key, "all")), speeds.get(after.get(key, "all"))
            return now / was if was and now else None
        if key == strategies.batch_size.BATCH_SIZE_PARAM and before.get(key) and after.get(key):
            half = gains["batch half"]
            was, now = int(before[key]), int(after[key])
            return (now / (now + half)) / (was / (was + half))
        # a knob the plain recipe's neighbours change: what it gave elsewhere (autotune.search.neighbours)
        return prior_factor(key, before, after, gains.get("stem speed"))

    def compile_gains(self, study: optuna.Study) -> dict[str, float]:
        """torch.compile's gain for each offered precision as this search measured it (its compiled
        trials over their eager twins), else any precision's, else its prior (autotune.priors); each
        precision's compiled trials are read once."""
        from autotune.search.screening import compile_gains

        if "default" not in self.space.compile_modes:
            return {mode: 1.0 for mode in self.space.precisions}
        measured = {mode: [g for g, _, _ in compile_gains(study, self.space, mode, "default")]
                    for mode in self.space.precisions}
        anywhere = [g for gains in measured.values() for g in gains]
        gain = prior(strategies.compile.MODE_PARAM, "default", "speed over eager")
        return {mode: max(gains or anywhere or [gain]) for mode, gains in measured.items()}

    def _words(self, predicted, source, best, cost, gain, novel) -> str:
        if predicted is None:
            text = "nothing comparable measured yet: in the queue's order"
        else:
            text = f"predicted {predicted:,.4g} {self.unit} ({source})"
            if best is not None:
                text += f" against the best #{best.number}'s {best.value:,.4g}"
        if novel:
            text += f"; measures {', '.join(novel[:2])} for the first time"
        return text + f"; about {cost:.0f} s" + (f", {gain / max(cost, 1e-3):,.3g} {self.unit} gained a second"
                                                 if gain > 0 else "")


def suspects(trials: list[optuna.trial.FrozenTrial]) -> list[tuple[str, frozenset]]:
    """Knob values that a failed trial (crashed, an error, a timeout: not out of memory) had and no
    completed trial has: each failed trial's, and those two failed trials share. A candidate holding
    all of one such set is expected to fail as they did (on the GPU a compile of fp8 with three memory
    knobs is a minute of a 5-minute budget: its siblings at other batches should not each spend one),
    and two failures that share values point at those. The batch is never a suspect. ("#7", values)."""
    from autotune.search.outcome import FAILED_STATUSES

    completed = {(k, v) for t in trials if t.state == TrialState.COMPLETE for k, v in t.params.items()}
    failed = []
    for t in trials:
        if TrialRecord.of(t).status in FAILED_STATUSES:
            values = frozenset((k, v) for k, v in t.params.items()
                               if (k, v) not in completed and k != strategies.batch_size.BATCH_SIZE_PARAM)
            if values:
                failed.append((f"#{t.number}", values))
    shared = [(f"{a} and {b}", x & y) for i, (a, x) in enumerate(failed) for b, y in failed[i + 1:] if x & y]
    return failed + shared


def accuracy_suspects(study: optuna.Study, trials: list[optuna.trial.FrozenTrial]) -> list[tuple[str, frozenset]]:
    """The precision of a trial that failed its accuracy check, as suspects do for a crash, where no
    passing check and no plain recipe ran in it (nor FP32): it changes the arithmetic of every matmul,
    where the memory knobs recompute exactly (checkpointing), accumulate in FP32 (a fused linear
    cross-entropy) or round only the optimizer's states. ("#18's accuracy check",
    {("precision.mode", "fp8")})."""
    from autotune.accuracy.study.gate import accuracy_of, failed
    from autotune.search import plain_recipe

    complete = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    cleared = {"fp32"} | {t.params.get(strategies.precision.MODE_PARAM) for t in complete
                          if TrialRecord.of(t).role == plain_recipe.ROLE
                          or (accuracy_of(study, t) or {}).get("verdict") == "passed"}
    out = []
    for t in complete:
        mode = t.params.get(strategies.precision.MODE_PARAM)
        if mode is not None and mode not in cleared and failed(accuracy_of(study, t)):
            # with the layers fp8 took: fp8 on the feed-forward layers alone is other numerics
            values = {(strategies.precision.MODE_PARAM, mode)} | {
                (k, v) for k, v in t.params.items() if k == strategies.fp8_layers.LAYERS_PARAM}
            out.append((f"#{t.number}'s accuracy check", frozenset(values)))
    return out


def _batch_half(study: optuna.Study) -> float:
    """The half-speed batch (autotune.priors) in samples of this study's workload (a language
    model's: its prior in tokens over a sample's tokens)."""
    from autotune.workload.units import ATTR, Units

    tokens = Units.from_dict(study.user_attrs.get(ATTR) or {}).tokens_per_sample
    if tokens:
        return prior(strategies.batch_size.BATCH_SIZE_PARAM, "tokens", "half-speed batch") / tokens
    return prior(strategies.batch_size.BATCH_SIZE_PARAM, "samples", "half-speed batch")


_RANK_WORDS = ("a baseline backed off to a batch that fits", "a configuration sized before it runs",
               "a repeat of a measured configuration", "the FP32 baseline", "the plain recipe",
               "a candidate ranked by gain per second")


def _lost(chosen: Plan, runner: Plan, left_s: float | None, unit: str, queue_order: bool = False) -> str:
    """Why ``runner`` did not run in ``chosen``'s place, in words."""
    if chosen.rank < 5 and chosen.rank != runner.rank:
        return f"{_RANK_WORDS[chosen.rank]} runs before {_RANK_WORDS[runner.rank]}"
    if chosen.rank < 5 or queue_order:
        return "queued after it: the queue's order"
    if left_s is not None and runner.cost_s > left_s:
        return f"about {runner.cost_s:.0f} s, more than the {left_s:.0f} s left"
    if runner.gain_per_s > chosen.gain_per_s:
        return (f"more gain a second, but the {left_s:.0f} s left would not hold #{chosen.number} "
                f"({chosen.cost_s:.0f} s) after it, and #{chosen.number} is expected to gain clearly more")
    if runner.gain_per_s < chosen.gain_per_s:
        return f"less gain a second: {runner.gain_per_s:,.3g} {unit} against {chosen.gain_per_s:,.3g}"
    return "as much gain a second, queued after it"
