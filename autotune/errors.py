"""User-facing errors: each message says what went wrong and how to fix it."""


class AutotuneError(Exception):
    """Base class for mistakes a user can fix (bad model name, bad option, bad file)."""


class ConfigError(AutotuneError, ValueError):
    """An option or configuration value is invalid."""


class WorkloadError(AutotuneError):
    """The model (or workload factory) given with --model cannot be built."""
