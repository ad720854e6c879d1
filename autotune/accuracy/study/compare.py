"""`autotune accuracy`: each precision mode trained briefly against FP32, one worker each, judged
as the search's checks are (autotune.accuracy.study.gate.judge), as the rows of a table."""

from __future__ import annotations

from typing import Any, Mapping

from autotune.accuracy.settings import AccuracySettings
from autotune.accuracy.study.gate import judge
from autotune.errors import AutotuneError
from strategies.precision import AUTOCAST_DTYPES


class AccuracyCheckError(AutotuneError):
    """The FP32 reference of the accuracy check could not be trained: the data or model is at fault."""


def summary_row(mode: str, judged: Mapping[str, Any]) -> dict[str, Any]:
    """One row of `autotune accuracy`'s table."""
    n = judged.get("numerics") or {}
    return {
        "mode": mode,
        "steps": judged.get("steps"),
        "final_loss": judged.get("final_loss"),
        "accuracy": judged.get("accuracy"),
        "accuracy_drop": judged.get("accuracy_drop"),
        "loss_drift": judged.get("loss_drift"),
        "skipped_steps": judged.get("skipped_steps"),
        "loss_rel_error": n.get("loss_rel_error_vs_fp32"),
        "grad_cosine": n.get("grad_cosine_vs_fp32"),
        "grad_cosine_fp64": n.get("grad_cosine_vs_fp64"),
        "verdict": judged.get("verdict"),
        "reason": judged.get("reason"),
    }


def compare_modes(*, workload: dict[str, Any], space, settings: AccuracySettings,
                  configurations: list[tuple[str, dict[str, Any]]], timeout_s: float = 1800.0,
                  on_row=None) -> list[dict[str, Any]]:
    """`autotune accuracy`: check each (label, numerics knobs) against FP32, one worker each, the
    FP32 reference trained once; returns one judged row per configuration. On a GPU the next
    configuration's worker starts while one runs (a spare: a worker's start is seconds of each
    check)."""
    from autotune.trial.runner import prestart_setting, run_worker

    prestart = prestart_setting() is not False  # AUTOTUNE_PRESTART=0: every worker starts with its request
    reference = None
    rows = []
    for i, (label, knobs) in enumerate(configurations):
        request = {"mode": "accuracy", "workload": workload, "space": space.to_dict(), "knobs": knobs,
                   "settings": settings.to_dict(), "reference": reference}
        result = run_worker(request, timeout_s=timeout_s, spare=prestart and i + 1 < len(configurations))
        if result["status"] != "ok":
            if reference is None:
                raise AccuracyCheckError(f"the FP32 reference run failed ({result['status']}): {result.get('reason')}"
                                         f"\n{result.get('traceback', '')}")
            row = {"mode": label, "verdict": "error", "reason": f"{result['status']}: {result.get('reason')}"}
        else:
            reference = result["reference"]
            judged = judge(result["run"], reference, max_accuracy_drop=settings.max_accuracy_drop,
                           max_loss_drift=settings.max_loss_drift)
            row = summary_row(label, judged)
            row["wall_s"] = result["run"].get("wall_s")
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def mode_configurations(precisions: list[str], fp32_layers: list[str] | None = None
                        ) -> list[tuple[str, dict[str, Any]]]:
    """What `autotune accuracy` checks: each precision mode (fp16 with the default GradScaler and
    without one), then each autocast mode with each requested fp32_layers combination."""
    out: list[tuple[str, dict[str, Any]]] = []
    for mode in precisions:
        if mode == "fp16":
            out.append(("fp16", {"precision": {"mode": "fp16"}, "grad_scaler": {"enabled": True}}))
            out.append(("fp16, no GradScaler", {"precision": {"mode": "fp16"}}))
        else:
            out.append((mode, {"precision": {"mode": mode}}))
    for layers in fp32_layers or []:
        for mode in precisions:
            if mode in AUTOCAST_DTYPES:
                knobs: dict[str, Any] = {"precision": {"mode": mode}, "fp32_layers": {"layers": layers}}
                if mode == "fp16":
                    knobs["grad_scaler"] = {"enabled": True}
                out.append((f"{mode}, fp32 {layers}", knobs))
    return out
