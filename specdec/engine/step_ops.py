"""The step's addressing and commit kernels: one call per op, the Triton kernel or its torch reference.

block_meta / tree_meta (where a block's tokens sit in the paged cache), warp_logits, verify_accept
and kv_sync_ (the sampling warpers, the verdict and the commit) and accept_stats_ (what the verdict
accepted, per depth) are engine work, not model layers, so their dispatch lives beside the step that
calls them.
"""

from __future__ import annotations

from ..models.ops import use_triton
from ..spec.tree_ops import use_step_kernels


def block_meta(start, valid, page_table, n: int, page_size: int, offset: int = 0, *, backend="auto"):
    """(slot [B*n] int64, pos [B, n] int64, cu_q_lens [B+1] int32, kv_lens [B] int32) of a block of
    n new tokens per row at logical slots start + offset .. start + offset + n - 1 (padding rows: slot -1, T_b = 0)."""
    from kernels_triton import paging

    fn = paging.block_meta if use_step_kernels(backend, start) else paging.block_meta_ref
    return fn(start, valid, page_table, n, page_size, offset)


def tree_meta(start, valid, page_table, tokens, depth, page_size: int, *, backend="auto"):
    """(slot [B*n], pos [B, n], ids [B*n] int64, cu_q_lens [B+1], kv_lens [B] int32) of a verify block:
    tree node j of row b at logical slot start + j, RoPE position start + depth, input id its token
    (padding rows: slot -1, position 0, id 0, T_b = 0); kernels_triton/paging.py."""
    from kernels_triton import paging

    fn = paging.tree_meta if use_step_kernels(backend, start) else paging.tree_meta_ref
    return fn(start, valid, page_table, tokens, depth, page_size)


def warp_logits(logits, params, *, backend="auto"):
    """[B, T, V] logits -> fp32 warped logits under each row's (temperature, top_k, top_p, min_p)
    params [B, 4] (kernels_triton/sampling.py)."""
    from kernels_triton import sampling

    fn = sampling.warp_logits if use_triton(backend, logits) else sampling.warp_logits_ref
    return fn(logits, params)


def accept_stats_(parents, depth, accepted_nodes, accept_len, out, *, backend="auto"):
    """Each row's drafted depth, draft nodes and accepted sibling ranks into ``out`` [B, T + 1] int64,
    in place (kernels_triton/accept_stats.py)."""
    from kernels_triton import accept_stats

    fn = accept_stats.accept_stats_ if use_triton(backend, parents) else accept_stats.accept_stats_ref_
    return fn(parents, depth, accepted_nodes, accept_len, out)


def verify_accept(logits, tokens, parents, temperature, uniforms=None, draft_probs=None, *, backend="auto"):
    from kernels_triton import verify_accept as va

    fn = va.verify_accept if use_triton(backend, logits) else va.verify_accept_ref
    return fn(logits, tokens, parents, temperature, uniforms, draft_probs)


def kv_sync_(caches, page_table, seq_lens, accepted_nodes, accept_len, out_tokens, valid=None, into=None, *,
             backend="auto"):
    from kernels_triton import kv_sync

    fn = kv_sync.kv_sync_ if use_triton(backend, seq_lens) else kv_sync.kv_sync_ref_
    return fn(caches, page_table, seq_lens, accepted_nodes, accept_len, out_tokens, valid, into)
