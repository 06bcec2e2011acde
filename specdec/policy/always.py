"""always: static speculation, the same k on every step."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .base import BatchView, Policy, StepStats


@dataclass(eq=False)
class Always(Policy):
    """Static speculation: k draft tokens every step."""

    k: int  # draft tokens per step (policy.k null: the drafter's largest configured size)

    name = "always"

    def __post_init__(self):
        if self.k < 1:
            raise ConfigError(f"policy.k={self.k}: always-speculate needs k >= 1")
        self.ks = (0, self.k)
        self.choices = (self.k,)  # never 0: the engine captures no prefill path for speculation off

    def choose(self, view: BatchView) -> int:
        return self.k

    def update(self, stats: StepStats) -> None:
        pass
