"""One measurement: the runner (parent side) starts a worker (child side), which measures, profiles and reads NVML; DDP ranks. Nothing here imports autotune.search."""
