"""The worker side of an accuracy check (worker mode "accuracy"): train the FP32 reference and a
configuration on the same data in the same order, and compare one step's numerics. Returns raw
results; the study side (autotune.accuracy.study.gate) judges them."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Mapping

from autotune.accuracy.settings import AccuracySettings, describe_numerics, numerics_key, numerics_knobs


HELD_OUT_TOKENS = 65_536
"""Tokens of a language model's held-out split at most. Its FP32 reshuffle noise is not the
sampling of these: TinyLM's held-out loss moved 0.0023 nats (median of 3 seeds) between the two data
orders on 8,192 held-out tokens and 0.0031 on 32,768 (scripts/teacher_calibration.py, 100 steps of
16), while the forward passes over 1,024 sequences of a large language model would cost tens of seconds
(a forward is about a third of an FP32 step) in each of the check's runs."""


def run_check(request: Mapping[str, Any]) -> dict[str, Any]:
    """Worker mode "accuracy": train the FP32 reference (unless given) and the configuration,
    compare one step's numerics; return the raw results (judged by the study)."""
    from autotune.space import SearchSpace
    from autotune.workload.models import WorkloadSpec

    settings = AccuracySettings.from_dict(request["settings"])
    space = SearchSpace.from_dict(request["space"])
    spec = WorkloadSpec.from_dict(request["workload"])
    knobs = numerics_knobs(request["knobs"])
    reference = request.get("reference")
    data = datasets(spec, settings, space.device)
    if reference is None:
        reference = train_run(spec, {}, space, settings, data, label="FP32 reference")
        reference["numerics"] = step_numerics(spec, {}, space, settings, data)
        # FP32 again with the data in another order: how much a short run's result moves for
        # reasons that have nothing to do with precision; a drop within that is not a loss
        reshuffled = train_run(spec, {}, space, settings, data, order_seed=settings.seed + 1,
                               label="FP32 reference, reshuffled")
        reference["reshuffled"] = {k: reshuffled.get(k) for k in ("final_loss", "held_out_accuracy",
                                                                   "held_out_loss", "wall_s")}
        # what the reference was trained on: the study keeps it for later searches by these (reference_cache)
        reference.update(trained_on(space.device))
    if numerics_key(knobs) == numerics_key({}):
        run = dict(reference)
    else:
        run = train_run(spec, knobs, space, settings, data, label=describe_numerics(knobs))
        run["numerics"] = step_numerics(spec, knobs, space, settings, data)
    run["numerics_key"] = numerics_key(knobs)
    return {"status": "ok", "reference": reference, "run": run}


def trained_on(device: str) -> dict[str, str]:
    import torch

    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return {"device_name": name, "torch": torch.__version__}


def datasets(spec, settings: AccuracySettings, device: str, *, init_device: str = "cpu"):
    """The check's training (and held-out) data. ``init_device``: where the workload built for its
    batch maker and shapes is initialised, as seeded_workload's; a worker whose runs build the model
    on the GPU passes theirs, so that this build is the one their copies come from. Built on the CPU,
    a large model's weights would take seconds of the worker only for the data."""
    from autotune.workload.data import load_data

    workload = seeded_workload(spec, settings.seed, init_device=init_device)
    if workload.make_batch is not None and settings.data is None:
        return _workload_batches(workload, settings)
    return load_data(settings.data, input_shape=tuple(workload.input_shape), num_classes=workload.num_classes,
                     train_size=settings.steps * settings.batch_size, held_out_size=settings.held_out_size,
                     seed=settings.seed, device=device)


def _workload_batches(workload, settings: AccuracySettings):
    """A model with its own batch maker and no --data. A language model's (its inputs integer
    tokens below its num_classes, its targets the same tokens shifted by one or not) trains on
    sequences of a fixed random Markov teacher at its vocabulary and length, with a held-out split
    judged by its loss (autotune.workload.data.TeacherTokens). Any other memorises a fixed set of
    its own batches: no held-out set (its labels may be random), so the check compares training loss."""
    import torch
    from torch.utils.data import TensorDataset

    from autotune.errors import ConfigError
    from autotune.workload.data import Datasets, token_data

    g = torch.Generator().manual_seed(settings.seed)
    x, y = workload.make_batch(settings.batch_size * 4, g)
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise ConfigError("the workload's make_batch returns inputs that are not one tensor, so the accuracy "
                          "check cannot build data from it; pass --data package.module:factory")
    layout = _token_layout(x, y, workload.num_classes)
    if layout is not None:
        return token_data(workload.num_classes, x.shape[1], train_size=settings.steps * settings.batch_size,
                          held_out_size=held_out_sequences(settings, x.shape[1]), seed=settings.seed,
                          shifted=layout == "shifted", dtype=x.dtype)
    return Datasets(train=TensorDataset(x, y), held_out=None, num_classes=None,
                    source=f"{len(x)} fixed batches of the workload's make_batch (memorised; no held-out set)")


def held_out_sequences(settings: AccuracySettings, seq_len: int) -> int:
    """A language model's held-out sequences: ``settings.held_out_size``, fewer where that would
    pass HELD_OUT_TOKENS tokens (64 sequences of GPT-2's 1,024)."""
    return max(1, min(settings.held_out_size, math.ceil(HELD_OUT_TOKENS / seq_len)))


def _token_layout(x, y, vocab_size: int) -> str | None:
    """"shifted" (targets are the next tokens), "same" (the loss shifts) or None: not token batches."""
    import torch

    integers = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    if x.dim() != 2 or x.shape != y.shape or x.shape[1] < 2 or x.dtype not in integers or y.dtype not in integers:
        return None
    if int(x.min()) < 0 or int(y.min()) < 0 or max(int(x.max()), int(y.max())) >= vocab_size:
        return None
    if (x[:, 1:] == y[:, :-1]).all():
        return "shifted"
    return "same" if (x == y).all() else None


def _build(spec, knobs: Mapping[str, Any], space, settings: AccuracySettings):
    """The model from the seed (same initial weights every time), its recipe and loss."""
    import strategies

    workload = seeded_workload(spec, settings.seed)
    recipe = strategies.build_recipe(strategies.knobs_from_dict(dict(knobs)), space.device)
    return workload, recipe


_PRISTINE: dict[str, tuple[Any, Any]] = {}
"""A check worker's first build of a workload, untouched, with the CPU random state it left, by
workload and seed: a worker builds the model for each training run and each one-step comparison
(about 5 times), and a copy of these weights is what a seeded build would give again without
initialising them again (a 2-layer Llama of 0.67 billion parameters: seconds a build)."""
KEEP_SHARE = 0.25
"""A pristine copy is kept only while the model's weights take at most this share of the host's
available memory; a larger model is built again each time, as before."""


def seeded_workload(spec, seed: int, *, init_device: str = "cpu"):
    """``build(spec)`` after ``torch.manual_seed(seed)``, with the random state such a build leaves;
    from the second call on, a copy of the first build's model (see _PRISTINE). ``init_device``: as
    models.build's (an hf: model initialised on the GPU); the copy kept is on the CPU, so that it
    takes none of the card's memory."""
    import json

    import torch

    from autotune.workload.models import build

    key = json.dumps({"workload": spec.to_dict(), "seed": seed, "init_device": init_device}, sort_keys=True)
    torch.manual_seed(seed)  # every device's generator, as a fresh build finds them
    if key in _PRISTINE:
        pristine, rng = _PRISTINE[key]
        copied = _copied(pristine)
        if copied is not None:
            torch.set_rng_state(rng)
            return copied
    workload = build(spec, init_device=init_device)
    if _worth_keeping(workload.model):
        pristine = _copied(workload, to_cpu=True)
        if pristine is not None:  # a model deepcopy cannot copy is built every time
            _PRISTINE[key] = (pristine, torch.get_rng_state())
    return workload


def _copied(workload, *, to_cpu: bool = False):
    """``workload`` with a deep copy of its model (nothing else of it is changed by a run), on the
    CPU with ``to_cpu``; None where the model cannot be deep-copied (hooks holding handles, say)."""
    import copy
    import dataclasses

    try:
        model = copy.deepcopy(workload.model)
        return dataclasses.replace(workload, model=model.to("cpu") if to_cpu else model)
    except Exception:
        return None


def _worth_keeping(model) -> bool:
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    available = _available_host_bytes()
    return available is not None and size <= KEEP_SHARE * available


def _available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _one_optimizer_step(model, optimizer, scaler, loss_fn, recipe, x, y):
    """Forward, backward and the scaler's step on one batch: (the loss, whether the optimizer step
    was taken: the scaler did not lower its scale to skip it)."""
    from autotune.deploy import runtime
    from autotune.workload.models import logits

    optimizer.zero_grad(set_to_none=True)
    with runtime.autocast(recipe):
        loss = loss_fn(logits(model(x)), y)
    scaler.scale(loss).backward()
    scale_before = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(optimizer)
    scaler.update()
    return loss, scale_before is None or scaler.get_scale() >= scale_before


def max_retries(steps: int) -> int:
    """How many steps the GradScaler skipped are taken again on their batch in one run: enough for
    its calibration from the initial scale (16 halvings), bounded for a run that overflows throughout."""
    return max(16, steps // 4)


def train_run(spec, knobs: Mapping[str, Any], space, settings: AccuracySettings, data, *,
              order_seed: int | None = None, label: str = "training") -> dict[str, Any]:
    """``settings.steps`` optimizer steps of the configuration, then the held-out evaluation.
    ``order_seed`` draws another data order (same initial weights): the FP32 noise run. Its steps
    are told to the search's live line as ``label`` k/N (autotune.progress)."""
    from autotune import progress

    import torch

    from autotune.deploy import runtime
    from autotune.recipe import backend_flags
    from autotune.workload.data import batch_order, collate
    from strategies.loss_kernel import step_loss

    started = time.perf_counter()
    workload, recipe = _build(spec, knobs, space, settings)
    device = space.device
    with backend_flags(recipe.backend_flags):
        model = runtime.prepare_model(workload.model, recipe, set_flags=False)
        loss_fn = step_loss(model, workload.loss_fn, recipe)  # a fused linear cross-entropy where loss_kernel says so
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
        optimizer = runtime.prepare_optimizer(optimizer, recipe)  # torchao's 8-bit AdamW where optimizer_state says so
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
        losses, skipped, taken = [], 0, 0
        retries_left = max_retries(settings.steps)
        every = max(1, settings.steps // 50)
        for step, indices in enumerate(batch_order(len(data.train), settings.batch_size, settings.steps,
                                   settings.seed if order_seed is None else order_seed)):
            if step % every == 0:
                progress.say(label, step, settings.steps)
            x, y = to_device(collate(data.train, indices), device, recipe)
            # a step the scaler skipped (inf/NaN gradients) is taken again on the same batch at the
            # lowered scale, so the run makes FP32's optimizer steps on its batches and schedule: in a
            # short check the scaler's first skips (from 65,536 down) would otherwise be a share of it
            while True:
                loss, applied = _one_optimizer_step(model, optimizer, scaler, loss_fn, recipe, x, y)
                taken, skipped = taken + applied, skipped + (not applied)
                if applied or retries_left == 0:
                    break
                retries_left -= 1
            with warnings.catch_warnings():
                # after a step the GradScaler skipped, torch warns that the schedule moved first
                warnings.simplefilter("ignore", UserWarning)
                schedule.step()
            losses.append(loss.detach().float())
        curve = torch.stack(losses).cpu()
        params_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        progress.say(f"{label}: held-out evaluation")
        held = _evaluate(model, workload, recipe, data, settings, device)
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
        "retried_steps": max_retries(settings.steps) - retries_left,
        "taken_steps": taken,
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


def to_device(batch, device: str, recipe):
    import torch

    x, y = batch
    x = x.to(device)
    if x.dim() == 4 and recipe.memory_format is not torch.contiguous_format:
        x = x.contiguous(memory_format=recipe.memory_format)
    return x, y.to(device)


def _evaluate(model, workload, recipe, data, settings: AccuracySettings, device: str) -> dict[str, Any]:
    """Held-out loss (the mean of the loss function's batch means, by sample) and accuracy (percent;
    not where ``data.judged_by`` is "loss": a language model's next tokens), in eval mode under the
    configuration's autocast; nothing without a held-out set."""
    import torch

    from autotune.deploy import runtime
    from autotune.workload.data import eval_batches
    from autotune.workload.models import logits

    dataset = data.held_out
    if dataset is None:
        return {}
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad(), runtime.autocast(recipe):
        for batch in eval_batches(dataset, settings.batch_size):  # a batch the training run showed fits
            x, y = to_device(batch, device, recipe)
            out = logits(model(x))
            loss_sum += float(workload.loss_fn(out, y).float()) * len(y)
            correct += int((out.argmax(dim=-1) == y).sum())
            total += len(y)
    model.train()
    out = {"held_out_loss": loss_sum / total, "held_out_size": total}
    if data.judged_by == "accuracy":
        out["held_out_accuracy"] = 100.0 * correct / total
    return out


def step_numerics(spec, knobs: Mapping[str, Any], space, settings: AccuracySettings, data) -> dict[str, Any]:
    """One step from the same weights on the same batch: the configuration's loss and (unscaled)
    gradients against true FP32 and, where cheap, FP64."""
    import torch

    from autotune.workload.data import batch_order, collate

    indices = next(batch_order(len(data.train), settings.batch_size, 1, settings.seed))
    batch = collate(data.train, indices)
    loss, grads = _one_step(spec, knobs, space, settings, batch, torch.float32)
    if numerics_key(knobs) == numerics_key({}):
        ref_loss, ref_grads = loss, grads  # the FP32 reference itself: the same step again is the same
    else:
        ref_loss, ref_grads = _one_step(spec, {}, space, settings, batch, torch.float32)
    out = {"loss": loss, **_compare(loss, grads, ref_loss, ref_grads, "fp32")}
    if settings.fp64:
        loss64, grads64 = _one_step(spec, {}, space, settings, batch, torch.float64)
        out.update(_compare(loss, grads, loss64, grads64, "fp64"))
    return out


def _one_step(spec, knobs, space, settings, batch, dtype) -> tuple[float, Any]:
    """Loss and flattened gradients of one forward/backward (GradScaler applied, then unscaled)."""
    import torch

    from autotune.deploy import runtime
    from autotune.recipe import backend_flags
    from autotune.workload.models import logits
    from strategies.loss_kernel import step_loss

    workload, recipe = _build(spec, knobs, space, settings)
    device = space.device
    with backend_flags(recipe.backend_flags):
        model = runtime.prepare_model(workload.model, recipe, set_flags=False)
        if dtype is torch.float64:
            model = model.double()
        without_dropout(model)
        loss_fn = step_loss(model, workload.loss_fn, recipe)  # a fused linear cross-entropy where loss_kernel says so
        x, y = to_device(batch, device, recipe)
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
            torch.manual_seed(settings.seed)
            with runtime.autocast(recipe):
                loss = loss_fn(logits(model(x)), y)
            (loss * scale if scale != 1.0 else loss).backward()
            # one concatenation in the gradients' own dtype, then one conversion (not one per tensor)
            grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten()
                               for p in params]).double() / scale
            if scale <= 1.0 or bool(torch.isfinite(grads).all()):
                break
            scale /= 2
    return float(loss.detach().double()), grads.cpu()


def without_dropout(model) -> None:
    """Dropout off for the one-step comparison: the same seed draws other masks on a GPU once the
    dtype changes (fp32 against fp64 read 0.62 gradient cosine for hf:gpt2, dropout 0.1, on a GPU),
    and a comparison of two different masks measures the masks, not the numerics. Setting
    ``p`` (not eval()) also reaches attention dropout that reads its module's ``p`` (transformers)."""
    import torch

    kinds = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
             torch.nn.FeatureAlphaDropout)
    for module in model.modules():
        if isinstance(module, kinds):
            module.p = 0.0


def _compare(loss: float, grads, ref_loss: float, ref_grads, name: str) -> dict[str, Any]:
    import torch

    ref_norm = float(ref_grads.norm())
    norm = float(grads.norm())
    finite = bool(torch.isfinite(grads).all())
    # a dot product over the norms: torch.nn.functional.cosine_similarity took 4.5 s for two vectors
    # of 0.1 billion FP64 gradients on 2 CPU cores, this a tenth of a second
    cosine = float(torch.dot(grads, ref_grads)) / (norm * ref_norm) if finite and norm and ref_norm \
        else (1.0 if norm == ref_norm == 0 else float("nan"))
    return {
        f"loss_rel_error_vs_{name}": abs(loss - ref_loss) / max(abs(ref_loss), 1e-12),
        f"grad_norm_ratio_vs_{name}": norm / ref_norm if ref_norm else float("nan"),
        f"grad_cosine_vs_{name}": cosine,
        f"grad_rel_error_vs_{name}": float((grads - ref_grads).norm()) / ref_norm if ref_norm else float("nan"),
    }
