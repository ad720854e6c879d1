"""cuda_graphs: capture the whole training step (forward, backward, optimizer step) in one CUDA graph.

After a few warm-up steps on a side stream, one step is captured with ``torch.cuda.graph`` from
static input buffers; every later step copies its batch into those buffers and replays the
graph: one launch instead of thousands, so the GPU never waits for Python (PyTorch's CUDA graphs
notes, "whole network capture"). Memory for the step's temporaries comes from the graph's own
pool and stays reserved.

Offered only where capturing the step is legal and means something:

* on CUDA, with fixed shapes (the worker's batches are; in user code, a DataLoader with
  ``drop_last=True``: the step refuses a batch of another shape instead of replaying wrong work);
* not with compile modes "reduce-overhead" or "max-autotune": those wrap the compiled graphs in
  CUDA graphs already, and two graph layers do not nest;
* with fp16 only when the optimizer is "fused": GradScaler's ordinary ``step`` reads the inf check
  on the host (``.item()``), which is illegal during capture; a fused optimizer takes the scale and
  the inf flag as device tensors (``_step_supports_amp_scaling``), so the scaled step never syncs
  and skipped steps are skipped on the device at replay;
* with an optimizer whose step keeps no host-side state: SGD as it is, Adam/AdamW and the others
  rebuilt with ``capturable=True`` (``TunedConfig.prepare`` does it; LBFGS and optimizers without
  that option are refused with a message); not with 8-bit optimizer states, whose step count
  torchao keeps on the host (``strategies.optimizer_state``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy
from strategies.compile import CUDAGRAPH_MODES


def legal(space: SearchSpace, chosen: Mapping[str, Any]) -> bool:
    """Whether capturing the whole step is allowed with the knobs chosen before this one."""
    if space.device != "cuda":
        return False
    loss = chosen.get("loss_kernel")
    if loss is not None and loss.kernel != "framework":
        return False  # liger's fused loss reads a count with .item() every step (strategies.loss_kernel)
    compile_config = chosen.get("compile")
    if compile_config is not None and compile_config.mode in CUDAGRAPH_MODES:
        return False
    state = chosen.get("optimizer_state")
    if state is not None and state.state != "full":
        return False  # torchao's 8-bit Adam counts its steps on the host (strategies.optimizer_state)
    precision = chosen.get("precision")
    optimizer = chosen.get("optimizer")
    if precision is not None and precision.mode == "fp16":
        return optimizer is not None and optimizer.implementation == "fused"
    return True


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
ENABLED_PARAM = "cuda_graphs.enabled"


class CudaGraphs(Strategy):
    name = "cuda_graphs"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        enabled: bool = False
        """Capture the whole step in one CUDA graph and replay it."""

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        # not under DDP: its all-reduces run from autograd hooks on NCCL's own stream, outside a
        # whole-step capture (the compile modes with CUDA graphs graph only the compiled pieces)
        # nor with accumulation: a graph replays one optimizer step, not k micro-steps and one step
        return {"cuda_graphs": [False, True] if device == "cuda" and not options.ddp
                and not options.global_batch_size else [False]}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        return {ENABLED_PARAM: False}

    def words(self, values: Mapping[str, Any]) -> str:
        return "CUDA graphs" if values.get("enabled") else ""

    def report_knobs(self) -> list[ReportKnob]:
        return []  # named in each configuration's description

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        if not legal(space, chosen):
            return self.Config()
        return self.Config(enabled=self.choose(trial, "enabled", space.cuda_graphs))

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.cuda_graphs = config.enabled and recipe.device == "cuda"
