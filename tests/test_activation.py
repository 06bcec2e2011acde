"""silu_mul (SwiGLU: silu(gate) * up over a fused gate|up row) against its plain-torch reference.

Odd shapes (N = 1, 5, 123; F = 123, 1536, 1100 over more than one 1024-wide block), every dtype the
device supports, outputs allocated NaN-poisoned so an unwritten element fails. The reference is
checked against torch's own silu, and against the two-rounding eager composition in half precision.
"""

import pytest
import torch

from kernels_triton.activation import silu_mul, silu_mul_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter rounds fp32 -> bf16 by truncation (FACTS.md): test bf16 on the GPU only.
DTYPES = [torch.float32, torch.float16]
BF16 = [torch.bfloat16] if DEVICE == "cuda" else []


def with_dtypes(cases, gpu_cases=()):
    """Parameters: every case (a tuple) in fp32 and fp16, and the ``gpu_cases`` also in bf16 on a GPU (the
    ``-m gpu`` selection compiles every case's kernel variants, so it keeps a representative few)."""
    return [(*c, dt) for c in cases for dt in DTYPES] + [(*c, dt) for c in gpu_cases for dt in BF16]
# (atol, rtol): fp32 differs by the exp's last ulps; half types by one rounding of the output.
TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}


@pytest.fixture
def poison(monkeypatch):
    """Make torch.empty return NaN-filled tensors; counts float allocations."""
    real_empty = torch.empty
    count = {"n": 0}

    def empty(*a, **kw):
        t = real_empty(*a, **kw)
        if t.is_floating_point():
            count["n"] += 1
            return t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return count


def _randn(*shape, dtype=torch.float32, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("N,F,dtype", with_dtypes([(N, F) for N in (1, 5, 123) for F in (123, 1100, 1536)],
                                                 [(5, 1100)]))
def test_silu_mul_matches_ref(N, F, dtype, poison):
    gen = torch.Generator().manual_seed(N * 1009 + F)
    x = _randn(N, 2 * F, dtype=dtype, scale=3.0, gen=gen)  # |gate| up to ~12: both silu tails
    out = silu_mul(x)
    assert poison["n"] >= 1
    assert out.shape == (N, F) and out.dtype == dtype and out.is_contiguous()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, silu_mul_ref(x), atol=atol, rtol=rtol)


def test_silu_mul_strided_rows_and_leading_dims(poison):
    # Rows of a wider buffer (row stride 2F + 16) and a 3-D input flatten to the same rows.
    base = _randn(7, 2 * 123 + 16)
    x = base[:, 8 : 8 + 2 * 123]
    torch.testing.assert_close(silu_mul(x), silu_mul_ref(x), atol=1e-6, rtol=1e-5)
    x3 = _randn(2, 3, 2 * 37)
    out3 = silu_mul(x3)
    assert out3.shape == (2, 3, 37)
    torch.testing.assert_close(out3, silu_mul_ref(x3), atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy exp
def test_silu_mul_extremes(poison):
    # Large |gate|: silu -> gate for gate >> 0 and -> -0 for gate << 0 (exp overflow must not give NaN).
    gate = torch.tensor([[-1000.0, -90.0, -20.0, 0.0, 1e-6, 20.0, 90.0, 1000.0]], device=DEVICE)
    up = torch.full_like(gate, 2.0)
    out = silu_mul(torch.cat([gate, up], dim=-1))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, silu_mul_ref(torch.cat([gate, up], dim=-1)), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[0, -1], torch.tensor(2000.0, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_mul_ref_is_swiglu(dtype):
    # fp32: exactly torch's silu(gate) * up. Half types: within one rounding of the eager
    # two-rounding composition silu(gate) * up (the reference rounds once).
    x = (torch.randn(5, 2 * 123) * 3).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    eager = torch.nn.functional.silu(gate) * up
    if dtype == torch.float32:
        torch.testing.assert_close(silu_mul_ref(x), eager, atol=0, rtol=0)
    else:
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(silu_mul_ref(x), eager, atol=2 * atol, rtol=2 * rtol)


def test_silu_mul_bad_inputs():
    with pytest.raises(ValueError, match="even"):
        silu_mul(_randn(3, 7))
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        silu_mul(torch.ones(3, 8, dtype=torch.int32, device=DEVICE))


def test_silu_mul_empty_batch():
    assert silu_mul(_randn(0, 10)).shape == (0, 5)
