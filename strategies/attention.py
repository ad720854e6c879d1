"""attention: which kernel runs ``torch.nn.functional.scaled_dot_product_attention`` (SDPA).

PyTorch picks an SDPA backend per call from the inputs (FlashAttention, memory-efficient, cuDNN,
or the plain math of matmul and softmax); the pick is a heuristic, and on a given GPU, dtype and
head size another backend may be faster. ``torch.nn.attention.sdpa_kernel(backend)`` restricts
the choice to one backend for the forward and backward passes run inside it. A backend that
cannot run the model's attention raises in the trial, which records it as a failed trial with
the reason; the study goes on, and does not run that backend again with attention in the same dtype.
What is known to fail beforehand (FlashAttention or cuDNN given FP32 attention on a GPU) is not
run at all (:func:`cannot_run`).

Offered only for models that call SDPA (the probe counts the calls of one forward pass).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from autotune.recipe import Recipe
from autotune.space import SearchSpace
from strategies.base import ReportKnob, Strategy

BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
"""The backends a configuration may pin, by name; "default" pins none (PyTorch chooses)."""

CUDA_BACKENDS = ["default", "flash", "efficient", "cudnn", "math"]
CUDNN_MIN_CAPABILITY = (9, 0)
"""cuDNN's SDPA kernels (PyTorch's CUDNN_ATTENTION) run on Hopper and newer."""

WORDS = {"flash": "flash attention", "efficient": "memory-efficient attention", "cudnn": "cuDNN attention",
         "math": "math attention"}


HALF_ONLY = frozenset({"flash", "cudnn"})
"""Backends whose CUDA kernels take fp16 and bf16 inputs only (PyTorch's SDPA dispatch checks the
dtype before anything else); the CPU's flash kernel runs FP32 too."""


class BackendFailed(RuntimeError):
    """A pinned SDPA backend could not run the model's attention."""


def attention_dtype(knobs: Mapping[str, Mapping[str, Any]]) -> str:
    """What a configuration (knobs as dicts) computes attention in: "fp32" for fp32 and tf32, and
    where fp32_layers keeps attention in FP32; else its autocast dtype ("bf16" for fp8, whose
    float8 is the Linear layers')."""
    mode = (knobs.get("precision") or {}).get("mode", "fp32")
    kept = str((knobs.get("fp32_layers") or {}).get("layers", "none")).split("+")
    if mode in ("fp32", "tf32") or "attention" in kept:
        return "fp32"
    return "bf16" if mode == "fp8" else mode


def cannot_run(knobs: Mapping[str, Mapping[str, Any]], device: str) -> str | None:
    """Why a configuration's pinned backend cannot run its attention, known before it runs (a
    half-precision-only backend given FP32 attention on a GPU), or None: run, each such trial costs a
    worker start and a model build."""
    backend = (knobs.get("attention") or {}).get("backend", "default")
    if device == "cuda" and backend in HALF_ONLY and attention_dtype(knobs) == "fp32":
        return (f"not run: {WORDS[backend]} takes only fp16 and bf16 inputs on a GPU, and this configuration "
                "computes attention in FP32")
    return None


@dataclass(frozen=True)
class PinnedBackend:
    """A recipe's step context (``Recipe.step_contexts``): SDPA restricted to ``backend``. A value,
    so two recipes built from the same configuration compare equal."""

    backend: str

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        return pinned(self.backend)


@contextlib.contextmanager
def pinned(backend: str) -> Iterator[None]:
    """SDPA runs only on ``backend`` inside the block (forward and backward); a call it cannot run
    raises :class:`BackendFailed`, which names the backend and the way out."""
    with sdpa_kernel(BACKENDS[backend]):
        try:
            yield
        except RuntimeError as exc:
            # PyTorch says only "No available kernel" (its warnings say why, once per process)
            text = str(exc).lower()
            if isinstance(exc, torch.OutOfMemoryError) or ("no available kernel" not in text
                                                          and "no viable backend" not in text):
                raise
            raise BackendFailed(
                f"the {backend} attention backend cannot run this model's scaled_dot_product_attention here "
                f"({str(exc).splitlines()[0][:200]}): it needs other dtypes, head sizes, masks or another GPU; "
                "a configuration with attention.backend 'default' lets PyTorch choose") from exc


def runs_here(backend: str, device: str, head_dim: int = 16) -> bool:
    """Whether a tiny causal SDPA (forward and backward, FP32) runs on ``device`` with ``backend``."""
    q = torch.randn(1, 2, 8, head_dim, device=device, requires_grad=True)
    try:
        with pinned(backend):
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except BackendFailed:
        return False
    return True


@functools.lru_cache(maxsize=None)
def cpu_backends(head_dim: int = 16) -> tuple[str, ...]:
    """The choices on a CPU: "default" and those of "math" and "flash" (PyTorch's CPU flash
    kernel) that run here; the memory-efficient and cuDNN kernels are CUDA-only."""
    return ("default",) + tuple(b for b in ("math", "flash") if runs_here(b, "cpu", head_dim))


_ORIGINAL_SDPA = F.scaled_dot_product_attention


class _CountSDPA(TorchFunctionMode):
    """Counts SDPA calls the model makes directly (also through a name imported from
    torch.nn.functional): a torch function mode sees every top-level torch call."""

    def __init__(self, found: dict[str, Any]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ORIGINAL_SDPA and not self.found["inside"]:
            _note(self.found, args, kwargs)
        return func(*args, **kwargs)


def _note(found: dict[str, Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    query = args[0] if args else kwargs.get("query")
    found["calls"] += 1
    if isinstance(query, torch.Tensor) and query.dim() >= 1:
        found["head_dim"] = int(query.shape[-1])


def sdpa_calls(model: nn.Module, inputs: Any) -> dict[str, Any]:
    """``{"sdpa_calls": N, "sdpa_head_dim": D or None}`` from one forward pass of ``model`` on
    ``inputs`` (without gradients). Calls inside torch's own Python functions (nn.MultiheadAttention,
    nn.TransformerEncoderLayer) are nested below the mode's view, so torch.nn.functional's
    attribute is wrapped for the pass as well; a forward that fails here (a model that only runs
    on its GPU, say) counts nothing and says why."""
    found: dict[str, Any] = {"calls": 0, "head_dim": None, "inside": 0}

    def counted(*args: Any, **kwargs: Any) -> Any:
        _note(found, args, kwargs)
        found["inside"] += 1  # the mode must not count this call again
        try:
            return _ORIGINAL_SDPA(*args, **kwargs)
        finally:
            found["inside"] -= 1

    F.scaled_dot_product_attention = counted
    try:
        with torch.no_grad(), _CountSDPA(found):
            short = _shortened(inputs)
            if short is not None:
                try:
                    model(short)
                except Exception:  # a model that needs its whole sequence: counted on it below
                    found.update(calls=0, head_dim=None, inside=0)
                    short = None
            if short is None:
                model(inputs)
    except Exception as exc:  # the user's model, not ours: the search goes on without the knob
        return {"sdpa_calls": 0, "sdpa_head_dim": None,
                "sdpa_probe_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    finally:
        F.scaled_dot_product_attention = _ORIGINAL_SDPA
    return {"sdpa_calls": found["calls"], "sdpa_head_dim": found["head_dim"]}


SHORT_SEQUENCE = 32
"""Tokens the probe's forward of a language model reads: how many SDPA calls a forward makes and
their head size do not depend on the sequence's length, and GPT-2's forward over 2 x 1,024 tokens
took 8.7 s on 2 cores, 0.19 s over 1 x 32."""


def _shortened(inputs: Any) -> torch.Tensor | None:
    """One sequence of a token batch (integer, batch x length), cut to SHORT_SEQUENCE; None for
    other inputs, which the probe passes whole."""
    if (isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and not inputs.is_floating_point()
            and inputs.shape[1] > SHORT_SEQUENCE):
        return inputs[:1, :SHORT_SEQUENCE]
    return None


def _capability(probe: Mapping[str, Any]) -> tuple[int, ...] | None:
    text = (probe.get("provenance") or {}).get("compute_capability")
    try:
        return tuple(int(p) for p in str(text).split("."))
    except ValueError:
        return None


# its Optuna parameter, named here once (Strategy.param): the engine names it by this
BACKEND_PARAM = "attention.backend"


class Attention(Strategy):
    """Pin the SDPA backend of every training step (see :func:`pinned`)."""

    name = "attention"
    label = "attention backend"

    @dataclass(kw_only=True, frozen=True)
    class Config:
        backend: str = "default"
        """"default" (PyTorch chooses per call), "flash", "efficient", "cudnn" or "math"."""

        def __post_init__(self) -> None:
            if self.backend != "default" and self.backend not in BACKENDS:
                raise ValueError(f"unknown attention backend {self.backend!r}; choose among default, "
                                 f"{', '.join(BACKENDS)}")

    def applies(self, space: SearchSpace) -> bool:
        return len(space.choices.get(self.name, [])) > 1

    def offer(self, options, device: str, probe: Mapping[str, Any], offered: Mapping[str, Any]) -> dict[str, Any]:
        if not probe.get("sdpa_calls"):
            return {}
        if device != "cuda":
            return {"choices": {self.name: list(cpu_backends(probe.get("sdpa_head_dim") or 16))}}
        capability = _capability(probe)
        # unknown capability: cudnn is offered, and a trial it cannot run is recorded as failed
        too_old = capability is not None and capability < CUDNN_MIN_CAPABILITY
        return {"choices": {self.name: [b for b in CUDA_BACKENDS if not (b == "cudnn" and too_old)]}}

    def seed(self, space: SearchSpace, *, tuned: bool, chosen: Mapping[str, Any]) -> dict[str, Any]:
        # PyTorch's own choice is the known-good one; pinning is for the search to find
        return {self.param("backend"): "default"} if self.applies(space) else {}

    def words(self, values: Mapping[str, Any]) -> str:
        return WORDS.get(values.get("backend", "default"), "")

    def report_knobs(self) -> list[ReportKnob]:
        return [ReportKnob("attention", "attention backend", self.name, "backend", "default")]

    def suggest(self, trial, space: SearchSpace, chosen: Mapping[str, Any]) -> Config:
        return self.Config(backend=self.choose(trial, "backend", space.choices[self.name]))

    def apply(self, config: Config, recipe: Recipe) -> None:
        if config.backend != "default":
            recipe.step_contexts.append(PinnedBackend(config.backend))
