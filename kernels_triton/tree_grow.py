"""Growing and selecting EAGLE-2 draft trees on the device: one launch per draft round, one for the tree.

The growth of ``specdec/spec/tree.py`` as torch ops costs ~20 small kernels per draft round (child
scores, the vocabulary map, top-k, gathers, the concatenation of the next round's draft rows) and
~25 for the final selection; in a graphed batch-1 step of a 16-node tree those ~140 launches took
about an eighth of the step. Here each is one launch: programs
per request (tree_select: grid (B,); tree_expand: grid (B, hidden chunks), the next rows' hidden
copied in parallel chunks).

``tree_expand`` -- one round. Inputs: the frontier (F nodes: cumulative log-prob ``score`` [B, F],
candidate id ``fcid`` [B, F]) and the best K children of each frontier node (log-probs ``lp``
[B, F, K], draft-vocabulary ids ``cid`` [B, F, K]). With ``first`` the frontier is the root alone
(F = 1, score 0, no candidate id). Child j = p * K + c (frontier node p, child c):

    score[j]  = score[p] + lp[p, c]                (fp32)
    token[j]  = d2t[cid[p, c]]                     (target id; identity without a table)
    candidates cand_off + j  <- (token, score, parent = fcid[p] or -1 if first, depth)
    next frontier = the K best children by score, descending, ties to the lower j (``first``:
                    the K children in their given order, which is already descending)

and, when the draft runs another round (``rows`` = (frontier masks [B, F] int64 or None when
``first``, n_done = scratch rows so far)), that round's K input rows, one per new frontier node i
(scratch row n_done + i):

    token     target id (0 for rows that are not ``valid``: padding rows of a graph bucket)
    position  seq_lens + depth - 1                 (a node of depth d sits d - 1 past the root)
    mask      mask[parent] | 1 << (n_done + i)     (ancestor bits over scratch rows; first: own bit)
    hidden    the parent's draft output hidden     (first: the root hidden)

The draft runs only these K rows: earlier scratch rows already hold their KV, and the attention's
tree window (the n_done + K scratch slots) lets the mask reach them.

``tree_select`` -- keep the n best candidates by ``score - TIE * depth`` (TIE makes a child rank
strictly below its parent, so the kept set is closed under ancestors; ties to the lower candidate
id) in candidate order (topological), and emit the tree: node 0 = root, node i = the i-th kept
candidate; parents as node indices (-1 for the root), depths, and ancestor-or-self bitmasks (bit 0,
the root, in every mask).

Invariants: K <= 64, F * K <= 4096 children per round, C <= 4096 candidates, n + 1 <= 64 nodes and
scratch rows n_done + K <= 64 (bitmasks are int64); candidates are written in round order, so a parent's id is
below its child's.
"""

import torch
import triton
import triton.language as tl

from .topk import ranked_index, ranked_key

MAX_NODES = 64
MAX_CANDIDATES = 4096
EXPAND_BLOCK_H = 256  # hidden values per program and row of tree_expand's copy (grid (B, H / 256))
TIE = 1e-6  # depth penalty: a child's selection key is strictly below its parent's


def _bit(i: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_left_shift(torch.ones_like(i, dtype=torch.int64), i.to(torch.int64))


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------


def new_candidates(B: int, C: int, device):
    """Candidate buffers the rounds fill (every slot: K + (steps - 1) K^2 of them, so no fill launch):
    (tokens int64, scores fp32, parents int32, depths int32) [B, C]."""
    return (torch.empty(B, C, dtype=torch.int64, device=device), torch.empty(B, C, dtype=torch.float32, device=device),
            torch.empty(B, C, dtype=torch.int32, device=device), torch.empty(B, C, dtype=torch.int32, device=device))


def tree_expand_ref(cand, cand_off, depth, lp, cid, d2t, score=None, fcid=None, rows=None, h_front=None,
                    valid=None, seq=None):
    """Plain torch, same contract as :func:`tree_expand` (``score``/``fcid`` None: the first round)."""
    ctok, cscore, cpar, cdep = cand
    B, F, K = lp.shape
    first = score is None
    child_score = lp.float() + (0.0 if first else score.float()[:, :, None])  # [B, F, K]
    tok = cid.long() if d2t is None else d2t[cid.long()]
    par = (torch.full((B, F), -1, device=lp.device, dtype=torch.int64) if first else fcid.long())
    sl = slice(cand_off, cand_off + F * K)
    ctok[:, sl] = tok.reshape(B, F * K)
    cscore[:, sl] = child_score.reshape(B, F * K)
    cpar[:, sl] = par[:, :, None].expand(B, F, K).reshape(B, F * K).to(cpar.dtype)
    cdep[:, sl] = depth
    flat = child_score.reshape(B, F * K)
    if first:
        best = torch.arange(K, device=lp.device).expand(B, K)
        nscore = flat[:, :K]
    else:
        nscore, best = torch.topk(flat, K, dim=1)
    ncid = cand_off + best
    if rows is None:
        return nscore.contiguous(), ncid.contiguous(), None
    front_mask, n = rows
    ntok = tok.reshape(B, F * K).gather(1, best)
    pslot = best // K  # [B, K] frontier slot of each new node's parent
    bits = _bit(torch.arange(n, n + K, device=lp.device))[None, :]
    pmask = torch.zeros_like(pslot) if first else front_mask.gather(1, pslot)
    hid = h_front.gather(1, pslot[:, :, None].expand(B, K, h_front.shape[-1]))
    new_rows = (torch.where(valid[:, None], ntok, 0), (seq.long() + depth - 1)[:, None].expand(B, K).contiguous(),
                pmask | bits, hid.contiguous())
    return nscore.contiguous(), ncid.contiguous(), new_rows


def tree_select_ref(root, cand, n: int, max_depth: int, cand_ids: bool = False):
    """Plain torch: (tokens int64, parents int32, depth int32, mask int64), each [B, n + 1]; with
    ``cand_ids`` also each node's candidate id (int32 [B, n + 1], -1 at the root)."""
    from .tree_mask import ancestor_masks_ref

    ctok, cscore, cpar, cdep = cand
    B, C = ctok.shape
    dev = root.device
    key = cscore.float() - TIE * cdep.float()
    keep = torch.topk(key, n, dim=1).indices.sort(dim=1).values  # [B, n] candidate ids, topological
    node_of = torch.full((B, C), -1, dtype=torch.long, device=dev)
    node_of.scatter_(1, keep, torch.arange(1, n + 1, device=dev).expand(B, n))
    p = cpar.long().gather(1, keep)
    par = torch.where(p >= 0, node_of.gather(1, p.clamp(min=0)), torch.zeros_like(p))
    tokens = torch.cat([root[:, None].long(), ctok.gather(1, keep)], 1)
    parents = torch.cat([torch.full((B, 1), -1, device=dev, dtype=torch.long), par], 1).int()
    depth = torch.cat([torch.zeros(B, 1, dtype=torch.int32, device=dev), cdep.gather(1, keep).int()], 1)
    out = (tokens, parents, depth, ancestor_masks_ref(parents, max_depth))
    if cand_ids:
        out += (torch.cat([torch.full((B, 1), -1, dtype=torch.int32, device=dev), keep.int()], 1),)
    return out


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["cand_off", "depth", "n_done", "C", "H"])
def _tree_expand_kernel(
    score_ptr,  # [B, F] fp32 frontier scores (not FIRST)
    fcid_ptr,  # [B, F] int64 frontier candidate ids (not FIRST)
    lp_ptr,  # [B, F * K] fp32 child log-probs (row stride stride_lp)
    cid_ptr,  # [B, F * K] int64 child draft ids (row stride stride_cid)
    d2t_ptr,  # [Vd] int64 draft -> target id (HAS_D2T)
    valid_ptr,  # [B] bool (ROWS)
    seq_ptr,  # [B] int32 (ROWS)
    ctok_ptr,  # [B, C] int64 candidates
    cscore_ptr,  # [B, C] fp32
    cpar_ptr,  # [B, C] int32
    cdep_ptr,  # [B, C] int32
    nscore_ptr,  # [B, K] fp32 next frontier
    ncid_ptr,  # [B, K] int64
    fmask_ptr,  # [B, F] int64 frontier masks (ROWS and not FIRST)
    ntok_ptr,  # [B, K] next rows (ROWS)
    npos_ptr,
    nmask_ptr,
    nhid_ptr,  # [B, K, H]
    hf_ptr,  # frontier output hidden, [B, F, H] with strides (stride_hfb, stride_hff, 1)
    cand_off,
    depth,
    n_done,
    C,
    H,
    stride_lp,
    stride_cid,
    stride_hfb,
    stride_hff,
    F: tl.constexpr,
    K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FIRST: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_D2T: tl.constexpr,
):
    # Grid (B, hidden chunks): every program ranks the children (a few dozen values, in registers);
    # program (b, 0) writes the candidates, the next frontier and its rows' tokens, positions and masks,
    # and program (b, j) copies chunk j of the new rows' hidden (one load and store each: the copy
    # of K x H values in one program's loop was most of the launch, ~12 us at H = 4096).
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    o_j = tl.arange(0, BLOCK_J)
    m_j = o_j < F * K
    o_p = o_j // K  # frontier slot of each child
    b_lp = tl.load(lp_ptr + b * stride_lp + o_j, mask=m_j, other=float("-inf"))
    if FIRST:
        b_sc = b_lp
    else:
        b_sc = tl.load(score_ptr + b * F + o_p, mask=m_j, other=0.0) + b_lp

    # The next frontier: the K best children (lowest index on ties; NaN ranks last) from one sort in
    # registers; everything they need is then gathered in parallel.
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    if FIRST:
        b_sel = o_k
    else:
        b_key = tl.where(m_j & (b_sc == b_sc), b_sc, float("-inf"))
        b_sorted = tl.sort(ranked_key(b_key, o_j), descending=True)  # [BLOCK_J], best child first
        # the first K entries, as a [BLOCK_K] vector
        b_first = tl.sum(tl.where(o_j[None, :] == o_k[:, None], b_sorted[None, :], 0), axis=1)
        b_sel = tl.minimum(ranked_index(b_first), F * K - 1)
    b_pslot = b_sel // K  # frontier slot of each new node's parent
    p_n = b * K + o_k  # [BLOCK_K] the new rows

    if hb == 0:
        if FIRST:
            b_par = tl.full([BLOCK_J], -1, tl.int32)
        else:
            b_par = tl.load(fcid_ptr + b * F + o_p, mask=m_j, other=-1).to(tl.int32)
        b_cid = tl.load(cid_ptr + b * stride_cid + o_j, mask=m_j, other=0)
        if HAS_D2T:
            b_tok = tl.load(d2t_ptr + b_cid, mask=m_j, other=0)
        else:
            b_tok = b_cid
        b_tok = b_tok.to(tl.int64)
        p_c = b * C + cand_off + o_j
        tl.store(ctok_ptr + p_c, b_tok, mask=m_j)
        tl.store(cscore_ptr + p_c, b_sc, mask=m_j)
        tl.store(cpar_ptr + p_c, b_par, mask=m_j)
        tl.store(cdep_ptr + p_c, tl.full([BLOCK_J], 0, tl.int32) + depth, mask=m_j)
        tl.debug_barrier()  # the candidates stored above are read back by other threads
        p_s = b * C + cand_off + b_sel
        tl.store(nscore_ptr + b * K + o_k, tl.load(cscore_ptr + p_s, mask=m_k), mask=m_k)
        tl.store(ncid_ptr + b * K + o_k, (cand_off + b_sel).to(tl.int64), mask=m_k)
        if ROWS:
            b_valid = tl.load(valid_ptr + b) != 0
            b_pos = tl.load(seq_ptr + b).to(tl.int64) + depth - 1
            b_ntok = tl.load(ctok_ptr + p_s, mask=m_k, other=0)
            tl.store(ntok_ptr + p_n, tl.where(b_valid, b_ntok, 0), mask=m_k)
            tl.store(npos_ptr + p_n, tl.zeros([BLOCK_K], dtype=tl.int64) + b_pos, mask=m_k)
            b_bit = tl.full([BLOCK_K], 1, tl.int64) << (n_done + o_k).to(tl.int64)
            if FIRST:
                b_pmask = tl.zeros([BLOCK_K], dtype=tl.int64)
            else:
                b_pmask = tl.load(fmask_ptr + b * F + b_pslot, mask=m_k, other=0)
            tl.store(nmask_ptr + p_n, b_pmask | b_bit, mask=m_k)
    if ROWS:
        o_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m_kh = m_k[:, None] & (o_h < H)[None, :]
        b_h = tl.load(hf_ptr + b * stride_hfb + b_pslot[:, None] * stride_hff + o_h[None, :], mask=m_kh)
        tl.store(nhid_ptr + p_n[:, None] * H + o_h[None, :], b_h.to(nhid_ptr.dtype.element_ty), mask=m_kh)


@triton.jit(do_not_specialize=["C", "n", "max_depth"])
def _tree_select_kernel(
    root_ptr,  # [B] int64 root tokens
    ctok_ptr,  # [B, C] int64
    cscore_ptr,  # [B, C] fp32
    cpar_ptr,  # [B, C] int32
    cdep_ptr,  # [B, C] int32
    node_ptr,  # [B, C] int32 scratch: node index of each candidate (0 = not kept)
    tok_ptr,  # [B, n + 1] int64 out
    par_ptr,  # [B, n + 1] int32 out
    dep_ptr,  # [B, n + 1] int32 out
    mask_ptr,  # [B, n + 1] int64 out
    cid_ptr,  # [B, n + 1] int32 out: each node's candidate id, -1 at the root (CAND_IDS)
    C,
    n,
    max_depth,
    tie,
    BLOCK_C: tl.constexpr,
    CAND_IDS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < C
    b_sc = tl.load(cscore_ptr + b * C + o_c, mask=m_c, other=0.0)
    b_dep = tl.load(cdep_ptr + b * C + o_c, mask=m_c, other=0)
    b_key = b_sc - b_dep.to(tl.float32) * tie
    b_key = tl.where(m_c & (b_key == b_key), b_key, float("-inf"))
    # Kept: the n largest (key, -id) pairs, i.e. those at or above the n-th of one descending sort.
    b_packed = ranked_key(b_key, o_c)
    b_sorted = tl.sort(b_packed, descending=True)
    thr = tl.max(tl.where(o_c == n - 1, b_sorted, -9223372036854775807), axis=0)
    b_kept = m_c & (b_packed >= thr)
    b_k = b_kept.to(tl.int32)
    b_node = tl.where(b_kept, tl.cumsum(b_k, axis=0), 0)  # 1-based node index of each kept candidate
    tl.store(node_ptr + b * C + o_c, b_node, mask=m_c)
    tl.debug_barrier()  # node indices visible to the whole program before the gathers below

    b_cpar = tl.load(cpar_ptr + b * C + o_c, mask=m_c, other=-1)
    has_par = b_kept & (b_cpar >= 0)
    b_pnode = tl.load(node_ptr + b * C + tl.maximum(b_cpar, 0), mask=has_par, other=0)
    b_mask = (tl.full([BLOCK_C], 1, tl.int64) << b_node.to(tl.int64)) | 1  # self and the root
    b_anc = tl.where(has_par, b_cpar, -1)
    for _ in range(max_depth):  # walk up the candidate ancestors (all kept: the set is closed)
        v = b_anc >= 0
        a = tl.maximum(b_anc, 0)
        b_an = tl.load(node_ptr + b * C + a, mask=v, other=0)
        b_mask = b_mask | tl.where(v, tl.full([BLOCK_C], 1, tl.int64) << b_an.to(tl.int64), 0)
        b_anc = tl.where(v, tl.load(cpar_ptr + b * C + a, mask=v, other=-1), -1)

    n1 = n + 1
    b_tok = tl.load(ctok_ptr + b * C + o_c, mask=m_c, other=0)
    p_out = b * n1 + b_node
    tl.store(tok_ptr + p_out, b_tok, mask=b_kept)
    tl.store(par_ptr + p_out, b_pnode, mask=b_kept)
    tl.store(dep_ptr + p_out, b_dep, mask=b_kept)
    tl.store(mask_ptr + p_out, b_mask, mask=b_kept)
    if CAND_IDS:
        tl.store(cid_ptr + p_out, o_c, mask=b_kept)
        tl.store(cid_ptr + b * n1, -1)
    tl.store(tok_ptr + b * n1, tl.load(root_ptr + b).to(tl.int64))
    tl.store(par_ptr + b * n1, -1)
    tl.store(dep_ptr + b * n1, 0)
    tl.store(mask_ptr + b * n1, tl.full([], 1, tl.int64))


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def tree_expand(cand, cand_off: int, depth: int, lp, cid, d2t, score=None, fcid=None, rows=None, h_front=None,
                valid=None, seq=None):
    """One growth round (see the module docstring); writes ``cand`` in place.

    lp, cid: [B, F, K] (the first round: F = 1, ``score``/``fcid`` None); d2t: [Vd] int64 or None;
    score [B, F] fp32, fcid [B, F] int64; ``rows`` = (frontier masks [B, F] int64 (None in the first
    round), n_done scratch rows so far) or None when no round follows -- with rows, ``h_front``
    [B, F, H] (any strides, last dim contiguous), ``valid`` [B] bool and ``seq`` [B] int32 are needed.
    Returns (next frontier scores [B, K] fp32, candidate ids [B, K] int64, next rows or None), the
    rows as (tokens, positions, masks [B, K] int64, hidden [B, K, H])).
    """
    ctok, cscore, cpar, cdep = cand
    B, F, K = lp.shape
    C = ctok.shape[1]
    first = score is None
    if cid.shape != lp.shape or (first and F != 1) or cand_off + F * K > C or C > MAX_CANDIDATES:
        raise ValueError(f"tree_expand: lp/cid [B, F, K] = {tuple(lp.shape)}/{tuple(cid.shape)}, "
                         f"candidates {cand_off} + {F * K} of {C} (<= {MAX_CANDIDATES}), first={first}")
    if not first and (score.shape != (B, F) or fcid.shape != (B, F)):
        raise ValueError(f"tree_expand: score/fcid must be [B, F] = [{B}, {F}]")
    dev = lp.device
    nscore = torch.empty(B, K, dtype=torch.float32, device=dev)
    ncid = torch.empty(B, K, dtype=torch.int64, device=dev)
    lp2 = lp.reshape(B, F * K).float()
    cid2 = cid.reshape(B, F * K)
    if lp2.stride(1) != 1:
        lp2 = lp2.contiguous()
    if cid2.stride(1) != 1:
        cid2 = cid2.contiguous()
    new_rows = None
    H = 1
    if rows is not None:
        front_mask, n_done = rows
        H = h_front.shape[-1]
        if n_done + K > MAX_NODES or h_front.shape != (B, F, H) or h_front.stride(-1) != 1:
            raise ValueError(f"tree_expand: {n_done} + {K} scratch rows (<= {MAX_NODES}), frontier hidden "
                             f"{tuple(h_front.shape)} must be [B, F, H] = [{B}, {F}, {H}] with a contiguous last dim")
        if not first and (front_mask is None or front_mask.shape != (B, F) or front_mask.dtype != torch.int64):
            raise ValueError(f"tree_expand: frontier masks must be [B, F] = [{B}, {F}] int64")
        if valid.dtype != torch.bool or valid.shape != (B,):
            raise ValueError(f"tree_expand: valid must be [B] = [{B}] bool, got {tuple(valid.shape)} {valid.dtype}")
        new_rows = (torch.empty(B, K, dtype=torch.int64, device=dev),
                    torch.empty(B, K, dtype=torch.int64, device=dev),
                    torch.empty(B, K, dtype=torch.int64, device=dev),
                    torch.empty(B, K, H, dtype=h_front.dtype, device=dev))
        fmask = front_mask.contiguous() if not first else lp2
    if B == 0:
        return nscore, ncid, new_rows
    ph = lp2  # placeholder pointer for unused arguments
    block_h = min(EXPAND_BLOCK_H, max(16, triton.next_power_of_2(H)))
    _tree_expand_kernel[(B, triton.cdiv(H, block_h) if rows is not None else 1)](
        score if not first else ph, fcid if not first else ph, lp2, cid2, d2t if d2t is not None else ph,
        valid if rows is not None else ph, seq if rows is not None else ph,
        ctok, cscore, cpar, cdep, nscore, ncid,
        fmask if rows is not None else ph,
        *(new_rows if new_rows is not None else (ph,) * 4),
        h_front if rows is not None else ph,
        cand_off, depth, rows[1] if rows is not None else 0, C, H,
        lp2.stride(0), cid2.stride(0),
        h_front.stride(0) if rows is not None else 0, h_front.stride(1) if rows is not None else 0,
        F=F, K=K, BLOCK_J=max(16, triton.next_power_of_2(F * K)), BLOCK_K=max(16, triton.next_power_of_2(K)),
        BLOCK_H=block_h, FIRST=first, ROWS=rows is not None,
        HAS_D2T=d2t is not None, num_warps=4,
    )  # fmt: skip
    return nscore, ncid, new_rows


def tree_select(root, cand, n: int, max_depth: int, cand_ids: bool = False):
    """The tree of the n best candidates: (tokens int64, parents int32, depth int32, mask int64) [B, n + 1];
    with ``cand_ids`` also each node's candidate id (int32 [B, n + 1], -1 at the root: what the
    counterfactual acceptance of smaller trees reads, kernels_triton/counterfactual.py)."""
    ctok, cscore, cpar, cdep = cand
    B, C = ctok.shape
    if not 1 <= n <= C or n + 1 > MAX_NODES or C > MAX_CANDIDATES:
        raise ValueError(f"tree_select: keep 1 <= n <= C={C} (<= {MAX_CANDIDATES}) candidates, n + 1 <= "
                         f"{MAX_NODES} nodes; got n={n}")
    dev = ctok.device
    tok = torch.empty(B, n + 1, dtype=torch.int64, device=dev)
    par = torch.empty(B, n + 1, dtype=torch.int32, device=dev)
    dep = torch.empty(B, n + 1, dtype=torch.int32, device=dev)
    mask = torch.empty(B, n + 1, dtype=torch.int64, device=dev)
    cid = torch.empty(B, n + 1, dtype=torch.int32, device=dev) if cand_ids else None
    if B:
        block_c = max(16, triton.next_power_of_2(C))
        node = torch.empty(B, C, dtype=torch.int32, device=dev)
        _tree_select_kernel[(B,)](root.contiguous(), ctok, cscore, cpar, cdep, node, tok, par, dep, mask,
                                  cid if cand_ids else par, C, n, int(max_depth), TIE, BLOCK_C=block_c,
                                  CAND_IDS=bool(cand_ids), num_warps=4)
    return (tok, par, dep, mask, cid) if cand_ids else (tok, par, dep, mask)
