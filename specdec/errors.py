"""User-facing errors: each names the bad input and what would be valid.

Entry points catch :class:`SpecdecError`, print its message and exit non-zero; anything else is a
bug and keeps its traceback.
"""

import operator


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


def config_number(key: str, value, kind=int, minimum=None):
    """``value`` as ``kind`` (int or float) at least ``minimum``; None stays None. Strings that
    spell a number are accepted (command-line overrides); anything else, a float where an int is
    wanted, or a value below ``minimum`` is a ConfigError naming ``key``."""
    if value is None:
        return None
    want = "an integer" if kind is int else "a number"
    if minimum is not None:
        want += f" >= {minimum}"
    try:
        if isinstance(value, bool):
            raise ValueError
        if kind is int:
            v = int(value) if isinstance(value, str) else operator.index(value)
        else:
            v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: must be {want}") from None
    if minimum is not None and v < minimum:
        raise ConfigError(f"{key}={value!r}: must be {want}")
    return v
