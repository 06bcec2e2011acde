"""User-facing errors: each names the bad input and what would be valid.

Entry points catch :class:`SpecdecError`, print its message and exit non-zero; anything else is a
bug and keeps its traceback.
"""


class SpecdecError(Exception):
    """Base class of errors caused by user input (configs, files, checkpoints, prompts)."""


class ConfigError(SpecdecError, ValueError):
    """An unknown or inconsistent configuration value."""


def config_flag(key: str, value) -> bool:
    """A boolean setting: true / false, also as the strings a command line gives; anything else is a
    ConfigError naming ``key``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ConfigError(f"{key}={value!r}: must be true or false")
