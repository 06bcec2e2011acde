"""never: plain decoding on every step (the baseline)."""

from __future__ import annotations

from .base import BatchView, StepStats


class Never:
    """Baseline: plain decoding every step (k = 0)."""

    name = "never"
    ks = (0,)
    choices = (0,)

    def choose(self, view: BatchView) -> int:
        return 0

    def update(self, stats: StepStats) -> None:
        pass
