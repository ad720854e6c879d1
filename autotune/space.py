"""The search space: which values each knob may take on this device, for this workload."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(kw_only=True)
class SearchSpace:
    """What the strategies may choose from. Built once per study from the device and the options.

    It is stored with the study and in config.json, so replaying a trial's parameters
    (Optuna's FixedTrial) later sees exactly the choices the trial saw.
    """

    device: str
    """"cuda" or "cpu"."""
    precisions: list[str] = field(default_factory=lambda: ["fp32"])
    """Precision modes the device supports, fp32 first."""
    batch_sizes: list[int] = field(default_factory=lambda: [32])
    """Candidate batch sizes (one entry when the user pins --batch-size)."""
    global_batch_size: int | None = None
    """--global-batch-size: the samples of one optimizer step, kept whatever the batch (then the
    micro-batch, a divisor of it) is: the rest is made up by gradient accumulation."""
    base_batch_size: int = 32
    """The batch size the baseline runs with: the user's own, for learning-rate scaling."""
    alignments: list[int] = field(default_factory=lambda: [1])
    """Channel multiples to pad Conv/Linear widths to (1 = no padding)."""
    memory_formats: list[str] = field(default_factory=lambda: ["contiguous"])
    """"contiguous" and, for models with 4-D inputs, "channels_last"."""
    stream_counts: list[int] = field(default_factory=lambda: [1])
    """CUDA streams for the input pipeline (2 = copy the next batch on a side stream)."""
    cudnn_benchmark: list[bool] = field(default_factory=lambda: [False])
    """cudnn.benchmark choices (only [False] on CPU)."""
    thread_counts: list[int] = field(default_factory=list)
    """CPU intra-op thread counts to try (empty on CUDA)."""
    fp32_layer_sets: list[str] = field(default_factory=lambda: ["none"])
    """Layer kinds fp32_layers may keep in FP32 under autocast ("none", "norm", "norm+head", ...);
    only "none" unless the probe found such layers and an autocast mode is searched."""
    optimizer_implementations: list[str] = field(default_factory=lambda: ["default"])
    """Optimizer implementations to try ("plain", "foreach", "fused"); "default" keeps the user's
    optimizer as it was built (what configs written before this knob existed did)."""
    zero_grad_set_to_none: list[bool] = field(default_factory=lambda: [True])
    """optimizer.zero_grad(set_to_none=...) choices (True is PyTorch's default)."""
    compile_modes: list[str] = field(default_factory=lambda: ["off"])
    """torch.compile modes to try; "off" runs eagerly. Only modes the probe found working."""
    cuda_graphs: list[bool] = field(default_factory=lambda: [False])
    """Whether the whole step may be captured in one CUDA graph (only [False] on CPU)."""
    dataloader_workers: list[int] = field(default_factory=list)
    """DataLoader worker counts to try; empty (the default) when the search has no --data: its
    timed steps are then fed ready-made batches, so there is no loader to tune."""
    dataloader_pin_memory: list[bool] = field(default_factory=lambda: [False])
    """DataLoader(pin_memory=...) choices ([False, True] with --data on a GPU)."""
    dataloader_prefetch_factors: list[int] = field(default_factory=lambda: [2])
    """DataLoader(prefetch_factor=...) choices, sampled only with workers."""
    ddp_world_size: int = 1
    """Processes (one GPU each) every trial's step runs in under DistributedDataParallel
    (``--ddp N``); 1 (the default) measures a single process without DDP."""
    ddp_bucket_caps_mb: list[int] = field(default_factory=lambda: [25])
    """DistributedDataParallel(bucket_cap_mb=...) choices; only PyTorch's default without --ddp."""
    ddp_gradient_as_bucket_view: list[bool] = field(default_factory=lambda: [False])
    """DistributedDataParallel(gradient_as_bucket_view=...) choices."""
    ddp_static_graph: list[bool] = field(default_factory=lambda: [False])
    """DistributedDataParallel(static_graph=...) choices (sampled for eager steps only)."""

    choices: dict[str, Any] = field(default_factory=dict)
    """The choices of knobs that keep them here rather than in a field of their own (a knob added
    as one module in strategies/), by strategy name; see ``Strategy.offer``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SearchSpace":
        return cls(**data)
