"""Batch-invariant linear (exact mode): out = dt(x @ w^T [+ add]), each row's value independent of M.

A token's projection must give the same bits whether it is the only row (a decode step), one of the
k + 1 rows of a verified tree, one of B rows of a batch, or a row of a prefill chunk (kernel option
``exact``, ``engine.exact``). cuBLAS and the fused small-M bodies of linear.py cannot promise that:
they pick a kernel, a tile and a split-K from M, and each choice sums the K products in another order.
Here the launch plan (:func:`plan`) is a function of the weight shape and dtype only, so every row, at
every M, is reduced by the same instructions in the same order.

Math, for M rows x [M, K] in dtype ``dt``, w [N, K] (same dtype), add [M, N] or None:

    acc[m, n] = sum over k-chunks c = 0, 1, ... (BLOCK_K wide, in order) of tl.dot(w_c, x_c^T)[n, m]
                                                   fp32 accumulation, one MMA chain per output
    out[m, n] = dt(acc[m, n] [+ fp32(add[m, n])])  one rounding (torch.addmm's convention)

Named dims: M rows (any, not specialised: the row count never reaches the compiler), N output
columns, K input features; BLOCK_M rows and BLOCK_N columns per program, BLOCK_K per chunk.

Kernel layout (swap-AB, as the streaming bodies of linear.py / linear_w8.py): a program owns BLOCK_N
output columns of one block of BLOCK_M rows and accumulates ``acc[BLOCK_N, BLOCK_M] += w[BLOCK_N,
BLOCK_K] @ x^T[BLOCK_K, BLOCK_M]`` over the whole K range, no split-K. A row's result depends on its
own inputs, the weight and the plan only: an MMA computes each output element from its row and column
alone, rows past M are masked loads (zeros), and BLOCK_M is fixed, so a single row is padded to
BLOCK_M exactly as a 64-row launch's last block is. The grid walks the row blocks of one column block
before the next (program id = column block * row blocks + row block), so a column block's weight
slab is read from DRAM once and from L2 by its other row blocks.

Why not a cheaper body at M = 1: the GEMV of linear.py sums each output over [BLOCK_N, BLOCK_K]
lanes on CUDA cores, another order than any MMA; a 1-row decode and the same token inside a verify
would differ in their last bits. Exactness needs one body at every M, and the MMA body is the one
that also serves a prefill chunk.

Invariants: x and w share one float dtype; last dims contiguous; no host sync (capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def linear_exact_ref(x, w, add=None):
    """fp32 (x @ w^T) [+ add], rounded once to x's dtype (the kernel's math up to summation order)."""
    y = x.float() @ w.float().t()
    if add is not None:
        y = y + add.float()
    return y.to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def _linear_exact_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    a_ptr,  # [M, N] (HAS_ADD)
    y_ptr,  # [M, N] out
    M, N, K, stride_xm, stride_wn, stride_am, stride_ym,
    HAS_ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    n_mblocks = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    i_n = pid // n_mblocks  # column block (outer), so its row blocks run side by side and share its weights
    i_m = pid % n_mblocks
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    m_n = o_n < N
    m_m = o_m < M
    p_w = w_ptr + o_n.to(tl.int64)[:, None] * stride_wn + o_k[None, :]  # [BLOCK_N, BLOCK_K]
    p_x = x_ptr + o_m.to(tl.int64)[None, :] * stride_xm + o_k[:, None]  # [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            b_w = tl.load(p_w + k0, mask=m_n[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
            b_x = tl.load(p_x + k0, mask=m_m[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]
        else:
            m_k = (k0 + o_k) < K
            b_w = tl.load(p_w + k0, mask=m_n[:, None] & m_k[None, :], other=0.0)
            b_x = tl.load(p_x + k0, mask=m_k[:, None] & m_m[None, :], other=0.0)
        acc = tl.dot(b_w, b_x, acc, input_precision=DOT_PREC)  # [BN, BK] @ [BK, BM] -> [BN, BM]
    m_nm = m_n[:, None] & m_m[None, :]
    if HAS_ADD:
        acc += tl.load(a_ptr + o_m.to(tl.int64)[None, :] * stride_am + o_n[:, None], mask=m_nm,
                       other=0.0).to(tl.float32)
    tl.store(y_ptr + o_m.to(tl.int64)[None, :] * stride_ym + o_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=m_nm)


def plan(N: int, K: int, dtype) -> dict:
    """The launch plan for a weight [N, K] of ``dtype``: BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages.

    A function of (N, K, dtype) only -- the row count is no argument -- which is the whole point.
    - BLOCK_M 64 rows (the MMA's n side under swap-AB): a 1-row decode pays the padded MMA, which
      hides under the weight stream; a 64-row verify or a prefill chunk gets 64 rows per weight tile.
    - BLOCK_N by the output width: 16 columns below 2048 (SmolLM2's 576 / 960-wide projections still
      give tens of programs), 32 below 16384 (an 8B model's 4096 / 6144-wide ones: 128-192 programs,
      about one per SM each streaming its slab, no split-K), 64 for wider ones (gate|up, LM heads).
    - BLOCK_K 128 (64 when K < 1024): the chunk is the unit of the summation order, fixed per K.
    - fp32 (tests, debugging): 16 x 16 x 32 tiles, ieee dots (the CPU interpreter runs them quickly).
    """
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)
    block_n = 16 if N < 2048 else 32 if N < 16384 else 64
    block_k = 128 if K >= 1024 else 64
    return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4 if block_n <= 32 else 3)


def grid(M: int, N: int, cfg: dict) -> tuple[int]:
    """Programs of one launch: row blocks x column blocks (the only place M enters)."""
    return (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)


def linear_exact(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """dt(x @ w^T [+ add]) for x [M, K], w [N, K] (one dtype of fp32 / fp16 / bf16), add [M, N] or None;
    a new [M, N] tensor. Each row's bits depend on that row, w and :func:`plan` only (module docstring)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear_exact: x [M, K] and w [N, K] must share K, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in _FLOAT_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"linear_exact: x and w must share one dtype of float32/float16/bfloat16, got "
                         f"{x.dtype} and {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"linear_exact: w is on {w.device}, x on {x.device}")
    M, K = x.shape
    N = w.shape[0]
    if add is not None and (add.shape != (M, N) or add.device != x.device):
        raise ValueError(f"linear_exact: add must be [M, N] = [{M}, {N}] on {x.device}, got {tuple(add.shape)} "
                         f"on {add.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    if add is not None and add.stride(1) != 1:
        add = add.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = plan(N, K, x.dtype)
    a = add if add is not None else y  # placeholder pointer without an add
    _linear_exact_kernel[grid(M, N, cfg)](
        x, w, a, y, M, N, K, x.stride(0), w.stride(0), a.stride(0), y.stride(0),
        HAS_ADD=add is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        EVEN_K=K % cfg["BLOCK_K"] == 0, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return y
