"""``autotune export DIR --to hf|lightning|accelerate``: an export's files, written next to config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from autotune.deploy.exports import TARGETS, accelerate_config, hf_training_args, lightning_settings
from autotune.errors import ConfigError

Written = tuple[list[Path], list[dict[str, Any]]]


def write_export(cfg: Any, target: str, out_dir: str | Path) -> Written:
    """Write ``target``'s export of ``cfg`` into ``out_dir``; returns the files written and what
    the target cannot express (which the files hold too)."""
    writers: dict[str, Callable[[Any, Path], Written]] = {
        "hf": write_hf, "lightning": write_lightning, "accelerate": write_accelerate}
    if target not in writers:
        raise ConfigError(f"--to {target!r}: choose from {', '.join(TARGETS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return writers[target](cfg, out)


def write_hf(cfg: Any, out: Path) -> Written:
    """hf_training_args.json: {"training_args": TrainingArguments kwargs, "unsupported": [...]}."""
    args, missing = hf_training_args(cfg)
    path = out / "hf_training_args.json"
    usage = "TrainingArguments(output_dir=..., **json.load(open('hf_training_args.json'))['training_args'])"
    path.write_text(json.dumps({"training_args": args, "unsupported": missing, "usage": usage}, indent=2) + "\n")
    return [path], missing


def write_lightning(cfg: Any, out: Path) -> Written:
    """lightning.json: the Trainer's kwargs, what the callback applies, the DataLoader's, the rest."""
    data = lightning_settings(cfg)
    path = out / "lightning.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return [path], data["unsupported"]


def write_accelerate(cfg: Any, out: Path) -> Written:
    """accelerate_config.yaml (for ``accelerate launch --config_file``) and accelerate_kwargs.json
    (what the script passes to Accelerator, its DataLoader and its optimizer)."""
    exp = accelerate_config(cfg)
    path = out / "accelerate_config.yaml"
    path.write_text(exp.yaml)
    extra = out / "accelerate_kwargs.json"
    extra.write_text(json.dumps({"accelerator_kwargs": exp.accelerator_kwargs, "ddp_kwargs": exp.ddp_kwargs,
                                 "dataloader_kwargs": exp.dataloader_kwargs, "optimizer_kwargs": exp.optimizer_kwargs,
                                 "unsupported": exp.unsupported}, indent=2) + "\n")
    return [path, extra], exp.unsupported
