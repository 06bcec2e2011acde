"""Small-M linear layers with their neighbours fused: a decode, draft or verify layer in five launches.

At batch 1 (and at a tree's few verify rows) every projection reads its whole weight to produce a
handful of rows, and a small model's layer is bound by launches, not bytes: RMSNorm, a GEMM, RoPE +
KV write, attention, a GEMM, RMSNorm, a GEMM, SwiGLU, a GEMM. These kernels fold the elementwise
neighbours into the GEMM that reads or writes them, so a layer is

    norm_qkv_rope_write_kv_   RMSNorm(x + residual) @ wqkv^T -> RoPE -> K/V into the paged cache
    paged_attention           (attention.py)
    linear_residual           o @ wo^T + residual, with its rows' sums of squares
    norm_swiglu               silu(gate) * up of RMSNorm(s) @ w13^T
    linear_residual           act @ w2^T + residual, with its rows' sums of squares

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
grid). Two bodies, by the number of rows:
- one row (GEMV, BLOCK_M = 1; projections up to GEMV_MAX_COLUMNS outputs): fp32 products on CUDA cores
  into a [BLOCK_N, BLOCK_K] accumulator, summed over k once at the end, so BLOCK_N may be 4 or 8 (many
  programs, each streaming a narrow slab of the weight). The next chunk's weight tiles are loaded before
  the current chunk is used (register double buffering) and the first chunk is requested before the norm
  pass, which reads the whole row in one load: Triton's software pipeliner did not overlap these loads,
  so without the explicit prefetch each iteration waited on its own load.
- several rows (the streaming body, BLOCK_M = 16, 32, 64): where a norm, residual or second input is
  involved, a prologue launch (``_stream_prologue_kernel``, one program per row) writes s and the ready
  rows y = [RMSNorm(x + residual) | RMSNorm2(x2)]. The GEMM then streams only weight and y tiles,
  swap-AB: ``acc[BLOCK_N, BLOCK_M] += w[BLOCK_N, BLOCK_K] @ y^T[BLOCK_K, BLOCK_M]`` (the weight is the
  MMA's large side, tokens the small one; transposed once for the epilogue), with pipelined loads and
  nothing else in the K loop. Normalising between a tile's load and its dot (a layout conversion and two
  roundings per chunk) cost each GEMM more than the prologue launch, which is nearly free: under PDL the
  GEMM launches at the prologue's start and asks for its first weight columns into L2
  (prefetch.global.L2) before it waits for y. A plain linear (wo, w2, fc over gathered rows) is the GEMM
  alone, reading x (or its gathered rows) directly. Column blocks: the widest that still gives every SM
  a block, but no narrower than BLOCK_M / accumulators (the y tiles a program reads from L2 stay no
  larger than its weight tiles); plain projections take STREAM_PLAIN_BLOCK_N. With fewer blocks than SMs
  a long K loop is split over several programs per block (split-K, ``_split_reduce``: fp32 partials, an
  arrival counter, the last split to arrive sums them in split order and runs the block's epilogue);
  short loops run whole (SPLIT_MIN_CHUNKS). A tile table (kernel option stream_tiles) overrides these
  rules per weight shape, rows and device.
M is a runtime argument: one compile per BLOCK_M bucket (1, 16, 32, 64), no recompile per batch size.

Norm statistics from the producer (``linear_residual``): the projection that closes a residual block
(wo, w2) adds the residual in its epilogue, s = dt(dt(x @ w^T) + residual) (the rounding the next
norm's residual add makes), and each column block (after its split-K reduction) writes the sums of
s^2 of its rows over its columns, fp32 [blocks, M]. The next norm_* launch takes them (``sumsq=``,
residual None) with the norm weight folded into its weight's input columns (``fold_norm`` in
specdec.models.ops; norm_weight None): the plain streaming K loop, then each row's products scaled by
its 1 / rms before the epilogue. Math: rstd(s) * (s @ (w * nw)^T), so the normalised rows are never
rounded on their own and the folded weight is rounded once. A streamed layer is then two launches
shorter; only the first layer's qkv, whose input is the embedding, keeps a prologue. (With a norm
weight instead of a folded one, ``sumsq`` is not needed: the kernel normalises s itself.)

Gathered rows (``rows=(index, group)``, linear and the qkv kernel): row m = g * W + j of the input is
row ``g * group + max(index[g, j], 0)`` of x, for an int index [G, W] (M = G * W; rows of index may be
strided): the layer reads its rows straight from a table, so a gather (and the clamp of a -1 index)
costs no launch of its own. EAGLE-3 uses it for the draft's token embeddings (index = token ids,
group 0, x = the embedding table) and for the fc over the accepted path's captured features in the
draft extend (index = accepted node ids [B, Te], group = T, x = the [B * T, 3H] features). Math:
``gather_rows_ref`` then the layer's reference; no residual with gathered rows (s is not returned).

Routing (which rows and weights come here, the rest going to norm + cuBLAS + epilogue kernels) is
``specdec.models.ops``'s; the measurements behind it and behind the tile rules below:
docs/kernel_notes.md "Fused small-M layers".

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
from .attention_launch import PDL_EARLY, PDL_LATE, pdl_mode, sm_count
from .norm import rms_norm_ref
from .rope import rope_write_kv_ref_

MAX_M = 64
# One-row projections up to this many output columns take the GEMV body. Wider ones (LM heads) take the
# streaming body: the GEMV's narrow column slabs streamed a 49152-column LM head slower than 16-row
# tensor-core tiles.
GEMV_MAX_COLUMNS = 16384
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# With PDL, the qkv kernel (RoPE epilogue) lets its successor, the attention, launch at its start
# instead of after its weight stream when its weights are at most QKV_EARLY_MAX_BYTES: the attention
# programs then read their lengths and prefetch their cached prefix while a short qkv kernel runs. A
# long one (Llama-3.1-8B's 50 MB) is slowed by programs waiting beside it, so it triggers late.
QKV_EARLY_MAX_BYTES = 8 << 20
# The streaming body splits K (split-K) only for loops of at least this many BLOCK_K chunks: storing the
# partials, counting the arrivals and the last program's reduction cost more than a loop of five
# chunks (SmolLM2's K = 576), while a loop of twelve (its w2, K = 1536) gains from six splits.
SPLIT_MIN_CHUNKS = 8
# The streaming body's column block for plain projections (linear, linear_residual: wo, w2, the draft's
# fc and down projection): 64 columns beat the rule of _stream_block_n (which gave SmolLM2's 576-wide
# wo 16 or 32) in the graphed tree step, and 16 or 128 did not.
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
    start (USE_PDL = PDL_EARLY: the GEMM prefetches its weights meanwhile, then waits for this grid) or
    once its rows are written (PDL_LATE)."""
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
    x_ptr,  # [M, K] input rows (streaming body: ready to multiply, or gathered through xi)
    r_ptr,  # [M, K] residual (GEMV with HAS_RESIDUAL) | [M, NOUT] the residual RES_STATS adds
    nw_ptr,  # [K] norm weight (GEMV with NORM)
    s_ptr,  # [M, K] x + residual out (GEMV with HAS_RESIDUAL)
    x2_ptr,  # [M, K2] second input (GEMV with TWO_INPUTS): columns K .. K + K2 of the weight
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
    ss_ptr,  # [n_ss, M] fp32 row sums of squares per column block: written (RES_STATS), read (ROW_SCALE)
    n_ss,  # ROW_SCALE: partial rows of ss to sum
    stride_ss,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,  # D / 2 (rope)
    PARTS: tl.constexpr,  # programs per head (rope): each owns BLOCK_N = HALF / PARTS dims of both halves
    PS: tl.constexpr,
    NORM: tl.constexpr,  # GEMV: RMSNorm of x (+ residual) in the kernel
    HAS_RESIDUAL: tl.constexpr,  # GEMV: s = x + residual stored and normalised
    TWO_INPUTS: tl.constexpr,  # GEMV: [norm(x) | norm2(x2)] @ w^T as two K ranges
    HAS_ADD: tl.constexpr,
    EPI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    GEMV: tl.constexpr,  # BLOCK_M = 1: CUDA-core products; else the streaming body
    BLOCK_SS: tl.constexpr,  # GEMV: the sum-of-squares pass reads the whole row in one load
    USE_PDL: tl.constexpr,  # programmatic dependent launch: 0, PDL_LATE or PDL_EARLY trigger
    GATHER: tl.constexpr,  # x rows read through xi (no residual then)
    PREFETCH: tl.constexpr = 0,  # streaming body with PDL: weight columns of the first block prefetched before the wait
    LINE: tl.constexpr = 64,  # elements per 128-byte line (PREFETCH)
    SPLIT: tl.constexpr = 1,  # streaming body: K split over SPLIT programs per column block (_split_reduce)
    RES_STATS: tl.constexpr = False,  # epilogue none: out = dt(dt(x @ w^T) + r), its squares summed per block
    ROW_SCALE: tl.constexpr = False,  # rows' 1 / rms from the ss partials scale the products (folded norm weight)
    SS_ROWS: tl.constexpr = 1,  # a power of two >= n_ss (ROW_SCALE)
):
    i_p, i_m = tl.program_id(0), tl.program_id(1)
    if USE_PDL == 2:  # early: let the next kernel launch at once
        tlc.gdc_launch_dependents()
    # Split-K: K chunks per split (SPLIT = 1: the whole K)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    if PREFETCH > 0 and USE_PDL:  # the weights never change: request them while the inputs are made
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
    b_rs = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ROW_SCALE:  # the producer's epilogue summed the squares of x's rows per column block: 1 / rms per row
        o_j = tl.arange(0, SS_ROWS)
        b_pss = tl.load(ss_ptr + o_j[:, None] * stride_ss + o_m[None, :], mask=(o_j < n_ss)[:, None] & m_m[None, :],
                        other=0.0)  # [SS_ROWS, BLOCK_M]
        b_rs = tl.math.rsqrt(tl.sum(b_pss, axis=0) / K + eps)

    # Column blocks i_p, i_p + P, ... (P programs along axis 0; P = n_blocks: one block each).
    # (Split-K: SPLIT programs per block, task i_t = block i_t // SPLIT, split i_t % SPLIT.)
    for i_t in range(i_p, n_blocks * SPLIT, tl.num_programs(0)):
        i_n = i_t // SPLIT
        i_s = i_t % SPLIT
        i_head, o_hc, o_wa, o_wb, m_w = _block_rows(i_n, NOUT, EPI, HALF, PARTS, BLOCK_N)

        if GEMV:
            acc_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_a, acc_b = _accumulate_gemv(acc_a, acc_b, x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, 0, o_wa, o_wb, m_w, K,
                                            eps, stride_w, i_n, NORM, HAS_RESIDUAL, EPI != _EPI_NONE, BLOCK_K,
                                            BLOCK_SS, USE_PDL)
            if TWO_INPUTS:
                acc_a, acc_b = _accumulate_gemv(acc_a, acc_b, x2_ptr, x2_ptr, nw2_ptr, x2_ptr, w_ptr, K, o_wa, o_wb,
                                                m_w, K2, eps, stride_w, i_n, True, False, EPI != _EPI_NONE, BLOCK_K,
                                                BLOCK_SS, USE_PDL)
        else:
            acc_a = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_b = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            k_lo = i_s * k_per_split
            acc_a, acc_b = _accumulate_stream(acc_a, acc_b, x_ptr, w_ptr, o_xm, m_m, o_wa, o_wb, m_w, k_lo,
                                              tl.minimum(k_lo + k_per_split, K), stride_x, stride_w, EPI != _EPI_NONE,
                                              BLOCK_K, DOT_PREC)
        if USE_PDL == 1:  # late: this block's weights are read (a one-block program has only its epilogue
            tlc.gdc_launch_dependents()  # left; a persistent program signals after its first block)
        m_e = m_m  # the epilogue's rows (split-K: only in the block's last split to arrive)
        if GEMV:
            acc_a = tl.sum(acc_a, axis=1)[None, :]  # [1, BLOCK_N]
            acc_b = tl.sum(acc_b, axis=1)[None, :]
        else:
            if SPLIT > 1:
                acc_a, acc_b, is_last = _split_reduce(acc_a, acc_b, part_ptr, cnt_ptr, i_m * n_blocks + i_n, i_s,
                                                      SPLIT, EPI != _EPI_NONE, BLOCK_N, BLOCK_M)
                m_e = m_m & is_last
            if ROW_SCALE:  # the norm weight is in w's columns: 1 / rms of each row scales its products
                acc_a = acc_a * b_rs[None, :]
                acc_b = acc_b * b_rs[None, :]
            acc_a = tl.trans(acc_a)  # [BLOCK_N, BLOCK_M] -> the epilogue's [BLOCK_M, BLOCK_N]
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


def _default_block_n(x, config, epi, rows=None, n_cols=None, hi=128, plain=False):
    """Column block when the caller gave none: the GEMV tile's, or the streaming body's (n_cols output
    columns per accumulator, at most hi; ``plain`` projections, linear and linear_residual:
    STREAM_PLAIN_BLOCK_N, no wider than the output)."""
    if _gemv_requested(x, config, rows):
        return _gemv_tiles(x.shape[1], epi, x.device)["block_n"]
    if plain:
        return min(STREAM_PLAIN_BLOCK_N, max(16, triton.next_power_of_2(n_cols)))
    return _stream_block_n(lambda bn: triton.cdiv(n_cols, bn), _num_rows(x, rows), 1 if epi == EPI_NONE else 2,
                           hi, x.device)


def _tuned(config, w, x, rows=None, qkv=False):
    """config over the kernel option stream_tiles' entry (options.load_tiles; "builtin": the packaged
    tables) for w's shape at this many rows on x's device; config's own keys win. Only where the
    streaming body runs (several rows, not a forced GEMV); elsewhere, or without a table or a
    matching entry, config as given. "parts" (programs per head) is the qkv launcher's alone: other
    launchers skip it."""
    value = options.get().stream_tiles
    if value is None:
        return config
    entries = options.tile_entries(value, _device_name(x.device))
    if not entries:
        return config
    M = _num_rows(x, rows)
    if M < 2 or (config or {}).get("gemv"):
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
    SPLIT_MIN_CHUNKS BLOCK_K chunks, enough splits to give every SM a program, keeping at least two
    chunks per split. Shorter loops run whole: the partials' store, count and reduction cost more than
    the loop they split."""
    sms = sm_count(device)
    chunks = triton.cdiv(K, block_k)
    if grid_n >= sms or chunks < SPLIT_MIN_CHUNKS:
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
    """GEMV tile defaults: block_n (output columns per program and accumulator), BLOCK_K, num_warps,
    from sweeps with the weights streamed from HBM (bench_linear.py --sweep --kinds gemv). Short rows
    (K <= 2048) keep a plain projection's chunks small and its programs many (4 x 128, 8 warps); with
    the norm or two accumulators 8 x 256 with 4 warps; long rows stream 8 x 512 chunks, and the wide
    gate|up of a large model runs a persistent grid of two programs per SM with 8 warps."""
    if epi == EPI_SWIGLU and K > 2048:
        return {"block_n": 8, "BLOCK_K": 512, "num_warps": 8, "programs": 2 * sm_count(device)}
    if epi != EPI_NONE:
        return {"block_n": 8, "BLOCK_K": 256, "num_warps": 4}
    if K <= 2048:
        return {"block_n": 4, "BLOCK_K": 128, "num_warps": 8}
    return {"block_n": 8, "BLOCK_K": 512, "num_warps": 4}


def _stream_tiles(K, block_m, block_n, n_acc, esize):
    """Streaming-body defaults: BLOCK_K for ~24 KB of weight and rows per pipeline stage (n_acc x
    [BLOCK_N, BLOCK_K] + [BLOCK_M, BLOCK_K]), between 32 and 256 and no wider than K needs; 4 stages
    (~96 KB of shared memory in flight per program), 4 warps. The tile sweeps (bench_linear.py
    --small-m-grid) found these near each projection's best; a shape's own optimum goes into a tile
    table (kernel option stream_tiles)."""
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
    x's rows' sums of squares in partials (a linear_residual's), with norm_weight None and w's columns
    scaled by the norm weight: the streaming body scales each row's products by its 1 / rms before the
    epilogue, without a prologue launch (with a norm weight sumsq is not needed and not read).
    ``config`` overrides BLOCK_K / num_warps / num_stages / programs (benchmark sweeps; the public
    launchers also take ``block_n``, and ``parts`` for the qkv kernel), "gemv" (one row), and for the
    streaming body "split_k" and "prefetch" (weight columns requested into L2 before the PDL wait,
    0 = none), "pdl" (0, PDL_LATE, PDL_EARLY). ``rows``: (index, group), gathered rows of x."""
    K = x.shape[1]
    M = _num_rows(x, rows)
    K2 = x2.shape[1] if x2 is not None else 0
    cfg = dict(config or {})
    gemv = _use_gemv(x, cfg, rows)
    # The streaming GEMM's first weight columns requested into L2 before its PDL wait (none for the GEMV,
    # which requests its first chunk itself).
    prefetch = cfg.pop("prefetch", None)
    if prefetch is None:
        prefetch = min(1024, triton.next_power_of_2(K + K2))
    line = 128 // x.element_size()
    prefetch = max(line, triton.next_power_of_2(prefetch)) if prefetch and not gemv else 0
    pdl = int(cfg.pop("pdl", pdl_mode(x.device)))  # 0 off, PDL_LATE, PDL_EARLY
    if pdl == PDL_LATE and epi == EPI_ROPE and w.numel() * w.element_size() <= QKV_EARLY_MAX_BYTES:
        pdl = PDL_EARLY  # the attention after it may launch at once (see QKV_EARLY_MAX_BYTES)
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
    row_scale = sumsq is not None and not norm
    if row_scale:
        if residual is not None or K2 or rows is not None:
            raise ValueError("sumsq: the rows' squares are summed already; no residual, second input or gather")
        if sumsq.dtype != torch.float32 or sumsq.dim() != 2 or sumsq.shape[1] != M or sumsq.stride(1) != 1:
            raise ValueError(f"sumsq must be fp32 [parts, M={M}] with contiguous rows, got {sumsq.dtype} "
                             f"{tuple(sumsq.shape)}")
        if gemv:
            raise ValueError("sumsq with a folded norm weight (norm_weight None) needs the streaming body (2+ rows); "
                             "pass the norm weight for one row")
    if M == 0:
        if stats_residual is not None:
            return torch.zeros((grid_n, 0), dtype=torch.float32, device=x.device)
        return s if norm else None
    r = residual if residual is not None else stats_residual if stats_residual is not None else x
    nw = norm_weight.contiguous() if norm else x
    if x2 is not None:
        x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
        nw2 = norm_weight2.contiguous()
    else:
        x2, nw2 = x, x  # placeholders (TWO_INPUTS=False)
    if not gemv and (norm or residual is not None or K2):
        # First launch: the ready rows y = [RMSNorm(x + residual) | RMSNorm2(x2)] (and s); the GEMM then
        # streams y like a plain linear's x (no residual, norm, second input or gather left).
        y = torch.empty((M, K + K2), dtype=x.dtype, device=x.device)
        gx, gw, gg, gs = (rows[0], rows[0].shape[1], int(rows[1]), rows[0].stride(0)) if rows is not None \
            else (x, 1, 0, 0)
        block = min(4096, triton.next_power_of_2(max(K, K2)))
        _stream_prologue_kernel[(M, 2 if K2 else 1)](
            x, r, nw, s, x2, nw2, y, K, K2, float(eps), x.stride(0), r.stride(0), x2.stride(0), y.stride(0),
            gx, gw, gg, gs, NORM=norm, HAS_RESIDUAL=residual is not None, GATHER=rows is not None, BLOCK=block,
            USE_PDL=(PDL_EARLY if prefetch else PDL_LATE) if pdl else 0, num_warps=4 if block <= 1024 else 8,
            **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
        x = r = y
        K, K2, rows, residual, norm = K + K2, 0, None, None, False
        x2 = nw2 = nw = y
    if gemv:
        cfg = {**_gemv_tiles(K, epi, x.device), "num_stages": 1, **cfg}
        cfg.pop("block_n")
    else:
        cfg = {**_stream_tiles(K, block_m, block_n, 1 if epi == EPI_NONE else 2, x.element_size()), **cfg}
    split = cfg.pop("split_k", None)
    split = int(split if split is not None else (1 if gemv else _stream_split(grid_n, K, cfg["BLOCK_K"], x.device)))
    if split < 1 or (split > 1 and gemv):
        raise ValueError(f"split_k={split}: the streaming body (2+ rows) splits K over >= 1 programs; one row "
                         "(GEMV) takes 1")
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
    ss, n_ss = (sumsq, sumsq.shape[0]) if row_scale else (part, 0)
    if stats_residual is not None:
        if epi != EPI_NONE or add is not None or norm or rows is not None:
            raise ValueError("stats_residual: a plain linear's epilogue only")
        ss, n_ss = torch.empty((grid_n, M), dtype=torch.float32, device=x.device), grid_n
    _fused_linear_kernel[(programs, triton.cdiv(M, block_m))](
        x, r, nw, s, x2, nw2, w, out, add if add is not None else out, pos, cos, sin, slots, kc, vc,
        M, K, K2, nout, grid_n, float(eps), n_pos,
        x.stride(0), r.stride(0), x2.stride(0), w.stride(0), out.stride(0), cs_stride, *kc_s, *vc_s,
        xi, xi_w, int(xi_group), xi_stride, part, counters, ss, n_ss, ss.stride(0) if n_ss else 0,
        HQ=hq, HKV=hkv, HALF=half, PARTS=parts, PS=ps, NORM=norm, HAS_RESIDUAL=residual is not None,
        TWO_INPUTS=K2 > 0, HAS_ADD=add is not None, EPI=epi,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PREC=_dot_prec(x.dtype), GEMV=gemv,
        BLOCK_SS=min(8192, triton.next_power_of_2(max(K, K2))) if gemv else 16,
        USE_PDL=pdl, GATHER=rows is not None, PREFETCH=prefetch, LINE=line, SPLIT=split,
        RES_STATS=stats_residual is not None, ROW_SCALE=row_scale,
        SS_ROWS=triton.next_power_of_2(n_ss) if row_scale else 1, **({"launch_pdl": True} if pdl else {}), **cfg,
    )  # fmt: skip
    if stats_residual is not None:
        return ss
    return s if norm_weight is not None else None


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
    bn = config.pop("block_n", None) or _default_block_n(x, config, EPI_NONE, rows, n_cols=NOUT, plain=True)
    _launch(x, w, out, grid_n=triton.cdiv(NOUT, bn), block_n=bn, nout=NOUT, add=add, config=config, rows=rows)
    return out


def linear_residual(x, w, residual, config=None):
    """The projection that closes a residual block: (s, sumsq) in one launch, for M <= MAX_M rows.

    s = dt(dt(x @ w^T) + residual) [M, NOUT] (the projection rounded, then the residual add rounded as
    norm.py does: the stream entering the next RMSNorm); sumsq fp32 [parts, M], the sums of s^2 of
    each row over the parts' column blocks (sumsq.sum(0) = sum of s^2 per row). Handing sumsq to the
    next norm_* launcher (``sumsq=``, with residual None and the norm weight folded into its weight)
    spares the streaming body its prologue launch (module docstring, "Norm statistics from the
    producer"). Reference: linear_residual_ref."""
    _check("linear_residual", x, w)
    M, NOUT = x.shape[0], w.shape[0]
    if residual is None or residual.shape != (M, NOUT) or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"linear_residual: residual must be [M, NOUT] = [{M}, {NOUT}] {x.dtype} on {x.device}, got "
                         + ("None" if residual is None else
                            f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"))
    residual = residual.contiguous()
    out = torch.empty((M, NOUT), dtype=x.dtype, device=x.device)
    config = _gemv_default(_tuned(config, w, x), NOUT)
    bn = config.pop("block_n", None) or _default_block_n(x, config, EPI_NONE, n_cols=NOUT, plain=True)
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
    x's rows' sums of squares from linear_residual (residual None), read when norm_weight is None: w's
    columns then carry the norm weight (ops.fold_norm) and 1 / rms scales the products."""
    _check("norm_linear", x, w, residual, norm_weight)
    _check_sumsq("norm_linear", residual, sumsq)
    M, NOUT = x.shape[0], w.shape[0]
    out = torch.empty((M, NOUT), dtype=x.dtype, device=x.device)
    config = _gemv_default(_tuned(config, w, x), NOUT)
    bn = config.pop("block_n", None) or _default_block_n(x, config, EPI_NONE, n_cols=NOUT)
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
    bn = config.pop("block_n", None) or _default_block_n(x, config, EPI_SWIGLU, n_cols=F, hi=64)
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
    # Programs per head: each half head split into parts (the GEMV's narrow column slabs, or the streaming
    # body's column-block rule), so that a model with few heads still spreads its weight stream over the
    # SMs: SmolLM2 (15 heads, D/2 = 32) runs 30 programs streaming 36 KB of weight each, not 15 of 73 KB.
    half = triton.next_power_of_2(D // 2)
    config = dict(_tuned(config, wqkv, x, rows, qkv=True) or {})
    parts = config.pop("parts", None)
    block_n = config.pop("block_n", None)  # a column block: the dims of a half head per program
    if parts is None and block_n:
        parts = max(1, triton.cdiv(triton.next_power_of_2(D // 2), int(block_n)))
    gemv = _gemv_requested(x, config, rows)
    if parts is None and gemv:
        parts = max(1, half // _gemv_tiles(x.shape[1], EPI_ROPE, x.device)["block_n"])
    elif parts is None:  # streaming body: its column-block rule per half head
        parts = max(1, half // _stream_block_n(lambda bn: (HQ + 2 * HKV) * triton.cdiv(half, bn), M, 2, max(16, half),
                                                x.device))
    block_n = max(1 if gemv else 16, half // parts)  # tl.dot needs >= 16 columns
    parts = triton.cdiv(D // 2, block_n)
    s = _launch(x, wqkv, q.view(M, HQ * D), grid_n=(HQ + 2 * HKV) * parts, block_n=block_n,
                residual=residual, norm_weight=norm_weight, eps=eps, epi=EPI_ROPE, rope_args=rope_args, x2=x2,
                norm_weight2=norm_weight2, config=config, rows=rows, sumsq=sumsq)
    if rows is not None:
        return q, None
    return q, (x if s is None else s)
