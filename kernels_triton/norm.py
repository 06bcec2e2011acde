"""RMSNorm with an optional fused residual add (the Llama layer boundary).

Math (Hugging Face ``LlamaRMSNorm`` convention), for one row ``x`` of width H and input dtype ``dt``:

    h   = fp32(x)
    rms = rsqrt(mean(h * h) + eps)                    # fp32
    y   = dt(h * rms)                                 # normalised row rounded back to the input dtype
    out = dt(fp32(weight) * fp32(y))                  # weight applied after the cast, rounded once

This is bit-for-bit ``weight * hidden.to(input_dtype)`` from transformers when ``weight.dtype == dt``
(the product of two bf16/fp16/fp32 values computed in fp32 and rounded once is what torch does for
that multiply). With an fp32 weight and a bf16 input, transformers would return fp32; here the
output is always ``dt``.

With ``residual`` the layer boundary ``s = x + residual`` is fused in front:

    s   = dt(fp32(x) + fp32(residual))                # the rounded sum is both normed and returned
    out = rmsnorm(s) * weight                         # as above, applied to s
    returns (out, s)

Shapes: x [N, H] (leading dims are flattened, so [..., H] works), residual like x, weight [H];
``out`` and ``s`` are new contiguous tensors shaped like x, dtype of x.

Kernel layout: one program normalises ROWS consecutive rows held as one [ROWS, BLOCK_H] tile,
BLOCK_H = next power of two >= H (masked), ROWS chosen from H only so that small rows (H = 576)
share a program. N is a runtime argument (not specialised), so one compiled kernel serves every
batch size and a CUDA graph can be captured per bucket without host synchronisation.

Invariants: H <= 8192; the last dim of x / residual is contiguous (row stride is free); weight is
contiguous.
"""

import torch
import triton
import triton.language as tl

MAX_H = 8192


def rms_norm_ref(x, weight, eps, residual=None):
    """Plain-torch RMSNorm (+ fused residual add); same convention as the module docstring."""
    dt = x.dtype
    if residual is not None:
        s = (x.float() + residual.float()).to(dt)
        return rms_norm_ref(s, weight, eps), s
    h = x.float()
    y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    return (weight.float() * y.float()).to(dt)


@triton.jit(do_not_specialize=["n_rows"])
def rms_norm_kernel(
    x_ptr,  # [N, H] input rows
    r_ptr,  # [N, H] residual rows (unused without HAS_RESIDUAL)
    w_ptr,  # [H] weight
    o_ptr,  # [N, H] normalised output
    s_ptr,  # [N, H] x + residual output (unused without HAS_RESIDUAL)
    n_rows,
    H,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_n = (i_n * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # int64: N * stride may pass 2**31
    o_h = tl.arange(0, BLOCK_H)
    m_n = o_n < n_rows
    m_h = o_h < H
    m_nh = m_n[:, None] & m_h[None, :]

    p_x = x_ptr + o_n[:, None] * stride_x + o_h[None, :]
    b_x = tl.load(p_x, mask=m_nh, other=0.0).to(tl.float32)  # [ROWS, BLOCK_H]
    if HAS_RESIDUAL:
        p_r = r_ptr + o_n[:, None] * stride_r + o_h[None, :]
        b_r = tl.load(p_r, mask=m_nh, other=0.0).to(tl.float32)  # [ROWS, BLOCK_H]
        # Round the sum to the storage dtype first: the returned s and the normed s must agree.
        b_s = (b_x + b_r).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + o_n[:, None] * stride_s + o_h[None, :], b_s, mask=m_nh)
        b_x = b_s.to(tl.float32)

    b_rstd = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) / H + eps)  # [ROWS]
    # Cast back to the input dtype before the weight (transformers' order), then round once more.
    b_y = (b_x * b_rstd[:, None]).to(o_ptr.dtype.element_ty).to(tl.float32)  # [ROWS, BLOCK_H]
    b_w = tl.load(w_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)  # [BLOCK_H]
    b_o = (b_y * b_w[None, :]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + o_n[:, None] * stride_o + o_h[None, :], b_o, mask=m_nh)


def _launch_config(H):
    """BLOCK_H, ROWS and num_warps for rows of width H (depends on H only: one compile per H)."""
    block_h = triton.next_power_of_2(H)
    rows = max(1, min(16, 2048 // block_h))  # ~2048-element tiles: H=576 -> 2 rows, H>=2048 -> 1
    tile = rows * block_h
    num_warps = 16 if tile >= 8192 else 8 if tile >= 4096 else 4
    return block_h, rows, num_warps


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rows_2d(t, H):
    """View t as [N, H] without copying when possible; the last dim must be contiguous."""
    t2 = t.reshape(-1, H)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def rms_norm(x, weight, eps, residual=None):
    """RMSNorm of x's last dim (optionally of x + residual) in one Triton launch.

    Args:
        x: [N, H] (or [..., H]) fp32 / fp16 / bf16, last dim contiguous.
        weight: [H], any float dtype (read as fp32).
        eps: float added to mean(x^2).
        residual: None, or a tensor shaped and typed like x.

    Returns:
        ``out`` if residual is None, else ``(out, s)`` with ``s = x + residual`` (rounded to x.dtype);
        both new tensors shaped like x. See the module docstring for the exact rounding convention.
    """
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"rms_norm: x must be float32/float16/bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm: x must be [..., H] with H >= 1, got shape {tuple(x.shape)}")
    H = x.shape[-1]
    if H > MAX_H:
        raise ValueError(f"rms_norm: H={H} exceeds the supported maximum {MAX_H}")
    if weight.dim() != 1 or weight.shape[0] != H:
        raise ValueError(f"rms_norm: weight must be [H]=[{H}], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"rms_norm: weight must be a float tensor, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight is on {weight.device}, x on {x.device}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                "rms_norm: residual must match x in shape and dtype, got "
                f"{tuple(residual.shape)} {residual.dtype} vs x {tuple(x.shape)} {x.dtype}"
            )
        if residual.device != x.device:
            raise ValueError(f"rms_norm: residual is on {residual.device}, x on {x.device}")

    x2 = _rows_2d(x, H)  # [N, H]
    N = x2.shape[0]
    w = weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    o2 = out.view(-1, H)  # [N, H]
    if residual is not None:
        r2 = _rows_2d(residual, H)  # [N, H]
        s = torch.empty_like(out)
        s2 = s.view(-1, H)  # [N, H]
    else:
        r2, s2 = x2, o2  # placeholders, never dereferenced (HAS_RESIDUAL=False)
    if N == 0:
        return (out, s) if residual is not None else out

    block_h, rows, num_warps = _launch_config(H)
    grid = (triton.cdiv(N, rows),)
    rms_norm_kernel[grid](
        x2, r2, w, o2, s2,
        N, H,
        x2.stride(0), r2.stride(0), o2.stride(0), s2.stride(0),
        float(eps),
        HAS_RESIDUAL=residual is not None,
        ROWS=rows,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return (out, s) if residual is not None else out
