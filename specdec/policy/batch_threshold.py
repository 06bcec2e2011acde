"""batch_threshold: speculate while the decode batch is small, with hysteresis."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .base import BatchView, Policy, StepStats


@dataclass(eq=False)
class BatchThreshold(Policy):
    """Speculate (k) while the decode batch is small; off above ``off_above`` rows, back on at or
    below ``on_at_or_below`` (hysteresis: a batch hovering at the threshold does not flip each step).
    Decode rows only: prefills never flip the decision."""

    k: int  # draft tokens of a speculative step (policy.k null: the drafter's largest configured size)
    off_above: int = 16
    on_at_or_below: int = 8

    name = "batch_threshold"

    def __post_init__(self):
        k, off, on = self.k, self.off_above, self.on_at_or_below
        if k < 1 or off < 1 or not 0 <= on <= off:
            raise ConfigError(f"policy batch_threshold: need k >= 1, off_above >= 1 and "
                              f"0 <= on_at_or_below <= off_above (got k={k}, off_above={off}, "
                              f"on_at_or_below={on})")
        self.ks = (0, k)
        self.active = True

    def choose(self, view: BatchView) -> int:
        if self.active and view.num_decode > self.off_above:
            self.active = False
        elif not self.active and view.num_decode <= self.on_at_or_below:
            self.active = True
        return self.k if self.active else 0

    def update(self, stats: StepStats) -> None:
        pass
