"""The options of a search (SearchConfig, checked on creation) and what follows from them alone:
the budget given as a duration, the device, the memory each trial may use, the default output folder."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError
from autotune.trial.gpus import parse_gpus
from autotune.trial.measure import MeasureSettings
from autotune.workload.models import WorkloadSpec

DEFAULT_OUT = Path("runs")
"""Where searches write by default: <model>-<device>/ under it. Never reports/, whose committed
example studies a search would otherwise resume (ignored by git, so a clone stays clean)."""
DEFAULT_BUDGET_S = 600.0  # when neither --trials nor --budget is given
MIN_BUDGET_S = 10.0


@dataclass(kw_only=True, frozen=True)
class SearchConfig:
    """Everything `autotune search` was asked to do, resolved and validated on creation and never
    changed afterwards: what a search learns (the probe's batch floor, the budget left) lives in its
    study, not here."""

    workload: WorkloadSpec
    device: str = "auto"
    """"cuda", "cpu" or "auto" (CUDA when there is a GPU)."""
    out_dir: Path | None = None
    """None: runs/<model>-<device>/ (ignored by git; the committed examples live in reports/)."""
    storage: str | None = None
    """Optuna storage URL; None: SQLite file study.db in the output folder."""
    study_name: str | None = None
    trials: int | None = None
    """Stop once this many trials are finished (resumed ones included)."""
    budget_s: float | None = None
    """Stop starting trials when the next one would end after this many seconds; without --trials,
    DEFAULT_BUDGET_S."""
    batch_size: int | None = None
    """Pin the batch size (no batch search)."""
    base_batch_size: int | None = None
    """The batch size the user trains with (the baseline's); default: the pinned one or 256 (GPU) / 16 (CPU)."""
    min_batch_size: int | None = None
    max_batch_size: int | None = None
    precisions: list[str] | None = None
    """Restrict (or, for bf16 on a CPU without native bf16, extend) the precision modes searched."""
    input_on_device: bool = False
    """Keep synthetic batches on the GPU instead of copying them from pinned host memory each step."""
    compile: bool | None = None
    """Search torch.compile modes: None (default) on a GPU only, True on a CPU too (a CPU compile of
    even a tiny model takes tens of seconds per trial), False never. Only where the probe compiled."""
    accuracy_check: bool = True
    """Train configurations near the speed frontier briefly against FP32; never recommend one that
    loses more than max_accuracy_drop (see autotune.accuracy.study.gate)."""
    max_accuracy_drop: float = 0.5
    """Held-out accuracy drop versus FP32 allowed, in percentage points."""
    max_loss_drift: float = 0.1
    """Without held-out accuracy: the share of FP32's training-loss decrease a configuration may lose."""
    accuracy_steps: int | None = None
    """Steps of the accuracy check's training run; None: scaled to the measured step time and
    accuracy_share of the budget (autotune.accuracy.study.plan), at most 300 on a GPU, 100 on a CPU."""
    accuracy_share: float | None = None
    """What the accuracy checks may spend of --budget (more than 0, at most 1); their steps are
    planned to fit in it. None: 0.15 for parity (the recommendation's verdict included), 0.25 for
    held-out (while trials run)."""
    accuracy_method: str = "parity"
    """"parity" (autotune.accuracy.study.parity_gate) or "held-out" (autotune.accuracy.study.gate.AccuracyGate)."""
    data: str | None = None
    """The accuracy check's data: None (synthetic), an ImageFolder folder, or package.module:factory."""
    profile: bool = True
    """Profile each GPU trial (torch.profiler and NVML) and derive its findings."""
    steer: bool = True
    """Queue the configurations the findings suggest, and stop exploring knobs shown to have no
    effect (autotune.search.knob_effects)."""
    started_at: float | None = None
    """When the command started (time.time()): --budget counts from it, so the interpreter's and
    torch's imports are inside the budget too; None: from run_search's call."""
    early_stop_below: float = 0.5
    """A trial whose warm-up runs below this share of the best throughput so far is stopped there
    (status "pruned", its warm-up windows reported to Optuna as intermediate values); 0: every
    trial is measured in full. Only with --objective throughput."""
    objective: str = "throughput"
    """What the search optimizes: "throughput" (samples/s), "energy" (joules per sample, NVML) or
    "memory" (peak memory); see autotune.search.goal."""
    seed: int = 0
    trial_timeout_s: float = 600.0
    measure: MeasureSettings | None = None
    command: str = ""
    gpus: list[int] | str | None = None
    """CUDA GPUs to search on in parallel, one trial worker on each ("0,1", [0, 1] or "all");
    None: the first visible GPU. All must be the same model (autotune.trial.gpus)."""
    prestart_workers: bool | None = None
    """Start each trial's worker while the previous trial runs (autotune.trial.runner: spare workers),
    taking its imports off the trials' path; None: on a GPU without --ddp (on a CPU the spare's
    imports would compete with the trial measured on the same cores)."""
    ddp: int | None = None
    """--ddp N: measure every trial as an N-process DistributedDataParallel step, one GPU per
    process (autotune.trial.ddp_rank), and search DDP's bucket size, bucket views and static graph; None:
    single-process trials."""
    global_batch_size: int | None = None
    """--global-batch-size: keep this many samples per optimizer step; the batch size searched is
    then the micro-batch (a divisor of it), and gradient accumulation makes up the rest."""
    memory_limit: int | str | None = None
    """--memory-limit: every worker caps its GPU memory at this many bytes ("24GiB" is parsed), what
    lives outside PyTorch's allocator included, so a large GPU tunes for a smaller card's memory."""
    memory_headroom: int | str | None = None
    """--memory-headroom: leave this much of the GPU's memory free (for other processes)."""
    resume: bool = False
    """Add trials to a study another machine wrote (a copied folder, a committed example): refused
    otherwise, since its figures are not this machine's (autotune.search.machine)."""
    replay: Path | None = None
    """An earlier search's output folder: its configurations are measured first, in its order
    (after this search's FP32 baseline and known-good ones), before the sampler proposes any: the
    same trials on another GPU, or with more GPUs (see replay_configurations)."""
    cache_limit: int | str | None = None
    """--cache-limit: what autotune's cache (autotune.cache: compiles, FP32 references, earlier searches'
    trials) may hold on disk, in bytes ("5GiB" is parsed); None: autotune.cache.DEFAULT_LIMIT_BYTES. The
    least recently used entries go first at the end of the search."""
    fresh: bool = False
    """Start without the trials earlier searches of this workload measured on this kind of machine
    (autotune.search.warm): the baseline and the plain recipe are measured again."""
    mlflow: str | None = None
    """--mlflow URI: also log each trial, the best configuration and the report to this MLflow
    tracking store (autotune.search.mlflow_log; needs the mlflow package, checked by run_search
    before any device time)."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"--device {self.device!r}: use cuda, cpu or auto")
        from autotune.workload.hub import check_options

        # --model-config and --seq-len: an hf: model's alone, --seq-len at least 1 (the fields are
        # checked against the model's configuration by check_spec, which imports transformers)
        check_options(self.workload.model, self.workload.model_config, self.workload.seq_len)
        if not 0 <= self.early_stop_below < 1:
            raise ConfigError(f"--early-stop-below {self.early_stop_below}: give a share of the best throughput "
                              "so far, from 0 (measure every trial in full) to below 1, e.g. 0.5")
        if isinstance(self.gpus, str):
            self._resolve("gpus", parse_gpus(self.gpus))
        if self.gpus is not None and self.device == "cpu":
            raise ConfigError("--gpus runs one trial worker per CUDA GPU; it cannot go with --device cpu")
        if self.ddp is not None:
            if self.ddp < 2:
                raise ConfigError(f"--ddp {self.ddp}: give the number of processes (GPUs) of the data-parallel "
                                  "step, at least 2; without --ddp trials run in one process")
            if self.gpus is not None:
                raise ConfigError("--ddp N runs each trial on GPUs 0..N-1 together, --gpus runs separate trials on "
                                  "separate GPUs: give one of them (choose the GPUs of a --ddp search with "
                                  "CUDA_VISIBLE_DEVICES)")
            if self.data is not None:
                raise ConfigError("--data is not measured under --ddp yet (each rank would need its own "
                                  "DistributedSampler shard); drop --data, the accuracy check then uses "
                                  "synthetic data")
        if self.replay is not None:
            self._resolve("replay", Path(self.replay))
            if not (self.replay / "study.db").is_file():
                raise ConfigError(f"--replay {self.replay}: no study.db there; give the output folder of an "
                                  "earlier `autotune search` (the one holding its config.json and study.db)")
        from autotune.search.memory import parse_size

        for name in ("memory_limit", "memory_headroom", "cache_limit"):  # sizes: "24GiB" -> bytes
            if getattr(self, name) is not None:
                self._resolve(name, parse_size(getattr(self, name), "--" + name.replace("_", "-")))
        if (self.memory_limit or self.memory_headroom) and self.device == "cpu":
            raise ConfigError("--memory-limit and --memory-headroom cap a GPU's memory; a CPU search has none "
                              "to cap (drop them, or search on --device cuda)")
        if self.trials is None and self.budget_s is None:
            self._resolve("budget_s", DEFAULT_BUDGET_S)
        if self.trials is not None and self.trials < 1:
            raise ConfigError(f"--trials must be at least 1, got {self.trials}")
        if self.budget_s is not None and self.budget_s < MIN_BUDGET_S:
            raise ConfigError(f"--budget {self.budget_s:g}s cannot hold a single trial (a worker start, a warm-up "
                              f"and seconds of timed steps); give at least {MIN_BUDGET_S:.0f}s, typically 10m")
        if self.global_batch_size is not None:
            for given, option in ((self.batch_size, "--batch-size"), (self.ddp, "--ddp"), (self.data, "--data")):
                if given is not None:
                    raise ConfigError(f"--global-batch-size searches the micro-batch and accumulates to it; it does "
                                      f"not go with {option} yet (drop one of them)")
            if self.base_batch_size is not None and self.base_batch_size != self.global_batch_size:
                raise ConfigError(f"--global-batch-size {self.global_batch_size} is the batch you train with, so "
                                  f"--base-batch-size {self.base_batch_size} contradicts it: drop --base-batch-size")
        for name in ("batch_size", "base_batch_size", "min_batch_size", "max_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.min_batch_size and self.max_batch_size and self.min_batch_size > self.max_batch_size:
            raise ConfigError(f"--min-batch-size {self.min_batch_size} is larger than "
                              f"--max-batch-size {self.max_batch_size}")
        from strategies.precision import MODES

        for mode in self.precisions or []:
            if mode not in MODES:
                raise ConfigError(f"--precisions: unknown mode {mode!r}; choose from {', '.join(MODES)}")
        if self.precisions is not None and "fp32" not in self.precisions:
            raise ConfigError("--precisions must include fp32: the FP32 baseline is what every figure is compared with")
        if self.trial_timeout_s <= 0:
            raise ConfigError("--trial-timeout must be positive")
        from autotune.search.goal import goal

        goal(self.objective)  # an unknown name gets the list of objectives
        self._check_accuracy_options()
        if self.data is not None and self.input_on_device:
            raise ConfigError("--input-on-device keeps synthetic batches on the GPU, but --data feeds the timed "
                              "steps from a DataLoader; drop one of them")

    def _resolve(self, name: str, value: Any) -> None:
        """Set an option to its resolved form (a parsed size, a path), in __post_init__ only: the config
        is frozen once created."""
        object.__setattr__(self, name, value)

    def measure_settings(self, device: str) -> MeasureSettings:
        """How each trial is timed: --min-measure-time's settings, else the device's defaults."""
        return self.measure or MeasureSettings.for_device(device)

    def _check_accuracy_options(self) -> None:
        """The accuracy check's options, and --data (which feeds the accuracy check and the timed steps)."""
        from autotune.workload.data import check_data_spec

        if self.accuracy_method not in ("parity", "held-out"):
            raise ConfigError(f"--accuracy-method {self.accuracy_method!r}: choose parity or held-out")
        if self.accuracy_share is not None and not 0 < self.accuracy_share <= 1:
            raise ConfigError(f"--accuracy-share {self.accuracy_share:g}: give the share of --budget the accuracy "
                              "checks may spend, more than 0 and at most 1 (default 0.15 for parity)")
        if self.accuracy_check:
            # validates the thresholds (for `autotune accuracy` too) and the step count
            self.accuracy_settings("cpu", steps=None if self.accuracy_method == "parity" else self.accuracy_steps)
            if self.accuracy_method == "parity":
                self.parity_settings()
        check_data_spec(self.data)  # without the check it still feeds the timed steps, through a DataLoader

    @property
    def share_of_budget(self) -> float:
        """--accuracy-share, or the method's default."""
        from autotune.accuracy.study.parity_gate import DEFAULT_SHARE
        from autotune.accuracy.study.plan import DEFAULT_SHARE as HELD_OUT_SHARE

        if self.accuracy_share is not None:
            return self.accuracy_share
        return DEFAULT_SHARE if self.accuracy_method == "parity" else HELD_OUT_SHARE

    def parity_settings(self):
        """The numerics parity check's settings (validated: a bad value raises ConfigError)."""
        from autotune.accuracy.worker.parity import ParitySettings

        given = {"steps": self.accuracy_steps} if self.accuracy_steps is not None else {}
        return ParitySettings(**given, seed=self.seed, data=self.data)

    def accuracy_settings(self, device: str, *, steps: int | None | str = "given"):
        """The accuracy check's settings on ``device`` (validated: a bad value raises ConfigError), at
        --accuracy-steps unless ``steps`` says otherwise."""
        from autotune.accuracy.settings import AccuracySettings

        steps = self.accuracy_steps if steps == "given" else steps
        return AccuracySettings.for_device(device, steps=steps, seed=self.seed, data=self.data,
                                           max_accuracy_drop=self.max_accuracy_drop,
                                           max_loss_drift=self.max_loss_drift)


def parse_duration(text: str) -> float:
    """'10m' -> 600.0; accepts s, m, h and plain seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match:
        raise ConfigError(f"--budget {text!r}: write a duration like 90s, 10m or 1.5h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def device_slug(provenance: dict[str, Any], device: str) -> str:
    """The GPU's name without "NVIDIA" and "GeForce", in lower case, other characters as '-'; the CPU ->
    'cpu'."""
    if device != "cuda":
        return "cpu"
    name = provenance.get("gpu", "gpu").lower().replace("nvidia", "").replace("geforce", "")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is False); "
                          "use --device cpu, or install a CUDA build of torch")
    return requested


def memory_limit_bytes(config: SearchConfig, device: str, info: dict[str, Any]) -> int | None:
    """The device memory each trial may use: --memory-limit, and the GPU's memory less
    --memory-headroom, whichever is less; None when neither is given (or on a CPU)."""
    if device != "cuda" or not (config.memory_limit or config.memory_headroom):
        return None
    total = int(info["provenance"].get("gpu_memory_bytes") or 0)
    limits = [int(config.memory_limit)] if config.memory_limit else []
    if config.memory_headroom:
        limits.append(total - int(config.memory_headroom))
    limit = min(limits)
    if limit <= 0:
        raise ConfigError(f"--memory-headroom {config.memory_headroom / 2**30:.1f} GiB leaves nothing of this GPU's "
                          f"{total / 2**30:.1f} GiB; give a smaller headroom")
    return limit
