"""Accuracy versus speed: does a configuration still train as well as FP32?

Two measurements against an FP32 reference (same initial weights, same data, same order):

* step numerics: one training step's loss and gradients (norm ratio, cosine) against FP32 and
  FP64, from the same weights and batch;
* short-training parity: ``steps`` real optimizer steps on learnable data (``autotune.data``):
  final training loss, held-out accuracy, GradScaler steps skipped, final scale, NaN/Inf.

:func:`judge` turns a run and the reference into a verdict: ``passed``, ``violated`` (held-out
accuracy dropped more than ``max_accuracy_drop`` points, or, without a held-out set, the training
loss lost more than ``max_loss_drift`` of the reference's progress) or ``unstable`` (NaN/Inf,
divergence, or a GradScaler that skipped most steps). Violated and unstable configurations are
never recommended.

Only the numerics knobs (precision, grad_scaler, fp32_layers) change what is computed; batch
size, memory format, padding, cuDNN and streams do not, so each *numerics key* is checked once,
with the check's own batch size and step count, and the result is reused by every configuration
that shares it. The training runs in a worker (mode "accuracy"), isolated like a trial; the study
side (:class:`AccuracyGate`) decides when to check and caches results in study user attributes.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from autotune.errors import AutotuneError

NUMERICS_KNOBS = ("precision", "grad_scaler", "fp32_layers")
"""The knobs that change the arithmetic; every other knob only changes speed and memory."""
NEAR_FRONTIER = 0.9
"""A trial at or above this fraction of the fastest throughput so far is checked."""
UNSTABLE_CONSTRAINT = 100.0
"""Optuna constraint value of an unstable configuration (feasible is <= 0)."""
MAX_SKIPPED_FRACTION = 0.5
"""A GradScaler that skips more than this fraction of the steps does not train: unstable."""
DIVERGED_FACTOR = 1.5
"""Final training loss above this multiple of the initial loss: the run diverged."""


@dataclass(kw_only=True)
class AccuracySettings:
    """How the accuracy check runs and what it accepts; fixed per study so results compare."""

    steps: int = 300
    """Optimizer steps of the short training run."""
    batch_size: int = 64
    """The check's own batch size, the same for every configuration."""
    held_out_size: int = 1024
    """Held-out samples of the synthetic data (an ImageFolder's split is its own)."""
    lr: float = 3e-3
    """Peak AdamW learning rate of the short run, reached after a linear warm-up over the first
    tenth of the steps (robust across CNNs and transformers trained from scratch)."""
    seed: int = 0
    """Initial weights, data and data order."""
    data: str | None = None
    """None: synthetic; a folder in ImageFolder layout; or package.module:factory."""
    max_accuracy_drop: float = 0.5
    """Largest accepted drop of held-out accuracy versus FP32, in percentage points."""
    max_loss_drift: float = 0.1
    """Without a held-out set: largest accepted loss drift, the fraction of FP32's loss decrease lost."""
    fp64: bool = True
    """Also compare one step against FP64 (cheap: one step)."""

    def __post_init__(self) -> None:
        from autotune.errors import ConfigError

        if self.steps < 10:
            raise ConfigError(f"--accuracy-steps must be at least 10 (a shorter run says nothing), got {self.steps}")
        if self.batch_size < 2:
            raise ConfigError(f"the accuracy check's batch size must be at least 2, got {self.batch_size}")
        if self.held_out_size < 1:
            raise ConfigError(f"the held-out set needs at least one sample, got {self.held_out_size}")
        if not self.lr > 0:
            raise ConfigError(f"the accuracy check's learning rate must be positive, got {self.lr}")
        if not 0 <= self.max_accuracy_drop <= 100:
            raise ConfigError(f"--max-accuracy-drop is in percentage points (0 to 100), got {self.max_accuracy_drop}")
        if not self.max_loss_drift >= 0:
            raise ConfigError(f"--max-loss-drift must be 0 or more, got {self.max_loss_drift}")

    @classmethod
    def for_device(cls, device: str, **overrides: Any) -> "AccuracySettings":
        """A few hundred steps on a GPU; far fewer, smaller ones on a CPU so CI stays fast."""
        defaults: dict[str, Any] = {} if device == "cuda" else {"steps": 100, "batch_size": 16, "held_out_size": 512}
        defaults.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**defaults)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AccuracySettings":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def fingerprint(self) -> str:
        """What makes two runs comparable (not the thresholds, which only judge them)."""
        run = {k: v for k, v in self.to_dict().items() if k not in ("max_accuracy_drop", "max_loss_drift")}
        return hashlib.sha1(json.dumps(run, sort_keys=True).encode()).hexdigest()[:10]


def numerics_knobs(knobs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The knobs (as dicts) that change the arithmetic; the others are left at their defaults."""
    return {name: dict(knobs[name]) for name in NUMERICS_KNOBS if name in knobs}


def numerics_key(knobs: Mapping[str, Mapping[str, Any]]) -> str:
    """One string per distinct arithmetic: configurations that share it share their check.
    A knob at its default is left out, so a study from before a knob existed keys the same."""
    import strategies

    present = {}
    for name, values in numerics_knobs(knobs).items():
        if values != strategies.BY_NAME[name].to_dict(strategies.BY_NAME[name].default()):
            present[name] = values
    return json.dumps(present, sort_keys=True)


def describe_numerics(knobs: Mapping[str, Mapping[str, Any]]) -> str:
    """'fp16, GradScaler init 65536, fp32 norm+head', for tables."""
    mode = knobs.get("precision", {}).get("mode", "fp32")
    parts = [mode]
    scaler = knobs.get("grad_scaler", {})
    if mode == "fp16":
        parts.append(f"GradScaler init {scaler.get('init_scale', 0):g}" if scaler.get("enabled") else "no GradScaler")
    layers = knobs.get("fp32_layers", {}).get("layers", "none")
    if layers != "none":
        parts.append(f"fp32 {layers}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# in the worker: the training runs


def run_check(request: Mapping[str, Any]) -> dict[str, Any]:
    """Worker mode "accuracy": train the FP32 reference (unless given) and the configuration,
    compare one step's numerics; return the raw results (judged by the study)."""
    import strategies
    from autotune.space import SearchSpace
    from autotune.workloads import WorkloadSpec

    settings = AccuracySettings.from_dict(request["settings"])
    space = SearchSpace.from_dict(request["space"])
    spec = WorkloadSpec.from_dict(request["workload"])
    knobs = numerics_knobs(request["knobs"])
    reference = request.get("reference")
    data = _datasets(spec, settings, space.device)
    if reference is None:
        reference = train_run(spec, {}, space, settings, data)
        reference["numerics"] = step_numerics(spec, {}, space, settings, data)
        # FP32 again with the data in another order: how much a short run's result moves for
        # reasons that have nothing to do with precision; a drop within that is not a loss
        reshuffled = train_run(spec, {}, space, settings, data, order_seed=settings.seed + 1)
        reference["reshuffled"] = {k: reshuffled.get(k) for k in ("final_loss", "held_out_accuracy", "wall_s")}
    if numerics_key(knobs) == numerics_key({}):
        run = dict(reference)
    else:
        run = train_run(spec, knobs, space, settings, data)
        run["numerics"] = step_numerics(spec, knobs, space, settings, data)
    run["numerics_key"] = numerics_key(knobs)
    return {"status": "ok", "reference": reference, "run": run}


def _datasets(spec, settings: AccuracySettings, device: str):
    from autotune.data import load_data
    from autotune.workloads import build

    import torch

    torch.manual_seed(settings.seed)
    workload = build(spec)
    if workload.make_batch is not None and settings.data is None:
        return _workload_batches(workload, settings)
    return load_data(settings.data, input_shape=tuple(workload.input_shape), num_classes=workload.num_classes,
                     train_size=settings.steps * settings.batch_size, held_out_size=settings.held_out_size,
                     seed=settings.seed, device=device)


def _workload_batches(workload, settings: AccuracySettings):
    """A model with its own batch maker (non-image inputs) and no --data: memorise a fixed set of
    its batches. There is no held-out set (random labels do not generalise), so the check
    compares training loss."""
    import torch
    from torch.utils.data import TensorDataset

    from autotune.data import Datasets
    from autotune.errors import ConfigError

    g = torch.Generator().manual_seed(settings.seed)
    x, y = workload.make_batch(settings.batch_size * 4, g)
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise ConfigError("the workload's make_batch returns inputs that are not one tensor, so the accuracy "
                          "check cannot build data from it; pass --data package.module:factory")
    return Datasets(train=TensorDataset(x, y), held_out=None, num_classes=None,
                    source=f"{len(x)} fixed batches of the workload's make_batch (memorised; no held-out set)")


def _build(spec, knobs: Mapping[str, Any], space, settings: AccuracySettings):
    """The model from the seed (same initial weights every time), its recipe and loss."""
    import torch

    import strategies
    from autotune.workloads import build

    torch.manual_seed(settings.seed)
    workload = build(spec)
    recipe = strategies.build_recipe(strategies.knobs_from_dict(dict(knobs)), space.device)
    return workload, recipe


def train_run(spec, knobs: Mapping[str, Any], space, settings: AccuracySettings, data, *,
              order_seed: int | None = None) -> dict[str, Any]:
    """``settings.steps`` optimizer steps of the configuration, then the held-out evaluation.
    ``order_seed`` draws another data order (same initial weights): the FP32 noise run."""
    import torch

    from autotune import runtime
    from autotune.data import batch_order, collate, eval_batches
    from autotune.recipe import backend_flags
    from autotune.workloads import logits

    started = time.perf_counter()
    workload, recipe = _build(spec, knobs, space, settings)
    device = space.device
    with backend_flags(recipe.backend_flags):
        model = runtime.prepare_model(workload.model, recipe, set_flags=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
        warmup = max(1, settings.steps // 10)
        total = settings.steps

        def lr_factor(step: int) -> float:
            # linear warm-up, then cosine decay to zero: the run ends on a settled model, so its final
            # loss and held-out accuracy do not depend on where in a loss spike the last step fell
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        scaler = runtime.grad_scaler(recipe)
        losses, skipped = [], 0
        for indices in batch_order(len(data.train), settings.batch_size, settings.steps,
                                   settings.seed if order_seed is None else order_seed):
            x, y = _to(collate(data.train, indices), device, recipe)
            optimizer.zero_grad(set_to_none=True)
            with runtime.autocast(recipe):
                loss = workload.loss_fn(logits(model(x)), y)
            scaler.scale(loss).backward()
            scale_before = scaler.get_scale() if scaler.is_enabled() else None
            scaler.step(optimizer)
            scaler.update()
            with warnings.catch_warnings():
                # after a step the GradScaler skipped, torch warns that the schedule moved first
                warnings.simplefilter("ignore", UserWarning)
                schedule.step()
            if scale_before is not None and scaler.get_scale() < scale_before:
                skipped += 1  # the scaler found inf/NaN gradients and skipped this step
            losses.append(loss.detach().float())
        curve = torch.stack(losses).cpu()
        params_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        held = _evaluate(model, workload, recipe, data.held_out, settings, device) if data.held_out is not None else {}
    finite = torch.isfinite(curve)
    head = curve[: max(1, len(curve) // 10)]
    tail = curve[-max(1, len(curve) // 10):]
    result = {
        "steps": settings.steps,
        "batch_size": settings.batch_size,
        "data": data.source,
        "initial_loss": _mean_finite(head),
        "final_loss": float(tail.mean()),  # NaN/Inf when the end of the run is not finite
        "nonfinite_losses": int((~finite).sum()),
        "params_finite": params_finite,
        "skipped_steps": skipped,
        "final_scale": scaler.get_scale() if scaler.is_enabled() else None,
        "loss_curve": [float(v) for v in curve[:: max(1, len(curve) // 20)]],
        "wall_s": round(time.perf_counter() - started, 3),
    }
    result.update(held)
    return result


def _mean_finite(values) -> float:
    import torch

    ok = values[torch.isfinite(values)]
    return float(ok.mean()) if len(ok) else float("nan")


def _to(batch, device: str, recipe):
    import torch

    x, y = batch
    x = x.to(device)
    if x.dim() == 4 and recipe.memory_format is not torch.contiguous_format:
        x = x.contiguous(memory_format=recipe.memory_format)
    return x, y.to(device)


def _evaluate(model, workload, recipe, dataset, settings: AccuracySettings, device: str) -> dict[str, Any]:
    """Held-out accuracy (percent) and loss, in eval mode under the configuration's autocast."""
    import torch

    from autotune import runtime
    from autotune.data import eval_batches
    from autotune.workloads import logits

    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad(), runtime.autocast(recipe):
        for batch in eval_batches(dataset, settings.batch_size):  # a batch the training run showed fits
            x, y = _to(batch, device, recipe)
            out = logits(model(x))
            loss_sum += float(workload.loss_fn(out, y).float()) * len(y)
            correct += int((out.argmax(dim=-1) == y).sum())
            total += len(y)
    model.train()
    return {"held_out_accuracy": 100.0 * correct / total, "held_out_loss": loss_sum / total,
            "held_out_size": total}


def step_numerics(spec, knobs: Mapping[str, Any], space, settings: AccuracySettings, data) -> dict[str, Any]:
    """One step from the same weights on the same batch: the configuration's loss and (unscaled)
    gradients against true FP32 and, where cheap, FP64."""
    import torch

    from autotune.data import batch_order, collate

    indices = next(batch_order(len(data.train), settings.batch_size, 1, settings.seed))
    batch = collate(data.train, indices)
    loss, grads = _one_step(spec, knobs, space, settings, batch, torch.float32)
    ref_loss, ref_grads = _one_step(spec, {}, space, settings, batch, torch.float32)
    out = {"loss": loss, **_compare(loss, grads, ref_loss, ref_grads, "fp32")}
    if settings.fp64:
        loss64, grads64 = _one_step(spec, {}, space, settings, batch, torch.float64)
        out.update(_compare(loss, grads, loss64, grads64, "fp64"))
    return out


def _one_step(spec, knobs, space, settings, batch, dtype) -> tuple[float, Any]:
    """Loss and flattened gradients of one forward/backward (GradScaler applied, then unscaled)."""
    import torch

    from autotune import runtime
    from autotune.recipe import backend_flags
    from autotune.workloads import logits

    workload, recipe = _build(spec, knobs, space, settings)
    device = space.device
    with backend_flags(recipe.backend_flags):
        model = runtime.prepare_model(workload.model, recipe, set_flags=False)
        if dtype is torch.float64:
            model = model.double()
        x, y = _to(batch, device, recipe)
        if x.is_floating_point():
            x = x.to(dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        # loss scaling as the GradScaler does it: scale, backward, unscale; on overflow the scaler
        # skips the step and backs off, so here the scale is halved until the gradients are finite
        # (the gradients of the step the configuration really takes, not of the skipped one)
        scale = float((recipe.grad_scaler or {}).get("init_scale", 1.0)) if recipe.grad_scaler else 1.0
        for _ in range(64):
            for p in params:
                p.grad = None
            torch.manual_seed(settings.seed)  # dropout draws the same masks in every run
            with runtime.autocast(recipe):
                loss = workload.loss_fn(logits(model(x)), y)
            (loss * scale if scale != 1.0 else loss).backward()
            grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
                               for p in params]) / scale
            if scale <= 1.0 or bool(torch.isfinite(grads).all()):
                break
            scale /= 2
    return float(loss.detach().double()), grads.cpu()


def _compare(loss: float, grads, ref_loss: float, ref_grads, name: str) -> dict[str, Any]:
    import torch

    ref_norm = float(ref_grads.norm())
    norm = float(grads.norm())
    finite = bool(torch.isfinite(grads).all())
    cosine = float(torch.nn.functional.cosine_similarity(grads, ref_grads, dim=0)) if finite and norm and ref_norm \
        else (1.0 if norm == ref_norm == 0 else float("nan"))
    return {
        f"loss_rel_error_vs_{name}": abs(loss - ref_loss) / max(abs(ref_loss), 1e-12),
        f"grad_norm_ratio_vs_{name}": norm / ref_norm if ref_norm else float("nan"),
        f"grad_cosine_vs_{name}": cosine,
        f"grad_rel_error_vs_{name}": float((grads - ref_grads).norm()) / ref_norm if ref_norm else float("nan"),
    }


# ---------------------------------------------------------------------------------------------
# the verdict


def judge(run: Mapping[str, Any], reference: Mapping[str, Any], *, max_accuracy_drop: float,
          max_loss_drift: float) -> dict[str, Any]:
    """passed / violated / unstable, with a reason in words and the Optuna constraint value
    (<= 0 feasible): the drop beyond the allowed one, in points (or loss drift beyond the allowed)."""
    out: dict[str, Any] = {
        "steps": run.get("steps"),
        "batch_size": run.get("batch_size"),
        "data": run.get("data"),
        "final_loss": run.get("final_loss"),
        "reference_final_loss": reference.get("final_loss"),
        "skipped_steps": run.get("skipped_steps"),
        "final_scale": run.get("final_scale"),
        "nonfinite_losses": run.get("nonfinite_losses"),
        "numerics": run.get("numerics"),
        "numerics_key": run.get("numerics_key"),
        "max_accuracy_drop": max_accuracy_drop,
        "max_loss_drift": max_loss_drift,
    }
    has_accuracy = run.get("held_out_accuracy") is not None and reference.get("held_out_accuracy") is not None
    if has_accuracy:
        out["accuracy"] = run["held_out_accuracy"]
        out["reference_accuracy"] = reference["held_out_accuracy"]
        out["accuracy_drop"] = reference["held_out_accuracy"] - run["held_out_accuracy"]
        out["held_out_size"] = run.get("held_out_size")
    progress = (reference.get("initial_loss") or 0.0) - (reference.get("final_loss") or 0.0)
    final, ref_final = run.get("final_loss"), reference.get("final_loss")
    if final is not None and ref_final is not None and math.isfinite(final):
        # the share of the FP32 run's loss decrease that this run lost (0: as good, 1: learnt nothing)
        out["loss_drift"] = (final - ref_final) / progress if progress > 0 else (final - ref_final) / max(abs(ref_final), 1e-12)

    shuffled = reference.get("reshuffled") or {}
    noise_acc = (abs(reference["held_out_accuracy"] - shuffled["held_out_accuracy"])
                 if has_accuracy and shuffled.get("held_out_accuracy") is not None else 0.0)
    noise_drift = 0.0
    if shuffled.get("final_loss") is not None and ref_final is not None and math.isfinite(shuffled["final_loss"]):
        noise_drift = abs(shuffled["final_loss"] - ref_final) / progress if progress > 0 else 0.0
    out["fp32_noise"] = {"accuracy_points": noise_acc, "loss_drift": noise_drift}
    unstable = _instability(run)
    if unstable:
        out.update(verdict="unstable", stable=False, reason=unstable, constraint=UNSTABLE_CONSTRAINT)
        return out
    out["stable"] = True
    if has_accuracy:
        allowed = max_accuracy_drop + noise_acc
        excess = out["accuracy_drop"] - allowed
        noise = f" + {noise_acc:.2f} FP32 reshuffle noise" if noise_acc else ""
        what = (f"held-out accuracy {out['accuracy']:.2f}% vs {out['reference_accuracy']:.2f}% for FP32 "
                f"(drop {out['accuracy_drop']:.2f} points, allowed {max_accuracy_drop:g}{noise}) after "
                f"{run.get('steps')} steps")
    else:
        allowed = max_loss_drift + noise_drift
        excess = out["loss_drift"] - allowed
        noise = f" + {noise_drift:.3f} FP32 reshuffle noise" if noise_drift else ""
        what = (f"final training loss {final:.4g} vs {ref_final:.4g} for FP32 (drift {out['loss_drift']:.3f} of "
                f"FP32's loss decrease, allowed {max_loss_drift:g}{noise}) after {run.get('steps')} steps")
    out["allowed"] = allowed
    out["constraint"] = float(excess)
    out["verdict"] = "violated" if excess > 0 else "passed"
    out["reason"] = what
    return out


def _instability(run: Mapping[str, Any]) -> str | None:
    steps = run.get("steps") or 0
    if run.get("nonfinite_losses"):
        return f"the training loss was NaN/Inf in {run['nonfinite_losses']} of {steps} steps"
    if run.get("params_finite") is False:
        return "the weights became NaN/Inf during training"
    if (run.get("skipped_steps") or 0) > MAX_SKIPPED_FRACTION * steps:
        return (f"the GradScaler skipped {run['skipped_steps']} of {steps} steps (gradients overflowed; final "
                f"scale {run.get('final_scale'):g}), so the model barely trained")
    final, initial = run.get("final_loss"), run.get("initial_loss")
    if final is not None and initial is not None and math.isfinite(initial) and final > DIVERGED_FACTOR * initial:
        return f"the training loss diverged ({initial:.4g} at the start, {final:.4g} at the end)"
    return None


def passed(accuracy: Mapping[str, Any] | None) -> bool:
    return bool(accuracy) and accuracy.get("verdict") == "passed"


def failed(accuracy: Mapping[str, Any] | None) -> bool:
    """Violated, unstable, or the check itself failed: never recommended."""
    return bool(accuracy) and accuracy.get("verdict") in ("violated", "unstable", "error")


# ---------------------------------------------------------------------------------------------
# in the study process: when to check, the cache, the recommendation

SETTINGS_ATTR = "accuracy_settings"
UNAVAILABLE_ATTR = "accuracy_unavailable"
REFERENCE_ATTR = "accuracy_reference:{fingerprint}"
RESULT_ATTR = "accuracy_run:{fingerprint}:{key}"


def _key_hash(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def study_settings(study) -> AccuracySettings | None:
    data = study.user_attrs.get(SETTINGS_ATTR)
    return AccuracySettings.from_dict(data) if data else None


def cached_run(study, settings: AccuracySettings, knobs: Mapping[str, Any]) -> tuple[dict, dict] | None:
    """(run, reference) already measured for this numerics key, or None."""
    attrs = study.user_attrs
    reference = attrs.get(REFERENCE_ATTR.format(fingerprint=settings.fingerprint()))
    if reference is None:
        return None
    key = numerics_key(knobs)
    if key == numerics_key({}):
        return {**reference, "numerics_key": key}, reference
    run = attrs.get(RESULT_ATTR.format(fingerprint=settings.fingerprint(), key=_key_hash(key)))
    return (run, reference) if run is not None else None


def accuracy_of(study, trial) -> dict[str, Any] | None:
    """A trial's judged accuracy evidence: its own attribute, else the study's cached check of its
    numerics key (checked after it finished, at export), judged with the study's thresholds."""
    own = trial.user_attrs.get("accuracy")
    if own:
        return own
    settings = study_settings(study)
    knobs = trial.user_attrs.get("knobs")
    if settings is None or not knobs:
        return None
    found = cached_run(study, settings, knobs)
    if found is None:
        return None
    run, reference = found
    return judge(run, reference, max_accuracy_drop=settings.max_accuracy_drop, max_loss_drift=settings.max_loss_drift)


class AccuracyGate:
    """The study side of the check: reuse by numerics key, check near the speed frontier, and
    make sure the recommended configuration has passing evidence."""

    def __init__(self, *, settings: AccuracySettings, space, workload: dict[str, Any], timeout_s: float,
                 log_dir: Path | None = None) -> None:
        self.settings = settings
        self.space = space
        self.workload = workload
        self.timeout_s = timeout_s
        self.log_dir = log_dir
        self.unavailable: str | None = None
        """Why no configuration can be checked (the FP32 reference failed), or None."""

    def attach(self, study) -> None:
        study.set_user_attr(SETTINGS_ATTR, self.settings.to_dict())

    def judge(self, run: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, Any]:
        return judge(run, reference, max_accuracy_drop=self.settings.max_accuracy_drop,
                     max_loss_drift=self.settings.max_loss_drift)

    def evidence(self, study, knobs: Mapping[str, Any], *, check: bool, timeout_s: float | None = None
                 ) -> dict[str, Any] | None:
        """The judged accuracy of ``knobs``: reused when its numerics key was checked, else
        measured in a worker when ``check``, else None."""
        found = cached_run(study, self.settings, knobs)
        if found is None and check and self.unavailable is None:
            found = self._measure(study, knobs, timeout_s or self.timeout_s)
        if found is None:
            return None
        run, reference = found
        if run.get("status") == "error":
            return {"verdict": "error", "stable": False, "reason": run["reason"], "constraint": UNSTABLE_CONSTRAINT,
                    "numerics_key": run.get("numerics_key")}
        return self.judge(run, reference)

    def _measure(self, study, knobs: Mapping[str, Any], timeout_s: float) -> tuple[dict, dict] | None:
        from autotune.runner import run_worker

        fingerprint = self.settings.fingerprint()
        reference = study.user_attrs.get(REFERENCE_ATTR.format(fingerprint=fingerprint))
        key = numerics_key(knobs)
        request = {"mode": "accuracy", "workload": self.workload, "space": self.space.to_dict(),
                   "knobs": numerics_knobs(knobs), "settings": self.settings.to_dict(), "reference": reference}
        log = self.log_dir / f"accuracy-{_key_hash(key)}.log" if self.log_dir else None
        result = run_worker(request, timeout_s=timeout_s, log_path=log)
        if result["status"] == "timeout" and timeout_s < self.timeout_s:
            return None  # cut by the search budget: not the configuration's fault, check again later
        if result["status"] != "ok":
            reason = f"the accuracy check {result['status']}: {result.get('reason')}"
            if reference is None:
                # the FP32 reference itself failed: nothing can be judged, and it is not this
                # configuration's fault; the search goes on for speed and says so everywhere
                self.unavailable = (f"the FP32 reference of the accuracy check failed ({reason}); fix --data, "
                                    "lower --accuracy-steps, or pass --no-accuracy-check")
                study.set_user_attr(UNAVAILABLE_ATTR, self.unavailable)
                return None
            run = {"status": "error", "reason": reason, "numerics_key": key}
        else:
            reference, run = result["reference"], result["run"]
            study.set_user_attr(REFERENCE_ATTR.format(fingerprint=fingerprint), reference)
        if key != numerics_key({}):
            study.set_user_attr(RESULT_ATTR.format(fingerprint=fingerprint, key=_key_hash(key)),
                                {**run, "knobs": numerics_knobs(knobs)})
        return run, reference

    def near_frontier(self, study, value: float) -> bool:
        """Whether an objective value (samples/s, or joules per sample or peak memory, which are
        minimized) is on or near the frontier of what is recommendable."""
        from optuna.study import StudyDirection
        from optuna.trial import TrialState

        maximize = study.direction == StudyDirection.MAXIMIZE
        best = value
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.value is not None and not t.user_attrs.get("unstable") and not failed(accuracy_of(study, t)):
                best = max(best, t.value) if maximize else min(best, t.value)
        return value >= NEAR_FRONTIER * best if maximize else value * NEAR_FRONTIER <= best

    def ensure_recommendation(self, study, deadline: float | None = None):
        """Check the best trials (under the study's objective) without evidence, best first, until
        one passes, while ``deadline`` (time.time(); the search budget's end) leaves time for a
        check. Returns the recommended trial (best with passing evidence) or None."""
        import time

        from optuna.study import StudyDirection
        from optuna.trial import TrialState

        done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.value is not None and not t.user_attrs.get("unstable") and "knobs" in t.user_attrs]
        for t in sorted(done, key=lambda t: t.value, reverse=study.direction == StudyDirection.MAXIMIZE):
            acc = accuracy_of(study, t)
            if acc is None:
                left = None if deadline is None else deadline - time.time()
                if left is not None and left < MIN_CHECK_S:
                    return None  # the budget is spent: the export says the numerics were not checked
                acc = self.evidence(study, t.user_attrs["knobs"], check=True,
                                    timeout_s=None if left is None else min(self.timeout_s, left))
            if passed(acc):
                return t
        return None


MIN_CHECK_S = 5.0
"""A check is not started with less of the budget left than this."""


class AccuracyCheckError(AutotuneError):
    """The FP32 reference of the accuracy check could not be trained: the data or model is at fault."""


def summary_row(mode: str, judged: Mapping[str, Any]) -> dict[str, Any]:
    """One row of `autotune accuracy`'s table."""
    n = judged.get("numerics") or {}
    return {
        "mode": mode,
        "steps": judged.get("steps"),
        "final_loss": judged.get("final_loss"),
        "accuracy": judged.get("accuracy"),
        "accuracy_drop": judged.get("accuracy_drop"),
        "loss_drift": judged.get("loss_drift"),
        "skipped_steps": judged.get("skipped_steps"),
        "loss_rel_error": n.get("loss_rel_error_vs_fp32"),
        "grad_cosine": n.get("grad_cosine_vs_fp32"),
        "grad_cosine_fp64": n.get("grad_cosine_vs_fp64"),
        "verdict": judged.get("verdict"),
        "reason": judged.get("reason"),
    }


def compare_modes(*, workload: dict[str, Any], space, settings: AccuracySettings,
                  configurations: list[tuple[str, dict[str, Any]]], timeout_s: float = 1800.0,
                  on_row=None) -> list[dict[str, Any]]:
    """`autotune accuracy`: check each (label, numerics knobs) against FP32, one worker each, the
    FP32 reference trained once; returns one judged row per configuration."""
    from autotune.runner import run_worker

    reference = None
    rows = []
    for label, knobs in configurations:
        request = {"mode": "accuracy", "workload": workload, "space": space.to_dict(), "knobs": knobs,
                   "settings": settings.to_dict(), "reference": reference}
        result = run_worker(request, timeout_s=timeout_s)
        if result["status"] != "ok":
            if reference is None:
                raise AccuracyCheckError(f"the FP32 reference run failed ({result['status']}): {result.get('reason')}"
                                         f"\n{result.get('traceback', '')}")
            row = {"mode": label, "verdict": "error", "reason": f"{result['status']}: {result.get('reason')}"}
        else:
            reference = result["reference"]
            judged = judge(result["run"], reference, max_accuracy_drop=settings.max_accuracy_drop,
                           max_loss_drift=settings.max_loss_drift)
            row = summary_row(label, judged)
            row["wall_s"] = result["run"].get("wall_s")
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def mode_configurations(precisions: list[str], fp32_layers: list[str] | None = None
                        ) -> list[tuple[str, dict[str, Any]]]:
    """What `autotune accuracy` checks: each precision mode (fp16 with the default GradScaler and
    without one), then each autocast mode with each requested fp32_layers combination."""
    out: list[tuple[str, dict[str, Any]]] = []
    for mode in precisions:
        if mode == "fp16":
            out.append(("fp16", {"precision": {"mode": "fp16"}, "grad_scaler": {"enabled": True}}))
            out.append(("fp16, no GradScaler", {"precision": {"mode": "fp16"}}))
        else:
            out.append((mode, {"precision": {"mode": mode}}))
    for layers in fp32_layers or []:
        for mode in precisions:
            if mode in ("fp16", "bf16"):
                knobs: dict[str, Any] = {"precision": {"mode": mode}, "fp32_layers": {"layers": layers}}
                if mode == "fp16":
                    knobs["grad_scaler"] = {"enabled": True}
                out.append((f"{mode}, fp32 {layers}", knobs))
    return out
