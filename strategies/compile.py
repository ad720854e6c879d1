"""compile: torch.compile the model (TorchDynamo + TorchInductor), in one of its modes, or not.

Compiling fuses the pointwise work around convolutions and matmuls (BatchNorm, activations,
residual adds, their backward) into generated kernels, for the forward and the backward pass.
It costs time once, in the first step(s): the trial records that apart as ``compile_s`` (and the
report shows it), since a user training for ten minutes may not want a five-minute compile.

* "default": a balance of compile time and speed.
* "max-autotune-no-cudagraphs": also benchmarks several kernel candidates per matmul/convolution
  at compile time and keeps the fastest (minutes of compiling for a ResNet-50).
* "reduce-overhead": "default" plus CUDA graphs (cudagraph trees) around the compiled forward and
  backward, which removes their launch overhead; more memory. CUDA only.
* "max-autotune": both of the above. CUDA only.
* "regional": each of the model's repeated blocks (transformer layers, ResNet bottlenecks: the
  blocks ``strategies.activation_checkpointing.find_blocks`` finds) compiled in default mode in
  place of the whole model, as PyTorch's regional-compilation recipe does
  (docs.pytorch.org/tutorials/recipes/regional_compilation.html): the blocks share one compiled
  graph, so the first step compiles one block instead of the model, and what lies between them
  (embeddings, the head, the stem) stays eager. Dynamo's recompile limit (8) is raised to the
  number of blocks, so a model whose blocks differ in a constant (a layer index it branches on)
  recompiles per block instead of running the rest eagerly, which a held-out 24-layer LM did
  (0.73x). Offered on a GPU where the probe found repeated blocks; whether it pays (a shorter
  compile, a slower step) is measured.

The two modes that already use CUDA graphs are never combined with the ``cuda_graphs`` knob
(whole-step capture): one graph layer is enough, and nesting them is not supported.

The model is compiled in place (``nn.Module.compile``), so its parameters, its class and its
state_dict keys stay what they were (checkpoints load either way). Offered only where the probe
compiled a small function on the device (Inductor needs Triton on a GPU and a working C++
compiler on a CPU); on a CPU only when asked for (``SearchConfig.compile``), since compiling even
a tiny model there takes tens of seconds per trial.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy

MODES = ("off", "default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune", "regional")
CUDAGRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})
"""Modes in which Inductor wraps the compiled graphs in CUDA graphs itself."""

COMPILE_ALLOWANCE_S = {"off": 0.0, "default": 300.0, "reduce-overhead": 300.0, "regional": 300.0,
                       "max-autotune-no-cudagraphs": 1200.0, "max-autotune": 1200.0}
"""Seconds a trial's timeout is extended by for compiling: a hung trial is still caught by the
timeout, while a ResNet-50 max-autotune compile (several minutes of kernel benchmarks) is not."""


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
MODE_PARAM = "compile.mode"


class Compile(Strategy):
    name = "compile"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        mode: str = "off"
        """off (eager) | default | max-autotune-no-cudagraphs | reduce-overhead | max-autotune | regional."""

        def __post_init__(self) -> None:
            if self.mode not in MODES:
                raise ValueError(f"compile.mode {self.mode!r}: choose from {', '.join(MODES)}")

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        if not wanted(options, device):
            return {"compile_modes": ["off"]}
        check = probe.get("compile") or {"works": False, "reason": "the probe did not check it"}
        if not check.get("works"):
            warnings.warn(f"torch.compile is not searched: it does not work on this {device} "
                          f"({check.get('reason')}); the search goes on without it", stacklevel=4)
            return {"compile_modes": ["off"]}
        return {"compile_modes": candidates(device, blocks=int(probe.get("checkpoint_blocks") or 0))}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        return {MODE_PARAM: "off"}  # eager; the known-good ones that compile say so

    def words(self, values: Mapping[str, Any]) -> str:
        return f"compile {values['mode']}" if values.get("mode", "off") != "off" else ""

    def report_knobs(self) -> list[ReportKnob]:
        return []  # named in each configuration's description

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(mode=self.choose(trial, "mode", space.compile_modes))

    def apply(self, config: Config, recipe: Recipe) -> None:
        recipe.compile_mode = None if config.mode == "off" else config.mode


def wanted(options, device: str) -> bool:
    """Whether to search torch.compile: on a GPU unless refused, on a CPU only when asked for."""
    return options.compile if options.compile is not None else device == "cuda"


def candidates(device: str, blocks: int = 0) -> list[str]:
    """The modes worth measuring on ``device``, "off" first; "regional" for a model with ``blocks``
    repeated blocks (two or more) on a GPU."""
    if device == "cuda":
        return [m for m in MODES if m != "regional" or blocks >= 2]
    # the CUDA-graph modes do nothing on a CPU, and max-autotune's CPU GEMM templates multiply a
    # compile that already takes tens of seconds
    return ["off", "default"]


def check_compile(device: str) -> dict[str, Any]:
    """Compile and run a small function with Inductor on ``device``: {"works", "reason", "seconds"}.

    What fails here (no Triton for the GPU, no C++ compiler for the CPU) would fail every compile
    trial, so the search does not offer compiling at all.
    """
    started = time.perf_counter()
    if device == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # a torch too old to tell: let the real compile below decide
            has_triton = None
        if has_triton is not None and not has_triton():
            return {"works": False, "reason": "Triton is not installed or does not support this GPU "
                                              "(Inductor generates Triton kernels on CUDA)", "seconds": 0.0}
    try:
        fn = torch.compile(lambda x: torch.relu(x * 2.0 + 1.0).sum(), backend="inductor")
        x = torch.arange(16, dtype=torch.float32, device=device)
        value = float(fn(x))
        expected = float(torch.relu(x * 2.0 + 1.0).sum())
        if abs(value - expected) > 1e-3 * abs(expected):
            return {"works": False, "reason": f"a compiled test function returned {value}, not {expected}",
                    "seconds": time.perf_counter() - started}
    except Exception as exc:  # any failure means: do not offer compile on this machine
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        return {"works": False, "reason": f"{type(exc).__name__}: {first}", "seconds": time.perf_counter() - started}
    finally:
        torch._dynamo.reset()
    return {"works": True, "reason": "", "seconds": time.perf_counter() - started}


def compile_regions(model: torch.nn.Module) -> int:
    """Compile ``model``'s repeated blocks in place (default mode), raising Dynamo's recompile limit
    to their number; the whole model where it has none (with a warning: the configuration was
    measured on a model that had them). Returns how many modules were compiled."""
    from strategies.activation_checkpointing import find_blocks

    blocks = find_blocks(model)
    if len(blocks) < 2:
        warnings.warn("compile 'regional' found no repeated blocks in this model: the whole model is compiled",
                      stacklevel=3)
        model.compile()
        return 1
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), len(blocks)))
    for block in blocks:
        block.compile()
    return len(blocks)
