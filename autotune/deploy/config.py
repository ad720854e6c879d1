"""TunedConfig: the exported configuration, as user training code imports it.

    cfg = autotune.load("reports/resnet50-h200/config.json")
    model, optimizer = cfg.prepare(model, optimizer)
    scaler = cfg.grad_scaler()
    for x, y in cfg.loader(data_loader):
        with cfg.autocast():
            loss = loss_fn(model(x), y)
        ...

Loading replays the stored Optuna parameters through the same strategies the search sampled
them with (``optuna.trial.FixedTrial``), so the recipe built here is the one the trial measured.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import optuna
import torch
from torch import nn

import strategies
from autotune.deploy import compile_cache, runtime
from autotune.recipe import Recipe, backend_flags
from autotune.space import SearchSpace
from autotune.errors import ConfigError
from strategies.allocator import set_allocator
from strategies.streams import device_batches

FORMAT_VERSION = 1


class TunedConfig:
    """A tuned training configuration: knob values, the recipe they make, and where they came from."""

    def __init__(self, knobs: Mapping[str, Any], space: SearchSpace, *,
                 params: Mapping[str, Any] | None = None, info: Mapping[str, Any] | None = None) -> None:
        self.space = space
        self.knobs = dict(knobs)
        self.params = dict(params or {})
        self.info = dict(info or {})
        """Everything else config.json holds: figures, baseline, provenance, study, command."""
        self.recipe: Recipe = strategies.build_recipe(self.knobs, space.device)
        self.path: Path | None = None
        """The config.json this was loaded from (``load``), beside which its compile cache lies."""

    # construction ------------------------------------------------------------------------------

    @classmethod
    def from_params(cls, params: Mapping[str, Any], space: SearchSpace, **kwargs: Any) -> "TunedConfig":
        """Replay Optuna parameters through the strategies (the search's own code path)."""
        knobs = strategies.sample(optuna.trial.FixedTrial(dict(params)), space)
        return cls(knobs, space, params=params, **kwargs)

    @classmethod
    def load(cls, path: str | Path, *, here: bool = True) -> "TunedConfig":
        """Read a config.json (or its output folder). ``here=False`` reads it as data, to translate
        for another machine (``autotune export``): a CUDA configuration loads without a GPU, and
        nothing is compared with this machine."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file; pass the config.json that `autotune search` wrote "
                              "(or its output folder)") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON ({exc}); re-export it with `autotune search`") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} holds a JSON {type(data).__name__}, not the object `autotune search` writes")
        if isinstance(data.get("format"), int) and data["format"] > FORMAT_VERSION:
            raise ConfigError(f"{path} is format {data['format']}, newer than this autotune reads "
                              f"({FORMAT_VERSION}); upgrade autotune (pip install -U autotune)")
        for key in ("space", "params", "knobs"):
            if not isinstance(data.get(key), dict):
                raise ConfigError(f"{path} has no {key!r} object: it was not written by `autotune search`")
        try:
            space = SearchSpace.from_dict(data["space"])
            cfg = cls.from_params(data["params"], space, info=data)
            recorded = strategies.knobs_from_dict(data["knobs"], fill_missing=True)
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: its space, parameters or knobs do not replay on this version of "
                              f"autotune ({type(exc).__name__}: {exc}); re-export it with `autotune search`") from None
        if recorded != cfg.knobs:
            raise ConfigError(
                f"{path}: replaying its parameters gives {strategies.knobs_to_dict(cfg.knobs)}, not the "
                f"recorded {data['knobs']}; the file was edited by hand or written by another version"
            )
        cfg.path = path
        if not here:
            return cfg
        if space.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{path} was tuned for CUDA but this process has no GPU; run on a GPU, or "
                              "tune for this machine with `autotune search --device cpu`")
        # before the user builds the model: the allocator's setting covers only the segments made after it
        set_allocator(cfg.recipe)
        _warn_if_it_may_not_fit(path, data, space.device)
        differs = _provenance_differences(data.get("provenance") or {}, space.device)
        if differs:
            warnings.warn(f"{path} was measured with {'; '.join(differs)}: the configuration still runs, "
                          "but its figures may not hold here; `autotune search` re-tunes for this machine",
                          stacklevel=3)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.info)
        data.update(format=FORMAT_VERSION, device=self.space.device, space=self.space.to_dict(),
                    params=self.params, knobs=strategies.knobs_to_dict(self.knobs), notes=self.recipe.notes)
        return data

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")

    # what user code calls ------------------------------------------------------------------------

    @property
    def device(self) -> str:
        return self.recipe.device

    @property
    def batch_size(self) -> int:
        return self.recipe.batch_size

    @property
    def notes(self) -> list[str]:
        return list(self.recipe.notes)

    @property
    def compile_cache_path(self) -> Path | None:
        """The compile cache the search saved beside config.json (``compile-cache.zip``,
        autotune.deploy.compile_cache) where this configuration compiles, else None."""
        entry = self.info.get("compile_cache")
        if self.recipe.compile_mode is None or not isinstance(entry, dict) or self.path is None:
            return None
        return self.path.parent / str(entry.get("file", compile_cache.ARCHIVE))

    def _load_compile_cache(self) -> None:
        # before the first compiled step: once per process; where it cannot, one warning says why
        if self.compile_cache_path is not None:
            compile_cache.load_once(self.compile_cache_path, self.device, stacklevel=3)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches (of ``batch_size``) per optimizer step: 1 unless tuned with
        --global-batch-size. ``train_step`` accumulates them; a loop of your own divides each
        micro-batch's loss by it and steps the optimizer every ``accumulation_steps`` batches."""
        return self.recipe.accumulation_steps

    def scaled_lr(self, base_lr: float) -> float:
        """The learning rate for the tuned batch size, by the linear scaling rule."""
        base = self.recipe.base_batch_size or self.recipe.batch_size
        return base_lr * self.recipe.batch_size * self.recipe.accumulation_steps / base

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Set the backend switches for this process, pad, move and (if tuned so) compile the model;
        move the optimizer's state and, if tuned so, rebuild it with another implementation.

        Use the returned optimizer: with ``optimizer.implementation`` other than "default" (or CUDA
        graphs with an Adam-like optimizer, which need ``capturable=True``) it is a new instance of
        your optimizer's class, with the same param_groups, hyperparameters and state; with
        ``optimizer_state`` "8bit" it is torchao's ``AdamW8bit`` (``Adam8bit`` for an Adam) in place of
        your ``torch.optim.AdamW``, its moments in 8 bits (``strategies.optimizer_state``).

        A configuration tuned with ``--ddp N`` returns the model wrapped in
        ``DistributedDataParallel`` with the tuned bucket_cap_mb, gradient_as_bucket_view and
        static_graph (between the device move and the compile, as measured), on this process's
        GPU (``LOCAL_RANK``): call it after ``torch.distributed.init_process_group()`` in a
        script launched with ``torchrun``; without a process group it raises ConfigError. The
        wrapped model's state_dict keys start with "module." (save ``model.module.state_dict()``).

        With the allocator knob's expandable segments, the CUDA allocator is set to them first (as
        ``autotune.load`` does): the model moved here is in them, not what your code put on the GPU before.

        A compiled configuration's compile cache (``compile_cache_path``) is loaded here, so its first
        step loads the compiled graphs and kernels the search made instead of compiling them.
        """
        set_allocator(self.recipe)
        self._load_compile_cache()
        model = runtime.prepare_model(model, self.recipe)
        if optimizer is not None:
            optimizer = runtime.prepare_optimizer(optimizer, self.recipe)
        return model, optimizer

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Around your forward pass (the loss too): autocast to the tuned precision, under the
        tuned per-step contexts (the attention backend's ``sdpa_kernel``) when there are any."""
        if not self.recipe.step_contexts:
            return runtime.autocast(self.recipe)
        return runtime.forward_context(self.recipe)

    def grad_scaler(self) -> torch.amp.GradScaler:
        return runtime.grad_scaler(self.recipe)

    def loader(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Batches on the device in the tuned memory format, copied on a side stream if tuned so."""
        return device_batches(batches, self.device, num_streams=self.recipe.num_streams,
                              memory_format=self.recipe.memory_format)

    def dataloader_kwargs(self, **untuned: Any) -> dict[str, Any]:
        """Keyword arguments for your ``torch.utils.data.DataLoader``: the tuned ``num_workers``,
        ``pin_memory``, ``prefetch_factor`` and ``persistent_workers`` when the search ran with
        ``--data``, and ``drop_last=True`` (every step keeps the measured batch shape).

        ``untuned`` gives your own values for what the search did not tune (``num_workers=4``
        for a search without ``--data``); tuned values take precedence. Without ``--data`` the
        trials copied batches from pinned memory, so ``pin_memory`` is then True on a GPU.
        """
        if strategies.BY_NAME["dataloader"].applies(self.space):
            tuned = dict(self.recipe.dataloader)
        else:
            tuned = {"pin_memory": self.device == "cuda", "drop_last": True}
        kwargs = {**untuned, **tuned}
        if kwargs.get("num_workers", 0) == 0:
            # the DataLoader refuses these without workers
            kwargs.pop("prefetch_factor", None)
            kwargs.pop("persistent_workers", None)
        return kwargs

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> runtime.TrainStep:
        """One callable for the whole optimized step: ``loss = step(x, y)``; with the cuda_graphs
        knob, the step is captured in a CUDA graph after a few warm-up steps (fixed batch shapes).
        Loads the compile cache as ``prepare`` does, where ``prepare`` did not."""
        self._load_compile_cache()
        return runtime.TrainStep(model, optimizer, loss_fn, self.recipe)

    def backend_flags(self) -> contextlib.AbstractContextManager[None]:
        """The tuned process-global switches, scoped: restored when the block ends."""
        return backend_flags(self.recipe.backend_flags)

    # exports to training frameworks (autotune.deploy.exports); each lists what it cannot express

    def hf_training_args(self) -> Any:
        """``(training_args, unsupported)``: ``transformers.TrainingArguments`` keyword arguments
        (precision, TF32, torch.compile, optimizer, batch, accumulation, DataLoader) and the tuned
        settings they cannot express, as ``{"setting", "value", "why"}``."""
        from autotune.deploy.exports import hf_training_args

        return hf_training_args(self)

    def lightning(self) -> Any:
        """A LightningExport: ``precision``, ``callback`` (an AutotuneCallback for what the Trainer
        has no flag for), ``trainer_kwargs`` (both included), ``dataloader_kwargs``, ``unsupported``.
        Needs ``pip install lightning``."""
        from autotune.deploy.lightning_callback import lightning_export

        return lightning_export(self)

    def accelerate_config(self) -> Any:
        """An AccelerateExport: ``config`` and its ``yaml`` text for ``accelerate launch
        --config_file`` (mixed precision, dynamo backend and mode, processes), the Accelerator,
        DataLoader and optimizer keyword arguments, and ``unsupported``."""
        from autotune.deploy.exports import accelerate_config

        return accelerate_config(self)

    def export(self, target: str, out_dir: str | Path) -> tuple[list[Path], list[dict[str, Any]]]:
        """Write the export for ``target`` ("hf", "lightning" or "accelerate") into ``out_dir``;
        returns the files written and the settings the target cannot express."""
        from autotune.deploy.export_files import write_export

        return write_export(self, target, out_dir)

    def describe(self) -> str:
        parts = [f"{name}: " + ", ".join(f"{k}={v}" for k, v in strategies.BY_NAME[name].to_dict(cfg).items())
                 for name, cfg in self.knobs.items()]
        return "; ".join(parts)

    def __repr__(self) -> str:
        return f"TunedConfig({self.describe()})"


def _warn_if_it_may_not_fit(path: Path, data: dict[str, Any], device: str) -> None:
    """A configuration measured to peak above this GPU's memory will likely not fit here."""
    peak = (data.get("figures") or {}).get("peak_memory_bytes")
    if device != "cuda" or not peak or not torch.cuda.is_available():
        return
    try:
        total = torch.cuda.get_device_properties(0).total_memory
    except (RuntimeError, AssertionError):  # no driver to ask: nothing to compare with
        return
    if peak > total:
        limit = (data.get("memory") or {}).get("limit_bytes")
        warnings.warn(f"{path} peaked at {peak / 2**30:.1f} GiB when measured, and this GPU has {total / 2**30:.1f} GiB: "
                      f"it will likely run out of memory here{'' if limit else ' (it was tuned without --memory-limit)'}; "
                      f"re-tune with `autotune search ... --memory-limit {total / 2**30:.0f}GiB`", stacklevel=4)


def _provenance_differences(recorded: Mapping[str, Any], device: str) -> list[str]:
    """What differs between where a config was measured and this process (GPU model, torch)."""
    differs = []
    if recorded.get("torch") and recorded["torch"] != torch.__version__:
        differs.append(f"torch {recorded['torch']} (here {torch.__version__})")
    if device == "cuda" and recorded.get("gpu") and torch.cuda.is_available():
        here = torch.cuda.get_device_name(0)
        if here != recorded["gpu"]:
            differs.append(f"GPU {recorded['gpu']} (here {here})")
    return differs


def load(path: str | Path) -> TunedConfig:
    """Load a config.json written by ``autotune search``."""
    return TunedConfig.load(path)


def variant(path: str | Path, changes: Mapping[str, Any], *, new_params: bool = False) -> dict[str, Any]:
    """The config.json at ``path`` with ``changes`` to its Optuna parameters, replayed through the
    strategies (its knobs and notes follow), as data to write (``autotune verify --set``: what one
    knob buys on this configuration). A parameter it does not have (unless ``new_params``: one that a
    change brings back, as turning 8-bit states off brings back the optimizer's implementation), or a
    value its search space does not offer, is refused with the ones it has."""
    cfg = TunedConfig.load(path, here=False)
    unknown = [] if new_params else sorted(set(changes) - set(cfg.params))
    if unknown:
        raise ConfigError(f"--set {unknown[0]}: this config has no such parameter; it has "
                          f"{', '.join(sorted(cfg.params))}")
    try:
        changed = TunedConfig.from_params({**cfg.params, **changes}, cfg.space, info=cfg.info)
    except ValueError as exc:  # FixedTrial: a value the space does not offer
        raise ConfigError(f"--set: {exc}: give a value this configuration's search offered") from None
    return changed.to_dict()
