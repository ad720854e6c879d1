"""The output folder: checked writable before any device time, and what the search keeps in it at its end
(the baseline's and the best trial's traces, the best trial's compile cache); autotune.report.write
adds config.json, trials.csv and the report."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.deploy import compile_cache
from autotune.errors import ConfigError
from autotune.search.trials import baseline_trial, best_trial, ranked_trials
from autotune.trial.record import TrialRecord

COMPILE_ARCHIVES_KEPT = 3
"""Compiled trials whose compile archives logs/ keeps while a search runs: the best few, so that an
accuracy check failing the best still leaves the next one's. On a GPU one is up to tens of MB (its
Triton kernels), and a search compiles dozens of trials."""


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


def compile_archive_name(number: int) -> str:
    """The compile archive (autotune.deploy.compile_cache) trial ``number``'s worker saves in logs/."""
    return f"compile-{number:04d}.zip"


def archive_of(trial: optuna.trial.FrozenTrial) -> str | None:
    """The file name of the compile archive in logs/ that holds ``trial``'s compile: its own, or, for
    a repeat of a measured configuration, the measured trial's (its figures are copied)."""
    saved = (TrialRecord.of(trial).figures or {}).get("compile_archive") or {}
    return saved.get("file")


def prune_compile_archives(study: optuna.Study, log_dir: Path, keep: int = COMPILE_ARCHIVES_KEPT) -> None:
    """Delete the compile archives in ``log_dir`` but those of the ``keep`` best trials (as
    best_trial ranks them) and of trials still running."""
    kept = {archive_of(t) for t in ranked_trials(study)[:keep]}
    running = {compile_archive_name(t.number) for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    for path in Path(log_dir).glob("compile-*.zip"):
        if path.name not in kept and path.name not in running:
            path.unlink(missing_ok=True)


def keep_compile_cache(study: optuna.Study, out_dir: Path) -> dict[str, Path]:
    """The best trial's compile archive copied beside config.json as compile-cache.zip, where it
    compiled; every compile archive in logs/ is then deleted. A compile-cache.zip already there
    stays where it is the same best's (a resumed search whose best did not change), and goes
    where the best changed or does not compile."""
    import shutil

    logs, target = out_dir / "logs", out_dir / compile_cache.ARCHIVE
    best = best_trial(study)
    name = archive_of(best) if best is not None else None
    kept = {}
    if name is not None and (logs / name).is_file():
        shutil.copyfile(logs / name, target)
        kept[target.name] = target
    elif name is not None and target.is_file() and _exported_trial(out_dir) == best.number:
        kept[target.name] = target
    elif name is not None and (earlier := _earlier_archive(best)) is not None:
        # the best was measured by an earlier search (autotune.search.warm), which kept its compile
        shutil.copyfile(earlier, target)
        kept[target.name] = target
    else:
        target.unlink(missing_ok=True)
    for archive in logs.glob("compile-*.zip"):
        archive.unlink()
    return kept


def _earlier_archive(trial: optuna.trial.FrozenTrial) -> Path | None:
    """The compile-cache.zip an earlier search kept for ``trial``, where the warm start took it from a
    search whose recommendation it was (and whose folder still holds it)."""
    warm = TrialRecord.of(trial).warm_from
    if not warm:
        return None
    folder = Path(warm["out_dir"])
    archive = folder / compile_cache.ARCHIVE
    return archive if archive.is_file() and _exported_trial(folder) == warm.get("number") else None


def _exported_trial(out_dir: Path) -> int | None:
    """The trial the folder's config.json (an earlier export) recommends, if any."""
    try:
        return json.loads((out_dir / "config.json").read_text())["study"]["trial_number"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
