"""autotune: find the fastest way to train a PyTorch model on this GPU, by measurement."""

from autotune.config import TunedConfig, load
from autotune.errors import AutotuneError, ConfigError, WorkloadError
from autotune.workloads import Workload

__version__ = "0.1.0"

__all__ = ["TunedConfig", "load", "Workload", "AutotuneError", "ConfigError", "WorkloadError", "__version__"]
