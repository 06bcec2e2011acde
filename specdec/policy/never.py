"""never: plain decoding on every step (the baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import BatchView, Policy, StepStats


@dataclass(eq=False)
class Never(Policy):
    """Baseline: plain decoding every step (k = 0)."""

    name = "never"
    ks = (0,)
    choices = (0,)

    def choose(self, view: BatchView) -> int:
        return 0

    def update(self, stats: StepStats) -> None:
        pass
