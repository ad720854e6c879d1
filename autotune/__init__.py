"""autotune: find the fastest way to train a PyTorch model on this GPU, by measurement.

The public names are imported on first use, so that ``python -m autotune`` can take the current
directory off the front of ``sys.path`` before torch or optuna are imported (a file named
``torch.py`` where the user happens to stand must not replace the real module).
"""

from __future__ import annotations

import importlib

from autotune.errors import AutotuneError, ConfigError, WorkloadError

__version__ = "0.1.0"

_LAZY = {"TunedConfig": "autotune.deploy.config", "load": "autotune.deploy.config", "Workload": "autotune.workload.models",
         "load_compile_cache": "autotune.deploy.compile_cache"}

__all__ = ["TunedConfig", "load", "load_compile_cache", "Workload", "AutotuneError", "ConfigError", "WorkloadError",
           "__version__"]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
