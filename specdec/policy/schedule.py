"""schedule: a fixed on/off pattern of speculative steps, for switching studies.

Speculation follows the decode step count, not the batch: ``on_steps`` steps with k draft tokens,
then ``off_steps`` steps at k = 0, repeated (``off_steps = 0``: every step speculates, as ``always``). Iterations
without decode rows do not advance the schedule. The question it serves (conf/experiment/
switch_acceptance.yaml): does acceptance hold on the first speculative step after an off period,
when the draft KV was kept in sync over the tokens committed while off (``draft.sync_while_off:
true``) or left behind (``false``)?
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from ..errors import ConfigError
from .base import BatchView, Policy, StepStats


@dataclass(eq=False)
class Schedule(Policy):
    """k for ``on_steps`` decode steps, then 0 for ``off_steps`` decode steps, repeated.

    Records, for every speculative step, its position in the on-window (0: the first step after an
    off period) and the tokens it committed per row (accepted drafts + 1); ``describe()`` gives the
    means by position, which is what the run's metrics.json keeps (``policy_state``).
    """

    k: int  # draft tokens of a speculative step (policy.k null: the drafter's largest configured size)
    on_steps: int = 4
    off_steps: int = 6

    name = "schedule"

    def __post_init__(self):
        k, on, off = self.k, self.on_steps, self.off_steps
        if k < 1 or on < 1 or off < 0:
            raise ConfigError(f"policy schedule: need k >= 1, on_steps >= 1 and off_steps >= 0 "
                              f"(got k={k}, on_steps={on}, off_steps={off})")
        self.on, self.off = on, off
        self.ks = (0, k)
        self.i = 0  # decode steps chosen so far
        # On-window position of each launched speculative step, oldest first: update() comes one
        # step late with overlapped decoding, in launch order.
        self._launched: collections.deque[int] = collections.deque()
        self._committed: dict[int, list[float]] = {}  # position -> tokens per row of each step

    def choose(self, view: BatchView) -> int:
        if view.num_decode == 0:
            return 0
        pos = self.i % (self.on + self.off)
        self.i += 1
        if pos < self.on:
            self._launched.append(pos)
            return self.k
        return 0

    def update(self, stats: StepStats) -> None:
        if stats.k == 0 or not self._launched:
            return
        pos = self._launched.popleft()
        if stats.committed:
            self._committed.setdefault(pos, []).append(sum(stats.committed) / len(stats.committed))

    def describe(self) -> dict:
        """Mean tokens committed per row and speculative step: on the first step after an off
        period (none when off = 0), on the others, overall and by position in the on-window."""
        def mean(xs):
            return sum(xs) / len(xs) if xs else None

        first = self._committed.get(0, []) if self.off else []
        other = [a for p, xs in self._committed.items() for a in xs if p > 0 or not self.off]
        every = [a for xs in self._committed.values() for a in xs]
        return {"k": self.k, "on_steps": self.on, "off_steps": self.off,
                "spec_steps": len(every),
                "first_after_off_tokens_per_step": mean(first), "first_after_off_steps": len(first),
                "other_tokens_per_step": mean(other), "other_steps": len(other),
                "tokens_per_spec_step": mean(every),
                "by_position": [mean(self._committed.get(p, [])) for p in range(self.on)] if self.off else []}
