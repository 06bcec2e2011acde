"""Small-M linear layers with their neighbours fused: a decode / draft layer in five launches.

At batch 1 every projection of a small model reads its whole weight to produce a handful of rows,
and a SmolLM2-135M layer is bound by launches, not bytes: RMSNorm, a cuBLAS GEMM, RoPE + KV write,
attention, a GEMM, RMSNorm, a GEMM, SwiGLU, a GEMM. These kernels fold the elementwise neighbours
into the GEMM that reads their output, so a layer is

    norm_qkv_rope_write_kv_   RMSNorm(x + residual) @ wqkv^T -> RoPE -> K/V into the paged cache
    paged_attention           (attention.py)
    linear                    o @ wo^T
    norm_swiglu               silu(gate) * up of RMSNorm(x + residual) @ w13^T
    linear                    act @ w2^T

Math, for M rows x [M, K] in dtype ``dt``, weight w [NOUT, K] (nn.Linear layout):

    linear:       out = dt(x @ w^T  [+ add])                 fp32 accumulation, one rounding
    norm prologue (``norm.py`` convention, bit-for-bit):
                  s   = dt(x + residual)   (or x without a residual; s is returned, it is the
                                            residual stream entering the layer)
                  y   = dt(fp32(nw) * fp32(dt(s * rsqrt(mean(s^2) + eps))))
                  out = dt(y @ w^T)
    swiglu epilogue, w = [gate | up] of [2F, K]:
                  g, u = dt(y @ gate^T), dt(y @ up^T);  act = dt(silu(g) * u)   (activation.py)
    rope epilogue, w = [q | k | v] of [(HQ + 2 HKV) D, K]: each head's D outputs rounded to dt,
                  q and k rotated at their token's position (rope.py), q returned [M, HQ, D],
                  rotated k and v stored at ``slot_mapping[m]`` in the caches (slot < 0: skipped).

So every result equals the unfused composition (``*_ref``: rms_norm_ref, matmul, silu_mul_ref,
rope_write_kv_ref_) up to the GEMM's summation order.

Kernel layout: grid (programs along the column blocks, row blocks of BLOCK_M). A program owns BLOCK_N
output columns (two accumulators for swiglu: its gate and up columns; for rope a slice of one head's
two D/2 halves, so the rotation pairs stay in one program) and streams them in BLOCK_K chunks. With
fewer programs than column blocks (``programs``) each loops over blocks i, i + P, ... (a persistent
grid). Three bodies:
- several rows, kernel option small_m = "dot" (the default; BLOCK_M = 16, 32, 64): ``[BLOCK_M,
  BLOCK_K] @ [BLOCK_K, BLOCK_N]`` tl.dots over the whole K; with the norm prologue each program first
  sums the squares of its rows (a pass over x, re-read from L2: M x K is a few KB), then normalises
  each x chunk right before its dot; the program of column block 0 also stores s.
- several rows, small_m = "stream" (the streaming body; BLOCK_M = 16, 32, 64): two launches when a
  norm / residual / second input is involved. ``_stream_prologue_kernel`` (one program per row, and
  one per row for x2) writes s and the ready rows y = [RMSNorm(x + residual) | RMSNorm2(x2)] (gathered
  rows read through the index) with the same roundings; then the GEMM kernel streams only weight and y
  tiles, swap-AB: ``acc[BLOCK_N, BLOCK_M] += w[BLOCK_N, BLOCK_K] @ y^T[BLOCK_K, BLOCK_M]`` (the weight
  is the MMA's large side, tokens the small one; transposed once for the epilogue), num_stages
  pipelined (cp.async) loads and nothing else in the K loop. A plain linear (wo, w2, fc over gathered
  rows) is the GEMM alone, reading x (or its gathered rows) directly. Column blocks: the widest that
  still gives every SM a block, but no narrower than BLOCK_M / accumulators (the y tiles a program
  reads from L2 stay no larger than its weight tiles); with fewer blocks than SMs the K range is split
  over several programs per block (split-K, ``_split_reduce``: fp32 partials, an arrival counter,
  the last split to arrive sums them in split order and runs the block's epilogue, so every epilogue
  works split). small_m = "stream_prefetch" is the same with PDL: the GEMM, launched while its
  predecessor runs, first asks for its first weight columns into L2 (prefetch.global.L2) and only
  then waits (griddepcontrol.wait) for y. small_m = "stream_inline": one launch, no prologue: the
  streaming body's tiles and split-K, each rows^T chunk loaded with its residual and normalised in
  the K loop (``_accumulate_stream_norm``, the tl.dot body's in-loop math; s stored by column block
  0 of each K range). Speed of all three not measured yet (bench_linear.py --small-m).
- one row (GEMV, BLOCK_M = 1; the default at M = 1): fp32 products on CUDA cores into a
  [BLOCK_N, BLOCK_K] accumulator, summed over k once at the end, so BLOCK_N may be 4 or 8 (many
  programs, each streaming a narrow slab of the weight); the next chunk's weight tiles are loaded
  before the current chunk is used (register double buffering), and the first chunk is requested
  before the norm pass, which reads the whole row in one load. The Triton software pipeliner did
  not overlap these loads (num_stages made no difference), so per-iteration memory latency bounded
  each program; the explicit prefetch is what streams the weights.
M is a runtime argument: one compile per BLOCK_M bucket (1, 16, 32, 64), no recompile per batch size.
(experiments/kernels/compile_linear_sm90.py compiles the bodies for sm_90 without a GPU: the streaming
GEMM's loads become cp.async stages, wgmma at BLOCK_N >= 64, mma.sync below.)

Measured on the H200 (bf16, experiments/kernels/bench_linear.py: per call in a graph, consecutive
calls reading different weight copies so nothing is served from L2; results/kernels/
bench_linear_2b50ac4.csv and the bench_linear_sweep_gemv_* sweeps): at M = 1 the GEMV body takes
SmolLM2 qkv 3.2 us (norm + cuBLAS + RoPE: 6.6), wo 2.0 (3.1), mlp_in 3.3 (5.9), w2 2.5 (4.7), and
Llama-3.1-8B qkv 17.7 (20.3), wo 10.5 (13.0), mlp_in 63.7 (63.4), w2 30.3 (31.9): 67-92% of copy
bandwidth at 8B sizes. The tl.dot body at M = 1 took 6.3-6.6 us (SmolLM2 qkv) and 45 us (8B qkv).
At M >= 17 cuBLAS is faster (e.g. SmolLM2 qkv 8.7 vs 6.2 us), so ``specdec.models.ops`` routes only up
to ``ops.FUSED_MAX_ROWS`` rows here. LM heads (more than GEMV_MAX_COLUMNS outputs) stay on cuBLAS or
the tl.dot body. A variant that folded the norm into the main loop (row scale on the accumulator, no
prologue pass) measured slower (qkv 10.6 us, mlp_in 11.5 us at M = 1, tl.dot body). So did a GEMV whose
program streams its blocks as one sequence (the last chunk of a block requesting the next block's
first, the norm pass once per program; b6534db, and a variant loading that chunk unconditionally
from selected addresses): H200, same run against this body, 8B qkv 18.0 vs 16.8 us, mlp_in 63.6 vs
62.7, SmolLM2 w2 2.8 vs 1.9; 8B step 4.47 vs 4.36 ms.

Gathered rows (``rows=(index, group)``, linear and the qkv kernel): row m = g * W + j of the input is
row ``g * group + max(index[g, j], 0)`` of x, for an int index [G, W] (M = G * W; rows of index may be
strided): the layer reads its rows straight from a table, so a gather (and the clamp of a -1 index)
costs no launch of its own. EAGLE-3 uses it for the draft's token embeddings (index = token ids,
group 0, x = the embedding table) and for the fc over the accepted path's captured features in the
draft extend (index = accepted node ids [B, Te], group = T, x = the [B * T, 3H] features). Math:
``gather_rows_ref`` then the layer's reference; no residual with gathered rows (s is not returned).

Norm statistics from the producer (``linear_residual``, kernel option norm_stats): the projection that
closes a residual block (wo, w2) adds the residual in its epilogue, s = dt(dt(x @ w^T) + residual) (the
rounding the next norm's residual add makes), and each column block (after its split-K reduction)
writes the sums of s^2 of its rows over its columns, fp32 [blocks, M]. The next norm_* launch takes
them (``sumsq=``, residual None) and the streaming body sums the partials (fixed order) into 1 / rms
per row, with neither a prologue launch nor a pass over the rows, in one of two ways:
- with the norm weight (kernel option norm_stats="loop"): each row chunk normalised in the K loop as
  stream_inline does; math: the norm prologue's, the squares summed in another order;
- with norm_weight None and the weight's input columns already scaled by it (``fold_norm`` in
  specdec.models.ops; norm_stats="fold", the default): the plain streaming K loop, then the products of
  each row scaled by its 1 / rms before the epilogue; math: rstd(s) * (s @ (w * nw)^T), so the
  normalised rows are never rounded on their own and the folded weight is rounded once.
A layer of several streamed rows is then two launches shorter; only the first layer's qkv, whose input
is the embedding, keeps a prologue. H200 graphed tree16 step: 0.973 ms fold, 1.096 loop, 1.043 with
the prologue (the loop's normalisation between load and dot costs more than the launch it saves;
docs/kernel_notes.md "Norm statistics from the producer").

Routing (``specdec.models.ops``): with small_m = "dot", up to FUSED_MAX_ROWS rows and
FUSED_MAX_WEIGHT_BYTES of weight here (one row: any projection, GEMV); with a streaming body
("stream", "stream_prefetch", "stream_inline"), up to STREAM_MAX_ROWS = 64 rows (tree verify,
EAGLE-3 draft rounds) and any projection (LM heads keep the weight limit).

Invariants: M <= MAX_M (larger M goes to cuBLAS through ``specdec.models.ops``); last dims contiguous;
x, residual, weights share one float dtype; fp32 inputs run ieee dots (exact-path tests), half
precision ones tensor-core dots with fp32 accumulation.
"""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlc

from . import options
from .activation import silu_mul_ref
from .attention import arrival_counters
from .attention_launch import pdl_mode, sm_count
from .norm import rms_norm_ref
from .rope import rope_write_kv_ref_

MAX_M = 64
# One-row projections up to this many output columns take the GEMV body; wider ones (LM heads) keep the
# tl.dot body, which streams them faster (H200: SmolLM2 lm_head 15.8 vs 21.1 us).
GEMV_MAX_COLUMNS = 16384
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# With PDL, the qkv kernel (RoPE epilogue) lets its successor, the attention, launch at its start
# instead of after its weight stream when its weights are at most QKV_EARLY_MAX_BYTES (always / never
# with the kernel option pdl_qkv_early true / false): the attention programs then read their lengths
# and prefetch their prefix (kernel option attn_prewait) while a short qkv kernel runs. A long one is
# slowed by them: H200, graphed batch-1 plain steps (results/profile/ab_prewait_qkv_early.txt),
# SmolLM2 (1.1 MB of qkv weights per layer) 0.5736 vs 0.5779 ms, Llama-3.1-8B shapes (50 MB) 4.396
# vs 4.306 ms.
QKV_EARLY_MAX_BYTES = 8 << 20
# The streaming body splits K (split-K) only for loops of at least this many BLOCK_K chunks (kernel
# option split_min_chunks overrides it). H200, SmolLM2 projections at 17 rows (bench_linear.py
# --small-m-sweep, de55f7a; results/kernels/bench_linear_small_m_sweep_smollm2_17_21_de55f7a.csv):
# over K = 576 (5 chunks of 128) two splits cost more than they spread (qkv 6.47 -> 5.39 us whole,
# mlp_in 6.17 -> 5.21), over K = 1536 (12 chunks) six splits win (w2 3.68 us, 5.29 whole).
SPLIT_MIN_CHUNKS = 8
# The streaming body's column block for plain projections (linear, linear_residual: wo, w2, the draft's fc
# and down projection; kernel option stream_block_n overrides it). H200, graphed batch-1 steps, effdfcc
# (results/profile/ab_stream_block_n_effdfcc.json): tree16 0.906 ms at 64 against 0.927 with the rule of
# _stream_block_n (16 / 32 columns for SmolLM2's 576: 36 / 18 programs), 0.929 at 16, 1.083 at 128; wo at
# 17 rows 2.87 vs 3.46 us alone (kernels/bench_linear_small_m_grid_smollm2_17_effdfcc.csv).
STREAM_PLAIN_BLOCK_N = 64
EPI_NONE, EPI_SWIGLU, EPI_ROPE = 0, 1, 2  # epilogues (launcher side)
# The same values as constexpr globals: the only globals a compiled @triton.jit body may read.
_EPI_NONE, _EPI_SWIGLU, _EPI_ROPE = tl.constexpr(EPI_NONE), tl.constexpr(EPI_SWIGLU), tl.constexpr(EPI_ROPE)


# ----------------------------------------------------------------------------------------------
# References (the unfused composition)
# ----------------------------------------------------------------------------------------------


def gather_rows_ref(x, index, group: int):
    """Rows of x picked by ``index`` [G, W]: row g * W + j is x[g * group + max(index[g, j], 0)] -> [G * W, K]."""
    g = torch.arange(index.shape[0], device=index.device)[:, None] * group  # [G, 1]
    return x[(g + index.long().clamp(min=0)).reshape(-1)]


def linear_ref(x, w, add=None, rows=None):
    """x [M, K] @ w [NOUT, K]^T (+ add) -> [M, NOUT] in x's dtype; ``rows`` = (index, group): x's
    rows gathered first (gather_rows_ref)."""
    if rows is not None:
        x = gather_rows_ref(x, *rows)
    return x @ w.t() if add is None else torch.addmm(add, x, w.t())


def _norm_ref(x, residual, norm_weight, eps):
    if norm_weight is None:  # no norm (then no residual either): the projection reads x as is
        return x, x
    if residual is None:
        return rms_norm_ref(x, norm_weight, eps), x
    return rms_norm_ref(x, norm_weight, eps, residual)


def norm_linear_ref(x, residual, norm_weight, eps, w):
    """(RMSNorm(x + residual) @ w^T, x + residual); residual None: (RMSNorm(x) @ w^T, x)."""
    y, s = _norm_ref(x, residual, norm_weight, eps)
    return y @ w.t(), s


def norm_swiglu_ref(x, residual, norm_weight, eps, w13):
    """(silu(gate) * up of RMSNorm(x + residual) @ w13^T, x + residual)."""
    y, s = _norm_ref(x, residual, norm_weight, eps)
    return silu_mul_ref(y @ w13.t()), s


def norm_qkv_rope_write_kv_ref_(x, residual, norm_weight, eps, wqkv, n_q_heads, n_kv_heads, positions,
                                cos, sin, k_cache, v_cache, slot_mapping, x2=None, norm_weight2=None, rows=None):
    """(rotated q [M, HQ, D], x + residual); rotated k and v written to the cache slots. With x2 the
    projected rows are cat(RMSNorm(x), RMSNorm2(x2)); with ``rows`` x's rows are gathered first."""
    if rows is not None:
        x = gather_rows_ref(x, *rows)
    y, s = _norm_ref(x, residual, norm_weight, eps)
    if x2 is not None:
        y = torch.cat([y, rms_norm_ref(x2, norm_weight2, eps)], dim=-1)
    M, D = x.shape[0], k_cache.shape[-1]
    q, k, v = (y @ wqkv.t()).split([n_q_heads * D, n_kv_heads * D, n_kv_heads * D], dim=-1)
    q = rope_write_kv_ref_(q.reshape(M, n_q_heads, D), k.reshape(M, n_kv_heads, D), v.reshape(M, n_kv_heads, D),
                           positions, cos, sin, k_cache, v_cache, slot_mapping)
    return q, s


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _sum_squares(x_ptr, r_ptr, o_m, m_m, K, stride_x, stride_r, HAS_RESIDUAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M] sums of squares of rows s = x (+ residual), s rounded to x's dtype as norm.py does."""
    dt = x_ptr.dtype.element_ty
    o_k = tl.arange(0, BLOCK_K)
    b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        m_mk = m_m[:, None] & ((k0 + o_k) < K)[None, :]
        b_x = tl.load(x_ptr + o_m[:, None] * stride_x + (k0 + o_k)[None, :], mask=m_mk, other=0.0)
        b_x = b_x.to(tl.float32)  # [BLOCK_M, BLOCK_K]
        if HAS_RESIDUAL:
            b_r = tl.load(r_ptr + o_m[:, None] * stride_r + (k0 + o_k)[None, :], mask=m_mk, other=0.0)
            b_x = (b_x + b_r.to(tl.float32)).to(dt).to(tl.float32)
        b_ss += tl.sum(b_x * b_x, axis=1)
    return b_ss


@triton.jit
def _accumulate_gemv(acc_a, acc_b, x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, w_col0, o_wa, o_wb, m_w, K, eps,
                     stride_w, i_n, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, TWO_ACC: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_SS: tl.constexpr, USE_PDL: tl.constexpr):
    """_accumulate for one row (BLOCK_M = 1) on CUDA cores: acc [BLOCK_N, BLOCK_K] += w chunk * x chunk.
    The first weight chunk is requested before the norm pass (whose row loads then wait alongside it),
    and each next chunk before the current chunk's products (register double buffering), so a program
    always has weight bytes in flight instead of waiting on one load per iteration."""
    dt = x_ptr.dtype.element_ty
    o_k = tl.arange(0, BLOCK_K)
    p_wa = w_ptr + w_col0 + o_wa[:, None] * stride_w + o_k[None, :]  # [BN, BK] chunk 0
    p_wb = w_ptr + w_col0 + o_wb[:, None] * stride_w + o_k[None, :]
    m_wk = m_w[:, None] & (o_k < K)[None, :]
    n_wa = tl.load(p_wa, mask=m_wk, other=0.0)
    n_wb = n_wa
    if TWO_ACC:
        n_wb = tl.load(p_wb, mask=m_wk, other=0.0)
    if USE_PDL:  # the weights never change: only x waits for the previous kernel
        tlc.gdc_wait()
    b_rstd = 0.0
    if NORM:  # 1 / rms of the row, the whole row per load (BLOCK_SS >= K up to 8192)
        o_0 = tl.zeros([1], dtype=tl.int64)
        b_ss = _sum_squares(x_ptr, r_ptr, o_0, o_0 == 0, K, 0, 0, HAS_RESIDUAL, 1, BLOCK_SS)  # [1]
        b_rstd = tl.math.rsqrt(tl.sum(b_ss, 0) / K + eps)
    for k0 in range(0, K, BLOCK_K):
        b_wa = n_wa
        b_wb = n_wb
        m_wk = m_w[:, None] & ((k0 + BLOCK_K + o_k) < K)[None, :]  # the next chunk
        n_wa = tl.load(p_wa + k0 + BLOCK_K, mask=m_wk, other=0.0)
        if TWO_ACC:
            n_wb = tl.load(p_wb + k0 + BLOCK_K, mask=m_wk, other=0.0)
        m_k = (k0 + o_k) < K
        b_x = tl.load(x_ptr + k0 + o_k, mask=m_k, other=0.0)  # [BLOCK_K]
        if HAS_RESIDUAL:
            b_r = tl.load(r_ptr + k0 + o_k, mask=m_k, other=0.0)
            b_x = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(dt)  # the new residual
            if i_n == 0:
                tl.store(s_ptr + k0 + o_k, b_x, mask=m_k)
        if NORM:
            b_nw = tl.load(nw_ptr + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_y = (b_x.to(tl.float32) * b_rstd).to(dt).to(tl.float32)
            b_x = (b_y * b_nw).to(dt)  # [BLOCK_K] the normalised row
        b_xf = b_x.to(tl.float32)[None, :]
        acc_a += b_wa.to(tl.float32) * b_xf  # [BN, BK]
        if TWO_ACC:
            acc_b += b_wb.to(tl.float32) * b_xf
    return acc_a, acc_b


@triton.jit
def _accumulate(acc_a, acc_b, x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, w_col0, o_m, m_m, o_wa, o_wb, m_w, K, b_rstd,
                stride_x, stride_r, stride_w, i_n, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                TWO_ACC: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc += rows @ w[:, w_col0 : w_col0 + K]^T for rows = x (+ residual, stored to s by column block 0),
    normalised chunk by chunk with b_rstd and nw when NORM; acc_b takes the o_wb weight rows."""
    dt = x_ptr.dtype.element_ty
    o_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        m_k = (k0 + o_k) < K
        m_mk = m_m[:, None] & m_k[None, :]
        b_x = tl.load(x_ptr + o_m[:, None] * stride_x + (k0 + o_k)[None, :], mask=m_mk, other=0.0)
        if HAS_RESIDUAL:
            b_r = tl.load(r_ptr + o_m[:, None] * stride_r + (k0 + o_k)[None, :], mask=m_mk, other=0.0)
            b_x = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(dt)  # [BLOCK_M, BLOCK_K] the new residual
            if i_n == 0:
                tl.store(s_ptr + o_m[:, None] * stride_x + (k0 + o_k)[None, :], b_x, mask=m_mk)
        if NORM:
            b_nw = tl.load(nw_ptr + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BLOCK_K]
            b_y = (b_x.to(tl.float32) * b_rstd[:, None]).to(dt).to(tl.float32)
            b_x = (b_y * b_nw[None, :]).to(dt)  # [BLOCK_M, BLOCK_K] normalised rows
        m_wk = m_w[:, None] & m_k[None, :]
        p_w = w_ptr + w_col0 + k0 + o_k[None, :]
        b_wa = tl.load(p_w + o_wa[:, None] * stride_w, mask=m_wk, other=0.0)  # [BN, BK]
        acc_a += tl.dot(b_x, tl.trans(b_wa), input_precision=DOT_PREC)  # [BM, BK] @ [BK, BN] -> [BM, BN]
        if TWO_ACC:
            b_wb = tl.load(p_w + o_wb[:, None] * stride_w, mask=m_wk, other=0.0)  # [BN, BK]
            acc_b += tl.dot(b_x, tl.trans(b_wb), input_precision=DOT_PREC)  # [BM, BK] @ [BK, BN]
    return acc_a, acc_b


@triton.jit
def _block_rows(i_n, NOUT, EPI: tl.constexpr, HALF: tl.constexpr, PARTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column block i_n's weight rows of the two accumulators: A = its columns (gate / first rope
    half), B = the up columns (swiglu) or the second half of the head (rope); -> (head, dims within
    a half (rope), rows A, rows B, row mask)."""
    o_c = tl.arange(0, BLOCK_N)
    i_head = i_n // PARTS
    o_hc = (i_n % PARTS) * BLOCK_N + o_c  # [BLOCK_N] dims within a half (rope)
    if EPI == _EPI_ROPE:  # program i_n: part i_n % PARTS of head i_n // PARTS (BLOCK_N dims of each half)
        o_wa = i_head * (2 * HALF) + o_hc
        o_wb = o_wa + HALF
        m_w = o_hc < HALF
    elif EPI == _EPI_SWIGLU:
        o_wa = i_n * BLOCK_N + o_c
        o_wb = o_wa + NOUT
        m_w = o_wa < NOUT
    else:
        o_wa = i_n * BLOCK_N + o_c
        o_wb = o_wa
        m_w = o_wa < NOUT
    return i_head, o_hc, o_wa.to(tl.int64), o_wb.to(tl.int64), m_w


@triton.jit
def _prefetch_l2(ptrs):
    """Ask for the 128-byte lines at ``ptrs`` to be brought into L2 (prefetch.global.L2): no result, no
    wait, so a program can start its weight stream before it may read its inputs. CUDA only."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_block(w_ptr, o_wa, o_wb, m_w, K, stride_w, TWO_ACC: tl.constexpr, PREFETCH: tl.constexpr,
                    LINE: tl.constexpr):
    """L2 prefetch of the block's first PREFETCH weight columns (one request per LINE elements =
    128 bytes; masked rows and columns clamped to valid addresses)."""
    o_l = tl.minimum(tl.arange(0, PREFETCH // LINE) * LINE, K - 1)[None, :]
    _prefetch_l2(w_ptr + tl.where(m_w, o_wa, 0)[:, None] * stride_w + o_l)
    if TWO_ACC:
        _prefetch_l2(w_ptr + tl.where(m_w, o_wb, 0)[:, None] * stride_w + o_l)


@triton.jit
def _accumulate_stream(acc_a, acc_b, x_ptr, w_ptr, o_xm, m_m, o_wa, o_wb, m_w, k_lo, k_hi, stride_x, stride_w,
                       TWO_ACC: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """The streaming body (swap-AB): acc [BLOCK_N, BLOCK_M] += w chunk [BLOCK_N, BLOCK_K] @ rows^T
    [BLOCK_K, BLOCK_M] over columns k_lo .. k_hi of K (all of it, or this program's split). The rows
    are ready to multiply (already normalised by _stream_prologue_kernel, or a plain linear's x,
    gathered through o_xm), so a K step is two or three
    tile loads and the dots: nothing between the loads and the dots for the software pipeliner to
    wait on, and the weight is the MMA's large side (tokens are the small one)."""
    o_k = tl.arange(0, BLOCK_K)
    p_x = x_ptr + o_xm[None, :] * stride_x + o_k[:, None]  # [BK, BM] rows^T
    p_wa = w_ptr + o_wa[:, None] * stride_w + o_k[None, :]  # [BN, BK]
    p_wb = w_ptr + o_wb[:, None] * stride_w + o_k[None, :]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        m_k = (k0 + o_k) < k_hi
        b_x = tl.load(p_x + k0, mask=m_k[:, None] & m_m[None, :], other=0.0)  # [BK, BM]
        b_wa = tl.load(p_wa + k0, mask=m_w[:, None] & m_k[None, :], other=0.0)  # [BN, BK]
        acc_a += tl.dot(b_wa, b_x, input_precision=DOT_PREC)  # [BN, BK] @ [BK, BM] -> [BN, BM]
        if TWO_ACC:
            b_wb = tl.load(p_wb + k0, mask=m_w[:, None] & m_k[None, :], other=0.0)
            acc_b += tl.dot(b_wb, b_x, input_precision=DOT_PREC)
    return acc_a, acc_b


@triton.jit
def _accumulate_stream_norm(acc_a, acc_b, x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, w_col0, o_xm, m_m, o_wa, o_wb, m_w,
                            k_lo, k_hi, b_rstd, stride_x, stride_r, stride_w, store_s, NORM: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr, TWO_ACC: tl.constexpr, BLOCK_K: tl.constexpr,
                            DOT_PREC: tl.constexpr):
    """_accumulate_stream with the norm prologue in the K loop (small_m = "stream_inline", one launch):
    each rows^T chunk [BLOCK_K, BLOCK_M] is loaded with its residual (s stored when store_s: column
    block 0 of each K range) and normalised with b_rstd [BLOCK_M] and nw right before its dot, as the
    tl.dot body does, on the streaming body's tiles (swap-AB, split-K)."""
    dt = x_ptr.dtype.element_ty
    o_k = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        m_k = (k0 + o_k) < k_hi
        m_km = m_k[:, None] & m_m[None, :]
        p_x = o_xm[None, :] * stride_x + (k0 + o_k)[:, None]  # [BK, BM]
        b_x = tl.load(x_ptr + p_x, mask=m_km, other=0.0)
        if HAS_RESIDUAL:
            b_r = tl.load(r_ptr + o_xm[None, :] * stride_r + (k0 + o_k)[:, None], mask=m_km, other=0.0)
            b_x = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(dt)  # the new residual
            if store_s:
                tl.store(s_ptr + p_x, b_x, mask=m_km)
        if NORM:
            b_nw = tl.load(nw_ptr + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
            b_y = (b_x.to(tl.float32) * b_rstd[None, :]).to(dt).to(tl.float32)
            b_x = (b_y * b_nw[:, None]).to(dt)  # [BK, BM] normalised rows^T
        p_w = w_ptr + w_col0 + (k0 + o_k)[None, :]
        m_wk = m_w[:, None] & m_k[None, :]
        b_wa = tl.load(p_w + o_wa[:, None] * stride_w, mask=m_wk, other=0.0)  # [BN, BK]
        acc_a += tl.dot(b_wa, b_x, input_precision=DOT_PREC)
        if TWO_ACC:
            b_wb = tl.load(p_w + o_wb[:, None] * stride_w, mask=m_wk, other=0.0)
            acc_b += tl.dot(b_wb, b_x, input_precision=DOT_PREC)
    return acc_a, acc_b


@triton.jit
def _split_reduce(acc_a, acc_b, part_ptr, cnt_ptr, i_cnt, i_s, SPLIT: tl.constexpr, TWO_ACC: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Split-K: store this split's fp32 partials [BLOCK_N, BLOCK_M] (and B's) in the block's slots of
    part_ptr and count it in; the block's last split to arrive (-> is_last) sums the SPLIT partials in
    split order (deterministic), returns the sums for the epilogue and resets the counter to 0 for the
    next launch. The barrier orders every thread's partial stores before the release of the increment,
    the acquire orders the last program's loads after all of them (attention.py's merge does the same)."""
    o_pn = tl.arange(0, BLOCK_N)
    o_pm = tl.arange(0, BLOCK_M)
    p_part = part_ptr + i_cnt.to(tl.int64) * (SPLIT * 2 * BLOCK_N * BLOCK_M) + o_pn[:, None] * BLOCK_M + o_pm[None, :]
    tl.store(p_part + i_s * (2 * BLOCK_N * BLOCK_M), acc_a)
    if TWO_ACC:
        tl.store(p_part + i_s * (2 * BLOCK_N * BLOCK_M) + BLOCK_N * BLOCK_M, acc_b)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + i_cnt, 1, sem="acq_rel")
    is_last = arrived == SPLIT - 1
    if is_last:
        tl.store(cnt_ptr + i_cnt, 0)
    m_last = (o_pn[:, None] >= 0) & is_last  # [BLOCK_N, 1]: only the last split reads the partials
    acc_a = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for j in range(SPLIT):
        acc_a += tl.load(p_part + j * (2 * BLOCK_N * BLOCK_M), mask=m_last, other=0.0, cache_modifier=".cg")
        if TWO_ACC:
            acc_b += tl.load(p_part + j * (2 * BLOCK_N * BLOCK_M) + BLOCK_N * BLOCK_M, mask=m_last, other=0.0,
                             cache_modifier=".cg")
    return acc_a, acc_b, is_last


@triton.jit
def _prologue_row(x_ptr, r_ptr, nw_ptr, s_ptr, y_ptr, K, eps, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                  BLOCK: tl.constexpr):
    """One row: s = dt(x + r) (stored when HAS_RESIDUAL), y = dt(nw * dt(s * rstd)) (NORM; else y = s)
    into y_ptr: the norm prologue's math (module docstring), chunks of BLOCK, two passes when K > BLOCK."""
    dt = x_ptr.dtype.element_ty
    o_k = tl.arange(0, BLOCK)
    b_rstd = 0.0
    if NORM:
        b_ss = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            m_k = (k0 + o_k) < K
            b_x = tl.load(x_ptr + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                b_x = (b_x + tl.load(r_ptr + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
            b_ss += b_x * b_x
        b_rstd = tl.math.rsqrt(tl.sum(b_ss, 0) / K + eps)
    for k0 in range(0, K, BLOCK):
        m_k = (k0 + o_k) < K
        b_x = tl.load(x_ptr + k0 + o_k, mask=m_k, other=0.0)
        if HAS_RESIDUAL:
            b_x = (b_x.to(tl.float32) + tl.load(r_ptr + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)).to(dt)
            tl.store(s_ptr + k0 + o_k, b_x, mask=m_k)
        if NORM:
            b_nw = tl.load(nw_ptr + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_x = ((b_x.to(tl.float32) * b_rstd).to(dt).to(tl.float32) * b_nw).to(dt)
        tl.store(y_ptr + k0 + o_k, b_x, mask=m_k)


@triton.jit(do_not_specialize=["xi_w", "xi_group", "xi_stride"])
def _stream_prologue_kernel(x_ptr, r_ptr, nw_ptr, s_ptr, x2_ptr, nw2_ptr, y_ptr, K, K2, eps, stride_x, stride_r,
                            stride_x2, stride_y, xi_ptr, xi_w, xi_group, xi_stride, NORM: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr, GATHER: tl.constexpr, BLOCK: tl.constexpr,
                            USE_PDL: tl.constexpr):
    """The streaming body's first launch, grid (M, 1 or 2): program (m, 0) writes y[m, :K] (the row's
    normalised x + residual, x's row gathered through xi when GATHER) and s[m]; program (m, 1) writes
    y[m, K : K + K2] = RMSNorm2(x2[m]) (the second input). With PDL it lets the GEMM launch at its
    start (USE_PDL = 2: pdl early, or the GEMM prefetches its weights meanwhile) or once its rows are
    written (1)."""
    i_m, i_part = tl.program_id(0), tl.program_id(1)
    if USE_PDL == 2:  # early: the GEMM may launch (and prefetch its weights) now; it waits for this grid
        tlc.gdc_launch_dependents()  # before reading y
    if USE_PDL:
        tlc.gdc_wait()
    i_m = i_m.to(tl.int64)
    if i_part == 0:
        i_xm = i_m
        if GATHER:
            i_g = i_m // xi_w
            i_xm = i_g * xi_group + tl.maximum(tl.load(xi_ptr + i_g * xi_stride + (i_m - i_g * xi_w)).to(tl.int64), 0)
        _prologue_row(x_ptr + i_xm * stride_x, r_ptr + i_m * stride_r, nw_ptr, s_ptr + i_m * stride_x,
                      y_ptr + i_m * stride_y, K, eps, NORM, HAS_RESIDUAL, BLOCK)
    else:
        _prologue_row(x2_ptr + i_m * stride_x2, x2_ptr, nw2_ptr, x2_ptr, y_ptr + i_m * stride_y + K, K2, eps, True,
                      False, BLOCK)
    if USE_PDL == 1:  # late: once the rows are written
        tlc.gdc_launch_dependents()


@triton.jit(do_not_specialize=["M", "n_blocks", "xi_w", "xi_group", "xi_stride", "n_ss", "stride_ss"])
def _fused_linear_kernel(
    x_ptr,  # [M, K] input rows
    r_ptr,  # [M, K] residual (HAS_RESIDUAL)
    nw_ptr,  # [K] norm weight (NORM)
    s_ptr,  # [M, K] x + residual out (HAS_RESIDUAL)
    x2_ptr,  # [M, K2] second input (TWO_INPUTS): columns K .. K + K2 of the weight
    nw2_ptr,  # [K2] its norm weight
    w_ptr,  # [NOUT, K (+ K2)] weight
    o_ptr,  # [M, NOUT] (none) | [M, F] (swiglu) | [M, HQ, D] rotated q (rope)
    add_ptr,  # [M, NOUT] added to the output (HAS_ADD, epilogue none), same strides as o
    pos_ptr,  # [M] positions (rope)
    cos_ptr,  # [P, BLOCK_N] fp32 (rope)
    sin_ptr,  # [P, BLOCK_N] fp32 (rope)
    slot_ptr,  # [M] int64 flat cache slots (rope)
    kc_ptr,  # [NP, PS, HKV, D] (rope)
    vc_ptr,  # [NP, PS, HKV, D] (rope)
    M,
    K,
    K2,
    NOUT,  # output columns of o (none: NOUT, swiglu: F)
    n_blocks,  # column blocks (rope: heads x PARTS); programs loop over them with stride num_programs(0)
    eps,
    n_positions,
    stride_x,
    stride_r,
    stride_x2,
    stride_w,
    stride_o,
    stride_cos,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    xi_ptr,  # [G, W] int row index of x (GATHER)
    xi_w,  # W: output rows per index row
    xi_group,  # rows of x per index row
    xi_stride,  # index row stride
    part_ptr,  # [row blocks * n_blocks, SPLIT, 2, BLOCK_N, BLOCK_M] fp32 split-K partials (SPLIT > 1)
    cnt_ptr,  # [row blocks * n_blocks] int32 arrival counters, zero between launches (SPLIT > 1)
    ss_ptr,  # [n_ss, M] fp32 row sums of squares per column block: written (RES_STATS), read (PRE_SS)
    n_ss,  # PRE_SS: partial rows of ss to sum
    stride_ss,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,  # D / 2 (rope)
    PARTS: tl.constexpr,  # programs per head (rope): each owns BLOCK_N = HALF / PARTS dims of both halves
    PS: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    TWO_INPUTS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    EPI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    GEMV: tl.constexpr,  # BLOCK_M = 1: CUDA-core products instead of a 16-row tl.dot
    BLOCK_SS: tl.constexpr,  # chunk of the sum-of-squares pass (GEMV: the whole row in one load)
    USE_PDL: tl.constexpr,  # programmatic dependent launch: 0, 1 late or 2 early trigger (attention_launch.pdl_mode)
    GATHER: tl.constexpr,  # x rows read through xi (no residual then)
    STREAM: tl.constexpr,  # the streaming body (x = ready rows, or NORM etc. in its K loop: stream_inline)
    PREFETCH: tl.constexpr = 0,  # STREAM with PDL: weight columns of the first block prefetched before the wait
    LINE: tl.constexpr = 64,  # elements per 128-byte line (PREFETCH)
    SPLIT: tl.constexpr = 1,  # STREAM: K split over SPLIT programs per column block (_split_reduce)
    RES_STATS: tl.constexpr = False,  # epilogue none: out = dt(dt(x @ w^T) + r), its squares summed per block
    PRE_SS: tl.constexpr = 0,  # rows' 1 / rms from ss partials: 0 no, 1 for NORM in the K loop, 2 as a row scale
    SS_ROWS: tl.constexpr = 1,  # a power of two >= n_ss (PRE_SS)
):
    i_p, i_m = tl.program_id(0), tl.program_id(1)
    if USE_PDL == 2:  # early: let the next kernel launch at once
        tlc.gdc_launch_dependents()
    # Split-K: K chunks per split (SPLIT = 1: the whole K)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    if STREAM and PREFETCH > 0 and USE_PDL:  # the weights never change: request them while the inputs are made
        _, _, p_wa, p_wb, p_m = _block_rows(i_p // SPLIT, NOUT, EPI, HALF, PARTS, BLOCK_N)
        p_k0 = (i_p % SPLIT) * k_per_split
        _prefetch_block(w_ptr + p_k0, p_wa, p_wb, p_m, K - p_k0, stride_w, EPI != _EPI_NONE, PREFETCH, LINE)
    if USE_PDL:
        if not GEMV:  # (GEMV: after requesting its first weight chunk)
            tlc.gdc_wait()
    dt = x_ptr.dtype.element_ty
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    m_m = o_m < M
    o_xm = o_m  # [BLOCK_M] the rows of x that output rows o_m read
    if GATHER:
        i_g = o_m // xi_w
        b_idx = tl.load(xi_ptr + i_g * xi_stride + (o_m - i_g * xi_w), mask=m_m, other=0).to(tl.int64)  # [BLOCK_M]
        o_xm = i_g * xi_group + tl.maximum(b_idx, 0)
        if GEMV:  # one row: its x row by pointer (the GEMV body reads row 0 of x_ptr)
            x_ptr += tl.sum(o_xm, 0) * stride_x
    o_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]

    # Pass 1 (norms): each row's 1 / rms; pass 2: the normalised chunks streamed against the weight.
    b_rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_pss = tl.zeros([SS_ROWS, BLOCK_M], dtype=tl.float32)
    if PRE_SS > 0:  # the producer's epilogue summed the squares of x's rows per column block: add them up
        o_j = tl.arange(0, SS_ROWS)
        b_pss = tl.load(ss_ptr + o_j[:, None] * stride_ss + o_m[None, :], mask=(o_j < n_ss)[:, None] & m_m[None, :],
                        other=0.0)  # [SS_ROWS, BLOCK_M]
    if PRE_SS == 1:  # needed in the K loop
        b_rstd = tl.math.rsqrt(tl.sum(b_pss, axis=0) / K + eps)
    elif NORM and not GEMV:  # (GEMV: per block, inside _accumulate_gemv)
        b_rstd = tl.math.rsqrt(_sum_squares(x_ptr, r_ptr, o_xm, m_m, K, stride_x, stride_r, HAS_RESIDUAL,
                                            BLOCK_M, BLOCK_SS) / K + eps)
    b_rstd2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if TWO_INPUTS and not GEMV:
        b_rstd2 = tl.math.rsqrt(_sum_squares(x2_ptr, x2_ptr, o_m, m_m, K2, stride_x2, stride_x2, False,
                                             BLOCK_M, BLOCK_SS) / K2 + eps)

    # Column blocks i_p, i_p + P, ... (P programs along axis 0; P = n_blocks: one block each). A
    # program with several blocks pays the norm pass above once.
    # (Split-K: SPLIT programs per block, task i_t = block i_t // SPLIT, split i_t % SPLIT.)
    for i_t in range(i_p, n_blocks * SPLIT, tl.num_programs(0)):
        i_n = i_t // SPLIT
        i_s = i_t % SPLIT
        i_head, o_hc, o_wa, o_wb, m_w = _block_rows(i_n, NOUT, EPI, HALF, PARTS, BLOCK_N)

        if GEMV:
            acc_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        elif STREAM:
            acc_a = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_b = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GEMV:
            acc_a, acc_b = _accumulate_gemv(acc_a, acc_b, x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, 0, o_wa, o_wb, m_w, K,
                                            eps, stride_w, i_n, NORM, HAS_RESIDUAL, EPI != _EPI_NONE, BLOCK_K,
                                            BLOCK_SS, USE_PDL)
            if TWO_INPUTS:
                acc_a, acc_b = _accumulate_gemv(acc_a, acc_b, x2_ptr, x2_ptr, nw2_ptr, x2_ptr, w_ptr, K, o_wa, o_wb,
                                                m_w, K2, eps, stride_w, i_n, True, False, EPI != _EPI_NONE, BLOCK_K,
                                                BLOCK_SS, USE_PDL)
        elif STREAM and (NORM or HAS_RESIDUAL or TWO_INPUTS):  # stream_inline: the norm in the K loop
            k_lo = i_s * k_per_split
            acc_a, acc_b = _accumulate_stream_norm(acc_a, acc_b, x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, 0, o_xm, m_m,
                                                   o_wa, o_wb, m_w, k_lo, tl.minimum(k_lo + k_per_split, K), b_rstd,
                                                   stride_x, stride_r, stride_w, i_n == 0, NORM, HAS_RESIDUAL,
                                                   EPI != _EPI_NONE, BLOCK_K, DOT_PREC)
            if TWO_INPUTS:  # the second K range, split alike
                k2_per_split = tl.cdiv(tl.cdiv(K2, BLOCK_K), SPLIT) * BLOCK_K
                k_lo = i_s * k2_per_split
                acc_a, acc_b = _accumulate_stream_norm(acc_a, acc_b, x2_ptr, x2_ptr, nw2_ptr, x2_ptr, w_ptr, K, o_m,
                                                       m_m, o_wa, o_wb, m_w, k_lo, tl.minimum(k_lo + k2_per_split, K2),
                                                       b_rstd2, stride_x2, stride_x2, stride_w, False, True, False,
                                                       EPI != _EPI_NONE, BLOCK_K, DOT_PREC)
        elif STREAM:
            k_lo = i_s * k_per_split
            acc_a, acc_b = _accumulate_stream(acc_a, acc_b, x_ptr, w_ptr, o_xm, m_m, o_wa, o_wb, m_w, k_lo,
                                              tl.minimum(k_lo + k_per_split, K), stride_x, stride_w, EPI != _EPI_NONE,
                                              BLOCK_K, DOT_PREC)
        else:
            acc_a, acc_b = _accumulate(acc_a, acc_b, x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, 0, o_xm, m_m, o_wa, o_wb, m_w,
                                       K, b_rstd, stride_x, stride_r, stride_w, i_n, NORM, HAS_RESIDUAL,
                                       EPI != _EPI_NONE, BLOCK_K, DOT_PREC)
            if TWO_INPUTS:  # [norm(x) | norm2(x2)] @ w^T as two K ranges of one accumulation
                acc_a, acc_b = _accumulate(acc_a, acc_b, x2_ptr, x2_ptr, nw2_ptr, x2_ptr, w_ptr, K, o_m, m_m, o_wa,
                                           o_wb, m_w, K2, b_rstd2, stride_x2, stride_x2, stride_w, i_n, True, False,
                                           EPI != _EPI_NONE, BLOCK_K, DOT_PREC)
        if USE_PDL == 1:  # late: this block's weights are read (a one-block program has only its epilogue
            tlc.gdc_launch_dependents()  # left; a persistent program signals after its first block)
        if GEMV:
            acc_a = tl.sum(acc_a, axis=1)[None, :]  # [1, BLOCK_N]
            acc_b = tl.sum(acc_b, axis=1)[None, :]
        m_e = m_m  # the epilogue's rows (split-K: only in the block's last split to arrive)
        if SPLIT > 1:
            acc_a, acc_b, is_last = _split_reduce(acc_a, acc_b, part_ptr, cnt_ptr, i_m * n_blocks + i_n, i_s, SPLIT,
                                                  EPI != _EPI_NONE, BLOCK_N, BLOCK_M)
            m_e = m_m & is_last
        if PRE_SS == 2:  # the norm weight is in w's columns: 1 / rms of each row scales its products
            b_rs = tl.math.rsqrt(tl.sum(b_pss, axis=0) / K + eps)  # [BLOCK_M]
            acc_a = acc_a * b_rs[None, :]
            acc_b = acc_b * b_rs[None, :]
        if STREAM:  # [BLOCK_N, BLOCK_M] -> the epilogue's [BLOCK_M, BLOCK_N]
            acc_a = tl.trans(acc_a)
            acc_b = tl.trans(acc_b)

        # Projections are rounded to dt first, exactly where the unfused path stores them.
        b_a = acc_a.to(dt)
        if EPI == _EPI_NONE:
            m_o = m_e[:, None] & m_w[None, :]
            if HAS_ADD:  # out = dt(x @ w^T + add), one rounding (torch.addmm's)
                b_add = tl.load(add_ptr + o_m[:, None] * stride_o + o_wa[None, :], mask=m_o, other=0.0)
                b_a = (acc_a + b_add.to(tl.float32)).to(dt)
            if RES_STATS:  # s = dt(dt(x @ w^T) + r) (norm.py's residual add), and sum(s^2) over these columns
                b_r = tl.load(r_ptr + o_m[:, None] * stride_r + o_wa[None, :], mask=m_o, other=0.0)
                b_a = (b_a.to(tl.float32) + b_r.to(tl.float32)).to(dt)
                b_sf = tl.where(m_o, b_a.to(tl.float32), 0.0)
                tl.store(ss_ptr + i_n * stride_ss + o_m, tl.sum(b_sf * b_sf, axis=1), mask=m_e)
            tl.store(o_ptr + o_m[:, None] * stride_o + o_wa[None, :], b_a, mask=m_o)
        elif EPI == _EPI_SWIGLU:
            b_g = b_a.to(tl.float32)
            b_u = acc_b.to(dt).to(tl.float32)
            b_act = b_g / (1.0 + tl.exp(-b_g)) * b_u  # silu(g) * u in fp32, one rounding
            m_o = m_e[:, None] & m_w[None, :]
            tl.store(o_ptr + o_m[:, None] * stride_o + o_wa[None, :], b_act.to(o_ptr.dtype.element_ty), mask=m_o)
        else:
            # Head i_head of [q heads | k heads | v heads]; halves a = dims [0, D/2), b = [D/2, D); this
            # program's dims o_hc of each half.
            b_x1 = b_a.to(tl.float32)
            b_x2 = acc_b.to(dt).to(tl.float32)
            m_o = m_e[:, None] & m_w[None, :]
            if i_head < HQ + HKV:
                b_pos = tl.load(pos_ptr + o_m, mask=m_e, other=0).to(tl.int64)  # [BLOCK_M]
                m_p = m_e & (b_pos >= 0) & (b_pos < n_positions)  # out of range: cos = sin = 0
                p_cs = b_pos[:, None] * stride_cos + o_hc[None, :]
                b_cos = tl.load(cos_ptr + p_cs, mask=m_p[:, None] & m_w[None, :], other=0.0)  # [BLOCK_M, BLOCK_N] fp32
                b_sin = tl.load(sin_ptr + p_cs, mask=m_p[:, None] & m_w[None, :], other=0.0)  # [BLOCK_M, BLOCK_N] fp32
                b_o1 = b_x1 * b_cos - b_x2 * b_sin
                b_o2 = b_x2 * b_cos + b_x1 * b_sin
            else:
                b_o1 = b_x1
                b_o2 = b_x2
            if i_head < HQ:
                p_q = o_ptr + o_m[:, None] * stride_o + i_head * (2 * HALF) + o_hc[None, :]
                tl.store(p_q, b_o1.to(dt), mask=m_o)
                tl.store(p_q + HALF, b_o2.to(dt), mask=m_o)
            else:
                b_slot = tl.load(slot_ptr + o_m, mask=m_e, other=-1)  # [BLOCK_M] int64
                m_s = m_o & (b_slot >= 0)[:, None]
                b_slot = tl.maximum(b_slot, 0)
                b_page = b_slot // PS
                b_off = b_slot % PS
                if i_head < HQ + HKV:
                    p_c = (kc_ptr + b_page[:, None] * stride_kcp + b_off[:, None] * stride_kcs
                           + (i_head - HQ) * stride_kch + o_hc[None, :])
                    kc_dt = kc_ptr.dtype.element_ty
                    tl.store(p_c, b_o1.to(dt).to(kc_dt), mask=m_s)  # rounded to k's dtype, then the cache's
                    tl.store(p_c + HALF, b_o2.to(dt).to(kc_dt), mask=m_s)
                else:
                    p_c = (vc_ptr + b_page[:, None] * stride_vcp + b_off[:, None] * stride_vcs
                           + (i_head - HQ - HKV) * stride_vch + o_hc[None, :])
                    vc_dt = vc_ptr.dtype.element_ty
                    tl.store(p_c, b_o1.to(dt).to(vc_dt), mask=m_s)
                    tl.store(p_c + HALF, b_o2.to(dt).to(vc_dt), mask=m_s)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

def _block_m(M):
    return max(16, triton.next_power_of_2(M))


def _block_n(n_cols, device, lo=16, hi=128):
    """Widest column block that still gives every SM a program (weights stream from all SMs): SmolLM2
    wo / w2 (576 columns) -> 16, lm_head (49152) -> 128; at least ``lo`` (the tl.dot minimum)."""
    sms = sm_count(device)
    bn = hi
    while bn > lo and triton.cdiv(n_cols, bn) < sms:
        bn //= 2
    return bn


def _block_k(K, block_m, block_n, n_acc, esize):
    """K chunk: ~16 KB of weight per pipeline stage (n_acc x [BLOCK_N, BLOCK_K]) so each SM keeps
    enough bytes in flight to stream a wide weight (an 8B w2 row block is 16 x 14336), and at most
    16 KB of x per stage (BLOCK_M x BLOCK_K); between 32 and 512, no wider than K needs."""
    bk = min(16384 // (n_acc * block_n * esize), 16384 // (block_m * esize), 512)
    bk = max(32, 1 << (bk.bit_length() - 1))
    return min(bk, max(32, triton.next_power_of_2(K)))


def _gemv_requested(x, config, rows=None):
    """Whether the GEMV body runs: one row (of the gathered ones with ``rows``), unless config says
    {"gemv": False}."""
    return _num_rows(x, rows) == 1 and bool(config.get("gemv", True))


def _num_rows(x, rows):
    """M: x's rows, or with gathered rows the index's entries."""
    return x.shape[0] if rows is None else rows[0].numel()


def _check_rows(name, x, rows):
    """Gathered rows: (int index [G, W] with a contiguous last dim, group >= 0) on x's device, at most MAX_M."""
    index, group = rows
    if index.dim() != 2 or index.dtype not in (torch.int32, torch.int64) or (index.shape[1] > 1 and index.stride(1) != 1):
        raise ValueError(f"{name}: rows index must be int32/int64 [G, W] with a contiguous last dim, got "
                         f"{index.dtype} {tuple(index.shape)}")
    if index.device != x.device or int(group) < 0:
        raise ValueError(f"{name}: rows index on {index.device} (x on {x.device}), group {group} (must be >= 0)")
    if index.numel() > MAX_M:
        raise ValueError(f"{name}: at most {MAX_M} gathered rows, got {index.numel()}")


def _default_block_n(x, config, epi, dot_block_n, rows=None, n_cols=None, hi=128, plain=False):
    """Column block when the caller gave none: the GEMV tile's, the streaming body's (n_cols output
    columns per accumulator, at most hi; ``plain`` projections, linear and linear_residual:
    STREAM_PLAIN_BLOCK_N or the kernel option stream_block_n, no wider than the output) or the tl.dot one."""
    if _gemv_requested(x, config, rows):
        return _gemv_tiles(x.shape[1], epi, x.device)["block_n"]
    if _peek_body(config) != "dot":
        if plain:
            return min(options.get().stream_block_n or STREAM_PLAIN_BLOCK_N, max(16, triton.next_power_of_2(n_cols)))
        return _stream_block_n(lambda bn: triton.cdiv(n_cols, bn), _num_rows(x, rows), 1 if epi == EPI_NONE else 2,
                               hi, x.device)
    return dot_block_n


def _tuned(config, w, x, rows=None, qkv=False):
    """config over the kernel option stream_tiles' entry (options.load_tiles; "builtin": the packaged
    tables) for w's shape at this many rows on x's device; config's own keys win. Only where the
    streaming body runs (several rows, not the tl.dot body, not a forced GEMV); elsewhere, or without
    a table or a matching entry, config as given.
    "parts" (programs per head) is the qkv launcher's alone: other launchers skip it."""
    value = options.get().stream_tiles
    if value is None:
        return config
    entries = options.tile_entries(value, _device_name(x.device))
    if not entries:
        return config
    M = _num_rows(x, rows)
    if M < 2 or (config or {}).get("gemv") or _peek_body(config) == "dot":
        return config
    w_rows, w_cols = w.shape
    for e in entries:
        if e["n"] == w_rows and e["k"] == w_cols and e["rows"][0] <= M <= e["rows"][1]:
            return {**{key: v for key, v in e["config"].items() if qkv or key != "parts"}, **(config or {})}
    return config


@functools.lru_cache(maxsize=None)
def _device_name_of(kind, index):
    return torch.cuda.get_device_name(index) if kind == "cuda" else kind


def _device_name(device):
    """The name a tile table's "device" is matched against: torch.cuda.get_device_name, or "cpu"."""
    return _device_name_of(device.type, device.index if device.index is not None else
                           (torch.cuda.current_device() if device.type == "cuda" else None))


def _peek_body(config):
    """The multi-row body config / the kernel option selects (without popping config's key)."""
    return _resolve_body((config or {}).get("small_m") or options.get().small_m)


def _resolve_body(body):
    """The body "auto" stands for where rows reach the fused kernels (specdec.models.ops routes only
    small weights and few rows here under it): "stream_prefetch"."""
    return "stream_prefetch" if body == "auto" else body


def _stream_block_n(grid_of, M, n_acc, hi, device):
    """Streaming-body column block: the widest (<= hi) that still gives every SM a column block
    (grid_of(bn) programs), but no narrower than the row block / n_acc, so the row tiles each program
    reads (BLOCK_M x K, from L2) stay no larger than its weight tiles (n_acc x BLOCK_N x K, from HBM);
    too few blocks then are made up by split-K (_stream_split)."""
    floor = min(hi, max(16, triton.next_power_of_2(_block_m(M) // n_acc)))
    bn = hi
    while bn > floor and grid_of(bn) < sm_count(device):
        bn //= 2
    return bn


def _stream_split(grid_n, K, block_k, device):
    """Default split-K of the streaming body: with fewer column blocks than SMs and a K loop of at least
    SPLIT_MIN_CHUNKS BLOCK_K chunks (kernel option split_min_chunks), enough splits to give every SM a
    program, keeping at least two chunks per split. Shorter loops run whole: the partials' store, count
    and reduction cost more than the loop they split."""
    sms = sm_count(device)
    chunks = triton.cdiv(K, block_k)
    if grid_n >= sms or chunks < (options.get().split_min_chunks or SPLIT_MIN_CHUNKS):
        return 1
    return max(1, min(triton.cdiv(sms, grid_n), chunks // 2))


def _use_gemv(x, config, rows=None):
    """_gemv_requested, popping the "gemv" key."""
    gemv = _gemv_requested(x, config, rows)
    config.pop("gemv", None)
    return gemv


def _gemv_default(config, n_cols):
    """config with "gemv" defaulted by the output width (GEMV_MAX_COLUMNS)."""
    config = dict(config or {})
    config.setdefault("gemv", n_cols <= GEMV_MAX_COLUMNS)
    return config


def _gemv_tiles(K, epi, device):
    """GEMV tile defaults: block_n (output columns per program and accumulator), BLOCK_K, num_warps.
    H200 sweeps (bench_linear.py --sweep --kinds gemv, weights streamed from HBM): short rows (SmolLM2,
    K 576 / 1536) 4 x 128 with 8 warps for a plain projection (wo 2.0 us, w2 2.5 us), 8 x 256 with 4
    warps with the norm / two accumulators (qkv 3.4, mlp_in 3.3); long rows (Llama-3.1-8B, K 4096 /
    14336) 8 x 512 with 4 warps (wo 10.5 us, w2 29.8), 8 x 256 for qkv (17.8), and for gate|up 8 x 512
    with 8 warps on a persistent grid of 2 programs per SM."""
    if epi == EPI_SWIGLU and K > 2048:  # 8B gate|up: 62.4 us (4 warps, one block per program: 65.2)
        return {"block_n": 8, "BLOCK_K": 512, "num_warps": 8, "programs": 2 * sm_count(device)}
    if epi != EPI_NONE:
        return {"block_n": 8, "BLOCK_K": 256, "num_warps": 4}
    if K <= 2048:
        return {"block_n": 4, "BLOCK_K": 128, "num_warps": 8}
    return {"block_n": 8, "BLOCK_K": 512, "num_warps": 4}


SMALL_M_BODIES = options.SMALL_M_BODIES


def _small_m_body(config):
    """The body for rows that do not take the GEMV: config's "small_m" (popped) or the kernel option
    small_m: "dot" (_accumulate), "stream" (_stream_prologue_kernel + _accumulate_stream), "auto" (as
    "stream_prefetch"; specdec.models.ops decides which rows come here),
    "stream_prefetch" (the same, with the GEMM's L2 prefetch before its PDL wait) or "stream_inline"
    (one launch: _accumulate_stream_norm)."""
    body = config.pop("small_m", None) or options.get().small_m
    if body not in SMALL_M_BODIES:
        raise ValueError(f"small_m body {body!r}; valid: {', '.join(SMALL_M_BODIES)}")
    return _resolve_body(body)


def _stream_tiles(K, block_m, block_n, n_acc, esize):
    """Streaming-body defaults: BLOCK_K for ~24 KB of weight and rows per pipeline stage (n_acc x
    [BLOCK_N, BLOCK_K] + [BLOCK_M, BLOCK_K]), between 32 and 256 and no wider than K needs; 4 stages
    (~96 KB of shared memory in flight per program), 4 warps. Not tuned on a GPU yet (bench_linear.py
    --small-m sweeps the alternatives)."""
    bk = 24576 // ((n_acc * block_n + block_m) * esize)
    bk = min(256, max(32, 1 << (bk.bit_length() - 1)))
    return {"BLOCK_K": min(bk, max(32, triton.next_power_of_2(K))), "num_warps": 4, "num_stages": 4}


def _dot_prec(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(name, x, w, residual=None, norm_weight=None, rows=None):
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: x must be [M, K] and w [NOUT, K] with the same K, got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in _FLOAT_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"{name}: x and w must share a float dtype, got {x.dtype} and {w.dtype}")
    if rows is not None:  # x is a table the rows are gathered from: any number of rows
        _check_rows(name, x, rows)
        if residual is not None:
            raise ValueError(f"{name}: gathered rows take no residual")
    elif x.shape[0] > MAX_M:
        raise ValueError(f"{name}: at most {MAX_M} rows (larger M belongs to a GEMM), got {x.shape[0]}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{name}: the last dims of x and w must be contiguous")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(1) != 1 or residual.stride(0) != x.stride(0)):
        raise ValueError(f"{name}: residual must match x in shape, dtype and strides, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if norm_weight is not None and norm_weight.shape != (x.shape[1],):
        raise ValueError(f"{name}: norm weight must be [K={x.shape[1]}], got {tuple(norm_weight.shape)}")
    for arg, t in (("w", w), ("residual", residual), ("norm_weight", norm_weight)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: {arg} is on {t.device}, x on {x.device}")


def _launch(x, w, out, *, grid_n, block_n, residual=None, norm_weight=None, eps=0.0, epi=EPI_NONE, nout=0,
            rope_args=None, add=None, x2=None, norm_weight2=None, config=None, rows=None, stats_residual=None,
            sumsq=None):
    """One launch of the fused kernel (the streaming body: its prologue first where a norm runs);
    returns s (x + residual, or x) when a norm runs, the [grid_n, M] sums of squares with
    ``stats_residual`` (out = x @ w^T + stats_residual, see linear_residual), else None. ``sumsq``:
    x's rows' sums of squares in partials (a linear_residual's): the streaming body, without a prologue
    launch, normalises in its K loop (with norm_weight; other bodies then compute the norm as usual) or,
    with norm_weight None and w's columns scaled by the norm weight, scales each row's products by its
    1 / rms before the epilogue. ``config`` overrides BLOCK_K /
    num_warps / num_stages / programs (benchmark sweeps; the public launchers also take ``block_n``,
    and ``parts`` for the qkv kernel), "gemv" (one row), "small_m" (the multi-row body, else the
    kernel option), and for the streaming body "split_k" and "prefetch" (weight columns requested
    into L2 before the PDL wait, 0 = none). ``rows``: (index, group), gathered rows of x."""
    K = x.shape[1]
    M = _num_rows(x, rows)
    cfg = dict(config or {})
    gemv = _use_gemv(x, cfg, rows)
    body = _small_m_body(cfg)
    stream = body != "dot" and not gemv
    # stream_prefetch: the GEMM's first weight columns requested into L2 before its PDL wait
    prefetch = cfg.pop("prefetch", None)
    if prefetch is None:
        prefetch = min(1024, triton.next_power_of_2(K + (x2.shape[1] if x2 is not None else 0))) \
            if body == "stream_prefetch" else 0
    line = 128 // x.element_size()
    prefetch = max(line, triton.next_power_of_2(prefetch)) if prefetch and stream else 0
    pdl = int(cfg.pop("pdl", pdl_mode(x.device)))  # 0 off, 1 late, 2 early trigger
    if pdl == 1 and epi == EPI_ROPE:  # the attention after it may launch at once (see QKV_EARLY_MAX_BYTES)
        early = options.get().pdl_qkv_early
        pdl = 2 if (w.numel() * w.element_size() <= QKV_EARLY_MAX_BYTES if early is None else early) else 1
    block_m = 1 if gemv else _block_m(M)
    norm = norm_weight is not None
    if residual is not None:
        s = torch.empty_like(x, memory_format=torch.contiguous_format)
        if s.stride(0) != x.stride(0):
            x = x.contiguous()
            residual = residual.contiguous()
    else:
        s = x
    if rope_args is None:
        pos = cos = sin = slots = kc = vc = x  # placeholders, never dereferenced
        n_pos, cs_stride, kc_s, vc_s, hq, hkv, ps, half = 1, 0, (0, 0, 0), (0, 0, 0), 1, 1, 1, 1
        parts = 1
    else:
        pos, cos, sin, slots, kc, vc, hq, hkv = rope_args
        n_pos, cs_stride, ps, half = cos.shape[0], cos.stride(0), kc.shape[1], cos.shape[1]
        parts = triton.cdiv(half, block_n)
        kc_s, vc_s = kc.stride()[:3], vc.stride()[:3]
    if M == 0:
        if stats_residual is not None:
            return torch.zeros((grid_n, 0), dtype=torch.float32, device=x.device)
        return s if norm else None
    r = residual if residual is not None else stats_residual if stats_residual is not None else x
    nw = norm_weight.contiguous() if norm else x
    if x2 is not None:
        x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
        nw2, K2 = norm_weight2.contiguous(), x2.shape[1]
    else:
        x2, nw2, K2 = x, x, 0  # placeholders (TWO_INPUTS=False)
    pre_ss = 0  # 1: normalise in the K loop (norm weight given), 2: scale rows in the epilogue (folded weight)
    if sumsq is not None and (stream or not norm):
        if residual is not None or K2 or rows is not None:
            raise ValueError("sumsq: the rows' squares are summed already; no residual, second input or gather")
        if sumsq.dtype != torch.float32 or sumsq.dim() != 2 or sumsq.shape[1] != M or sumsq.stride(1) != 1:
            raise ValueError(f"sumsq must be fp32 [parts, M={M}] with contiguous rows, got {sumsq.dtype} "
                             f"{tuple(sumsq.shape)}")
        if not stream:
            raise ValueError("sumsq with a folded norm weight (norm_weight None) needs the streaming body")
        pre_ss = 1 if norm else 2
    if stream and body != "stream_inline" and (norm or residual is not None or K2) and not pre_ss:
        # First launch: the ready rows y = [RMSNorm(x + residual) | RMSNorm2(x2)] (and s); the GEMM then
        # streams y like a plain linear's x (no residual, norm, second input or gather left).
        y = torch.empty((M, K + K2), dtype=x.dtype, device=x.device)
        gx, gw, gg, gs = (rows[0], rows[0].shape[1], int(rows[1]), rows[0].stride(0)) if rows is not None \
            else (x, 1, 0, 0)
        block = min(4096, triton.next_power_of_2(max(K, K2)))
        _stream_prologue_kernel[(M, 2 if K2 else 1)](
            x, r, nw, s, x2, nw2, y, K, K2, float(eps), x.stride(0), r.stride(0), x2.stride(0), y.stride(0),
            gx, gw, gg, gs, NORM=norm, HAS_RESIDUAL=residual is not None, GATHER=rows is not None, BLOCK=block,
            USE_PDL=(2 if pdl == 2 or prefetch else 1) if pdl else 0, num_warps=4 if block <= 1024 else 8,
            **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
        x = r = y
        K, K2, rows, residual, norm_main = K + K2, 0, None, None, False
        x2 = nw2 = nw = y
    else:
        norm_main = norm
    if gemv:
        cfg = {**_gemv_tiles(K, epi, x.device), "num_stages": 1, **cfg}
        cfg.pop("block_n")
    elif stream:
        cfg = {**_stream_tiles(max(K, K2), block_m, block_n, 1 if epi == EPI_NONE else 2, x.element_size()), **cfg}
    else:
        cfg = {"BLOCK_K": _block_k(K, block_m, block_n, 1 if epi == EPI_NONE else 2, x.element_size()),
               "num_warps": 4, "num_stages": 3, **cfg}
    split = cfg.pop("split_k", None)
    split = int(split if split is not None else (_stream_split(grid_n, K, cfg["BLOCK_K"], x.device) if stream else 1))
    if split < 1 or (split > 1 and not stream):
        raise ValueError(f"split_k={split}: the streaming body's K split needs small_m stream and >= 1 splits")
    n_tasks = grid_n * split
    programs = min(n_tasks, cfg.pop("programs", None) or n_tasks)
    if split > 1:
        n_cnt = triton.cdiv(M, block_m) * grid_n
        part = torch.empty(n_cnt * split * 2 * block_n * block_m, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, n_cnt, owner="fused_linear")
    else:
        part = counters = out  # placeholders (SPLIT = 1)
    if rows is not None:
        xi, xi_group = rows
        xi_w, xi_stride = xi.shape[1], xi.stride(0)
    else:
        xi, xi_w, xi_group, xi_stride = x, 1, 0, 0  # placeholders (GATHER=False)
    ss, n_ss = (sumsq, sumsq.shape[0]) if pre_ss else (part, 0)
    if stats_residual is not None:
        if epi != EPI_NONE or add is not None or norm or rows is not None:
            raise ValueError("stats_residual: a plain linear's epilogue only")
        ss, n_ss = torch.empty((grid_n, M), dtype=torch.float32, device=x.device), grid_n
    _fused_linear_kernel[(programs, triton.cdiv(M, block_m))](
        x, r, nw, s, x2, nw2, w, out, add if add is not None else out, pos, cos, sin, slots, kc, vc,
        M, K, K2, nout, grid_n, float(eps), n_pos,
        x.stride(0), r.stride(0), x2.stride(0), w.stride(0), out.stride(0), cs_stride, *kc_s, *vc_s,
        xi, xi_w, int(xi_group), xi_stride, part, counters, ss, n_ss, ss.stride(0) if n_ss else 0,
        HQ=hq, HKV=hkv, HALF=half, PARTS=parts, PS=ps, NORM=norm_main, HAS_RESIDUAL=residual is not None,
        TWO_INPUTS=K2 > 0,
        HAS_ADD=add is not None, EPI=epi,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PREC=_dot_prec(x.dtype), GEMV=gemv,
        BLOCK_SS=min(8192, triton.next_power_of_2(max(K, K2))) if gemv else cfg["BLOCK_K"],
        USE_PDL=pdl, GATHER=rows is not None, STREAM=stream, PREFETCH=prefetch, LINE=line, SPLIT=split,
        RES_STATS=stats_residual is not None, PRE_SS=pre_ss,
        SS_ROWS=triton.next_power_of_2(sumsq.shape[0]) if pre_ss else 1, **({"launch_pdl": True} if pdl else {}), **cfg,
    )  # fmt: skip
    if stats_residual is not None:
        return ss
    return s if norm else None


def linear(x, w, add=None, config=None, rows=None):
    """x [M, K] @ w [NOUT, K]^T (+ add [M, NOUT]) -> new [M, NOUT] in x's dtype, in one launch (M <= MAX_M).
    With ``add`` the sum is rounded once, as torch.addmm(add, x, w.t()) does. ``rows`` = (index [G, W],
    group): the M = G * W input rows gathered from x in the kernel (module docstring)."""
    _check("linear", x, w, rows=rows)
    M, NOUT = _num_rows(x, rows), w.shape[0]
    out = torch.empty((M, NOUT), dtype=x.dtype, device=x.device)
    if add is not None:
        if add.shape != (M, NOUT) or add.dtype != x.dtype or add.device != x.device:
            raise ValueError(f"linear: add must be [M, NOUT] = [{M}, {NOUT}] {x.dtype} on {x.device}, got "
                             f"{tuple(add.shape)} {add.dtype} on {add.device}")
        add = add.contiguous()
    config = _gemv_default(_tuned(config, w, x, rows), NOUT)
    bn = config.pop("block_n", None) or _default_block_n(x, config, EPI_NONE, _block_n(NOUT, x.device), rows,
                                                         n_cols=NOUT, plain=True)
    _launch(x, w, out, grid_n=triton.cdiv(NOUT, bn), block_n=bn, nout=NOUT, add=add, config=config, rows=rows)
    return out


def linear_residual(x, w, residual, config=None):
    """The projection that closes a residual block: (s, sumsq) in one launch, for M <= MAX_M rows.

    s = dt(dt(x @ w^T) + residual) [M, NOUT] (the projection rounded, then the residual add rounded as
    norm.py does: the stream entering the next RMSNorm); sumsq fp32 [parts, M], the sums of s^2 of
    each row over the parts' column blocks (sumsq.sum(0) = sum of s^2 per row). Handing sumsq to the
    next norm_* launcher (``sumsq=``, with residual None) spares the streaming body its prologue launch
    (module docstring, "Norm statistics from the producer"). Reference: linear_residual_ref."""
    _check("linear_residual", x, w)
    M, NOUT = x.shape[0], w.shape[0]
    if residual is None or residual.shape != (M, NOUT) or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"linear_residual: residual must be [M, NOUT] = [{M}, {NOUT}] {x.dtype} on {x.device}, got "
                         + ("None" if residual is None else
                            f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"))
    residual = residual.contiguous()
    out = torch.empty((M, NOUT), dtype=x.dtype, device=x.device)
    config = _gemv_default(_tuned(config, w, x), NOUT)
    bn = config.pop("block_n", None) or _default_block_n(x, config, EPI_NONE, _block_n(NOUT, x.device), n_cols=NOUT,
                                                         plain=True)
    ss = _launch(x, w, out, grid_n=triton.cdiv(NOUT, bn), block_n=bn, nout=NOUT, config=config,
                 stats_residual=residual)
    return out, ss


def linear_residual_ref(x, w, residual):
    """(s = dt(dt(x @ w^T) + residual), [1, M] fp32 sums of s^2 per row)."""
    s = x @ w.t() + residual
    return s, s.float().pow(2).sum(-1)[None]


def _check_sumsq(name, residual, sumsq):
    if sumsq is not None and residual is not None:
        raise ValueError(f"{name}: sumsq describes x's rows as they are; pass residual=None with it")


def norm_linear(x, residual, norm_weight, eps, w, config=None, sumsq=None):
    """(RMSNorm(x + residual) @ w^T, x + residual) in one launch; residual None: (..., x). ``sumsq``:
    x's rows' sums of squares from linear_residual (residual None); with it, norm_weight None means w's
    columns carry the norm weight (ops.fold_norm) and 1 / rms scales the products."""
    _check("norm_linear", x, w, residual, norm_weight)
    _check_sumsq("norm_linear", residual, sumsq)
    M, NOUT = x.shape[0], w.shape[0]
    out = torch.empty((M, NOUT), dtype=x.dtype, device=x.device)
    config = _gemv_default(_tuned(config, w, x), NOUT)
    bn = config.pop("block_n", None) or _default_block_n(x, config, EPI_NONE, _block_n(NOUT, x.device), n_cols=NOUT)
    s = _launch(x, w, out, grid_n=triton.cdiv(NOUT, bn), block_n=bn, residual=residual,
                norm_weight=norm_weight, eps=eps, nout=NOUT, config=config, sumsq=sumsq)
    return out, (x if s is None else s)


def norm_swiglu(x, residual, norm_weight, eps, w13, config=None, sumsq=None):
    """(silu(gate) * up of RMSNorm(x + residual) @ [gate | up]^T, x + residual) in one launch.

    w13: [2F, K] (gate rows first). Returns a new [M, F] activation and s (x itself without residual).
    ``sumsq``: x's rows' sums of squares from linear_residual (residual None; norm_weight None: folded
    into w13, as in norm_linear).
    """
    _check("norm_swiglu", x, w13, residual, norm_weight)
    _check_sumsq("norm_swiglu", residual, sumsq)
    if w13.shape[0] % 2:
        raise ValueError(f"norm_swiglu: w13 must have an even number of rows [2F, K], got {tuple(w13.shape)}")
    M, F = x.shape[0], w13.shape[0] // 2
    out = torch.empty((M, F), dtype=x.dtype, device=x.device)
    config = dict(_tuned(config, w13, x) or {})
    bn = config.pop("block_n", None) or _default_block_n(x, config, EPI_SWIGLU, _block_n(F, x.device, hi=64),
                                                         n_cols=F, hi=64)
    s = _launch(x, w13, out, grid_n=triton.cdiv(F, bn), block_n=bn, residual=residual, norm_weight=norm_weight,
                eps=eps, epi=EPI_SWIGLU, nout=F, config=config, sumsq=sumsq)
    return out, (x if s is None else s)


def norm_qkv_rope_write_kv_(x, residual, norm_weight, eps, wqkv, n_q_heads, n_kv_heads, positions, cos, sin,
                            k_cache, v_cache, slot_mapping, x2=None, norm_weight2=None, config=None, rows=None,
                            sumsq=None):
    """RMSNorm(x + residual) @ wqkv^T, RoPE on q and k, k and v into the paged caches: one launch.

    wqkv: [(HQ + 2 HKV) D, K] (q rows, then k, then v); positions [M] int32/int64 rows of the fp32
    cos/sin tables [P, D/2]; k_cache / v_cache [NP, PS, HKV, D] written in place at
    ``slot_mapping`` [M] int64 (< 0 skips the row). Returns (rotated q, a new [M, HQ, D] tensor;
    s = x + residual, or x itself without a residual). norm_weight None: no norm, x is projected as is.
    With ``x2`` [M, K2] (and its ``norm_weight2``, x normed too, no residual) the projected rows are
    [RMSNorm(x) | RMSNorm2(x2)] and wqkv is [.., K + K2]: EAGLE-3's draft layer, whose attention reads
    the normed token embedding beside the normed hidden state, without a concatenated copy.
    ``rows`` = (index [G, W], group): x's M = G * W rows gathered in the kernel (e.g. x = an embedding
    table, index = token ids); then s is None. ``sumsq``: x's rows' sums of squares from
    linear_residual (residual None, no x2 or rows; norm_weight None: folded into wqkv, as in norm_linear).
    """
    name = "norm_qkv_rope_write_kv_"
    _check_sumsq(name, residual, sumsq)
    M = _num_rows(x, rows)
    if x2 is not None:
        if norm_weight is None or norm_weight2 is None or residual is not None:
            raise ValueError(f"{name}: a second input needs both norm weights and no residual")
        if x2.dim() != 2 or x2.shape[0] != M or x2.dtype != x.dtype or x2.device != x.device:
            raise ValueError(f"{name}: x2 must be [M={M}, K2] {x.dtype} on {x.device}, got "
                             f"{tuple(x2.shape)} {x2.dtype} on {x2.device}")
        if norm_weight2.shape != (x2.shape[1],):
            raise ValueError(f"{name}: norm weight 2 must be [K2={x2.shape[1]}], got {tuple(norm_weight2.shape)}")
        _check(name, x, wqkv[:, :x.shape[1]], residual, norm_weight, rows)
        if wqkv.shape[1] != x.shape[1] + x2.shape[1]:
            raise ValueError(f"{name}: wqkv must have K + K2 = {x.shape[1] + x2.shape[1]} columns, got {wqkv.shape[1]}")
    else:
        _check(name, x, wqkv, residual, norm_weight, rows)
    if norm_weight is None and residual is not None:
        raise ValueError(f"{name}: a residual needs a norm weight (the sum is normalised)")
    D = k_cache.shape[-1]
    HQ, HKV = n_q_heads, n_kv_heads
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2] != HKV:
        raise ValueError(f"{name}: caches must both be [P, PS, HKV={HKV}, D], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if D % 2:
        raise ValueError(f"{name}: head dim must be even, got {D}")
    if wqkv.shape[0] != (HQ + 2 * HKV) * D:
        raise ValueError(f"{name}: wqkv must be [(HQ + 2 HKV) D = {(HQ + 2 * HKV) * D}, K], got {tuple(wqkv.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{name}: the head dim of the caches must be contiguous")
    if positions.shape != (M,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: positions must be int32/int64 [M={M}], got {positions.dtype} {tuple(positions.shape)}")
    if slot_mapping.shape != (M,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"{name}: slot_mapping must be int64 [M={M}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if cos.dtype != torch.float32 or sin.shape != cos.shape or cos.shape[-1] != D // 2:
        raise ValueError(f"{name}: cos/sin must be fp32 [P, D/2={D // 2}], got {tuple(cos.shape)} {cos.dtype}")
    q = torch.empty((M, HQ, D), dtype=x.dtype, device=x.device)
    rope_args = (positions.contiguous(), cos.contiguous(), sin.contiguous(), slot_mapping.contiguous(), k_cache,
                 v_cache, HQ, HKV)
    # Programs per head: split each half into parts of >= 16 dims (the tl.dot minimum) while the heads
    # x parts still fit the SMs: SmolLM2 (15 heads, D/2 = 32) -> 2 parts, 30 programs streaming 36 KB
    # of weight each instead of 15 streaming 73 KB (the batch-1 qkv is bound by that per-program stream).
    half = triton.next_power_of_2(D // 2)
    config = dict(_tuned(config, wqkv, x, rows, qkv=True) or {})
    parts = config.pop("parts", None)
    block_n = config.pop("block_n", None)  # a column block: the dims of a half head per program
    if parts is None and block_n:
        parts = max(1, triton.cdiv(triton.next_power_of_2(D // 2), int(block_n)))
    gemv = _gemv_requested(x, config, rows)
    if parts is None and gemv:
        parts = max(1, half // _gemv_tiles(x.shape[1], EPI_ROPE, x.device)["block_n"])
    elif parts is None and _peek_body(config) != "dot":  # streaming body: its column-block rule per half head
        parts = max(1, half // _stream_block_n(lambda bn: (HQ + 2 * HKV) * triton.cdiv(half, bn), M, 2, max(16, half),
                                                x.device))
    elif parts is None:
        parts = 1
        while half // (2 * parts) >= 16 and (HQ + 2 * HKV) * 2 * parts <= sm_count(x.device):
            parts *= 2
    block_n = max(1 if gemv else 16, half // parts)  # tl.dot needs >= 16 columns
    parts = triton.cdiv(D // 2, block_n)
    s = _launch(x, wqkv, q.view(M, HQ * D), grid_n=(HQ + 2 * HKV) * parts, block_n=block_n,
                residual=residual, norm_weight=norm_weight, eps=eps, epi=EPI_ROPE, rope_args=rope_args, x2=x2,
                norm_weight2=norm_weight2, config=config, rows=rows, sumsq=sumsq)
    if rows is not None:
        return q, None
    return q, (x if s is None else s)
