"""What a check worker process runs (requests of mode "parity" and "accuracy", autotune.worker.serve):
the numerics parity run (parity), what it measured against FP32 (parity_figures, parity_grads) and
its verdict by bands (parity_verdict); the held-out check's training (check); the file in which a
worker hands the study the reference it trained (reference_file). Nothing here imports the study
side (autotune.accuracy.study)."""
