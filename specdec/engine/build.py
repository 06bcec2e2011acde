"""The engine's start-up pieces: its decode and prefill runners and the counterfactual plan.

Functions of their inputs, not of the Engine: a runner's body closes over the model, KV, state and
drafter only. A closure over the engine would make a reference cycle (engine -> stepper -> runner ->
body -> engine) that keeps its KV pool and CUDA graphs alive after ``del engine`` until the cyclic
garbage collector runs.
"""

from __future__ import annotations

import functools

import torch

from ..spec.base import capturable, catches_up, extends_at_k0, prefills
from .graphs import EagerDecode, GraphedDecode, PaddedPrefill, prefill_request_buckets
from .step import Counterfactual, catch_up_body_, prefill_body_, step_body_


def decode_runner(model, state, kv, cfg, drafter, acceptance, counterfactual: dict, buckets, tree_sizes,
                  graphed: bool):
    """The decode step runner: CUDA graphs per (bucket, tree size) when ``graphed`` (a tree size whose
    drafter cannot be captured runs eagerly), else eager steps (padded to the buckets with pad_eager).
    A k = 0 step runs the drafter only if it extends at k = 0 (decided once here, not per step)."""
    k0_drafter = drafter if extends_at_k0(drafter) else None

    def body(B: int, T: int, context) -> None:
        step_body_(model, state, kv, B, T, cfg.step_temperature, drafter if T > 1 else k0_drafter, context,
                   acceptance=acceptance, counterfactual=counterfactual)

    if graphed:
        eager_T = [t for t in tree_sizes if t > 1 and not capturable(drafter)]
        return GraphedDecode(body, state, buckets, tree_sizes, eager_T)
    return EagerDecode(body, pad_to=buckets if cfg.pad_eager else None)


def attach_prefill_runners_(stepper, model, kv, cfg, drafter, max_pages: int, *, speculates: bool, rests: bool,
                            timed_catch_up: bool) -> None:
    """Padded (graphed when the decode runner is) prefill runners on ``stepper``, for the paths the
    policy can reach: with a drafter that catches up, prefill drafts only while speculating (never:
    not at all) and runs the target alone only while off (always: never), and the catch-up runs only
    on a switch back on. A path not captured runs eagerly if ever taken (e.g. engine.step(0) called
    by hand under always). ``timed_catch_up``: the catch-up shapes are timed at start-up, for a policy
    that prices a switch back on by its catch-up."""
    graphed = stepper.runner.graphed
    token_buckets = [b for b in cfg.prefill_buckets if 1 <= b < cfg.prefill_chunk]
    if cfg.prefill_buckets:  # and a full chunk, the largest prefill forward
        token_buckets.append(cfg.prefill_chunk)
    if not token_buckets or not (graphed or cfg.pad_eager):
        return
    request_buckets = prefill_request_buckets(cfg.prefill_requests, cfg.max_batch_size)

    def padded(body, timed: bool) -> PaddedPrefill:
        return PaddedPrefill(body, model.device, token_buckets, max_pages, graphed=graphed,
                             request_buckets=request_buckets, timed=timed)

    split = catches_up(drafter) and prefills(drafter)  # drafted and plain prefill differ
    if not split or speculates:
        body = functools.partial(prefill_body_, model, kv, drafter if prefills(drafter) else None)
        stepper.prefill_runner = padded(body, cfg.prefill_fit)
    if split and rests:  # prefill while speculation is off: the target's alone
        stepper.plain_prefill_runner = padded(functools.partial(prefill_body_, model, kv, None), cfg.prefill_fit)
    if catches_up(drafter) and speculates and rests:  # a switch back on replays these shapes
        stepper.catch_up_runner = padded(functools.partial(catch_up_body_, model, kv, drafter), timed_catch_up)


def plan_counterfactual(policy, drafter, acceptance, state) -> tuple[dict, tuple[int, ...]]:
    """Counterfactual acceptance for a policy that asks for it: a speculative step at k also scores
    every smaller k' of the policy's ks. Returns ({T: Counterfactual} for the device, the ks whose
    commits the host derives), telling the policy the pairs it will get and their labels:
      replayed acceptance   the replay draws the smaller sizes at the same quantile itself (no plan);
      chains that nest      (n-gram) the host reads a smaller chain's commits off each row's
                            committed count, min(committed, k' + 1): exact, no device plan;
      a drafter that scores (EAGLE-3, ``counterfactual_commits_``) its smaller trees on the verified
                            path of the larger one: output columns reserved per tree size.
    A drafter that can do none of these gets ({}, ())."""
    if policy is None or not policy.wants_counterfactual:
        return {}, ()
    ks = sorted(k for k in policy.ks if k > 0)
    smaller = {k: tuple(j for j in ks if j < k) for k in ks}
    if acceptance is not None:
        if hasattr(acceptance, "counterfactual_"):
            acceptance.counterfactual_(smaller)
            policy.counterfactual_({(j, k): "replayed" for k in ks for j in smaller[k]})
        return {}, ()
    if getattr(drafter, "nested_chains", False):
        if len(ks) > 1:
            policy.counterfactual_({(j, k): "exact" for k in ks for j in smaller[k]})
        return {}, tuple(ks)
    if not hasattr(drafter, "counterfactual_commits_"):
        return {}, ()
    plan, pairs = {}, {}
    for k in ks:
        if not smaller[k]:
            continue
        shapes = [list(drafter.shape_for(j)) for j in smaller[k]]
        plan[drafter.num_nodes(k)] = Counterfactual(smaller[k], torch.tensor(shapes, dtype=torch.int32,
                                                                             device=state.device), shapes)
        drafter.counterfactual_sizes.add(k)
        pairs.update({(j, k): drafter.counterfactual_label(j, k) for j in smaller[k]})
    if not plan:
        return {}, ()
    state.set_cf_widths_({T: len(c.ks) for T, c in plan.items()})
    policy.counterfactual_(pairs)
    return plan, ()
