"""Speculation policies: choose k (draft tokens per step) from the decode batch, learn from results.

One file per policy (never, always, batch_threshold, goodput, bandit, schedule), each a subclass of
:class:`.base.Policy` whose options are dataclass fields with their one default (the policy class
itself, or goodput's GoodputConfig and bandit's BanditConfig). conf/policy/<name>.yaml lists the
keys; a null there takes that default. A new policy is a new file plus one entry in ``BUILDERS``.
"""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from .always import Always
from .bandit import Bandit, BanditConfig
from .base import BatchView, Policy, StepStats, options
from .batch_threshold import BatchThreshold
from .goodput import SERVED_OUTLIER, Goodput, GoodputConfig
from .never import Never
from .schedule import Schedule

__all__ = ["Always", "Bandit", "BanditConfig", "BatchThreshold", "BatchView", "Goodput", "GoodputConfig", "Never",
           "Policy", "SERVED_OUTLIER", "Schedule", "StepStats", "build_policy"]


def _size(k, sizes, key: str = "k") -> int:
    """policy.<key> (a draft length): None -> the drafter's largest configured size; an explicit one
    must be a configured size."""
    if k is None:
        if not sizes:
            raise ConfigError(f"policy.{key} is null and the drafter lists no sizes; set policy.{key}")
        return max(sizes)
    k = int(k)
    if sizes is not None and k not in sizes:
        raise ConfigError(f"policy.{key}={k} is not a size the drafter is configured for; configured sizes: "
                          f"{list(sizes)} (EAGLE-3: draft.trees num_draft_tokens; n-gram: draft.chains)")
    return k


def _ks(ks, sizes) -> list[int]:
    """goodput's policy.ks: None -> every size the drafter is configured for; else configured sizes."""
    if ks is None:
        if not sizes:
            raise ConfigError("policy goodput: policy.ks is null and the drafter lists no sizes; set policy.ks")
        return list(sizes)
    ks = [int(k) for k in ks]
    bad = [k for k in ks if sizes is not None and k not in sizes]
    if bad:
        raise ConfigError(f"policy.ks={ks}: {bad} not sizes the drafter is configured for; configured sizes: "
                          f"{list(sizes)} (EAGLE-3: draft.trees num_draft_tokens; n-gram: draft.chains)")
    return ks


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _fixed_k(cls):
    """Build a policy whose options are its own dataclass fields, k among them."""
    return lambda o, sizes: options(cls, {**o, "k": _size(o.get("k"), sizes)}, cls.name)


def _goodput(o: dict, sizes) -> Goodput:
    if "profile_context" in o:
        o["profile_context"] = _profile_context(o["profile_context"])
    return Goodput(_ks(o.pop("ks", None), sizes), options(GoodputConfig, o, "goodput"))


def _bandit(o: dict, sizes) -> Bandit:
    own = {k: o.pop(k) for k in list(o) if k in _fields(BanditConfig)}
    return Bandit(_goodput(o, sizes), **own)


# name -> (its keys, build(its options, the drafter's sizes))
BUILDERS = {
    "never": (set(), lambda o, sizes: Never()),
    "always": ({"k"}, _fixed_k(Always)),
    "batch_threshold": (_fields(BatchThreshold), _fixed_k(BatchThreshold)),
    "schedule": (_fields(Schedule), _fixed_k(Schedule)),
    "goodput": ({"ks"} | _fields(GoodputConfig), _goodput),
    "bandit": ({"ks"} | _fields(GoodputConfig) | _fields(BanditConfig), _bandit),
}
ALL_KEYS = set().union(*(keys for keys, _ in BUILDERS.values()))


def build_policy(cfg, sizes=None) -> Policy:
    """From the Hydra ``policy`` group. ``sizes``: the drafter's configured draft lengths (None: any)
    -- always / batch_threshold / schedule default to the largest, goodput's ks to all of them. A null
    value takes the policy's default; a key no policy has is a ConfigError naming it and the valid ones
    (a key of another policy is ignored: an experiment may set goodput's keys whatever the policy)."""
    given = {str(k): v for k, v in cfg.items() if v is not None}
    name = given.pop("name", "never")
    if name not in BUILDERS:
        raise ConfigError(f"unknown policy {name!r}; valid: {', '.join(BUILDERS)}")
    keys, build = BUILDERS[name]
    unknown = sorted(set(given) - ALL_KEYS)
    if unknown:
        raise ConfigError(f"policy {name}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(sorted(keys))}")
    return build({k: v for k, v in given.items() if k in keys}, sizes)


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
