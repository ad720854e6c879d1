"""``autotune export DIR --to hf|lightning|accelerate``: an export's files, written next to config.json."""

from __future__ import annotations

import json
import os
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


def compile_cache_note(cfg: Any, out: Path) -> dict[str, str] | None:
    """How a script of the user's loads the search's compile cache (autotune.deploy.compile_cache)
    before its first compiled step: the archive's path from ``out`` and the one call; None where the
    configuration has none."""
    archive = cfg.compile_cache_path
    if archive is None or not archive.is_file():
        return None
    where = os.path.relpath(archive, out)
    return {"file": where, "load": f"import autotune; autotune.load_compile_cache({where!r})  # before the first "
                                   "training step (trainer.train()): it loads the search's compile instead of redoing it"}


def write_hf(cfg: Any, out: Path) -> Written:
    """hf_training_args.json: {"training_args": TrainingArguments kwargs, "unsupported": [...]}, and
    the compile cache's load where there is one."""
    args, missing = hf_training_args(cfg)
    path = out / "hf_training_args.json"
    usage = "TrainingArguments(output_dir=..., **json.load(open('hf_training_args.json'))['training_args'])"
    data = {"training_args": args, "unsupported": missing, "usage": usage}
    if note := compile_cache_note(cfg, out):
        data["compile_cache"] = note
    path.write_text(json.dumps(data, indent=2) + "\n")
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
    note = compile_cache_note(cfg, out)
    path = out / "accelerate_config.yaml"
    # accelerate's loader ignores comments: the load is the script's, one call before its first step
    path.write_text(exp.yaml if note is None else f"# compile cache: {note['load']}\n{exp.yaml}")
    extra = out / "accelerate_kwargs.json"
    kwargs = {"accelerator_kwargs": exp.accelerator_kwargs, "ddp_kwargs": exp.ddp_kwargs,
              "dataloader_kwargs": exp.dataloader_kwargs, "optimizer_kwargs": exp.optimizer_kwargs,
              "unsupported": exp.unsupported}
    if note is not None:
        kwargs["compile_cache"] = note
    extra.write_text(json.dumps(kwargs, indent=2) + "\n")
    return [path, extra], exp.unsupported
