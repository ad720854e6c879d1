"""streams: CUDA streams of the input pipeline.

With 1 stream the next batch's host-to-device copy runs on the compute stream, in series with
the step. With 2, the copy of batch i+1 (and its memory-format conversion) is issued on a side
stream while batch i computes, and the compute stream waits for it only when it needs it.
Whether that overlap pays depends on how long the copy is next to the step: it is measured per
trial, not assumed. Copies overlap compute only from pinned host memory (DataLoader(pin_memory=True)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
NUM_STREAMS_PARAM = "streams.num_streams"


class Streams(Strategy):
    name = "streams"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        num_streams: int = 1
        """1: copies on the compute stream; 2: the next batch is copied on a side stream."""

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        # inputs made on the device have no copy to overlap
        return {"stream_counts": [1, 2] if device == "cuda" and not options.input_on_device else [1]}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        return {NUM_STREAMS_PARAM: max(space.stream_counts) if tuned else 1}

    def words(self, values: Mapping[str, Any]) -> str:
        return f"{values['num_streams']} streams" if values.get("num_streams", 1) > 1 else ""

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("streams", "CUDA streams", self.name, "num_streams", 1)]

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(num_streams=self.choose(trial, "num_streams", space.stream_counts))

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.num_streams = config.num_streams


def to_device(batch: Any, device: torch.device | str,
              memory_format: torch.memory_format = torch.contiguous_format) -> Any:
    """``batch`` (a tensor, or tensors in lists, tuples and dicts) on ``device``, a 4-D tensor in
    ``memory_format``."""
    if isinstance(batch, torch.Tensor):
        out = batch.to(device, non_blocking=True)
        if out.dim() == 4 and memory_format is not torch.contiguous_format:
            out = out.contiguous(memory_format=memory_format)
        return out
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, memory_format) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, memory_format) for k, v in batch.items()}
    return batch


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    # the caching allocator must not reuse a tensor made on the side stream while the compute
    # stream still reads it
    if isinstance(batch, torch.Tensor):
        if batch.is_cuda:
            batch.record_stream(stream)
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            _record_stream(b, stream)
    elif isinstance(batch, dict):
        for b in batch.values():
            _record_stream(b, stream)


def device_batches(batches: Iterable[Any], device: str | torch.device, *, num_streams: int = 1,
                   memory_format: torch.memory_format = torch.contiguous_format) -> Iterator[Any]:
    """Yield each batch (a tensor, or a tuple/list/dict of them) on ``device``, in ``memory_format``.

    With ``num_streams == 2`` on CUDA, the next batch is copied on a side stream while the
    caller computes on the current one.
    """
    device = torch.device(device)
    if device.type != "cuda" or num_streams < 2:
        for batch in batches:
            yield to_device(batch, device, memory_format)
        return
    side = torch.cuda.Stream(device=device)
    iterator = iter(batches)

    def load(batch: Any) -> Any:
        with torch.cuda.stream(side):
            return to_device(batch, device, memory_format)

    try:
        ahead = load(next(iterator))
    except StopIteration:
        return
    for batch in iterator:
        current = torch.cuda.current_stream(device)
        current.wait_stream(side)
        _record_stream(ahead, current)
        ready, ahead = ahead, load(batch)
        yield ready
    current = torch.cuda.current_stream(device)
    current.wait_stream(side)
    _record_stream(ahead, current)
    yield ahead
