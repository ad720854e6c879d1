"""The CLI's terminal output: the live view of a search, its summary, and the table `autotune accuracy`
prints (rich, on stderr; stdout is left to the commands' JSON)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from autotune.report.format import describe, fmt_rate, memory_knobs_line, plural_fix

console = Console(stderr=True)


class SearchView:
    """Trials done, the current best and the time left, on one live line; a line per trial."""

    def __init__(self, config) -> None:
        self.config = config
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                 console=console, transient=False)
        self.task = None
        self.summary = "starting"
        """The live line's first part: trials done and the best; what runs now follows it."""
        self.started = getattr(config, "started_at", None) or time.time()  # --budget counts from the command's start
        self.walls: list[float] = []

    def __call__(self, kind: str, payload: Any) -> None:
        if kind == "start":
            self._start(payload)
            return
        if kind == "end":
            if self.task is not None:
                self.progress.update(self.task, description=self.summary)
            self.progress.stop()
            return
        if kind == "phase":
            if self.task is not None:
                self.progress.update(self.task, description=f"{self.summary} · {payload}")
            return
        if kind == "stopped":
            self.progress.console.print(f"  {escape(payload)}")
            return
        if kind == "fixed":
            for param, entry in payload.items():
                self.progress.console.print(f"  no longer explored: {param} = {entry['value']!r} ({entry['reason']})")
            return
        self._trial(payload)

    def _start(self, payload: dict[str, Any]) -> None:
        """The search's header (model, device, space, what it resumes) and the live line."""
        space = payload["space"]
        prov = payload["probe"]["provenance"]
        where = prov.get("gpu", "CPU") if space.device == "cuda" else f"CPU ({prov.get('num_cpus')} cores)"
        console.print(f"[bold]autotune[/] {self.config.workload.model} on {where}, torch {prov['torch']} "
                      f"-> {payload['out_dir']}")
        console.print(f"  space: precision {space.precisions}, batch {space.batch_sizes}, "
                      f"format {space.memory_formats}, padding {space.alignments}, streams {space.stream_counts}"
                      + (f", threads {space.thread_counts}" if space.thread_counts else ""))
        if space.ddp_world_size > 1:
            console.print(f"  DDP: {space.ddp_world_size} processes per trial, "
                          f"bucket_cap_mb {space.ddp_bucket_caps_mb}, "
                          f"gradient_as_bucket_view {space.ddp_gradient_as_bucket_view}, "
                          f"static_graph {space.ddp_static_graph}")
        if payload["done"]:
            console.print(f"  resuming: {payload['done']} trials already finished")
        if line := warm_line(payload["study"]):
            console.print(f"  {escape(line)}")
        if payload["recovered"]:
            console.print(f"  trials {payload['recovered']} were cut off by a killed search: re-queued")
        self.study = payload["study"]
        self.out_dir = payload["out_dir"]
        total = self.config.trials if self.config.trials else self.config.budget_s
        self.progress.start()
        self.task = self.progress.add_task("starting", total=total, status="",
                                           completed=payload["done"] if self.config.trials else 0)

    def _trial(self, trial) -> None:
        """A finished trial's line, then the live line: trials done, the best, the time left."""
        from autotune.search.trials import best_trial, counted_trials
        from autotune.trial.record import TrialRecord

        record = TrialRecord.of(trial)
        fig = record.figures
        if record.timing.get("wall_s") and record.duplicate_of is None:
            self.walls.append(record.timing["wall_s"])
        from autotune.workload.units import ATTR as UNITS_ATTR, Units

        tokens = Units.from_dict(self.study.user_attrs.get(UNITS_ATTR)).tokens_per_s(fig.get("samples_per_s"))
        outcome = (f"{fmt_rate(fig['samples_per_s'])} samples/s" + (f" ({fmt_rate(tokens)} tokens/s)" if tokens else "")
                   + f", {fig['step_time_ms']:.1f} ms/step, "
                   f"{fig['peak_memory_bytes'] / 2**30:.2f} GiB") if fig else escape(record.reason or trial.state.name)
        compiled = record.timing.get("compile_s") or 0.0
        if fig and compiled >= 0.5:
            cached = {"hit": ", its graphs from the cache", "partial": ", some graphs from the cache"}
            outcome += f", compiled in {compiled:.0f} s{cached.get(record.timing.get('compile_cache'), '')}"
        if record.backed_off_to:
            outcome += f"; queued again at batch {record.backed_off_to}"
        if record.unstable:
            outcome += ", loss not finite (unstable: never recommended)"
        if fig.get("ddp_world_size"):
            unit, units = ("GPU", "GPUs") if self.study.user_attrs.get("device") == "cuda" else ("process", "processes")
            outcome += (f" over {fig['ddp_world_size']} {units} ({fmt_rate(fig['per_gpu_samples_per_s'])} per {unit}, "
                        f"scaling efficiency {fig['scaling_efficiency']:.0%})")
        dup = f" (same as #{record.duplicate_of})" if record.duplicate_of is not None else ""
        if record.status in ("crashed", "error", "timeout") and record.duplicate_of is None:
            dup += f" (log: {self.out_dir / 'logs' / f'trial-{trial.number:04d}.log'})"
        role = f"[{record.role}] " if record.role else ""
        knobs = escape(describe(record.knobs))
        self.progress.console.print(f"  #{trial.number:<3} {role}{knobs}: {outcome}{dup}")
        counted = counted_trials(self.study)
        done = len(counted)  # what --trials counts
        repeats = sum(TrialRecord.of(t).duplicate_of is not None for t in counted)
        best = best_trial(self.study)
        elapsed = time.time() - self.started
        if self.config.trials:
            left_n = max(0, self.config.trials - done)
            left_s = left_n * statistics.median(self.walls) if self.walls else 0.0
            if self.config.budget_s:
                left_s = min(left_s, max(0.0, self.config.budget_s - elapsed))
            self.progress.update(self.task, completed=done)
        else:
            left_s = max(0.0, self.config.budget_s - elapsed)
            self.progress.update(self.task, completed=min(elapsed, self.config.budget_s))
        from autotune.search.goal import goal_of

        best_text = f"best {goal_value(goal_of(self.study), best.value)} (#{best.number})" if best else "no result yet"
        # a repeat reuses an earlier trial's result: not a trial of its own to the reader
        self.summary = f"{trials_words(done - repeats)}" + (f" (+{repeats} {plural(repeats, 'repeat')})" if repeats else "") \
            + f", {best_text}"
        self.progress.update(self.task, description=self.summary, status=f"~{left_s:,.0f}s left")


def goal_value(target, v: float | None) -> str:
    """An objective's value in words; a rate as the tables write it (3.94 samples/s, not 4)."""
    if v is not None and target.unit == "samples/s":
        return f"{fmt_rate(v)} {target.unit}"
    return target.format(v)


def plural(n: int, word: str) -> str:
    """``word`` for one, ``word`` + s for any other count: "1 thread", "2 threads"."""
    return word if n == 1 else f"{word}s"


def trials_words(n: int) -> str:
    return f"{n} {plural(n, 'trial')}"


OUTPUT_NAMES = ("config.json", "compile-cache.zip", "trials.csv", "report.html", "report.md", "trace-baseline.json.gz", "trace-best.json.gz")
"""What a search writes into its output folder, in the order the last line names them."""


def files_line(out_dir: Path, files: dict[str, Path] | None) -> str:
    """The last line: every file the search wrote (``files``, by name); without ``files`` (`autotune
    show`), the files the folder holds."""
    if files is None:
        paths = [out_dir / name for name in OUTPUT_NAMES if (out_dir / name).exists()]
        head = f"in {out_dir}: "
        names = [p.name for p in paths]
        return head + ", ".join(names) if names else f"{out_dir} holds none of {', '.join(OUTPUT_NAMES)}"
    order = {name: i for i, name in enumerate(OUTPUT_NAMES)}
    paths = sorted(files.values(), key=lambda p: (order.get(p.name, len(order)), p.name))
    shown = [str(p) for p in paths]
    if len(shown) > 1:
        return f"wrote {', '.join(shown[:-1])} and {shown[-1]}"
    return f"wrote {shown[0]}" if shown else "wrote nothing"


def print_summary(out_dir: Path, elapsed_s: float | None = None, phases: dict[str, float] | None = None, *,
                  study=None, min_batch_size: int | None = None, files: dict[str, Path] | None = None) -> bool:
    """Print the baseline, the best and the search's cost; False when nothing can be recommended,
    and then why (``study``: the pattern across its trials, autotune.search.outcome). The last line
    names every file the search wrote (``files``; without them, those the folder holds)."""
    path = out_dir / "config.json"
    if not path.exists():
        console.print("[red]no configuration to recommend[/]")
        if study is not None:
            from autotune.search.outcome import explain

            for line in explain(study, min_batch_size=min_batch_size):
                console.print(f"  {line}")
        console.print(f"see {out_dir / 'trials.csv'} and the logs in {out_dir / 'logs'}")
        if files:
            console.print(files_line(out_dir, files))
        return False
    data = json.loads(path.read_text())
    console.print(figures_table(data))
    best = data.get("figures") or {}
    if best.get("ddp_world_size"):
        console.print(f"DDP over {best['ddp_world_size']} processes: {fmt_rate(best['samples_per_s'])} samples/s in "
                      f"total, {fmt_rate(best['per_gpu_samples_per_s'])} per GPU; one GPU alone: "
                      f"{fmt_rate(best['single_gpu_samples_per_s'])}; scaling efficiency {best['scaling_efficiency']:.0%}")
    if (data.get("baseline") or {}).get("note"):
        console.print(f"note: {escape(data['baseline']['note'])}")
    if (data.get("memory") or {}).get("limit_bytes"):
        console.print(f"every trial was capped at {data['memory']['limit_bytes'] / 2**30:.1f} GiB of GPU memory "
                      "(--memory-limit)")
    if "speedup_vs_baseline" in data:
        console.print(f"speed-up over the FP32 baseline: {data['speedup_vs_baseline']:.2f}x, "
                      f"memory {data['memory_vs_baseline']:.2f}x")
    if line := plain_recipe_line(data):
        console.print(escape(line))
    if line := memory_knobs_line(data):
        console.print(escape(line))
    console.print(objective_line(data))
    for param, entry in (data.get("fixed_knobs") or {}).items():
        console.print(escape(f"no longer explored: {param} = {entry['value']!r} ({entry['reason']})"))
    s = data["search"]
    from autotune.report.format import trials_text

    # a repeat of an earlier trial reuses its result: named apart, not counted as a trial
    console.print(f"search cost over {trials_text(s)}: worker start "
                  f"{s['worker_start_s']:.0f}s, build {s['build_s']:.0f}s, warm-up {s['warmup_s']:.0f}s, "
                  f"measuring {s['measure_s']:.0f}s, trials in all {s['trial_wall_s']:.0f}s"
                  + (f"; this run {elapsed_s:.0f}s" if elapsed_s is not None else "")
                  + (f" ({', '.join(f'{k} {v:.1f}s' for k, v in phases.items())})" if phases else ""))
    acc = data.get("accuracy")
    if acc:
        # a parity verdict's reason is its whole line ("bf16: passed: loss 1.5% off FP32 ... (band ...)")
        said = acc.get("reason") if acc.get("method") == "parity" else f"{acc.get('verdict')}: {acc.get('reason')}"
        console.print(escape(f"accuracy: {said}"))
        from autotune.accuracy.study.plan import describe as describe_plan

        if plan := describe_plan(acc.get("plan")):
            console.print(escape(f"accuracy check: {plan}"))
    else:
        console.print("accuracy: not checked (--no-accuracy-check, or a config exported before the check existed)")
    for note in data.get("notes", []):
        console.print(f"note: {escape(note)}")
    if line := compile_cache_line(data):
        console.print(escape(line))
    console.print(files_line(out_dir, files))
    return True


def warm_line(study) -> str | None:
    """What the study started with from earlier searches (autotune.search.warm), or None."""
    from autotune.report.format import warm_words
    from autotune.search.warm import ATTR

    return warm_words(study.user_attrs.get(ATTR)) if study is not None else None


def print_cache(cache: dict[str, Any]) -> None:
    """autotune's cache after the search: where, its size against its limit, what was deleted to stay under it."""
    if not cache:
        return
    from autotune.report.format import fmt_bytes

    freed = f"; {fmt_bytes(cache['freed_bytes'])} least recently used deleted" if cache["freed_bytes"] else ""
    console.print(escape(f"cache: {fmt_bytes(cache['bytes'])} in {cache['path']} (limit {fmt_bytes(cache['limit_bytes'])}, "
                         f"--cache-limit{freed}); deleting it makes the next search start cold"))


def figures_table(data: dict[str, Any]) -> Table:
    """The baseline, plain recipe and best side by side, from config.json."""
    table = Table(title=f"{data['workload']['model']} on {data['provenance'].get('gpu', 'CPU')}")
    # a language model (config.json's units name its tokens per sample): tokens/s next to samples/s
    tokens = bool((data.get("units") or {}).get("tokens_per_sample"))
    for col in ("", "configuration", "samples/s", *(["tokens/s"] if tokens else []), "step ms", "peak GiB"):
        table.add_column(col)
    for label, entry in (("baseline", data.get("baseline")), ("plain recipe", data.get("plain_recipe")),
                         ("best", data)):
        if entry:
            f = entry["figures"]
            table.add_row(label, escape(plural_fix(entry["summary"])), fmt_rate(f["samples_per_s"]),
                          *([fmt_rate(f.get("tokens_per_s") or 0)] if tokens else []), f"{f['step_time_ms']:.1f}",
                          f"{f['peak_memory_bytes'] / 2**30:.2f}")
    return table


def objective_line(data: dict[str, Any]) -> str:
    """What the best was ranked by, and its value beside the plain recipe's and FP32's."""
    from autotune.search.goal import goal_of_config

    target, ranked = goal_of_config(data), data.get("objective") or {}

    def value(v: float) -> str:
        return goal_value(target, v)

    line = f"objective: {target.text}"
    if ranked.get("value") is not None:
        line += f"; best {value(ranked['value'])}"
        if ranked.get("plain_recipe_value") is not None:
            line += f", plain recipe {value(ranked['plain_recipe_value'])}"
        if ranked.get("baseline_value") is not None:
            line += f", FP32 baseline {value(ranked['baseline_value'])}"
    return line


def plain_recipe_line(data: dict[str, Any]) -> str | None:
    """The best's speed-up over the plain recipe beside the one over FP32, from config.json: "1.12x the
    plain recipe (bf16, channels_last, ...: 6,480 samples/s), 4.10x FP32"; that nothing beat the recipe
    when it is the recommendation; why it is missing; None where the search measured no plain recipe
    (a config.json from before it existed, or a device with neither bf16 nor fp16)."""
    plain = data.get("plain_recipe")
    if not plain:
        missing = data.get("plain_recipe_missing")
        return f"plain recipe: {missing}" if missing else None
    figures = plain["figures"]
    rate = f"{fmt_rate(figures['samples_per_s'])} samples/s"
    if figures.get("tokens_per_s"):
        rate += f", {fmt_rate(figures['tokens_per_s'])} tokens/s"
    fp32 = f", {data['speedup_vs_baseline']:.2f}x FP32" if data.get("speedup_vs_baseline") is not None else ""
    if data.get("best_is_plain_recipe"):
        return (f"nothing measured beat the plain recipe: it is the recommendation ({plural_fix(plain['summary'])}: "
                f"{rate}){fp32}")
    return f"best: {data['speedup_vs_plain_recipe']:.2f}x the plain recipe ({plural_fix(plain['summary'])}: {rate}){fp32}"


def compile_cache_line(data: dict[str, Any]) -> str | None:
    """The best's compile cache beside config.json, from config.json: "compile cache: compile-cache.zip,
    0.2 MiB, for torch 2.14.1 on cpu: cfg.prepare loads it before the first compiled step"; where
    Inductor cached none of its graphs (each bypassed the cache: compile_cache.bypassed), that its first
    step still compiles them; None where the best does not compile (or compiled nothing torch records)."""
    from autotune.deploy.compile_cache import graphs

    cache = data.get("compile_cache")
    if not cache:
        return None
    triton = f", Triton {cache['triton']}" if cache.get("device") != "cpu" and cache.get("triton") else ""
    head = (f"compile cache: {cache['file']}, {cache['bytes'] / 2**20:.1f} MiB, for torch {cache.get('torch')}{triton} "
            f"on {cache.get('device')}")
    if graphs(cache) == 0:
        left = sum((cache.get("bypassed") or {}).values())
        why = f" ({left} bypassed its cache)" if left else ""
        kinds = ", ".join(sorted(cache.get("entries") or {})) or "nothing"
        return (f"{head}: Inductor cached none of this configuration's graphs{why}, so its first step still "
                f"compiles them (the archive carries {kinds} entries)")
    return f"{head}: cfg.prepare loads it before the first compiled step"


class AccuracyView:
    """`autotune accuracy`'s output: a line per configuration as its training run ends, then the table."""

    def __init__(self, model: str, where: str) -> None:
        self.table = Table(title=f"{model} on {where}: accuracy versus FP32")
        columns = ("configuration", "steps", "final loss", "held-out acc %", "drop (points)", "loss drift",
                   "skipped", "loss rel. err", "grad cosine", "verdict")
        for col in columns:
            self.table.add_column(col)

    def __call__(self, row: dict[str, Any]) -> None:
        def fmt(v, spec=".4g"):
            return "-" if v is None else format(v, spec)

        console.print(f"  {row['mode']}: {row.get('verdict')}: {row.get('reason')}")
        self.table.add_row(row["mode"], fmt(row.get("steps"), "d"), fmt(row.get("final_loss")),
                           fmt(row.get("accuracy"), ".2f"), fmt(row.get("accuracy_drop"), ".2f"),
                           fmt(row.get("loss_drift"), ".3f"), fmt(row.get("skipped_steps"), "d"),
                           fmt(row.get("loss_rel_error"), ".2e"), fmt(row.get("grad_cosine"), ".6f"),
                           str(row.get("verdict")))

    def print_table(self) -> None:
        console.print(self.table, width=max(console.width, 160))
