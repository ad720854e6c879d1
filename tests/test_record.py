"""The typed trial record: what a trial stored, read back with the defaults of an older trial."""

from __future__ import annotations

import optuna
import pytest

from autotune.trial.record import TrialRecord, copy, queue_attrs, write


def _study():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(direction="maximize")


def test_a_measured_trial_reads_back_typed_and_an_unmeasured_one_with_defaults():
    study = _study()

    def objective(trial):
        trial.suggest_categorical("batch_size.batch_size", [64])
        if trial.number == 0:
            write(trial, knobs={"batch_size": {"batch_size": 64}, "compile": {"mode": "default"}}, status="ok",
                  figures={"samples_per_s": 1234.5, "peak_memory_bytes": 2**30}, role="baseline")
            return 1234.5
        raise optuna.TrialPruned()

    study.optimize(objective, n_trials=2)
    measured, pruned = (TrialRecord.of(t) for t in study.trials)
    assert measured.measured and measured.counted and measured.role == "baseline"
    assert (measured.samples_per_s, measured.peak_memory_bytes, measured.batch_size) == (1234.5, 2**30, 64)
    assert measured.knob("compile", "mode", "off") == "default" and measured.knob("cudnn", "benchmark", False) is False
    # no outcome stored (a killed search's trial): not counted, every field at its default
    assert not pruned.counted and pruned.status is None and pruned.knobs == {} and pruned.findings == []
    assert pruned.role is None and not pruned.unstable


def test_only_record_fields_are_stored_and_copies_keep_what_was_stored():
    study = _study()
    trial = study.ask()
    with pytest.raises(AttributeError, match="no field statu"):
        write(trial, statu="ok")
    with pytest.raises(AttributeError, match="no field rol"):
        queue_attrs(rol="steered")
    write(trial, status="oom", reason="does not fit at batch 1024")
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    repeat = study.ask()
    copy(study.trials[0], repeat, ("status", "reason", "figures"))
    assert repeat.user_attrs == {"status": "oom", "reason": "does not fit at batch 1024"}  # no figures invented
