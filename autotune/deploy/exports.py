"""Exports: a tuned configuration in the words of Hugging Face, Lightning and accelerate.

    cfg = autotune.load("runs/resnet50-h200/config.json")
    kwargs, unsupported = cfg.hf_training_args()          # TrainingArguments(output_dir=..., **kwargs)
    exp = cfg.lightning()                                  # Trainer(**exp.trainer_kwargs, max_epochs=...)
    exp = cfg.accelerate_config()                          # exp.yaml for `accelerate launch --config_file`

Each target expresses part of a configuration with its own options; the rest is listed in the
export's ``unsupported`` ({"setting", "value", "why"}, the why saying what to do instead), never
dropped silently. Only settings that differ from PyTorch's untuned behaviour are listed: an
untuned value needs nothing. The frameworks are imported only where an export builds their
objects (the Lightning callback), so autotune runs without them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import strategies
from autotune.recipe import Recipe
from autotune.errors import ConfigError
from autotune.workload.hub import HF_PREFIX, hub_name
from strategies import activation_checkpointing as checkpointing
from strategies import allocator

TARGETS = ("hf", "lightning", "accelerate")

# torch.amp.GradScaler's defaults: a scaler tuned to these needs no option in any framework
SCALER_DEFAULTS = {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


class HFExport(NamedTuple):
    """``TrainingArguments`` keyword arguments and what they cannot express."""

    training_args: dict[str, Any]
    unsupported: list[dict[str, Any]]


class LightningExport(NamedTuple):
    """A Lightning ``Trainer``'s precision and keyword arguments (the callback among them), the
    DataLoader keyword arguments (the Trainer takes your loader as built), and what is left."""

    precision: str
    callback: Any
    trainer_kwargs: dict[str, Any]
    dataloader_kwargs: dict[str, Any]
    unsupported: list[dict[str, Any]]


class AccelerateExport(NamedTuple):
    """An accelerate config file (as a dict and as YAML text), the ``Accelerator``, DataLoader and
    optimizer keyword arguments your script passes, and what none of them can express."""

    config: dict[str, Any]
    yaml: str
    accelerator_kwargs: dict[str, Any]
    ddp_kwargs: dict[str, Any] | None
    dataloader_kwargs: dict[str, Any]
    optimizer_kwargs: dict[str, Any]
    unsupported: list[dict[str, Any]]


def require(package: str, module: str | None = None) -> Any:
    """Import a framework an export needs, or say which package to install."""
    import importlib

    try:
        return importlib.import_module(module or package)
    except ImportError as exc:
        raise ConfigError(f"this export needs the {package!r} package ({exc}); install it with "
                          f"`pip install {package}`") from None


def knob_values(cfg: Any) -> dict[str, dict[str, Any]]:
    """Every knob's recorded values, untuned defaults filled in for knobs this space lacks."""
    return strategies.with_untuned(strategies.knobs_to_dict(cfg.knobs))


def item(setting: str, value: Any, why: str) -> dict[str, Any]:
    """One entry of an export's ``unsupported`` list."""
    return {"setting": setting, "value": value, "why": why}


def tuned_scaler(values: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The GradScaler settings that differ from torch's defaults (empty without loss scaling)."""
    scaler = values["grad_scaler"]
    if not scaler.get("enabled"):
        return {}
    return {k: scaler[k] for k, default in SCALER_DEFAULTS.items() if scaler.get(k, default) != default}


def ddp_kwargs(values: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """DistributedDataParallel keyword arguments of a ``--ddp N`` configuration; None without DDP."""
    ddp = values["ddp"]
    if ddp.get("world_size", 1) <= 1:
        return None
    return {k: ddp[k] for k in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph")}


def _fp8_layers(values: dict[str, dict[str, Any]]) -> str:
    """The layers fp8 trains (strategies.fp8_layers): "all" for a configuration recorded before the knob."""
    return (values.get("fp8_layers") or {}).get("layers", "all")


def _fp8_layers_arg(values: dict[str, dict[str, Any]]) -> str:
    """``, layers="feed-forward"`` where fp8 trains those alone (strategies.fp8_layers); else nothing."""
    layers = _fp8_layers(values)
    return "" if layers == "all" else f', layers="{layers}"'


# what no framework option covers, by setting: (tuned?, why). The why names the framework's own way
# where there is one; an export leaves out the settings it does express.
def _common_unsupported(values: dict[str, dict[str, Any]], target: str) -> list[dict[str, Any]]:
    checks: list[tuple[str, Any, bool, str]] = [
        (strategies.precision.MODE_PARAM, values["precision"]["mode"], values["precision"]["mode"] == "fp8",
         f"{target} has no float8 training option: its bf16 mixed precision is set; convert the Linear layers with "
         f"strategies.precision.to_float8_training(model{_fp8_layers_arg(values)}) (torchao) before training"),
        (strategies.memory_format.FORMAT_PARAM, values["memory_format"]["format"],
         values["memory_format"]["format"] != "contiguous",
         f"{target} has no memory-format option: call model.to(memory_format=torch.channels_last) before training "
         "(a channels_last model's convolutions then run channels_last)"),
        (strategies.channel_alignment.MULTIPLE_PARAM, values["channel_alignment"]["multiple"],
         values["channel_alignment"]["multiple"] > 1,
         f"{target} cannot change the model's layers: pad them with cfg.prepare(model) (or "
         "strategies.channel_alignment.align_channels) before training"),
        (strategies.depthwise_conv.INPUT_GRAD_PARAM, values["depthwise_conv"]["input_grad"],
         values["depthwise_conv"]["input_grad"] != "framework",
         f"{target} cannot change the model's layers: swap its depthwise convolutions with cfg.prepare(model) (or "
         "strategies.depthwise_conv.flip_input_grad) before training"),
        (strategies.stem_conv.STEM_PARAM, values["stem_conv"]["stem"], values["stem_conv"]["stem"] != "framework",
         f"{target} cannot change the model's layers: swap its stem convolution with cfg.prepare(model) (or "
         "strategies.stem_conv.space_to_depth) before training"),
        (strategies.fp32_layers.LAYERS_PARAM, values["fp32_layers"]["layers"],
         values["fp32_layers"]["layers"] != "none",
         f"{target}'s autocast covers the whole model: keep those layers in FP32 with "
         "strategies.fp32_layers.keep_fp32(model, kinds) before training"),
        (strategies.cudnn.BENCHMARK_PARAM, values["cudnn"]["benchmark"], bool(values["cudnn"]["benchmark"]),
         f"{target} has no cudnn.benchmark option: set torch.backends.cudnn.benchmark = True in your script"),
        (strategies.streams.NUM_STREAMS_PARAM, values["streams"]["num_streams"], values["streams"]["num_streams"] > 1,
         f"{target} copies each batch on the compute stream: there is no side-stream copy of the next batch "
         "(pin_memory=True still makes the copy asynchronous)"),
        (strategies.threads.NUM_THREADS_PARAM, values["threads"]["num_threads"], values["threads"]["num_threads"] > 0,
         f"{target} has no thread-count option: call torch.set_num_threads(N) in your script"),
        (strategies.cuda_graphs.ENABLED_PARAM, values["cuda_graphs"]["enabled"], bool(values["cuda_graphs"]["enabled"]),
         f"{target} runs the step eagerly: capturing the whole step in one CUDA graph needs cfg.train_step "
         f"(compile mode reduce-overhead is the nearest {target} has)"),
        (strategies.compile.MODE_PARAM, values["compile"]["mode"], values["compile"]["mode"] == "regional",
         f"{target} compiles the whole model or nothing: compile its repeated blocks with "
         "strategies.compile.compile_regions(model) before training (Lightning's callback does it)"),
        (strategies.optimizer.SET_TO_NONE_PARAM, values["optimizer"]["set_to_none"],
         not values["optimizer"]["set_to_none"],
         f"{target} clears gradients with zero_grad() (set_to_none=True); zeroing in place needs your own step"),
        (strategies.loss_kernel.KERNEL_PARAM, values["loss_kernel"]["kernel"],
         values["loss_kernel"]["kernel"] != "framework",
         f"{target} computes the loss your code computes: make it liger-kernel's fused linear cross-entropy with "
         "loss_fn = strategies.loss_kernel.fused_loss(model, loss_fn) once the model is prepared (Lightning: in "
         "setup); the model then returns its LM head's input in training mode, which that loss_fn takes"),
        (strategies.llm_kernels.KERNELS_PARAM, values["llm_kernels"]["kernels"],
         values["llm_kernels"]["kernels"] != "framework",
         f"{target} runs the model's layers as transformers writes them: bind liger-kernel's RMSNorm, RoPE and SwiGLU "
         "kernels with strategies.llm_kernels.apply_liger(model) before training (liger's "
         "apply_liger_kernel_to_<model type>(model=model), its losses off)"),
        (checkpointing.EVERY_PARAM, values["activation_checkpointing"]["every"],
         values["activation_checkpointing"]["every"] > 0,
         f"{target} has no activation-checkpointing option: call "
         f"{checkpointing.CODE.format(every=values['activation_checkpointing']['every'])} before training "
         "(transformers models: through their own activation_checkpointing_enable)"),
        (strategies.optimizer_state.STATE_PARAM, values["optimizer_state"]["state"],
         values["optimizer_state"]["state"] != "full",
         f"{target} takes the optimizer your code builds: keep its Adam states in 8 bits with "
         f"optimizer = strategies.optimizer_state.rebuild(optimizer, {values['optimizer_state']['state']!r}) "
         "(torchao's or bitsandbytes' AdamW8bit, same param groups "
         "and hyperparameters) where you build it (Lightning: in configure_optimizers)"),
        (allocator.EXPANDABLE_SEGMENTS_PARAM, values["allocator"]["expandable_segments"],
         bool(values["allocator"]["expandable_segments"]),
         f"{target} has no CUDA allocator option: {allocator.ENVIRONMENT_FIX} (autotune.load(CONFIG) sets it too, "
         "for what the process allocates after it)"),
    ]
    return [item(setting, value, why) for setting, value, tuned, why in checks if tuned]


def unsupported(cfg: Any, target: str, expressed: set[str]) -> list[dict[str, Any]]:
    """The tuned settings ``target`` has no option for, leaving out those named in ``expressed``."""
    return [u for u in _common_unsupported(knob_values(cfg), target) if u["setting"] not in expressed]


# Hugging Face ------------------------------------------------------------------------------------


HF_OPTIMIZER_CLASS = "torch.optim.adamw.AdamW"
"""The optimizer class TrainingArguments(optim=...) names build (its adamw_* variants), as the probe
names classes (strategies.optimizer_state.class_name)."""


def optimizer_kwargs(implementation: str) -> dict[str, bool]:
    """The keyword arguments that build an optimizer of a tuned implementation ({} for PyTorch's default)."""
    return {"plain": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}.get(implementation, {})


def optimizer_words(implementation: str) -> str:
    """How to build an optimizer of a tuned implementation, in words: "fused=True"."""
    kwargs = optimizer_kwargs(implementation)
    return ", ".join(f"{k}={v}" for k, v in kwargs.items()) if kwargs else "PyTorch's default implementation"


def hf_optimizer(implementation: str, device: str) -> str | None:
    """TrainingArguments(optim=...) for an optimizer implementation; None where no name says it.

    The Trainer builds AdamW itself: "adamw_torch_fused" is fused=True, "adamw_torch" is PyTorch's
    untuned choice (foreach on a GPU, the plain loop on a CPU); nothing picks the other one."""
    untuned = "foreach" if device == "cuda" else "plain"
    if implementation == "fused":
        return "adamw_torch_fused"
    if implementation in ("default", untuned):
        return "adamw_torch"
    return None


def hf_training_args(cfg: Any) -> HFExport:
    """``transformers.TrainingArguments`` keyword arguments for ``cfg`` (add output_dir and your own)."""
    values = knob_values(cfg)
    mode = values["precision"]["mode"]
    args: dict[str, Any] = {"bf16": mode in ("bf16", "fp8"), "fp16": mode == "fp16"}  # fp8: see unsupported
    if cfg.device == "cuda":
        # autotune's fp32 is true FP32 (TF32 off for cuDNN too); every other mode lets TF32 in
        args["tf32"] = mode != "fp32"
    else:
        args["use_cpu"] = True
    args["per_device_train_batch_size"] = cfg.batch_size
    args["gradient_accumulation_steps"] = cfg.accumulation_steps
    loader = cfg.dataloader_kwargs()
    args.update(dataloader_num_workers=loader.get("num_workers", 0), dataloader_pin_memory=loader["pin_memory"],
                dataloader_drop_last=loader.get("drop_last", True))
    if loader.get("num_workers", 0) > 0:
        args.update(dataloader_prefetch_factor=loader["prefetch_factor"],
                    dataloader_persistent_workers=loader.get("persistent_workers", False))
    compile_mode = values["compile"]["mode"]
    args["torch_compile"] = compile_mode not in ("off", "regional")  # regional: listed as not expressed
    if args["torch_compile"]:
        args.update(torch_compile_backend="inductor", torch_compile_mode=compile_mode)
    out = unsupported(cfg, "TrainingArguments", expressed={
        strategies.optimizer_state.STATE_PARAM, strategies.loss_kernel.KERNEL_PARAM, strategies.llm_kernels.KERNELS_PARAM,
        checkpointing.EVERY_PARAM})
    implementation = values["optimizer"]["implementation"]
    optim = hf_optimizer(implementation, cfg.device)
    state = values["optimizer_state"]["state"]
    if state != "full":  # its implementation is then "default": nothing else to say
        # the Trainer's torchao.optim.AdamW8bit (block size 256, as measured), or bitsandbytes' AdamW8bit
        optim = "adamw_bnb_8bit" if state == "8bit-bnb" else "adamw_torch_8bit"
    measured = (cfg.info.get("optimizer") or {}).get("class")
    if measured is not None and measured != HF_OPTIMIZER_CLASS:
        # optim names the Trainer's AdamW variants: one for another class would change what was measured
        name = measured.rsplit(".", 1)[-1]
        how = (f"then optimizer = strategies.optimizer_state.rebuild(optimizer, {state!r}) for its 8-bit states"
               if state != "full" else f"built with {optimizer_words(implementation)}")
        out.append(item("optimizer.class", measured,
                        f"the search measured {name} and TrainingArguments(optim=...) builds an AdamW: pass your "
                        f"{name} with Trainer(optimizers=(optimizer, None)), {how}"))
    elif optim is not None:
        args["optim"] = optim
    else:
        out.append(item(strategies.optimizer.IMPLEMENTATION_PARAM, implementation,
                        f"TrainingArguments(optim=...) offers AdamW fused or as PyTorch defaults it, not "
                        f"{implementation}: pass your own optimizer with Trainer(optimizers=(optimizer, None))"))
    checkpointing_args, why = checkpointing.hf_training_args(values["activation_checkpointing"]["every"])
    args.update(checkpointing_args)  # what the Trainer passes to the model's activation_checkpointing_enable
    if why:
        out.append(item(checkpointing.EVERY_PARAM, values["activation_checkpointing"]["every"], why))
    out += hf_liger(cfg, values, args)
    scaler = tuned_scaler(values)
    if scaler:
        out.append(item("grad_scaler", scaler, "the Trainer's fp16 loss scaling uses torch's GradScaler defaults: "
                                               "no TrainingArguments option sets them"))
    ddp = ddp_kwargs(values)
    if ddp is not None:
        args.update(ddp_bucket_cap_mb=ddp["bucket_cap_mb"], ddp_static_graph=ddp["static_graph"])
        if ddp["gradient_as_bucket_view"]:
            out.append(item(strategies.ddp.GRADIENT_AS_BUCKET_VIEW_PARAM, True, "TrainingArguments has no "
                            "gradient_as_bucket_view option (launch with torchrun for the DDP itself)"))
    return HFExport(args, out)


LIGER_MODEL_TYPES = frozenset({
    "exaone4", "falcon_h1", "gemma", "gemma2", "gemma3", "gemma3_text", "gemma4_text", "glm4", "glm4v", "glm4v_moe",
    "gpt_oss", "granite", "hunyuan_v1_dense", "hunyuan_v1_moe", "internvl", "llama", "llama4", "llama4_text", "llava",
    "ministral", "mistral", "mixtral", "mllama", "mllama_text_model", "nemotron", "olmo2", "olmo3", "paligemma", "phi3",
    "qwen2", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text", "qwen3", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_moe_text",
    "qwen3_vl_text", "smollm3", "smolvlm"})
"""The transformers model types (``config.model_type``) whose layers and fused linear cross-entropy
liger-kernel 0.8.0's transformers patch covers (its MODEL_TYPE_TO_APPLY_LIGER_FN): what
``TrainingArguments(use_liger_kernel=True)`` can apply, and only to a transformers model of such a
type. 0.8.0 is the oldest liger-kernel ``autotune[memory]`` accepts; later ones patch these too. Kept
here rather than read from liger-kernel, so an export says the same wherever it is written."""


def _liger_gap(setting: str, model: str, model_type: str | None) -> str:
    """Why the Trainer's liger patch cannot carry ``setting`` for a workload of ``model``, and what to do."""
    on_loss = setting == strategies.loss_kernel.KERNEL_PARAM
    if model_type is None:
        applied = "its fused loss (in the model's forward, from its labels)" if on_loss else "its kernels"
        tuned_on = f"{model}, not an hf: model" if model else "a workload config.json does not record"
        head = (f"TrainingArguments(use_liger_kernel=True) applies liger-kernel's {applied} only to a transformers "
                f"model of a type liger patches, and this configuration was tuned on {tuned_on}")
    else:
        left = "their loss" if on_loss else "their layers"
        head = (f"liger-kernel has no transformers patch for {model_type} models, so TrainingArguments("
                f"use_liger_kernel=True) leaves {left} as they are")
    if on_loss:
        return (f"{head}: train with cfg.train_step, or a loop of your own with "
                "loss_fn = strategies.loss_kernel.fused_loss(model, loss_fn)")
    return f"{head}: bind liger's kernels with strategies.llm_kernels.apply_liger(model) before training"


def hf_liger(cfg: Any, values: dict[str, dict[str, Any]], args: dict[str, Any]) -> list[dict[str, Any]]:
    """liger-kernel's transformers patch for the llm_kernels and loss_kernel knobs, which the Trainer
    applies with ``use_liger_kernel`` and one ``liger_kernel_config`` holding both knobs' switches
    (into ``args``) to an ``hf:`` model of a type in LIGER_MODEL_TYPES; for any other workload the
    tuned values are listed instead, since the Trainer would leave its model and loss as they are."""
    from strategies.llm_kernels import HF_SWITCHES, OTHER_SWITCHES, dynamo_fails_on_liger
    from strategies.loss_kernel import hf_liger_config

    kernels, loss = values["llm_kernels"]["kernels"], values["loss_kernel"]["kernel"]
    tuned = {s: v for s, v in ((strategies.loss_kernel.KERNEL_PARAM, loss), (strategies.llm_kernels.KERNELS_PARAM, kernels))
             if v != "framework"}
    if not tuned:
        return []
    model = str((cfg.info.get("workload") or {}).get("model") or "")
    model_type = hub_name(model) if model.startswith(HF_PREFIX) else None
    if model_type not in LIGER_MODEL_TYPES:
        return [item(setting, value, _liger_gap(setting, model, model_type)) for setting, value in tuned.items()]
    # liger turns on what is left out, so without its layers every layer switch is named off (the Trainer
    # passes the type's apply function those it takes); with them, the others stay at liger's defaults
    switches = ({s: True for s in HF_SWITCHES} if kernels != "framework"
                else {s: False for s in HF_SWITCHES + OTHER_SWITCHES})
    args.update(use_liger_kernel=True, liger_kernel_config=hf_liger_config(loss, switches))
    if kernels != "framework" and values["compile"]["mode"] != "off" and dynamo_fails_on_liger():
        return [item(strategies.llm_kernels.KERNELS_PARAM, kernels,
                     "the Trainer applies liger's patch itself, without the graph break at each kernel that "
                     "cfg.prepare adds: with torch_compile, this torch's TorchDynamo fails on liger's kernels "
                     "(pytorch/pytorch#180642, fixed in 2.12): train with cfg.prepare, or torch 2.12 or later")]
    return []


# accelerate --------------------------------------------------------------------------------------

ACCELERATE_MIXED_PRECISION = {"fp32": "no", "tf32": "no", "fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}


def accelerate_config(cfg: Any) -> AccelerateExport:
    """An accelerate config file for ``cfg`` plus what the script passes to Accelerator, its
    DataLoader and its optimizer; the config file holds precision, compile and processes."""
    values = knob_values(cfg)
    mode = values["precision"]["mode"]
    ddp = ddp_kwargs(values)
    processes = values["ddp"].get("world_size", 1) if ddp is not None else 1
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False,
        "distributed_type": ("MULTI_GPU" if cfg.device == "cuda" else "MULTI_CPU") if ddp is not None else "NO",
        "downcast_bf16": "no", "enable_cpu_affinity": False, "gpu_ids": "all", "machine_rank": 0,
        "main_training_function": "main", "mixed_precision": ACCELERATE_MIXED_PRECISION[mode],
        "num_machines": 1, "num_processes": processes, "rdzv_backend": "static", "same_network": True,
        "use_cpu": cfg.device == "cpu",
    }
    compile_mode = values["compile"]["mode"]
    config["dynamo_config"] = ({"dynamo_backend": "INDUCTOR", "dynamo_mode": compile_mode,
                                "dynamo_use_fullgraph": False, "dynamo_use_dynamic": False}
                               if compile_mode not in ("off", "regional") else {})
    out = unsupported(cfg, "accelerate", expressed=set())
    if cfg.device == "cuda":
        flag = "tf32" if mode != "fp32" else "ieee"
        out.append(item("precision.tf32", mode != "fp32",
                        "accelerate's config has no TF32 switch: set torch.backends.cuda.matmul.fp32_precision = "
                        f"torch.backends.cudnn.conv.fp32_precision = {flag!r} in your script"))
    scaler = tuned_scaler(values)
    if scaler:
        out.append(item("grad_scaler", scaler, "not in accelerate's config file: pass "
                                               f"Accelerator(kwargs_handlers=[GradScalerKwargs(**{scaler})])"))
    implementation = values["optimizer"]["implementation"]
    loader = {"batch_size": cfg.batch_size, **cfg.dataloader_kwargs()}
    text = yaml_text(config, out)
    return AccelerateExport(config, text, {"gradient_accumulation_steps": cfg.accumulation_steps}, ddp, loader,
                            optimizer_kwargs(implementation), out)


def yaml_text(config: dict[str, Any], unsupported_items: list[dict[str, Any]]) -> str:
    """The config as YAML, with what it cannot express as comments at the top (accelerate's
    loader ignores comments, so the file stays loadable)."""
    yaml = require("pyyaml", "yaml")
    head = ["# accelerate config written by `autotune export --to accelerate`",
            "# use: accelerate launch --config_file accelerate_config.yaml train.py"]
    for u in unsupported_items:
        head.append(f"# not expressible here: {u['setting']} = {u['value']}: {u['why']}")
    return "\n".join(head) + "\n" + yaml.safe_dump(config, sort_keys=True)


# Lightning ---------------------------------------------------------------------------------------

# fp8: bf16-mixed, and the callback converts the Linear layers (a model transform of the recipe)
LIGHTNING_PRECISION = {"fp32": "32-true", "tf32": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed",
                       "fp8": "bf16-mixed"}

LIGHTNING_CALLBACK_FIELDS = frozenset({"backend_flags", "model_transforms", "memory_format", "compile_mode",
                                       "optimizer_implementation", "grad_scaler"})
"""The Recipe fields the callback (autotune.deploy.lightning_callback.AutotuneCallback) applies; with
model_transforms, every transform of any knob, so a knob that changes the model's layers is no gap."""
LIGHTNING_TRAINER_FIELDS = frozenset({"device", "autocast_dtype", "batch_size", "accumulation_steps",
                                      "base_batch_size", "dataloader", "ddp", "ddp_world_size", "llm_kernels", "notes"})
"""The Recipe fields the rest of the Lightning export carries: the Trainer's accelerator, precision,
accumulation and DDPStrategy, the DataLoader's keyword arguments. ``llm_kernels`` only tells a step
that its first call compiles liger's kernels (a model transform applies them); notes are advice."""


def _comparable(value: Any) -> Any:
    """A recipe field as a value two builds agree on: a functools.partial as its function and arguments."""
    if isinstance(value, list):
        return [(v.func, v.args, v.keywords) if isinstance(v, functools.partial) else v for v in value]
    return value


def recipe_fields(cfg: Any, setting: str) -> set[str]:
    """The Recipe fields a tuned ``setting`` ("knob.field") changes: ``cfg``'s recipe against the one
    built with that field at its untuned value and every other knob as tuned."""
    name, field = setting.split(".", 1)
    strategy = strategies.BY_NAME[name]
    knobs = dict(cfg.knobs)
    untuned = dataclasses.replace(knobs.get(name, strategy.default()), **{field: getattr(strategy.default(), field)})
    device = cfg.recipe.device
    tuned, without = strategies.build_recipe(cfg.knobs, device), strategies.build_recipe({**knobs, name: untuned}, device)
    return {f.name for f in dataclasses.fields(Recipe)
            if _comparable(getattr(tuned, f.name)) != _comparable(getattr(without, f.name))}


def lightning_unsupported(cfg: Any) -> list[dict[str, Any]]:
    """The tuned settings the Lightning export cannot express: those that change a Recipe field that
    neither the callback nor the Trainer's flags carry (what recipe_fields finds, not a list of knobs)."""
    carried = LIGHTNING_CALLBACK_FIELDS | LIGHTNING_TRAINER_FIELDS
    return [u for u in _common_unsupported(knob_values(cfg), "Lightning")
            if not recipe_fields(cfg, u["setting"]) <= carried]


def _transform_name(transform: Any) -> str:
    """A model transform's function by its dotted name ("strategies.stem_conv.space_to_depth")."""
    func = getattr(transform, "func", transform)
    return f"{func.__module__}.{func.__qualname__}"


def lightning_settings(cfg: Any) -> dict[str, Any]:
    """The Lightning export as plain data (what lightning.json holds): the Trainer's keyword
    arguments, the DDP strategy's, what the callback applies, the DataLoader's, what is left."""
    values = knob_values(cfg)
    mode = values["precision"]["mode"]
    trainer: dict[str, Any] = {"precision": LIGHTNING_PRECISION[mode], "accelerator": "gpu" if cfg.device == "cuda"
                               else "cpu", "accumulate_grad_batches": cfg.accumulation_steps}
    if cfg.device == "cuda":
        trainer["benchmark"] = bool(values["cudnn"]["benchmark"])
    ddp = ddp_kwargs(values)
    if ddp is not None:
        trainer["devices"] = values["ddp"]["world_size"]
    recipe = cfg.recipe
    applies = {"backend_flags": dict(recipe.backend_flags), "float8_linear_layers": mode == "fp8",
               strategies.fp8_layers.LAYERS_PARAM: _fp8_layers(values),
               "memory_format": values["memory_format"]["format"],
               strategies.channel_alignment.MULTIPLE_PARAM: values["channel_alignment"]["multiple"],
               strategies.fp32_layers.LAYERS_PARAM: values["fp32_layers"]["layers"],
               strategies.compile.MODE_PARAM: values["compile"]["mode"],
               strategies.optimizer.IMPLEMENTATION_PARAM: values["optimizer"]["implementation"],
               checkpointing.EVERY_PARAM: values["activation_checkpointing"]["every"],
               strategies.llm_kernels.KERNELS_PARAM: values["llm_kernels"]["kernels"],
               "model_transforms": [_transform_name(t) for t in recipe.model_transforms],
               "grad_scaler": dict(recipe.grad_scaler) if recipe.grad_scaler is not None else None,
               # the search's compile, loaded before the callback compiles (autotune.deploy.compile_cache)
               "compile_cache": cfg.compile_cache_path.name if cfg.compile_cache_path is not None else None}
    return {"precision": trainer["precision"], "trainer": trainer,
            "strategy": {"class": "lightning.pytorch.strategies.DDPStrategy", "kwargs": ddp} if ddp else None,
            "callback": {"class": "autotune.deploy.lightning_callback.AutotuneCallback", "applies": applies},
            "dataloader": {"batch_size": cfg.batch_size, **cfg.dataloader_kwargs()},
            "unsupported": lightning_unsupported(cfg),
            "usage": "exp = autotune.load(CONFIG).lightning(); "
                     "trainer = lightning.Trainer(**exp.trainer_kwargs, max_epochs=...); "
                     "DataLoader(dataset, **exp.dataloader_kwargs)"}
