"""Weight-only int8 linear for few rows: out = dt((x @ q^T) * scale [+ add]).

A projection at batch 1 (a draft round, a draft extend) reads its whole weight to produce a handful
of rows, so its time is the weight's bytes over the memory bandwidth. Stored as int8 with one fp32
scale per output row (symmetric, ``quantize``), the weight streams in half the bytes of bf16.

Math, for M rows x [M, K] in dtype ``dt``, q [NOUT, K] int8, scale [NOUT] fp32:

    acc[m, n] = sum_k fp32(x[m, k]) * fp32(dt(q[n, k]))    (tl.dot of x with q cast to dt, fp32
                                                            accumulation; q's values are exact in bf16)
    out[m, n] = dt(acc[m, n] * scale[n] [+ add[m, n]])       one rounding

so the result equals ``linear_w8_ref`` (the same product of x and the dequantized weight
dt(q) * scale, in fp32) up to summation order.

Kernel layout (swap-AB, as the streaming body of linear.py): a program owns BLOCK_N output columns
and one block of BLOCK_M rows and streams ``acc[BLOCK_N, BLOCK_M] += dt(q[BLOCK_N, BLOCK_K]) @
x^T[BLOCK_K, BLOCK_M]`` with num_stages pipelined loads (the weight is the MMA's large side). With
fewer column blocks than SMs the K range is split over SPLIT programs per block: each writes fp32
partials and ``_w8_reduce_kernel`` sums them in split order and runs the epilogue.

Launch choices come from static information only (shapes, SM count), so a call is CUDA-graph
capturable. More than ``MAX_ROWS`` rows (a prefill) is the caller's to route elsewhere (the
weight's bf16 original through cuBLAS: specdec.models.ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_launch import sm_count

MAX_ROWS = 64  # rows a launch takes (BLOCK_M <= 64); more: the caller's dense path
QMAX = 127  # symmetric int8: q in [-127, 127]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [NOUT, K] int8, scale [NOUT] fp32) with w ~ q * scale[:, None]: per output row, scale =
    max |w| / 127 (1 for an all-zero row), q = round(w / scale)."""
    if w.dim() != 2:
        raise ValueError(f"quantize: w must be [NOUT, K], got {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def linear_w8_ref(x, q, scale, add=None):
    """The torch reference: fp32 (x @ (q * scale)^T) [+ add], rounded once to x's dtype."""
    y = (x.float() @ q.float().t()) * scale.float()[None, :]
    if add is not None:
        y = y + add.float()
    return y.to(x.dtype)


@triton.jit
def _w8_linear_kernel(x_ptr, q_ptr, s_ptr, a_ptr, y_ptr, p_ptr, M, NOUT, K, k_per_split,
                      stride_xm, stride_qn, stride_am, stride_ym,
                      HAS_ADD: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
                      EVEN_K: tl.constexpr):
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    i_s = tl.program_id(2)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    m_n = o_n < NOUT
    m_m = o_m < M
    k_lo = i_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    p_q = q_ptr + o_n.to(tl.int64)[:, None] * stride_qn + o_k[None, :]
    p_x = x_ptr + o_m.to(tl.int64)[None, :] * stride_xm + o_k[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:  # no mask along K: the int8 row loads stay 16-byte vectors
            b_q = tl.load(p_q + k0, mask=m_n[:, None], other=0)  # [BLOCK_N, BLOCK_K] int8
            b_x = tl.load(p_x + k0, mask=m_m[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]
        else:
            m_k = (k0 + o_k) < k_hi
            b_q = tl.load(p_q + k0, mask=m_n[:, None] & m_k[None, :], other=0)
            b_x = tl.load(p_x + k0, mask=m_k[:, None] & m_m[None, :], other=0.0)
        acc = tl.dot(b_q.to(b_x.dtype), b_x, acc, input_precision=DOT_PREC)  # |q| <= 127: exact in bf16 / fp16
    if SPLIT:
        # fp32 partials [SPLIT, M, NOUT]; _w8_reduce_kernel sums them and runs the epilogue
        p_p = p_ptr + (i_s * M + o_m.to(tl.int64))[None, :] * NOUT + o_n[:, None]
        tl.store(p_p, acc, mask=m_n[:, None] & m_m[None, :])
    else:
        b_s = tl.load(s_ptr + o_n, mask=m_n, other=0.0)  # [BLOCK_N] fp32
        out = acc * b_s[:, None]
        if HAS_ADD:
            out += tl.load(a_ptr + o_m.to(tl.int64)[None, :] * stride_am + o_n[:, None],
                           mask=m_n[:, None] & m_m[None, :], other=0.0).to(tl.float32)
        p_y = y_ptr + o_m.to(tl.int64)[None, :] * stride_ym + o_n[:, None]
        tl.store(p_y, out.to(y_ptr.dtype.element_ty), mask=m_n[:, None] & m_m[None, :])


@triton.jit
def _w8_reduce_kernel(p_ptr, s_ptr, a_ptr, y_ptr, M, NOUT, stride_am, stride_ym,
                      HAS_ADD: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)
    o_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < NOUT
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):  # split order: the same sum on every call
        acc += tl.load(p_ptr + (s * M + i_m) * NOUT + o_n, mask=m_n, other=0.0)
    out = acc * tl.load(s_ptr + o_n, mask=m_n, other=0.0)
    if HAS_ADD:
        out += tl.load(a_ptr + i_m * stride_am + o_n, mask=m_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + i_m * stride_ym + o_n, out.to(y_ptr.dtype.element_ty), mask=m_n)


def launch_config(M: int, NOUT: int, K: int, device) -> dict:
    """BLOCK_M / BLOCK_N / BLOCK_K, split count, warps and stages from static shapes.

    Up to 16 rows (BLOCK_M 16) the int8 -> bf16 conversion of the weight tile is the kernel's largest
    instruction stream, so warps are laid out along the weight rows only: with 4 warps the mma layout
    of a [32, 16] accumulator is 2 x 2 and every weight element is converted by two warps; 2 warps over
    32 rows (1 over 16) convert each once. 32-row blocks in two K splits of 256-wide chunks where they
    are fewer than twice the SMs (4096 / 6144 wide projections: 128 / 192 blocks); 64-row blocks over
    whole K where there are more (gate|up, lm_head); far fewer blocks than SMs (small models) split K
    further, each split keeping >= 4 chunks. 17-64 rows: 4 warps, 128-wide chunks. The sweeps behind
    these choices: experiments/kernels/bench_linear_w8.py --sweep (docs/kernel_notes.md)."""
    block_m = max(16, triton.next_power_of_2(M))
    block_n = 32 if NOUT >= 2048 else 16
    if block_m <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=256, num_warps=block_n // 16, num_stages=4, split=1)
    else:
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, num_warps=4, num_stages=4, split=1)
    sms = sm_count(device)
    grid_n = triton.cdiv(NOUT, block_n)
    if grid_n < sms // 2:
        cfg["split"] = max(1, min(sms // grid_n, K // (4 * cfg["BLOCK_K"]), 16))
    elif block_m <= 16 and grid_n < 2 * sms:
        cfg["split"] = 2 if K >= 4 * 1024 else 1
    elif block_m <= 16:
        cfg.update(BLOCK_N=64, num_stages=3)
    return cfg


def linear_w8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, add: torch.Tensor | None = None,
              config: dict | None = None) -> torch.Tensor:
    """dt((x @ q^T) * scale [+ add]) for x [M, K] (M <= MAX_ROWS, bf16 / fp16 / fp32), q [NOUT, K] int8,
    scale [NOUT] fp32, add [M, NOUT] or None. ``config``: launch_config overrides (benchmarks)."""
    if x.dim() != 2 or q.dim() != 2 or x.shape[1] != q.shape[1]:
        raise ValueError(f"linear_w8: x [M, K] and q [NOUT, K] must share K, got {tuple(x.shape)} and {tuple(q.shape)}")
    if q.dtype != torch.int8 or scale.dtype != torch.float32 or scale.shape != (q.shape[0],):
        raise ValueError(f"linear_w8: q must be int8 and scale fp32 [NOUT], got {q.dtype}, {scale.dtype} "
                         f"{tuple(scale.shape)}")
    M, K = x.shape
    NOUT = q.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"linear_w8: at most {MAX_ROWS} rows, got {M}")
    if add is not None and add.shape != (M, NOUT):
        raise ValueError(f"linear_w8: add must be [M, NOUT] = [{M}, {NOUT}], got {tuple(add.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if q.stride(1) != 1:
        q = q.contiguous()
    y = torch.empty((M, NOUT), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = launch_config(M, NOUT, K, x.device) | (config or {})
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], int(cfg["split"])
    k_per = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per)
    part = torch.empty((split, M, NOUT), dtype=torch.float32, device=x.device) if split > 1 else y
    a = add if add is not None else y
    grid = (triton.cdiv(NOUT, bn), triton.cdiv(M, bm), split)
    _w8_linear_kernel[grid](x, q, scale, a, y, part, M, NOUT, K, k_per, x.stride(0), q.stride(0), a.stride(0),
                            y.stride(0), HAS_ADD=add is not None, SPLIT=split > 1, BLOCK_M=bm, BLOCK_N=bn,
                            BLOCK_K=bk, EVEN_K=K % bk == 0, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
                            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split > 1:
        block = 1024
        _w8_reduce_kernel[(M, triton.cdiv(NOUT, block))](part, scale, a, y, M, NOUT, a.stride(0), y.stride(0),
                                                         HAS_ADD=add is not None, SPLIT=split, BLOCK=block,
                                                         num_warps=4)
    return y
