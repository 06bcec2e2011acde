"""Counterfactual acceptance: what each smaller configured tree would have committed, read off the
verified path of a larger one (one launch per step, one program per request).

A step drafts an EAGLE-2 tree of growth (K, S, N) (topk K, S rounds, the N best candidates kept;
kernels_triton/tree_grow.py) and verifies it; for every smaller configured shape (K', S', N') this
kernel marks the nodes of the large tree that the small growth would hold, and counts how many
nodes of the accepted path lie in that set: the small tree's accepted length (plus one: the
committed tokens, bonus included).

Membership, by simulating the small growth over the large tree's kept nodes. Per node i (root 0):
its candidate id c(i) (``tree_select(..., cand_ids=True)``), its depth d(i), its selection key
key(i) = score - TIE * depth (tree_select's), its parent, and its sibling rank
    sib(i) = c(i)            if c(i) < K      (a child of the root: the first round's order)
             (c(i) - K) % K  otherwise       (child c of frontier slot p sits at K + r K^2 + p K + c)
i.e. its rank among its parent's children by draft log-prob (each expansion keeps the best K in
descending order). Then, with F_0 = {root}:
    candidates at depth d   D_d = {i : d(i) = d <= S', sib(i) < K', parent(i) in F_{d-1}}
    frontier at depth d     F_d = the K' best of D_d by key (ties to the lower node index)
    small tree              the N' best of D_1 u ... u D_S' by key
and the counterfactual commit of a row is 1 + #(accepted path nodes 1..accept_len in the small
tree). A child's key is strictly below its parent's, so every set above is closed under ancestors
and the path's members are a prefix of it.

When it is exact. The small tree and the frontier nodes its growth expanded (F_1 .. F_{S'-1}) all
lie in the large tree => the simulated sets are the small growth's own (by induction over d: D_d
is the small growth's D_d less the nodes the large tree lacks, and F_d its K' best, the true F_d
when that is in the large tree; the small tree is the N' best of what remains), so the marked set
is the small tree exactly (same scores and keys; exact key ties between nodes the two growths
order differently aside); then its accepted path is the large tree's truncated at the first non-member:
siblings carry distinct tokens (one expansion's top K), so greedy verification accepts at a node
the one child carrying the target's token, which the small tree holds iff the large tree's
accepted child is a member; at temperature > 0 a node's children in the small tree are a prefix
(by sibling rank = node order) of its children in the large tree, so with the same coins the
multi-draft walk tries the same children in the same order with the same residuals (exact in
distribution: the coins are i.i.d.). Cases:
  same growth (K', S') = (K, S), N' < N   exact: the N'-tree is the N' best nodes of the N-tree
                                          (the large tree holds every candidate the small one
                                          ranks above its N'-th; the simulation gives D = all
                                          nodes, F_d the true frontier's kept part)
  a chain (K' = 1)                        the membership is exact (top-1 child at each depth,
                                          depth <= min(S', N')); the count is a lower bound: the
                                          chain's continuation past the last accepted node may be
                                          missing from the large tree (it is only when that node
                                          is a leaf of the large tree above the chain's depth)
  other growths (K' != K or S' != S)      approximate: exact when the small tree and its growth's
                                          expanded frontier are in the large tree; otherwise
                                          nodes the large growth dropped are missing from the
                                          ranks, which can admit nodes the small tree would not
                                          hold (or lose its continuation, as for a chain)
                                          (specdec.spec.eagle3.counterfactual_label)
Invariants: T <= 64 nodes per tree (tree_select's bound), shapes [M, 3] int32 on the device.
"""

import torch
import triton
import triton.language as tl

from .tree_grow import TIE


def counterfactual_commits_ref(cand, cids, parents, nodes, accept_len, shapes, K: int, out=None):
    """Plain torch, same contract as :func:`counterfactual_commits`."""
    cscore, cdep = cand[1], cand[3]
    B, T = cids.shape
    dev = cids.device
    is_node = cids >= 0  # [B, T], False at the root
    cc = cids.long().clamp(min=0)
    dep = torch.where(is_node, cdep.gather(1, cc).long(), 0)
    key = cscore.gather(1, cc).float() - dep.float() * TIE
    sib = torch.where(cids < K, cids.long(), (cids.long() - K) % K)
    o = torch.arange(T, device=dev)
    # beats[b, i, j]: node j ranks above node i (higher key, ties to the lower index)
    beats = (key[:, None, :] > key[:, :, None]) | ((key[:, None, :] == key[:, :, None]) & (o[None, :] < o[:, None]))
    is_parent = parents.long()[:, :, None] == o[None, None, :]  # [b, i, j]: j is i's parent
    pos = (o[None, :] >= 1) & (o[None, :] <= accept_len.long()[:, None])  # [B, T] path positions 1..accept_len
    on_path = ((nodes.long()[:, :, None] == o[None, None, :]) & pos[:, :, None]).any(1)  # [B, T] per node
    cols = []
    for kk, ss, nn in (shapes.tolist() if torch.is_tensor(shapes) else shapes):  # a host read: references sync
        front = (o == 0)[None, :].expand(B, T)
        cnd = torch.zeros(B, T, dtype=torch.bool, device=dev)
        for d in range(1, int(ss) + 1):
            pf = (is_parent & front[:, None, :]).any(2)
            cd = is_node & (dep == d) & (sib < kk) & pf
            rank = (beats & cd[:, None, :]).sum(2)
            front = front | (cd & (rank < kk))
            cnd = cnd | cd
        member = cnd & ((beats & cnd[:, None, :]).sum(2) < nn)
        cols.append((on_path & member).sum(1) + 1)
    res = torch.stack(cols, 1) if cols else torch.zeros(B, 0, dtype=torch.int64, device=dev)
    if out is not None:
        out.copy_(res.to(out.dtype))
        return out
    return res.to(torch.int32)


@triton.jit(do_not_specialize=["C", "T"])
def _counterfactual_kernel(
    cscore_ptr,  # [B, C] fp32 candidate scores
    cdep_ptr,  # [B, C] int32 candidate depths
    cid_ptr,  # [B, T] int32 node -> candidate id (-1 at the root)
    par_ptr,  # [B, T] int32 node parents
    nodes_ptr,  # [B, T] int32 accepted path (node indices, then -1)
    acc_ptr,  # [B] int32 accepted draft nodes
    shp_ptr,  # [M, 3] int32 small shapes (topk, steps, num_draft_tokens)
    out_ptr,  # [B, M] out (row stride stride_out)
    C,
    T,
    stride_out,
    tie,
    K: tl.constexpr,
    M: tl.constexpr,
    SMAX: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    o_i = tl.arange(0, BLOCK_T)
    m_i = o_i < T
    cid = tl.load(cid_ptr + b * T + o_i, mask=m_i, other=-1)
    is_node = m_i & (cid >= 0)
    cc = tl.maximum(cid, 0)
    sc = tl.load(cscore_ptr + b * C + cc, mask=is_node, other=0.0)
    dep = tl.load(cdep_ptr + b * C + cc, mask=is_node, other=0)
    key = sc - dep.to(tl.float32) * tie
    sib = tl.where(cid < K, cid, (cid - K) % K)
    par = tl.load(par_ptr + b * T + o_i, mask=m_i, other=-1)
    # [i, j] matrices over the nodes: j ranks above i; j is i's parent
    beats = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (o_i[None, :] < o_i[:, None]))
    is_parent = par[:, None] == o_i[None, :]
    acc = tl.load(acc_ptr + b)
    nd = tl.load(nodes_ptr + b * T + o_i, mask=m_i, other=-1)
    pos = m_i & (o_i >= 1) & (o_i <= acc)
    on_path = tl.sum(tl.where((nd[:, None] == o_i[None, :]) & pos[:, None], 1, 0), axis=0) > 0  # per node j
    for m in tl.static_range(M):
        kk = tl.load(shp_ptr + 3 * m)
        ss = tl.load(shp_ptr + 3 * m + 1)
        nn = tl.load(shp_ptr + 3 * m + 2)
        front = o_i == 0
        cnd = o_i < 0
        for d in tl.static_range(1, SMAX + 1):
            pf = tl.sum(tl.where(is_parent & front[None, :], 1, 0), axis=1) > 0
            cd = is_node & (dep == d) & (sib < kk) & pf & (ss >= d)
            rank = tl.sum(tl.where(beats & cd[None, :], 1, 0), axis=1)
            front = front | (cd & (rank < kk))
            cnd = cnd | cd
        rank = tl.sum(tl.where(beats & cnd[None, :], 1, 0), axis=1)
        member = cnd & (rank < nn)
        cnt = tl.sum(tl.where(on_path & member, 1, 0), axis=0)
        tl.store(out_ptr + b * stride_out + m, (cnt + 1).to(out_ptr.dtype.element_ty))


def counterfactual_commits(cand, cids, parents, nodes, accept_len, shapes, K: int, out=None, max_steps: int = None):
    """Tokens each smaller tree would have committed per row (see the module docstring).

    cand: the large tree's candidate buffers (tokens, scores fp32, parents, depths int32) [B, C];
    cids [B, T] int32 (tree_select's cand_ids), parents [B, T], nodes [B, T] and accept_len [B]
    (verify_accept's); shapes [M, 3] int32 (topk, steps, num_draft_tokens) on the device; K the
    large growth's topk; ``max_steps`` a static bound on the shapes' steps (the kernel unrolls that
    many depths; default: read from ``shapes``, a host sync, so pass it when capturing a graph).
    Returns (or writes into ``out``, any int dtype, row stride free) [B, M] committed counts."""
    cscore, cdep = cand[1], cand[3]
    B, T = cids.shape
    M = shapes.shape[0]
    if T > 64 or cscore.shape[0] != B or parents.shape != (B, T) or nodes.shape != (B, T) or accept_len.shape != (B,):
        raise ValueError(f"counterfactual_commits: cids/parents/nodes [B, T] with T <= 64, accept_len [B], "
                         f"candidates [B, C]; got cids {tuple(cids.shape)}, parents {tuple(parents.shape)}, "
                         f"nodes {tuple(nodes.shape)}, accept_len {tuple(accept_len.shape)}, "
                         f"scores {tuple(cscore.shape)}")
    if shapes.dim() != 2 or shapes.shape[1] != 3 or shapes.dtype != torch.int32:
        raise ValueError(f"counterfactual_commits: shapes must be [M, 3] int32, got {tuple(shapes.shape)} {shapes.dtype}")
    if out is None:
        out = torch.empty(B, M, dtype=torch.int32, device=cids.device)
    elif out.shape != (B, M) or (M and out.stride(1) != 1):
        raise ValueError(f"counterfactual_commits: out must be [B, M] = [{B}, {M}] with contiguous rows")
    if B == 0 or M == 0:
        return out
    smax = int(shapes[:, 1].max()) if max_steps is None else int(max_steps)
    _counterfactual_kernel[(B,)](
        cscore.contiguous(), cdep.contiguous(), cids.contiguous(), parents.int().contiguous(),
        nodes.int().contiguous(), accept_len.int().contiguous(), shapes.contiguous(), out,
        cscore.shape[1], T, out.stride(0), TIE,
        K=int(K), M=M, SMAX=max(1, smax), BLOCK_T=max(16, triton.next_power_of_2(T)), num_warps=4,
    )  # fmt: skip
    return out
