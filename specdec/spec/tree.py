"""Draft trees: token ids, parents, depths and ancestor masks for a batch, built on the device.

A tree of T nodes per request: node 0 is the root (the pending token, already committed, whose KV
the verify pass computes), nodes 1..T-1 are draft tokens in topological order (parent < child).
For verification, node i sits at logical KV slot ``seq_len + i`` and RoPE position
``seq_len + depth[i]``; it may attend to the whole prefix plus its ancestors (bit j of ``mask[i]``
set iff node j is node i or one of its ancestors). T = 1 is plain decoding.

Growing a tree (EAGLE-2): take the ``topk`` best tokens at the root; for ``steps - 1`` more rounds,
expand the current frontier's ``topk`` nodes, score their ``topk * topk`` children by cumulative
log-probability and keep the best ``topk`` as the next frontier; finally keep the best
``num_draft_tokens`` candidates overall. Children score strictly below their parents (a tiny
depth penalty breaks exact ties), so the kept set is closed under ancestors. ``topk = 1`` gives a
chain of ``steps`` tokens. Everything here is batched tensor work: no host sync. ``grow_tree`` over
torch ops is the readable form; the EAGLE-3 drafter grows the same trees with one Triton launch per
round and one for the selection (``kernels_triton/tree_grow.py``, through ``tree_ops.tree_expand`` /
``tree_ops.tree_select``), and tests check the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import tree_ops

MAX_TREE_NODES = 64  # one int64 ancestor bitmask per node


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, T] int64, tokens[:, 0] = root (pending token)
    parents: torch.Tensor  # [B, T] int32, parents[:, 0] = -1
    depth: torch.Tensor  # [B, T] int32, depth[:, 0] = 0
    mask: torch.Tensor  # [B, T] int64 ancestor bitmask including self
    # What the counterfactual acceptance of smaller trees reads (kernels_triton/counterfactual.py),
    # set only when asked for (``cand_ids=True``): the growth's candidate buffers (tokens, scores,
    # parents, depths) [B, C], each node's candidate id [B, T] int32 (-1 at the root) and the topk
    cand: tuple | None = None
    cand_ids: torch.Tensor | None = None
    topk: int | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def bit(i: torch.Tensor) -> torch.Tensor:
    """1 << i as int64 (i = 63 wraps to the sign bit, which is what a bitmask wants)."""
    return torch.bitwise_left_shift(torch.ones_like(i, dtype=torch.int64), i.to(torch.int64))


def ancestor_masks(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, T] parents (root -1, topological) -> [B, T] int64 ancestor-or-self bitmasks (one launch
    on the GPU: kernels_triton/tree_mask.py; ``max_depth`` bounds the walk, depth <= steps)."""
    return tree_ops.ancestor_masks(parents, max_depth)


def single_node_tree(root: torch.Tensor, consts=None) -> DraftTree:
    """The k = 0 tree: the root alone. root: [B] int64. ``consts`` = (parents -1 [R, 1] int32, depth 0
    [R, 1] int32, mask 1 [R, 1] int64) with R >= B: persistent buffers to view instead of filling new
    ones (a plain decode step then launches no kernel for its tree)."""
    B = root.shape[0]
    if consts is not None:
        par, dep, mask = consts
        return DraftTree(root[:, None].long(), par[:B], dep[:B], mask[:B])
    z = torch.zeros(B, 1, dtype=torch.int32, device=root.device)
    return DraftTree(root[:, None].long(), z - 1, z, torch.ones(B, 1, dtype=torch.int64, device=root.device))


def chain_tree(root: torch.Tensor, drafts: torch.Tensor) -> DraftTree:
    """A chain: root [B] followed by drafts [B, K] (each node the child of the previous)."""
    B, K = drafts.shape
    dev = root.device
    tokens = torch.cat([root[:, None].long(), drafts.long()], dim=1)  # [B, K+1]
    parents = (torch.arange(K + 1, device=dev, dtype=torch.int32) - 1).expand(B, K + 1).contiguous()
    depth = torch.arange(K + 1, device=dev, dtype=torch.int32).expand(B, K + 1).contiguous()
    mask = (bit(torch.arange(K + 1, device=dev) + 1) - 1).expand(B, K + 1).contiguous()
    return DraftTree(tokens, parents, depth, mask)


def topk_of(logp: torch.Tensor, k: int):
    """(values, ids) of the k largest entries of the last dim, descending: ``grow_tree``'s inputs
    from full log-probs (drafters with a fused kernel produce them directly)."""
    v, i = logp.float().topk(k, dim=-1)
    return v, i


def select_tree(root: torch.Tensor, cand_tokens: torch.Tensor, cand_scores: torch.Tensor,
                cand_parents: torch.Tensor, cand_depth: torch.Tensor, num_draft_tokens: int,
                max_depth: int, cand_ids: bool = False, topk: int | None = None) -> DraftTree:
    """Keep the best ``num_draft_tokens`` candidates as a tree (``tree_ops.tree_select``: score minus a
    tiny depth penalty, ties to the lower candidate id, kept in candidate order).

    cand_*: [B, C] over all grown candidates in round order (a parent's index is lower than its
    child's); cand_parents holds candidate indices, -1 for children of the root; scores are
    cumulative log-probabilities; ``max_depth`` is the static depth bound (the growth steps).
    ``cand_ids``: the tree also carries the candidates and each node's candidate id (and ``topk``,
    the growth's), for the counterfactual acceptance of smaller trees.
    """
    n = min(num_draft_tokens, cand_tokens.shape[1])
    if n + 1 > MAX_TREE_NODES:
        raise ValueError(f"num_draft_tokens={num_draft_tokens}: a tree holds at most {MAX_TREE_NODES - 1}")
    cand = (cand_tokens.long().contiguous(), cand_scores.float().contiguous(), cand_parents.int().contiguous(),
            cand_depth.int().contiguous())
    if not cand_ids:
        return DraftTree(*tree_ops.tree_select(root, cand, n, max_depth))
    *tree, cid = tree_ops.tree_select(root, cand, n, max_depth, cand_ids=True)
    return DraftTree(*tree, cand=cand, cand_ids=cid, topk=topk)


def grow_tree(root: torch.Tensor, first, expand, *, topk: int, steps: int,
              num_draft_tokens: int, to_target=None, cand_ids: bool = False) -> DraftTree:
    """EAGLE-2 growth. root: [B]; ``first`` = (log-probs, ids) of the root's best children, [B, >= k]
    each, descending (e.g. ``topk_of(logp, k)`` of full draft log-probs [B, V]).

    ``expand(r, tokens [B, topk], parent_slot [B, topk]) -> (log-probs, ids)`` [B, topk, >= topk]
    each, descending, runs the draft on round r's frontier (``parent_slot`` = each node's parent's
    index in the previous frontier, -1 in round 0) and returns its best children. ``to_target``
    maps draft-vocabulary ids to target ids (EAGLE-3's d2t); identity when None. Only the best
    ``topk`` children of a node can be kept, so no step ever needs the full distribution.
    ``cand_ids``: see :func:`select_tree`.
    """
    if steps < 1 or topk < 1:
        raise ValueError(f"a tree needs steps >= 1 and topk >= 1 (got steps={steps}, topk={topk})")
    to_target = to_target or (lambda ids: ids)
    B = root.shape[0]
    dev = root.device
    scores, ids = first[0][:, :topk].float(), first[1][:, :topk]  # [B, k]
    front_tok = to_target(ids)
    front_ids = torch.arange(topk, device=dev).expand(B, topk)  # candidate ids of the frontier
    cands = [(front_tok, scores, torch.full_like(ids, -1), torch.ones_like(ids))]
    n_cand = topk
    parent_slot = torch.full_like(ids, -1)
    for r in range(1, steps):
        cs, cid = expand(r - 1, front_tok, parent_slot)  # [B, k, >= k]
        cs, cid = cs[:, :, :topk].float(), cid[:, :, :topk]
        child_scores = (scores[:, :, None] + cs).reshape(B, topk * topk)
        child_tok = to_target(cid).reshape(B, topk * topk)
        child_par = front_ids[:, :, None].expand(B, topk, topk).reshape(B, topk * topk)
        cands.append((child_tok, child_scores, child_par, torch.full_like(child_tok, r + 1)))
        scores, best = tree_ops.topk(child_scores, topk)  # next frontier [B, k] (one launch, no sort)
        front_tok = child_tok.gather(1, best)
        front_ids = n_cand + best
        parent_slot = best // topk
        n_cand += topk * topk
    tok, sc, par, dep = (torch.cat(x, dim=1) for x in zip(*cands))
    return select_tree(root, tok, sc, par, dep, num_draft_tokens, steps, cand_ids, topk)
