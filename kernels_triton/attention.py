"""Paged attention for prefill, decode and tree verification, plus the KV-cache write.

One kernel family serves every step of the engine: B requests, request b with T_b new query tokens
(T_b = 1: decode, T_b = tree size: verify, T_b = a chunk: prefill, T_b = 0: padding) attends to its
kv_len_b cached slots, read through a page table.

Shapes (named dims):
    N   total query tokens of the batch (rows of q; request b owns rows cu_q_lens[b]:cu_q_lens[b+1])
    HQ  query heads, HKV key/value heads, G = HQ // HKV (query heads per KV head, GQA)
    D   head dim (power of two, 16..256)
    P   physical pages in the pool, PS slots per page, MP page-table entries per request
    q          [N, HQ, D]        fp32 / fp16 / bf16, last dim contiguous (row/head strides free)
    k_cache    [P, PS, HKV, D]   same dtype as q; v_cache likewise
    page_table [B, MP] int32     logical slot s of request b -> page page_table[b, s // PS], offset s % PS
    cu_q_lens  [B + 1] int32     prefix sums of T_b
    kv_lens    [B] int32         valid slots of request b INCLUDING its T_b new tokens
    tree_mask  [N] int64 | None  ancestor bitmask per query row (T_b <= 64, or over a window of W <= 64)
    out        [N, HQ, D]        q.dtype

Math, for request b with prefix length L0 = kv_len - T_b, query i (0-based within the request,
stored at logical slot L0 + i) and query head h reading KV head h // G:
    s_j   = sm_scale * <q_i, k_j>                          for slots j < kv_len, in fp32
    vis_ij = j <= L0 + i                                   (tree_mask None: causal)
    vis_ij = j < L0  or  bit (j - L0) of tree_mask[row i]  (tree: whole prefix + marked new tokens)
    out_i = sum_j softmax_j(s_j | vis_ij) v_j              (fp32 accumulation, cast to q.dtype)
A causal chain is the tree whose mask for node i is (1 << (i + 1)) - 1.
A tree window W >= T_b (``tree_window``) widens the masked range to the last W slots: L0 = kv_len - W
and bit j of a mask is slot L0 + j, so queries (the last T_b slots) can see some of the W - T_b
earlier slots and not others -- a draft round that runs only its new frontier nodes, while the
nodes of earlier rounds (already in the cache) stay visible to their descendants only.

Kernel layout (FlashAttention-2 style online softmax in the exp2 domain):
- grid (query block, b * HKV + kv head, KV split). One program owns BLOCK_T consecutive queries of one
  request and all G query heads of one KV head, packed as BLOCK_M = pow2 >= BLOCK_T * G rows
  (row r -> query t0 + r // G, head kv_head * G + r % G), so each K/V tile is loaded once per KV head
  and feeds a [BLOCK_M, D] x [D, BLOCK_N] tl.dot.
- KV is walked in BLOCK_N-slot tiles; each slot's page comes from the int32 page table, so pages may
  be in any order and PS need not divide BLOCK_N (or vice versa). Tiles that every row of the block
  fully sees (the prefix, and for causal prefill the part before the block's first query) skip the
  mask; only the tail tiles covering the new tokens apply the causal / tree mask and kv_len bound.
  By default one pipelined loop walks all tiles and decides per tile (ONE_LOOP); otherwise an
  unmasked loop is followed by a masked one.
- Split-KV: the block's KV range is cut into num_splits contiguous tile ranges; with num_splits > 1
  each split writes (out / l, log2-sum-exp) to an fp32 workspace and a second small kernel merges
  the splits, or (fused merge) the last of a group's busy splits to finish merges them. num_splits
  defaults from static shapes (B, HKV, MP * PS, SM count) only; the tiles are divided by the
  request's real length, so splits past a short request's last tile are empty: they skip every load
  and write a zero partial with weight 0 for the merge kernel, or just return (fused merge). Tree
  tiles with long programs split further, to ~3 programs per SM, under a register cap and with a
  run-time minimum of tiles per busy split (the occupancy plan, attention_launch.occupancy_splits).
- Launch is capture-safe: the launcher never reads tensor values on the host (B, N, num_splits are
  runtime values, max_q_len a host int bound); the grid covers ceil(max_q_len / BLOCK_T) query blocks
  and programs past T_b return at once. Every launch choice (tile, splits, loops, merge, PDL) is made
  in attention_launch.py (``plan``), with the reason for each rule.

Invariants: kv_lens[b] >= T_b; kv_lens[b] <= MP * PS; page_table entries below ceil(kv_len / PS) are
valid pages (others are never read); with a tree mask T_b <= 64 and bits >= T_b are ignored; every
query must see at least one slot (true for causal, and for trees that set the node's own bit).
"""

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlc

from . import attention_launch as launch

MAX_TREE_TOKENS = 64  # one int64 ancestor bitmask per tree node
MAX_SPLITS = launch.MAX_SPLITS
# With PDL, each program reads its lengths and prefetches up to PREFETCH_TILES tiles of its cached
# prefix into L2 before it waits for its predecessor (_prefetch_prefix): the prefix, page table and
# lengths were written before the predecessor (the qkv kernel) started. Behind a small qkv kernel that
# lets attention launch at its start (linear.QKV_EARLY_MAX_BYTES) this overlaps the prefix fetch with
# the projection (docs/kernel_notes.md "PDL in attention").
PREFETCH_TILES = tl.constexpr(4)
# V strides passed when V has K's (the KV pools of one layer always do): as constexpr None, so the
# kernel computes each slot's address once for K and V (fewer instructions on every tile's chain;
# docs/kernel_notes.md "Paged attention").
SAME_KV_STRIDES = (None, None, None)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# References (plain torch; also what the model runs on CPU)
# ----------------------------------------------------------------------------------------------


def paged_attention_ref(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tree_mask=None, sm_scale=None,
                        tree_window=None):
    """Plain-torch paged attention; see the module docstring for shapes and the mask semantics."""
    N, HQ, D = q.shape
    PS, HKV = k_cache.shape[1], k_cache.shape[2]
    G = HQ // HKV
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    out = torch.zeros_like(q)
    cu = cu_q_lens.tolist()
    lens = kv_lens.tolist()
    for b in range(page_table.shape[0]):
        q0, q1, kv_len = cu[b], cu[b + 1], lens[b]
        T = q1 - q0
        if T == 0:
            continue
        W = tree_window if (tree_mask is not None and tree_window) else T  # masked window width
        prefix = kv_len - W
        pages = page_table[b, : (kv_len + PS - 1) // PS].long()  # logical page i -> physical page
        k = k_cache[pages].flatten(0, 1)[:kv_len].float()  # [L, HKV, D]
        v = v_cache[pages].flatten(0, 1)[:kv_len].float()  # [L, HKV, D]
        slots = torch.arange(kv_len, device=q.device)  # [L]
        i = torch.arange(T, device=q.device)
        if tree_mask is None:
            vis = slots[None, :] <= prefix + i[:, None]  # [T, L]
        else:
            bits = (tree_mask[q0:q1, None] >> torch.arange(W, device=q.device)[None, :]) & 1  # [T, W]
            vis = torch.ones(T, kv_len, dtype=torch.bool, device=q.device)
            vis[:, prefix:] = bits.bool()
        qg = q[q0:q1].float().reshape(T, HKV, G, D)  # query head h = kv_head * G + g
        s = torch.einsum("tkgd,lkd->kgtl", qg, k) * scale  # [HKV, G, T, L]
        s = s.masked_fill(~vis, float("-inf"))
        o = torch.einsum("kgtl,lkd->tkgd", torch.softmax(s, dim=-1), v)  # [T, HKV, G, D]
        out[q0:q1] = o.reshape(T, HQ, D).to(q.dtype)
    return out


def write_kv_ref_(k_cache, v_cache, k, v, slot_mapping):
    """Write k[n], v[n] ([N, HKV, D]) into flat slot slot_mapping[n] of the caches; skip slots < 0."""
    HKV, D = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, HKV, D)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, HKV, D)[slots] = v[keep].to(v_cache.dtype)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _attn_tile(b_q, k_cache, v_cache, p_pt, i_hkv, tile, kv_len, prefix, o_i, b_tm, n_full, m_i, l_i, acc, qk_scale,
               stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, D: tl.constexpr, PS: tl.constexpr,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_TREE: tl.constexpr, DOT_PREC: tl.constexpr,
               L2D: tl.constexpr):
    """One BLOCK_N-slot KV tile of the online softmax. MASKED: 0 no mask (a tile every row fully
    sees), 1 the kv_len bound and the causal / tree mask, 2 the kv_len bound on the loads and the
    masks decided at run time (applied when tile >= n_full), so that one loop covers every tile."""
    o_d = tl.arange(0, D)
    o_s = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical slots
    if MASKED != 0:
        m_s = o_s < kv_len
        b_page = tl.load(p_pt + o_s // PS, mask=m_s, other=0).to(tl.int64)  # [BLOCK_N]
    else:
        b_page = tl.load(p_pt + o_s // PS).to(tl.int64)  # [BLOCK_N]
    o_off = o_s % PS
    off = (b_page * stride_kp + o_off * stride_ks + i_hkv * stride_kh)[:, None] + o_d[None, :]
    p_k = k_cache + off
    if stride_vp is None:  # V has K's strides (the launcher passes None): one address computation
        p_v = v_cache + off
    else:
        p_v = v_cache + (b_page * stride_vp + o_off * stride_vs + i_hkv * stride_vh)[:, None] + o_d[None, :]
    if MASKED != 0:
        b_k = tl.load(p_k, mask=m_s[:, None], other=0.0)  # [BLOCK_N, D]
        b_v = tl.load(p_v, mask=m_s[:, None], other=0.0)  # [BLOCK_N, D]
    else:
        b_k = tl.load(p_k)  # [BLOCK_N, D]
        b_v = tl.load(p_v)  # [BLOCK_N, D]

    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, D] @ [D, BLOCK_N]
    if MASKED != 0:
        if MASKED == 1 or tile >= n_full:
            if IS_TREE:
                o_j = o_s - prefix  # index among the new tokens (negative inside the prefix)
                m_new = (o_j >= 0) & m_s
                b_bit = (b_tm[:, None] >> tl.where(m_new, o_j, 0).to(tl.int64)[None, :]) & 1  # [BLOCK_M, BLOCK_N]
                m_vis = (o_s < prefix)[None, :] | ((b_bit != 0) & m_new[None, :])
            else:
                m_vis = (o_s[None, :] <= (prefix + o_i)[:, None]) & m_s[None, :]
            b_s = tl.where(m_vis, b_s, float("-inf"))
        m_new_i = tl.maximum(m_i, tl.max(b_s, 1))  # [BLOCK_M]
        # A row may see nothing yet (all -inf so far): shift by 0 instead of -inf to avoid inf - inf.
        m_safe = tl.where(m_new_i == float("-inf"), 0.0, m_new_i)
    else:
        m_new_i = tl.maximum(m_i, tl.max(b_s, 1))  # [BLOCK_M], finite: every slot is visible
        m_safe = m_new_i
    b_alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
    b_p = tl.exp2(b_s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    if L2D:  # l_i [BLOCK_M, BLOCK_N]: elementwise running sums, reduced once after the loop
        l_i = l_i * b_alpha[:, None] + b_p
    else:
        l_i = l_i * b_alpha + tl.sum(b_p, 1)
    acc = acc * b_alpha[:, None] + tl.dot(
        b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC
    )  # [BLOCK_M, BLOCK_N] @ [BLOCK_N, D] -> [BLOCK_M, D]
    return m_new_i, l_i, acc


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the lines at ptrs (PTX prefetch.global.L2: no register result, nothing waits)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_prefix(k_cache, v_cache, p_pt, i_hkv, slot_lo, slot_hi, stride_kp, stride_ks, stride_kh, stride_vp,
                     stride_vs, stride_vh, D: tl.constexpr, PS: tl.constexpr, N_SLOTS: tl.constexpr):
    """Prefetch the K/V lines of slots [slot_lo, slot_hi) (at most N_SLOTS) into L2: one page-table
    load, then one prefetch per 128-byte line; nothing waits for the data.

    Runs before griddepcontrol.wait, while the predecessor (the qkv kernel) may still run. The
    caller passes only slots below the prefix: they, the page table and the lengths were written
    before the predecessor started (by earlier steps and the step's metadata kernel), and the
    predecessor writes only q and the new tokens' slots. Nothing is stored here."""
    LINE: tl.constexpr = 1024 // k_cache.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
    N_LINES: tl.constexpr = D // LINE if D > LINE else 1
    if slot_hi > slot_lo:
        o_s = tl.minimum(slot_lo + tl.arange(0, N_SLOTS), slot_hi - 1)  # lanes past the range repeat the last slot
        b_page = tl.load(p_pt + o_s // PS).to(tl.int64)  # [N_SLOTS]
        o_off = o_s % PS
        o_l = tl.arange(0, N_LINES) * LINE
        off = (b_page * stride_kp + o_off * stride_ks + i_hkv * stride_kh)[:, None] + o_l[None, :]
        _prefetch_l2(k_cache + off)
        if stride_vp is None:  # V has K's strides
            _prefetch_l2(v_cache + off)
        else:
            _prefetch_l2(v_cache + (b_page * stride_vp + o_off * stride_vs + i_hkv * stride_vh)[:, None] + o_l[None, :])


@triton.jit
def _last_split_merges(counters, i_cnt, o_part, lse_part, o, bos, t0, T, i_hkv, n_busy, num_splits, stride_on,
                       stride_oh, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, S_CHUNK: tl.constexpr):
    """Count this split in; the group's last busy split to arrive merges the n_busy partials of its rows.

    Splits >= n_busy are empty: they return without counting in (every split of the group computes
    the same n_busy from the request's length). Every busy split has stored its partial before its
    increment (the barrier orders all threads' stores before the release), so the program that sees
    n_busy - 1 arrivals before its own reads complete partials (acquire), writes the output and
    resets the counter to 0 for the next launch.
    The merge tiles its rows by BLOCK_M here (the rows the launch can use, e.g. G for decode, not the
    attention tile's padded rows), so S_CHUNK partials of every row are folded per step.
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(counters + i_cnt, 1, sem="acq_rel")
    if arrived == n_busy - 1:
        tl.store(counters + i_cnt, 0)
        HQ: tl.constexpr = HKV * G
        o_r = tl.arange(0, BLOCK_M)
        o_i = t0 + o_r // G  # [BLOCK_M] query index within the request (same packing as the attention tile)
        o_hq = i_hkv * G + o_r % G
        m_r = (o_r < BLOCK_T * G) & (o_i < T)
        o_n = (bos + o_i).to(tl.int64)
        row = (o_n * HQ + o_hq) * num_splits  # [BLOCK_M] first partial of each row
        o_s = tl.arange(0, BLOCK_S)
        m_s = m_r[:, None] & (o_s < n_busy)[None, :]
        b_lse = tl.load(lse_part + row[:, None] + o_s[None, :], mask=m_s, other=float("-inf"),
                        cache_modifier=".cg")  # [BLOCK_M, BLOCK_S]
        b_max = tl.max(b_lse, 1)  # [BLOCK_M]; every row has a split that saw a slot
        b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
        b_den = tl.sum(tl.exp2(b_lse - b_max[:, None]), 1)  # [BLOCK_M]
        o_c = tl.arange(0, S_CHUNK)
        o_d = tl.arange(0, D)
        b_acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for s0 in range(0, n_busy, S_CHUNK):
            m_c = m_r[:, None] & ((s0 + o_c) < n_busy)[None, :]  # [BLOCK_M, S_CHUNK]
            b_l = tl.load(lse_part + row[:, None] + s0 + o_c[None, :], mask=m_c, other=float("-inf"),
                          cache_modifier=".cg")
            b_w = tl.exp2(b_l - b_max[:, None])  # [BLOCK_M, S_CHUNK]
            p_p = o_part + ((row[:, None] + s0 + o_c[None, :]) * D)[:, :, None] + o_d[None, None, :]
            b_p = tl.load(p_p, mask=m_c[:, :, None], other=0.0, cache_modifier=".cg")  # [BLOCK_M, S_CHUNK, D]
            b_acc += tl.sum(b_w[:, :, None] * b_p, 1)
        b_o = b_acc / tl.where(b_den > 0.0, b_den, 1.0)[:, None]
        p_o = o + (o_n * stride_on + o_hq * stride_oh)[:, None] + o_d[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_r[:, None])


@triton.jit(do_not_specialize=["num_splits", "min_busy_tiles", "window"])
def _paged_attention_fwd_kernel(
    q,  # [N, HQ, D]
    k_cache,  # [P, PS, HKV, D]
    v_cache,  # [P, PS, HKV, D]
    page_table,  # [B, MP] int32
    cu_q_lens,  # [B + 1] int32
    kv_lens,  # [B] int32
    tree_mask,  # [N] int64 (unused unless IS_TREE)
    o,  # [N, HQ, D] output (SPLIT False)
    o_part,  # [N, HQ, num_splits, D] fp32 (SPLIT True)
    lse_part,  # [N, HQ, num_splits] fp32 log2-sum-exp (SPLIT True)
    counters,  # [n_qblocks * B * HKV] int32 arrivals, zero between launches (FUSED_MERGE)
    qk_scale,  # sm_scale * log2(e)
    num_splits,
    min_busy_tiles,  # a split gets >= this many of the request's tiles (fewer busy splits if short)
    window,  # tree window W (IS_TREE; 0: T_b)
    stride_qn,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ptb,
    stride_on,
    stride_oh,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED_MERGE: tl.constexpr,  # SPLIT: the last split of each group merges (no second launch)
    BLOCK_S: tl.constexpr,  # pow2 >= num_splits (FUSED_MERGE)
    S_CHUNK: tl.constexpr,  # partials merged per step (FUSED_MERGE)
    MERGE_ROWS: tl.constexpr,  # pow2 >= the rows a query block can use (FUSED_MERGE's row tile)
    IS_TREE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (attention_launch.pdl_mode): wait, then late trigger
    ONE_LOOP: tl.constexpr,  # one loop over all tiles, or unmasked then masked tiles (attention_launch)
    L2D: tl.constexpr,  # running softmax sums kept per element, reduced after the loop (attention_launch)
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
    if IS_TREE:
        prefix = kv_len - tl.where(window > 0, window, T)  # mask bit j <-> slot prefix + j
    else:
        prefix = kv_len - T

    o_r = tl.arange(0, BLOCK_M)
    o_i = t0 + o_r // G  # [BLOCK_M] query index within the request
    o_hq = i_hkv * G + o_r % G  # [BLOCK_M] query head
    m_r = (o_r < BLOCK_T * G) & (o_i < T)
    o_n = (bos + o_i).to(tl.int64)  # [BLOCK_M] row of q / out
    o_d = tl.arange(0, D)
    if IS_TREE:
        kv_hi = kv_len
        full_hi = prefix  # every node sees the whole prefix, nothing more for sure
    else:
        kv_hi = prefix + tl.minimum(t0 + BLOCK_T, T)  # the block's last query sees up to here
        full_hi = prefix + t0 + 1  # the block's first query sees slots < full_hi

    # This split's tile range; tiles below n_full are seen by every row and need no mask.
    n_tiles = tl.cdiv(kv_hi, BLOCK_N)
    # Splits take ceil(n_tiles / n_busy) tiles each, so the last ones may be empty (65 tiles in 16
    # splits: 13 busy splits of 5). Spreading the tiles evenly instead (n_tiles // n_busy or one
    # more each, all 16 busy) was slower where it differs: same longest split, more programs and
    # partials (docs/kernel_notes.md "Split-KV").
    n_busy = tl.maximum(tl.minimum(num_splits, n_tiles // min_busy_tiles), 1)
    per_split = tl.cdiv(n_tiles, n_busy)
    tile_lo = i_sp * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    n_full = full_hi // BLOCK_N
    i_cnt = i_t * tl.num_programs(1) + i_bh  # this group's arrival counter (FUSED_MERGE)
    p_pt = page_table + i_b.to(tl.int64) * stride_ptb
    if USE_PDL:  # up to here only what the predecessor does not write was read
        _prefetch_prefix(k_cache, v_cache, p_pt, i_hkv, tile_lo * BLOCK_N,
                         tl.minimum(tl.minimum(tile_hi, tile_lo + PREFETCH_TILES) * BLOCK_N, prefix),
                         stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, D, PS,
                         PREFETCH_TILES * BLOCK_N)
        tlc.gdc_wait()
    if SPLIT:
        if tile_lo >= tile_hi:
            # Empty split (num_splits comes from the page-table width, so a short request in a wide
            # table leaves most splits empty): no q, page-table or K/V loads. For the merge kernel it
            # still writes the zeros and the weight 2^-inf = 0 that the merge reads, so the merge
            # loads o_part and lse together instead of loading o_part only after seeing lse (one
            # more round trip). The fused merge waits only for the busy splits: nothing to do.
            if not FUSED_MERGE:
                o_part_row = (o_n * (HKV * G) + o_hq) * num_splits + i_sp  # [BLOCK_M]
                tl.store(o_part + o_part_row[:, None] * D + o_d[None, :],
                         tl.zeros([BLOCK_M, D], dtype=tl.float32), mask=m_r[:, None])
                tl.store(lse_part + o_part_row, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=m_r)
            return

    p_q = q + (o_n * stride_qn + o_hq * stride_qh)[:, None] + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None], other=0.0)  # [BLOCK_M, D]
    if IS_TREE:
        b_tm = tl.load(tree_mask + o_n, mask=m_r, other=0)  # [BLOCK_M] int64 ancestor bits
    else:
        b_tm = tl.zeros([BLOCK_M], dtype=tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if L2D:
        l_i = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    # ONE_LOOP: one pipelined loop over all tiles, each applying the masks when it needs them
    # (tile >= n_full); otherwise the tiles every row fully sees run first, without any mask.
    t_mask = tile_lo
    if not ONE_LOOP:
        for tile in range(tile_lo, tl.minimum(tile_hi, n_full)):
            m_i, l_i, acc = _attn_tile(
                b_q, k_cache, v_cache, p_pt, i_hkv, tile, kv_len, prefix, o_i, b_tm, n_full, m_i, l_i, acc, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                D, PS, BLOCK_N, 0, IS_TREE, DOT_PREC, L2D,
            )  # fmt: skip
        t_mask = tl.maximum(tile_lo, n_full)
    for tile in range(t_mask, tile_hi):
        m_i, l_i, acc = _attn_tile(
            b_q, k_cache, v_cache, p_pt, i_hkv, tile, kv_len, prefix, o_i, b_tm, n_full, m_i, l_i, acc, qk_scale,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            D, PS, BLOCK_N, 2 if ONE_LOOP else 1, IS_TREE, DOT_PREC, L2D,
        )  # fmt: skip
    if USE_PDL:  # only the epilogue is left
        tlc.gdc_launch_dependents()

    if L2D:
        l_i = tl.sum(l_i, 1)  # [BLOCK_M]
    # An empty split (or a row that saw nothing in it) has l = 0: write 0 with weight 2^-inf = 0.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    b_o = acc / l_safe[:, None]  # [BLOCK_M, D]
    if SPLIT and FUSED_MERGE and tl.cdiv(n_tiles, per_split) == 1:
        # The request's tiles fit one split: its result is the output (no partial, no arrival).
        p_o = o + (o_n * stride_on + o_hq * stride_oh)[:, None] + o_d[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_r[:, None])
    elif SPLIT:
        o_part_row = (o_n * (HKV * G) + o_hq) * num_splits + i_sp  # [BLOCK_M]
        tl.store(o_part + o_part_row[:, None] * D + o_d[None, :], b_o, mask=m_r[:, None])
        b_lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # [BLOCK_M]
        tl.store(lse_part + o_part_row, b_lse, mask=m_r)
        if FUSED_MERGE:
            _last_split_merges(counters, i_cnt, o_part, lse_part, o, bos, t0, T, i_hkv, tl.cdiv(n_tiles, per_split),
                               num_splits, stride_on, stride_oh, HKV, G, D, BLOCK_T, MERGE_ROWS, BLOCK_S, S_CHUNK)
    else:
        p_o = o + (o_n * stride_on + o_hq * stride_oh)[:, None] + o_d[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_r[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _paged_attention_merge_kernel(
    o_part,  # [N, HQ, num_splits, D] fp32
    lse_part,  # [N, HQ, num_splits] fp32 (log2 domain)
    o,  # [N, HQ, D]
    num_splits,
    stride_on,
    stride_oh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tlc.gdc_wait()
    i_nh = tl.program_id(0).to(tl.int64)  # one (row, query head) per program
    i_n = i_nh // HQ
    i_h = i_nh % HQ
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, D)
    m_s = o_s < num_splits
    b_lse = tl.load(lse_part + i_nh * num_splits + o_s, mask=m_s, other=float("-inf"))  # [BLOCK_S]
    b_w = tl.exp2(b_lse - tl.max(b_lse, 0))  # [BLOCK_S], empty splits weigh 0
    p_op = o_part + (i_nh * num_splits + o_s)[:, None] * D + o_d[None, :]
    b_op = tl.load(p_op, mask=m_s[:, None], other=0.0)  # [BLOCK_S, D]
    if USE_PDL:
        tlc.gdc_launch_dependents()
    b_o = tl.sum(b_w[:, None] * b_op, 0) / tl.sum(b_w, 0)  # [D]
    tl.store(o + i_n * stride_on + i_h * stride_oh + o_d, b_o.to(o.dtype.element_ty))


@triton.jit
def _write_kv_kernel(
    k,  # [N, HKV, D]
    v,  # [N, HKV, D]
    k_cache,  # [P, PS, HKV, D]
    v_cache,  # [P, PS, HKV, D]
    slot_mapping,  # [N] int64
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + i_n)
    if slot < 0:  # padding token
        return
    page = slot // PS
    off = slot % PS
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_hd = (o_h < HKV)[:, None] & (o_d < D)[None, :]
    b_k = tl.load(k + i_n * stride_kn + o_h[:, None] * stride_kh + o_d[None, :], mask=m_hd)  # [BLOCK_H, BLOCK_D]
    b_v = tl.load(v + i_n * stride_vn + o_h[:, None] * stride_vh + o_d[None, :], mask=m_hd)  # [BLOCK_H, BLOCK_D]
    p_kc = k_cache + page * stride_kcp + off * stride_kcs + o_h[:, None] * stride_kch + o_d[None, :]
    p_vc = v_cache + page * stride_vcp + off * stride_vcs + o_h[:, None] * stride_vch + o_d[None, :]
    tl.store(p_kc, b_k.to(k_cache.dtype.element_ty), mask=m_hd)
    tl.store(p_vc, b_v.to(v_cache.dtype.element_ty), mask=m_hd)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_COUNTERS = {}


def arrival_counters(device, n, owner="paged_attention"):
    """A zeroed int32 workspace of >= n arrival counters on device for one kind of kernel (owner):
    the last program of a group to arrive does the group's final work and returns its counter to 0,
    and launches on one stream run one after another, so each buffer is allocated (and zeroed)
    once, outside any CUDA-graph capture the first call size allows: at least 65536 counters."""
    buf = _COUNTERS.get((device, owner))
    if buf is None or buf.numel() < n:
        if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: {n} arrival counters needed during CUDA-graph capture; "
                               "run the same shapes once before capturing")
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[(device, owner)] = buf
    return buf


def _check_attention_args(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tree_mask, max_q_len):
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q must be [N, HQ, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "paged_attention: k_cache and v_cache must both be [P, PS, HKV, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    N, HQ, D = q.shape
    P, PS, HKV, Dk = k_cache.shape
    if q.dtype not in _FLOAT_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            "paged_attention: q, k_cache, v_cache must share one dtype of float32/float16/bfloat16, got "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if Dk != D:
        raise ValueError(f"paged_attention: head dim of q ({D}) != head dim of the cache ({Dk})")
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"paged_attention: head dim must be a power of two in [16, 256], got {D}")
    if HKV == 0 or HQ % HKV:
        raise ValueError(f"paged_attention: HQ={HQ} must be a multiple of HKV={HKV}")
    if HQ // HKV > 128:
        raise ValueError(f"paged_attention: at most 128 query heads per KV head, got {HQ // HKV}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention: the head dim (last dim) of q, k_cache, v_cache must be contiguous")
    if page_table.dim() != 2 or page_table.dtype != torch.int32:
        raise ValueError(
            f"paged_attention: page_table must be [B, MP] int32, got {tuple(page_table.shape)} {page_table.dtype}"
        )
    B = page_table.shape[0]
    if cu_q_lens.shape != (B + 1,) or cu_q_lens.dtype != torch.int32:
        raise ValueError(
            f"paged_attention: cu_q_lens must be [B + 1] = [{B + 1}] int32, got "
            f"{tuple(cu_q_lens.shape)} {cu_q_lens.dtype}"
        )
    if kv_lens.shape != (B,) or kv_lens.dtype != torch.int32:
        raise ValueError(
            f"paged_attention: kv_lens must be [B] = [{B}] int32, got {tuple(kv_lens.shape)} {kv_lens.dtype}"
        )
    if tree_mask is not None:
        if tree_mask.shape != (N,) or tree_mask.dtype != torch.int64:
            raise ValueError(
                f"paged_attention: tree_mask must be [N] = [{N}] int64, got {tuple(tree_mask.shape)} {tree_mask.dtype}"
            )
        if max_q_len > MAX_TREE_TOKENS:
            raise ValueError(
                f"paged_attention: a tree mask allows at most {MAX_TREE_TOKENS} tokens per request, "
                f"got max_q_len={max_q_len}"
            )
    if not isinstance(max_q_len, int) or max_q_len < 1:
        raise ValueError(f"paged_attention: max_q_len must be a host int >= 1, got {max_q_len!r}")
    tensors = [k_cache, v_cache, page_table, cu_q_lens, kv_lens] + ([tree_mask] if tree_mask is not None else [])
    for t in tensors:
        if t.device != q.device:
            raise ValueError(f"paged_attention: all tensors must be on {q.device}, found one on {t.device}")


def paged_attention(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_q_lens,
    kv_lens,
    tree_mask=None,
    sm_scale=None,
    *,
    max_q_len: int,
    num_splits: int | None = None,
    tree_window: int | None = None,
    fused_merge: bool | None = None,
    one_loop: bool | None = None,
    maxnreg: int | None = None,
    merge_chunk: int | None = None,
    l2d: bool | None = None,
    min_busy_tiles: int | None = None,
):
    """Paged attention over one layer's KV pool (prefill chunk, decode or tree verify) in 1-2 launches.

    Args:
        q: [N, HQ, D] queries of all requests, concatenated.
        k_cache, v_cache: [P, PS, HKV, D] page pools (same dtype as q).
        page_table: [B, MP] int32; cu_q_lens: [B + 1] int32; kv_lens: [B] int32 (incl. new tokens).
        tree_mask: None (causal) or [N] int64 ancestor bitmasks (T_b <= 64).
        sm_scale: softmax scale, default 1 / sqrt(D).
        max_q_len: host-side upper bound on every T_b (sizes the query-block grid; never synced).
        num_splits: split-KV factor; None picks one from static shapes.
        tree_window: with a tree mask, the width W >= every T_b of the masked window (the last W
            slots; bits index them); None: W = T_b.
        fused_merge: with num_splits > 1, True: the last split of each (query block, request, KV
            head) to finish merges the partials (one launch; an int32 arrival counter per group in a
            zeroed workspace that each launch leaves zeroed); False: a second merge kernel; None:
            fused when that last program folds >= 8 partials per step (merged rows x D <= 1024,
            e.g. decode), see attention_launch.FUSED_MERGE_MAX_TILE.
        one_loop: True: each program walks its KV tiles in one loop, masking a tile at run time
            when it needs it; False: the unmasked tiles, then the masked ones; None: the measured
            default, see attention_launch.default_one_loop. Both compute the same values.
        maxnreg: launch tuning (None: ptxas decides, or 168 under the tree occupancy plan): a
            register cap per thread for the attention kernel. Split-KV raises the tree tile's
            count (BLOCK_M = 64, d64, sm_90: 168 registers without splits, 203 with the merge
            kernel, 230-244 with the fused merge), which drops it from 3 to 2 programs per SM; a
            cap of 168 fits them with <= 24 bytes of spills. See attention_launch.occupancy_splits.
        merge_chunk: launch tuning: partials the fused merge folds per step (default as many as fit
            8192 fp32 values, at most num_splits; 1 under the tree occupancy plan).
        l2d: True: each program keeps its running softmax sums per element of the score tile and
            reduces them once after its loop; False: a row sum per tile; None: the measured default,
            see attention_launch.default_l2d. Both compute the same values up to summation order.
        min_busy_tiles: launch tuning: a busy split takes at least this many of its request's KV tiles
            (fewer busy splits for short requests; one busy split under the fused merge writes the
            output itself); None: 1, or the tree occupancy plan's.
        When num_splits is None and the tree occupancy plan applies (attention_launch.occupancy_splits), the
        defaults of fused_merge, merge_chunk and maxnreg are the plan's; explicit values win.

    Returns:
        [N, HQ, D] in q.dtype (a new tensor). Rows not owned by any request are left unwritten.
    """
    _check_attention_args(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tree_mask, max_q_len)
    if tree_window is not None and (tree_mask is None or not isinstance(tree_window, int)
                                    or not max_q_len <= tree_window <= MAX_TREE_TOKENS):
        raise ValueError(f"paged_attention: tree_window must be a host int in [max_q_len={max_q_len}, "
                         f"{MAX_TREE_TOKENS}] with a tree mask, got {tree_window!r}")
    N, HQ, D = q.shape
    P, PS, HKV, _ = k_cache.shape
    B, MP = page_table.shape
    G = HQ // HKV
    lp = launch.plan(max_q_len, B, HKV, G, D, MP * PS, q.dtype, q.device, num_splits=num_splits,
                     fused_merge=fused_merge, one_loop=one_loop, maxnreg=maxnreg, merge_chunk=merge_chunk, l2d=l2d,
                     min_busy_tiles=min_busy_tiles)
    cfg, num_splits, pdl = lp.cfg, lp.num_splits, lp.pdl

    o = torch.empty((N, HQ, D), dtype=q.dtype, device=q.device)
    if N == 0 or B == 0:
        return o
    if lp.split:
        o_part = torch.empty((N, HQ, num_splits, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((N, HQ, num_splits), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = o  # unused placeholders
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    tm = tree_mask if tree_mask is not None else kv_lens  # placeholder pointer when causal
    grid = (lp.n_qblocks, B * HKV, num_splits)
    counters = arrival_counters(q.device, lp.n_qblocks * B * HKV) if lp.fused_merge else kv_lens  # placeholder
    block_s = triton.next_power_of_2(num_splits)
    _paged_attention_fwd_kernel[grid](
        q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tm, o, o_part, lse_part, counters,
        scale * 1.4426950408889634, num_splits, lp.min_busy_tiles, tree_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *(SAME_KV_STRIDES if v_cache.stride() == k_cache.stride()
          else (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))),
        page_table.stride(0), o.stride(0), o.stride(1),
        HKV=HKV, G=G, D=D, PS=PS,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"],
        SPLIT=lp.split, FUSED_MERGE=lp.fused_merge, BLOCK_S=block_s, S_CHUNK=lp.s_chunk,
        MERGE_ROWS=lp.merge_rows,
        IS_TREE=tree_mask is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, **({"launch_pdl": True} if pdl else {}), ONE_LOOP=lp.one_loop,
        L2D=lp.l2d,
        **({"maxnreg": lp.maxnreg} if lp.maxnreg else {}),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if lp.split and not lp.fused_merge:
        _paged_attention_merge_kernel[(N * HQ,)](
            o_part, lse_part, o, num_splits, o.stride(0), o.stride(1),
            HQ=HQ, D=D, BLOCK_S=block_s, USE_PDL=pdl, **({"launch_pdl": True} if pdl else {}),
            num_warps=max(1, min(8, block_s * D // 1024)),  # <= 32 fp32 / thread
        )  # fmt: skip
    return o


def write_kv_(k_cache, v_cache, k, v, slot_mapping):
    """Write k[n], v[n] ([N, HKV, D]) into flat slot slot_mapping[n] = page * PS + offset of the
    [P, PS, HKV, D] caches (in place); slot_mapping[n] < 0 skips token n. One program per token."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "write_kv_: k_cache and v_cache must both be [P, PS, HKV, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    P, PS, HKV, D = k_cache.shape
    if k.dim() != 3 or k.shape[1:] != (HKV, D) or v.shape != k.shape:
        raise ValueError(
            f"write_kv_: k and v must both be [N, HKV, D] = [N, {HKV}, {D}], got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    N = k.shape[0]
    if slot_mapping.shape != (N,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"write_kv_: slot_mapping must be [N] = [{N}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    for t in (k, v, k_cache, v_cache):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"write_kv_: tensors must be float32/float16/bfloat16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError("write_kv_: the head dim (last dim) of k, v and the caches must be contiguous")
        if t.device != k_cache.device:
            raise ValueError(f"write_kv_: all tensors must be on {k_cache.device}, found one on {t.device}")
    if slot_mapping.device != k_cache.device:
        raise ValueError(f"write_kv_: slot_mapping is on {slot_mapping.device}, caches on {k_cache.device}")
    if N == 0:
        return
    _write_kv_kernel[(N,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HKV=HKV, D=D, PS=PS, BLOCK_H=triton.next_power_of_2(HKV), BLOCK_D=triton.next_power_of_2(D),
        num_warps=1 if HKV * D <= 512 else 4,
    )  # fmt: skip
