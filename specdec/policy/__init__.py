"""Speculation policies: choose k (draft tokens per step) from the decode batch, learn from results.

One file per policy (never, always, batch_threshold, goodput, schedule) over the types and protocol in
:mod:`.base`. A new policy is a new file plus one line in ``build_policy``.
"""

from __future__ import annotations

from ..errors import ConfigError
from .always import Always
from .base import BatchView, Policy, StepStats
from .batch_threshold import BatchThreshold
from .goodput import SERVED_OUTLIER, Goodput
from .never import Never
from .schedule import Schedule

__all__ = ["Always", "BatchThreshold", "BatchView", "Goodput", "Never", "Policy", "SERVED_OUTLIER", "Schedule",
           "StepStats", "build_policy"]


def build_policy(cfg):
    name = cfg.get("name", "never")
    if name == "never":
        return Never()
    if name == "always":
        return Always(int(cfg.k))
    if name == "batch_threshold":
        on = cfg.get("on_at_or_below")
        return BatchThreshold(int(cfg.k), int(cfg.off_above), None if on is None else int(on))
    if name == "goodput":
        return Goodput([int(k) for k in cfg.ks], ema=float(cfg.get("ema", 0.1)),
                       margin=float(cfg.get("margin", 0.03)), explore_every=int(cfg.get("explore_every", 32)),
                       profile_context=int(cfg.get("profile_context", 512)), time_ema=float(cfg.get("time_ema", 0.1)),
                       prior_ema=float(cfg.get("prior_ema", 0.01)))
    if name == "schedule":
        return Schedule(int(cfg.k), int(cfg.on_steps), int(cfg.off_steps))
    raise ConfigError(f"unknown policy {name!r}; valid: never, always, batch_threshold, goodput, schedule")
