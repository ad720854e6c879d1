"""Numerics parity: a configuration's training against FP32's, from the same initial weights on the
same batches, judged by bands that harmless changes calibrate in the same run.

Runs of ``steps`` optimizer steps (AdamW, constant learning rate, dropout off), each through the
project's own training step (``runtime.TrainStep`` on the configuration's recipe, as
``TunedConfig.train_step`` builds it), so every knob's numerics are what is measured (precision,
GradScaler, fp32_layers, loss_kernel, optimizer_state and implementation, activation_checkpointing,
compile): the FP32 reference; ``calibrations`` FP32 runs that a rounding-sized difference moves (every
initial weight moved to one of its two bf16 neighbours at random, and every gradient rounded to bf16
stochastically at every step: GradientRounding; known to be harmless, they show how far this model's
own training carries such a difference); and the configuration. From each: the loss at every step,
and per parameter tensor its first gradient (unscaled, of the step taken: one the GradScaler skips is
taken again on its batch, as ``autotune.accuracy.worker.check`` does) and its update over the run,
``w_T - w_0`` (parity_grads). parity_verdict compares them with the reference's and judges each figure
by ``k`` x the calibrations' largest + a floor, a band wider than MAX_BAND judging nothing.

Why the update: on a BatchNorm ConvNet at batch 8 (torchvision ResNet-18) the calibrations move
each tensor's first gradient by 20-60% and its update's direction entirely (the network amplifies a
rounding by orders of magnitude), so no band on a first gradient or on the loss can be sharp there;
but an update's size stays within a few percent, and a weight that never moves where FP32's does
never moves in a calibration. So a frozen gain, gradients underflowed to zero (fp16 without loss
scaling), updates rounded away (weights in 16 bits or fewer with no FP32 master copy) and optimizer
states too coarse fail on every network, whatever its chaos (Micikevicius et al. 2018, "Mixed Precision
Training", name the first three as what FP32 master weights and loss scaling are for).

The calibration's size is a 16-bit format's rounding, not FP32's: a randomly initialised ResNet-50's
first gradients (batch 8, CPU) amplify rounding by about 10^5 through its BatchNorms, so one FP32 ulp
moved most of its tensors' gradients by 1.6-2.3% while bf16 autocast moved others by 56-81%. They are
bf16 steps, not a share of each weight: a head whose bias holds logits at 2**16 (tests'
broken_head_under_autocast) moved by 2**-9 of itself shifted its logits by 128 and its calibration's
loss by 86x; 2**16 is a bf16 value, which the calibration leaves as it is. The learning rate is small
for the same reason: at 1e-3 a ResNet-50's loss after 5 steps was 3.06 for FP32, 4.87 and 2.90 for
two calibrations (training itself is chaotic there); at 1e-4 they stayed within 1.1% of each other.

Taken from training frameworks: torchtitan's loss-converging guide (docs/converging.md) keeps the
data deterministic and the initial weights identical and compares a test run's loss curve with a
control's; Megatron-LM's functional tests compare per-step losses with golden values whose tolerances
come from the spread of repeated runs (compute_golden_statistics.py). Here the spread is measured in
the same run, by the calibrations, since the model is the user's. A NaN/Inf loss, gradient or weight
where FP32's are finite is "unstable".

Cost: a first verdict is ``2 + calibrations`` runs of ``steps`` steps and the first batch again
(ParitySettings.first_verdict_runs). Within a search the reference's sampled first gradients and
updates are kept in a file (GRAD_SAMPLE elements of a tensor at most, the same ones in every run), and
a later check is its own run. Across searches the reference's losses and the calibrations' figures
are kept (reference_cache), not its tensors: a check from the cache takes the reference's run again,
not its calibrations. A configuration whose first gradients are already out of band fails whatever
its other steps do: its run stops after its first step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

from autotune.accuracy.settings import MIN_STEPS, AccuracySettings
from autotune.accuracy.worker.parity_figures import progress_drift
from autotune.accuracy.worker.parity_grads import (
    GRAD_SAMPLE,
    RunTensors,
    grads_writer,
    read_grads,
)
from autotune.accuracy.worker.parity_verdict import (
    BF16_EPS,
    MAX_BAND,
    ParityResult,
    calibration_noise,
    gradients_out_of_band,
    judge,
)
from autotune.accuracy.worker.reference_file import reference_writer

RUN_PHASES: list[dict[str, Any]] = []
"""This worker's runs, each one's seconds by phase (its build, a calibration's move of the weights, the
first step with its gradients kept or compared, the other steps), with the steps it ran and whether it
stopped on its first gradients: what a check's seconds went to, returned by run_parity."""
FORMAT = 6
"""Part of the reference's cache key: bumped when what a parity reference holds changes (3: an hf:
model's initial weights are drawn on the device it trains on; 4: on a GPU it steps with fused AdamW;
5: the calibration's moves are drawn on the parameters' device, a chunk at a time; 6: several
calibrations, with each tensor's update and first-gradient figures). Not when the first gradients of
large tensors came to be compared on a sample (parity_grads.GRAD_SAMPLE): that estimates the same
figures, and the key is also the studies' (their verdicts are stored under it)."""
CALIBRATION_SEEDS = 104_729
"""Calibration i moves the weights with seed ``settings.seed + i * CALIBRATION_SEEDS`` (the first
as a single calibration did)."""


@dataclass(kw_only=True)
class ParitySettings:
    """How a parity check runs and what it accepts; fixed per study so that every check compares."""

    steps: int = 40
    """Optimizer steps of each run (the caller sizes them to its budget): long enough for what the
    optimizer's states and the weights' rounding do to the updates to show (40 of AdamW's first steps
    integrate the gradients' signs into an update far steadier than one step's gradient)."""
    batch_size: int = 16
    """The check's own batch size, the same for every run."""
    lr: float = 1e-4
    """Constant AdamW learning rate (no weight decay): small, so that the runs stay comparable (the
    module's docstring says why)."""
    seed: int = 0
    """Initial weights, data and data order; the calibrations' directions are drawn from it too."""
    data: str | None = None
    """As AccuracySettings.data: None (synthetic), an image folder, or package.module:factory."""
    calibrations: int = 2
    """FP32 runs moved by rounding-sized differences in other random directions (perturb_weights,
    GradientRounding); each figure's noise is the largest of theirs. One run's noise is itself noisy:
    on ResNet-18 at batch 8 one calibration's update-size figure for a BatchNorm gain ranged from 1%
    to 20% between directions."""
    k: float = 3.0
    """The band's multiple of the calibrations' noise (the largest of ``calibrations`` runs'), as
    Megatron-LM's golden values allow a multiple of repeated runs' spread."""
    loss_floor: float = 2 * BF16_EPS
    """Relative (windowed) loss difference accepted whatever the calibrations say (1.6%)."""
    grad_floor: float = 32 * BF16_EPS
    """Relative error of a first gradient accepted per tensor whatever the calibrations say (25%: four
    times Megatron-LM's deepest bf16 bound, for the check's small batch: under bf16
    autocast the ReLU gates that flip in a batch of 16 put one block's gradients 3.6-14% off FP32's
    over 20 seeds of scripts/parity_models.py's mlp)."""
    size_floor: float = 32 * BF16_EPS
    """How far (max(r, 1/r) - 1 of the norm ratio r) a tensor's first gradient or update may be from
    FP32's size whatever the calibrations say (25%, as a first gradient's error: bf16 autocast moved
    the size of ResNet-18's early BatchNorm tensors' first gradients by up to 16% and their updates by
    up to 33% where the calibrations moved them 1-6%; scripts/parity_calibration.py)."""
    share_floor: float = 0.02
    """Share of a tensor's elements that may vanish (first gradient) or stall (update) where FP32's
    did not, whatever the calibrations say (and SHARE_ELEMENTS elements at least): bf16 autocast
    zeroed one element of a 128-element bias (a unit dead in its batch); fp16 without loss scaling
    on ResNet-18's loss x 2**-14 zeroed 6-7% of a BatchNorm bias's first gradient, all of them at
    2**-22 (Micikevicius et al. 2018 measured such a flush to zero as the harm loss scaling avoids)."""
    drift_floor: float = 0.25
    """Share of FP32's progress on the first batch a run may lose whatever the calibrations say: over
    20 seeds of parity_models' wide_linear (loss down 0.03 in 20 steps at lr 1e-4) bf16 autocast lost
    up to 7.5% of it, bf16 weights without an FP32 master copy all of it."""
    max_band: float = MAX_BAND
    """The widest band a figure is judged by; a noisier figure is reported, not judged."""

    def __post_init__(self) -> None:
        from autotune.errors import ConfigError

        for wrong, words in ((self.steps < 1, f"needs at least one step, got {self.steps}"),
                             (self.batch_size < 1, f"needs a batch of at least 1, got {self.batch_size}"),
                             (not self.lr > 0, f"needs a positive learning rate, got {self.lr}"),
                             (self.calibrations < 1, f"needs at least one calibration, got {self.calibrations}"),
                             (not min(self.k, self.loss_floor, self.grad_floor, self.drift_floor, self.size_floor,
                                      self.share_floor) >= 0, "band's k and floors must be >= 0"),
                             (not 0 < self.max_band, f"needs a positive widest band, got {self.max_band}")):
            if wrong:
                raise ConfigError(f"the parity check {words}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParitySettings":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def fingerprint(self) -> str:
        """What makes two runs comparable (not the band, which only judges them), marked as a parity
        run's so that a cache shared with the accuracy check never mixes the two (reference_key)."""
        run = {k: v for k, v in self.to_dict().items() if k not in BAND_FIELDS}
        run["kind"] = f"parity-{FORMAT}"
        return hashlib.sha1(json.dumps(run, sort_keys=True).encode()).hexdigest()[:10]

    def data_settings(self) -> AccuracySettings:
        """Accuracy-check settings that make this check's training data (``check.datasets``)."""
        # at least 2 a batch, as the held-out check's: a parity run at batch 1 (a 1B model under a
        # 24 GiB cap) draws its batches from that data one sample at a time
        return AccuracySettings(steps=max(MIN_STEPS, self.steps), batch_size=max(2, self.batch_size), held_out_size=1,
                                seed=self.seed, data=self.data, fp64=False)

    @property
    def first_verdict_runs(self) -> int:
        """Runs of a first verdict, each ``steps`` steps and the first batch again: the reference, the
        calibrations and the configuration (parity_gate.parity_plan's cost)."""
        return 2 + self.calibrations

    def step_equivalents(self, *, reference_kept: bool) -> int:
        """Training steps one check takes: the configuration's run (its steps and the first batch
        again), and, unless the reference's gradients and updates are kept, the reference's run
        (its figures kept, as the cache keeps them) or the reference's and the calibrations' (none)."""
        run = self.steps + (1 if self.steps > 1 else 0)
        return run + (0 if reference_kept else (self.first_verdict_runs - 1) * run)


BAND_FIELDS = ("k", "loss_floor", "grad_floor", "size_floor", "share_floor", "drift_floor", "max_band")
"""ParitySettings' fields that only judge runs (not part of what makes two runs comparable)."""


# ---------------------------------------------------------------------------------------------
# one run


PERTURB_CHUNK = 1 << 24
"""Elements of a parameter moved at a time (perturb_weights): 64 MiB of draws a chunk."""


def perturb_weights(model, seed: int):
    """``model`` with every floating-point parameter moved to one of its two bf16 neighbours, down
    (towards zero) or up at random, drawn from ``seed`` by a generator of its own on the parameter's
    device (the global random state is untouched); a value bf16 holds exactly stays. A model transform:
    the calibration's change, and with another seed a control's. In place, on the device, a chunk at a
    time: on the host, a 1.2B-parameter model's draws alone took about 5 s (torch.rand on a CPU is one
    thread: 0.25 s for 66M here), and the parameters went to the host and back (10 GB)."""
    import torch

    generators: dict = {}
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype != torch.float32:
                continue
            g = generators.get(p.device)
            if g is None:
                g = generators[p.device] = torch.Generator(device=p.device).manual_seed(seed + 7919)
            flat = p.detach()
            bits = (flat if flat.is_contiguous() else flat.contiguous()).view(-1).view(torch.int32)
            for start in range(0, bits.numel(), PERTURB_CHUNK):
                part = bits[start:start + PERTURB_CHUNK]
                low = part & 0xFFFF  # the bits bf16 drops; clearing them moves the value towards zero
                up = (torch.rand(part.shape, generator=g, device=part.device) < 0.5) & (low != 0)
                part.sub_(low).add_(up.to(torch.int32) << 16)  # and one bf16 step away from zero
            if not flat.is_contiguous():
                p.copy_(bits.view(torch.float32).view(p.shape))
    return model


class GradientRounding:
    """An optimizer step pre-hook of a calibration: every gradient element rounded to one of its two
    bf16 neighbours at random, in proportion to its distance from each (stochastic rounding: unbiased),
    drawn from ``seed`` by a generator of its own on the gradient's device. A rounding-sized difference
    at every step, as a 16-bit format's compute makes, where the moved initial weights make one at the
    start: on a BatchNorm network a difference made once grows slower than one made every step (on
    ResNet-18 at batch 8 bf16 autocast moved a BatchNorm gain's update by 30% where calibrations that
    moved only the initial weights moved it by 5%). Unbiased, and a gradient rounded to bf16 with FP32
    master weights trains like FP32 (Micikevicius et al. 2018): harmless."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.generators: dict = {}

    def __call__(self, optimizer, args, kwargs) -> None:
        import torch

        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None or p.grad.dtype != torch.float32 or not p.grad.is_contiguous():
                        continue
                    g = self.generators.get(p.grad.device)
                    if g is None:
                        g = self.generators[p.grad.device] = torch.Generator(device=p.grad.device).manual_seed(
                            self.seed + 15485863)
                    bits = p.grad.view(-1).view(torch.int32)
                    for start in range(0, bits.numel(), PERTURB_CHUNK):
                        part = bits[start:start + PERTURB_CHUNK]
                        noise = torch.randint(0, 1 << 16, part.shape, generator=g, device=part.device,
                                              dtype=torch.int32)
                        finite = (part & 0x7F800000) != 0x7F800000
                        part.copy_(torch.where(finite, (part + noise) & ~0xFFFF, part))


def _one_run(spec, recipe, settings: ParitySettings, data, *, steps: int, reference_tensors=None,
             calibration: Mapping[str, Any] | None = None, perturb: int | None = None) -> dict[str, Any]:
    """``steps`` steps of ``recipe`` from the seeded initial weights on the check's batches (moved
    to bf16 neighbours drawn from the seed ``perturb`` where given: a calibration): each step's loss,
    the first step's gradients and each tensor's update over the ``steps`` steps (kept, or compared
    with ``reference_tensors``: parity_grads.RunTensors). Stops at the first NaN/Inf loss, and, given
    the reference's ``calibration`` (a configuration's run, never the reference's or a calibration's),
    after the first step where its gradients are already out of band (``stopped``: "gradients"): the
    verdict is then "violated" whatever the other steps do, and a run that breaks its first gradients
    (fp8 on every layer of a 1B Llama, fp16 gradients underflowing) costs one step, not ``steps``."""
    import torch

    from autotune.accuracy.worker.check import seeded_workload, to_device, without_dropout
    from autotune.deploy import runtime
    from autotune.recipe import backend_flags
    from autotune.workload.data import batch_order, collate

    started = time.perf_counter()
    workload = seeded_workload(spec, settings.seed, init_device=recipe.device)
    if recipe.device == "cuda":
        # the run before's model and states, and what building on the GPU freed, back to the card (as
        # the trial worker does after its build): under --memory-limit they stayed reserved in blocks
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    names = {id(p): n for n, p in workload.model.named_parameters()}
    built = time.perf_counter()
    if perturb is not None:
        # on the card: a copy of the cached build is on the host, and the parameters go to the card anyway
        perturb_weights(workload.model.to(recipe.device), perturb)
    perturbed = stepped = time.perf_counter()
    with backend_flags(recipe.backend_flags):
        model = runtime.prepare_model(workload.model, recipe, set_flags=False)
        without_dropout(model)  # the numerics, not the masks (check.step_numerics says why)
        optimizer = runtime.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=settings.lr,
                                                                weight_decay=0.0), recipe)
        tensors = RunTensors(names, reference_tensors, settings.seed)
        handle = optimizer.register_step_pre_hook(tensors)
        if perturb is not None:  # after RunTensors: the first gradients read are the step's own
            rounding = optimizer.register_step_pre_hook(GradientRounding(perturb))
        step = runtime.TrainStep(model, optimizer, workload.loss_fn, recipe)
        losses, skipped, retries, stopped = [], 0, max_retries(steps), None
        torch.manual_seed(settings.seed)
        order = list(batch_order(len(data.train), settings.batch_size, steps, settings.seed))
        # the first batch again after the run: its loss then, against the first step's, is what the
        # run learnt (progress_drift); the update of that extra step is not used
        for i, indices in enumerate(order + order[:1] if steps > 1 else order):
            x, y = to_device(collate(data.train, indices), recipe.device, recipe)
            while True:
                before = step.scaler.get_scale() if step.scaler.is_enabled() else None
                loss = float(step(x, y).float())
                if before is None or step.scaler.get_scale() >= before or retries == 0 or not math.isfinite(loss):
                    break
                skipped, retries = skipped + 1, retries - 1  # skipped by the scaler: again, at its lower scale
            losses.append(loss)
            if tensors.active:  # the first gradients are final: a step the scaler skipped was taken again
                stepped = time.perf_counter()
                logged(f"run {len(RUN_PHASES) + 1}: built in {built - started:.2f} s, "
                       f"first step in {stepped - perturbed:.2f} s")
                worst = gradients_out_of_band(tensors.sums, calibration, settings) if calibration else None
                if worst is not None and math.isfinite(loss):
                    stopped = "gradients"
                    logged(f"run {len(RUN_PHASES) + 1}: stopped: first gradients out of band (worst {worst})")
            tensors.active = False
            if i == steps - 1:
                tensors.finish(optimizer)  # the updates of the run's steps, before the first batch again
            if not math.isfinite(loss) or stopped:
                break
        handle.remove()
        if perturb is not None:
            rounding.remove()
    end = time.perf_counter()
    RUN_PHASES.append({"build": round(built - started, 2), "perturb": round(perturbed - built, 2),
                       "first step": round(stepped - perturbed, 2), "steps": round(end - stepped, 2),
                       "steps_run": len(losses), "compared": reference_tensors is not None, "stopped": stopped})
    logged(f"run {len(RUN_PHASES)}: {json.dumps(RUN_PHASES[-1])}")
    return {"losses": losses, "tensors": tensors.kept, "sums": tensors.sums, "skipped": skipped, "stopped": stopped,
            "wall_s": end - started}


def logged(words: str) -> None:
    """A line in the worker's log (its stderr) as it happens: a check the budget cuts returns nothing,
    and its log is then all that says where its seconds went."""
    import sys

    print(f"parity: {words}", file=sys.stderr, flush=True)


def max_retries(steps: int) -> int:
    """Steps the GradScaler skipped that a run takes again: its calibration from 65,536 down (16
    halvings), bounded for a run whose gradients overflow throughout."""
    return max(16, steps // 4)


# ---------------------------------------------------------------------------------------------
# the check


def parity_recipe(knobs: Mapping[str, Any], device: str):
    """The configuration's recipe as the check runs it: one optimizer step a call (the check's batch
    is its own: no gradient accumulation), one process (no DDP)."""
    import strategies

    recipe = strategies.build_recipe(strategies.knobs_from_dict(dict(knobs)), device)
    recipe.accumulation_steps = 1
    recipe.ddp, recipe.ddp_world_size = None, 1
    return recipe


def reference_knobs(device: str) -> dict[str, Any]:
    """The FP32 reference's knobs: the defaults, with fused AdamW on a GPU. A foreach step holds a new
    FP32 tensor a parameter that the fused one never makes (4.6 GiB for the 1B Llama, whose FP32 step
    at batch 1 peaked at 23.9 GiB of a 24 GiB cap), and the plain recipe, which the configurations
    checked grow from, steps fused too. The same FP32 update, rounded in another order."""
    return {"optimizer": {"implementation": "fused", "set_to_none": True}} if device == "cuda" else {}


def train_reference(spec, settings: ParitySettings, device: str, data) -> tuple[dict[str, Any], dict[str, Any]]:
    """The FP32 reference's losses and its calibrations' figures (what the cache keeps, JSON), and
    the reference's first gradients and updates (parity_grads.RunTensors.kept: sampled, CPU; not kept
    across searches)."""
    from autotune.accuracy.worker.check import trained_on

    fp32 = parity_recipe(reference_knobs(device), device)
    ref = _one_run(spec, fp32, settings, data, steps=settings.steps)
    cals = [_one_run(spec, fp32, settings, data, steps=settings.steps, reference_tensors=ref["tensors"],
                     perturb=settings.seed + i * CALIBRATION_SEEDS) for i in range(settings.calibrations)]
    reference = {
        "losses": ref["losses"],
        "calibration": calibration_noise(cals, ref["losses"], settings.steps),
        "settings": settings.to_dict(),
        "wall_s": round(ref["wall_s"] + sum(c["wall_s"] for c in cals), 3),
        **trained_on(device),
    }
    return reference, ref["tensors"]


def check_parity(spec, knobs: Mapping[str, Any], settings: ParitySettings, *, device: str = "cpu",
                 reference: Mapping[str, Any] | None = None, reference_tensors: Mapping[str, Any] | None = None,
                 recipe=None, label: str | None = None, on_reference=None, on_tensors=None
                 ) -> tuple[ParityResult, dict[str, Any]]:
    """Judge the configuration ``knobs`` (knob name -> its values, as recorded; or a ``recipe`` the
    caller built) against FP32 on the model of ``spec`` (a WorkloadSpec). ``reference``: an earlier
    check's (or the cache's) for these settings and device, else it is trained here, and handed to
    ``on_reference`` before the configuration runs. ``reference_tensors``: that reference's first
    gradients and updates as the check keeps them (parity_grads.RunTensors: sampled), else the FP32
    reference's run is taken again for them (its calibrations are not) and they are handed to
    ``on_tensors``. Returns the result and the reference (the gate keeps it:
    autotune.accuracy.study.reference_cache)."""
    from autotune.accuracy.settings import describe_numerics
    from autotune.accuracy.worker.check import datasets

    started = time.perf_counter()
    data = datasets(spec, settings.data_settings(), device, init_device=device)  # as the runs build it (_one_run)
    logged(f"data in {time.perf_counter() - started:.2f} s")
    taken = reference_tensors is None or reference is None  # the reference's tensors, taken here
    if reference is None:
        reference, reference_tensors = train_reference(spec, settings, device, data)
        reference["reference_source"] = "trained"
        if on_reference is not None:
            on_reference(reference)
    elif reference_tensors is None:
        reference_tensors = _one_run(spec, parity_recipe(reference_knobs(device), device), settings, data,
                                     steps=settings.steps)["tensors"]
    if taken and on_tensors is not None:
        on_tensors(reference_tensors)
    recipe = recipe if recipe is not None else parity_recipe(knobs, device)
    run = _one_run(spec, recipe, settings, data, steps=settings.steps, reference_tensors=reference_tensors,
                   calibration=reference["calibration"])  # out of band on its first gradients: stops there
    result = judge(run, reference, settings, label=label or describe_numerics(knobs),
                   seconds=time.perf_counter() - started)
    return result, dict(reference)


def run_parity(request: Mapping[str, Any]) -> dict[str, Any]:
    """A worker mode ("parity"), as check.run_check is "accuracy": request {"workload": spec dict,
    "device", "knobs", "settings", "reference": a kept one or None, "reference_only": train the
    reference alone, "grads_path": where the reference's first gradients and updates are kept between
    checks (read where the file exists and the reference is given, else written)}; returns {"status":
    "ok", "result": ParityResult dict (None for the reference alone), "reference": the reference
    (trained here, or the one given), "runs": RUN_PHASES, "in_worker_s": this function's seconds}.
    The check's seconds less ``in_worker_s`` are the worker's start, hand-over and exit;
    ``in_worker_s`` less the runs' phases, its set-up (data). The worker that serves it (autotune.worker.serve)
    has capped its memory at the request's ``memory_limit_bytes`` first, as for a trial."""
    from autotune.workload.models import WorkloadSpec

    entered = time.perf_counter()
    RUN_PHASES.clear()
    settings = ParitySettings.from_dict(request["settings"])
    spec = WorkloadSpec.from_dict(request["workload"])
    device = request.get("device", "cpu")
    grads_path = request.get("grads_path")
    kept = read_grads(grads_path) if grads_path and request.get("reference") is not None else None
    on_tensors = grads_writer(grads_path) if grads_path and kept is None else None
    if request.get("reference_only"):  # FP32's numerics: the reference is their run
        from autotune.accuracy.worker.check import datasets

        data = datasets(spec, settings.data_settings(), device, init_device=device)  # as the runs build it (_one_run)
        reference, tensors = train_reference(spec, settings, device, data)
        if on_tensors is not None:
            on_tensors(tensors)
        return {"status": "ok", "result": None, "reference": {**reference, "reference_source": "trained"},
                "runs": list(RUN_PHASES), "in_worker_s": round(time.perf_counter() - entered, 2)}
    result, reference = check_parity(spec, request.get("knobs") or {}, settings, device=device,
                                     reference=request.get("reference"), reference_tensors=kept,
                                     label=request.get("label"), on_tensors=on_tensors,
                                     on_reference=reference_writer(request.get("reference_path"),
                                                                  lambda path: logged(f"reference written to {path}")))
    return {"status": "ok", "result": result.to_dict(), "reference": reference, "runs": list(RUN_PHASES),
            "in_worker_s": round(time.perf_counter() - entered, 2)}
