"""All-reduce + residual add + RMSNorm at a tensor-parallel layer boundary, in one launch.

Math, for world size W, rank r's partial sum x_r [N, H] (the row-parallel o / down projection's
output), the residual stream ``residual`` [N, H] (identical on every rank) and input dtype ``dt``:

    s   = dt(sum_r fp32(x_r) + fp32(residual))     # the all-reduce summed in fp32, rounded once
    out = rmsnorm(s) * weight                       # the norm of kernels_triton/norm.py, applied to s
    returns (out, s) on every rank                  # s is the next residual, out feeds the projection

(NCCL's bf16 all-reduce rounds the sum to bf16 before the residual add; summing in fp32 rounds once,
so the two differ in the last bf16 bit: compare with a tolerance, fp32 compares tightly.)

One-shot all-reduce over torch symmetric memory (``torch.distributed._symmetric_memory``): each
rank's partial sum is copied into its symmetric buffer [ROWS_MAX, H]; the kernel reads every peer's
buffer directly over NVLink (pointers from ``rendezvous(...).buffer_ptrs``), sums in fp32, adds the
residual, normalises and writes its own ``out`` and ``s``. Every rank computes the same rows. No
NVLink multicast / multimem (forbidden on the lent machines): plain peer loads only.

Barriers through the symmetric-memory signal pads (uint32, zero at rest): program p of rank r
signals program p of every peer (compare-and-swap 0 -> 1 on the peer's pad slot [phase, p, r], release,
system scope) and waits for all of them (CAS 1 -> 0 on its own slots [phase, p, peer], acquire): once
before reading (every peer's copy into its buffer is done: it precedes the kernel on that rank's
stream) and once after (no peer overwrites its buffer at the next boundary while this rank still
reads it). Each wait resets its slot, so the pads are zero again after every launch: the kernel is
CUDA-graph safe (fixed pointers, no host state). The rows are split the same way on every rank
(program p handles tiles p, p + G, ...), so program p's barriers cover exactly the rows it reads.
The scalar atomics rely on Triton issuing a scalar atomic from one thread of the program.

Kernels:
* ``_fused_norm_allreduce_symm_kernel``: the one-shot path above (CUDA, W > 1).
* ``_fused_norm_allreduce_stacked_kernel``: the same arithmetic over W partial sums stacked in one
  tensor [W, N, H] of one process. W = 1 is the world-size-1 path (no communication: residual add +
  RMSNorm of x itself, exactly ``kernels_triton.norm.rms_norm``); W > 1 simulates the peers for the
  interpreter tests (which cannot follow pointers loaded from memory).

Shapes: x / residual [N, H] (last dim contiguous), weight [H]; H <= 8192; fp32 / fp16 / bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_H = 8192
MAX_PROGRAMS = 32  # persistent programs of the one-shot kernel (each barriers with its peers)


def _finish_ref(total, residual, weight, eps, dt):
    """total [N, H] fp32 (the reduced partial sums) -> (out, s) in dtype dt."""
    s = (total if residual is None else total + residual.float()).to(dt)
    h = s.float()
    y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    return (weight.float() * y.float()).to(dt), s


def fused_norm_allreduce_ref(parts, residual, weight, eps):
    """Plain torch over parts [W, N, H] (each rank's partial sum) -> (out, s), as in the docstring."""
    return _finish_ref(parts.float().sum(0), residual, weight, eps, parts.dtype)


def fused_norm_allreduce_dist_ref(x, residual, weight, eps, group=None):
    """The distributed reference: all_reduce of x (in fp32) over ``group`` + residual add + RMSNorm."""
    import torch.distributed as dist

    total = x.float()  # [N, H] a copy: x is left as it is
    dist.all_reduce(total, group=group)
    return _finish_ref(total, residual, weight, eps, x.dtype)


@triton.jit
def _add_norm_store(b_x, r_ptr, w_ptr, o_ptr, s_ptr, o_n, o_h, m_nh, m_h, H, stride_r, stride_o, stride_s, eps,
                    HAS_RESIDUAL: tl.constexpr):
    """b_x [ROWS, BLOCK_H] fp32 (the reduced rows): + residual, store s, RMSNorm * weight, store out."""
    if HAS_RESIDUAL:
        b_r = tl.load(r_ptr + o_n[:, None] * stride_r + o_h[None, :], mask=m_nh, other=0.0).to(tl.float32)
        b_x = b_x + b_r
    # Round s to the storage dtype first: the returned s and the normed s must agree.
    b_s = b_x.to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + o_n[:, None] * stride_s + o_h[None, :], b_s, mask=m_nh)
    b_x = b_s.to(tl.float32)
    b_rstd = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) / H + eps)  # [ROWS]
    b_y = (b_x * b_rstd[:, None]).to(o_ptr.dtype.element_ty).to(tl.float32)  # [ROWS, BLOCK_H]
    b_w = tl.load(w_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)  # [BLOCK_H]
    tl.store(o_ptr + o_n[:, None] * stride_o + o_h[None, :], (b_y * b_w[None, :]).to(o_ptr.dtype.element_ty),
             mask=m_nh)


@triton.jit(do_not_specialize=["n_rows"])
def _fused_norm_allreduce_stacked_kernel(
    x_ptr,  # [W, N, H] partial sums (W = 1: x itself)
    r_ptr,  # [N, H] residual
    w_ptr,  # [H] norm weight
    o_ptr,  # [N, H] out
    s_ptr,  # [N, H] new residual
    n_rows, H, stride_peer, stride_x, stride_r, stride_o, stride_s, eps,
    WORLD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_n = (i_n * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    m_nh = (o_n < n_rows)[:, None] & m_h[None, :]
    b_x = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
    for i_w in tl.static_range(WORLD):
        p_x = x_ptr + i_w * stride_peer + o_n[:, None] * stride_x + o_h[None, :]
        b_x += tl.load(p_x, mask=m_nh, other=0.0).to(tl.float32)  # [ROWS, BLOCK_H]
    _add_norm_store(b_x, r_ptr, w_ptr, o_ptr, s_ptr, o_n, o_h, m_nh, m_h, H, stride_r, stride_o, stride_s, eps,
                    HAS_RESIDUAL)


@triton.jit
def _barrier(pad_ptrs, i_p, phase, RANK: tl.constexpr, WORLD: tl.constexpr, PROGRAMS: tl.constexpr):
    """Program i_p of this rank meets program i_p of every peer (see the module docstring)."""
    o_slot = (phase * PROGRAMS + i_p) * WORLD
    for i_w in tl.static_range(WORLD):
        if i_w != RANK:
            p_peer = tl.load(pad_ptrs + i_w).to(tl.pointer_type(tl.int32)) + o_slot + RANK
            old = tl.atomic_cas(p_peer, 0, 1, sem="release", scope="sys")
            while old != 0:  # the peer has not consumed the previous signal yet
                old = tl.atomic_cas(p_peer, 0, 1, sem="release", scope="sys")
    p_own = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.int32)) + o_slot
    for i_w in tl.static_range(WORLD):
        if i_w != RANK:
            got = tl.atomic_cas(p_own + i_w, 1, 0, sem="acquire", scope="sys")
            while got != 1:
                got = tl.atomic_cas(p_own + i_w, 1, 0, sem="acquire", scope="sys")


@triton.jit(do_not_specialize=["n_rows"])
def _fused_norm_allreduce_symm_kernel(
    buf_ptrs,  # [W] int64: every rank's symmetric buffer [ROWS_MAX, H] (row stride H)
    pad_ptrs,  # [W] int64: every rank's signal pad (int32 slots)
    r_ptr, w_ptr, o_ptr, s_ptr,
    n_rows, H, stride_r, stride_o, stride_s, eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PROGRAMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i_p = tl.program_id(0)
    _barrier(pad_ptrs, i_p, 0, RANK, WORLD, PROGRAMS)  # every peer's partial sum is in its buffer
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    for i_t in range(i_p, tl.cdiv(n_rows, ROWS), PROGRAMS):
        o_n = (i_t * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        m_nh = (o_n < n_rows)[:, None] & m_h[None, :]
        b_x = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
        for i_w in tl.static_range(WORLD):
            p_buf = tl.load(buf_ptrs + i_w).to(tl.pointer_type(o_ptr.dtype.element_ty))
            b_x += tl.load(p_buf + o_n[:, None] * H + o_h[None, :], mask=m_nh, other=0.0).to(tl.float32)
        _add_norm_store(b_x, r_ptr, w_ptr, o_ptr, s_ptr, o_n, o_h, m_nh, m_h, H, stride_r, stride_o, stride_s,
                        eps, HAS_RESIDUAL)
    _barrier(pad_ptrs, i_p, 1, RANK, WORLD, PROGRAMS)  # every peer has read this rank's buffer


def _launch_config(H):
    block_h = triton.next_power_of_2(H)
    rows = max(1, min(16, 2048 // block_h))
    tile = rows * block_h
    return block_h, rows, 16 if tile >= 8192 else 8 if tile >= 4096 else 4


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(x, residual, weight):
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES or x.stride(-1) != 1:
        raise ValueError(f"fused_norm_allreduce: x must be [N, H] fp32/fp16/bf16 with a contiguous last dim, got "
                         f"{tuple(x.shape)} {x.dtype}")
    H = x.shape[1]
    if H > MAX_H:
        raise ValueError(f"fused_norm_allreduce: H={H} > {MAX_H}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"fused_norm_allreduce: residual must be like x {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if weight.shape != (H,) or not weight.is_contiguous():
        raise ValueError(f"fused_norm_allreduce: weight must be contiguous [H={H}], got {tuple(weight.shape)}")


def fused_norm_allreduce_stacked(parts, residual, weight, eps):
    """(out, s) from W partial sums stacked in one tensor parts [W, N, H] (one process): the
    world-size-1 path (W = 1) and the peer-simulating path of the tests."""
    W, N, H = parts.shape
    if parts.stride(-1) != 1:
        parts = parts.contiguous()
    _check(parts[0], residual, weight)
    out = torch.empty((N, H), dtype=parts.dtype, device=parts.device)
    s = torch.empty((N, H), dtype=parts.dtype, device=parts.device)
    block_h, rows, warps = _launch_config(H)
    r = residual if residual is not None else parts[0]
    _fused_norm_allreduce_stacked_kernel[(triton.cdiv(N, rows),)](
        parts, r, weight, out, s, N, H, parts.stride(0), parts.stride(1), r.stride(0), out.stride(0), s.stride(0),
        eps, WORLD=W, HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK_H=block_h, num_warps=warps)
    return out, s


class SymmBuffer:
    """This rank's symmetric-memory buffer [rows, H] and every peer's buffer / signal-pad pointers
    (one rendezvous at start-up, reused by every launch and every CUDA graph). ``group`` None (world
    size 1): no buffer, the kernel reads x itself."""

    def __init__(self, rows: int, H: int, dtype, device, group=None):
        self.rows, self.H, self.dtype = int(rows), int(H), dtype
        self.world, self.rank = 1, 0
        self.tensor = None
        if group is None:
            return
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before rendezvous on older torch
            symm_mem.enable_symm_mem_for_group(name)
        self.tensor = symm_mem.empty(self.rows, self.H, dtype=dtype, device=device)  # [rows, H]
        handle = symm_mem.rendezvous(self.tensor, name)
        self.handle = handle
        self.world, self.rank = handle.world_size, handle.rank
        need = 2 * MAX_PROGRAMS * self.world * 4  # bytes: two barriers x programs x peers, int32 slots
        have = getattr(handle, "signal_pad_size", None) or symm_mem.get_signal_pad_size()
        if have < need:
            raise RuntimeError(f"symmetric-memory signal pad holds {have} bytes, the kernel needs {need}")
        self.buf_ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)  # [W]
        self.pad_ptrs = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)  # [W]
        handle.get_signal_pad(self.rank, (need // 4,), dtype=torch.int32).zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every pad is zero before any rank's first launch


def fused_norm_allreduce(x, residual, weight, eps, buf: SymmBuffer | None = None):
    """(RMSNorm(sum over ranks of x + residual) * weight, sum over ranks of x + residual).

    x [N, H]: this rank's partial sum; residual [N, H] or None; weight [H]. ``buf`` None or world
    size 1: no communication (the residual add + RMSNorm of x). Otherwise x is copied into this
    rank's symmetric buffer (N <= buf.rows) and the one-shot kernel runs: every rank calls this
    at the same boundary with the same N (one launch, CUDA-graph safe)."""
    _check(x, residual, weight)
    if buf is None or buf.world == 1:
        return fused_norm_allreduce_stacked(x[None], residual, weight, eps)
    N, H = x.shape
    if N > buf.rows or H != buf.H or x.dtype != buf.dtype:
        raise ValueError(f"fused_norm_allreduce: x {tuple(x.shape)} {x.dtype} does not fit the symmetric "
                         f"buffer [{buf.rows}, {buf.H}] {buf.dtype}")
    buf.tensor[:N].copy_(x)
    out = torch.empty((N, H), dtype=x.dtype, device=x.device)
    s = torch.empty((N, H), dtype=x.dtype, device=x.device)
    block_h, rows, warps = _launch_config(H)
    r = residual if residual is not None else x
    programs = min(MAX_PROGRAMS, triton.cdiv(N, rows))
    # The grid is MAX_PROGRAMS-shaped for the barrier slots but only `programs` run: launch exactly
    # them, with PROGRAMS fixed so the slot layout (and the compiled kernel) does not depend on N.
    _fused_norm_allreduce_symm_kernel[(programs,)](
        buf.buf_ptrs, buf.pad_ptrs, r, weight, out, s, N, H, r.stride(0), out.stride(0), s.stride(0), eps,
        RANK=buf.rank, WORLD=buf.world, PROGRAMS=MAX_PROGRAMS, HAS_RESIDUAL=residual is not None, ROWS=rows,
        BLOCK_H=block_h, num_warps=warps)
    return out, s
