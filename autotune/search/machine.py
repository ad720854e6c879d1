"""Which machine a study's measurements were made on, so that a search never silently resumes
another machine's study: a committed example report, a folder copied from a colleague, a study
on a shared disk written from another node.

A study records its machine when it is set up (host name, /etc/machine-id where there is one, the
UUID of the probed GPU). Resuming it elsewhere is refused with the two ways on: ``--resume`` adds
this machine's trials to it anyway, a fresh ``--out`` starts a search of this machine's own.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import optuna

from autotune.errors import ConfigError

MACHINE_ATTR = "machine"
"""Study user attribute: this_machine() of the process that set the study up."""


def _machine_id() -> str | None:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return None


def this_machine(provenance: dict[str, Any]) -> dict[str, Any]:
    """This machine's identity: host name, machine id and, on a GPU, the probed GPU's UUID
    (a container may get a new host name each run; its GPU keeps its UUID)."""
    identity: dict[str, Any] = {"host": socket.gethostname(), "machine_id": _machine_id()}
    if provenance.get("gpu_uuid"):
        identity["gpu_uuid"] = provenance["gpu_uuid"]
    return identity


def same_machine(recorded: dict[str, Any], ours: dict[str, Any]) -> bool:
    """Whether two identities are one machine: the same GPU, or (for a GPU study, the same GPU is
    not required since --gpus may pick another one of the same host) the same host or machine id."""
    if recorded.get("gpu_uuid") and recorded.get("gpu_uuid") == ours.get("gpu_uuid"):
        return True
    return any(recorded.get(key) and recorded.get(key) == ours.get(key) for key in ("host", "machine_id"))


def describe(identity: dict[str, Any] | None) -> str:
    if not identity:
        return "an unrecorded machine (the study was written before autotune recorded machines)"
    text = f"host {identity.get('host') or 'unknown'}"
    if identity.get("gpu_uuid"):
        text += f", GPU {identity['gpu_uuid']}"
    return text


def check_resume(study: optuna.Study, ours: dict[str, Any], *, where: str, resume: bool) -> None:
    """Refuse to add this machine's trials to a study another machine wrote, unless ``resume``.

    A study with no trials and no recorded setup is new: nothing to refuse."""
    attrs = study.user_attrs
    if "space" not in attrs and not study.trials:
        return
    recorded = attrs.get(MACHINE_ATTR)
    if recorded and same_machine(recorded, ours):
        return
    if resume:
        return
    done = len(study.trials)
    raise ConfigError(
        f"study {study.study_name!r} in {where} ({done} trial{'s' if done != 1 else ''}) was written on "
        f"{describe(recorded)}, not on this machine ({describe(ours)}); its figures are not this machine's. "
        "Give a fresh --out to start a search of your own, or --resume to add this machine's trials to it anyway")
