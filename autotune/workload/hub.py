"""Models by name from the model libraries, offline: ``hf:TYPE`` and ``timm:NAME``.

``hf:gpt2`` is a Hugging Face transformers causal language model built from its model type's
default configuration (``AutoConfig.for_model``), with ``--model-config`` overriding its fields,
trained on next-token cross-entropy over random tokens of ``--seq-len``. ``timm:resnet18`` is a
timm image classifier at the input size of its pretrained configuration. Nothing is downloaded:
no weights, no configuration from the hub; random initialisation measures speed as well.
Both libraries are optional extras (``autotune[hf]``, ``autotune[timm]``), imported only here.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from types import ModuleType
from typing import Any

import torch

from autotune.errors import ConfigError, WorkloadError
from autotune.heads import causal_lm_loss  # noqa: F401  (the loss a causal LM workload is built with)

HF_PREFIX = "hf:"
TIMM_PREFIX = "timm:"
DEFAULT_SEQ_LEN = 1024
"""--seq-len for an hf: model when not given, clipped to the model's longest sequence."""
_LIBRARIES = {HF_PREFIX: ("transformers", "hf"), TIMM_PREFIX: ("timm", "timm")}


def is_hub_model(model: str) -> bool:
    """Whether ``--model`` names a model of a library (hf:TYPE, timm:NAME), not a factory."""
    return model.startswith((HF_PREFIX, TIMM_PREFIX))


def hub_name(model: str) -> str:
    """'hf:gpt2' -> 'gpt2'."""
    return model.split(":", 1)[1]


def parse_model_config(text: str) -> dict[str, Any]:
    """'n_layer=2,n_embd=64,tie_word_embeddings=false' -> {'n_layer': 2, 'n_embd': 64, ...}."""
    return parse_assignments(text, option="--model-config", example="n_layer=2,n_embd=64")


def parse_assignments(text: str, *, option: str, example: str) -> dict[str, Any]:
    """'a=2,b=0.5,c=false,d=x' -> {'a': 2, 'b': 0.5, 'c': False, 'd': 'x'}: ints, floats, true/false
    and none are parsed, anything else is kept as a string; ``option`` and ``example`` word the
    error for an item that is not NAME=VALUE."""
    out: dict[str, Any] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key or not value:
            raise ConfigError(f"{option} {text!r}: {item!r} is not NAME=VALUE; write e.g. {example}")
        out[key] = _parse_value(value)
    return out


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def check_options(model: str, model_config: dict[str, Any], seq_len: int | None) -> None:
    """--model-config and --seq-len belong to hf: models; refused elsewhere, before any build."""
    if model.startswith(HF_PREFIX):
        if seq_len is not None and seq_len < 1:
            raise ConfigError(f"--seq-len must be at least 1, got {seq_len}")
        return
    if model_config:
        raise ConfigError(f"--model-config overrides the configuration of an hf: model (e.g. --model hf:gpt2); "
                          f"--model {model} has none to override")
    if seq_len is not None:
        raise ConfigError(f"--seq-len sets the sequence length of an hf: model (e.g. --model hf:gpt2); for "
                          f"--model {model} give --input-shape instead")


def library(model: str) -> ModuleType:
    """The library an hf: or timm: model needs, or an error that names the extra to install."""
    prefix = HF_PREFIX if model.startswith(HF_PREFIX) else TIMM_PREFIX
    module, extra = _LIBRARIES[prefix]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise WorkloadError(f"--model {model} needs {module}: pip install 'autotune[{extra}]'") from None


def _close(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else "."


def hf_config(model: str, overrides: dict[str, Any]) -> Any:
    """The model type's default configuration with ``overrides`` applied, checked field by field
    (``AutoConfig.for_model`` would keep a misspelt field as a new attribute without a word)."""
    transformers = library(model)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = hub_name(model)
    causal = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if model_type not in causal:
        raise WorkloadError(f"--model {model}: {model_type!r} is not a transformers causal language model "
                            f"type{_close(model_type, causal)} (transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES "
                            "lists the types: gpt2, llama, mistral, ...)")
    default = transformers.AutoConfig.for_model(model_type)
    fields = sorted(set(default.to_dict()) | set(getattr(default, "attribute_map", {})))
    for key in overrides:
        if key not in fields:
            raise ConfigError(f"--model-config: {model_type} configurations have no field {key!r}"
                              f"{_close(key, fields)}")
    # no key/value cache: a training step never reuses it, and it would be an extra output
    return transformers.AutoConfig.for_model(model_type, **{"use_cache": False, **overrides})


def max_positions(config: Any) -> int | None:
    """The longest sequence the configuration's position embeddings cover; None: no limit known."""
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_seq_len(model: str, config: Any, seq_len: int | None) -> int:
    """--seq-len, or DEFAULT_SEQ_LEN clipped to the model's longest sequence; a --seq-len longer
    than that is refused."""
    limit = max_positions(config)
    if seq_len is None:
        return min(DEFAULT_SEQ_LEN, limit) if limit else DEFAULT_SEQ_LEN
    if limit is not None and seq_len > limit:
        raise ConfigError(f"--seq-len {seq_len} is longer than {model} allows ({limit} positions); give "
                          f"--seq-len {limit} or less, or raise it with --model-config n_positions={seq_len} "
                          "(max_position_embeddings for most model types)")
    return seq_len


def check(model: str, model_config: dict[str, Any], seq_len: int | None) -> None:
    """Fail early, with the fix, on an hf: or timm: model that cannot be built (without building it)."""
    check_options(model, model_config, seq_len)
    if model.startswith(HF_PREFIX):
        resolve_seq_len(model, hf_config(model, model_config), seq_len)
    else:
        timm_names(model)


def timm_names(model: str) -> list[str]:
    """timm's model names; an unknown one is refused with the close ones."""
    timm = library(model)
    names = timm.list_models()
    arch = hub_name(model).split(".", 1)[0]  # 'resnet18.a1_in1k': a pretrained tag of resnet18
    if arch not in names:
        raise WorkloadError(f"--model {model}: timm has no model {arch!r}{_close(arch, names)} "
                            "(python -c 'import timm; print(timm.list_models())' lists them)")
    return names


def random_tokens(batch_size: int, generator: torch.Generator, *, vocab_size: int,
                  seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One random sequence of seq_len + 1 tokens per sample: the inputs, and the same shifted by one."""
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


CAUSAL_SDPA = "autotune_causal_sdpa"
"""A transformers attention implementation: SDPA with ``is_causal=True`` and no mask built, as
nanoGPT calls it. transformers' own "sdpa" builds the causal mask as a tensor while torch.compile
traces (its skip of the mask is off under tracing), and SDPA's flash kernel refuses a mask, so flash
attention fails to compile with it (transformers 5.17)."""


def causal_sdpa() -> str:
    """Register CAUSAL_SDPA with transformers (once; valid for causal models fed whole, unpadded
    sequences, as the search's random tokens are) and return its name for ``attn_implementation``."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        # transformers' own SDPA call (grouped key/value heads, scaling), handed no mask: is_causal says it
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=True, **kwargs)

    AttentionInterface.register(CAUSAL_SDPA, attention)
    AttentionMaskInterface.register(CAUSAL_SDPA, lambda *args, **kwargs: None)  # no mask: is_causal says it
    return CAUSAL_SDPA


def causal_attention(config: Any, seq_len: int) -> str | None:
    """CAUSAL_SDPA for a causal LM whose attention over ``seq_len`` tokens is plain causal (it calls
    transformers' attention interface, and no sliding window is shorter than the sequence), so a
    compiled step keeps SDPA's flash kernel; None where the model's own attention must stay."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if cls is None or not getattr(cls, "_supports_attention_backend", False):
        return None
    window = getattr(config, "sliding_window", None)
    if window is not None and window < seq_len and getattr(config, "use_sliding_window", True):
        return None
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention", "sliding_attention"} or ("sliding_attention" in kinds and (window or 0) < seq_len):
        return None
    try:
        return causal_sdpa()
    except (ImportError, AttributeError):  # a transformers without these interfaces: its own attention
        return None


def nanogpt_adamw(model: torch.nn.Module, *, fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW as nanoGPT trains a GPT: lr 6e-4, betas (0.9, 0.95), weight decay 0.1 on the weight
    matrices and embeddings, none on biases and norms. The search trains language models with it,
    so their step times include the optimizer their users run."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=fused)


def preload(model: str) -> None:
    """Import what building ``model`` imports, before its request (autotune.trial.runner's spares,
    the CPU fork server): for hf:TYPE transformers' modules of that model type and its attention
    interfaces (5.3 s of a 7.7 s GPT-2 build on 2 cores), for timm:NAME timm's models."""
    if model.startswith(HF_PREFIX):
        from transformers import AutoModelForCausalLM

        config = hf_config(model, {})
        AutoModelForCausalLM._model_mapping.get(type(config), None)  # imports the model type's module
        causal_attention(config, DEFAULT_SEQ_LEN)
    elif model.startswith(TIMM_PREFIX):
        importlib.import_module("timm")  # its model registry with it


def build_hf(model: str, model_config: dict[str, Any], seq_len: int | None) -> dict[str, Any]:
    """The Workload fields of an hf: model: the model (random weights), its batches and loss, and
    its units (a sample is a sequence of seq_len tokens)."""
    check_options(model, model_config, seq_len)
    config = hf_config(model, model_config)
    length = resolve_seq_len(model, config, seq_len)
    from transformers import AutoModelForCausalLM

    # nanoGPT's SDPA call where it is the model's own attention: transformers' "sdpa" builds the
    # causal mask as a tensor while torch.compile traces, and SDPA's flash kernel refuses masks
    net = AutoModelForCausalLM.from_config(config, attn_implementation=causal_attention(config, length))
    vocab = int(config.vocab_size)
    return {"model": net, "make_batch": functools.partial(random_tokens, vocab_size=vocab, seq_len=length),
            "loss_fn": causal_lm_loss, "input_shape": (length,), "num_classes": vocab,
            "sample_unit": "sequence", "tokens_per_sample": length, "make_optimizer": nanogpt_adamw}


def build_timm(model: str, num_classes: int, input_shape: tuple[int, ...] | None) -> dict[str, Any]:
    """The Workload fields of a timm: model: the classifier (random weights, ``num_classes``
    outputs) at ``input_shape`` or its pretrained configuration's input size."""
    timm_names(model)
    import timm

    net = timm.create_model(hub_name(model), pretrained=False, num_classes=num_classes)
    default = (getattr(net, "pretrained_cfg", None) or {}).get("input_size") or (3, 224, 224)
    return {"model": net, "input_shape": tuple(input_shape or default), "num_classes": num_classes}
