"""The output folder: checked writable before any device time, and filled at the end of a search
(config.json and trials.csv, the report, the baseline's and the best trial's traces)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna

from autotune.deploy.space import SearchSpace
from autotune.errors import ConfigError
from autotune.search.options import SearchConfig
from autotune.search.trials import baseline_trial, best_trial


def check_writable(out_dir: Path, min_free_bytes: int = 50 * 2**20) -> None:
    """Fail before any device time is spent when results could not be saved."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe_file = out_dir / ".write-test"
        probe_file.write_text("ok")
        probe_file.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write to the output folder {out_dir} ({exc.strerror or exc}); "
                          "choose another with --out") from None
    import shutil

    free = shutil.disk_usage(out_dir).free
    if free < min_free_bytes:
        raise ConfigError(f"only {free / 2**20:.0f} MiB free under {out_dir}; free some space or choose "
                          "another --out (the study, logs and report need about 50 MiB)")


def write_outputs(study: optuna.Study, out_dir: Path, config: SearchConfig, space: SearchSpace,
                  info: dict[str, Any]) -> dict[str, Path]:
    """config.json and trials.csv, then report.html and report.md."""
    from autotune.report.export import export
    from autotune.report.render import write_report

    files = export(study, out_dir, config=config, space=space, probe=info)
    files.update(keep_traces(study, out_dir))
    exported = json.loads(files["config.json"].read_text()) if "config.json" in files else None
    files.update(write_report(study, out_dir, exported))
    return files


def keep_traces(study: optuna.Study, out_dir: Path) -> dict[str, Path]:
    """The Chrome traces (Perfetto opens them) of the baseline and the best trial, copied next to
    the report as trace-baseline.json.gz and trace-best.json.gz; the other trials' traces are
    deleted from logs/ (half a megabyte each)."""
    import shutil

    logs = out_dir / "logs"
    sources = {label: logs / f"trace-{trial.number:04d}.json.gz"
               for label, trial in (("baseline", baseline_trial(study)), ("best", best_trial(study)))
               if trial is not None}
    keep = {}
    for label, source in sources.items():
        if source.exists():
            target = out_dir / f"trace-{label}.json.gz"
            shutil.copyfile(source, target)
            keep[target.name] = target
    for trace in logs.glob("trace-*.json*"):
        if trace not in sources.values():
            trace.unlink()
    return keep
