"""What a finished search leaves in its output folder: the best trial's compile cache and traces
(autotune.search.outputs), config.json and trials.csv (autotune.report.export), then report.html and
report.md (autotune.report.render)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna

from autotune.report.export import export
from autotune.report.render import write_report
from autotune.search.options import SearchConfig
from autotune.search.outputs import keep_compile_cache, keep_traces
from autotune.space import SearchSpace


def write_outputs(study: optuna.Study, out_dir: Path, config: SearchConfig, space: SearchSpace,
                  info: dict[str, Any], device: str) -> dict[str, Path]:
    """compile-cache.zip, config.json and trials.csv, then report.html and report.md; ``device``: the
    one the trials ran on."""
    files = keep_compile_cache(study, out_dir)  # before config.json, which records it
    files.update(export(study, out_dir, config=config, space=space, probe=info, device=device))
    files.update(keep_traces(study, out_dir))
    exported = json.loads(files["config.json"].read_text()) if "config.json" in files else None
    files.update(write_report(study, out_dir, exported))
    return files
