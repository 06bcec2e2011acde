"""Speculation policies: choose k (draft tokens per step) from the decode batch, learn from results.

    k = policy.choose(view)        view: BatchView (decode rows only; prefills never count)
    policy.update(stats)           stats: StepStats of the step just run

Every k a policy can return is listed in ``policy.ks`` up front, so the engine reserves KV and
captures CUDA graphs for all of them at start-up: switching k selects another graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass
class BatchView:
    num_decode: int  # decode-ready rows this step (requests still prefilling are not counted)
    num_waiting: int  # queued requests


@dataclass
class StepStats:
    k: int
    num_decode: int
    committed: list[int]  # tokens committed per row (accepted drafts + 1)


class Never:
    """Baseline: plain decoding every step (k = 0)."""

    name = "never"
    ks = (0,)

    def choose(self, view: BatchView) -> int:
        return 0

    def update(self, stats: StepStats) -> None:
        pass


class Always:
    """Static speculation: k draft tokens every step."""

    name = "always"

    def __init__(self, k: int):
        if k < 1:
            raise ConfigError(f"policy.k={k}: always-speculate needs k >= 1")
        self.k = k
        self.ks = (0, k)

    def choose(self, view: BatchView) -> int:
        return self.k

    def update(self, stats: StepStats) -> None:
        pass


class BatchThreshold:
    """Speculate (k) while the decode batch is small; off above ``off_above`` rows, back on at or
    below ``on_at_or_below`` (hysteresis: a batch hovering at the threshold does not flip each step)."""

    name = "batch_threshold"

    def __init__(self, k: int, off_above: int, on_at_or_below: int | None = None):
        on = off_above if on_at_or_below is None else on_at_or_below
        if k < 1 or off_above < 1 or not 0 <= on <= off_above:
            raise ConfigError(f"policy batch_threshold: need k >= 1, off_above >= 1 and "
                              f"0 <= on_at_or_below <= off_above (got k={k}, off_above={off_above}, "
                              f"on_at_or_below={on})")
        self.k, self.off_above, self.on_at_or_below = k, off_above, on
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


def build_policy(cfg):
    name = cfg.get("name", "never")
    if name == "never":
        return Never()
    if name == "always":
        return Always(int(cfg.k))
    if name == "batch_threshold":
        on = cfg.get("on_at_or_below")
        return BatchThreshold(int(cfg.k), int(cfg.off_above), None if on is None else int(on))
    raise ConfigError(f"unknown policy {name!r}; valid: never, always, batch_threshold")
