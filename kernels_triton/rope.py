"""Rotary position embedding (rotate-half, Hugging Face Llama layout) at arbitrary per-token positions.

Math, for one head vector x of width D at position p (tables hold D/2 frequencies per row):

    x1, x2 = x[:D/2], x[D/2:]
    c, s   = cos[p], sin[p]                           # fp32 [D/2]
    out    = concat(x1 * c - x2 * s,  x2 * c + x1 * s)

which is transformers' ``q * cos + rotate_half(q) * sin`` with cos/sin = concat(table, table).
Products are rounded to fp32 separately, then summed (no fused multiply-add), so in fp32 the result
equals transformers' op for op; in fp16/bf16 the math is fp32 with one final rounding (transformers
rounds cos/sin and every product to the model dtype instead).

Tables (``rope_tables``), matching transformers' numerics:

    inv_freq[i] = 1 / base ** (float32(2 i) / D)      # fp32, computed on the CPU like transformers'
                                                      # module init; optional Llama-3 adjustment
    angle[p, i] = float32(p) * inv_freq[i]            # fp32 product, on the target device
    cos, sin    = cos(angle), sin(angle)              # fp32 [P, D/2]

Shapes: q [N, HQ, D], k [N, HKV, D] (HQ and HKV independent, e.g. 9 and 3), positions [N]
int32/int64, cos/sin [P, D/2] fp32. Returns new contiguous (q_out, k_out) in the input dtype.

Positions are per token and need not be contiguous or distinct (tree nodes sit at prefix + depth).
Positions should lie in 0 .. P - 1; they are not checked on the host (that would synchronise). A row
whose position is out of range reads no table memory and comes out as zeros, in the kernels and the
reference alike: the engine's tree nodes past a request's last position (a speculative step of a request
that ends at max_position_embeddings) sit there, and their tokens are never kept.

Kernel layout: one program per token rotates all HQ query heads and HKV key heads of that token in
one launch, reading the token's table row once. The last dim of q/k must be contiguous; token and
head strides are free (q/k may be views into a fused QKV projection).

Fused with the KV-cache write (``rope_write_kv_``, the decode / verify / prefill layer path): the same
program also stores its rotated k and its v into the paged caches at flat slot
``slot_mapping[n] = page * PS + offset`` (k_cache, v_cache [P, PS, HKV, D]; slot < 0 = padding,
nothing written) and returns only the rotated q. Bit-for-bit ``rope`` followed by
``attention.write_kv_``: rotated k is rounded to k's dtype, then to the cache dtype; v is cast to the
cache dtype. It saves one launch per layer and the round trip of rotated k through memory. Every
load but the table row (q, k, v, position, slot) is issued first, so a program waits on two
dependent memory round trips: the position, then its table row.

Attention extras, folded into the same program (optional; compile-time flags HAS_BIAS / HAS_QK_NORM,
so a Llama layer's kernel is the plain one): ``bias`` [(HQ + 2 HKV) D] added to q | k | v (Qwen2), and
``q_norm`` / ``k_norm`` [D] RMSNorms over each query / key head before RoPE (Qwen3). Per head, in the
order and with the roundings of the separate ops they replace (``qkv + bias`` in torch, then
``norm.rms_norm`` on the [N, heads, D] views, then RoPE):

    x   = dt(fp32(x) + fp32(b))                       # the bias add, rounded to the head's dtype dt
    rms = rsqrt(sum(fp32(x) ** 2) / D + eps)          # over the head's D channels (both halves)
    x   = dt(fp32(w) * fp32(dt(fp32(x) * rms)))       # norm.rms_norm's two roundings
    out = rope(x)                                     # as above, from the rounded normed head

v gets its bias and no norm. The bias and norm weights are loaded with q, k and v, before the table
row. The sum of squares adds the two halves' sums (the kernel holds each head as halves), another
order than norm.rms_norm's one reduction over D: in fp32 they may differ in the last bits, as that
kernel and its torch reference already do.
"""

import math

import torch
import triton
import triton.language as tl

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _inv_freq_llama3(inv_freq, scaling):
    """Llama-3 frequency adjustment, in fp32 with transformers' operation order.

    Wavelengths shorter than original_max / high_freq_factor keep their frequency, those longer than
    original_max / low_freq_factor are divided by ``factor``, and the band in between blends the two
    with a weight linear in original_max / wavelength.
    """
    missing = [key for key in _LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"rope_tables: llama3 scaling needs keys {list(_LLAMA3_KEYS)}, missing {missing}")
    factor = scaling["factor"]
    low_ff = scaling["low_freq_factor"]
    high_ff = scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    if not high_ff > low_ff:
        raise ValueError(
            f"rope_tables: llama3 scaling needs high_freq_factor > low_freq_factor, got {high_ff} <= {low_ff}"
        )

    wavelen = 2 * math.pi / inv_freq  # [D/2] fp32
    is_long = wavelen > old_len / low_ff  # low frequencies: interpolate by factor
    is_short = wavelen < old_len / high_ff  # high frequencies: unchanged
    scaled = torch.where(is_long, inv_freq / factor, inv_freq)
    w_short = (old_len / wavelen - low_ff) / (high_ff - low_ff)  # 0 at the long edge, 1 at the short edge
    blended = (1 - w_short) * scaled / factor + w_short * scaled
    return torch.where(~is_long & ~is_short, blended, scaled)


def _rope_type(scaling):
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        raise ValueError(f"rope_tables: scaling dict has no 'rope_type' key: {scaling}")
    return rope_type


def rope_tables(head_dim, max_positions, base, scaling=None, device=None):
    """cos/sin tables, fp32 [max_positions, head_dim // 2], for ``rope`` / ``rope_ref``.

    Args:
        head_dim: D, even.
        max_positions: P, number of table rows (positions 0..P-1).
        base: rope_theta.
        scaling: None, or a Hugging Face config.json ``rope_scaling`` / ``rope_parameters`` dict with
            rope_type "default" or "llama3" (keys factor, low_freq_factor, high_freq_factor,
            original_max_position_embeddings). Any other rope_type raises ValueError.
        device: where the tables live; angles and cos/sin are computed there (inv_freq on the CPU).
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope_tables: head_dim must be a positive even number, got {head_dim}")
    if max_positions <= 0:
        raise ValueError(f"rope_tables: max_positions must be positive, got {max_positions}")
    if scaling is not None:
        rope_type = _rope_type(scaling)
        if rope_type not in ("default", "llama3"):
            raise ValueError(
                f"rope_tables: unsupported rope_type {rope_type!r}; supported: 'default', 'llama3' (or scaling=None)"
            )
        theta = scaling.get("rope_theta")
        if theta is not None and float(theta) != float(base):
            raise ValueError(f"rope_tables: scaling['rope_theta']={theta} disagrees with base={base}")

    # fp32 throughout, in transformers' order: arange(0, D, 2) as float, / D, base ** that, 1 / that.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponent)  # [D/2] fp32, CPU
    if scaling is not None and _rope_type(scaling) == "llama3":
        inv_freq = _inv_freq_llama3(inv_freq, scaling)

    positions = torch.arange(max_positions, dtype=torch.int64, device=device).to(torch.float32)  # [P]
    angles = positions[:, None] * inv_freq.to(device)[None, :]  # [P, D/2] fp32
    return angles.cos(), angles.sin()


def rope_ref(q, k, positions, cos, sin):
    """Plain-torch rotate-half RoPE at per-token positions; see the module docstring."""
    idx = positions.long()
    ok = ((idx >= 0) & (idx < cos.shape[0]))[:, None, None]  # out of range: cos = sin = 0, as in the kernels
    idx = idx.clamp(0, cos.shape[0] - 1)
    c = torch.where(ok, cos[idx].float()[:, None, :], 0.0)  # [N, 1, D/2]
    s = torch.where(ok, sin[idx].float()[:, None, :], 0.0)  # [N, 1, D/2]

    def rotate(x):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def qkv_extras_ref(q, k, v, bias=None, q_norm=None, k_norm=None, eps=None):
    """q [N, HQ, D], k / v [N, HKV, D] with the bias [(HQ + 2 HKV) D] added (``+`` in torch) and the
    per-head RMSNorms (``norm.rms_norm_ref``) applied to q and k; see the module docstring."""
    from .norm import rms_norm_ref

    HQ, HKV, D = q.shape[1], k.shape[1], q.shape[2]
    if bias is not None:
        b_q, b_k, b_v = bias.split([HQ * D, HKV * D, HKV * D])
        q, k, v = q + b_q.view(HQ, D), k + b_k.view(HKV, D), v + b_v.view(HKV, D)
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    return q, k, v


def rope_write_kv_ref_(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, bias=None, q_norm=None,
                       k_norm=None, eps=None):
    """``qkv_extras_ref`` (with a bias / q and k norms), ``rope_ref``, then the paged KV write (slot < 0
    skipped). Mutates k_cache / v_cache; returns the rotated q."""
    q, k, v = qkv_extras_ref(q, k, v, bias, q_norm, k_norm, eps)
    q_out, k_out = rope_ref(q, k, positions, cos, sin)
    HKV, D = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, HKV, D)[slots] = k_out[keep].to(k_cache.dtype)
    v_cache.view(-1, HKV, D)[slots] = v[keep].to(v_cache.dtype)
    return q_out


@triton.jit
def _load_halves(
    x_ptr,
    i_n,
    n_heads,
    stride_xn,
    stride_xh,
    HALF,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Token i_n's n_heads head vectors as (first halves, second halves), fp32."""
    o_h = tl.arange(0, BLOCK_HEADS)
    o_d = tl.arange(0, BLOCK_HALF)
    m_hd = (o_h < n_heads)[:, None] & (o_d < HALF)[None, :]
    p_x1 = x_ptr + i_n * stride_xn + o_h[:, None] * stride_xh + o_d[None, :]
    b_x1 = tl.load(p_x1, mask=m_hd, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_HALF]
    b_x2 = tl.load(p_x1 + HALF, mask=m_hd, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_HALF]
    return b_x1, b_x2


@triton.jit
def _add_bias(b_x1, b_x2, b_b1, b_b2, x_ptr):
    """Halves plus their bias halves, rounded to x's dtype (torch's ``x + b``), back in fp32."""
    dt = x_ptr.dtype.element_ty
    return (b_x1 + b_b1).to(dt).to(tl.float32), (b_x2 + b_b2).to(dt).to(tl.float32)


@triton.jit
def _head_rms_norm(b_x1, b_x2, b_w1, b_w2, HALF, eps, x_ptr):
    """RMSNorm of each head (row) of [heads, HALF] halves over its 2 * HALF channels, with norm.rms_norm's
    roundings to x's dtype (normalised head, then times the weight halves); back in fp32."""
    dt = x_ptr.dtype.element_ty
    b_ss = tl.sum(b_x1 * b_x1, axis=1) + tl.sum(b_x2 * b_x2, axis=1)  # [heads]: both halves
    b_rstd = tl.math.rsqrt(b_ss / (2 * HALF) + eps)[:, None]  # [heads, 1]
    b_y1 = (b_x1 * b_rstd).to(dt).to(tl.float32)
    b_y2 = (b_x2 * b_rstd).to(dt).to(tl.float32)
    return ((b_y1 * b_w1[None, :]).to(dt).to(tl.float32),
            (b_y2 * b_w2[None, :]).to(dt).to(tl.float32))


@triton.jit
def _rotate(b_x1, b_x2, b_cos, b_sin):
    """(x1 c - x2 s, x2 c + x1 s) for [heads, HALF] halves and [HALF] cos / sin rows."""
    b_c = b_cos[None, :]
    b_s = b_sin[None, :]
    return b_x1 * b_c - b_x2 * b_s, b_x2 * b_c + b_x1 * b_s


@triton.jit
def _store_heads(o_ptr, i_n, n_heads, b_o1, b_o2, HALF, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Store rotated halves of token i_n into a contiguous [N, n_heads, 2 * HALF] output."""
    o_h = tl.arange(0, BLOCK_HEADS)
    o_d = tl.arange(0, BLOCK_HALF)
    m_hd = (o_h < n_heads)[:, None] & (o_d < HALF)[None, :]
    p_o1 = o_ptr + (i_n * n_heads + o_h[:, None]) * (2 * HALF) + o_d[None, :]
    tl.store(p_o1, b_o1.to(o_ptr.dtype.element_ty), mask=m_hd)
    tl.store(p_o1 + HALF, b_o2.to(o_ptr.dtype.element_ty), mask=m_hd)


@triton.jit
def _rotate_heads(
    x_ptr,
    o_ptr,
    i_n,
    n_heads,
    stride_xn,
    stride_xh,
    b_cos,  # [BLOCK_HALF] fp32
    b_sin,  # [BLOCK_HALF] fp32
    HALF,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    b_x1, b_x2 = _load_halves(x_ptr, i_n, n_heads, stride_xn, stride_xh, HALF, BLOCK_HEADS, BLOCK_HALF)
    b_o1, b_o2 = _rotate(b_x1, b_x2, b_cos, b_sin)
    _store_heads(o_ptr, i_n, n_heads, b_o1, b_o2, HALF, BLOCK_HEADS, BLOCK_HALF)


@triton.jit
def rope_kernel(
    q_ptr,  # [N, HQ, D]
    k_ptr,  # [N, HKV, D]
    pos_ptr,  # [N] int32 / int64
    cos_ptr,  # [P, HALF] fp32
    sin_ptr,  # [P, HALF] fp32
    qo_ptr,  # [N, HQ, D] contiguous
    ko_ptr,  # [N, HKV, D] contiguous
    HQ,
    HKV,
    HALF,
    n_positions,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_cos,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    b_pos = tl.load(pos_ptr + i_n).to(tl.int64)  # scalar
    o_d = tl.arange(0, BLOCK_HALF)
    # Out-of-range positions read nothing (cos = sin = 0 -> zero output) instead of stray memory.
    m_d = (o_d < HALF) & (b_pos >= 0) & (b_pos < n_positions)
    b_cos = tl.load(cos_ptr + b_pos * stride_cos + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BLOCK_HALF]
    b_sin = tl.load(sin_ptr + b_pos * stride_cos + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BLOCK_HALF]

    _rotate_heads(q_ptr, qo_ptr, i_n, HQ, stride_qn, stride_qh, b_cos, b_sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, ko_ptr, i_n, HKV, stride_kn, stride_kh, b_cos, b_sin, HALF, BLOCK_HKV, BLOCK_HALF)


@triton.jit
def rope_write_kv_kernel(
    q_ptr,  # [N, HQ, D]
    k_ptr,  # [N, HKV, D]
    v_ptr,  # [N, HKV, D]
    pos_ptr,  # [N] int32 / int64
    cos_ptr,  # [P, HALF] fp32
    sin_ptr,  # [P, HALF] fp32
    slot_ptr,  # [N] int64 flat cache slot, < 0 = skip
    qo_ptr,  # [N, HQ, D] contiguous
    kc_ptr,  # [NP, PS, HKV, D]
    vc_ptr,  # [NP, PS, HKV, D]
    b_ptr,  # [(HQ + HKV + HKV) * D] q | k | v bias (unused without HAS_BIAS)
    qw_ptr,  # [D] q_norm weight (unused without HAS_QK_NORM)
    kw_ptr,  # [D] k_norm weight (unused without HAS_QK_NORM)
    HQ,
    HKV,
    HALF,
    n_positions,
    eps,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cos,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    PS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    # Every load but the table row is independent of every other: issue them all before the
    # position-dependent cos / sin loads, so their latencies overlap.
    b_pos = tl.load(pos_ptr + i_n).to(tl.int64)  # scalar
    b_slot = tl.load(slot_ptr + i_n)  # scalar int64
    # [BLOCK_HQ, BLOCK_HALF] x 2 and [BLOCK_HKV, BLOCK_HALF] x 2
    b_q1, b_q2 = _load_halves(q_ptr, i_n, HQ, stride_qn, stride_qh, HALF, BLOCK_HQ, BLOCK_HALF)
    b_k1, b_k2 = _load_halves(k_ptr, i_n, HKV, stride_kn, stride_kh, HALF, BLOCK_HKV, BLOCK_HALF)
    o_h = tl.arange(0, BLOCK_HKV)
    o_d = tl.arange(0, BLOCK_HALF)
    m_hd = (o_h < HKV)[:, None] & (o_d < HALF)[None, :]
    p_v1 = v_ptr + i_n * stride_vn + o_h[:, None] * stride_vh + o_d[None, :]
    b_v1 = tl.load(p_v1, mask=m_hd, other=0.0)  # [BLOCK_HKV, BLOCK_HALF]
    b_v2 = tl.load(p_v1 + HALF, mask=m_hd, other=0.0)  # [BLOCK_HKV, BLOCK_HALF]
    if HAS_BIAS:  # the bias's q | k | v heads, each a [heads, 2 * HALF] block: same halves as q / k / v
        b_bq1, b_bq2 = _load_halves(b_ptr, 0, HQ, 0, 2 * HALF, HALF, BLOCK_HQ, BLOCK_HALF)
        b_bk1, b_bk2 = _load_halves(b_ptr + HQ * 2 * HALF, 0, HKV, 0, 2 * HALF, HALF, BLOCK_HKV, BLOCK_HALF)
        b_bv1, b_bv2 = _load_halves(b_ptr + (HQ + HKV) * 2 * HALF, 0, HKV, 0, 2 * HALF, HALF, BLOCK_HKV,
                                    BLOCK_HALF)
    if HAS_QK_NORM:
        m_half = o_d < HALF
        b_qw1 = tl.load(qw_ptr + o_d, mask=m_half, other=0.0).to(tl.float32)  # [BLOCK_HALF]
        b_qw2 = tl.load(qw_ptr + HALF + o_d, mask=m_half, other=0.0).to(tl.float32)
        b_kw1 = tl.load(kw_ptr + o_d, mask=m_half, other=0.0).to(tl.float32)
        b_kw2 = tl.load(kw_ptr + HALF + o_d, mask=m_half, other=0.0).to(tl.float32)

    # Out-of-range positions read nothing (cos = sin = 0 -> zero output) instead of stray memory.
    m_d = (o_d < HALF) & (b_pos >= 0) & (b_pos < n_positions)
    b_cos = tl.load(cos_ptr + b_pos * stride_cos + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BLOCK_HALF]
    b_sin = tl.load(sin_ptr + b_pos * stride_cos + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BLOCK_HALF]

    if HAS_BIAS:  # qkv + bias, rounded to the model dtype before anything reads it
        b_q1, b_q2 = _add_bias(b_q1, b_q2, b_bq1, b_bq2, q_ptr)
        b_k1, b_k2 = _add_bias(b_k1, b_k2, b_bk1, b_bk2, k_ptr)
        b_v1, b_v2 = _add_bias(b_v1.to(tl.float32), b_v2.to(tl.float32), b_bv1, b_bv2, v_ptr)
    if HAS_QK_NORM:  # per-head RMSNorm (padding heads are normed too, never stored)
        b_q1, b_q2 = _head_rms_norm(b_q1, b_q2, b_qw1, b_qw2, HALF, eps, q_ptr)
        b_k1, b_k2 = _head_rms_norm(b_k1, b_k2, b_kw1, b_kw2, HALF, eps, k_ptr)

    b_q1, b_q2 = _rotate(b_q1, b_q2, b_cos, b_sin)
    _store_heads(qo_ptr, i_n, HQ, b_q1, b_q2, HALF, BLOCK_HQ, BLOCK_HALF)
    b_k1, b_k2 = _rotate(b_k1, b_k2, b_cos, b_sin)

    # Padding tokens (slot < 0) rotate q but write no cache slot: masked stores rather than an early
    # return, so no load waits for the slot.
    m_w = m_hd & (b_slot >= 0)
    b_slot = tl.maximum(b_slot, 0)
    b_page = b_slot // PS
    b_off = b_slot % PS
    p_kc = kc_ptr + b_page * stride_kcp + b_off * stride_kcs + o_h[:, None] * stride_kch + o_d[None, :]
    p_vc = vc_ptr + b_page * stride_vcp + b_off * stride_vcs + o_h[:, None] * stride_vch + o_d[None, :]
    # Rotated k is rounded to k's dtype first, then to the cache's, as rope followed by write_kv_ does.
    kc_dt = kc_ptr.dtype.element_ty
    tl.store(p_kc, b_k1.to(k_ptr.dtype.element_ty).to(kc_dt), mask=m_w)
    tl.store(p_kc + HALF, b_k2.to(k_ptr.dtype.element_ty).to(kc_dt), mask=m_w)
    tl.store(p_vc, b_v1.to(vc_ptr.dtype.element_ty), mask=m_w)
    tl.store(p_vc + HALF, b_v2.to(vc_ptr.dtype.element_ty), mask=m_w)


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_rope_args(name, q, k, positions, cos, sin):
    """Shape / dtype / device checks shared by the launchers; returns (N, HQ, HKV, D)."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"{name}: q and k must be [N, heads, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    N, HQ, D = q.shape
    if k.shape[0] != N or k.shape[2] != D:
        raise ValueError(f"{name}: k must be [N={N}, HKV, D={D}], got {tuple(k.shape)}")
    HKV = k.shape[1]
    if D % 2:
        raise ValueError(f"{name}: head dim D must be even, got {D}")
    if q.dtype not in _FLOAT_DTYPES or k.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: q/k must be float32/float16/bfloat16, got {q.dtype} and {k.dtype}")
    if positions.shape != (N,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name}: positions must be int32/int64 [N={N}], got {positions.dtype} {tuple(positions.shape)}"
        )
    half = D // 2
    if cos.dim() != 2 or cos.shape[1] != half or sin.shape != cos.shape:
        raise ValueError(
            f"{name}: cos and sin must both be [P, D/2={half}], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"{name}: cos/sin must be float32 (see rope_tables), got {cos.dtype} and {sin.dtype}")
    for arg, t in (("k", k), ("positions", positions), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name}: {arg} is on {t.device}, q on {q.device}")
    return N, HQ, HKV, D


def _num_warps(block_hq, block_hkv, block_half):
    return 8 if (block_hq + block_hkv) * block_half * 2 >= 8192 else 4


def rope(q, k, positions, cos, sin):
    """Rotate q [N, HQ, D] and k [N, HKV, D] by the table rows at ``positions`` [N], in one launch.

    Returns new contiguous ``(q_out, k_out)`` in q's / k's dtype (math in fp32, one rounding).
    """
    N, HQ, HKV, D = _check_rope_args("rope", q, k, positions, cos, sin)
    half = D // 2
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    cos = cos.contiguous()
    sin = sin.contiguous()
    positions = positions.contiguous()
    q_out = torch.empty((N, HQ, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((N, HKV, D), dtype=k.dtype, device=k.device)
    if N == 0:
        return q_out, k_out

    block_hq = triton.next_power_of_2(max(HQ, 1))
    block_hkv = triton.next_power_of_2(max(HKV, 1))
    block_half = triton.next_power_of_2(half)
    rope_kernel[(N,)](
        q, k, positions, cos, sin, q_out, k_out,
        HQ, HKV, half, cos.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        BLOCK_HQ=block_hq,
        BLOCK_HKV=block_hkv,
        BLOCK_HALF=block_half,
        num_warps=_num_warps(block_hq, block_hkv, block_half),
        # Keep x1 * c - x2 * s as two rounded products and a subtraction, as torch computes it, so
        # fp32 outputs match transformers exactly; this kernel is memory-bound, FMA buys nothing.
        enable_fp_fusion=False,
    )
    return q_out, k_out


def _check_extras(name, q, k, v, bias, q_norm, k_norm, eps):
    """Checks of rope_write_kv_'s optional bias / q and k norms (q [N, HQ, D], k and v [N, HKV, D])."""
    HQ, HKV, D = q.shape[1], k.shape[1], q.shape[2]
    if bias is not None:
        n_bias = (HQ + 2 * HKV) * D
        if bias.dim() != 1 or bias.shape[0] != n_bias:
            raise ValueError(f"{name}: bias must be [(HQ + 2 HKV) D = {n_bias}], got {tuple(bias.shape)}")
        if not (bias.dtype == q.dtype == k.dtype == v.dtype):
            raise ValueError(f"{name}: bias, q, k and v must share one dtype (the bias is added and rounded in "
                             f"it, as torch's qkv + bias), got {bias.dtype}, {q.dtype}, {k.dtype}, {v.dtype}")
        if bias.device != q.device:
            raise ValueError(f"{name}: bias is on {bias.device}, q on {q.device}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError(f"{name}: q_norm and k_norm come together (both None, or both [D])")
    if q_norm is not None:
        for arg, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            if w.dim() != 1 or w.shape[0] != D:
                raise ValueError(f"{name}: {arg} must be [D={D}], got {tuple(w.shape)}")
            if not w.is_floating_point():
                raise ValueError(f"{name}: {arg} must be a float tensor, got {w.dtype}")
            if w.device != q.device:
                raise ValueError(f"{name}: {arg} is on {w.device}, q on {q.device}")
        if eps is None:
            raise ValueError(f"{name}: q_norm / k_norm need eps")


def rope_write_kv_(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, bias=None, q_norm=None,
                   k_norm=None, eps=None):
    """RoPE on q and k, then k (rotated) and v written into the paged KV caches, in one launch; with a
    q | k | v ``bias`` and / or per-head ``q_norm`` / ``k_norm`` RMSNorms applied first, in the same launch.

    Args:
        q: [N, HQ, D]; k, v: [N, HKV, D] (views into a fused QKV output are fine: last dim contiguous).
        positions: [N] int32/int64, rows of the cos/sin tables.
        cos, sin: [P, D/2] fp32 from ``rope_tables``.
        k_cache, v_cache: [NP, PS, HKV, D] page pools, written in place at flat slot
            ``slot_mapping[n] = page * PS + offset``; ``slot_mapping`` [N] int64, < 0 skips token n.
        bias: None, or [(HQ + 2 HKV) D] in q's dtype (q, k and v then share it): q | k | v's bias (Qwen2),
            added and rounded to that dtype first.
        q_norm, k_norm: None, or both [D] float: RMSNorm weights over each query / key head, applied after
            the bias and before RoPE (Qwen3), with ``eps``.

    Mutates k_cache and v_cache; returns the rotated q as a new contiguous [N, HQ, D] tensor in q's
    dtype. Same values as ``rope`` followed by ``attention.write_kv_`` (rotated k discarded); with the
    extras, as torch's ``qkv + bias`` and ``norm.rms_norm`` on each head before them (module docstring).
    """
    name = "rope_write_kv_"
    N, HQ, HKV, D = _check_rope_args(name, q, k, positions, cos, sin)
    if v.shape != k.shape or v.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: v must be a float tensor shaped like k {tuple(k.shape)}, got "
                         f"{tuple(v.shape)} {v.dtype}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != (HKV, D):
        raise ValueError(
            f"{name}: k_cache and v_cache must both be [P, PS, HKV={HKV}, D={D}], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype not in _FLOAT_DTYPES or v_cache.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: caches must be float32/float16/bfloat16, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{name}: the head dim (last dim) of k_cache and v_cache must be contiguous")
    if slot_mapping.shape != (N,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"{name}: slot_mapping must be [N={N}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    for arg, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != q.device:
            raise ValueError(f"{name}: {arg} is on {t.device}, q on {q.device}")
    _check_extras(name, q, k, v, bias, q_norm, k_norm, eps)

    half = D // 2
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    cos = cos.contiguous()
    sin = sin.contiguous()
    positions = positions.contiguous()
    slot_mapping = slot_mapping.contiguous()
    # Absent extras: q stands in for their pointers, never dereferenced (HAS_BIAS / HAS_QK_NORM False).
    has_bias, has_norm = bias is not None, q_norm is not None
    bias = bias.contiguous() if has_bias else q
    q_norm, k_norm = (q_norm.contiguous(), k_norm.contiguous()) if has_norm else (q, q)
    q_out = torch.empty((N, HQ, D), dtype=q.dtype, device=q.device)
    if N == 0:
        return q_out

    block_hq = triton.next_power_of_2(max(HQ, 1))
    block_hkv = triton.next_power_of_2(max(HKV, 1))
    block_half = triton.next_power_of_2(half)
    rope_write_kv_kernel[(N,)](
        q, k, v, positions, cos, sin, slot_mapping, q_out, k_cache, v_cache, bias, q_norm, k_norm,
        HQ, HKV, half, cos.shape[0], float(eps) if has_norm else 0.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PS=k_cache.shape[1],
        HAS_BIAS=has_bias,
        HAS_QK_NORM=has_norm,
        BLOCK_HQ=block_hq,
        BLOCK_HKV=block_hkv,
        BLOCK_HALF=block_half,
        num_warps=_num_warps(block_hq, block_hkv, block_half),
        enable_fp_fusion=False,  # fp32 results identical to rope's (see rope)
    )  # fmt: skip
    return q_out
