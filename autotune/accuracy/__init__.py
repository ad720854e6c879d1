"""Accuracy versus speed: does a configuration still train as well as FP32?

Two measurements against an FP32 reference (same initial weights, same data, same order):

* step numerics: one training step's loss and gradients (norm ratio, cosine) against FP32 and
  FP64, from the same weights and batch;
* short-training parity: ``steps`` real optimizer steps on learnable data (``autotune.workload.data``):
  final training loss, held-out accuracy, GradScaler steps skipped, final scale, NaN/Inf.

:func:`judge` turns a run and the reference into a verdict: ``passed``, ``violated`` (held-out
accuracy dropped more than ``max_accuracy_drop`` points, or, without a held-out set, the training
loss lost more than ``max_loss_drift`` of the reference's progress) or ``unstable`` (NaN/Inf,
divergence, or a GradScaler that skipped most steps). Violated and unstable configurations are
never recommended.

Only the numerics knobs (precision, grad_scaler, fp32_layers) change what is computed; batch
size, memory format, padding, cuDNN and streams do not, so each *numerics key* is checked once,
with the check's own batch size and step count, and the result is reused by every configuration
that shares it. The training runs in a worker (mode "accuracy"), isolated like a trial; the study
side (:class:`AccuracyGate`) decides when to check and caches results in study user attributes.

The package is split by the side that runs it: ``worker`` holds what a check worker process runs
(the parity run and its figures, gradients and verdict; the held-out check's training), ``study``
what the search process decides (the gates, the plan, the references kept across searches);
``settings``, used by both, stays here. The worker side never imports the study side.

A sharper, cheaper check, not yet wired into the search: numerics parity (``worker.parity``), the loss
trajectory, first gradients and progress on the first batch over a few steps against FP32's, judged
by a band that FP32 from weights moved to neighbouring bf16 values calibrates in the same run
(scripts/parity_calibration.py shows it can fail).

With a budget the checks cost in proportion: their steps are planned from the FP32 baseline's
measured step time to fit in a share of it (``study.plan``), and the FP32 reference is trained once per
workload, settings, torch and device and kept across searches (``study.reference_cache``).
"""
