"""The draft tree's kernels: one call per op, the Triton kernel or its torch version behind it.

Tree growth (candidates, expand, select), ancestor masks and the top-k ops are spec-side work, not
model layers, so their dispatch lives here beside tree.py; :func:`use_step_kernels` (also used by
engine/step_ops.py) holds the step kernels' backend choice.
"""

from __future__ import annotations

import os

import torch

from ..models.ops import use_triton


def use_step_kernels(backend: str, t: torch.Tensor) -> bool:
    """The step's addressing and tree helpers (block_meta, tree_meta, ancestor_masks, tree_expand,
    tree_select) run as Triton kernels wherever the Triton backend runs: they replace ~12,
    ~8-per-level, ~20-per-round and ~25 small torch kernels per call (docs/kernel_notes.md "Step
    kernels"). The kernel option step_kernels (kernels_triton/options.py) False keeps the torch
    versions (the references); True forces the kernels with backend "auto" on the CPU too, under the
    interpreter (tests of the engine loop)."""
    from kernels_triton import options

    flag = options.get().step_kernels
    if flag is False:
        return False
    if flag and backend == "auto" and os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return use_triton(backend, t)


def ancestor_masks(parents, max_depth: int, *, backend="auto"):
    """[B, T] tree parents -> [B, T] int64 ancestor-or-self bitmasks."""
    from kernels_triton import tree_mask

    fn = tree_mask.ancestor_masks if use_step_kernels(backend, parents) else tree_mask.ancestor_masks_ref
    return fn(parents, max_depth)


def new_tree_candidates(B: int, C: int, device):
    """Candidate buffers of a growing draft tree (kernels_triton/tree_grow.py)."""
    from kernels_triton import tree_grow

    return tree_grow.new_candidates(B, C, device)


def tree_expand(cand, cand_off, depth, lp, cid, d2t, score=None, fcid=None, rows=None, h_front=None, valid=None,
                seq=None, *, backend="auto"):
    """One EAGLE-2 growth round: candidates written, next frontier and next draft rows (tree_grow.py)."""
    from kernels_triton import tree_grow

    fn = tree_grow.tree_expand if use_step_kernels(backend, lp) else tree_grow.tree_expand_ref
    return fn(cand, cand_off, depth, lp, cid, d2t, score, fcid, rows, h_front, valid, seq)


def tree_select(root, cand, n: int, max_depth: int, *, backend="auto", cand_ids: bool = False):
    """The draft tree of the n best candidates: (tokens, parents, depth, ancestor masks) [B, n + 1],
    with ``cand_ids`` also each node's candidate id [B, n + 1] int32 (-1 at the root)."""
    from kernels_triton import tree_grow

    fn = tree_grow.tree_select if use_step_kernels(backend, cand[0]) else tree_grow.tree_select_ref
    return fn(root, cand, n, max_depth, cand_ids) if cand_ids else fn(root, cand, n, max_depth)


def counterfactual_commits(cand, cids, parents, nodes, accept_len, shapes, K: int, out=None, *, shapes_host=None,
                           max_steps=None, backend="auto"):
    """[B, M] tokens each smaller tree shape would have committed on this step's verified path
    (kernels_triton/counterfactual.py); ``shapes_host`` (the same shapes as a host list) spares the
    torch version a device read."""
    from kernels_triton import counterfactual as cf

    if use_step_kernels(backend, cids):
        return cf.counterfactual_commits(cand, cids, parents, nodes, accept_len, shapes, K, out, max_steps)
    return cf.counterfactual_commits_ref(cand, cids, parents, nodes, accept_len,
                                         shapes if shapes_host is None else shapes_host, K, out)


def _triton_topk(backend: str, x: torch.Tensor) -> bool:
    """The top-k ops run as Triton kernels: on the Triton backend, rows up to kernels_triton.topk.MAX_V
    in one program, wider ones up to MAX_SPLIT_V as the split row's two launches (torch's log_softmax +
    topk take ~20 launches per call on a GPU); wider still, torch."""
    from kernels_triton import topk as topk_mod

    return use_triton(backend, x) and x.shape[-1] <= topk_mod.MAX_SPLIT_V


def topk(x, k: int, *, backend="auto"):
    """(k largest values of the last dim as fp32, their ids int64), descending, ties lowest id first."""
    from kernels_triton import topk as topk_mod

    if _triton_topk(backend, x):
        return topk_mod.topk(x, k)
    return topk_mod.topk_ref(x, k)


def topk_logprobs(logits, k: int, *, backend="auto", out=None):
    """(log_softmax(logits) top-k values fp32, their ids int64), descending, ties lowest id first;
    written into ``out`` = (values, ids) when given."""
    from kernels_triton import topk

    if _triton_topk(backend, logits):
        return topk.topk_logprobs(logits, k, out=out)
    return topk.topk_logprobs_ref(logits, k, out=out)
