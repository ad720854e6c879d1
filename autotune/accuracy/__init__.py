"""Accuracy versus speed: does a configuration still train as FP32 does?

The default check is numerics parity (``worker.parity``, ``--accuracy-method parity``): the
configuration, the FP32 reference and calibration runs (FP32 moved by rounding-sized differences,
which show how far this model's own training carries such a difference) train a few dozen steps
from the same initial weights on the same batches; the loss trajectory, each tensor's first gradient
and its update over the run, and the progress on the first batch are judged against FP32's by bands
the calibrations set (``worker.parity_verdict``): ``passed``, ``violated`` or ``unstable`` (NaN/Inf).
scripts/parity_calibration.py shows which harm it fails and which harmless changes it passes.

The held-out check (``worker.check``, ``--accuracy-method held-out``) trains longer on learnable data
and judges held-out accuracy and the final training loss against FP32's.

Only the numerics knobs (precision, grad_scaler, fp32_layers, fp8, the optimizer's states, the fused
loss, ...) change what is computed; batch size, memory format, padding, cuDNN and streams do not, so
each *numerics key* is checked once, with the check's own batch size and step count, and the verdict
is reused by every configuration that shares it. Violated and unstable configurations are never
recommended.

The package is split by the side that runs it: ``worker`` holds what a check worker process runs
(the parity run and its figures, gradients and verdict; the held-out check's training), ``study``
what the search process decides (the gates, when to check, the plan, the references kept across
searches); ``settings``, used by both, stays here. The worker side never imports the study side.

With a budget the checks cost in proportion: their steps are planned from the FP32 baseline's
measured step time to fit in a share of it (``study.parity_gate``, ``study.plan``), and the FP32
reference is trained once per workload, settings, torch and device and kept across searches
(``study.reference_cache``).
"""
