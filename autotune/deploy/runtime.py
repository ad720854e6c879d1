"""The one training step that trials measure and user code runs: autocast, GradScaler, optimizer.

One path for every precision (as nanoGPT does): autocast is entered with ``enabled=False`` for
fp32, and the GradScaler is built with ``enabled=False`` unless fp16 needs loss scaling. The same
step runs eagerly or, with the cuda_graphs knob, captured once in a CUDA graph and replayed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autotune.recipe import Recipe, apply_backend_flags
from autotune.errors import ConfigError
from autotune.workload.models import logits
from strategies import optimizer as optimizer_strategy
from strategies import optimizer_state as optimizer_state_strategy
from strategies.compile import CUDAGRAPH_MODES, compile_regions
from strategies.loss_kernel import step_loss
from strategies.vocab_padding import pad_optimizer_state

GRAPH_WARMUP_STEPS = 3
"""Eager steps on a side stream before the whole step is captured (PyTorch's CUDA graphs notes:
lazy initialisation, cudnn.benchmark, compiling and optimizer state happen there, not in capture)."""


def autocast(recipe: Recipe, *, cache_enabled: bool = True) -> torch.autocast:
    """The recipe's autocast context. A graph capture needs ``cache_enabled=False``: the weight-cast
    cache would otherwise hold tensors from the graph's pool past the capture."""
    dtype = recipe.autocast_dtype
    return torch.autocast(recipe.device, dtype=dtype or torch.float32, enabled=dtype is not None,
                          cache_enabled=cache_enabled)


@contextlib.contextmanager
def step_context(recipe: Recipe) -> Iterator[None]:
    """The recipe's per-step contexts (``recipe.step_contexts``: the attention backend), entered in
    order around a step's forward and backward, left in reverse order."""
    with contextlib.ExitStack() as stack:
        for make in recipe.step_contexts:
            stack.enter_context(make())
        yield


@contextlib.contextmanager
def forward_context(recipe: Recipe) -> Iterator[None]:
    """``cfg.autocast()``: the step contexts, then autocast, for a training loop of the user's own
    (the backward pass follows the kernels its forward chose, so the forward is where they act)."""
    with step_context(recipe), autocast(recipe):
        yield


def grad_scaler(recipe: Recipe) -> torch.amp.GradScaler:
    kwargs = recipe.grad_scaler or {}
    return torch.amp.GradScaler(recipe.device, enabled=recipe.grad_scaler is not None, **kwargs)


def prepare_model(model: nn.Module, recipe: Recipe, *, set_flags: bool = True) -> nn.Module:
    """Apply the recipe's model transforms, then move the model to the device and memory format,
    wrap it in DistributedDataParallel (a ``--ddp`` configuration, inside a process group), compile.

    Parameters keep their identity (padding shares them, ``Module.to`` converts in place), so an
    optimizer created before this call still steps the prepared model.
    """
    if recipe.ddp is not None:
        # before any work: a DDP configuration outside a process group gets the error, not a model
        # half prepared; on CUDA this process's GPU is its local rank's, so `.to("cuda")` lands there
        check_process_group(recipe)
    if set_flags:
        apply_backend_flags(recipe.backend_flags)
    for transform in recipe.model_transforms:
        model = transform(model)
    model = model.to(recipe.device)
    if recipe.memory_format is not torch.contiguous_format:
        model = model.to(memory_format=recipe.memory_format)
    if recipe.ddp is not None:
        # after the device move and memory format, before compiling: torch.compile of the DDP
        # module is PyTorch's supported order (TorchDynamo's DDPOptimizer splits the compiled
        # graph at DDP's bucket boundaries, so all-reduces still overlap the backward pass)
        model = wrap_ddp(model, recipe)
    if recipe.compile_mode == "regional":
        compile_regions(model)  # each repeated block in place, as the whole model is below
    elif recipe.compile_mode is not None:
        # in place: same module, same parameters, same state_dict keys (no "_orig_mod." prefix);
        # the compile itself happens in the first step
        model.compile(mode=recipe.compile_mode)
    return model


def check_process_group(recipe: Recipe) -> None:
    """Refuse a DDP configuration where it cannot run: no process group, or CUDA graphs of the
    whole step (the search never offers them together); on CUDA, select the local rank's GPU."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"this configuration was tuned for DistributedDataParallel over {recipe.ddp_world_size} processes, "
            "but this process has no torch.distributed process group: launch your training script with "
            f"`torchrun --nproc-per-node {recipe.ddp_world_size} train.py` and call "
            "torch.distributed.init_process_group() (backend \"nccl\" on GPUs) before cfg.prepare(...); "
            "or tune a single-process configuration with `autotune search` without --ddp")
    if recipe.cuda_graphs:
        raise ConfigError("a DDP configuration cannot capture the whole step in one CUDA graph (DDP's "
                          "all-reduces run from autograd hooks outside it); re-export it with `autotune search`")
    if recipe.device == "cuda":
        torch.cuda.set_device(local_rank())


def local_rank() -> int:
    """This process's GPU among the node's: torchrun's LOCAL_RANK, else the current device."""
    import os

    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None else torch.cuda.current_device()


def wrap_ddp(model: nn.Module, recipe: Recipe) -> nn.Module:
    """``DistributedDataParallel(model, ...)`` with the tuned bucket size, bucket views and static
    graph, on this process's GPU (``device_ids=[local rank]``) or on the CPU (gloo)."""
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    if world != recipe.ddp_world_size:
        warnings.warn(f"this configuration was measured with {recipe.ddp_world_size} DDP processes and runs "
                      f"with {world} here: it works, but its per-GPU figures may not hold", stacklevel=3)
    device_ids = [torch.cuda.current_device()] if recipe.device == "cuda" else None
    assert recipe.ddp is not None
    return DistributedDataParallel(model, device_ids=device_ids, **recipe.ddp)


def prepare_optimizer(optimizer: torch.optim.Optimizer, recipe: Recipe) -> torch.optim.Optimizer:
    """Move the optimizer's state to the device, then rebuild it with the tuned implementation
    (and ``capturable=True`` when the step is captured in a CUDA graph); call it after the model
    is on the device, since a fused implementation checks where the parameters are. With 8-bit
    states (``recipe.optimizer_state``) it is torchao's 8-bit Adam instead, which has no other
    implementation (its moments quantised from the state moved and padded here)."""
    move_optimizer_state(optimizer, recipe.device)
    pad_optimizer_state(optimizer)  # a resumed optimizer's state follows its padded vocabulary
    if recipe.optimizer_state != "full":
        return optimizer_state_strategy.rebuild(optimizer, recipe.optimizer_state, cuda_graphs=recipe.cuda_graphs,
                                                implementation=recipe.optimizer_implementation)
    optimizer = optimizer_strategy.rebuild(optimizer, recipe.optimizer_implementation, capturable=recipe.cuda_graphs)
    optimizer_strategy.prime_fused_sgd(optimizer)  # a GradScaler-skipped first step must not leave garbage
    return optimizer


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    """Optimizer state (momentum buffers, Adam moments) follows the parameters to the device."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != torch.device(device) and value.dim() > 0:
                state[key] = value.to(device)


def compiled_loss(loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                  recipe: Recipe) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss, compiled beside a compiled model; the loss as it is otherwise. ``TrainStep`` computes
    a whole-model compile's loss in the model's graph instead (:func:`joint_compile`); this one is
    the loss of a regionally compiled model (its head stays outside the compiled blocks) and of DDP.

    Left eager, a language model's loss is the costliest pointwise work of its step: the logits
    (sequences x tokens x vocabulary, 6.6 GB in bf16 for GPT-2 at 64 x 1,024) are upcast to FP32,
    log-softmaxed and read back, forward and backward, each a pass over memory; compiled, the
    upcast, the softmax and the gradient fuse into a few reductions, and a padded head's sliced
    logits are read in place instead of copied. Default mode whatever the model's: the loss has no
    matmul for max-autotune to tune, and its own CUDA graphs would only split the model's.
    """
    if recipe.compile_mode is None:
        return loss_fn
    return torch.compile(loss_fn)


def joint_compile(recipe: Recipe) -> bool:
    """Whether the step compiles its forward and loss as one graph: a whole-model compile with the
    framework's loss, without DDP (TorchDynamo splits a graph at DDP's buckets, so all-reduces overlap
    the backward, only for a frame it compiles inside DDP's forward: DDP keeps its loss apart).

    As nanoGPT compiles ``loss(model(x), y)``. Apart, the logits leave the model's graph as an output
    and the loss's graph saves them; its backward returns their gradient in a new buffer while they
    are still held. Jointly, the compiled backward owns the saved logits and their gradient takes
    their place: a logits-sized buffer less at the step's peak. A 2-layer Llama of 32,000 tokens at
    4 x 512 tokens on a CPU (scripts/joint_compile_bench.py) saved 182 MiB for backward either way
    in bf16 and peaked 202 MiB above the step's start jointly, 307 MiB apart (349 and 568 in FP32).
    """
    return (recipe.compile_mode is not None and recipe.compile_mode != "regional"
            and recipe.loss_kernel == "framework" and recipe.ddp is None)


def step_forward(model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 recipe: Recipe) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """``loss_fn(logits(model(inputs)), targets)``: compiled as one function in the recipe's mode
    where :func:`joint_compile` says so (TorchDynamo inlines the model compiled in place into it, so
    the step traces one graph, and reduce-overhead's CUDA graphs span the model and the loss);
    otherwise the model as prepared, then the loss as given."""

    def forward_loss(inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits(model(inputs)), targets)

    if joint_compile(recipe):
        return torch.compile(forward_loss, mode=recipe.compile_mode)
    return forward_loss


def in_format(x: Any, memory_format: torch.memory_format) -> Any:
    """``x`` in ``memory_format`` where it is a 4-D tensor (an image batch), else as it is; a no-op for a
    tensor in that format already."""
    if memory_format is torch.contiguous_format or not isinstance(x, torch.Tensor) or x.dim() != 4:
        return x
    return x.contiguous(memory_format=memory_format)


class TrainStep:
    """zero_grad -> forward and loss under autocast -> scaled backward -> optimizer step -> scaler update.

    Under a whole-model compile the forward and the loss are one compiled function
    (:func:`step_forward`); ``loss_fn`` is the loss as computed apart from the model otherwise.

    Returns the loss as a device tensor (no host synchronisation, so steps queue up on the GPU).
    With ``recipe.cuda_graphs``, the first GRAPH_WARMUP_STEPS steps run eagerly on a side stream,
    the next one is captured in a CUDA graph from static copies of its batch, and every step from
    then on copies its batch into those buffers and replays the graph (batches must keep their
    shape: a DataLoader with drop_last=True).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], recipe: Recipe,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        # a fused linear cross-entropy (loss_kernel) reads the LM head's input and stays eager beside a
        # compiled model: its kernels are liger's own Triton, and its host synchronisation would split the graph
        self.loss_fn = (compiled_loss(loss_fn, recipe) if recipe.loss_kernel == "framework"
                        else step_loss(model, loss_fn, recipe))
        # the forward and the loss of every step path: one compiled graph under a whole-model compile
        self.forward_loss = step_forward(model, loss_fn if joint_compile(recipe) else self.loss_fn, recipe)
        self.recipe = recipe
        self.scaler = scaler if scaler is not None else grad_scaler(recipe)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._num_graph_warmup = 0
        self._side_stream: torch.cuda.Stream | None = None
        self._static: tuple[list[Any], Any, torch.Tensor] | None = None
        self._static_loss: torch.Tensor | None = None
        self._micro = 0  # micro-batches accumulated towards the next optimizer step
        if recipe.accumulation_steps > 1 and recipe.cuda_graphs:
            raise ConfigError("gradient accumulation and a whole-step CUDA graph do not go together (the graph "
                              "holds one optimizer step per replay); re-export the configuration with `autotune search`")

    @property
    def num_setup_steps(self) -> int:
        """Steps before this step runs its steady-state code: the compile (and cudagraph trees'
        recording) or the graph warm-up and capture. Their time is compile time, not step time."""
        n = 0
        if self.recipe.compile_mode is not None:
            # cudagraph trees run a compiled function once, record it the next time, replay after
            n = 3 if self.recipe.compile_mode in CUDAGRAPH_MODES else 1
        if self.recipe.cuda_graphs:
            n = max(n, GRAPH_WARMUP_STEPS + 1)
        if self.recipe.loss_kernel != "framework" or self.recipe.llm_kernels != "framework":
            n = max(n, 1)  # liger's Triton kernels compile in the first step that calls them
        if self.recipe.optimizer_state != "full":
            n = max(n, 1)  # torchao's 8-bit Adam compiles its update (once a parameter shape) in the first step
        return n

    def __call__(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch: with ``accumulation_steps`` k, every k-th call steps the optimizer over
        the gradients of the last k micro-batches (each loss divided by k, so the step is that of
        one batch of k micro-batches); without accumulation, every call is a whole step. A 4-D input
        is put in the tuned memory format first, as cfg.loader gives it: the step then runs the graph
        the search measured, whose compile (compile-cache.zip) is keyed on its inputs' strides."""
        inputs = in_format(inputs, self.recipe.memory_format)
        if self.recipe.accumulation_steps > 1:
            return self._accumulate(inputs, targets)
        if self.recipe.cuda_graphs:
            return self._graphed(inputs, targets)
        if self.recipe.compile_mode in CUDAGRAPH_MODES:
            # a new iteration: the previous step's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        return self._eager(inputs, targets)

    def _accumulate(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        steps = self.recipe.accumulation_steps
        if self._micro == 0:
            self.optimizer.zero_grad(set_to_none=self.recipe.zero_grad_set_to_none)
        if self.recipe.compile_mode in CUDAGRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()
        with step_context(self.recipe):
            with autocast(self.recipe):
                loss = self.forward_loss(inputs, targets)
            self.scaler.scale(loss / steps).backward()
        self._micro += 1
        if self._micro == steps:
            self._micro = 0
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return self._kept(loss)

    def _eager(self, inputs: Any, targets: torch.Tensor, *, cache_enabled: bool = True) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=self.recipe.zero_grad_set_to_none)
        with step_context(self.recipe):
            with autocast(self.recipe, cache_enabled=cache_enabled):
                loss = self.forward_loss(inputs, targets)
            self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return self._kept(loss)

    def _kept(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss, the caller's to keep: under reduce-overhead and max-autotune it is an
        output of the joint graph's CUDA graph, which the next step's replay overwrites."""
        loss = loss.detach()
        return loss.clone() if self.recipe.compile_mode in CUDAGRAPH_MODES and joint_compile(self.recipe) else loss

    def _graphed(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.graph is None and self._num_graph_warmup < GRAPH_WARMUP_STEPS:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream()
            side = self._side_stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                # autocast's weight cache off as in the capture: a compiled model guards on it, and
                # a recompile inside the capture autotuned Inductor's kernels there, which synchronises
                # ("operation not permitted when stream is capturing")
                loss = self._eager(inputs, targets, cache_enabled=False)
            torch.cuda.current_stream().wait_stream(side)
            self._num_graph_warmup += 1
            return loss
        if self.graph is None:
            self._capture(inputs, targets)  # the static buffers now hold this batch
        else:
            self._copy_in(inputs, targets)
        assert self.graph is not None and self._static_loss is not None
        self.graph.replay()
        return self._static_loss.clone()  # the static loss is overwritten by the next replay

    def _capture(self, inputs: Any, targets: torch.Tensor) -> None:
        leaves, spec = tree_flatten(inputs)
        static_leaves = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        static_targets = targets.clone()
        self._static = (static_leaves, spec, static_targets)
        # as in PyTorch's whole-network example: gradients set to None before capture, so backward
        # allocates them from the graph's pool and every replay refills them in place
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a DataLoader pinning memory) do not break the capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._static_loss = self._eager(tree_unflatten(static_leaves, spec), static_targets,
                                            cache_enabled=False)
        self.graph = graph

    def _copy_in(self, inputs: Any, targets: torch.Tensor) -> None:
        assert self._static is not None
        static_leaves, spec, static_targets = self._static
        leaves, got_spec = tree_flatten(inputs)
        pairs = list(zip(leaves, static_leaves)) + [(targets, static_targets)]
        if got_spec != spec or any(not _same_kind(new, old) for new, old in pairs):
            raise ConfigError(
                "this step was captured in a CUDA graph, which replays fixed shapes: a batch of "
                f"{_describe(inputs)} differs from the captured {_describe(tree_unflatten(static_leaves, spec))}; "
                "give every step the same batch shape (DataLoader(..., drop_last=True)), or use a "
                "configuration with cuda_graphs off")
        for new, old in pairs:
            if isinstance(old, torch.Tensor):
                old.copy_(new, non_blocking=True)


def _same_kind(new: Any, old: Any) -> bool:
    if isinstance(old, torch.Tensor):
        return (isinstance(new, torch.Tensor) and new.shape == old.shape and new.dtype == old.dtype
                and new.device == old.device)
    return new == old


def _describe(tree: Any) -> str:
    leaves, _ = tree_flatten(tree)
    return ", ".join(f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else repr(x) for x in leaves)
