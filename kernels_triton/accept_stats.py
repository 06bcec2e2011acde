"""Acceptance statistics of a verified tree step, per row: how deep it drafted, which sibling it took.

Read back with the committed tokens (one copy per step, no extra sync), they give acceptance per
draft depth and the accepted rank among siblings (specdec.bench.metrics).

Shapes (named dims): B rows, T tree nodes (T >= 2: a speculative step)
    parents         [B, T] int32 / int64; parents[:, 0] = -1; a node i > 0 with parent < 0 is padding
    depth           [B, T] int32 / int64; depth[:, 0] = 0
    accepted_nodes  [B, T] int32 (verify_accept's): path node indices [0, n_1, n_2, ...] then -1
    accept_len      [B] int32, accepted draft nodes
    out             [B, T + 1] int64, written in place (any row stride; last dim contiguous):
        out[b, 0]     drafted depth: the largest depth of a real (non-padding) node, 0 if none
        out[b, 1]     real draft nodes (the tree is a chain iff this equals the drafted depth)
        out[b, 1 + d] rank of the accepted node n_d among its siblings, d = 1 .. accept_len[b]: the
                      real nodes before it (lower index) with the same parent, i.e. the siblings
                      verification tried and rejected before accepting it; -1 for d > accept_len[b]

Kernel layout: grid (B,); one program per row holds its parents and depths as [BLOCK_T] vectors
and walks the accepted path (at most T - 1 nodes), one reduction per accepted node. No host reads
of tensor values (CUDA-graph capturable).
"""

import torch
import triton
import triton.language as tl

_INT_DTYPES = (torch.int32, torch.int64)


def accept_stats_ref_(parents, depth, accepted_nodes, accept_len, out):
    """Plain-torch statistics into ``out`` (mutated in place; see the module docstring)."""
    B, T = parents.shape
    par = parents.long()
    o_t = torch.arange(T, device=par.device)
    real = (par >= 0) & (o_t > 0)  # [B, T]
    drafted = torch.where(real, depth.long(), 0).amax(-1)  # [B]
    # rank[b, i] = real j < i with parents[b, j] == parents[b, i]
    same = (par[:, :, None] == par[:, None, :]) & (o_t[None, :] < o_t[:, None])[None] & real[:, None, :]
    rank = same.sum(-1)  # [B, T]
    path = accepted_nodes.long().clamp(min=0)  # [B, T]
    on_path = (o_t >= 1) & (o_t <= accept_len.long()[:, None])
    out[:, 0] = drafted
    out[:, 1] = real.sum(-1)
    out[:, 2:] = torch.where(on_path, rank.gather(1, path), -1)[:, 1:]
    return out


@triton.jit
def _accept_stats_kernel(
    parents,  # [B, T] int32/int64, contiguous
    depth,  # [B, T] int32/int64, contiguous
    accepted_nodes,  # [B, T] int32, contiguous
    accept_len,  # [B] int32
    out,  # [B, T + 1] int64, row stride stride_ob
    T,
    stride_ob,
    BLOCK_T: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_t = tl.arange(0, BLOCK_T)
    m_t = o_t < T
    b_par = tl.load(parents + i_b * T + o_t, mask=m_t, other=-1).to(tl.int32)  # [BLOCK_T]
    b_dep = tl.load(depth + i_b * T + o_t, mask=m_t, other=0).to(tl.int32)  # [BLOCK_T]
    m_real = m_t & (o_t > 0) & (b_par >= 0)
    p_out = out + i_b * stride_ob
    tl.store(p_out, tl.max(tl.where(m_real, b_dep, 0), 0).to(tl.int64))
    tl.store(p_out + 1, tl.sum(m_real.to(tl.int32), 0).to(tl.int64))
    n_acc = tl.load(accept_len + i_b)
    tl.store(p_out + 1 + o_t, tl.full([BLOCK_T], -1, tl.int64), mask=m_t & (o_t > n_acc))
    for d in range(1, n_acc + 1):
        node = tl.load(accepted_nodes + i_b * T + d)
        par = tl.sum(tl.where(o_t == node, b_par, 0), 0)
        rank = tl.sum((m_real & (b_par == par) & (o_t < node)).to(tl.int32), 0)
        tl.store(p_out + 1 + d, rank.to(tl.int64))


def accept_stats_(parents, depth, accepted_nodes, accept_len, out):
    """Write each row's drafted depth, draft nodes and accepted sibling ranks into ``out`` [B, T + 1]
    int64 (in place; see the module docstring). One launch; returns ``out``."""
    if parents.dim() != 2 or parents.dtype not in _INT_DTYPES:
        raise ValueError(f"accept_stats_: parents must be [B, T] int32/int64, got {tuple(parents.shape)} {parents.dtype}")
    B, T = parents.shape
    for name, t in (("depth", depth), ("accepted_nodes", accepted_nodes)):
        if t.shape != (B, T) or t.dtype not in _INT_DTYPES:
            raise ValueError(f"accept_stats_: {name} must be [B, T] = [{B}, {T}] int32/int64, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if accept_len.shape != (B,) or accept_len.dtype not in _INT_DTYPES:
        raise ValueError(f"accept_stats_: accept_len must be [B] = [{B}] int32/int64, got "
                         f"{tuple(accept_len.shape)} {accept_len.dtype}")
    if out.shape != (B, T + 1) or out.dtype != torch.int64 or (B and out.stride(-1) != 1):
        raise ValueError(f"accept_stats_: out must be [B, T + 1] = [{B}, {T + 1}] int64 with a contiguous last dim, got "
                         f"{tuple(out.shape)} {out.dtype}")
    for name, t in (("depth", depth), ("accepted_nodes", accepted_nodes), ("accept_len", accept_len), ("out", out)):
        if t.device != parents.device:
            raise ValueError(f"accept_stats_: {name} is on {t.device}, parents on {parents.device}")
    if B == 0:
        return out
    _accept_stats_kernel[(B,)](parents.contiguous(), depth.contiguous(), accepted_nodes.contiguous(),
                               accept_len.contiguous(), out, T, out.stride(0),
                               BLOCK_T=triton.next_power_of_2(T), num_warps=1)
    return out
