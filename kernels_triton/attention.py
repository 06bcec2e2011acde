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
  By default one pipelined loop walks all tiles and decides per tile (ONE_LOOP, _default_one_loop);
  otherwise an unmasked loop is followed by a masked one.
- Split-KV: the block's KV range is cut into num_splits contiguous tile ranges; with num_splits > 1
  each split writes (out / l, log2-sum-exp) to an fp32 workspace and a second small kernel merges
  the splits, or (fused merge) the last of a group's busy splits to finish merges them. num_splits
  defaults from static shapes (B, HKV, MP * PS, SM count) only; the tiles are divided by the
  request's real length, so splits past a short request's last tile are empty: they skip every load
  and write a zero partial with weight 0 for the merge kernel, or just return (fused merge). Tree
  tiles with long programs split further, to ~3 programs per SM, under a register cap and with a
  run-time minimum of tiles per busy split (the occupancy plan, _occupancy_splits).
- Launch is capture-safe: the launcher never reads tensor values on the host (B, N, num_splits are
  runtime values, max_q_len a host int bound); the grid covers ceil(max_q_len / BLOCK_T) query blocks
  and programs past T_b return at once.

Invariants: kv_lens[b] >= T_b; kv_lens[b] <= MP * PS; page_table entries below ceil(kv_len / PS) are
valid pages (others are never read); with a tree mask T_b <= 64 and bits >= T_b are ignored; every
query must see at least one slot (true for causal, and for trees that set the node's own bit).
"""

import math

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlc

MAX_TREE_TOKENS = 64  # one int64 ancestor bitmask per tree node
MAX_SPLITS = 64  # split-KV cap: bounds the merge kernel's tile and the fp32 workspace
MIN_SPLIT_TILES = 4  # default split-KV keeps >= 4 BLOCK_N tiles of page-table capacity per split
# Default fused merge only where the merged rows x D (rows: what a query block can use, e.g. G for
# decode; see _last_split_merges) are at most this many values: its last program then folds >= 8
# partials per step (8192 values). History, H200, graphed batch-1 steps (profile_step.py): with the
# row tile = the attention tile and 4096 values per step, merge kernel at 6d5d346 vs fused merge
# everywhere at eddb3e5: SmolLM2 decode (16 x 64, 4 partials per step) 0.737 -> 0.726 ms; tree16
# verify + draft (64 x 64, 1 per step) 1.303 -> 1.434 ms; Llama-3.1-8B decode (16 x 128, 2 per
# step, 16 busy splits at context 256) 4.436 -> 4.452 ms: a serial fold costs more than the merge
# launch it saves. SPECDEC_FUSED_MERGE=1 / 0 forces it on / off (experiments).
FUSED_MERGE_MAX_TILE = 1024
_FUSED_ENV = os.environ.get("SPECDEC_FUSED_MERGE")
if _FUSED_ENV not in (None, "0", "1"):
    raise ValueError(f"SPECDEC_FUSED_MERGE must be 0 or 1, got {_FUSED_ENV!r}")
FUSED_MERGE = None if _FUSED_ENV is None else _FUSED_ENV == "1"
_PREWAIT_ENV = os.environ.get("SPECDEC_ATTN_PREWAIT", "1")
if _PREWAIT_ENV not in ("0", "1"):
    raise ValueError(f"SPECDEC_ATTN_PREWAIT must be 0 or 1, got {_PREWAIT_ENV!r}")
# With PDL, whether each program reads its lengths and prefetches up to PREFETCH_TILES tiles of its
# cached prefix into L2 before it waits for its predecessor (see _prefetch_prefix); on unless
# SPECDEC_ATTN_PREWAIT=0. It pays where the predecessor lets it launch early (the qkv kernel of a
# small model, kernels_triton/linear.py QKV_EARLY_MAX_BYTES). H200, graphed batch-1 plain steps,
# random weights, context 512, alternating processes (scratch A/B at 1b8fd40, two rounds):
# SmolLM2 0.5821 / 0.5821 ms without it, 0.5779 / 0.5787 with it, 0.5736 / 0.5738 with it and the
# qkv kernel's early trigger; Llama-3.1-8B shapes 4.3063 / 4.3064 without, 4.3056 / 4.3071 with,
# and 4.3959 / 4.3962 with the early trigger too (4.4249 / 4.4256 with the early trigger alone).
PREWAIT = _PREWAIT_ENV == "1"
PREFETCH_TILES = tl.constexpr(4)
# V strides passed when V has K's (the KV pools of one layer always do): as constexpr None, so the
# kernel computes each slot's address once for K and V. Sass at sm_90 (bf16): the tree tile's
# unmasked loop 406 -> 374 instructions per warp per tile, decode 9q/3kv 358 -> 310. H200, same
# run (results/kernels/exp_warp_split_bc734ee.txt, columns base and ws1): tree headline 25.8 -> 24.2
# us, 32q/8kv T=16 B=64 prefix 1024 90.9 -> 85.4 us; graphed batch-1 steps, alternating processes:
# Llama-3.1-8B shapes 4.3034-4.3046 -> 4.2984-4.3016 ms, SmolLM2 0.5746-0.5750 -> 0.5723-0.5727 ms.
SAME_KV_STRIDES = (None, None, None)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PDL_LATE, PDL_EARLY = 1, 2  # USE_PDL values: where a kernel lets its successor launch (see pdl_mode)


def pdl_mode(device) -> int:
    """Programmatic dependent launch for the step kernels (attention, merge, fused linear), on a CUDA
    device of compute capability >= 9.0: PDL_LATE by default, PDL_EARLY with SPECDEC_PDL=early, off
    with SPECDEC_PDL=0 (and always off elsewhere, e.g. under the CPU interpreter). Each such kernel
    waits for its predecessor (griddepcontrol.wait) before reading anything the predecessor wrote
    (the fused linear requests its first weight chunk before the wait, so its weight stream starts
    during the previous kernel's tail) and lets its successor launch (griddepcontrol.launch_dependents):
    PDL_LATE once its main loop is done (only the epilogue left), PDL_EARLY at its start.
    H200, graphed batch-1 plain steps at d9676c6 (profile_step.py, same run): SmolLM2 0.717 ms off ->
    0.612 ms late; Llama-3.1-8B shapes 4.467 -> 4.368 ms late, while early (at 6aecb84 + the trigger
    switch) was slower than off, 4.564 vs 4.484 ms: successors launched at the start pile up
    (successors of successors too) holding SM slots while they wait. Attention reading its lengths
    and prefetching its cached prefix into L2 before the wait (PREWAIT) first gave nothing behind
    late triggers (92b24ea: 8B step 4.351 / 4.348 vs 4.354 / 4.355 ms, SmolLM2 0.604 vs 0.596 ms);
    it pays behind a small model's qkv kernel triggering early (see PREWAIT). Measured and dropped
    (H200, same runs): GEMVs prefetching their first block's weights into L2 before the wait,
    c27786c: 8B 5.79 vs 4.40 ms; attention alone triggering early: 4.394 vs 4.397 ms; the o-projection
    alone prefetching its weights (33.5 MB at 8B, which fits the L2) into L2 while attention runs,
    with attention triggering early so it is resident, 43c36b5 (branch exp/wo-l2-prefetch): 8B
    4.385 / 4.429 ms (16 / 40 MB budget) vs 4.336 ms with the early trigger alone and 4.339 / 4.338
    ms with neither; SmolLM2 0.621 vs 0.607 ms."""
    mode = os.environ.get("SPECDEC_PDL", "1")
    if mode not in ("1", "early") or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return 0
    return PDL_EARLY if mode == "early" else PDL_LATE


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
    USE_PDL: tl.constexpr,  # programmatic dependent launch: 0, PDL_LATE or PDL_EARLY (see pdl_mode)
    ONE_LOOP: tl.constexpr,  # one loop over all tiles, or unmasked then masked tiles (see _default_one_loop)
    L2D: tl.constexpr,  # running softmax sums kept per element, reduced after the loop (see _default_l2d)
    PREWAIT: tl.constexpr,  # USE_PDL: lengths read and prefix tiles prefetched before the wait (see PREWAIT)
):
    if USE_PDL == 2:  # PDL_EARLY
        tlc.gdc_launch_dependents()
    if USE_PDL and not PREWAIT:
        tlc.gdc_wait()
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
    # partials (H200, same run, results/kernels/ab_split_ranges_11a6ed8.txt: decode 9q/3kv B=8
    # prefix 4096 13.79 vs 14.48 us, 32q/8kv B=1 prefix 512 7.55 vs 7.85 us).
    n_busy = tl.maximum(tl.minimum(num_splits, n_tiles // min_busy_tiles), 1)
    per_split = tl.cdiv(n_tiles, n_busy)
    tile_lo = i_sp * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    n_full = full_hi // BLOCK_N
    i_cnt = i_t * tl.num_programs(1) + i_bh  # this group's arrival counter (FUSED_MERGE)
    p_pt = page_table + i_b.to(tl.int64) * stride_ptb
    if USE_PDL and PREWAIT:  # up to here only what the predecessor does not write was read
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
    if USE_PDL == 1:  # PDL_LATE: only the epilogue is left
        tlc.gdc_launch_dependents()

    if L2D:
        l_i = tl.sum(l_i, 1)  # [BLOCK_M]
    # An empty split (or a row that saw nothing in it) has l = 0: write 0 with weight 2^-inf = 0.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    b_o = acc / l_safe[:, None]  # [BLOCK_M, D]
    if SPLIT:
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
    if USE_PDL == 2:  # PDL_EARLY
        tlc.gdc_launch_dependents()
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
    if USE_PDL == 1:  # PDL_LATE
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

_SM_COUNT = {}


def _sm_count(device):
    """Streaming multiprocessors of device (a fixed small number on CPU, where the interpreter runs)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


WGMMA_MIN_CAPACITY_D128 = 4096  # 17-32 rows take the wgmma tile at d128 from this page-table capacity


def _launch_config(max_q_len, G, D, dtype=torch.bfloat16, kv_capacity=None):
    """Tile sizes and launch options from static info only (ptxas figures for sm_90, bf16).

    17-32 rows (short chains and trees: e.g. T = 6-10 at G = 3) take the one-warpgroup wgmma tile of
    BLOCK_M = 64 (padded) with 16-bit inputs at d <= 64, and at d128 from a page-table capacity
    (kv_capacity, slots) of WGMMA_MIN_CAPACITY_D128; otherwise the mma.sync tile of 32 rows. Same-run
    A/B, H200, bf16 (results/kernels/ab_wgmma_short_trees_d0845d2.txt), T=8, 32 vs 64 rows: 9q/3kv
    d64 1.00-1.06x at B=1, B=8 prefix 4096 / 16384 22.96 -> 18.95 / 53.11 -> 38.84 us, B=64 prefix
    512 / 4096 / 16384 27.4 -> 16.5 / 96.6 -> 59.4 / 330 -> 206 us, T=6 B=64 prefix 1024 36.8 ->
    23.9 us; 32q/8kv d128 prefix 4096-16384 1.02-1.44x, but prefix 512 B=1 9.41 -> 12.00 us and B=8
    16.85 -> 17.51 us (kept on mma.sync below that capacity).

    BLOCK_M packs BLOCK_T queries x G heads: decode (max_q_len * G <= 16) 16 rows, tree verify and
    short chunks 32-64 rows, prefill 128 rows (e.g. 42 queries x 3 heads).
    - BLOCK_M <= 32 (mma.sync path, bandwidth-bound): 5 stages give two K/V buffers in flight
      (~37 KB smem, ~95 regs at d64 / N=64; d128 takes N=32 for the same footprint). 4 warps:
      H200 at c3ae0bd (results/kernels/exp_decode_warps_c3ae0bd.txt), decode 9q/3kv B=8 prefix
      16384 31.4 us vs 32.5 (2 warps), 51.3 (1 warp), 46.4 (8 warps), 34.6 (N=128); 32q/8kv B=1
      prefix 512 8.7 us vs 11.6 / 16.0 / 9.2; 2 warps with N halved was within 0.5 us at B=1 and
      up to 14% slower elsewhere.
    - BLOCK_M = 64 (one wgmma warpgroup): N=64; N=128 needs 255 regs at d64 (2 programs/SM -> 1).
    - BLOCK_M = 128 (prefill): 8 warps, N=64; 4 warps spill at d64.
    fp32 inputs (tests, debugging) run an ieee FMA dot, which needs registers for both operands:
    8 warps, 2 stages, BLOCK_M <= 64 x BLOCK_N = 32 at d64 and 32 x 16 at d128 (no spills; the bf16
    tiles would spill kilobytes).
    """
    rows = max_q_len * G
    max_m = 128 if dtype != torch.float32 else (64 if D <= 64 else 32)
    block_m = min(max_m, max(16, triton.next_power_of_2(rows)))
    block_m = max(block_m, triton.next_power_of_2(G))
    if (block_m == 32 and dtype != torch.float32
            and (D <= 64 or (kv_capacity is not None and kv_capacity >= WGMMA_MIN_CAPACITY_D128))):
        block_m = 64  # the wgmma tile, see above
    block_t = block_m // G
    if block_m <= 32:
        cfg = dict(BLOCK_N=64 if D <= 64 else 32, num_warps=4, num_stages=5)
    elif block_m == 64:
        # 5 stages, measured on H200 (bf16, B=64, prefix 1024, T=16): 30.9 us vs 49.3 us with 3
        # stages and 2 splits (9q/3kv d64); 96 us vs 105 us at 32q/8kv d128. Rotating timing at
        # 9aa95c6, same run (9q/3kv): 5 stages 23.6 us; 6-10 stages 23.6-25.2; 3 / 4 stages 31.9;
        # BLOCK_N 32 (7-11 stages) 25.3-26.0, 128 (4-6 stages) 25.7-28.6; 8 warps 32.9; the softmax
        # scale folded into the exp2 FMA 23.55 vs 23.42 us.
        cfg = dict(BLOCK_N=64, num_warps=4, num_stages=5)
    else:
        cfg = dict(BLOCK_N=64, num_warps=8, num_stages=3 if D <= 128 else 2)
    if dtype == torch.float32:
        cfg.update(BLOCK_N=32 if D <= 64 else 16, num_warps=8, num_stages=2)
    return dict(BLOCK_M=block_m, BLOCK_T=block_t, **cfg)


def _default_num_splits(B, HKV, D, n_qblocks, kv_capacity, cfg, device):
    """Split-KV factor from static shapes: enough programs to fill every SM with as many as can be
    resident at once (by registers, see _launch_config: ~4 at BLOCK_M <= 32, 3 or 2 at 64, 1 at 128),
    keeping >= MIN_SPLIT_TILES KV tiles of capacity per split.

    Capture-safe means the split count cannot see kv_lens, only the capacity MP * PS (the page-table
    width). Work is still spread by the real length (each split takes ceil(n_tiles / num_splits) of
    the request's tiles, see the kernel), so a short request in a wide table keeps only its first
    few splits busy; the others return after writing an empty partial. The trade-off of the
    per-split minimum, decode at B = 1, 3 KV heads, capacity 8192 slots (128 tiles of 64):
    - a full-length request runs 3 * 32 programs of 4 tiles; a minimum of 2 gives 3 * 64 programs
      of 2 tiles (more SMs streaming KV: possibly faster at long contexts), 8 gives 3 * 16 of 8;
    - a short request (kv_len 100: 2 tiles) keeps 2 splits busy whatever the minimum, plus 3 * 30
      empty programs (3 * 62 with a minimum of 2), and the merge reads 32 partials per row, not 64.
    Neither removes the merge launch: that needs num_splits = 1, i.e. a capacity <= one split's
    minimum (an engine that captures graphs per context-length bucket could pass num_splits itself).
    experiments/kernels/bench_decode_layer.py times the split counts side by side.
    """
    base = max(1, B * HKV * n_qblocks)
    block_m = cfg["BLOCK_M"]
    # Tree tiles (BLOCK_M = 64) split here only to reach one program per SM (at B=64, T=16 a second
    # split with the merge kernel cost 60%); long prefixes split further under _occupancy_splits.
    per_sm = 4 if block_m <= 32 else 1
    splits = max(1, (per_sm * _sm_count(device)) // base)
    splits = min(splits, max(1, kv_capacity // (MIN_SPLIT_TILES * cfg["BLOCK_N"])), MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)  # a power of two: few distinct merge-kernel compiles


TREE_MIN_SPLIT_TILES = 16  # the tree-tile occupancy plan keeps >= 16 tiles per split (capacity and run time)
TREE_PROGRAMS_PER_SM = {64: 3, 128: 2}  # by head dim, see _occupancy_splits
TREE_MAXNREG = 168  # register cap of the d64 tree tile when split (its unsplit count on sm_90)


def _occupancy_splits(B, HKV, D, n_qblocks, kv_capacity, cfg, device, dtype):
    """Split count of the tree-tile occupancy plan (BLOCK_M = 64, 16-bit inputs, D <= 128), or 1.

    One tree program walks its tiles as a dependent chain (QK wgmma, wait, softmax, PV wgmma): at
    the tree headline (9q/3kv d64, B=64, prefix 1024, T=16) it takes 21.2 us with every K/V read
    hitting L2 (the page table folded onto 8 pages) vs 23.0 us from DRAM, so a program is bound by
    its chain, not by bandwidth, and more programs per SM is what lifts throughput. The plan splits
    the KV range until about TREE_PROGRAMS_PER_SM programs per SM exist (3 at d64: 168 registers
    and 58 KB of shared memory each with the cap below; 2 at d128, measured), each split keeping
    >= TREE_MIN_SPLIT_TILES tiles of page-table capacity, and (in paged_attention) launches them
    with the fused merge folding one partial per step and, at d64, a 168-register cap (split-KV
    otherwise takes 203-244 registers: 2 programs per SM). At run time a split also gets >= 16 of
    its request's tiles (min_busy_tiles), so a short request in a wide table runs fewer, longer
    splits. It only applies where it gives more splits than _default_num_splits (which fills the
    SMs once).
    H200, bf16, T=16, same run, rotating timing (experiments/kernels/exp_tree_splits.py; us,
    default before -> this plan): 9q/3kv B=16 prefix 4096 33.9 -> 28.9 (4 splits), 16384 102.6 ->
    79.1; B=32 4096 52.5 -> 37.8, 16384 189.3 -> 108.4 (88.5% of copy); B=64 4096 70.7 -> 61.2
    (2 splits), 16384 256.1 -> 202.9; 32q/8kv B=8 16384 150.9 -> 139.7; B=16 4096 90.7 -> 79.8,
    16384 322.9 -> 257.5. Shapes it leaves alone were slower split: B=64 prefix 1024 23.6 us vs
    25.1 (2 splits), B=128 1024 33.8 vs 47.4. Held out of that first sweep and checked at 048c1ed
    (results/kernels/exp_tree_splits_048c1ed.txt): 9q/3kv B=16 prefix 16384, 8 splits, 63.6 vs
    102.6 us. Also measured at the tree headline and dropped: issuing tile j+1's QK^T before tile
    j's softmax (branch exp/overlap-qk): Triton waits for that wgmma at once, since its result
    feeds non-dot ops, so nothing overlaps and the extra masking costs (31.0 vs 23.6 us); smaller
    query blocks of mma.sync tiles (exp_tree_qblocks.py): 36.7-37.9 us.
    """
    per_sm = TREE_PROGRAMS_PER_SM.get(D)
    if cfg["BLOCK_M"] != 64 or dtype == torch.float32 or per_sm is None:
        return 1
    splits = max(1, (per_sm * _sm_count(device)) // max(1, B * HKV * n_qblocks))
    splits = min(splits, max(1, kv_capacity // (TREE_MIN_SPLIT_TILES * cfg["BLOCK_N"])), MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)


def default_split_count(B, HKV, D, n_qblocks, kv_capacity, cfg, device, dtype):
    """(num_splits, plan) that paged_attention launches with num_splits=None: the larger of
    _default_num_splits and _occupancy_splits; plan is True when the occupancy plan's count wins
    (and with it its launch options)."""
    fill = _default_num_splits(B, HKV, D, n_qblocks, kv_capacity, cfg, device)
    occupancy = _occupancy_splits(B, HKV, D, n_qblocks, kv_capacity, cfg, device, dtype)
    return (occupancy, True) if occupancy > fill else (fill, False)


def _merge_rows(cfg, max_q_len, G):
    """Rows of the fused merge's tile: pow2 >= the rows a query block can use (<= BLOCK_M)."""
    return triton.next_power_of_2(min(cfg["BLOCK_T"], max_q_len) * G)


ONE_LOOP_MAX_TILES = 8  # default one loop for BLOCK_M >= 64 up to this many tiles of capacity per split


def _default_l2d(cfg):
    """Whether the running softmax sums are kept per element ([BLOCK_M, BLOCK_N], one FMA per score)
    and reduced once after the loop (L2D), instead of a row sum per tile: at BLOCK_M <= 32.

    The mma.sync tiles (decode, short chains and trees) spread a score tile's columns over the 4
    warps, so each row sum is a cross-warp reduction through shared memory, with a barrier, on every
    tile's dependent chain; the per-element sums take 8-16 more registers there. On the wgmma tiles
    (BLOCK_M = 64: one warpgroup, each row within one warp) they take 32 more (168 -> 224 at d64, 3
    -> 2 programs per SM) and the row sum is not on the critical path. Same-run A/B, H200, bf16,
    rotating timing (experiments/results/kernels/exp_attention_l2d_c3ae0bd.txt), row sums vs L2D:
    - BLOCK_M <= 32: decode 9q/3kv B=8 prefix 4096 14.17 / 14.13 vs 13.61 / 13.61 us, prefix 16384
      32.6 vs 31.5, B=64 prefix 4096 59.5 vs 57.1; 32q/8kv B=1 prefix 512 9.18 vs 8.70, B=8 prefix
      4096 39.9 vs 39.5; a T=8 chain at B=1 prefix 1024 10.3 vs 9.5.
    - BLOCK_M = 64 (T=16 trees): headline 23.8 / 23.9 vs 23.9 / 24.0 us (no change), 32q/8kv
      B=64 prefix 1024 85.8 vs 85.4; B=128 prefix 1024 34.0 vs 46.5 (the occupancy loss), 9q/3kv B=64
      prefix 4096 61.3 vs 63.6."""
    return cfg["BLOCK_M"] <= 32


def _default_one_loop(cfg, kv_capacity, num_splits):
    """Whether the kernel walks its tiles in one loop (ONE_LOOP) by default: at BLOCK_M <= 32
    (decode, short chains and trees: mma.sync tiles), and at larger tiles when a split holds at
    most ONE_LOOP_MAX_TILES tiles of page-table capacity (static shapes only, like the split count).

    One loop streams every tile, the masked ones included, through one software pipeline and
    branches per tile on whether it needs the mask; two loops (unmasked tiles, then masked) restart
    the pipeline for the masked tiles: two more dependent memory round trips (page table, then K/V)
    at the end of each program, which short programs feel most. On the wgmma tiles (BLOCK_M >= 64)
    the branch inside a long loop costs more than those round trips. Same-run A/B, H200, bf16,
    eb3d046 (rotating timing; experiments/results/kernels/ab_attention_loops_eb3d046.txt), two-loop
    time / one-loop time:
    - BLOCK_M <= 32: 1.006-1.364 at 35 of 36 shapes (e.g. 32q/8kv T=8 B=64 prefix 4096 481 vs
      376 us; decode B=1 prefix 512 10.1 vs 9.2 us), 0.997 at the other.
    - BLOCK_M >= 64, <= 5 tiles per split: 1.005-1.078 at 9 of 10 shapes, 0.991 at the other.
    - 9 tiles: 0.960-1.076, 4 of 7 shapes for one loop; 17-257 tiles: 0.824-0.997 at 16 of 17
      shapes (9q/3kv T=16 prefix 16384 B=8: 55.0 vs 65.0 us), 1.003 at the other. The tree headline
      (9q/3kv T=16 B=64 prefix 1024, 17 tiles) in another run: 23.6 vs 25.8 us.
    Graphed steps, random weights, same run: Llama-3.1-8B batch 1 4.349 vs 4.386 ms with one loop
    everywhere; SmolLM2 plain 0.580 vs 0.600 ms, chain5 / tree16 / tree48 1.116 / 1.258 /
    1.388 vs 1.140 / 1.271 / 1.432 ms. Also measured and dropped: applying the tree mask to every
    tile instead of branching (T=16 B=64 prefix 1024: 35.5 us), and loading the first masked tile
    before the unmasked loop (23.8 us: its registers go to shared memory before the loop, so the
    loads are waited for there)."""
    if cfg["BLOCK_M"] <= 32:
        return True
    return triton.cdiv(triton.cdiv(kv_capacity, cfg["BLOCK_N"]), num_splits) <= ONE_LOOP_MAX_TILES


def _default_fused_merge(cfg, max_q_len, G, D):
    """Whether split-KV merges in the attention kernel by default (SPECDEC_FUSED_MERGE, else the
    FUSED_MERGE_MAX_TILE rule)."""
    if FUSED_MERGE is not None:
        return FUSED_MERGE
    return _merge_rows(cfg, max_q_len, G) * D <= FUSED_MERGE_MAX_TILE


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
            e.g. decode), see FUSED_MERGE_MAX_TILE (SPECDEC_FUSED_MERGE overrides the default).
        one_loop: True: each program walks its KV tiles in one loop, masking a tile at run time
            when it needs it; False: the unmasked tiles, then the masked ones; None: the measured
            default, see _default_one_loop. Both compute the same values.
        maxnreg: launch tuning (None: ptxas decides, or 168 under the tree occupancy plan): a
            register cap per thread for the attention kernel. Split-KV raises the tree tile's
            count (BLOCK_M = 64, d64, sm_90: 168 registers without splits, 203 with the merge
            kernel, 230-244 with the fused merge), which drops it from 3 to 2 programs per SM; a
            cap of 168 fits them with <= 24 bytes of spills. See _occupancy_splits for when it pays.
        merge_chunk: launch tuning: partials the fused merge folds per step (default as many as fit
            8192 fp32 values, at most num_splits; 1 under the tree occupancy plan).
        l2d: True: each program keeps its running softmax sums per element of the score tile and
            reduces them once after its loop; False: a row sum per tile; None: the measured default,
            see _default_l2d. Both compute the same values up to summation order.
        When num_splits is None and the tree occupancy plan applies (_occupancy_splits), the
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
    cfg = _launch_config(max_q_len, G, D, q.dtype, MP * PS)
    n_qblocks = triton.cdiv(max_q_len, cfg["BLOCK_T"])
    min_busy_tiles = 1
    if num_splits is None:
        num_splits, plan = default_split_count(B, HKV, D, n_qblocks, MP * PS, cfg, q.device, q.dtype)
        if plan:  # the tree-tile occupancy plan (see _occupancy_splits)
            min_busy_tiles = TREE_MIN_SPLIT_TILES
            fused_merge = True if fused_merge is None and FUSED_MERGE is None else fused_merge
            merge_chunk = 1 if merge_chunk is None else merge_chunk
            if maxnreg is None and D <= 64:
                maxnreg = TREE_MAXNREG
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"paged_attention: num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if merge_chunk is not None and (not isinstance(merge_chunk, int) or merge_chunk < 1
                                    or merge_chunk & (merge_chunk - 1)):
        raise ValueError(f"paged_attention: merge_chunk must be a power of two >= 1, got {merge_chunk!r}")

    o = torch.empty((N, HQ, D), dtype=q.dtype, device=q.device)
    if N == 0 or B == 0:
        return o
    split = num_splits > 1
    if split:
        o_part = torch.empty((N, HQ, num_splits, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((N, HQ, num_splits), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = o  # unused placeholders
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    tm = tree_mask if tree_mask is not None else kv_lens  # placeholder pointer when causal
    grid = (n_qblocks, B * HKV, num_splits)
    merge_rows = _merge_rows(cfg, max_q_len, G)
    if fused_merge is None:
        fused_merge = _default_fused_merge(cfg, max_q_len, G, D)
    fused = split and fused_merge
    pdl = pdl_mode(q.device)
    if one_loop is None:
        one_loop = _default_one_loop(cfg, MP * PS, num_splits)
    counters = arrival_counters(q.device, n_qblocks * B * HKV) if fused else kv_lens  # placeholder
    block_s = triton.next_power_of_2(num_splits)
    _paged_attention_fwd_kernel[grid](
        q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, tm, o, o_part, lse_part, counters,
        scale * 1.4426950408889634, num_splits, min_busy_tiles, tree_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *(SAME_KV_STRIDES if v_cache.stride() == k_cache.stride()
          else (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))),
        page_table.stride(0), o.stride(0), o.stride(1),
        HKV=HKV, G=G, D=D, PS=PS,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"],
        SPLIT=split, FUSED_MERGE=fused, BLOCK_S=block_s,
        S_CHUNK=merge_chunk or min(block_s, max(1, 8192 // (merge_rows * D))),  # <= 8192 fp32 values per step
        MERGE_ROWS=merge_rows,
        IS_TREE=tree_mask is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, **({"launch_pdl": True} if pdl else {}), ONE_LOOP=one_loop,
        L2D=_default_l2d(cfg) if l2d is None else bool(l2d), PREWAIT=PREWAIT and bool(pdl),
        **({"maxnreg": maxnreg} if maxnreg else {}),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split and not fused:
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
