"""The DataLoader-fed measurement of a trial with --data: the same step timed fed from memory,
then fed by the loader the dataloader knob configures, and the loader's figures."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Iterator

from autotune.deploy.config import TunedConfig
from autotune.trial.batches import NUM_HOST_BATCHES
from autotune.trial.measure import MeasureSettings, is_data_bound, measure


class LoaderFeed:
    """With ``--data``: the trial's steps fed from a DataLoader over the training split, built
    with the dataloader knob's settings (``TunedConfig.dataloader_kwargs``, as user code builds
    it), its batches copied to the device by the streams knob (``TunedConfig.loader``).

    Whether the loader keeps up is measured, not assumed: the same step is first timed fed from
    memory (the loader's first batches, cycled: "compute-only"), then fed by the loader, and each
    step's wait for its next batch is logged. Workers are started after the compute-only window,
    so no batches pile up ahead of the timed window, and their first batches fall in the warm-up.
    """

    def __init__(self, spec: str, workload, cfg: TunedConfig, seed: int) -> None:
        from autotune.workload.data import load_data
        from strategies.dataloader import endless_loader

        datasets = load_data(spec, input_shape=tuple(workload.input_shape), num_classes=workload.num_classes,
                             train_size=1024, held_out_size=256, seed=seed)
        self.cfg = cfg
        self.kwargs = cfg.dataloader_kwargs()
        self.loader = endless_loader(datasets.train, cfg.batch_size, self.kwargs, seed=seed)
        self.iterator: Iterator[Any] | None = None
        self.log: list[tuple[float, float]] = []
        """(time the batch arrived, seconds next() waited for it), one entry per fed step."""

    def first_batches(self) -> list[Any]:
        """NUM_HOST_BATCHES batches as the loader makes them (pinned when it pins); its workers
        are shut down again before anything is timed."""
        iterator = iter(self.loader)
        try:
            return [next(iterator) for _ in range(NUM_HOST_BATCHES)]
        finally:
            del iterator

    def _batches(self) -> Iterator[Any]:
        assert self.iterator is not None
        while True:
            start = time.perf_counter()
            batch = next(self.iterator)
            now = time.perf_counter()
            self.log.append((now, now - start))
            yield batch

    def measure(self, compute_step, step, last_loss: list, settings: MeasureSettings, nvml_window):
        """Time the step fed from memory (a short window; compiling and warm-up happen here), then
        fed by the loader (its timed window under NVML); returns the loader-fed Measurement, the
        loader-fed step (for the profile window) and the loader figures."""
        device, batch = self.cfg.device, self.cfg.batch_size
        compute_wall: list[tuple[float, float]] = []
        compute = measure(compute_step, device,
                          dataclasses.replace(settings, min_time_s=min(settings.min_time_s, 1.0), max_remeasure=0),
                          setup_steps=step.num_setup_steps, timed_window=lambda: _wall(compute_wall))
        compute_rate = compute.num_timed_steps_total * batch / max(compute_wall[0][1] - compute_wall[0][0], 1e-9)

        self.iterator = iter(self.loader)  # the workers start now, before the warm-up
        fed_stream = iter(self.cfg.loader(self._batches()))

        def fed_step() -> None:
            x, y = next(fed_stream)
            last_loss[:] = [step(x, y)]

        fed_wall: list[tuple[float, float]] = []

        @contextlib.contextmanager
        def timed() -> Iterator[None]:
            with (nvml_window() if nvml_window is not None else contextlib.nullcontext()), _wall(fed_wall):
                yield

        workers = self.kwargs.get("num_workers", 0)
        # a loader-fed step time varies by design (workers deliver in waves): one window, long
        # enough for two waves, and the rate is taken over it rather than from the median step.
        # Its warm-up only has to let the workers deliver their first wave (the compile, cudnn's
        # autotuning and the steady state were reached in the compute-only window): waiting for
        # two windows to agree would wait out max_warmup_s (60 s on a GPU) on waves that never do
        fed_settings = dataclasses.replace(settings, max_remeasure=0, max_warmup_s=0.0,
                                           min_warmup_steps=max(settings.min_warmup_steps, 2 * workers + 1),
                                           min_steps=max(settings.min_steps, 2 * workers + 1))
        m = measure(fed_step, device, fed_settings, timed_window=timed)
        begin, end = fed_wall[0]
        fed_rate, wait_s = self._rate(begin, end, batch, threshold_s=max(1e-3, 0.05 * compute.step_time_ms / 1e3))
        m = dataclasses.replace(m, compile_s=compute.compile_s, num_setup_steps=compute.num_setup_steps,
                                warmup_s=compute.warmup_s + compute.measure_s + m.warmup_s)
        wait_share = min(1.0, wait_s / max(end - begin, 1e-9))
        figures = {
            "samples_per_s": fed_rate,
            "loader_fed_samples_per_s": fed_rate,
            "compute_only_samples_per_s": compute_rate,
            "compute_only_step_time_ms": compute.step_time_ms,
            "loader_wait_share": wait_share,
            "data_bound": is_data_bound(fed_rate, compute_rate, wait_share),
        }
        return m, fed_step, figures

    def _rate(self, begin: float, end: float, batch: int, *, threshold_s: float) -> tuple[float, float]:
        """Samples per second the loader-fed steps ran at between ``begin`` and ``end``, and the
        seconds they waited for batches there.

        Where steps waited for their batch (``threshold_s`` or more) at least twice, the rate is
        taken between the first and the last wait: the loader's queue is empty at both ends, so
        a wave of batches that workers finished together is neither counted without its wait
        nor cut in half by the window. Otherwise the loader was never behind, and the whole
        window counts."""
        inside = [(t, w) for t, w in self.log if begin <= t <= end]
        waited = sum(w for _, w in inside)
        waits = [i for i, (_, w) in enumerate(inside) if w >= threshold_s]
        if len(waits) >= 2:
            first, last = waits[0], waits[-1]
            return (last - first) * batch / max(inside[last][0] - inside[first][0], 1e-9), waited
        return len(inside) * batch / max(end - begin, 1e-9), waited

    def close(self) -> None:
        """Shut the loader's workers down (deleting its iterator does)."""
        self.iterator = None


@contextlib.contextmanager
def _wall(into: list[tuple[float, float]]) -> Iterator[None]:
    """Record the (start, end) wall-clock times of a timed window; measure() synchronizes the
    GPU before and at the end of it, so the time is the device's too."""
    start = time.perf_counter()
    try:
        yield
    finally:
        into.append((start, time.perf_counter()))
