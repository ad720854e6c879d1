"""Measuring a trial under DistributedDataParallel: ``autotune search --ddp N``.

A ``--ddp N`` trial runs in N rank processes of one torch.distributed group (NCCL on CUDA, gloo on
a CPU), started by the study process for that trial alone (``run_ranks``) with torchrun's
environment: MASTER_ADDR/MASTER_PORT (a port free at that moment), RANK, WORLD_SIZE, LOCAL_RANK.
Each rank is pinned to its own GPU (LOCAL_RANK) and builds the configuration through
``TunedConfig`` as user code does: padding, memory format and the device move, then
``DistributedDataParallel`` with the trial's bucket size, bucket views and static graph, then
torch.compile. Batch sizes are per rank: N ranks at batch b train a global batch of N x b.

Every rank measures two windows, all ranks at the same time, each on its own GPU:

1. **single GPU**: the same configuration without DDP (its own model, compiled too when the
   configuration compiles, so the ratio compares like with like), timed alone on each GPU with
   no collective in the step: what one GPU does by itself under the same host load. A compiled
   configuration therefore compiles twice per trial, once without and once with DDP (DDPOptimizer
   splits the graph at the bucket boundaries, so the first compile cannot be reused); that
   second compile goes into the trial's warm-up time, and only the DDP compile into
   ``compile_s`` (the one a user's training run pays).
2. **DDP**: the wrapped model, gradients all-reduced every step. DDP steps are collectives, so
   every rank must run exactly as many steps: the warm-up and timed step counts are derived from
   the single-GPU step times that all ranks gathered (``plan``), not decided per rank the way
   ``autotune.trial.measure.measure`` decides (that would leave one rank waiting in an all-reduce
   another never joins).

The trial's figures (rank 0 gathers them): ``samples_per_s`` is the total throughput, N x batch
per step of the slowest rank (the group moves at its pace), and the study's objective;
``per_gpu_samples_per_s`` is that over N; ``single_gpu_samples_per_s`` the mean of the ranks'
single-GPU rates; ``scaling_efficiency`` = per-GPU DDP rate / single-GPU rate (1.0: DDP costs
nothing; N GPUs then train N times as fast as one). Peak memory is the largest rank's.
No profile or NVML window is taken under DDP.

A rank that raises, runs out of memory or dies ends the trial at once: the others are killed
(they would wait in a collective for it) and the trial is recorded as oom, error or crashed with
that rank's reason; a group that stops making progress is killed at the trial's timeout.

    python -c BOOT RESULT.json STUDY_PID REQUEST.json     (one per rank, environment as above)
"""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__" and len(sys.argv) > 3:
    from autotune.trial.orphan import watch_parent

    watch_parent(int(sys.argv[2]))  # before the heavy imports below

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any, Callable  # noqa: E402

import torch  # noqa: E402,F401  (a rank is ready once torch is imported, as a worker is)

if TYPE_CHECKING:
    from autotune.trial.request import TrialSetup

READY_AT = time.time()

COLLECTIVE_TIMEOUT_S = 600.0
"""torch.distributed's own timeout for a collective; the trial's timeout (shorter) acts first."""

PLAN_WARMUP_S = 1.0
"""Seconds of DDP warm-up steps (at the single-GPU step time; no more than the timed window's
min_time_s), after any compile steps: DDP rebuilds its buckets in the order gradients arrived
after the first step, and a static graph is recorded then too; at least MIN_DDP_WARMUP_STEPS
steps either way."""

MIN_DDP_WARMUP_STEPS = 3


# a rank's side: two windows, gathered by rank 0 ---------------------------------------------------

def plan(single_step_ms: list[float], settings) -> tuple[int, int]:
    """(warm-up steps, timed steps) of the DDP window, the same on every rank: from the slowest
    rank's single-GPU step time, about PLAN_WARMUP_S of warm-up and settings.min_time_s of timed
    steps, within settings' step limits (a DDP step takes at least as long, so no less time)."""
    step_ms = max(max(single_step_ms), 1e-3)
    warmup_s = min(PLAN_WARMUP_S, settings.min_time_s)
    warmup = max(settings.min_warmup_steps, MIN_DDP_WARMUP_STEPS, math.ceil(warmup_s * 1e3 / step_ms))
    timed = max(settings.min_steps, math.ceil(settings.min_time_s * 1e3 / step_ms))
    return warmup, min(timed, settings.max_steps)


def measure_fixed(step: Callable[[], Any], device: str, settings, *, setup_steps: int, warmup_steps: int,
                  timed_steps: int, timed_window: Callable[[], Any] | None = None):
    """Time a fixed number of steps (every rank the same): setup steps (compile) apart, then
    warm-up, then the timed steps; steady and noisy are judged as ``measure`` judges them.
    ``timed_window()`` (NVML sampling) is entered around the timed steps only."""

    from autotune.trial.measure import Measurement, Timer, quantile

    timer = Timer(device)
    compile_s = 0.0
    if setup_steps:
        start = time.perf_counter()
        for _ in range(setup_steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
    start = time.perf_counter()
    warm = timer.run(step, warmup_steps)
    warmup_s = time.perf_counter() - start
    with timed_window() if timed_window is not None else contextlib.nullcontext():
        start = time.perf_counter()
        times = timer.run(step, timed_steps)
        measure_s = time.perf_counter() - start
    med = statistics.median(times)
    warm_med = statistics.median(warm[len(warm) // 2:])
    spread = (quantile(times, 0.9) - quantile(times, 0.1)) / med
    return Measurement(step_time_ms=med, step_time_p10_ms=quantile(times, 0.1), step_time_p90_ms=quantile(times, 0.9),
                       spread=spread, num_steps=len(times), num_warmup_steps=warmup_steps,
                       steady=abs(warm_med - med) / med <= settings.steady_tolerance,
                       noisy=spread > settings.spread_tolerance, num_remeasured=0, warmup_s=warmup_s,
                       measure_s=measure_s, compile_s=compile_s, num_setup_steps=setup_steps,
                       num_timed_steps_total=len(times))


class _Run:
    """One model of a rank, prepared through TunedConfig, with its step and batches."""

    def __init__(self, cfg, spec, *, input_on_device: bool, seed: int, rank: int) -> None:

        from autotune.trial.batches import input_batches
        from autotune.workload.models import build

        torch.manual_seed(seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
        workload = build(spec)
        optimizer = workload.optimizer(workload.model)
        self.model, self.optimizer = cfg.prepare(workload.model, optimizer)
        self.step = cfg.train_step(self.model, self.optimizer, workload.loss_fn)
        # each rank trains on its own shard of the data, as a DistributedSampler gives it
        batches = input_batches(workload, cfg.batch_size, cfg.device, input_on_device, seed + 1000 * rank)
        self.stream = iter(cfg.loader(itertools.cycle(batches)))
        self.last_loss: list[Any] = []

    def one_step(self) -> None:
        x, y = next(self.stream)
        self.last_loss[:] = [self.step(x, y)]

    def loss(self) -> float:
        return float(self.last_loss[0].float().item())


def run_rank(request: dict[str, Any]) -> dict[str, Any]:
    """One rank of a DDP trial: join the group, time the single-GPU window, then the DDP window;
    rank 0 returns the trial's figures, gathered from every rank."""
    import torch.distributed as dist

    import strategies
    from autotune.trial.request import read_request

    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    t0 = time.perf_counter()
    trial = read_request(request)
    cfg = trial.cfg
    if request.get("data") or cfg.info.get("data"):
        raise ValueError("--data is not measured under --ddp yet: each rank would need its DistributedSampler shard")
    device, seed = cfg.device, int(request.get("seed", 0))
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                            **({"device_id": torch.device("cuda", local)} if cuda else {}))
    try:
        singles, build_s, single_window_s = _single_gpu_window(trial, seed=seed, rank=rank, world=world, t0=t0)
        warmup_steps, timed_steps = plan([s["step_time_ms"] for s in singles], trial.settings)
        # the DDP model lives on until the group is destroyed, as in a training script
        ranks, ddp_run = _ddp_window(trial, request, seed=seed, rank=rank, local=local, world=world,
                                     steps=(warmup_steps, timed_steps), build_s=build_s,
                                     single_window_s=single_window_s)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return {"status": "ok"}
    figures = _combine(ranks, singles, cfg.batch_size, world)
    result = {"status": "ok", "figures": figures, "knobs": strategies.knobs_to_dict(cfg.knobs)}
    energy = combine_energy([r.get("energy") for r in ranks],
                            samples=figures["num_timed_steps_total"] * cfg.batch_size * world)
    if energy is not None:
        result["energy"] = energy
    return result


def _single_gpu_window(trial: TrialSetup, *, seed: int, rank: int, world: int,
                       t0: float) -> tuple[list[Any], float, float]:
    """1. single GPU: the same configuration without DDP, every rank alone on its own GPU; returns
    every rank's step time and compile time (gathered), this rank's build seconds (since ``t0``)
    and the window's seconds. The model is freed again before the DDP model is built."""
    import torch.distributed as dist

    import strategies
    from autotune.deploy.config import TunedConfig
    from autotune.trial.measure import measure

    cfg, settings, device = trial.cfg, trial.settings, trial.cfg.device
    single_cfg = TunedConfig({**cfg.knobs, "ddp": strategies.BY_NAME["ddp"].default()}, cfg.space)
    run = _Run(single_cfg, trial.spec, input_on_device=trial.input_on_device, seed=seed, rank=rank)
    build_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    single = measure(run.one_step, device,
                     dataclasses.replace(settings, min_time_s=min(settings.min_time_s, 1.0), max_remeasure=0),
                     setup_steps=run.step.num_setup_steps)
    single_window_s = time.perf_counter() - t1
    del run
    if cfg.recipe.compile_mode is not None:
        torch._dynamo.reset()  # the DDP model compiles afresh (DDPOptimizer); free the first one's graphs
    gc.collect()  # the first model's memory is free before the DDP model is built
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    singles: list[Any] = [None] * world
    dist.all_gather_object(singles, {"step_time_ms": single.step_time_ms, "compile_s": single.compile_s})
    return singles, build_s, single_window_s


def _ddp_window(trial: TrialSetup, request: dict[str, Any], *, seed: int, rank: int, local: int, world: int,
                steps: tuple[int, int], build_s: float, single_window_s: float) -> tuple[list[Any], _Run]:
    """2. DDP: the configuration as exported, gradients all-reduced every step, ``steps`` (warm-up,
    timed) on every rank; returns every rank's figures (gathered) and this rank's model."""
    import torch.distributed as dist

    from autotune.trial.instruments import nvml_monitor
    from autotune.trial.measure import memory_figures

    cfg, device = trial.cfg, trial.cfg.device
    t2 = time.perf_counter()
    run = _Run(cfg, trial.spec, input_on_device=trial.input_on_device, seed=seed, rank=rank)
    build_s += time.perf_counter() - t2
    monitor, windows = nvml_monitor(device, request, cuda_index=local), []
    nvml_window = (lambda: monitor.window_into(windows)) if monitor is not None else None

    try:
        m = measure_fixed(run.one_step, device, trial.settings, setup_steps=run.step.num_setup_steps,
                          warmup_steps=steps[0], timed_steps=steps[1], timed_window=nvml_window)
    finally:
        if monitor is not None:
            monitor.close()
    loss = run.loss()
    mine = {"measurement": m.to_dict(), "memory": memory_figures(device), "final_loss": loss,
            "build_s": build_s, "single_window_s": single_window_s,
            "energy": windows[0].to_dict() if windows and windows[0] is not None else None}
    if cfg.recipe.compile_mode is not None:
        from autotune.trial.instruments import compiled_graphs

        mine["compiled_graphs"] = compiled_graphs()
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, mine)
    return ranks, run


def combine_energy(windows: list[dict[str, Any] | None], *, samples: int) -> dict[str, Any] | None:
    """The DDP group's NVML figures from each rank's window over the same timed steps: energy summed
    over the GPUs, so joules per sample is the group's (all GPUs' energy / all GPUs' samples); power,
    clocks and utilization are per GPU (means; ``per_gpu_avg_power_w`` lists each); peaks, the
    temperature and each throttle reason's share are the worst GPU's. None unless every rank
    measured a window (NVML missing on one GPU would understate the group's energy)."""
    if not windows or any(w is None for w in windows):
        return None

    def values(key: str) -> list[Any]:
        return [w[key] for w in windows if w.get(key) is not None]

    def mean(key: str) -> float | None:
        got = values(key)
        return statistics.fmean(got) if got else None

    def worst(key: str, pick=max) -> Any:
        got = values(key)
        return pick(got) if got else None

    energies = [w.get("energy_j") for w in windows]
    energy_j = sum(energies) if all(e is not None for e in energies) else None
    reasons = sorted({k for w in windows for k in (w.get("throttle") or {})})
    return {
        "duration_s": worst("duration_s"),
        "energy_j": energy_j,
        "energy_source": windows[0].get("energy_source"),
        "avg_power_w": mean("avg_power_w"),
        "peak_power_w": worst("peak_power_w"),
        "avg_sm_clock_mhz": mean("avg_sm_clock_mhz"),
        "min_sm_clock_mhz": worst("min_sm_clock_mhz", min),
        "avg_mem_clock_mhz": mean("avg_mem_clock_mhz"),
        "max_temperature_c": worst("max_temperature_c"),
        "avg_gpu_util_pct": mean("avg_gpu_util_pct"),
        "avg_mem_util_pct": mean("avg_mem_util_pct"),
        "peak_memory_used_bytes": worst("peak_memory_used_bytes"),
        "num_samples": sum(w.get("num_samples") or 0 for w in windows),
        "throttle": {k: max((w.get("throttle") or {}).get(k, 0.0) for w in windows) for k in reasons},
        "throttled": any(w.get("throttled") for w in windows),
        "unsupported": {k: v for w in windows for k, v in (w.get("unsupported") or {}).items()},
        "joules_per_sample": energy_j / samples if energy_j is not None and samples > 0 else None,
        "num_gpus": len(windows),
        "per_gpu_avg_power_w": [w.get("avg_power_w") for w in windows],
    }


def _combine(ranks: list[dict[str, Any]], singles: list[dict[str, Any]], batch: int, world: int) -> dict[str, Any]:
    """The trial's figures from every rank's: the slowest rank's DDP step paces the group."""
    slowest = max(ranks, key=lambda r: r["measurement"]["step_time_ms"])
    figures = dict(slowest["measurement"])
    for key in ranks[0]["memory"]:  # the largest rank's: what each GPU must hold
        figures[key] = max(r["memory"][key] for r in ranks)
    per_gpu = batch * 1e3 / figures["step_time_ms"]
    single_rates = [batch * 1e3 / s["step_time_ms"] for s in singles]
    single = statistics.fmean(single_rates)
    losses = [r["final_loss"] for r in ranks]
    figures.update(
        samples_per_s=per_gpu * world,
        per_gpu_samples_per_s=per_gpu,
        single_gpu_samples_per_s=single,
        single_gpu_step_time_ms=statistics.fmean(s["step_time_ms"] for s in singles),
        scaling_efficiency=per_gpu / single,
        ddp_world_size=world,
        rank_step_time_ms=[r["measurement"]["step_time_ms"] for r in ranks],
        batch_size=batch,
        global_batch_size=batch * world,
        final_loss=losses[0],
        loss_finite=all(math.isfinite(x) for x in losses),
        build_s=max(r["build_s"] for r in ranks),
        # the single-GPU window (and its compile) is the search's cost, like warm-up
        warmup_s=figures["warmup_s"] + max(r["single_window_s"] for r in ranks),
        single_gpu_compile_s=max(s["compile_s"] for s in singles),
    )
    if "compiled_graphs" in ranks[0]:
        figures["compiled_graphs"] = ranks[0]["compiled_graphs"]
    return figures


def main(argv: list[str]) -> int:
    result_path, request_path = argv[1], argv[3]
    from autotune.trial.memory_fit import is_out_of_memory

    try:
        request = json.loads(Path(request_path).read_text())
        result = run_rank(request)
    except Exception as exc:  # reported to the study through the launcher, which records it
        if is_out_of_memory(exc):
            result = {"status": "oom", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        else:
            result = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
    result["ready_at"] = READY_AT
    result["done_at"] = time.time()
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, default=str)
    os.replace(tmp, result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: after a peer failed, the group's destructors could block on it
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
