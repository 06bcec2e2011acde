"""RMSNorm (+ fused residual add) and RoPE kernels against their plain-torch references.

Odd shapes (N = 5, 123; H = 123, 576, 4096; 9/3 and 32/8 heads), every dtype the device supports,
outputs allocated NaN-poisoned so an unwritten element fails. The references are themselves checked
against transformers' formulas (LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb).
"""

import math

import pytest
import torch

from kernels_triton.norm import rms_norm, rms_norm_ref
from kernels_triton.rope import rope, rope_ref, rope_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter rounds fp32 -> bf16 by truncation (FACTS.md): test bf16 on the GPU only.
DTYPES = [torch.float32, torch.float16]
BF16 = [torch.bfloat16] if DEVICE == "cuda" else []


def with_dtypes(cases, gpu_cases=()):
    """Parameters: every case (a tuple) in fp32 and fp16, and the ``gpu_cases`` also in bf16 on a GPU (the
    ``-m gpu`` selection compiles every case's kernel variants, so it keeps a representative few)."""
    return [(*c, dt) for c in cases for dt in DTYPES] + [(*c, dt) for c in gpu_cases for dt in BF16]

# (atol, rtol): fp32 differs only by reduction order / rsqrt ulps; half types by one or two
# roundings of the output (relative ulp 2**-11 for fp16, 2**-8 for bf16).
NORM_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
ROPE_TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}


@pytest.fixture
def poison(monkeypatch):
    """Make torch.empty / torch.empty_like return NaN-filled tensors; counts float allocations."""
    real_empty, real_empty_like = torch.empty, torch.empty_like
    count = {"n": 0}

    def fill(t):
        if t.is_floating_point():
            count["n"] += 1
            return t.fill_(float("nan"))
        return t.fill_(-1)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(real_empty_like(*a, **kw)))
    return count


def _randn(*shape, dtype=torch.float32, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


# ----------------------------------------------------------------------------------------- norm


@pytest.mark.parametrize("with_residual,N,H,dtype", with_dtypes([(r, N, H) for r in (False, True) for N in (1, 5, 123)
                                                                 for H in (123, 576, 4096)],
                                                                [(False, 123, 576), (True, 5, 4096)]))
def test_rms_norm_matches_ref(N, H, dtype, with_residual, poison):
    gen = torch.Generator().manual_seed(N * 10007 + H)
    x = _randn(N, H, dtype=dtype, scale=2.0, gen=gen)
    w = _randn(H, dtype=dtype, gen=gen)
    r = _randn(N, H, dtype=dtype, gen=gen) if with_residual else None
    eps = 1e-5
    atol, rtol = NORM_TOL[dtype]

    got = rms_norm(x, w, eps, residual=r)
    assert poison["n"] >= (2 if with_residual else 1)
    want = rms_norm_ref(x, w, eps, residual=r)
    if with_residual:
        (out, s), (out_ref, s_ref) = got, want
        assert s.dtype == dtype and s.shape == (N, H)
        # One fp32 add, one rounding: bit-exact.
        torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    else:
        out, out_ref = got, want
    assert out.dtype == dtype and out.shape == (N, H)
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_eps_matters(dtype, poison):
    # mean(x^2) ~ 1e-6 is comparable to eps, so dropping or misplacing eps changes the output by ~2x.
    x = _randn(5, 576, dtype=dtype, scale=1e-3)
    w = _randn(576, dtype=dtype)
    for eps in (1e-6, 1e-5):
        atol, rtol = NORM_TOL[dtype]
        torch.testing.assert_close(rms_norm(x, w, eps), rms_norm_ref(x, w, eps), atol=atol, rtol=rtol)
    assert (rms_norm_ref(x, w, 1e-5).float() - rms_norm_ref(x, w, 1e-6).float()).abs().max() > 0.1


def test_rms_norm_strided_and_leading_dims(poison):
    # A row-strided view (e.g. a slice of a wider buffer) and a 3-D input flatten to the same rows.
    base = _randn(7, 640)
    x = base[:, 32:608]  # [7, 576], row stride 640
    r = _randn(7, 576)
    w = _randn(576)
    out, s = rms_norm(x, w, 1e-5, residual=r)
    out_ref, s_ref = rms_norm_ref(x, w, 1e-5, residual=r)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)

    x3 = _randn(2, 3, 123)
    w3 = _randn(123)
    out3 = rms_norm(x3, w3, 1e-6)
    assert out3.shape == (2, 3, 123)
    torch.testing.assert_close(out3, rms_norm_ref(x3, w3, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_ref_is_transformers_convention(dtype):
    # LlamaRMSNorm.forward, written out: normalise in fp32, cast, then weight * hidden (same dtype).
    x = torch.randn(5, 123).to(dtype)
    w = torch.randn(123).to(dtype)
    h = x.to(torch.float32)
    hf = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-5), hf, atol=0, rtol=0)


def test_rms_norm_bad_inputs():
    x = _randn(5, 576)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, _randn(575), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, _randn(576), 1e-5, residual=_randn(5, 576, dtype=torch.float16))
    with pytest.raises(ValueError, match="8192"):
        rms_norm(_randn(1, 8193), _randn(8193), 1e-5)
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        rms_norm(x.to(torch.int32), _randn(576), 1e-5)


# ----------------------------------------------------------------------------------------- rope


def _qk(N, HQ, HKV, D, dtype, gen, fused=False):
    if fused:
        # Views into one [N, (HQ + 2 HKV) * D] projection output, as a fused QKV linear leaves them.
        qkv = _randn(N, (HQ + 2 * HKV) * D, dtype=dtype, gen=gen)
        q = qkv[:, : HQ * D].view(N, HQ, D)
        k = qkv[:, HQ * D : (HQ + HKV) * D].view(N, HKV, D)
        return q, k
    return _randn(N, HQ, D, dtype=dtype, gen=gen), _randn(N, HKV, D, dtype=dtype, gen=gen)


@pytest.mark.parametrize("pos_dtype,N,heads,dtype", with_dtypes([(p, N, h) for p in (torch.int32, torch.int64)
                                                                 for N in (5, 123) for h in ((9, 3, 64), (32, 8, 128))],
                                                                [(torch.int64, 123, (32, 8, 128))]))
def test_rope_matches_ref(N, heads, dtype, pos_dtype, poison):
    HQ, HKV, D = heads
    P = 50  # N = 123 draws from 50 rows: positions repeat and are not sorted
    gen = torch.Generator().manual_seed(N * 31 + D)
    cos, sin = rope_tables(D, P, 10000.0, device=DEVICE)
    q, k = _qk(N, HQ, HKV, D, dtype, gen, fused=(N == 123))
    positions = torch.randint(0, P, (N,), generator=gen).to(device=DEVICE, dtype=pos_dtype)
    atol, rtol = ROPE_TOL[dtype]

    q_out, k_out = rope(q, k, positions, cos, sin)
    assert poison["n"] >= 2
    q_ref, k_ref = rope_ref(q, k, positions, cos, sin)
    assert q_out.shape == (N, HQ, D) and k_out.shape == (N, HKV, D)
    assert q_out.dtype == dtype and k_out.dtype == dtype
    torch.testing.assert_close(q_out, q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_out, k_ref, atol=atol, rtol=rtol)
    # Inputs are not modified.
    assert q_out.data_ptr() != q.data_ptr() and k_out.data_ptr() != k.data_ptr()


def test_rope_is_a_rotation_at_the_right_position():
    # Independent of rope_ref: position 0 is the identity, norms are preserved, and the dot product
    # of two rotated vectors depends only on the position difference (the point of RoPE).
    D = 64
    cos, sin = rope_tables(D, 64, 10000.0, device=DEVICE)
    x = _randn(1, 1, D).expand(4, 1, D).contiguous()
    y = _randn(1, 1, D).expand(4, 1, D).contiguous()
    pos = torch.tensor([0, 3, 10, 13], device=DEVICE)
    xr, yr = rope(x, y, pos, cos, sin)
    torch.testing.assert_close(xr[0], x[0], atol=0, rtol=0)
    torch.testing.assert_close(xr.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    dot_0_3 = (xr[0] * yr[1]).sum()  # positions 0 and 3
    dot_10_13 = (xr[2] * yr[3]).sum()  # positions 10 and 13
    torch.testing.assert_close(dot_0_3, dot_10_13, atol=1e-4, rtol=1e-4)


def test_rope_out_of_range_position_gives_zeros(poison):
    cos, sin = rope_tables(64, 16, 10000.0, device=DEVICE)
    q, k = _randn(3, 9, 64), _randn(3, 3, 64)
    q_out, k_out = rope(q, k, torch.tensor([1, 16, 2], device=DEVICE), cos, sin)
    assert torch.all(q_out[1] == 0) and torch.all(k_out[1] == 0)
    q_ref, _ = rope_ref(q[[0, 2]], k[[0, 2]], torch.tensor([1, 2], device=DEVICE), cos, sin)
    torch.testing.assert_close(q_out[[0, 2]], q_ref, atol=1e-6, rtol=1e-6)
    # the reference agrees (it used to raise an IndexError, taking the whole batch's step down)
    q_r, k_r = rope_ref(q, k, torch.tensor([1, 16, 2], device=DEVICE), cos, sin)
    assert torch.all(q_r[1] == 0) and torch.all(k_r[1] == 0)
    torch.testing.assert_close(q_r, q_out, atol=1e-6, rtol=1e-6)


def test_rope_tables_default_close_to_float64():
    D, P, base = 64, 8192, 100000.0
    cos, sin = rope_tables(D, P, base)
    assert cos.shape == (P, D // 2) and cos.dtype == torch.float32 and sin.shape == cos.shape
    inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(P, dtype=torch.float64)[:, None] * inv[None, :]
    # fp32 angles: absolute angle error <= P * 2**-24 * max(inv) ~ 5e-4 at P = 8192.
    torch.testing.assert_close(cos.double(), ang.cos(), atol=1e-3, rtol=0)
    torch.testing.assert_close(sin.double(), ang.sin(), atol=1e-3, rtol=0)
    assert math.isclose(cos[1, 0].item(), math.cos(1.0), abs_tol=1e-7)


def test_rope_tables_llama3_shape():
    # Independent sanity: llama3 scaling leaves the highest frequency alone and divides the lowest
    # by `factor` (wavelength 2 pi / inv_freq beyond original_max / low_freq_factor).
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    D = 128
    cos_d, sin_d = rope_tables(D, 2, 500000.0)
    _, sin_s = rope_tables(D, 2, 500000.0, scaling=sc)
    # Row 1 holds angle = inv_freq (all <= 1 < pi / 2), so asin recovers it with full precision.
    inv_d, inv_s = torch.asin(sin_d[1].double()), torch.asin(sin_s[1].double())
    assert inv_s[0] == inv_d[0]
    torch.testing.assert_close(inv_s[-1], inv_d[-1] / 8, atol=1e-7, rtol=1e-3)
    cos_def, _ = rope_tables(D, 2, 500000.0, scaling={"rope_type": "default"})
    assert torch.equal(cos_def, cos_d)


def _hf_rotary(head_dim, base, scaling, max_pos):
    transformers = pytest.importorskip("transformers")
    try:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    except ImportError as exc:
        pytest.skip(f"transformers {transformers.__version__} lacks LlamaRotaryEmbedding: {exc}")
    kwargs = dict(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                  max_position_embeddings=max_pos, rope_theta=base)
    if scaling is not None:
        kwargs["rope_scaling"] = dict(scaling)
    try:
        emb = LlamaRotaryEmbedding(transformers.LlamaConfig(**kwargs))
    except Exception as exc:  # config API changed between releases
        pytest.skip(f"cannot build LlamaRotaryEmbedding in transformers {transformers.__version__}: {exc}")
    return emb, apply_rotary_pos_emb


@pytest.mark.parametrize(
    "case",
    [
        (64, 100000.0, None, 8192),  # SmolLM2-135M
        (128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 131072),  # Llama-3.1
    ],
    ids=["default", "llama3"],
)
def test_rope_tables_and_ref_match_transformers(case):
    D, base, scaling, max_pos = case
    emb, apply_rotary_pos_emb = _hf_rotary(D, base, scaling, max_pos)
    positions = torch.tensor([0, 1, 7, 7, 100, 4095, 8191, max_pos // 2 + 3, max_pos - 1])
    cos, sin = rope_tables(D, max_pos, base, scaling=scaling)
    hf_cos, hf_sin = emb(torch.zeros(1), positions[None])  # [1, T, D] each, = concat(table, table)
    torch.testing.assert_close(cos[positions], hf_cos[0, :, : D // 2], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[positions], hf_sin[0, :, D // 2 :], atol=1e-6, rtol=0)

    # rope_ref agrees with transformers' q * cos + rotate_half(q) * sin in fp32.
    T = positions.numel()
    q, k = torch.randn(T, 4, D), torch.randn(T, 2, D)
    q_ref, k_ref = rope_ref(q, k, positions, cos, sin)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, hf_cos[0], hf_sin[0], unsqueeze_dim=1)
    torch.testing.assert_close(q_ref, q_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ref, k_hf, atol=1e-5, rtol=1e-5)


def test_rope_tables_bad_scaling():
    with pytest.raises(ValueError, match="'yarn'"):
        rope_tables(64, 16, 10000.0, scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_tables(64, 16, 10000.0, scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="rope_type"):
        rope_tables(64, 16, 10000.0, scaling={"factor": 8.0})
    with pytest.raises(ValueError, match="even"):
        rope_tables(63, 16, 10000.0)


def test_rope_bad_inputs():
    cos, sin = rope_tables(64, 16, 10000.0, device=DEVICE)
    q, k = _randn(5, 9, 64), _randn(5, 3, 64)
    pos = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="k must be"):
        rope(q, _randn(5, 3, 32), pos, cos, sin)
    with pytest.raises(ValueError, match="positions"):
        rope(q, k, pos.float(), cos, sin)
    with pytest.raises(ValueError, match="positions"):
        rope(q, k, pos[:4], cos, sin)
    with pytest.raises(ValueError, match="D/2=32"):
        rope(q, k, pos, *rope_tables(128, 16, 10000.0, device=DEVICE))


# ------------------------------------------------------------------------------- rope + write_kv


def _paged_caches(P, PS, HKV, D, dtype):
    """NaN-filled page pools: any slot the kernel should not touch stays NaN and must match."""
    shape = (P, PS, HKV, D)
    return (torch.full(shape, float("nan"), device=DEVICE, dtype=dtype),
            torch.full(shape, float("nan"), device=DEVICE, dtype=dtype))


def _slots(N, P, PS, gen, n_pad):
    """Distinct random flat slots for N tokens, n_pad of them -1 (padding), in shuffled order."""
    slots = torch.randperm(P * PS, generator=gen)[:N]
    slots[torch.randperm(N, generator=gen)[:n_pad]] = -1
    return slots.to(device=DEVICE, dtype=torch.int64)


@pytest.mark.parametrize("N,PS,heads,dtype", with_dtypes([(N, PS, h) for N, PS in ((5, 16), (37, 7))
                                                          for h in ((9, 3, 64), (5, 1, 48))],  # D = 48: HALF = 24
                                                         [(37, 7, (9, 3, 64))]))  # is not a power of two
def test_rope_write_kv_matches_rope_then_write_kv(N, PS, heads, dtype, poison):
    from kernels_triton.attention import write_kv_ref_
    from kernels_triton.rope import rope_write_kv_, rope_write_kv_ref_

    HQ, HKV, D = heads
    P_TABLE = 50
    gen = torch.Generator().manual_seed(N * 7 + D + PS)
    cos, sin = rope_tables(D, P_TABLE, 10000.0, device=DEVICE)
    qkv = _randn(N, (HQ + 2 * HKV) * D, dtype=dtype, gen=gen)  # fused projection: q, k, v are views
    q = qkv[:, : HQ * D].view(N, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(N, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(N, HKV, D)
    positions = torch.randint(0, P_TABLE, (N,), generator=gen).to(DEVICE)
    n_pages = -(-N // PS) + 3  # spare pages: most slots stay NaN
    slot_mapping = _slots(N, n_pages, PS, gen, n_pad=2)
    atol, rtol = ROPE_TOL[dtype]

    kc, vc = _paged_caches(n_pages, PS, HKV, D, dtype)
    q_out = rope_write_kv_(q, k, v, positions, cos, sin, kc, vc, slot_mapping)
    assert poison["n"] >= 1
    assert q_out.shape == (N, HQ, D) and q_out.dtype == dtype and q_out.is_contiguous()

    q_ref, k_ref = rope_ref(q, k, positions, cos, sin)
    kc_ref, vc_ref = _paged_caches(n_pages, PS, HKV, D, dtype)
    write_kv_ref_(kc_ref, vc_ref, k_ref, v, slot_mapping)
    torch.testing.assert_close(q_out, q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(kc, kc_ref, atol=atol, rtol=rtol, equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)  # a plain copy
    assert int(torch.isnan(kc).any(-1).any(-1).logical_not().sum()) == N - 2  # written slots only

    # Bit-for-bit the two kernels it replaces (same fp32 ops, same roundings).
    from kernels_triton.attention import write_kv_

    q_two, k_two = rope(q, k, positions, cos, sin)
    kc_two, vc_two = _paged_caches(n_pages, PS, HKV, D, dtype)
    write_kv_(kc_two, vc_two, k_two, v, slot_mapping)
    torch.testing.assert_close(q_out, q_two, atol=0, rtol=0)
    torch.testing.assert_close(kc, kc_two, atol=0, rtol=0, equal_nan=True)

    # The reference used on CPU agrees with the two-step composition exactly.
    kc_ref2, vc_ref2 = _paged_caches(n_pages, PS, HKV, D, dtype)
    q_ref2 = rope_write_kv_ref_(q, k, v, positions, cos, sin, kc_ref2, vc_ref2, slot_mapping)
    torch.testing.assert_close(q_ref2, q_ref, atol=0, rtol=0)
    torch.testing.assert_close(kc_ref2, kc_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc_ref2, vc_ref, atol=0, rtol=0, equal_nan=True)


def test_rope_write_kv_rounds_k_like_the_two_step_path(poison):
    # fp32 q/k/v into fp16 caches: rotated k goes fp32 -> fp32 (k's dtype) -> fp16, v fp32 -> fp16.
    from kernels_triton.attention import write_kv_ref_
    from kernels_triton.rope import rope_write_kv_

    N, HQ, HKV, D, PS = 6, 4, 2, 32, 4
    gen = torch.Generator().manual_seed(5)
    cos, sin = rope_tables(D, 64, 10000.0, device=DEVICE)
    q, k, v = _randn(N, HQ, D, gen=gen), _randn(N, HKV, D, gen=gen), _randn(N, HKV, D, gen=gen)
    positions = torch.arange(10, 10 + N, device=DEVICE, dtype=torch.int32)
    slot_mapping = _slots(N, 3, PS, gen, n_pad=1)
    kc, vc = _paged_caches(3, PS, HKV, D, torch.float16)
    q_out = rope_write_kv_(q, k, v, positions, cos, sin, kc, vc, slot_mapping)
    q_ref, k_ref = rope_ref(q, k, positions, cos, sin)
    kc_ref, vc_ref = _paged_caches(3, PS, HKV, D, torch.float16)
    write_kv_ref_(kc_ref, vc_ref, k_ref, v, slot_mapping)
    assert q_out.dtype == torch.float32
    torch.testing.assert_close(q_out, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kc, kc_ref, atol=1e-3, rtol=1e-3, equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)


def test_rope_write_kv_all_padding_writes_nothing(poison):
    from kernels_triton.rope import rope_write_kv_

    cos, sin = rope_tables(64, 16, 10000.0, device=DEVICE)
    q, k, v = _randn(3, 9, 64), _randn(3, 3, 64), _randn(3, 3, 64)
    pos = torch.tensor([1, 2, 3], device=DEVICE)
    kc, vc = _paged_caches(2, 4, 3, 64, torch.float32)
    q_out = rope_write_kv_(q, k, v, pos, cos, sin, kc, vc, torch.full((3,), -1, device=DEVICE))
    assert torch.isnan(kc).all() and torch.isnan(vc).all()
    torch.testing.assert_close(q_out, rope_ref(q, k, pos, cos, sin)[0], atol=1e-6, rtol=1e-6)


def test_rope_write_kv_bad_inputs():
    from kernels_triton.rope import rope_write_kv_

    cos, sin = rope_tables(64, 16, 10000.0, device=DEVICE)
    q, k, v = _randn(5, 9, 64), _randn(5, 3, 64), _randn(5, 3, 64)
    pos = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    slots = torch.arange(5, device=DEVICE)
    kc, vc = _paged_caches(2, 4, 3, 64, torch.float32)
    with pytest.raises(ValueError, match="v must be"):
        rope_write_kv_(q, k, v[:, :2], pos, cos, sin, kc, vc, slots)
    with pytest.raises(ValueError, match="HKV=3"):
        rope_write_kv_(q, k, v, pos, cos, sin, kc[:, :, :2], vc[:, :, :2], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_write_kv_(q, k, v, pos, cos, sin, kc, vc, slots.to(torch.int32))
    with pytest.raises(ValueError, match="positions"):
        rope_write_kv_(q, k, v, pos[:4], cos, sin, kc, vc, slots)
    # the optional bias / q and k norms
    w = _randn(64)
    args = (q, k, v, pos, cos, sin, kc, vc, slots)
    with pytest.raises(ValueError, match=r"bias must be \[\(HQ \+ 2 HKV\) D = 960\]"):
        rope_write_kv_(*args, _randn(959))
    with pytest.raises(ValueError, match="share one dtype"):
        rope_write_kv_(*args, _randn(960, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"q_norm must be \[D=64\]"):
        rope_write_kv_(*args, None, _randn(63), w, 1e-6)
    with pytest.raises(ValueError, match=r"k_norm must be \[D=64\]"):
        rope_write_kv_(*args, None, w, _randn(2, 64), 1e-6)
    with pytest.raises(ValueError, match="come together"):
        rope_write_kv_(*args, None, w, None, 1e-6)
    with pytest.raises(ValueError, match="float tensor"):
        rope_write_kv_(*args, None, w, w.to(torch.int32), 1e-6)
    with pytest.raises(ValueError, match="need eps"):
        rope_write_kv_(*args, None, w, w)


# ------------------------------------------------- rope + write_kv with a bias / per-head q and k norms

# fp32: the kernel's sum of squares adds two halves (another order than rms_norm's), otherwise the same
# ops; bf16: the interpreter truncates each fp32 -> bf16 rounding (four of them in a chain), a GPU rounds
# to nearest: a few ulps of the largest output (2**-6 of it) and 2**-6 relative.
EXTRAS_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2.0**-6, 2.0**-6)}
EXTRAS = ("none", "bias", "norm", "bias+norm")


def _extras(kind, HQ, HKV, D, dtype, gen):
    """(bias, q_norm, k_norm) for one of EXTRAS: bias [(HQ + 2 HKV) D], norm weights [D] in the model dtype."""
    bias = _randn((HQ + 2 * HKV) * D, dtype=dtype, gen=gen) if "bias" in kind else None
    if "norm" not in kind:
        return bias, None, None
    return bias, _randn(D, dtype=dtype, gen=gen), _randn(D, dtype=dtype, gen=gen)


def _close(got, want, dtype, equal_nan=False):
    atol, rtol = EXTRAS_TOL[dtype]
    if dtype == torch.bfloat16:
        atol *= float(want.float().nan_to_num().abs().max())
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=equal_nan)


@pytest.mark.parametrize(
    "N,heads,extras,dtype",
    [(N, h, e, torch.float32) for N in (1, 6, 37) for h in ((5, 1, 64), (32, 4, 128), (9, 3, 48)) for e in EXTRAS]
    + [(37, h, e, torch.bfloat16) for h in ((5, 1, 64), (32, 4, 128)) for e in EXTRAS[1:]],
)
def test_rope_write_kv_extras_match_ref(N, heads, extras, dtype, poison):
    """The fused bias + per-head q/k RMSNorm + RoPE + KV write against the torch reference (qkv + bias,
    rms_norm_ref on each head, rope_ref, the paged write), on views into one fused projection, odd head
    counts, D = 48 (HALF = 24: masked channels in the sum of squares), slots scattered over spare pages."""
    from kernels_triton.rope import rope_write_kv_, rope_write_kv_ref_

    HQ, HKV, D = heads
    PS, P_TABLE, eps = 4, 64, 1e-6
    gen = torch.Generator().manual_seed(N * 31 + HQ * 7 + D + EXTRAS.index(extras))
    cos, sin = rope_tables(D, P_TABLE, 10000.0, device=DEVICE)
    qkv = _randn(N, (HQ + 2 * HKV) * D, dtype=dtype, scale=3.0, gen=gen)
    q = qkv[:, : HQ * D].view(N, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(N, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(N, HKV, D)
    bias, q_norm, k_norm = _extras(extras, HQ, HKV, D, dtype, gen)
    positions = torch.randint(0, P_TABLE, (N,), generator=gen).to(DEVICE)
    n_pages = -(-N // PS) + 3
    n_pad = min(2, N - 1)
    slot_mapping = _slots(N, n_pages, PS, gen, n_pad=n_pad)

    kc, vc = _paged_caches(n_pages, PS, HKV, D, dtype)
    q_out = rope_write_kv_(q, k, v, positions, cos, sin, kc, vc, slot_mapping, bias, q_norm, k_norm, eps)
    assert q_out.shape == (N, HQ, D) and q_out.dtype == dtype and q_out.is_contiguous()
    assert not torch.isnan(q_out).any()
    kc_ref, vc_ref = _paged_caches(n_pages, PS, HKV, D, dtype)
    q_ref = rope_write_kv_ref_(q, k, v, positions, cos, sin, kc_ref, vc_ref, slot_mapping, bias, q_norm, k_norm, eps)
    assert torch.equal(torch.isnan(kc), torch.isnan(kc_ref)) and torch.equal(torch.isnan(vc), torch.isnan(vc_ref))
    assert int(torch.isnan(kc).any(-1).any(-1).logical_not().sum()) == N - n_pad  # written slots only
    _close(q_out, q_ref, dtype)
    _close(kc, kc_ref, dtype, equal_nan=True)
    if dtype == torch.float32:  # v: one fp32 add (or a copy)
        torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)
    else:
        _close(vc, vc_ref, dtype, equal_nan=True)

    if dtype != torch.float32:
        return
    # The ops it replaces, as Triton kernels: qkv + bias in torch, norm.rms_norm on the heads, then the plain
    # RoPE + KV write. Without norms the same fp32 ops: bit-exact; with them, the sum of squares' order.
    if bias is not None:
        qkv = qkv + bias
    q, k, v = (t.view(N, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    kc_two, vc_two = _paged_caches(n_pages, PS, HKV, D, dtype)
    q_two = rope_write_kv_(q, k, v, positions, cos, sin, kc_two, vc_two, slot_mapping)
    tol = (1e-5, 1e-5) if q_norm is not None else (0, 0)
    torch.testing.assert_close(q_out, q_two, atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(kc, kc_two, atol=tol[0], rtol=tol[1], equal_nan=True)
    torch.testing.assert_close(vc, vc_two, atol=0, rtol=0, equal_nan=True)


def test_rope_write_kv_extras_norm_reads_both_halves(poison):
    """A head that is zero in its first half and large in its second normalises to unit RMS over all D
    channels (a sum of squares over one half would be off by sqrt(2)); position 0 leaves it unrotated."""
    from kernels_triton.rope import rope_write_kv_

    HQ, HKV, D = 3, 1, 64
    cos, sin = rope_tables(D, 4, 10000.0, device=DEVICE)
    q = torch.zeros(2, HQ, D, device=DEVICE)
    q[:, :, D // 2 :] = 5.0
    k, v = q[:, :HKV].clone(), _randn(2, HKV, D)
    ones = torch.ones(D, device=DEVICE)
    kc, vc = _paged_caches(1, 4, HKV, D, torch.float32)
    q_out = rope_write_kv_(q, k, v, torch.zeros(2, dtype=torch.int64, device=DEVICE), cos, sin, kc, vc,
                           torch.tensor([0, 3], device=DEVICE), None, ones, ones, 1e-6)
    want = torch.zeros_like(q)
    want[:, :, D // 2 :] = math.sqrt(2.0)
    torch.testing.assert_close(q_out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc[0, [0, 3]], want[:, :HKV], atol=1e-5, rtol=1e-5)


class _Launches:
    """Names of the Triton kernels launched (``name[grid](...)``) from the modules given, in order."""

    def __init__(self, monkeypatch, *modules):
        self.names = []
        for mod in modules:
            for name, obj in list(vars(mod).items()):
                if name.endswith("_kernel") and hasattr(obj, "__getitem__"):
                    monkeypatch.setattr(mod, name, self._wrap(name, obj))

    def _wrap(self, name, kernel):
        launches = self

        class Counted:
            def __getitem__(self, grid):
                launch = kernel[grid]

                def run(*a, **kw):
                    launches.names.append(name)
                    return launch(*a, **kw)

                return run

        return Counted()


@pytest.mark.parametrize("extras", EXTRAS)
def test_attention_input_side_launches(extras, monkeypatch):
    """The model op for one decode row: a Llama layer's attention input side is one launch (the fused
    RMSNorm + qkv + RoPE + KV write), a Qwen2 / Qwen3 layer's two (RMSNorm + qkv, then bias + q/k norms +
    RoPE + KV write), with the torch path's values."""
    from kernels_triton import activation, linear, norm, rope
    from specdec.models import ops

    HQ, HKV, D, H, eps = 4, 2, 32, 64, 1e-6
    gen = torch.Generator().manual_seed(3)
    x, r = _randn(1, H, gen=gen), _randn(1, H, gen=gen)
    nw, wqkv = _randn(H, gen=gen), _randn((HQ + 2 * HKV) * D, H, scale=H**-0.5, gen=gen)
    bias, q_norm, k_norm = _extras(extras, HQ, HKV, D, torch.float32, gen)
    cos, sin = rope_tables(D, 16, 10000.0, device=DEVICE)
    pos, slots = torch.tensor([5], device=DEVICE), torch.tensor([6], device=DEVICE)
    out = {}
    launches = _Launches(monkeypatch, activation, linear, norm, rope)
    for be in ("torch", "triton"):
        launches.names = []
        kc, vc = _paged_caches(2, 4, HKV, D, torch.float32)
        q, s = ops.norm_qkv_rope_write_kv_(x, r, nw, eps, wqkv, HQ, HKV, pos, cos, sin, kc, vc, slots, backend=be,
                                           bias=bias, q_norm=q_norm, k_norm=k_norm)
        out[be] = (q, s, kc, vc, launches.names)
    assert out["torch"][4] == []
    names = out["triton"][4]
    assert len(names) == (1 if extras == "none" else 2), names
    if extras != "none":
        assert names[-1] == "rope_write_kv_kernel"
    for got, want in zip(out["triton"][:4], out["torch"][:4]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, equal_nan=True)
