"""Fused mixture-of-experts layer (Qwen3-MoE / Mixtral SwiGLU experts) for decode, verify and prefill.

Math, for T tokens x [T, H] in dtype ``dt``, E experts, K = top_k, router_w [E, H],
w13 [E, 2F, H] (expert e's gate rows 0..F-1, then its up rows F..2F-1), w2 [E, H, F]:

    logits   = fp32(x) @ fp32(router_w)^T                              [T, E] fp32 (never rounded to dt)
    p        = softmax(logits, -1)                                     fp32
    w, ids   = top-K of p per token (ties: the lower expert id)        [T, K] fp32, int32
    w        = w / sum_j w[:, j]            when renormalize           (Qwen3-MoE norm_topk_prob; Mixtral's
                                                                        softmax over the selected is the same)
    for each pair (t, j), e = ids[t, j]:
        g, u     = dt(x[t] @ gate_e^T), dt(x[t] @ up_e^T)              [F] fp32 accumulation, rounded as the
                                                                        model's unfused linears round them
        a        = dt(silu(g) * u)                                     [F] (activation.py, one rounding)
        y[t, j]  = w[t, j] * (a @ w2_e^T)                              [H] fp32, not rounded
    out[t]   = dt(y[t, 0] + y[t, 1] + ... + y[t, K-1])                 [T, H] summed in slot order, rounded once

In fp32 every rounding vanishes and this is the textbook layer; in bf16 it is what a loop over experts
with fp32 accumulation gives (``fused_moe_ref``), up to GEMM summation order.

Named dims: T tokens, H hidden, F expert intermediate, E experts, K = top_k slots per token,
P = T * K (token, slot) pairs, pair id p = t * K + j (so w.view(-1)[p], ids.view(-1)[p]).

Launches (all shapes fixed by T, E, K, H, F; no host sync, no data-dependent shape, so a CUDA graph
captures the layer per token bucket and replays it with any routing). Decode and verify (one routing
block of T <= FUSED_ROUTE_ROWS, not in exact mode; kernel option ``fused_moe``) take three:

    _moe_route_fused_kernel  (fused_moe_norm: RMSNorm(x + residual) first, writing the experts' input y and
                          s = x + residual) router logits, softmax, top-K, renormalise and the sort below,
                          in one launch: program (e, k) computes the logits of 16 experts over split k of H
                          (SPLIT splits, about FUSED_ROUTE_PROGRAMS programs, so the 0.5 MB router of a
                          128 x 2048 layer streams over many SMs), stores them and counts itself in on an
                          arrival counter; the last program to arrive sums the splits in split order and
                          routes (as _moe_topk_kernel with one block), then resets the counter
    _moe_gate_up_kernel   grouped GEMM + SwiGLU: program (b, n) takes block b of BLOCK_M sorted pairs (all
                          of one expert) and BLOCK_N gate and BLOCK_N up columns; writes a [P, F] in dt
    _moe_down_kernel      grouped GEMM, routing weight applied: y [P, H] fp32 rows by pair id; up to
                          COMBINE_IN_DOWN_PAIRS pairs it also combines: the last program of each column
                          tile to arrive sums its columns of every token's K rows in slot order into out

Prefill, several routing blocks and exact mode take the unfused routing and the combine kernel (the norm
is then the RMSNorm kernel's):

    _moe_router_kernel    logits [T, E] fp32 = x @ router_w^T; grid (token blocks, expert blocks)
    _moe_topk_kernel      per block of BLOCK_R tokens: softmax, top-K, renormalise; w, ids; the block's
                          expert histogram [NB, E] (and expert_hits += it, an integer atomic add); with one
                          block (NB = 1) it also does the sort below in the same program
    _moe_sort_kernel      (NB > 1, or exact mode) counting sort of the P pairs by expert: each block's pairs
                          are placed at offset[e] + (pairs of e in earlier blocks) + (rank in this block),
                          slot-major within a block; deterministic (no atomics), so sorted_pairs [P] and the
                          expert counts [E] are a pure function of ids
    _moe_gate_up_kernel, _moe_down_kernel   as above
    _moe_combine_kernel   out[t] = dt(sum over j in order of y[t * K + j])

Arrival counters (attention.arrival_counters, zeroed once, reset by each last program) order the partial
results as linear.py's split-K does: a barrier, then an acq_rel increment; the last program reads with
.cg loads. The sums are in a fixed order, so results are the same from run to run; the fused routing sums
the router's H splits in another order than _moe_router_kernel (the logits equal up to rounding).

Steered routing (``steer`` = (sel [T, K] int32, margin); specdec/models/routing.py): the router kernel adds
margin to each row's logits of its sel experts before the softmax.

Programmatic dependent launch (kernel option ``pdl``, compute capability >= 9): every launch above waits
for its predecessor's outputs (griddepcontrol.wait) before it reads or writes anything, and lets its
successor launch once its main loop is done (at its start for the short sort and combine), so a kernel's
launch and start-up overlap the previous one's tail; a chain of such waits orders every kernel after all
earlier ones, as the stream does without PDL.

Expert blocks. Each GEMM program finds its expert from the expert counts alone (cumulative
cdiv(count_e, BLOCK_M) over experts, 128 integers from L2): block b belongs to the first expert whose
cumulative block count exceeds b; rows past that expert's count are masked; blocks past the last expert
exit at once. The grid is the worst case, max_blocks = min(P, P // BLOCK_M + min(E, P)) (sum over the
non-empty experts of cdiv(c_e, BLOCK_M) <= P / BLOCK_M + their number, and each block holds >= 1 pair),
so it depends on shapes only. Every program of one (expert block, N tile) streams its columns of that
expert's weights once for all of the block's pairs: at decode (T <= BLOCK_M pairs per expert, as a token
picks an expert at most once) each expert the step touches is read exactly once; 1 token with top-8 reads
8 experts. The sorted pair list itself needs no padding (blocks index it at offset_e + i * BLOCK_M).

Combine: per-slot fp32 rows y [P, H], then a fixed-order sum, instead of an fp32 atomic add into the
output: the result is bit-identical from run to run (the summation order of atomics is not), one
rounding to dt. It costs one [P, H] fp32 write and read: 3 % of the weight bytes at 256 tokens of a
Qwen3-30B-A3B layer (1.2 GB of experts, all touched), 11 % at 1,024.

Launch plan: ``moe_plan(T, E, K, H, F)`` picks each GEMM's BLOCK_M from the mean pairs per expert
P / E (16 at decode and verify, larger for prefill) and its tiles from a table (``_PLANS``), from
shapes only; ``fused_moe(..., config=)`` overrides it. The table's tiles are first choices (checked to
compile for sm_90 with cp.async pipelining, no spills), not yet measured: experiments/bench_moe.py
--sweep prints the best per token count to set it from.

Exact mode (kernel option ``exact``): a token's output must not depend on how many tokens share the
layer, so the plan takes no T: one GEMM tile set (``EXACT_TILES``, decode's), routing rows per block
and router tiles fixed per (E, H). A pair's GEMM rows then reduce in the same order in any expert block
(an MMA row depends on its own inputs only), the router's logits and each row's softmax / top-k
reductions run on the same layout, and the combine is the fixed slot-order sum it always is.

Invariants: x [T, H] and the weights share one float dtype; last dims contiguous; 1 <= top_k <= E;
expert_hits (optional) int32 [E] on x's device, added to in place. fp32 inputs run ieee dots (exact-path
tests), half precision ones tensor-core dots with fp32 accumulation.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlc

from .attention import arrival_counters
from .attention_launch import pdl_mode

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------


def moe_route_ref(router_logits, top_k: int, renormalize: bool):
    """Softmax over experts (fp32), top-k, optionally renormalised: (w [T, K] fp32, ids [T, K] int32)."""
    p = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    w, ids = p.topk(top_k, dim=-1)  # [T, K] each, largest first
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


def steer_logits_ref(logits, steer=None):
    """Steered routing (``steer`` = (sel [T, K] int32, margin)): logits [T, E] fp32 with margin added to each
    row's selected experts; None: logits unchanged."""
    if steer is None:
        return logits
    sel, margin = steer
    return logits + float(margin) * torch.zeros_like(logits).scatter_(1, sel.long(), 1.0)


def fused_moe_ref(x, router_w, w13, w2, top_k: int, renormalize: bool, steer=None):
    """The layer as a loop over experts (module docstring math) -> [T, H] in x's dtype."""
    T, H = x.shape
    E, F = w13.shape[0], w13.shape[1] // 2
    dt = x.dtype
    w, ids = moe_route_ref(steer_logits_ref(x.float() @ router_w.float().t(), steer), top_k, renormalize)  # [T, K]
    y = torch.zeros((T, top_k, H), dtype=torch.float32, device=x.device)  # per-slot rows
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)  # pairs routed to e
        if tok.numel() == 0:
            continue
        xe = x[tok].float()  # [n, H]
        g = (xe @ w13[e, :F].float().t()).to(dt)  # [n, F]
        u = (xe @ w13[e, F:].float().t()).to(dt)
        a = (torch.nn.functional.silu(g.float()) * u.float()).to(dt)
        y[tok, slot] = w[tok, slot, None] * (a.float() @ w2[e].float().t())  # [n, H]
    out = y[:, 0].clone()
    for j in range(1, top_k):  # slot order, as the combine kernel sums
        out += y[:, j]
    return out.to(dt)


# ----------------------------------------------------------------------------------------------
# Kernels: routing and grouping
# ----------------------------------------------------------------------------------------------


@triton.jit
def _moe_router_kernel(
    x_ptr,  # [T, H]
    rw_ptr,  # [E, H]
    l_ptr,  # [T, E] fp32 out
    sel_ptr,  # [T, SEL_K] int32 experts whose logits are raised by margin (SEL: steered routing)
    margin,
    T, E, H, stride_x, stride_rw,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SEL: tl.constexpr, SEL_K: tl.constexpr,
    DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # x is the previous kernel's output
        tlc.gdc_wait()
    i_t, i_e = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    m_t, m_e = o_t < T, o_e < E
    b_acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(x_ptr + o_t[:, None].to(tl.int64) * stride_x + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
        b_w = tl.load(rw_ptr + o_e[None, :].to(tl.int64) * stride_rw + o_k[:, None],
                      mask=m_e[None, :] & m_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_E]
        b_acc = tl.dot(b_x, b_w, b_acc, input_precision=DOT_PREC)  # [BT, BK] @ [BK, BE] -> [BT, BE]
    if SEL:
        b_acc = _raise_selected(b_acc, sel_ptr, margin, o_t, m_t, o_e, SEL_K)
    if USE_PDL:
        tlc.gdc_launch_dependents()
    tl.store(l_ptr + o_t[:, None].to(tl.int64) * E + o_e[None, :], b_acc, mask=m_t[:, None] & m_e[None, :])


@triton.jit
def _raise_selected(b_l, sel_ptr, margin, o_t, m_t, o_e, SEL_K: tl.constexpr):
    """Steered routing: logits b_l [rows o_t, experts o_e] fp32 plus margin where the expert is one of the
    row's SEL_K selected ones (sel_ptr [T, SEL_K] int32)."""
    for j in range(SEL_K):
        b_id = tl.load(sel_ptr + o_t.to(tl.int64) * SEL_K + j, mask=m_t, other=-1)  # [rows]
        b_l += tl.where(o_e[None, :] == b_id[:, None], margin, 0.0)
    return b_l


@triton.jit
def _scatter_pairs(sorted_ptr, b_ids, o_r, m_r, b_base, TOP_K: tl.constexpr, E_PAD: tl.constexpr,
                   K_PAD: tl.constexpr):
    """Store the pair ids p = t * K + j of this block's rows (ids tile b_ids [BLOCK_R, K_PAD]) at
    sorted_ptr[b_base[e] + rank], rank = the pair's place among this block's pairs of expert e, slot-major
    (all rows' slot 0, then slot 1, ...)."""
    o_e = tl.arange(0, E_PAD)
    o_k = tl.arange(0, K_PAD)
    for j in range(TOP_K):
        b_id = tl.sum(tl.where(o_k[None, :] == j, b_ids, 0), 1)  # [BLOCK_R] expert of slot j
        b_oh = ((o_e[None, :] == b_id[:, None]) & m_r[:, None]).to(tl.int32)  # [BLOCK_R, E_PAD] one-hot
        b_rank = tl.cumsum(b_oh, 0) - 1 + b_base[None, :]  # [BLOCK_R, E_PAD] position if this row picked e
        b_pos = tl.sum(b_oh * b_rank, 1)  # [BLOCK_R]
        tl.store(sorted_ptr + b_pos, o_r * TOP_K + j, mask=m_r)
        b_base += tl.sum(b_oh, 0)


@triton.jit
def _topk_rows(b_l, o_r, m_r, i_b, w_ptr, ids_ptr, cnt_ptr, hits_ptr, sorted_ptr, ecnt_ptr, E,
               TOP_K: tl.constexpr, RENORM: tl.constexpr, HITS: tl.constexpr, SORT: tl.constexpr,
               E_PAD: tl.constexpr, K_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """Softmax, top-K and renormalisation of routing block i_b's logits b_l [BLOCK_R, E_PAD] fp32 (padded
    experts -inf) for rows o_r (valid m_r): stores w, ids, the block's histogram and (HITS) adds it to
    hits; with SORT (the only block) also the expert counts and the pairs sorted by expert."""
    o_e = tl.arange(0, E_PAD)
    o_k = tl.arange(0, K_PAD)
    m_e = o_e < E
    b_p = tl.exp(b_l - tl.max(b_l, 1)[:, None])
    b_p = b_p / tl.sum(b_p, 1)[:, None]  # [BLOCK_R, E_PAD] softmax; padded experts 0
    b_q = tl.where(m_e[None, :], b_p, -1.0)  # candidates; a picked or padded expert never wins again
    b_w = tl.zeros((b_l.shape[0], K_PAD), dtype=tl.float32)
    b_ids = tl.zeros((b_l.shape[0], K_PAD), dtype=tl.int32)
    b_hist = tl.zeros((E_PAD,), dtype=tl.int32)
    for j in range(TOP_K):
        b_m = tl.max(b_q, 1)  # [BLOCK_R]
        b_arg = tl.min(tl.where(b_q == b_m[:, None], o_e[None, :], E_PAD), 1)  # ties: the lower id
        b_w = tl.where(o_k[None, :] == j, b_m[:, None], b_w)
        b_ids = tl.where(o_k[None, :] == j, b_arg[:, None], b_ids)
        b_sel = o_e[None, :] == b_arg[:, None]  # [BLOCK_R, E_PAD]
        b_hist += tl.sum((b_sel & m_r[:, None]).to(tl.int32), 0)
        b_q = tl.where(b_sel, -2.0, b_q)
    if RENORM:
        b_w = b_w / tl.sum(b_w, 1)[:, None]
    if USE_PDL:
        tlc.gdc_launch_dependents()
    m_rk = m_r[:, None] & (o_k[None, :] < TOP_K)
    o_rk = o_r[:, None].to(tl.int64) * TOP_K + o_k[None, :]
    tl.store(w_ptr + o_rk, b_w, mask=m_rk)
    tl.store(ids_ptr + o_rk, b_ids, mask=m_rk)
    tl.store(cnt_ptr + i_b * E + o_e, b_hist, mask=m_e)
    if HITS:
        tl.atomic_add(hits_ptr + o_e, b_hist, mask=m_e & (b_hist > 0))
    if SORT:  # the only block: the expert offsets are the exclusive prefix sum of its histogram
        tl.store(ecnt_ptr + o_e, b_hist, mask=m_e)
        _scatter_pairs(sorted_ptr, b_ids, o_r, m_r, tl.cumsum(b_hist, 0) - b_hist, TOP_K, E_PAD, K_PAD)


@triton.jit
def _moe_topk_kernel(
    l_ptr,  # [T, E] router logits (any float dtype)
    w_ptr,  # [T, K] fp32 out
    ids_ptr,  # [T, K] int32 out
    cnt_ptr,  # [NB, E] int32 out: pairs per expert of each row block
    hits_ptr,  # [E] int32, added to (HITS)
    sorted_ptr,  # [P] int32 out (SORT)
    ecnt_ptr,  # [E] int32 out: pairs per expert (SORT)
    T, E, stride_l,
    TOP_K: tl.constexpr, RENORM: tl.constexpr, HITS: tl.constexpr, SORT: tl.constexpr,
    BLOCK_R: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tlc.gdc_wait()
    i_b = tl.program_id(0)
    o_r = i_b * BLOCK_R + tl.arange(0, BLOCK_R)
    o_e = tl.arange(0, E_PAD)
    m_r, m_e = o_r < T, o_e < E
    b_l = tl.load(l_ptr + o_r[:, None].to(tl.int64) * stride_l + o_e[None, :],
                  mask=m_r[:, None] & m_e[None, :], other=0.0).to(tl.float32)  # [BLOCK_R, E_PAD]
    b_l = tl.where(m_e[None, :], b_l, float("-inf"))
    _topk_rows(b_l, o_r, m_r, i_b, w_ptr, ids_ptr, cnt_ptr, hits_ptr, sorted_ptr, ecnt_ptr, E,
               TOP_K, RENORM, HITS, SORT, E_PAD, K_PAD, USE_PDL)


@triton.jit
def _moe_route_fused_kernel(
    x_ptr,  # [T, H] the rows entering the layer (the attention block's output)
    r_ptr,  # [T, H] residual rows (HAS_RES)
    nw_ptr,  # [H] RMSNorm weight
    y_ptr,  # [T, H] out: RMSNorm(x + r), the experts' input
    s_ptr,  # [T, H] out: x + r (HAS_RES)
    rw_ptr,  # [E, H] router
    l_ptr,  # [SPLIT, T, E] fp32 scratch: each H split's partial logits
    arr_ptr,  # [1] int32 arrival counter, 0 between launches
    w_ptr, ids_ptr, cnt_ptr, hits_ptr, sorted_ptr, ecnt_ptr,  # as _moe_topk_kernel (one routing block)
    sel_ptr,  # [T, K] int32 experts whose logits are raised by margin (SEL: steered routing)
    margin,
    T, E, H, eps, stride_x, stride_r, stride_rw,
    TOP_K: tl.constexpr, RENORM: tl.constexpr, HITS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    SEL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    E_PAD: tl.constexpr, K_PAD: tl.constexpr, DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr,
):
    """RMSNorm (+ residual add; NORM), router GEMM, softmax / top-K and the grouping in one launch, for
    the T <= BLOCK_T rows of a decode or verify step: program (e, k) computes the partial logits of expert
    block e over H split k (each program normalises the rows itself: x is a few KB); the last program to
    arrive sums the SPLIT partials in split order and routes (module docstring, fused routing). Without
    NORM, x is the experts' input (y and s unused)."""
    if USE_PDL:
        tlc.gdc_wait()
    i_e, i_k = tl.program_id(0), tl.program_id(1)
    dt = y_ptr.dtype.element_ty
    o_t = tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    m_e = o_e < E
    o_kk = tl.arange(0, BLOCK_K)
    # Pass 1: each row's sum of squares of s = dt(x + r), over all of H (as the RMSNorm kernel rounds s).
    b_ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if NORM:
        for k0 in range(0, H, BLOCK_K):
            o_k = k0 + o_kk
            m_tk = m_t[:, None] & (o_k < H)[None, :]
            b_s = tl.load(x_ptr + o_t[:, None].to(tl.int64) * stride_x + o_k[None, :], mask=m_tk, other=0.0)
            if HAS_RES:
                b_r = tl.load(r_ptr + o_t[:, None].to(tl.int64) * stride_r + o_k[None, :], mask=m_tk, other=0.0)
                b_s = (b_s.to(tl.float32) + b_r.to(tl.float32)).to(dt)
            b_s = b_s.to(tl.float32)
            b_ss += tl.sum(b_s * b_s, 1)
    b_rstd = 1.0 / tl.sqrt(b_ss / H + eps)  # [BLOCK_T]
    # Pass 2: this program's H split, normalised, times its experts' router rows.
    k_lo = i_k * (H // SPLIT)
    k_hi = H if i_k == SPLIT - 1 else k_lo + H // SPLIT
    writer = (i_e == 0)  # expert block 0 writes y (and s) for its split
    b_acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        o_k = k0 + o_kk
        m_k = o_k < k_hi
        m_tk = m_t[:, None] & m_k[None, :]
        b_y = tl.load(x_ptr + o_t[:, None].to(tl.int64) * stride_x + o_k[None, :], mask=m_tk, other=0.0)
        if NORM:
            if HAS_RES:
                b_r = tl.load(r_ptr + o_t[:, None].to(tl.int64) * stride_r + o_k[None, :], mask=m_tk, other=0.0)
                b_y = (b_y.to(tl.float32) + b_r.to(tl.float32)).to(dt)
                tl.store(s_ptr + o_t[:, None].to(tl.int64) * H + o_k[None, :], b_y, mask=m_tk & writer)
            b_nw = tl.load(nw_ptr + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_y = (b_y.to(tl.float32) * b_rstd[:, None]).to(dt).to(tl.float32)
            b_y = (b_nw[None, :] * b_y).to(dt)  # [BLOCK_T, BLOCK_K], as the RMSNorm kernel rounds it
            tl.store(y_ptr + o_t[:, None].to(tl.int64) * H + o_k[None, :], b_y, mask=m_tk & writer)
        b_w = tl.load(rw_ptr + o_e[None, :].to(tl.int64) * stride_rw + o_k[:, None],
                      mask=m_e[None, :] & m_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_E]
        b_acc = tl.dot(b_y, b_w, b_acc, input_precision=DOT_PREC)
    if USE_PDL:  # the experts' GEMM may launch; it waits for this whole grid
        tlc.gdc_launch_dependents()
    p_l = l_ptr + (i_k * T + o_t[:, None]).to(tl.int64) * E + o_e[None, :]
    tl.store(p_l, b_acc, mask=m_t[:, None] & m_e[None, :])
    # The last of the grid's programs to arrive routes (linear.py's split-K reduction: the barrier orders
    # every thread's stores before the release of the increment, the acquire the last one's loads after).
    tl.debug_barrier()
    n_prog = tl.num_programs(0) * tl.num_programs(1)
    arrived = tl.atomic_add(arr_ptr, 1, sem="acq_rel")
    if arrived == n_prog - 1:
        tl.store(arr_ptr, 0)
        o_ea = tl.arange(0, E_PAD)
        m_ea = o_ea < E
        m_te = m_t[:, None] & m_ea[None, :]
        b_l = tl.zeros((BLOCK_T, E_PAD), dtype=tl.float32)
        for k in range(SPLIT):  # split order: the same sums at every launch
            b_l += tl.load(l_ptr + (k * T + o_t[:, None]).to(tl.int64) * E + o_ea[None, :], mask=m_te, other=0.0,
                           cache_modifier=".cg")
        if SEL:
            b_l = _raise_selected(b_l, sel_ptr, margin, o_t, m_t, o_ea, TOP_K)
        b_l = tl.where(m_ea[None, :], b_l, float("-inf"))
        _topk_rows(b_l, o_t, m_t, 0, w_ptr, ids_ptr, cnt_ptr, hits_ptr, sorted_ptr, ecnt_ptr, E,
                   TOP_K, RENORM, HITS, True, E_PAD, K_PAD, False)


@triton.jit
def _moe_sort_kernel(
    ids_ptr,  # [T, K] int32
    cnt_ptr,  # [NB, E] int32 per-block histograms
    sorted_ptr,  # [P] int32 out
    ecnt_ptr,  # [E] int32 out
    T, E, NB,
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_B: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()  # a short kernel: its successor may launch (and wait) at once
    i_b = tl.program_id(0)
    o_e = tl.arange(0, E_PAD)
    m_e = o_e < E
    b_tot = tl.zeros((E_PAD,), dtype=tl.int32)
    b_before = tl.zeros((E_PAD,), dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)
        b_c = tl.load(cnt_ptr + o_b[:, None] * E + o_e[None, :], mask=(o_b < NB)[:, None] & m_e[None, :],
                      other=0)  # [BLOCK_B, E_PAD]
        b_tot += tl.sum(b_c, 0)
        b_before += tl.sum(tl.where((o_b < i_b)[:, None], b_c, 0), 0)
    if i_b == 0:
        tl.store(ecnt_ptr + o_e, b_tot, mask=m_e)
    o_r = i_b * BLOCK_R + tl.arange(0, BLOCK_R)
    o_k = tl.arange(0, K_PAD)
    m_r = o_r < T
    b_ids = tl.load(ids_ptr + o_r[:, None].to(tl.int64) * TOP_K + o_k[None, :],
                    mask=m_r[:, None] & (o_k[None, :] < TOP_K), other=0)  # [BLOCK_R, K_PAD]
    _scatter_pairs(sorted_ptr, b_ids, o_r, m_r, tl.cumsum(b_tot, 0) - b_tot + b_before, TOP_K, E_PAD, K_PAD)


# ----------------------------------------------------------------------------------------------
# Kernels: grouped GEMMs and the combine
# ----------------------------------------------------------------------------------------------


@triton.jit
def _expert_block(ecnt_ptr, i_b, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first sorted position, valid rows) of expert block i_b; expert >= E past the last block."""
    o_e = tl.arange(0, E_PAD)
    b_c = tl.load(ecnt_ptr + o_e, mask=o_e < E, other=0)  # [E_PAD] pairs per expert
    b_nb = (b_c + BLOCK_M - 1) // BLOCK_M  # blocks per expert
    b_end = tl.cumsum(b_nb, 0)  # blocks through expert e
    i_e = tl.sum((b_end <= i_b).to(tl.int32), 0)  # experts wholly before block i_b
    m_sel = o_e == i_e
    i_blk = i_b - tl.sum(tl.where(m_sel, b_end - b_nb, 0), 0)  # block index within the expert
    pos0 = tl.sum(tl.where(o_e < i_e, b_c, 0), 0) + i_blk * BLOCK_M
    n_rows = tl.sum(tl.where(m_sel, b_c, 0), 0) - i_blk * BLOCK_M
    return i_e, pos0, n_rows


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2F, H]
    a_ptr,  # [P, F] out, rows by pair id
    sorted_ptr,  # [P] int32 pair ids by expert
    ecnt_ptr,  # [E] int32
    E, H, F, stride_x, stride_we, stride_wn, stride_a,
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # the routing (expert counts, pair ids) and x are earlier kernels' outputs
        tlc.gdc_wait()
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    i_e, pos0, n_rows = _expert_block(ecnt_ptr, i_b, E, E_PAD, BLOCK_M)
    if i_e >= E:  # past the last expert block of this routing
        return
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < n_rows
    b_pair = tl.load(sorted_ptr + pos0 + o_m, mask=m_m, other=0)  # [BLOCK_M]; masked rows read token 0
    b_tok = (b_pair // TOP_K).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < F
    o_nl = tl.minimum(o_n, F - 1).to(tl.int64)  # columns past F re-read the last one: no load mask
    o_k = tl.arange(0, BLOCK_K)
    p_x = x_ptr + b_tok[:, None] * stride_x + o_k[None, :]  # [BLOCK_M, BLOCK_K]
    p_g = w_ptr + i_e.to(tl.int64) * stride_we + o_nl[None, :] * stride_wn + o_k[:, None]  # [BLOCK_K, BLOCK_N]
    p_u = p_g + F * stride_wn
    b_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        # Weights first: their addresses need only the expert, so the first tiles are requested before
        # the pair ids (a dependent load) arrive.
        if EVEN_K:
            b_wg = tl.load(p_g)
            b_wu = tl.load(p_u)
            b_x = tl.load(p_x)
        else:
            m_k = o_k < H - k0
            b_wg = tl.load(p_g, mask=m_k[:, None], other=0.0)
            b_wu = tl.load(p_u, mask=m_k[:, None], other=0.0)
            b_x = tl.load(p_x, mask=m_k[None, :], other=0.0)
        b_g = tl.dot(b_x, b_wg, b_g, input_precision=DOT_PREC)  # [BM, BK] @ [BK, BN] -> [BM, BN]
        b_u = tl.dot(b_x, b_wu, b_u, input_precision=DOT_PREC)
        p_x += BLOCK_K
        p_g += BLOCK_K
        p_u += BLOCK_K
    if USE_PDL:
        tlc.gdc_launch_dependents()
    dt = a_ptr.dtype.element_ty
    b_g = b_g.to(dt).to(tl.float32)  # the model's gate and up projections, rounded
    b_u = b_u.to(dt).to(tl.float32)
    b_a = b_g / (1.0 + tl.exp(-b_g)) * b_u  # silu(g) * u, rounded once (activation.py)
    tl.store(a_ptr + b_pair[:, None].to(tl.int64) * stride_a + o_n[None, :], b_a.to(dt),
             mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _moe_down_kernel(
    a_ptr,  # [P, F]
    w_ptr,  # [E, H, F]
    y_ptr,  # [P, H] fp32 out
    rw_ptr,  # [P] fp32 routing weights
    sorted_ptr,  # [P] int32
    ecnt_ptr,  # [E] int32
    o_ptr,  # [T, H] out (COMBINE)
    arr_ptr,  # [H tiles] int32 arrival counters, 0 between launches (COMBINE)
    T, E, H, F, stride_a, stride_we, stride_wn, stride_y,
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, COMBINE: tl.constexpr, BLOCK_T: tl.constexpr,
    DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tlc.gdc_wait()
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    i_e, pos0, n_rows = _expert_block(ecnt_ptr, i_b, E, E_PAD, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    if i_e < E:  # blocks past the last expert block of this routing only arrive (COMBINE)
        o_m = tl.arange(0, BLOCK_M)
        m_m = o_m < n_rows
        b_pair = tl.load(sorted_ptr + pos0 + o_m, mask=m_m, other=0).to(tl.int64)  # [BLOCK_M]
        o_nl = tl.minimum(o_n, H - 1).to(tl.int64)
        o_k = tl.arange(0, BLOCK_K)
        p_a = a_ptr + b_pair[:, None] * stride_a + o_k[None, :]  # [BLOCK_M, BLOCK_K]
        p_w = w_ptr + i_e.to(tl.int64) * stride_we + o_nl[None, :] * stride_wn + o_k[:, None]  # [BLOCK_K, BLOCK_N]
        b_y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            if EVEN_K:  # weights first, as in the gate|up kernel
                b_w = tl.load(p_w)
                b_a = tl.load(p_a)
            else:
                m_k = o_k < F - k0
                b_w = tl.load(p_w, mask=m_k[:, None], other=0.0)
                b_a = tl.load(p_a, mask=m_k[None, :], other=0.0)
            b_y = tl.dot(b_a, b_w, b_y, input_precision=DOT_PREC)  # [BM, BK] @ [BK, BN] -> [BM, BN]
            p_a += BLOCK_K
            p_w += BLOCK_K
        if USE_PDL:
            tlc.gdc_launch_dependents()
        b_rw = tl.load(rw_ptr + b_pair, mask=m_m, other=0.0)  # [BLOCK_M] routing weights
        tl.store(y_ptr + b_pair[:, None] * stride_y + o_n[None, :], b_y * b_rw[:, None],
                 mask=m_m[:, None] & m_n[None, :])
    if COMBINE:
        # The last program of column tile i_n to arrive sums its columns of every token's K rows in slot
        # order (the combine kernel's sum; barrier and acquire / release as in the fused routing).
        tl.debug_barrier()
        arrived = tl.atomic_add(arr_ptr + i_n, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) - 1:
            tl.store(arr_ptr + i_n, 0)
            for t0 in range(0, T, BLOCK_T):
                o_t = t0 + tl.arange(0, BLOCK_T)
                m_tn = (o_t < T)[:, None] & m_n[None, :]
                p_y = y_ptr + (o_t[:, None] * TOP_K).to(tl.int64) * stride_y + o_n[None, :]
                b_o = tl.load(p_y, mask=m_tn, other=0.0, cache_modifier=".cg")  # [BLOCK_T, BLOCK_N] slot 0
                for j in range(1, TOP_K):
                    b_o += tl.load(p_y + j * stride_y, mask=m_tn, other=0.0, cache_modifier=".cg")
                tl.store(o_ptr + o_t[:, None].to(tl.int64) * H + o_n[None, :], b_o.to(o_ptr.dtype.element_ty),
                         mask=m_tn)


@triton.jit
def _moe_combine_kernel(y_ptr, o_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()  # a short kernel: the next layer's first kernel may launch (and wait)
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    p_y = y_ptr + i_t * TOP_K * H + o_h
    b_o = tl.load(p_y, mask=m_h, other=0.0)  # [BLOCK_H] slot 0
    for j in range(1, TOP_K):  # fixed slot order: bit-identical from run to run
        b_o += tl.load(p_y + j * H, mask=m_h, other=0.0)
    tl.store(o_ptr + i_t * H + o_h, b_o.to(o_ptr.dtype.element_ty), mask=m_h)


# ----------------------------------------------------------------------------------------------
# Launch plan and launchers
# ----------------------------------------------------------------------------------------------

# Tiles per range of the mean pairs per expert P / E (T = 1 / 8 / 64 / 256 / 1,024 tokens of a top-8,
# 128-expert layer: 0.06 / 0.5 / 4 / 16 / 64): (upper bound, gate_up tiles, down tiles). Up to 4 pairs
# per expert, decode and verify: BLOCK_M = 16 (one block per expert while it has <= 16 pairs, so each
# touched expert's weights are read once) and narrow column tiles (gate_up: F / 32 = 24 programs per expert
# of F = 768, each streaming 2 x 32 x H weights; at 1 token MIN_PROGRAMS halves them to 16 columns, so the
# 8 experts of one token spread over 384 programs).
_PLANS = (
    (4.0, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
     dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
    (24.0, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
     dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)),
    (float("inf"), dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
     dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
)
_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
# Column tiles narrow (down to 16) until the experts a step can touch, min(E, P), give each GEMM at least
# this many programs (two per SM of a 132-SM H100 / H200): a Mixtral decode step (2 experts, H 4096) would
# otherwise stream its down projection with 128 programs, fewer than the SMs.
MIN_PROGRAMS = 256
# Exact mode: decode's tiles at every token count (no narrowing by the experts a step touches), 16
# routing rows per block (fewer for wide expert counts, from E only) and 16 x 16 router tiles.
EXACT_TILES = _PLANS[0][1:]
EXACT_ROUTE_ROWS = 16
EXACT_ROUTER_ROWS = 16
# Fused routing and combine (module docstring): the rows one fused routing program takes at most, the
# programs its grid aims at, and the pairs up to which the down kernel combines.
FUSED_ROUTE_ROWS = 64
FUSED_ROUTE_PROGRAMS = 64
COMBINE_IN_DOWN_PAIRS = 1024


def moe_plan(T: int, E: int, top_k: int, H: int, F: int, config=None, exact: bool | None = None) -> dict:
    """The launch plan, from shapes only: {"gate_up": tiles, "down": tiles} (keys _TILE_KEYS), the
    routing's rows per block and the router kernel's tiles ({"BLOCK_T", "BLOCK_E", "BLOCK_K"}).
    ``config`` overrides entries ({"gate_up": {"BLOCK_N": 64}, ...}). ``exact`` (None: the kernel option):
    the exact-mode plan, the same for every T (module docstring)."""
    from . import options

    if exact is None:
        exact = options.get().exact
    mean = T * top_k / E
    if exact:
        gate_up, down = (dict(t) for t in EXACT_TILES)
    else:
        gate_up, down = next((dict(g), dict(d)) for bound, g, d in _PLANS if mean <= bound)
    config = config or {}
    unknown = set(config) - {"gate_up", "down"}
    if unknown:
        raise ValueError(f"fused_moe: config keys must be 'gate_up' / 'down', got {sorted(unknown)}")
    plan = {}
    for name, tiles, n_out, k_in in (("gate_up", gate_up, F, H), ("down", down, H, F)):
        over = dict(config.get(name) or {})
        bad = set(over) - set(_TILE_KEYS)
        if bad:
            raise ValueError(f"fused_moe: config[{name!r}] keys must be among {_TILE_KEYS}, got {sorted(bad)}")
        tiles.update(over)
        # tl.dot needs >= 16 along every dim; no tile wider than the (power-of-two padded) dim it covers.
        tiles["BLOCK_N"] = max(16, min(int(tiles["BLOCK_N"]), triton.next_power_of_2(n_out)))
        while not exact and "BLOCK_N" not in over and tiles["BLOCK_N"] > 16 and \
                min(E, T * top_k) * triton.cdiv(n_out, tiles["BLOCK_N"]) < MIN_PROGRAMS:
            tiles["BLOCK_N"] //= 2
        tiles["BLOCK_K"] = max(16, min(int(tiles["BLOCK_K"]), triton.next_power_of_2(k_in)))
        tiles["BLOCK_M"] = max(16, int(tiles["BLOCK_M"]))
        plan[name] = tiles
    e_pad = triton.next_power_of_2(E)
    # Routing rows per block: the whole batch in one block (routing and sort in one program) up to a
    # [64, 128] tile; wider expert counts take fewer rows.
    plan["route_rows"] = min(EXACT_ROUTE_ROWS if exact else triton.next_power_of_2(max(T, 1)), max(1, 8192 // e_pad))
    # Router GEMM tiles: up to 64 token rows and, past 64 tokens, 64 expert columns per program.
    if exact:
        bt, be = EXACT_ROUTER_ROWS, 16
    else:
        bt = min(64, max(16, triton.next_power_of_2(T)))
        be = min(64 if T > 64 else 16, max(16, triton.next_power_of_2(E)))
    plan["router"] = dict(BLOCK_T=bt, BLOCK_E=be, BLOCK_K=min(128, max(16, triton.next_power_of_2(H))))
    # Exact mode: the sort kernel runs even for a single routing block (which the top-k program sorts
    # otherwise) with a fixed tile, so every kernel is one compiled variant at every T.
    plan["exact"] = bool(exact)
    # Fused routing (one routing block of <= FUSED_ROUTE_ROWS rows, not in exact mode): 16 experts per
    # program and H split so that the grid has about FUSED_ROUTE_PROGRAMS programs at one token block
    # (each program normalises all of its rows over H first, so wide blocks split H less).
    fused = not exact and options.get().fused_moe
    plan["fused_route"] = None
    if fused and T <= min(FUSED_ROUTE_ROWS, plan["route_rows"]):
        bt = max(16, triton.next_power_of_2(T))
        bk = min(128, max(16, triton.next_power_of_2(H)))
        n_e = triton.cdiv(E, 16)
        split = max(1, min(FUSED_ROUTE_PROGRAMS // n_e // (bt // 16), H // bk))
        plan["fused_route"] = dict(BLOCK_T=bt, BLOCK_E=16, BLOCK_K=bk, SPLIT=split)
    # The combine in the down kernel (its column tiles' last programs sum the slots) up to
    # COMBINE_IN_DOWN_PAIRS pairs; past it (prefill) the combine kernel.
    plan["combine_in_down"] = fused and T * top_k <= COMBINE_IN_DOWN_PAIRS
    return plan


def _max_blocks(P: int, E: int, block_m: int) -> int:
    """Worst-case expert blocks over all routings of P pairs (module docstring)."""
    return max(1, min(P, P // block_m + min(E, P)))


def _dot_prec(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(x, router_w, w13, w2, top_k, expert_hits, steer=None):
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"fused_moe: x must be [T, H] float32/float16/bfloat16, got {tuple(x.shape)} {x.dtype}")
    T, H = x.shape
    if router_w.dim() != 2 or router_w.shape[1] != H:
        raise ValueError(f"fused_moe: router_w must be [E, H={H}], got {tuple(router_w.shape)}")
    E = router_w.shape[0]
    if w13.dim() != 3 or w13.shape[0] != E or w13.shape[2] != H or w13.shape[1] % 2:
        raise ValueError(f"fused_moe: w13 must be [E={E}, 2F, H={H}] (gate rows, then up rows), got {tuple(w13.shape)}")
    F = w13.shape[1] // 2
    if w2.shape != (E, H, F):
        raise ValueError(f"fused_moe: w2 must be [E, H, F] = [{E}, {H}, {F}], got {tuple(w2.shape)}")
    for name, t in (("router_w", router_w), ("w13", w13), ("w2", w2)):
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"fused_moe: {name} must be {x.dtype} on {x.device} like x, got {t.dtype} on {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"fused_moe: {name}'s last dim must be contiguous")
    if not 1 <= int(top_k) <= E:
        raise ValueError(f"fused_moe: top_k must be in 1..E={E}, got {top_k}")
    if expert_hits is not None and (expert_hits.shape != (E,) or expert_hits.dtype != torch.int32
                                    or expert_hits.device != x.device):
        raise ValueError(f"fused_moe: expert_hits must be int32 [E={E}] on {x.device}, got "
                         f"{expert_hits.dtype} {tuple(expert_hits.shape)} on {expert_hits.device}")
    if steer is not None:
        sel = steer[0]
        if sel.shape != (T, int(top_k)) or sel.dtype != torch.int32 or sel.device != x.device or not sel.is_contiguous():
            raise ValueError(f"fused_moe: steer's selection must be contiguous int32 [T={T}, top_k={top_k}] on "
                             f"{x.device}, got {sel.dtype} {tuple(sel.shape)} on {sel.device}")


def _pdl_launch(pdl: int) -> dict:
    """A MoE kernel launch's PDL arguments for ``pdl`` (pdl_mode): the constexpr and the launch flag."""
    return {"USE_PDL": bool(pdl), **({"launch_pdl": True} if pdl else {})}


def _route(logits, top_k, renormalize, route_rows, expert_hits=None, sort=False, exact=False, pdl=0):
    """Launch the top-k (and, with ``sort``, the grouping: in the top-k program when there is one block,
    except in ``exact`` mode, else the sort kernel): (w, ids, sorted_pairs, expert_counts). ``pdl``:
    pdl_mode of the device (programmatic dependent launch, fused_moe's launches)."""
    launch = _pdl_launch(pdl)
    T, E = logits.shape
    dev = logits.device
    e_pad, k_pad = triton.next_power_of_2(E), triton.next_power_of_2(top_k)
    nb = triton.cdiv(T, route_rows)
    w = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=dev)
    counts = torch.empty((nb, E), dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty((T * top_k,), dtype=torch.int32, device=dev) if sort else ids
    ecnt = torch.empty((E,), dtype=torch.int32, device=dev) if sort else ids
    # Warps by tile size: a decode step's [1, 128] tile in one warp, so the top-k loop's row reductions stay
    # shuffles within the warp (no shared-memory round trip per step); [64, 128] in eight.
    warps = max(1, min(8, route_rows * e_pad // 1024))
    _moe_topk_kernel[(nb,)](
        logits, w, ids, counts, expert_hits if expert_hits is not None else counts, sorted_pairs, ecnt,
        T, E, logits.stride(0),
        TOP_K=top_k, RENORM=bool(renormalize), HITS=expert_hits is not None, SORT=sort and nb == 1 and not exact,
        BLOCK_R=route_rows, E_PAD=e_pad, K_PAD=k_pad, num_warps=warps, **launch,
    )  # fmt: skip
    if sort and (nb > 1 or exact):
        _moe_sort_kernel[(nb,)](
            ids, counts, sorted_pairs, ecnt, T, E, nb,
            TOP_K=top_k, BLOCK_R=route_rows, E_PAD=e_pad, K_PAD=k_pad,
            BLOCK_B=max(1, 4096 // e_pad) if exact else min(triton.next_power_of_2(nb), max(1, 4096 // e_pad)),
            num_warps=warps, **launch,
        )  # fmt: skip
    return w, ids, sorted_pairs, ecnt


def moe_route(router_logits, top_k: int, renormalize: bool):
    """Routing alone, in one launch (moe_route_ref's math): router_logits [T, E] any float dtype (last dim
    contiguous) -> (w [T, K] fp32, ids [T, K] int32)."""
    if router_logits.dim() != 2 or router_logits.dtype not in _FLOAT_DTYPES or router_logits.stride(-1) != 1:
        raise ValueError(f"moe_route: router_logits must be [T, E] float with a contiguous last dim, got "
                         f"{tuple(router_logits.shape)} {router_logits.dtype}")
    T, E = router_logits.shape
    if not 1 <= int(top_k) <= E:
        raise ValueError(f"moe_route: top_k must be in 1..E={E}, got {top_k}")
    if T == 0:
        return (torch.empty((0, top_k), dtype=torch.float32, device=router_logits.device),
                torch.empty((0, top_k), dtype=torch.int32, device=router_logits.device))
    rows = min(triton.next_power_of_2(T), max(1, 8192 // triton.next_power_of_2(E)))
    w, ids, _, _ = _route(router_logits, int(top_k), renormalize, rows)
    return w, ids


def fused_moe(x, router_w, w13, w2, top_k: int, renormalize: bool, *, expert_hits=None, config=None, steer=None):
    """The MoE layer (module docstring) over normed rows x [T, H] -> new [T, H] in x's dtype, no host sync
    (launches: module docstring). ``expert_hits`` (int32 [E]): the number of pairs routed to each expert
    is added to it in place. ``config``: tile overrides for moe_plan (benchmark sweeps). ``steer`` = (sel
    [T, top_k] int32, margin): each row's logits of its sel experts raised by margin before the softmax
    (steered routing, specdec/models/routing.py)."""
    _check(x, router_w, w13, w2, top_k, expert_hits, steer)
    out, _ = _fused_moe(x, None, None, 0.0, router_w, w13, w2, int(top_k), renormalize, expert_hits, config, steer)
    return out


def fused_moe_norm_ref(x, residual, norm_weight, eps, router_w, w13, w2, top_k: int, renormalize: bool, steer=None):
    """RMSNorm(x + residual) (kernels_triton/norm.py's rounding; residual None: RMSNorm(x)), then the layer:
    (out [T, H], s = x + residual [T, H])."""
    from .norm import rms_norm_ref

    if residual is None:
        y, s = rms_norm_ref(x, norm_weight, eps), x
    else:
        y, s = rms_norm_ref(x, norm_weight, eps, residual)
    return fused_moe_ref(y, router_w, w13, w2, top_k, renormalize, steer), s


def fused_moe_norm(x, residual, norm_weight, eps: float, router_w, w13, w2, top_k: int, renormalize: bool, *,
                   expert_hits=None, config=None, steer=None):
    """RMSNorm(x + residual) and the MoE layer over it (fused_moe_norm_ref's math): (out [T, H], s = x +
    residual; x itself when residual is None). Where the routing fits one block (decode and verify) the
    norm, router, top-k and grouping are one launch (module docstring); elsewhere the norm is the RMSNorm
    kernel's. ``steer``: as fused_moe's."""
    _check(x, router_w, w13, w2, top_k, expert_hits, steer)
    if norm_weight is None:
        raise ValueError("fused_moe_norm: norm_weight is required")
    H = x.shape[1]
    for name, t, shape in (("residual", residual, x.shape), ("norm_weight", norm_weight, (H,))):
        if t is not None and (tuple(t.shape) != tuple(shape) or t.dtype != x.dtype or t.device != x.device
                              or t.stride(-1) != 1):
            raise ValueError(f"fused_moe_norm: {name} must be {x.dtype} {tuple(shape)} on {x.device} with a "
                             f"contiguous last dim, got {t.dtype} {tuple(t.shape)} on {t.device}")
    return _fused_moe(x, residual, norm_weight, float(eps), router_w, w13, w2, int(top_k), renormalize,
                      expert_hits, config, steer)


def _fused_moe(x, residual, norm_weight, eps, router_w, w13, w2, K, renormalize, expert_hits, config, steer=None):
    """The launches of fused_moe / fused_moe_norm (norm_weight None: x is normed already) -> (out, s)."""
    T, H = x.shape
    E, F = w13.shape[0], w13.shape[1] // 2
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    s = x if residual is None else torch.empty_like(out)
    if T == 0:
        return out, s
    if x.stride(-1) != 1:
        x = x.contiguous()
    plan = moe_plan(T, E, K, H, F, config)
    P, dev, prec = T * K, x.device, _dot_prec(x.dtype)
    pdl = pdl_mode(dev)  # each kernel waits for its predecessor's outputs, then lets its successor launch
    launch = _pdl_launch(pdl)
    e_pad, k_pad = triton.next_power_of_2(E), triton.next_power_of_2(K)
    sel, margin = steer if steer is not None else (x, 0.0)

    fr = plan["fused_route"]
    if fr is not None:  # norm, router, top-k and grouping: one launch
        y = torch.empty_like(out) if norm_weight is not None else x
        logits = torch.empty((fr["SPLIT"], T, E), dtype=torch.float32, device=dev)
        w = torch.empty((T, K), dtype=torch.float32, device=dev)
        ids = torch.empty((T, K), dtype=torch.int32, device=dev)
        counts = torch.empty((1, E), dtype=torch.int32, device=dev)
        sorted_pairs = torch.empty((P,), dtype=torch.int32, device=dev)
        ecnt = torch.empty((E,), dtype=torch.int32, device=dev)
        arrive = arrival_counters(dev, 1, owner="fused_moe_route")
        r = residual if residual is not None else x
        _moe_route_fused_kernel[(triton.cdiv(E, fr["BLOCK_E"]), fr["SPLIT"])](
            x, r, norm_weight if norm_weight is not None else x, y, s, router_w, logits, arrive,
            w, ids, counts, expert_hits if expert_hits is not None else counts, sorted_pairs, ecnt, sel, float(margin),
            T, E, H, eps, x.stride(0), r.stride(0), router_w.stride(0),
            TOP_K=K, RENORM=bool(renormalize), HITS=expert_hits is not None, NORM=norm_weight is not None,
            HAS_RES=residual is not None, SEL=steer is not None, **fr, E_PAD=e_pad, K_PAD=k_pad, DOT_PREC=prec,
            num_warps=4, **launch,
        )  # fmt: skip
    else:
        if norm_weight is not None:
            from .norm import rms_norm

            if residual is None:
                y = rms_norm(x, norm_weight, eps)
            else:
                y, s = rms_norm(x, norm_weight, eps, residual)
        else:
            y = x
        logits = torch.empty((T, E), dtype=torch.float32, device=dev)
        rt = plan["router"]
        _moe_router_kernel[(triton.cdiv(T, rt["BLOCK_T"]), triton.cdiv(E, rt["BLOCK_E"]))](
            y, router_w, logits, sel, float(margin), T, E, H, y.stride(0), router_w.stride(0), **rt,
            SEL=steer is not None, SEL_K=K if steer is not None else 1, DOT_PREC=prec, num_warps=4, **launch,
        )  # fmt: skip
        w, _, sorted_pairs, ecnt = _route(logits, K, renormalize, plan["route_rows"], expert_hits, sort=True,
                                          exact=plan["exact"], pdl=pdl)

    a = torch.empty((P, F), dtype=x.dtype, device=dev)  # SwiGLU activations, rows by pair id
    tg = dict(plan["gate_up"])
    bm, bn = tg.pop("BLOCK_M"), tg.pop("BLOCK_N")
    _moe_gate_up_kernel[(_max_blocks(P, E, bm), triton.cdiv(F, bn))](
        y, w13, a, sorted_pairs, ecnt, E, H, F, y.stride(0), w13.stride(0), w13.stride(1), a.stride(0),
        TOP_K=K, E_PAD=e_pad, BLOCK_M=bm, BLOCK_N=bn, EVEN_K=H % tg["BLOCK_K"] == 0, DOT_PREC=prec, **tg, **launch,
    )  # fmt: skip

    yp = torch.empty((P, H), dtype=torch.float32, device=dev)  # weighted expert outputs, rows by pair id
    td = dict(plan["down"])
    bm, bn = td.pop("BLOCK_M"), td.pop("BLOCK_N")
    grid_n = triton.cdiv(H, bn)
    combine = plan["combine_in_down"]
    arrive = arrival_counters(dev, grid_n, owner="fused_moe_down") if combine else ecnt
    _moe_down_kernel[(_max_blocks(P, E, bm), grid_n)](
        a, w2, yp, w, sorted_pairs, ecnt, out, arrive, T, E, H, F, a.stride(0), w2.stride(0), w2.stride(1),
        yp.stride(0), TOP_K=K, E_PAD=e_pad, BLOCK_M=bm, BLOCK_N=bn, EVEN_K=F % td["BLOCK_K"] == 0,
        COMBINE=combine, BLOCK_T=min(16, triton.next_power_of_2(T)) if combine else 16, DOT_PREC=prec, **td, **launch,
    )  # fmt: skip
    if not combine:
        bh = min(1024, triton.next_power_of_2(H))
        _moe_combine_kernel[(T, triton.cdiv(H, bh))](yp, out, H, TOP_K=K, BLOCK_H=bh,
                                                      num_warps=max(1, min(4, bh // 256)), **launch)
    return out, s
