"""Batch-invariant paged attention (exact mode): each query's output independent of the launch.

Same inputs, shapes and math as attention.py (prefill chunks, decode, tree verification over a paged
KV cache; see its module docstring), for kernel option ``exact`` (``engine.exact``): a query's output
must have the same bits whether it is a 1-token decode step, a node of a verified tree of any shape,
one row of a batch of any size, or a token of a prefill chunk of any length. attention.py cannot
promise that: its tile (BLOCK_M, MMA kind, loop shape) follows the query count, its split count
follows the batch and the SM count, and a tree node reads its ancestors at their scratch slots
(seq_len + node index), not where they sit once committed (seq_len + depth), so the same keys land
in other lanes and tiles.

The canonical order. Query i of a request at position p sees the logical keys 0 .. p (n = p + 1 of
them), logical key j being the token at position j: for j < L0 = kv_len - T (the cached prefix) the
slot j; for a causal query also its chunk's slots L0 .. p; for a tree node the ancestor at depth
j - L0, i.e. the (j - L0)-th set bit of its ancestor mask (nodes are topologically ordered, so
ancestors appear in depth order), at slot L0 + that node. Its position is p = L0 + depth (the RoPE
position the engine gives it; a causal chain's node i has depth i). Then, with BLOCK_N-key tiles
(tile t = logical keys t * BLOCK_N ..) and splits of SPLIT_TILES tiles (split s = tiles s * SPLIT_TILES ..),
both fixed per head shape:

    split s: online softmax over its tiles in order, from (m, l, acc) = (-inf, 0, 0):
        s_j = qk_scale * <q, k_j> (one tl.dot per tile, key j in lane j mod BLOCK_N), masked -inf past p
        m' = max(m, max_j s_j); l = l * 2^(m - m') + sum_j 2^(s_j - m'); acc = acc * 2^(m - m') + P @ V
    fold the splits 0, 1, .. in order:  M' = max(M, m_s); L = L 2^(M - M') + l_s 2^(m_s - M');
                                        A = A 2^(M - M') + acc_s 2^(m_s - M')
    out = dt(A / L)

Every term of that is a function of the query's position, its keys and the plan (G, D, dtype), so
the bits are too. A tile's fully masked rows (keys another query of the block needs) leave a row's
state exactly unchanged (factor 2^0 = 1, probabilities 2^-inf = 0), so queries can share programs.

Kernel layout: grid (query block, b * HKV + kv head, split program). A program holds BLOCK_T queries
x G heads as BLOCK_M = pow2 >= max(16, G) rows (one tile for decode, tree and prefill alike: the MMA
is the same instruction at every query count). Tiles wholly below a tree's prefix (and every tile of
a causal block) are read once for all the block's queries; the at most ceil(T / BLOCK_N) + 1 tiles
holding tree nodes are gathered per query (its own ancestors in their canonical lanes) and applied
to that query's rows only.
Splits either run as parallel programs (few programs, long prefixes: each writes its (m, l, acc) to
an fp32 workspace, a merge kernel folds them) or one after another in one program (folded in
registers). Both fold the same partials in the same order with the same helper, so the choice
(:func:`split_programs`, from static shapes) changes speed, never bits. Compiled without FMA
contraction (enable_fp_fusion=False), so a fold or a rescale rounds the same way in every kernel.

Invariants: as attention.py; tree masks over T <= 64 new tokens, bit i of node i set, a node's
ancestors the other set bits (positions L0 + depth); no tree_window (the draft's windowed rounds,
which need not be exact, take attention.py). No host sync (capturable).
"""

import math

import torch
import triton
import triton.language as tl

from . import attention
from .attention_launch import sm_count

MAX_TREE_TOKENS = attention.MAX_TREE_TOKENS
# the kernels read it as a compile-time constant (a plain global is refused by the GPU compiler, not the interpreter)
_MAX_TREE_TOKENS = tl.constexpr(MAX_TREE_TOKENS)
SPLIT_KEYS = 512  # keys per split in half precision (fp32: FP32_SPLIT_KEYS); a query of n keys folds ceil(n / 512)
FP32_SPLIT_KEYS = 128  # fp32 plans (CPU tests) split early, so short test contexts exercise the fold
PARALLEL_MAX_WORKSPACE = 64 << 20  # bytes of fp32 partials the parallel split programs may use


def paged_attention_exact_ref(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tree_mask=None, sm_scale=None):
    """The math in plain torch: attention.paged_attention_ref (this kernel changes only the summation order)."""
    return attention.paged_attention_ref(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tree_mask, sm_scale)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_update(b_q, b_k, b_v, m_vis, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr):
    """One tile of the online softmax (exp2 domain) for the rows of b_q; m_vis [BLOCK_M, BLOCK_N] the
    lanes each row sees. A row that sees none of the tile keeps its state bit for bit."""
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * qk_scale  # [BM, D] @ [D, BN] -> [BM, BN]
    b_s = tl.where(m_vis, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, 1))  # [BM]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: no inf - inf
    b_alpha = tl.exp2(m_i - m_safe)  # [BM]
    b_p = tl.exp2(b_s - m_safe[:, None])  # [BM, BN]
    l_i = l_i * b_alpha + tl.sum(b_p, 1)
    acc = acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)  # [BM, BN] @ [BN, D]
    return m_new, l_i, acc


@triton.jit
def _fold(M, L, A, m, l, a):
    """Fold one split's (m, l, a) into the running (M, L, A) (module docstring); the first fold
    (M = -inf, L = A = 0) returns (m, l, a) exactly."""
    M_new = tl.maximum(M, m)
    M_safe = tl.where(M_new == float("-inf"), 0.0, M_new)
    c_old = tl.exp2(M - M_safe)
    c_new = tl.exp2(m - M_safe)
    return M_new, L * c_old + l * c_new, A * c_old[:, None] + a * c_new[:, None]


@triton.jit
def _load_kv(k_cache, v_cache, p_pt, i_hkv, o_slot, m_j, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
             stride_vh, D: tl.constexpr, PS: tl.constexpr):
    """K and V [BLOCK_N, D] of logical slots o_slot (lanes m_j false read zeros)."""
    o_d = tl.arange(0, D)
    b_page = tl.load(p_pt + o_slot // PS, mask=m_j, other=0).to(tl.int64)  # [BN]
    o_off = o_slot % PS
    b_k = tl.load(k_cache + (b_page * stride_kp + o_off * stride_ks + i_hkv * stride_kh)[:, None] + o_d[None, :],
                  mask=m_j[:, None], other=0.0)  # [BN, D]
    b_v = tl.load(v_cache + (b_page * stride_vp + o_off * stride_vs + i_hkv * stride_vh)[:, None] + o_d[None, :],
                  mask=m_j[:, None], other=0.0)  # [BN, D]
    return b_k, b_v


@triton.jit(do_not_specialize=["n_prog"])
def _attention_exact_kernel(
    q,  # [N, HQ, D]
    k_cache,  # [P, PS, HKV, D]
    v_cache,  # [P, PS, HKV, D]
    page_table,  # [B, MP] int32
    cu_q_lens,  # [B + 1] int32
    kv_lens,  # [B] int32
    tree_mask,  # [N] int64 (IS_TREE)
    o,  # [N, HQ, D]
    part_acc,  # [N, HQ, n_prog, D] fp32 (PARALLEL)
    part_ml,  # [N, HQ, n_prog, 2] fp32 (PARALLEL): m, l
    busy,  # [N, HQ] int32 (PARALLEL): splits per row
    qk_scale,  # sm_scale * log2(e)
    n_prog,  # split programs of the grid (PARALLEL), else 1
    stride_qn, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb,
    stride_on, stride_oh,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr,
    PARALLEL: tl.constexpr, IS_TREE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_t, i_bh, i_sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b = i_bh // HKV
    i_hkv = i_bh % HKV
    bos = tl.load(cu_q_lens + i_b)
    T = tl.load(cu_q_lens + i_b + 1) - bos
    t0 = i_t * BLOCK_T
    if t0 >= T:  # query block past this request's T_b (incl. T_b = 0 padding)
        return
    kv_len = tl.load(kv_lens + i_b)
    L0 = kv_len - T  # cached prefix: logical keys below it are slots of the same index

    o_r = tl.arange(0, BLOCK_M)
    o_i = t0 + o_r // G  # [BM] query index within the request
    o_hq = i_hkv * G + o_r % G  # [BM] query head
    m_r = (o_r < BLOCK_T * G) & (o_i < T)
    o_n = (bos + o_i).to(tl.int64)  # [BM] row of q / out
    o_d = tl.arange(0, D)
    o_bit = tl.arange(0, _MAX_TREE_TOKENS)
    if IS_TREE:
        b_tm = tl.load(tree_mask + o_n, mask=m_r, other=0)  # [BM] int64 ancestor bits
        b_bits = (b_tm[:, None] >> o_bit[None, :].to(tl.int64)) & 1  # [BM, 64]
        b_depth = tl.sum(tl.where(o_bit[None, :] < T, b_bits, 0), 1) - 1  # [BM] ancestors on the path
        b_nk = tl.where(m_r, L0 + b_depth + 1, 0).to(tl.int32)  # [BM] logical keys each row sees
        reg_lo = L0 // BLOCK_N  # first tile holding a tree node: gathered per query from here
    else:
        b_nk = tl.where(m_r, L0 + o_i + 1, 0).to(tl.int32)
    n_tiles = tl.cdiv(tl.max(b_nk, 0), BLOCK_N)
    if not IS_TREE:
        reg_lo = n_tiles
    n_split = tl.cdiv(n_tiles, SPLIT_TILES)
    b_busy = tl.cdiv(tl.cdiv(b_nk, BLOCK_N), SPLIT_TILES)  # [BM] splits each row folds
    if PARALLEL:
        if i_sp >= n_split:
            return
        s_lo = i_sp
        s_hi = i_sp + 1
    else:
        s_lo = 0
        s_hi = n_split

    b_q = tl.load(q + (o_n * stride_qn + o_hq * stride_qh)[:, None] + o_d[None, :], mask=m_r[:, None], other=0.0)
    p_pt = page_table + i_b.to(tl.int64) * stride_ptb
    M_f = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    L_f = tl.zeros([BLOCK_M], dtype=tl.float32)
    A_f = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = M_f
    l_i = L_f
    acc = A_f
    for s in range(s_lo, s_hi):
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        tile_lo = s * SPLIT_TILES
        tile_hi = tl.minimum(tile_lo + SPLIT_TILES, n_tiles)
        # Tiles every query of the block reads at their own slots: one load, all rows.
        for tile in range(tile_lo, tl.minimum(tile_hi, reg_lo)):
            o_j = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] logical keys = slots
            m_j = o_j < kv_len
            b_k, b_v = _load_kv(k_cache, v_cache, p_pt, i_hkv, o_j, m_j, stride_kp, stride_ks, stride_kh, stride_vp,
                                stride_vs, stride_vh, D, PS)
            m_vis = m_r[:, None] & (o_j[None, :] < b_nk[:, None])
            m_i, l_i, acc = _tile_update(b_q, b_k, b_v, m_vis, m_i, l_i, acc, qk_scale, DOT_PREC)
        if IS_TREE:
            # Tiles holding tree nodes: per query, its ancestors gathered into their canonical lanes
            # (logical key L0 + d = the ancestor at depth d), applied to that query's rows only.
            for tile in range(tl.maximum(tile_lo, reg_lo), tile_hi):
                o_j = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] logical keys
                for tq in range(0, BLOCK_T):
                    i_q = t0 + tq
                    if i_q < T:
                        b_mq = tl.load(tree_mask + bos + i_q)  # int64 ancestor bits of query i_q
                        b_on = (((b_mq >> o_bit.to(tl.int64)) & 1) != 0) & (o_bit < T)  # [64] on its path
                        b_rank = tl.cumsum(b_on.to(tl.int32), 0) - 1  # [64] depth of each path node
                        n_q = L0 + tl.sum(b_on.to(tl.int32), 0)  # keys query i_q sees
                        o_rk = o_j - L0  # [BN] depth a lane holds (negative: prefix)
                        b_hit = b_on[None, :] & (b_rank[None, :] == o_rk[:, None])  # [BN, 64]
                        b_node = tl.sum(tl.where(b_hit, o_bit[None, :], 0), 1)  # [BN] the ancestor at that depth
                        o_slot = tl.where(o_rk < 0, o_j, L0 + b_node)
                        m_j = o_j < n_q
                        b_k, b_v = _load_kv(k_cache, v_cache, p_pt, i_hkv, o_slot, m_j, stride_kp, stride_ks,
                                            stride_kh, stride_vp, stride_vs, stride_vh, D, PS)
                        m_vis = (m_r & (o_r // G == tq))[:, None] & m_j[None, :]
                        m_i, l_i, acc = _tile_update(b_q, b_k, b_v, m_vis, m_i, l_i, acc, qk_scale, DOT_PREC)
        if not PARALLEL:
            M_n, L_n, A_n = _fold(M_f, L_f, A_f, m_i, l_i, acc)
            m_fold = s < b_busy  # [BM] rows with keys in split s
            M_f = tl.where(m_fold, M_n, M_f)
            L_f = tl.where(m_fold, L_n, L_f)
            A_f = tl.where(m_fold[:, None], A_n, A_f)

    p_o = o + (o_n * stride_on + o_hq * stride_oh)[:, None] + o_d[None, :]
    if PARALLEL:
        # A row of one split finishes here (the same first fold the merge would do); longer rows
        # leave their split's partial for the merge kernel.
        m_done = m_r & (b_busy == 1)
        if i_sp == 0:
            M_n, L_n, A_n = _fold(M_f, L_f, A_f, m_i, l_i, acc)
            b_o = A_n / tl.where(L_n > 0.0, L_n, 1.0)[:, None]
            tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_done[:, None])
            tl.store(busy + o_n * (HKV * G) + o_hq, b_busy, mask=m_r)
        m_part = m_r & (b_busy > 1) & (i_sp < b_busy)
        o_p = (o_n * (HKV * G) + o_hq) * n_prog + i_sp  # [BM] partial of (row, head, split)
        tl.store(part_acc + o_p[:, None] * D + o_d[None, :], acc, mask=m_part[:, None])
        tl.store(part_ml + o_p * 2, m_i, mask=m_part)
        tl.store(part_ml + o_p * 2 + 1, l_i, mask=m_part)
    else:
        b_o = A_f / tl.where(L_f > 0.0, L_f, 1.0)[:, None]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_r[:, None])


@triton.jit(do_not_specialize=["n_prog"])
def _attention_exact_merge_kernel(
    part_acc, part_ml, busy, o, n_prog, stride_on, stride_oh, HQ: tl.constexpr, D: tl.constexpr,
):
    """One (row, head) per program: fold its splits 0 .. busy - 1 in order (rows of one split were
    finished by the attention kernel)."""
    i_nh = tl.program_id(0).to(tl.int64)
    n_busy = tl.load(busy + i_nh)
    if n_busy <= 1:
        return
    o_d = tl.arange(0, D)
    o_1 = tl.arange(0, 1)
    M_f = tl.full([1], float("-inf"), dtype=tl.float32)
    L_f = tl.zeros([1], dtype=tl.float32)
    A_f = tl.zeros([1, D], dtype=tl.float32)
    for s in range(0, n_busy):
        o_p = i_nh * n_prog + s
        b_m = tl.load(part_ml + o_p * 2 + o_1)  # [1]
        b_l = tl.load(part_ml + o_p * 2 + 1 + o_1)  # [1]
        b_a = tl.load(part_acc + o_p * D + o_1[:, None] * 0 + o_d[None, :])  # [1, D]
        M_f, L_f, A_f = _fold(M_f, L_f, A_f, b_m, b_l, b_a)
    b_o = A_f / tl.where(L_f > 0.0, L_f, 1.0)[:, None]  # [1, D]
    i_n = i_nh // HQ
    i_h = i_nh % HQ
    tl.store(o + i_n * stride_on + i_h * stride_oh + o_1[:, None] * 0 + o_d[None, :], b_o.to(o.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# Launch plan and launcher
# ----------------------------------------------------------------------------------------------


def plan(G: int, D: int, dtype) -> dict:
    """The launch plan of a head shape (G query heads per KV head, head dim D) and dtype: BLOCK_M,
    BLOCK_T, BLOCK_N, SPLIT_TILES, num_warps, num_stages. No query count, batch, tree or capacity
    enters, so every launch for these heads sums a query's keys in the same tiles and splits.
    - BLOCK_M = pow2 >= max(16, G) rows: decode's tile (G heads of one query, mma.sync), which trees
      and prefill chunks fill with BLOCK_T = BLOCK_M // G queries.
    - BLOCK_N 64 keys at d <= 64, 32 at d128 (attention.py's decode tiles, chosen there by A/B).
    - SPLIT_TILES: SPLIT_KEYS keys per split (FP32_SPLIT_KEYS for fp32).
    - fp32 (tests): 32-key tiles (16 at d128), ieee dots."""
    block_m = max(16, triton.next_power_of_2(G))
    if dtype == torch.float32:
        block_n = 32 if D <= 64 else 16
        cfg = dict(BLOCK_N=block_n, SPLIT_TILES=FP32_SPLIT_KEYS // block_n, num_warps=4, num_stages=1)
    else:
        block_n = 64 if D <= 64 else 32
        cfg = dict(BLOCK_N=block_n, SPLIT_TILES=SPLIT_KEYS // block_n, num_warps=4, num_stages=3)
    return dict(BLOCK_M=block_m, BLOCK_T=block_m // G, **cfg)


def split_programs(B: int, HKV: int, n_qblocks: int, N: int, HQ: int, D: int, kv_capacity: int, cfg: dict,
                   device) -> int:
    """Split programs per (query block, request, KV head): the splits the page-table capacity can hold,
    as parallel programs where the grid would otherwise leave SMs idle and their fp32 partials fit
    PARALLEL_MAX_WORKSPACE; else 1 (each program folds its splits itself). Speed only: the same
    partials are folded in the same order either way (module docstring)."""
    splits = triton.cdiv(triton.cdiv(kv_capacity, cfg["BLOCK_N"]), cfg["SPLIT_TILES"])
    if splits <= 1 or B * HKV * n_qblocks >= sm_count(device):
        return 1
    if N * HQ * splits * (D + 2) * 4 > PARALLEL_MAX_WORKSPACE:
        return 1
    return splits


def paged_attention_exact(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tree_mask=None, sm_scale=None, *,
                          max_q_len: int, parallel: bool | None = None):
    """Paged attention (attention.paged_attention's arguments and result, no tree_window) in the
    canonical order of the module docstring. ``parallel``: None picks by :func:`split_programs`; True /
    False force parallel split programs / one program folding its splits (tests: the bits agree)."""
    attention._check_attention_args(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tree_mask, max_q_len)
    N, HQ, D = q.shape
    P, PS, HKV, _ = k_cache.shape
    B, MP = page_table.shape
    G = HQ // HKV
    cfg = plan(G, D, q.dtype)
    n_qblocks = triton.cdiv(max_q_len, cfg["BLOCK_T"])
    o = torch.empty((N, HQ, D), dtype=q.dtype, device=q.device)
    if N == 0 or B == 0:
        return o
    n_prog = split_programs(B, HKV, n_qblocks, N, HQ, D, MP * PS, cfg, q.device)
    if parallel is not None:
        n_prog = max(2, triton.cdiv(triton.cdiv(MP * PS, cfg["BLOCK_N"]), cfg["SPLIT_TILES"])) if parallel else 1
    par = n_prog > 1
    if par:
        part_acc = torch.empty((N, HQ, n_prog, D), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((N, HQ, n_prog, 2), dtype=torch.float32, device=q.device)
        busy = torch.zeros((N, HQ), dtype=torch.int32, device=q.device)
    else:
        part_acc = part_ml = busy = o  # unused placeholders
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    tm = tree_mask if tree_mask is not None else kv_lens  # placeholder pointer when causal
    _attention_exact_kernel[(n_qblocks, B * HKV, n_prog)](
        q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tm, o, part_acc, part_ml, busy,
        scale * 1.4426950408889634, n_prog,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0), o.stride(0), o.stride(1),
        HKV=HKV, G=G, D=D, PS=PS, BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"],
        SPLIT_TILES=cfg["SPLIT_TILES"], PARALLEL=par, IS_TREE=tree_mask is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=False,
    )  # fmt: skip
    if par:
        _attention_exact_merge_kernel[(N * HQ,)](
            part_acc, part_ml, busy, o, n_prog, o.stride(0), o.stride(1), HQ=HQ, D=D,
            num_warps=1, enable_fp_fusion=False,
        )  # fmt: skip
    return o
