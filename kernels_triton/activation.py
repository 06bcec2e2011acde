"""SwiGLU activation: ``silu(gate) * up`` over the output of the fused gate|up projection.

Math, for one row x of width 2F (gate = x[:F], up = x[F:], input dtype ``dt``):

    g, u = fp32(x[:F]), fp32(x[F:])
    out  = dt(g / (1 + exp(-g)) * u)                  # silu(g) * u in fp32, rounded once

In fp32 this is ``torch.nn.functional.silu(gate) * up`` up to the exp's last-ulp rounding. In
fp16/bf16 torch eager rounds twice (silu to ``dt``, then the product); here the product is rounded
once, so half-precision outputs can differ from eager torch by one ulp (and are closer to exact).

Shapes: x [N, 2F] (leading dims are flattened, so [..., 2F] works), out [N, F] (new, contiguous,
x's dtype). The two halves are read in place: x may be the [N, 2F] result of ``h @ w13.t()`` with
w13 = cat(gate_proj, up_proj), no ``chunk`` copy.

Kernel layout: grid (N, ceil(F / BLOCK_F)); one program reads BLOCK_F gate and BLOCK_F up values of
one row and writes BLOCK_F outputs. N rides on grid axis 0 (no 65535 limit) and is not a kernel
argument, so one compile serves every batch size and a CUDA graph captures it per bucket.

Invariants: the last dim of x is contiguous (row stride is free); 2F is even.
"""

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def silu_mul_ref(x):
    """Plain-torch ``silu(x[..., :F]) * x[..., F:]`` in fp32, rounded once to x.dtype."""
    gate, up = x.float().chunk(2, dim=-1)  # [..., F] each
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


@triton.jit
def silu_mul_kernel(
    x_ptr,  # [N, 2F]
    o_ptr,  # [N, F] contiguous
    F,
    stride_x,
    BLOCK_F: tl.constexpr,
):
    i_n, i_f = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
    m_f = o_f < F
    p_g = x_ptr + i_n * stride_x + o_f
    b_g = tl.load(p_g, mask=m_f, other=0.0).to(tl.float32)  # [BLOCK_F] gate
    b_u = tl.load(p_g + F, mask=m_f, other=0.0).to(tl.float32)  # [BLOCK_F] up
    # g / (1 + e^-g): for g -> -inf, e^-g = inf and the quotient is -0, as torch's silu gives.
    b_o = b_g / (1.0 + tl.exp(-b_g)) * b_u
    tl.store(o_ptr + i_n * F + o_f, b_o.to(o_ptr.dtype.element_ty), mask=m_f)


def _launch_config(F):
    """BLOCK_F and num_warps from F only (one compile per F): 8 elements per thread, 16-byte bf16
    vectors; F = 1536 (SmolLM2) -> 2 programs per row, F = 14336 (Llama-3.1-8B) -> 14."""
    block_f = min(1024, triton.next_power_of_2(F))
    return block_f, max(1, min(4, block_f // 256))


def silu_mul(x):
    """``silu(gate) * up`` for x = [gate | up] of shape [..., 2F], in one launch.

    Returns a new contiguous [..., F] tensor in x's dtype (math in fp32, one rounding).
    """
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"silu_mul: x must be float32/float16/bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_mul: x must be [..., 2F] with an even, positive last dim, got {tuple(x.shape)}")
    F = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * F)  # [N, 2F], a view when possible
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    N = x2.shape[0]
    out = torch.empty((*x.shape[:-1], F), dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    block_f, num_warps = _launch_config(F)
    silu_mul_kernel[(N, triton.cdiv(F, block_f))](
        x2, out, F, x2.stride(0), BLOCK_F=block_f, num_warps=num_warps,
    )  # fmt: skip
    return out
