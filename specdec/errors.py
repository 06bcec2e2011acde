"""User-facing errors: each names the bad input and what would be valid.

Entry points catch :class:`SpecdecError`, print its message and exit non-zero; anything else is a
bug and keeps its traceback.
"""


class SpecdecError(Exception):
    """Base class of errors caused by user input (configs, files, checkpoints, prompts)."""


class ConfigError(SpecdecError, ValueError):
    """An unknown or inconsistent configuration value."""
