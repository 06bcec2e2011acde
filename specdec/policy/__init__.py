"""Speculation policies: choose k (draft tokens per step) from the decode batch, learn from results.

One file per policy (never, always, batch_threshold, goodput, schedule) over the types and protocol in
:mod:`.base`. A new policy is a new file plus one line in ``build_policy``.
"""

from __future__ import annotations

from ..errors import ConfigError, config_flag
from .always import Always
from .bandit import Bandit
from .base import BatchView, Policy, StepStats
from .batch_threshold import BatchThreshold
from .goodput import SERVED_OUTLIER, Goodput
from .never import Never
from .schedule import Schedule

__all__ = ["Always", "Bandit", "BatchThreshold", "BatchView", "Goodput", "Never", "Policy", "SERVED_OUTLIER",
           "Schedule", "StepStats", "build_policy"]


def _size(cfg, key: str, sizes) -> int:
    """policy.<key> (a draft length): null -> the drafter's largest configured size; an explicit one
    must be a configured size."""
    k = cfg.get(key)
    if k is None:
        if not sizes:
            raise ConfigError(f"policy {cfg.name}: policy.{key} is null and the drafter lists no sizes; "
                              f"set policy.{key}")
        return max(sizes)
    k = int(k)
    if sizes is not None and k not in sizes:
        raise ConfigError(f"policy.{key}={k} is not a size the drafter is configured for; configured sizes: "
                          f"{list(sizes)} (EAGLE-3: draft.trees num_draft_tokens; n-gram: draft.chains)")
    return k


def build_policy(cfg, sizes=None):
    """From the Hydra ``policy`` group. ``sizes``: the drafter's configured draft lengths (None: any)
    -- always / batch_threshold default to the largest, goodput's ks to all of them."""
    name = cfg.get("name", "never")
    if name == "never":
        return Never()
    if name == "always":
        return Always(_size(cfg, "k", sizes))
    if name == "batch_threshold":
        on = cfg.get("on_at_or_below")
        return BatchThreshold(_size(cfg, "k", sizes), int(cfg.off_above), None if on is None else int(on))
    if name == "goodput":
        return _goodput(cfg, sizes)
    if name == "bandit":
        arms = cfg.get("arms") or ["goodput", "always", "never"]
        return Bandit(_goodput(cfg, sizes), list(arms), block_iters=int(cfg.get("block_iters", 8)),
                      block_rows=int(cfg.get("block_rows", 256)), settle=int(cfg.get("settle", 2)),
                      memory=float(cfg.get("memory", 0.2)), explore_cost=float(cfg.get("explore_cost", 0.01)))
    if name == "schedule":
        return Schedule(_size(cfg, "k", sizes), int(cfg.on_steps), int(cfg.off_steps))
    raise ConfigError(f"unknown policy {name!r}; valid: never, always, batch_threshold, goodput, bandit, schedule")


def _goodput(cfg, sizes) -> Goodput:
    """goodput from its config keys (policy=goodput, and the model of policy=bandit)."""
    ks = cfg.get("ks")
    if ks is None:
        if not sizes:
            raise ConfigError("policy goodput: policy.ks is null and the drafter lists no sizes; set policy.ks")
        ks = list(sizes)
    ks = [int(k) for k in ks]
    bad = [k for k in ks if sizes is not None and k not in sizes]
    if bad:
        raise ConfigError(f"policy.ks={ks}: {bad} not sizes the drafter is configured for; configured sizes: "
                          f"{list(sizes)} (EAGLE-3: draft.trees num_draft_tokens; n-gram: draft.chains)")
    return Goodput(ks, ema=float(cfg.get("ema", 0.1)),
                   margin=float(cfg.get("margin", 0.03)), explore_every=int(cfg.get("explore_every", 32)),
                   profile_context=_profile_context(cfg.get("profile_context", 512)),
                   time_ema=float(cfg.get("time_ema", 0.1)), time_every=int(cfg.get("time_every", 1)),
                   prior_ema=float(cfg.get("prior_ema", 0.01)),
                   explore_backoff=float(cfg.get("explore_backoff", 1.0)),
                   explore_max=int(cfg.get("explore_max", 1024)),
                   shadow_evals=int(cfg.get("shadow_evals", 0)),
                   profile_iters=int(cfg.get("profile_iters", 20)),
                   probe_rows=int(cfg.get("probe_rows", 1)),
                   switch_horizon=int(cfg.get("switch_horizon", 32)),
                   explore_budget=float(cfg.get("explore_budget", 0.05)),
                   probe_cost=float("inf") if cfg.get("probe_cost") is None else float(cfg.probe_cost),
                   counterfactual=config_flag("policy.counterfactual", cfg.get("counterfactual", False)),
                   refresh_every=int(cfg.get("refresh_every", 0) or 0),
                   defer_first_tries=config_flag("policy.defer_first_tries", cfg.get("defer_first_tries", False)),
                   ramp_hold=config_flag("policy.ramp_hold", cfg.get("ramp_hold", False)),
                   host_model=config_flag("policy.host_model", cfg.get("host_model", False)),
                   calibrate=float(cfg.get("calibrate", 0.0) or 0.0),
                   mixed_pricing=config_flag("policy.mixed_pricing", cfg.get("mixed_pricing", False)),
                   shadow_min_rows=float(cfg.get("shadow_min_rows", 2.0)),
                   probe_requests=int(cfg.get("probe_requests", 0) or 0),
                   shadow_ema=cfg.get("shadow_ema", 0.03),
                   iter_median=int(cfg.get("iter_median", 0) or 0),
                   iter_min_samples=int(cfg.get("iter_min_samples", 0) or 0),
                   row_sample=int(cfg.get("row_sample", 0) or 0),
                   shadow_max_lag=None if cfg.get("shadow_max_lag") is None else int(cfg.shadow_max_lag),
                   explore_fresh=float(cfg.get("explore_fresh", 0.0) or 0.0),
                   shadow_rows_cap=None if cfg.get("shadow_rows_cap") is None else int(cfg.get("shadow_rows_cap")))


def profile_context_auto(cfg) -> bool:
    """goodput's ``profile_context: auto``: the workload's mean decode context, which the caller
    (specdec.run, which has the prompts) writes into the config before the policy is built."""
    return str(cfg.get("profile_context", "")).strip().lower() == "auto"


def _profile_context(value) -> int:
    """goodput's profile_context: a number of context tokens ("auto" resolved by the caller)."""
    if profile_context_auto({"profile_context": value}):
        raise ConfigError("policy.profile_context=auto needs the workload's prompts (serving through "
                          "specdec.run); set a number of tokens instead")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"policy.profile_context={value!r}: a number of context tokens, or auto (the "
                          "workload's mean prompt length + half its new tokens)") from None
