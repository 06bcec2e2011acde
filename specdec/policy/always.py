"""always: static speculation, the same k on every step."""

from __future__ import annotations

from ..errors import ConfigError
from .base import BatchView, StepStats


class Always:
    """Static speculation: k draft tokens every step."""

    name = "always"

    def __init__(self, k: int):
        if k < 1:
            raise ConfigError(f"policy.k={k}: always-speculate needs k >= 1")
        self.k = k
        self.ks = (0, k)
        self.choices = (k,)  # never 0: the engine captures no prefill path for speculation off

    def choose(self, view: BatchView) -> int:
        return self.k

    def update(self, stats: StepStats) -> None:
        pass
