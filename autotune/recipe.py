"""The training recipe: what the strategies decide, in one object the runtime executes.

Strategies never touch a model or a global switch directly while they are sampled; they write
into a :class:`Recipe`. The runtime (``autotune.deploy.runtime``) turns a recipe into a prepared model,
an autocast context, a GradScaler and an input pipeline. The study's worker and a user's
training code (``autotune.load(...)``) both go through it, so what is exported is what was measured.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

# Process-global switches a recipe may set. Each entry: (getter, setter). They are applied only
# inside `backend_flags(...)`, which restores the previous values on exit, so one trial's flags
# never leak into code that runs after it.


def _matmul_get():
    m = torch.backends.cuda.matmul
    return m.fp32_precision if hasattr(m, "fp32_precision") else ("tf32" if m.allow_tf32 else "ieee")


def _matmul_set(value: str) -> None:
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        # The legacy query, torch.get_float32_matmul_precision() (Lightning's CUDA accelerator calls it),
        # raises when CUDA's matmul is "tf32" and the legacy setting still says "highest": set both, and
        # keep the CPU's oneDNN matmul, which torch.set_float32_matmul_precision also sets, as it was.
        mkldnn = torch.backends.mkldnn.matmul
        kept = mkldnn.fp32_precision
        torch.set_float32_matmul_precision("high" if value == "tf32" else "highest")
        mkldnn.fp32_precision = kept
        m.fp32_precision = value
    else:  # torch < 2.9
        m.allow_tf32 = value == "tf32"


def _conv_get():
    c = torch.backends.cudnn
    if hasattr(c, "conv") and hasattr(c.conv, "fp32_precision"):
        return c.conv.fp32_precision
    return "tf32" if c.allow_tf32 else "ieee"


def _conv_set(value: str) -> None:
    c = torch.backends.cudnn
    if hasattr(c, "conv") and hasattr(c.conv, "fp32_precision"):
        c.conv.fp32_precision = value
    else:  # torch < 2.9
        c.allow_tf32 = value == "tf32"


def _cudnn_benchmark_set(value: bool) -> None:
    torch.backends.cudnn.benchmark = bool(value)


BACKEND_FLAGS: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    # "ieee" is true FP32; "tf32" lets cuBLAS/cuDNN use TF32 Tensor Cores for float32 math.
    "matmul_fp32_precision": (_matmul_get, _matmul_set),
    "conv_fp32_precision": (_conv_get, _conv_set),
    "cudnn_benchmark": (lambda: torch.backends.cudnn.benchmark, _cudnn_benchmark_set),
    "num_threads": (torch.get_num_threads, torch.set_num_threads),
}


@contextlib.contextmanager
def backend_flags(flags: dict[str, Any]) -> Iterator[None]:
    """Set process-global backend switches for the duration of the block, then restore them."""
    unknown = set(flags) - set(BACKEND_FLAGS)
    if unknown:
        raise KeyError(f"unknown backend flags {sorted(unknown)}; known: {sorted(BACKEND_FLAGS)}")
    saved = {name: BACKEND_FLAGS[name][0]() for name in flags}
    try:
        apply_backend_flags(flags)
        yield
    finally:
        apply_backend_flags(saved)


def apply_backend_flags(flags: dict[str, Any]) -> None:
    """Set process-global backend switches for good (what a user's training process wants)."""
    for name, value in flags.items():
        BACKEND_FLAGS[name][1](value)


@dataclass(kw_only=True)
class Recipe:
    """Everything needed to run one training step the way a configuration says."""

    device: str
    """"cuda" or "cpu"."""
    batch_size: int = 32
    """Samples per forward and backward pass (the micro-batch, with accumulation)."""
    accumulation_steps: int = 1
    """Micro-batches whose gradients add up to one optimizer step (--global-batch-size)."""
    base_batch_size: int | None = None
    """The batch size the user trains with today (for learning-rate scaling advice)."""
    autocast_dtype: torch.dtype | None = None
    """Autocast compute dtype; None runs without autocast."""
    grad_scaler: dict[str, Any] | None = None
    """GradScaler keyword arguments; None means no loss scaling (the scaler is disabled)."""
    memory_format: torch.memory_format = torch.contiguous_format
    """Memory format of the model's parameters and of 4-D inputs."""
    model_transforms: list[Callable[[torch.nn.Module], torch.nn.Module]] = field(default_factory=list)
    """Applied to the model in order, before it is moved to the device."""
    loss_kernel: str = "framework"
    """What computes the step's loss: "framework" (the user's loss on the model's logits) or
    "fused_linear" (a fused linear cross-entropy from the LM head's input: strategies.loss_kernel)."""
    llm_kernels: str = "framework"
    """"liger": a transformers LLM's layers run liger-kernel's Triton kernels (strategies.llm_kernels,
    applied by a model transform), which compile in the first step that calls them."""
    backend_flags: dict[str, Any] = field(default_factory=dict)
    """Process-global switches (see BACKEND_FLAGS)."""
    step_contexts: list[Callable[[], contextlib.AbstractContextManager[Any]]] = field(default_factory=list)
    """Each makes a context entered around every step's forward and backward (the attention
    backend's ``sdpa_kernel``), in order; ``runtime.step_context`` enters them."""
    num_streams: int = 1
    """1: input copies on the compute stream; 2: the next batch is copied on a side stream."""
    optimizer_implementation: str = "default"
    """"default" keeps the user's optimizer; "plain", "foreach" or "fused" rebuilds it with that
    implementation (same hyperparameters and state)."""
    zero_grad_set_to_none: bool = True
    """optimizer.zero_grad(set_to_none=...) in the step."""
    optimizer_state: str = "full"
    """"full" keeps the user's optimizer; "8bit" replaces its torch.optim.Adam/AdamW with torchao's
    8-bit Adam8bit/AdamW8bit (same param_groups, hyperparameters and state: strategies.optimizer_state)."""
    expandable_segments: bool = False
    """The CUDA caching allocator's expandable segments, set before the model is on the GPU
    (strategies.allocator.set_allocator: the worker, autotune.load and TunedConfig.prepare call it)."""
    compile_mode: str | None = None
    """torch.compile mode the model is compiled with ("default", "reduce-overhead", ...); None: eager."""
    cuda_graphs: bool = False
    """Capture the whole step (forward, backward, optimizer step) in one CUDA graph and replay it."""
    ddp: dict[str, Any] | None = None
    """DistributedDataParallel keyword arguments (bucket_cap_mb, gradient_as_bucket_view,
    static_graph) the model is wrapped with; None: no DDP."""
    ddp_world_size: int = 1
    """Processes the DDP step was tuned for (1: no DDP)."""
    dataloader: dict[str, Any] = field(default_factory=dict)
    """DataLoader keyword arguments the dataloader knob chose (num_workers, pin_memory, ...); what
    user code gets through ``TunedConfig.dataloader_kwargs``."""
    notes: list[str] = field(default_factory=list)
    """Plain-language advice that comes with this recipe (e.g. learning-rate scaling)."""
