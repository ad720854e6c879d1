"""Workloads: a model, a synthetic batch maker and a loss, named on the command line.

``--model`` takes any torchvision classification model by name (``resnet50``, ``vit_b_16``),
``hf:TYPE`` or ``timm:NAME`` (autotune.workload.hub: a transformers causal LM, a timm classifier)
or ``package.module:factory``, a callable that returns an ``nn.Module`` or a :class:`Workload`.
No weights are downloaded: random initialisation is enough to measure speed.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from autotune.errors import ConfigError, WorkloadError
from autotune.heads import logits  # noqa: F401  (autotune.workload.models.logits: where the workloads use it)
from autotune.workload import hub


@dataclass(kw_only=True)
class Workload:
    """What a trial trains. A user's factory may return one of these instead of a bare model."""

    model: nn.Module
    """The model, on the CPU, in training mode."""
    make_batch: Callable[[int, torch.Generator], tuple[Any, torch.Tensor]] | None = None
    """(batch_size, generator) -> (inputs, targets) on the CPU; None: random images of input_shape
    and random class labels."""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = field(default_factory=nn.CrossEntropyLoss)
    """(model output, targets) -> scalar loss."""
    input_shape: tuple[int, ...] = (3, 224, 224)
    """Shape of one input sample (used when make_batch is None)."""
    num_classes: int = 1000
    """Number of classes of the random labels (used when make_batch is None)."""
    sample_unit: str = "sample"
    """What one sample is, in words ("image", "sequence"); samples/s counts these."""
    tokens_per_sample: int | None = None
    """Tokens in one sample (a language model's sequence length): tokens/s is samples/s times
    this; None: the samples are not token sequences."""
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    """model -> the optimizer a trial trains it with (its implementation is then the optimizer
    knob's); None: SGD with momentum, as image classifiers are trained."""

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer a trial steps: ``make_optimizer``'s, else SGD (lr 0.01, momentum 0.9)."""
        if self.make_optimizer is not None:
            return self.make_optimizer(model)
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[Any, torch.Tensor]:
        """One synthetic batch on the CPU: random normal inputs (never zeros, which can run
        faster than real data) and uniform random labels."""
        if self.make_batch is not None:
            return self.make_batch(batch_size, generator)
        x = torch.randn((batch_size, *self.input_shape), generator=generator)
        y = torch.randint(0, self.num_classes, (batch_size,), generator=generator)
        return x, y


@dataclass(kw_only=True)
class WorkloadSpec:
    """How to build a workload, as given on the command line; JSON-serialisable."""

    model: str
    input_shape: tuple[int, ...] | None = None
    """None: the model's default (3x224x224; 3x299x299 for inception_v3)."""
    num_classes: int = 1000
    model_config: dict[str, Any] = field(default_factory=dict)
    """--model-config: fields of an hf: model's configuration overriding its defaults."""
    seq_len: int | None = None
    """--seq-len: an hf: model's sequence length; None: hub.DEFAULT_SEQ_LEN, clipped to the model's."""

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "input_shape": list(self.input_shape) if self.input_shape else None,
                "num_classes": self.num_classes, "model_config": dict(self.model_config), "seq_len": self.seq_len}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WorkloadSpec":
        shape = data.get("input_shape")
        seq_len = data.get("seq_len")  # absent from dicts written before hf: models
        return cls(model=data["model"], input_shape=tuple(shape) if shape else None,
                   num_classes=int(data.get("num_classes", 1000)), model_config=dict(data.get("model_config") or {}),
                   seq_len=int(seq_len) if seq_len is not None else None)

    @property
    def short_name(self) -> str:
        """A name fit for a folder: the torchvision, hf: or timm: name, or the factory's name."""
        return self.model.rsplit(":", 1)[-1].replace(".", "_").replace("/", "_")


def torchvision_models() -> list[str]:
    """The classification models torchvision can build by name."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def parse_input_shape(text: str) -> tuple[int, ...]:
    """'3x64x64' -> (3, 64, 64)."""
    try:
        shape = tuple(int(part) for part in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise ConfigError(f"--input-shape {text!r} is not of the form CxHxW, e.g. 3x224x224") from None
    if not shape or any(d <= 0 for d in shape):
        raise ConfigError(f"--input-shape {text!r}: every dimension must be a positive integer, e.g. 3x224x224")
    return shape


def _default_shape(name: str) -> tuple[int, ...]:
    return (3, 299, 299) if name == "inception_v3" else (3, 224, 224)


def check_spec(spec: WorkloadSpec) -> None:
    """Fail early, with the fix, on a --model value that cannot work (without building it)."""
    if spec.num_classes < 1:
        raise ConfigError(f"--num-classes must be at least 1, got {spec.num_classes}")
    hub.check_options(spec.model, spec.model_config, spec.seq_len)
    if hub.is_hub_model(spec.model):
        hub.check(spec.model, spec.model_config, spec.seq_len)
        return
    if ":" in spec.model:
        import_factory(spec.model)
        return
    names = torchvision_models()
    if spec.model not in names:
        close = difflib.get_close_matches(spec.model, names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else "."
        raise WorkloadError(
            f"unknown model {spec.model!r}{hint} `autotune models` lists the torchvision names; "
            "hf:TYPE and timm:NAME build transformers and timm models; for your own model pass package.module:factory"
        )


def import_factory(target: str, *, option: str = "--model", error: type[Exception] = WorkloadError,
                   returns: str = "an nn.Module", example: str = "mypkg.models:build_net") -> Callable[..., Any]:
    """Import the callable a user names as ``package.module:factory`` (for ``--model`` or
    ``--data``), with a clear error for each way that fails: malformed, not importable, raising
    while imported, no such attribute (with close names), not callable."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise error(f"{option} {target!r}: write package.module:factory, e.g. {example}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{option} {target!r}: cannot import module {module_name!r} ({exc}); "
                    "is its package installed or on PYTHONPATH?") from exc
    except Exception as exc:  # the user's module itself failed while importing
        raise error(f"{option} {target!r}: importing {module_name!r} raised "
                    f"{type(exc).__name__}: {exc}; fix the module, then run again") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(module) if not n.startswith("_")]
            close = difflib.get_close_matches(part, public, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise error(f"{option} {target!r}: module {module_name!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{option} {target!r}: {attr!r} is not callable; it must be a function returning {returns}")
    return obj



def build(spec: WorkloadSpec, *, init_device: str = "cpu") -> Workload:
    """Build the workload in training mode, with random weights: on the CPU, except an hf: model's
    weights, which ``init_device`` "cuda" creates and initialises on the GPU (a trial's worker: a
    billion parameters take tens of seconds a trial to initialise on a CPU)."""
    check_spec(spec)
    if spec.model.startswith(hub.HF_PREFIX):
        with torch.device(init_device):
            workload = Workload(**hub.build_hf(spec.model, spec.model_config, spec.seq_len))
    elif spec.model.startswith(hub.TIMM_PREFIX):
        workload = Workload(**hub.build_timm(spec.model, spec.num_classes, spec.input_shape))
    elif ":" in spec.model:
        factory = import_factory(spec.model)
        kwargs = {}
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            params = {}
        if "num_classes" in params:
            kwargs["num_classes"] = spec.num_classes
        made = factory(**kwargs)
        if isinstance(made, Workload):
            workload = made
            if spec.input_shape is not None:
                workload.input_shape = spec.input_shape
        elif isinstance(made, nn.Module):
            workload = Workload(model=made, input_shape=spec.input_shape or (3, 224, 224),
                                num_classes=spec.num_classes)
            if "num_classes" not in params:
                workload.num_classes = _output_width(workload, spec)
        else:
            raise WorkloadError(
                f"--model {spec.model!r} returned {type(made).__name__}; the factory must return an "
                "nn.Module or an autotune.Workload"
            )
    else:
        import torchvision

        kwargs = {"weights": None, "num_classes": spec.num_classes}
        if spec.model in ("inception_v3", "googlenet"):
            kwargs["init_weights"] = True  # silences torchvision's warning; random init either way
        model = torchvision.models.get_model(spec.model, **kwargs)
        workload = Workload(model=model, input_shape=spec.input_shape or _default_shape(spec.model),
                            num_classes=spec.num_classes)
    workload.model.train()
    return workload


def _output_width(workload: Workload, spec: WorkloadSpec) -> int:
    """Classes of a factory-made model that was not told --num-classes: its output width, so the
    synthetic labels are valid targets for it."""
    x, _ = workload.batch(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = logits(workload.model(x))
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        raise WorkloadError(f"--model {spec.model!r}: its output is not (batch, classes) logits; return an "
                            "autotune.Workload with your own make_batch and loss_fn instead")
    return int(out.shape[-1])


