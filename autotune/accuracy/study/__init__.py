"""What the search process decides about accuracy: which trials to check, at how many steps, and
with what verdict. The parity gate (parity_gate) and the held-out gate (gate), the checks' steps
from the budget (plan), the FP32 references kept across searches (reference_cache) and `autotune
accuracy`'s comparison of precision modes (compare). They start check workers (autotune.trial.runner)
that run autotune.accuracy.worker, and read its results."""
