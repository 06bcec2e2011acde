"""Fused small-M linear kernels against their unfused references (kernels_triton/linear.py).

Odd shapes (M = 1, 5, 17, 40 rows; K = 80, 96, 200; column counts that no block size divides),
fp32 and fp16 on the CPU, outputs NaN-poisoned so an unwritten element fails, KV pools NaN-poisoned
with pages out of order and padding rows (slot -1) so a write to the wrong slot, or any write for a
padding row, fails. On a GPU a representative case of each kernel path also runs in bf16 (the
``-m gpu`` selection: each case compiles its kernel variants, so the sweeps stay on the CPU).
"""

import json
import math

import pytest
import torch

from kernels_triton import linear as lin
from kernels_triton.rope import rope_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = __import__("os").environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.float16]
BF16 = [torch.bfloat16] if DEVICE == "cuda" else []


def with_dtypes(cases, gpu_cases=()):
    """Parameters: every case (a tuple) in fp32 and fp16, and the ``gpu_cases`` also in bf16 on a GPU."""
    return [(*c, dt) for c in cases for dt in DTYPES] + [(*c, dt) for c in gpu_cases for dt in BF16]
# Outputs are one rounding of a K-long fp32 dot (summation order differs from the reference GEMM);
# half types may round to a neighbouring value.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


@pytest.fixture
def poison(monkeypatch):
    """torch.empty / torch.empty_like return NaN-filled tensors (ints: -1)."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(real_empty_like(*a, **kw)))


def _randn(*shape, dtype, scale=1.0, gen):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def _close(got, want, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def _rope_case(M, HKV, D, PS, NP, max_pos, dtype, gen):
    """RoPE tables, M random positions, M distinct cache slots and NaN-filled K/V pools (and copies for
    the reference): (cos, sin, pos, slots, kc, vc, kc_ref, vc_ref)."""
    cos, sin = rope_tables(D, max_pos, 10000.0, device=DEVICE)
    pos = torch.randint(0, max_pos, (M,), generator=gen).to(DEVICE)
    slots = torch.randperm(NP * PS, generator=gen)[:M].to(DEVICE)
    kc = torch.full((NP, PS, HKV, D), float("nan"), dtype=dtype, device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    return cos, sin, pos, slots, kc, vc, kc.clone(), vc.clone()


@pytest.mark.parametrize("M,K,NOUT,dtype", with_dtypes([(M, K, N) for M in (1, 5, 17, 40) for K, N in ((80, 100), (200, 36))],
                                                     [(1, 200, 36), (17, 80, 100)]))
def test_linear_matches_ref(M, K, NOUT, dtype, poison):
    gen = torch.Generator().manual_seed(M * 31 + K)
    x = _randn(M, K, dtype=dtype, gen=gen)
    w = _randn(NOUT, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    out = lin.linear(x, w)
    assert out.shape == (M, NOUT) and out.dtype == dtype
    _close(out, lin.linear_ref(x, w), dtype)


@pytest.mark.parametrize("M,with_residual,dtype", with_dtypes([(1, False), (1, True), (17, False), (17, True)],
                                                              [(17, True)]))
def test_norm_linear_matches_ref(M, dtype, with_residual, poison):
    gen = torch.Generator().manual_seed(M + 7 * with_residual)
    K, NOUT = 96, 70
    x = _randn(M, K, dtype=dtype, scale=3.0, gen=gen)
    r = _randn(M, K, dtype=dtype, gen=gen) if with_residual else None
    nw = _randn(K, dtype=dtype, gen=gen)
    w = _randn(NOUT, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    out, s = lin.norm_linear(x, r, nw, 1e-5, w)
    out_ref, s_ref = lin.norm_linear_ref(x, r, nw, 1e-5, w)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)  # one fp32 add, one rounding: exact
    _close(out, out_ref, dtype)
    if not with_residual:
        assert s is x


@pytest.mark.parametrize("M,dtype", with_dtypes([(1,), (5,), (33,)], [(33,)]))
def test_norm_swiglu_matches_ref(M, dtype, poison):
    gen = torch.Generator().manual_seed(100 + M)
    K, F = 96, 72  # F = 72: the last column block is partial
    x = _randn(M, K, dtype=dtype, gen=gen)
    r = _randn(M, K, dtype=dtype, gen=gen)
    nw = _randn(K, dtype=dtype, gen=gen)
    w13 = _randn(2 * F, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    act, s = lin.norm_swiglu(x, r, nw, 1e-5, w13)
    act_ref, s_ref = lin.norm_swiglu_ref(x, r, nw, 1e-5, w13)
    assert act.shape == (M, F)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    _close(act, act_ref, dtype)


def test_norm_swiglu_uses_gate_and_up_rows(poison):
    # Swapping gate and up changes silu(g) * u: the kernel must read gate rows first.
    gen = torch.Generator().manual_seed(3)
    x = _randn(3, 64, dtype=torch.float32, gen=gen)
    nw = torch.ones(64, device=DEVICE)
    w13 = _randn(64, 64, dtype=torch.float32, scale=0.5, gen=gen)
    act, _ = lin.norm_swiglu(x, None, nw, 1e-5, w13)
    swapped, _ = lin.norm_swiglu_ref(x, None, nw, 1e-5, torch.cat([w13[32:], w13[:32]]))
    assert not torch.allclose(act, swapped, atol=1e-3)


@pytest.mark.parametrize("M,with_residual,dtype", with_dtypes([(M, r) for M in (1, 7, 20) for r in (False, True)],
                                                              [(20, True)]))
def test_norm_qkv_rope_write_kv_matches_ref(M, dtype, with_residual, poison):
    gen = torch.Generator().manual_seed(1000 + M + with_residual)
    HQ, HKV, D, K, PS, NP = 9, 3, (32 if M != 7 else 24), 96, 4, 16  # D = 24: half 12, masked columns
    x = _randn(M, K, dtype=dtype, gen=gen)
    r = _randn(M, K, dtype=dtype, gen=gen) if with_residual else None
    nw = _randn(K, dtype=dtype, gen=gen)
    wqkv = _randn((HQ + 2 * HKV) * D, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    cos, sin = rope_tables(D, 512, 10000.0, device=DEVICE)
    positions = torch.randint(0, 512, (M,), generator=gen).to(DEVICE)
    # Distinct slots in shuffled pages; every third row is padding (-1).
    slots = torch.randperm(NP * PS, generator=gen)[:M]
    slots[::3] = -1
    slots = slots.to(DEVICE)
    kc = torch.full((NP, PS, HKV, D), float("nan"), dtype=dtype, device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    kc_ref, vc_ref = kc.clone(), vc.clone()

    q, s = lin.norm_qkv_rope_write_kv_(x, r, nw, 1e-5, wqkv, HQ, HKV, positions, cos, sin, kc, vc, slots)
    q_ref, s_ref = lin.norm_qkv_rope_write_kv_ref_(x, r, nw, 1e-5, wqkv, HQ, HKV, positions, cos, sin,
                                                   kc_ref, vc_ref, slots)
    assert q.shape == (M, HQ, D)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    _close(q, q_ref, dtype)
    written = torch.zeros(NP * PS, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    for cache, ref in ((kc, kc_ref), (vc, vc_ref)):
        flat, flat_ref = cache.view(NP * PS, HKV, D), ref.view(NP * PS, HKV, D)
        assert torch.isnan(flat[~written.to(DEVICE)]).all()  # untouched slots stay poisoned
        _close(flat[written.to(DEVICE)], flat_ref[written.to(DEVICE)], dtype)


@pytest.mark.parametrize("D,parts", [(64, 2), (48, 2), (128, 4), (64, 1)])
def test_qkv_rope_split_heads_match_ref(D, parts, poison):
    """Several programs per head (each BLOCK_N dims of both halves; D = 48: a masked last part) give
    the same q and cache writes as the reference."""
    gen = torch.Generator().manual_seed(D + parts)
    M, HQ, HKV, K, PS, NP, dtype = 3, 4, 2, 64, 4, 8, torch.float32
    x, r, nw = _randn(M, K, dtype=dtype, gen=gen), _randn(M, K, dtype=dtype, gen=gen), _randn(K, dtype=dtype, gen=gen)
    wqkv = _randn((HQ + 2 * HKV) * D, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    cos, sin = rope_tables(D, 64, 10000.0, device=DEVICE)
    positions = torch.tensor([5, 0, 63], device=DEVICE)
    slots = torch.tensor([7, -1, 30], device=DEVICE)
    kc = torch.full((NP, PS, HKV, D), float("nan"), dtype=dtype, device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q, _ = lin.norm_qkv_rope_write_kv_(x, r, nw, 1e-5, wqkv, HQ, HKV, positions, cos, sin, kc, vc, slots,
                                       config={"parts": parts})
    q_ref, _ = lin.norm_qkv_rope_write_kv_ref_(x, r, nw, 1e-5, wqkv, HQ, HKV, positions, cos, sin, kc_ref, vc_ref,
                                               slots)
    _close(q, q_ref, dtype)
    for cache, ref in ((kc, kc_ref), (vc, vc_ref)):
        torch.testing.assert_close(cache, ref, equal_nan=True, atol=1e-5, rtol=1e-5)


def test_rope_epilogue_rotates_by_position(poison):
    # Same row at two positions: q must differ (rotation applied) and equal the reference for each.
    gen = torch.Generator().manual_seed(5)
    HQ, HKV, D, K = 2, 1, 32, 64
    x = _randn(1, K, dtype=torch.float32, gen=gen).expand(2, K).contiguous()
    nw = torch.ones(K, device=DEVICE)
    wqkv = _randn((HQ + 2 * HKV) * D, K, dtype=torch.float32, scale=0.2, gen=gen)
    cos, sin = rope_tables(D, 64, 10000.0, device=DEVICE)
    kc = torch.zeros(2, 4, HKV, D, device=DEVICE)
    vc = torch.zeros_like(kc)
    pos = torch.tensor([0, 37], device=DEVICE)
    slots = torch.tensor([0, 5], device=DEVICE)
    q, _ = lin.norm_qkv_rope_write_kv_(x, None, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc, vc, slots)
    assert not torch.allclose(q[0], q[1], atol=1e-3)
    torch.testing.assert_close(vc.view(8, HKV, D)[0], vc.view(8, HKV, D)[5])  # v is not rotated
    assert not torch.allclose(kc.view(8, HKV, D)[0], kc.view(8, HKV, D)[5], atol=1e-3)
    assert math.isclose(float(q[0].norm()), float(q[1].norm()), rel_tol=1e-4)  # rotations keep norms


def test_launchers_reject_bad_input():
    x = torch.zeros(lin.MAX_M + 1, 64, device=DEVICE)
    w = torch.zeros(32, 64, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        lin.linear(x, w)
    with pytest.raises(ValueError, match="same K"):
        lin.linear(x[:4], w[:, :32])
    with pytest.raises(ValueError, match="dtype"):
        lin.linear(x[:4], w.half())
    with pytest.raises(ValueError, match="norm weight"):
        lin.norm_linear(x[:4], None, torch.ones(63, device=DEVICE), 1e-5, w)


@pytest.mark.parametrize("dtype", DTYPES + BF16)
def test_linear_with_add_matches_addmm(dtype, poison):
    gen = torch.Generator().manual_seed(11)
    x, add = _randn(5, 80, dtype=dtype, gen=gen), _randn(5, 36, dtype=dtype, scale=4.0, gen=gen)
    w = _randn(36, 80, dtype=dtype, scale=80 ** -0.5, gen=gen)
    out = lin.linear(x, w, add=add)
    _close(out, lin.linear_ref(x, w, add), dtype)
    assert not torch.allclose(out.float(), lin.linear_ref(x, w).float(), atol=0.5)  # the add happened


@pytest.mark.parametrize("M,dtype", with_dtypes([(1,), (6,)], [(6,)]))
def test_two_input_qkv_matches_concatenated_norms(M, dtype, poison):
    # EAGLE-3's draft attention input: [RMSNorm(embeds) | RMSNorm2(hidden)] without the concat; the
    # two halves have different norm weights and scales, so swapping or sharing a norm fails.
    gen = torch.Generator().manual_seed(77 + M)
    HQ, HKV, D, K, PS, NP = 4, 2, 32, 64, 4, 8
    x = _randn(M, K, dtype=dtype, scale=3.0, gen=gen)
    x2 = _randn(M, K, dtype=dtype, scale=0.2, gen=gen)
    nw, nw2 = _randn(K, dtype=dtype, gen=gen), _randn(K, dtype=dtype, gen=gen)
    wqkv = _randn((HQ + 2 * HKV) * D, 2 * K, dtype=dtype, scale=(2 * K) ** -0.5, gen=gen)
    cos, sin, pos, slots, kc, vc, kc_ref, vc_ref = _rope_case(M, HKV, D, PS, NP, 128, dtype, gen)
    q, _ = lin.norm_qkv_rope_write_kv_(x, None, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc, vc, slots,
                                       x2=x2, norm_weight2=nw2)
    q_ref, _ = lin.norm_qkv_rope_write_kv_ref_(x, None, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc_ref, vc_ref,
                                               slots, x2=x2, norm_weight2=nw2)
    _close(q, q_ref, dtype)
    torch.testing.assert_close(kc, kc_ref, atol=TOL[dtype][0], rtol=TOL[dtype][1], equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=TOL[dtype][0], rtol=TOL[dtype][1], equal_nan=True)
    swapped, _ = lin.norm_qkv_rope_write_kv_ref_(x, None, nw2, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc_ref.clone(),
                                                 vc_ref.clone(), slots, x2=x2, norm_weight2=nw)
    assert not torch.allclose(q.float(), swapped.float(), atol=1e-2)


def test_two_input_qkv_rejects_bad_shapes():
    x = torch.zeros(2, 64, device=DEVICE)
    w = torch.zeros(8 * 32, 100, device=DEVICE)
    kc = torch.zeros(4, 4, 2, 32, device=DEVICE)
    cos = torch.zeros(16, 16, device=DEVICE)
    args = (4, 2, torch.zeros(2, dtype=torch.long, device=DEVICE), cos, cos, kc, kc.clone(),
            torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="K \\+ K2"):
        lin.norm_qkv_rope_write_kv_(x, None, torch.ones(64, device=DEVICE), 1e-5, w, *args, x2=x,
                                    norm_weight2=torch.ones(64, device=DEVICE))
    with pytest.raises(ValueError, match="both norm weights"):
        lin.norm_qkv_rope_write_kv_(x, None, None, 1e-5, w, *args, x2=x, norm_weight2=torch.ones(64, device=DEVICE))


# One row (batch-1 decode) runs the GEMV body (CUDA-core products, register double buffering,
# per-block norm pass); {"gemv": False} puts it on the streaming body instead (as an LM head wider than
# GEMV_MAX_COLUMNS goes). Each runs with several chunks and a partial last chunk (K = 200, BLOCK_K = 32 /
# 64), and with a persistent grid smaller than the column blocks (a program handles several blocks).
# With more rows "gemv" is ignored (the streaming body).
FEW_ROW_PATHS = {
    "gemv": {"gemv": True},
    "gemv-chunks": {"gemv": True, "BLOCK_K": 32},
    "gemv-persistent": {"gemv": True, "BLOCK_K": 64, "programs": 3},
    "stream": {"gemv": False, "BLOCK_K": 64},
    "stream-persistent": {"gemv": False, "BLOCK_K": 32, "programs": 2},
}


def _check_qkv_rope_write(x, r, nw, K, cfg, dtype, gen, HQ, HKV, D, PS, NP, cos, sin, pos, slots):
    """norm + QKV + RoPE + KV write against its reference, with one input (residual r) and with two
    (a second input x2 with its own norm weight: K + 40 columns): q and the residual sum equal, the
    caches equal (untouched slots NaN in both) and every written slot (slot >= 0) filled."""
    M = x.shape[0]
    x2, nw2 = _randn(M, 40, dtype=dtype, scale=0.3, gen=gen), _randn(40, dtype=dtype, gen=gen)
    for two_inputs in (False, True):
        kk = K + 40 if two_inputs else K
        wqkv = _randn((HQ + 2 * HKV) * D, kk, dtype=dtype, scale=kk ** -0.5, gen=gen)
        extra = dict(x2=x2, norm_weight2=nw2) if two_inputs else {}
        res = None if two_inputs else r
        kc = torch.full((NP, PS, HKV, D), float("nan"), dtype=dtype, device=DEVICE)
        vc = torch.full_like(kc, float("nan"))
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q, s = lin.norm_qkv_rope_write_kv_(x, res, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc, vc, slots,
                                           config=dict(cfg), **extra)
        q_ref, s_ref = lin.norm_qkv_rope_write_kv_ref_(x, res, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc_ref,
                                                       vc_ref, slots, **extra)
        torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
        _close(q, q_ref, dtype)
        for c, c_ref in ((kc, kc_ref), (vc, vc_ref)):
            torch.testing.assert_close(c, c_ref, atol=TOL[dtype][0], rtol=TOL[dtype][1], equal_nan=True)
            assert not torch.isnan(c.view(-1, HKV, D)[slots[slots >= 0]]).any()


@pytest.mark.parametrize("path,M,dtype", with_dtypes([(p, M) for p in sorted(FEW_ROW_PATHS) for M in (1, 3)],
                                                     [("gemv", 1)]))
def test_few_row_paths_match_ref(path, M, dtype, poison):
    cfg = FEW_ROW_PATHS[path]
    gen = torch.Generator().manual_seed(5 + M)
    K, NOUT, F = 200, 52, 36
    x, r = _randn(M, K, dtype=dtype, scale=3.0, gen=gen), _randn(M, K, dtype=dtype, gen=gen)
    nw = _randn(K, dtype=dtype, gen=gen)
    w = _randn(NOUT, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    add = _randn(M, NOUT, dtype=dtype, gen=gen)
    _close(lin.linear(x, w, config=dict(cfg)), lin.linear_ref(x, w), dtype)
    _close(lin.linear(x, w, add, config=dict(cfg)), lin.linear_ref(x, w, add), dtype)
    out, s = lin.norm_linear(x, r, nw, 1e-5, w, config=dict(cfg))
    out_ref, s_ref = lin.norm_linear_ref(x, r, nw, 1e-5, w)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    _close(out, out_ref, dtype)
    w13 = _randn(2 * F, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    act, s = lin.norm_swiglu(x, r, nw, 1e-5, w13, config=dict(cfg))
    act_ref, _ = lin.norm_swiglu_ref(x, r, nw, 1e-5, w13)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    _close(act, act_ref, dtype)

    HQ, HKV, D, PS, NP = 3, 1, 32, 4, 4
    cos, sin = rope_tables(D, 64, 10000.0, device=DEVICE)
    pos = torch.tensor([37, 5, 60][:M], device=DEVICE)
    slots = torch.tensor([9, 2, 14][:M], device=DEVICE)
    _check_qkv_rope_write(x, r, nw, K, cfg, dtype, gen, HQ, HKV, D, PS, NP, cos, sin, pos, slots)


def test_gemv_only_for_one_row():
    # The GEMV body serves one row; more rows run the streaming body even when GEMV is asked for.
    x = torch.randn(3, 64, device=DEVICE)
    w = torch.randn(40, 64, device=DEVICE)
    assert lin._gemv_requested(x[:1], {}) and not lin._gemv_requested(x[:1], {"gemv": False})
    assert not lin._gemv_requested(x, {"gemv": True})
    _close(lin.linear(x, w, config={"gemv": True}), lin.linear_ref(x, w), torch.float32)


@pytest.mark.parametrize("rows", [1, 2])
def test_model_routes_one_row_to_gemv_at_any_weight_size(rows, monkeypatch, kernel_options):
    # specdec.models.ops sends a single row (batch-1 decode) to the fused kernels whatever the weight
    # size (here every weight is "too large": FUSED_MAX_WEIGHT_BYTES = 0) and two rows to the unfused
    # path; both give the torch-reference model's logits. The kernel option fused_linear=False turns it off.
    from specdec.models import ops
    from specdec.models.llama import LlamaModel
    from specdec.models.families import ModelConfig

    monkeypatch.setattr(ops, "FUSED_MAX_WEIGHT_BYTES", 0)
    calls = []
    for name in ("linear", "linear_residual", "norm_linear", "norm_swiglu", "norm_qkv_rope_write_kv_"):
        real = getattr(lin, name)
        monkeypatch.setattr(lin, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    cfg = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=40, head_dim=16, max_position_embeddings=64)
    models = {be: LlamaModel.random(cfg, device=DEVICE, dtype="float32", seed=1, backend=be)
              for be in ("triton", "torch")}
    i32 = dict(dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[3, 1], [0, 2]], **i32)[:rows]
    meta = ops.AttentionMeta(torch.arange(rows + 1, **i32), torch.ones(rows, **i32), table,
                             (table[:, 0].long() * 4), 1)
    ids = torch.tensor([5, 9][:rows], device=DEVICE)
    logits = {}
    for fused in (True, False):
        kernel_options.set_(fused_linear=fused)
        for be, model in models.items():
            calls.clear()
            k, v = model.new_kv_cache(4, 4)
            logits[be, fused] = model.logits(model(ids, torch.zeros(rows, **i32), meta, k, v).hidden)
            if be == "triton":
                # per layer qkv, wo, gate|up, down; plus the LM head (40 outputs)
                want = 4 * cfg.num_hidden_layers + 1 if rows == 1 and fused else 0
                assert len(calls) == want, (rows, fused, calls)
        torch.testing.assert_close(logits["triton", fused], logits["torch", fused], atol=1e-4, rtol=1e-4)



def _tiny_models(n, *, layers, vocab, seed, pages, max_pos, ids_seed):
    """A random tiny Llama on the triton and torch backends (same weights), and the inputs of one forward
    over n tokens of one request: (models, meta, ids, positions)."""
    from specdec.models import ops
    from specdec.models.llama import LlamaModel
    from specdec.models.families import ModelConfig

    cfg = ModelConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=vocab, head_dim=16, max_position_embeddings=max_pos)
    models = {be: LlamaModel.random(cfg, device=DEVICE, dtype="float32", seed=seed, backend=be)
              for be in ("triton", "torch")}
    i32 = dict(dtype=torch.int32, device=DEVICE)
    meta = ops.AttentionMeta(torch.tensor([0, n], **i32), torch.tensor([n], **i32),
                             torch.arange(pages, **i32)[None], torch.arange(n, device=DEVICE), n)
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(ids_seed)).to(DEVICE)
    return models, meta, ids, torch.arange(n, **i32)


@pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED, reason="Triton kernels on CPU need the interpreter")
def test_fused_rows_option_routes_tree_verify_rows(monkeypatch, kernel_options):
    # 17 rows (the verify of a 16-node tree): the fused kernels by default (up to ops.FUSED_MAX_ROWS = 24),
    # the unfused path with the kernel option fused_rows below 17; both give the torch-reference model's
    # hidden.
    calls = []
    for name in ("linear", "linear_residual", "norm_linear", "norm_swiglu", "norm_qkv_rope_write_kv_"):
        real = getattr(lin, name)
        monkeypatch.setattr(lin, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    models, meta, ids, pos = _tiny_models(17, layers=1, vocab=40, seed=2, pages=5, max_pos=64, ids_seed=0)
    hidden = {}
    for rows, fused in ((None, True), (16, False), (17, True), (64, True)):
        kernel_options.set_(fused_rows=rows)
        for be, model in models.items():
            calls.clear()
            k, v = model.new_kv_cache(5, 4)
            hidden[be, rows] = model(ids, pos, meta, k, v).hidden
            if be == "triton":
                assert len(calls) == (4 if fused else 0), (rows, calls)
        torch.testing.assert_close(hidden["triton", rows], hidden["torch", rows], atol=1e-4, rtol=1e-4)


def _rows_case(M_shape, group, table_rows, gen):
    """(index [G, W] int32, maybe a strided view with -1 entries, group): every row of the table in range."""
    G, W = M_shape
    if group:
        wide = torch.randint(-1, group, (G, group + 3), generator=gen, dtype=torch.int32)
        index = wide.to(DEVICE)[:, :W]  # strided rows (as nodes[:, :Te] of a [B, T] tensor)
    else:
        index = torch.randint(-1, table_rows, (G, W), generator=gen, dtype=torch.int32).to(DEVICE)
    return index, group


@pytest.mark.parametrize("shape,group,dtype", with_dtypes([((1, 1), 0), ((1, 7), 0), ((2, 3), 5), ((1, 1), 4),
                                                          ((3, 6), 9)], [((1, 1), 4)]))
def test_linear_gathered_rows_match_ref(shape, group, dtype, poison):
    # rows=(index, group): input row g * W + j is x[g * group + max(index[g, j], 0)] (GEMV at one row,
    # the streaming body otherwise), equal to gathering first; -1 entries read row g * group.
    gen = torch.Generator().manual_seed(7 * shape[1] + group)
    n_rows = max(1, shape[0] * group) if group else 50
    x = _randn(n_rows, 72, dtype=dtype, gen=gen)
    w = _randn(40, 72, dtype=dtype, scale=72 ** -0.5, gen=gen)
    rows = _rows_case(shape, group, n_rows, gen)
    out = lin.linear(x, w, rows=rows)
    assert out.shape == (shape[0] * shape[1], 40)
    want = lin.linear_ref(x, w, rows=rows)
    _close(out, want, dtype)
    picked = lin.gather_rows_ref(x, *rows)
    g = torch.arange(shape[0], device=DEVICE)[:, None] * group
    assert torch.equal(picked, x[(g + rows[0].long().clamp(min=0)).reshape(-1)])


@pytest.mark.parametrize("M,dtype", with_dtypes([(1,), (6,)], [(1,)]))
def test_two_input_qkv_with_gathered_token_rows(M, dtype, poison):
    # The draft layer's qkv reading its token embeddings straight from the table (index = token ids,
    # group 0) beside the hidden rows: the same q and cache writes as embedding first.
    gen = torch.Generator().manual_seed(99 + M)
    HQ, HKV, D, K, PS, NP, V = 4, 2, 32, 64, 4, 8, 30
    table = _randn(V, K, dtype=dtype, scale=3.0, gen=gen)
    tok = torch.randint(-1, V, (M,), generator=gen).to(DEVICE)
    x2 = _randn(M, K, dtype=dtype, scale=0.2, gen=gen)
    nw, nw2 = _randn(K, dtype=dtype, gen=gen), _randn(K, dtype=dtype, gen=gen)
    wqkv = _randn((HQ + 2 * HKV) * D, 2 * K, dtype=dtype, scale=(2 * K) ** -0.5, gen=gen)
    cos, sin = rope_tables(D, 128, 10000.0, device=DEVICE)
    pos = torch.randint(0, 128, (M,), generator=gen).to(DEVICE)
    slots = torch.randperm(NP * PS, generator=gen)[:M].to(DEVICE)
    kc = torch.full((NP, PS, HKV, D), float("nan"), dtype=dtype, device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    rows = (tok[None], 0)
    q, s = lin.norm_qkv_rope_write_kv_(table, None, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc, vc, slots,
                                       x2=x2, norm_weight2=nw2, rows=rows)
    assert s is None and q.shape == (M, HQ, D)
    emb = table[tok.clamp(min=0)]
    q_ref, _ = lin.norm_qkv_rope_write_kv_ref_(emb, None, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc_ref, vc_ref,
                                               slots, x2=x2, norm_weight2=nw2)
    _close(q, q_ref, dtype)
    torch.testing.assert_close(kc, kc_ref, atol=TOL[dtype][0], rtol=TOL[dtype][1], equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=TOL[dtype][0], rtol=TOL[dtype][1], equal_nan=True)


def test_gathered_rows_reject_bad_input():
    x, w = torch.zeros(10, 16, device=DEVICE), torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="rows index must be int32/int64"):
        lin.linear(x, w, rows=(torch.zeros(3, device=DEVICE), 0))
    with pytest.raises(ValueError, match="at most 64 gathered rows"):
        lin.linear(x, w, rows=(torch.zeros(1, 65, dtype=torch.int32, device=DEVICE), 0))
    with pytest.raises(ValueError, match="group -1"):
        lin.linear(x, w, rows=(torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), -1))


# The streaming body (two rows or more): a prologue launch writes the ready rows (norm of x + residual,
# second input's norm, gathered rows) and s, then the GEMM streams weight and row tiles (swap-AB). Every
# epilogue, M from 2 to 64 (BLOCK_M 16, 32, 64), odd K and output counts, several K chunks with a partial
# last one, persistent grids, split-K, gathered rows.
STREAM_PATHS = {
    "stream": {},
    "stream-chunks": {"BLOCK_K": 32, "num_stages": 2},
    "stream-persistent": {"BLOCK_K": 64, "programs": 2, "block_n": 32},
    # split-K: 3 splits of K = 200 in 32-column chunks (3, 3, 1 chunks), the last to arrive sums them
    "stream-split": {"BLOCK_K": 32, "split_k": 3},
    "stream-split-persistent": {"BLOCK_K": 32, "split_k": 4, "programs": 3, "block_n": 16},
}
NORM_LAUNCHES = ["prologue", "stream"]  # a layer with a norm on the streaming body


class _Spy:
    """Wraps a @triton.jit kernel: records the constexpr / keyword arguments of each launch."""

    def __init__(self, kernel, log, name):
        self.kernel, self.log, self.name = kernel, log, name

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append((self.name, kw))
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.fixture
def launches(monkeypatch):
    """[(kernel name, launch kwargs)] of the fused-linear kernels launched in the test."""
    log = []
    for name in ("_fused_linear_kernel", "_stream_prologue_kernel"):
        monkeypatch.setattr(lin, name, _Spy(getattr(lin, name), log, name))
    return log


def _bodies(log):
    """'prologue' / 'stream' / 'gemv' per launch."""
    return ["prologue" if name == "_stream_prologue_kernel" else "gemv" if kw["GEMV"] else "stream"
            for name, kw in log]


@pytest.mark.parametrize("M,dtype", with_dtypes([(2,), (8,), (17,), (33,), (64,)], [(64,)]))
def test_stream_body_matches_ref(M, dtype, poison, launches):
    cfg = {}
    gen = torch.Generator().manual_seed(300 + M)
    K, NOUT, F = 75, 37, 21  # odd: partial row, column and K blocks
    x, r = _randn(M, K, dtype=dtype, scale=3.0, gen=gen), _randn(M, K, dtype=dtype, gen=gen)
    nw = _randn(K, dtype=dtype, gen=gen)
    w = _randn(NOUT, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    add = _randn(M, NOUT, dtype=dtype, scale=2.0, gen=gen)
    _close(lin.linear(x, w, config=dict(cfg)), lin.linear_ref(x, w), dtype)
    _close(lin.linear(x, w, add, config=dict(cfg)), lin.linear_ref(x, w, add), dtype)
    assert _bodies(launches) == ["stream", "stream"]  # no norm: one launch
    for res in (None, r):
        launches.clear()
        out, s = lin.norm_linear(x, res, nw, 1e-5, w, config=dict(cfg))
        out_ref, s_ref = lin.norm_linear_ref(x, res, nw, 1e-5, w)
        assert _bodies(launches) == NORM_LAUNCHES
        torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
        _close(out, out_ref, dtype)
    w13 = _randn(2 * F, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    act, s = lin.norm_swiglu(x, r, nw, 1e-5, w13, config=dict(cfg))
    act_ref, s_ref = lin.norm_swiglu_ref(x, r, nw, 1e-5, w13)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    _close(act, act_ref, dtype)

    HQ, HKV, D, PS, NP = 3, 1, 24, 4, 24  # D = 24: half 12, masked columns
    cos, sin = rope_tables(D, 64, 10000.0, device=DEVICE)
    pos = torch.randint(0, 64, (M,), generator=gen).to(DEVICE)
    slots = torch.randperm(NP * PS, generator=gen)[:M]
    slots[1::4] = -1  # padding rows
    slots = slots.to(DEVICE)
    _check_qkv_rope_write(x, r, nw, K, cfg, dtype, gen, HQ, HKV, D, PS, NP, cos, sin, pos, slots)
    assert "gemv" not in _bodies(launches)


@pytest.mark.parametrize("path", ["stream-chunks", "stream-persistent", "stream-split", "stream-split-persistent"])
@pytest.mark.parametrize("M", [5, 40])
def test_stream_tiles_match_ref(path, M, poison, launches):
    # Several K chunks (K = 200: BLOCK_K 32 / 64, partial last chunk), a persistent grid (programs
    # looping over the column blocks) and split-K (every epilogue from the summed partials), fp32
    # through ieee dots: near-exact. The split-K arrival counters are back at 0 afterwards.
    cfg, dtype = STREAM_PATHS[path], torch.float32
    gen = torch.Generator().manual_seed(M)
    K, NOUT, F = 200, 100, 70
    x, r, nw = _randn(M, K, dtype=dtype, gen=gen), _randn(M, K, dtype=dtype, gen=gen), _randn(K, dtype=dtype, gen=gen)
    w = _randn(NOUT, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    _close(lin.linear(x, w, config=dict(cfg)), lin.linear_ref(x, w), dtype)
    out, s = lin.norm_linear(x, r, nw, 1e-5, w, config=dict(cfg))
    out_ref, s_ref = lin.norm_linear_ref(x, r, nw, 1e-5, w)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    _close(out, out_ref, dtype)
    w13 = _randn(2 * F, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    act, _ = lin.norm_swiglu(x, r, nw, 1e-5, w13, config=dict(cfg))
    _close(act, lin.norm_swiglu_ref(x, r, nw, 1e-5, w13)[0], dtype)
    HQ, HKV, D, PS, NP = 3, 1, 64, 4, 16
    cos, sin = rope_tables(D, 64, 10000.0, device=DEVICE)
    pos = torch.randint(0, 64, (M,), generator=gen).to(DEVICE)
    slots = torch.randperm(NP * PS, generator=gen)[:M].to(DEVICE)
    wqkv = _randn((HQ + 2 * HKV) * D, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    kc = torch.full((NP, PS, HKV, D), float("nan"), dtype=dtype, device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q, _ = lin.norm_qkv_rope_write_kv_(x, r, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc, vc, slots, config=dict(cfg))
    q_ref, _ = lin.norm_qkv_rope_write_kv_ref_(x, r, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc_ref, vc_ref, slots)
    _close(q, q_ref, dtype)
    torch.testing.assert_close(kc, kc_ref, atol=1e-5, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert _bodies(launches) == ["stream"] + NORM_LAUNCHES * 3
    main = [kw for n, kw in launches if n == "_fused_linear_kernel"]
    assert all(kw["BLOCK_K"] == cfg["BLOCK_K"] and kw["SPLIT"] == cfg.get("split_k", kw["SPLIT"]) for kw in main)
    if "split_k" in cfg:
        from kernels_triton.attention import arrival_counters
        assert not arrival_counters(x.device, 1, owner="fused_linear").any()


@pytest.mark.parametrize("plain_block_n", [64, 16])
def test_plain_projections_take_their_column_block(plain_block_n, monkeypatch, poison, launches):
    # The streaming body's column block of linear / linear_residual is STREAM_PLAIN_BLOCK_N (64; 16 when
    # patched), no wider than the output; norm_linear keeps the rule of the others (32 here: 80 columns,
    # 132 SMs, 17 rows). Same outputs.
    monkeypatch.setattr(lin, "sm_count", lambda device: 132)
    monkeypatch.setattr(lin, "STREAM_PLAIN_BLOCK_N", plain_block_n)
    gen = torch.Generator().manual_seed(3)
    dtype, M, K, NOUT = torch.float32, 17, 96, 80
    x, w = _randn(M, K, dtype=dtype, gen=gen), _randn(NOUT, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    r, nw = _randn(M, NOUT, dtype=dtype, gen=gen), _randn(K, dtype=dtype, gen=gen)
    _close(lin.linear(x, w), lin.linear_ref(x, w), dtype)
    s, ss = lin.linear_residual(x, w, r)
    _close(s, lin.linear_residual_ref(x, w, r)[0], dtype)
    _close(lin.norm_linear(x, None, nw, 1e-5, w)[0], lin.norm_linear_ref(x, None, nw, 1e-5, w)[0], dtype)
    blocks = [kw["BLOCK_N"] for n, kw in launches if n == "_fused_linear_kernel"]
    assert blocks == [plain_block_n] * 2 + [32], blocks
    assert ss.shape == (triton_cdiv(NOUT, plain_block_n), M)


def triton_cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("K,min_chunks,want_split", [(160, None, 1), (384, None, 6), (160, 4, 2), (384, 16, 1)])
def test_split_k_only_for_long_k_loops(K, min_chunks, want_split, monkeypatch, poison, launches):
    # The default split-K (132 SMs, 5 column blocks): K loops shorter than SPLIT_MIN_CHUNKS (8) BLOCK_K
    # chunks run whole (K = 160: 5 chunks of 32), longer ones split into halves of the chunks at most
    # (K = 384: 12 chunks -> 6); other bars (patched: 4, 16) move the split. Split or not, the output is
    # the reference's.
    monkeypatch.setattr(lin, "sm_count", lambda device: 132)
    if min_chunks is not None:
        monkeypatch.setattr(lin, "SPLIT_MIN_CHUNKS", min_chunks)
    gen = torch.Generator().manual_seed(K)
    dtype, M, NOUT = torch.float32, 5, 80
    x, w = _randn(M, K, dtype=dtype, gen=gen), _randn(NOUT, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    r = _randn(M, NOUT, dtype=dtype, gen=gen)
    cfg = {"BLOCK_K": 32, "block_n": 16}
    _close(lin.linear(x, w, config=dict(cfg)), lin.linear_ref(x, w), dtype)
    s, ss = lin.linear_residual(x, w, r, config=dict(cfg))
    s_ref, ss_ref = lin.linear_residual_ref(x, w, r)
    _close(s, s_ref, dtype)
    _close(ss.sum(0, keepdim=True), ss_ref, dtype)
    splits = [kw["SPLIT"] for n, kw in launches if n == "_fused_linear_kernel"]
    assert splits == [want_split, want_split]


@pytest.mark.parametrize("shape,group,dtype", with_dtypes([((1, 2), 0), ((2, 9), 11), ((1, 33), 0)], [((2, 9), 11)]))
def test_stream_gathered_rows_match_ref(shape, group, dtype, poison, launches):
    # Gathered rows: a plain linear reads them in its K loop (one launch), the two-input qkv in its
    # prologue (the draft layer's token embeddings straight from the table).
    gen = torch.Generator().manual_seed(50 + shape[1] + group)
    cfg = {}
    n_rows = shape[0] * group if group else 60
    table = _randn(n_rows, 72, dtype=dtype, scale=2.0, gen=gen)
    w = _randn(40, 72, dtype=dtype, scale=72 ** -0.5, gen=gen)
    rows = _rows_case(shape, group, n_rows, gen)
    _close(lin.linear(table, w, rows=rows, config=dict(cfg)), lin.linear_ref(table, w, rows=rows), dtype)
    assert _bodies(launches) == ["stream"]
    M = shape[0] * shape[1]
    HQ, HKV, D, PS, NP = 2, 1, 32, 4, 16
    x2, nw, nw2 = _randn(M, 48, dtype=dtype, scale=0.2, gen=gen), _randn(72, dtype=dtype, gen=gen), \
        _randn(48, dtype=dtype, gen=gen)
    wqkv = _randn((HQ + 2 * HKV) * D, 72 + 48, dtype=dtype, scale=120 ** -0.5, gen=gen)
    cos, sin = rope_tables(D, 128, 10000.0, device=DEVICE)
    pos = torch.randint(0, 128, (M,), generator=gen).to(DEVICE)
    slots = torch.randperm(NP * PS, generator=gen)[:M].to(DEVICE)
    kc = torch.full((NP, PS, HKV, D), float("nan"), dtype=dtype, device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    launches.clear()
    q, s = lin.norm_qkv_rope_write_kv_(table, None, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc, vc, slots,
                                       x2=x2, norm_weight2=nw2, rows=rows, config=dict(cfg))
    assert s is None and _bodies(launches) == NORM_LAUNCHES
    q_ref, _ = lin.norm_qkv_rope_write_kv_ref_(table, None, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc_ref,
                                               vc_ref, slots, x2=x2, norm_weight2=nw2, rows=rows)
    _close(q, q_ref, dtype)
    torch.testing.assert_close(kc, kc_ref, atol=TOL[dtype][0], rtol=TOL[dtype][1], equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=TOL[dtype][0], rtol=TOL[dtype][1], equal_nan=True)


def test_rows_select_the_body(launches):
    # One row: the GEMV; more rows (or a one-row launch with {"gemv": False}): the streaming body, with a
    # prologue where a norm runs.
    x, w = torch.randn(3, 64, device=DEVICE), torch.randn(40, 64, device=DEVICE)
    lin.linear(x[:1], w)
    lin.linear(x, w)
    lin.linear(x[:1], w, config={"gemv": False})
    lin.norm_linear(x, None, torch.ones(64, device=DEVICE), 1e-5, w)
    assert _bodies(launches) == ["gemv", "stream", "stream", "prologue", "stream"]
    with pytest.raises(ValueError, match="split_k=2: the streaming body"):
        lin.linear(x[:1], w, config={"split_k": 2})


@pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED, reason="Triton kernels on CPU need the interpreter")
@pytest.mark.parametrize("n", [8, 17, 64])
def test_large_weights_stream_at_tree_verify_rows_only(n, monkeypatch, kernel_options, launches):
    # With every weight "too large" (FUSED_MAX_WEIGHT_BYTES = 0), n rows take the fused kernels (4 per layer,
    # streaming body) from STREAM_LARGE_MIN_ROWS to FUSED_MAX_ROWS rows only (a tree verify), cuBLAS
    # elsewhere; the kernel option fused_rows moves the upper bound, not the lower; an LM head (more than
    # GEMV_MAX_COLUMNS outputs) keeps the weight limit (cuBLAS). All match the torch-reference model.
    from specdec.models import ops
    from specdec.models.llama import LlamaModel
    from specdec.models.families import ModelConfig

    monkeypatch.setattr(ops, "FUSED_MAX_WEIGHT_BYTES", 0)
    monkeypatch.setattr(lin, "GEMV_MAX_COLUMNS", 64)  # qkv: 64 outputs, F = 48; the 100-token LM head: more
    calls = []
    for name in ("linear", "linear_residual", "norm_linear", "norm_swiglu", "norm_qkv_rope_write_kv_"):
        real = getattr(lin, name)
        monkeypatch.setattr(lin, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    cfg = ModelConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=100, head_dim=16, max_position_embeddings=128)
    models = {be: LlamaModel.random(cfg, device=DEVICE, dtype="float32", seed=3, backend=be)
              for be in ("triton", "torch")}
    i32 = dict(dtype=torch.int32, device=DEVICE)
    meta = ops.AttentionMeta(torch.tensor([0, n], **i32), torch.tensor([n], **i32), torch.arange(17, **i32)[None],
                             torch.arange(n, device=DEVICE), n)
    ids = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    pos = torch.arange(n, **i32)
    rule = 4 if ops.STREAM_LARGE_MIN_ROWS <= n <= ops.FUSED_MAX_ROWS else 0
    assert rule == (4 if n == 17 else 0)  # the cases: below, inside and above the rule's row range
    for opts, want in (({}, rule), (dict(fused_rows=n - 1), 0), (dict(fused_rows=64), 0 if n < 17 else 4),
                       (dict(fused_linear=False), 0)):
        kernel_options.reset_()
        kernel_options.set_(**opts)
        out = {}
        for be, model in models.items():
            calls.clear()
            launches.clear()
            k, v = model.new_kv_cache(17, 4)
            h = model(ids, pos, meta, k, v).hidden
            out[be] = model.logits(h)
            if be == "triton":
                assert len(calls) == want, (opts, calls)
                assert set(_bodies(launches)) <= {"prologue", "stream"}, (opts, _bodies(launches))
        torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)


# Norm statistics in the producer's epilogue: linear_residual (wo, w2) writes s = x @ w^T + residual and
# each column block's sums of s^2 per row; the next norm_* launcher takes them (sumsq=) with the norm
# weight folded into its weight and scales each row's products by its 1 / rms: no prologue launch. Same
# values as the prologue path up to the normalised rows' rounding (which this path skips) and the folded
# weight's, on every tile path. With a norm weight the kernel normalises s itself (sumsq not read).
@pytest.mark.parametrize("path,dtype", with_dtypes([(p,) for p in ("stream", "stream-split",
                                                                   "stream-split-persistent", "gemv")],
                                                   [("stream-split",)]))
def test_norm_stats_from_the_producer_epilogue(path, dtype, poison, launches):
    from specdec.models.ops import fold_norm

    cfg = {"gemv": {}, **STREAM_PATHS}[path]
    M = 1 if path == "gemv" else 17
    gen = torch.Generator().manual_seed(7 + M)
    K, H, F = 72, 80, 36  # x [M, K] @ wo [H, K]^T + residual [M, H] -> s; norm(s) @ w13 [2F, H]^T
    x, res = _randn(M, K, dtype=dtype, gen=gen), _randn(M, H, dtype=dtype, scale=2.0, gen=gen)
    wo = _randn(H, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    nw = _randn(H, dtype=dtype, gen=gen)
    s, ss = lin.linear_residual(x, wo, res, config=dict(cfg))
    s_ref, ss_ref = lin.linear_residual_ref(x, wo, res)
    _close(s, s_ref, dtype)
    assert ss.dtype == torch.float32 and ss.shape[1] == M and ss.shape[0] >= 1
    # the partials sum to the row sums of s^2 as stored (bit-exact s: compare against s itself)
    torch.testing.assert_close(ss.sum(0), s.float().pow(2).sum(-1), atol=1e-3, rtol=1e-4)
    w13 = _randn(2 * F, H, dtype=dtype, scale=H ** -0.5, gen=gen)
    wqkv = _randn(5 * 16, H, dtype=dtype, scale=H ** -0.5, gen=gen)
    act_ref = lin.norm_swiglu_ref(s, None, nw, 1e-5, w13)[0]
    HQ, HKV, D, PS, NP = 3, 1, 16, 4, 12
    cos, sin, pos, slots, kc, vc, kc_ref, vc_ref = _rope_case(M, HKV, D, PS, NP, 64, dtype, gen)
    q_ref, _ = lin.norm_qkv_rope_write_kv_ref_(s, None, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc_ref, vc_ref, slots)
    # With the norm weight: the kernel normalises s itself (a prologue on the streaming body, the GEMV's pass)
    launches.clear()
    act, s_out = lin.norm_swiglu(s, None, nw, 1e-5, w13, config=dict(cfg), sumsq=ss)
    assert s_out is s
    _close(act, act_ref, dtype)
    assert not any(kw["ROW_SCALE"] for n, kw in launches if n == "_fused_linear_kernel")
    if path == "gemv":
        with pytest.raises(ValueError, match="folded norm weight.*needs the streaming body"):
            lin.norm_swiglu(s, None, None, 1e-5, fold_norm(w13, nw), config=dict(cfg), sumsq=ss)
        return
    assert "prologue" in _bodies(launches)
    # Folded weights: no prologue, 1 / rms from the sums scales the rows' products
    launches.clear()
    act_f, s_out = lin.norm_swiglu(s, None, None, 1e-5, fold_norm(w13, nw), config=dict(cfg), sumsq=ss)
    assert s_out is s
    _close(act_f, act_ref, dtype)
    out, _ = lin.norm_linear(s, None, None, 1e-5, fold_norm(wqkv, nw), config=dict(cfg), sumsq=ss)
    _close(out, lin.norm_linear_ref(s, None, nw, 1e-5, wqkv)[0], dtype)
    q_f, _ = lin.norm_qkv_rope_write_kv_(s, None, None, 1e-5, fold_norm(wqkv, nw), HQ, HKV, pos, cos, sin, kc, vc,
                                         slots, config=dict(cfg), sumsq=ss)
    _close(q_f, q_ref, dtype)
    torch.testing.assert_close(kc, kc_ref, atol=TOL[dtype][0], rtol=TOL[dtype][1], equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=TOL[dtype][0], rtol=TOL[dtype][1], equal_nan=True)
    assert [kw["ROW_SCALE"] for _, kw in launches] == [True] * 3 and "prologue" not in _bodies(launches)
    if "split_k" in cfg:
        from kernels_triton.attention import arrival_counters
        assert not arrival_counters(x.device, 1, owner="fused_linear").any()


def test_norm_stats_are_read_not_recomputed(poison):
    # Mutation check: scaled partials change the normalised rows by exactly that scale's rsqrt (the
    # kernel reads the sums it is given instead of recomputing them).
    gen = torch.Generator().manual_seed(3)
    dtype, cfg = torch.float32, {"split_k": 2}
    s, nw = _randn(5, 64, dtype=dtype, gen=gen), _randn(64, dtype=dtype, gen=gen)
    w = _randn(32, 64, dtype=dtype, scale=0.125, gen=gen)
    ss = s.pow(2).sum(-1)[None].contiguous()
    folded = (w * nw[None, :]).contiguous()
    base, _ = lin.norm_linear(s, None, None, 1e-12, folded, config=dict(cfg), sumsq=ss)
    _close(base, lin.norm_linear_ref(s, None, nw, 1e-12, w)[0], dtype)
    scaled, _ = lin.norm_linear(s, None, None, 1e-12, folded, config=dict(cfg), sumsq=ss * 4)
    _close(scaled, base / 2, dtype)


def test_norm_stats_reject_bad_input():
    x, w = torch.randn(3, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE)
    nw = torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match="residual must be"):
        lin.linear_residual(x, w, None)
    with pytest.raises(ValueError, match="residual must be"):
        lin.linear_residual(x, w, torch.randn(3, 15, device=DEVICE))
    with pytest.raises(ValueError, match="pass residual=None"):
        lin.norm_linear(x, x, nw, 1e-5, w, sumsq=torch.ones(1, 3, device=DEVICE))
    with pytest.raises(ValueError, match=r"sumsq must be fp32 \[parts, M=3\]"):
        lin.norm_linear(x, None, None, 1e-5, w, sumsq=torch.ones(1, 4, device=DEVICE))


@pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED, reason="Triton kernels on CPU need the interpreter")
@pytest.mark.parametrize("n", [1, 17])
def test_model_norm_stats_drop_the_prologues(n, launches):
    # A 2-layer model over 17 streamed rows: wo and w2 add the residual and sum its squares, so only layer
    # 0's qkv (the embeddings' norm) keeps a prologue launch and the other three norm ops scale their rows
    # in the epilogue, with folded weights. Hidden states match the torch-reference model; one row (GEMV)
    # has neither.
    models, meta, ids, pos = _tiny_models(n, layers=2, vocab=40, seed=5, pages=5, max_pos=64, ids_seed=4)
    out = {}
    for be, model in models.items():  # (the torch model launches nothing)
        k, v = model.new_kv_cache(5, 4)
        out[be] = model(ids, pos, meta, k, v).hidden
    torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)
    scaled = [kw["ROW_SCALE"] for name, kw in launches if name == "_fused_linear_kernel"].count(True)
    assert (_bodies(launches).count("prologue"), scaled) == ((0, 0) if n == 1 else (1, 3))


@pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED, reason="Triton kernels on CPU need the interpreter")
@pytest.mark.parametrize("n", [1, 5])
def test_draft_layer_logits_take_the_sums(n, launches):
    # The EAGLE-3 draft layer over n streamed rows (a tree round): its down projection adds the residual in
    # the epilogue and hands the final norm + lm_head the rows' sums, so only the two-input qkv keeps a
    # prologue launch (gate|up and lm_head: folded weights, rows scaled in the epilogue). Hidden and logits
    # match the torch-reference head; one row (GEMV) has neither.
    from specdec.models.eagle3 import Eagle3Config, Eagle3Head

    models, meta, ids, pos = _tiny_models(n, layers=2, vocab=40, seed=7, pages=5, max_pos=64, ids_seed=2)
    cfg = Eagle3Config.for_target(models["torch"].config, 24, target_layers=(0, 1, 1))
    heads = {be: Eagle3Head(cfg, backend=be).init_weights_(3).to_device(DEVICE, torch.float32, max_positions=64)
             for be in models}
    gen = torch.Generator().manual_seed(n)
    emb = _randn(n, cfg.hidden_size, dtype=torch.float32, gen=gen)
    hid = _randn(n, cfg.hidden_size, dtype=torch.float32, gen=gen)
    out = {}
    for be, head in heads.items():
        k, v = head.new_kv_cache(5, 4)
        out[be] = head(emb, hid, pos, meta, k, v)
    for got, ref in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    scaled = [kw["ROW_SCALE"] for name, kw in launches if name == "_fused_linear_kernel"].count(True)
    assert (_bodies(launches).count("prologue"), scaled) == ((0, 0) if n == 1 else (1, 2))


def _tile_table(path, device_name, entries):
    path.write_text(json.dumps({"device": device_name, "source": "test", "entries": entries}))
    return str(path)


def test_stream_tiles_table_sets_launch_settings_per_shape_and_rows(tmp_path, kernel_options, poison, launches,
                                                                   monkeypatch):
    # A tile table's entry gives the launch settings of the weights of its shape at its rows (the
    # plain, residual, norm, swiglu and qkv launchers); other shapes and row counts keep the rules, a
    # caller's own config wins, a table for another device is ignored. Outputs are the reference's.
    from kernels_triton.linear import _device_name

    gen = torch.Generator().manual_seed(11)
    dtype, K, NOUT, F = torch.float32, 200, 100, 70
    HQ, HKV, D, PS, NP = 3, 1, 64, 4, 32
    w = _randn(NOUT, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    w13 = _randn(2 * F, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    wqkv = _randn((HQ + 2 * HKV) * D, K, dtype=dtype, scale=K ** -0.5, gen=gen)
    plain = {"block_n": 16, "split_k": 3, "BLOCK_K": 32, "num_stages": 2, "num_warps": 2}
    table = [{"n": NOUT, "k": K, "rows": [6, 9], "config": plain},
             {"n": 2 * F, "k": K, "rows": [6, 9], "config": {"block_n": 16, "BLOCK_K": 64, "parts": 4}},
             {"n": (HQ + 2 * HKV) * D, "k": K, "rows": [1, 64], "config": {"parts": 2, "BLOCK_K": 32}}]
    here = _tile_table(tmp_path / "here.json", _device_name(torch.device(DEVICE)), table)
    other = _tile_table(tmp_path / "other.json", "a GPU this is not", table)

    def run(M, config=None):
        launches.clear()
        x, r = _randn(M, K, dtype=dtype, gen=gen), _randn(M, NOUT, dtype=dtype, gen=gen)
        xr, nw = _randn(M, K, dtype=dtype, gen=gen), _randn(K, dtype=dtype, gen=gen)
        _close(lin.linear(x, w, config=dict(config or {})), lin.linear_ref(x, w), dtype)
        s, ss = lin.linear_residual(x, w, r, config=dict(config or {}))
        s_ref, ss_ref = lin.linear_residual_ref(x, w, r)
        _close(s, s_ref, dtype)
        _close(ss.sum(0, keepdim=True), ss_ref, dtype)
        _close(lin.norm_linear(x, xr, nw, 1e-5, w)[0], lin.norm_linear_ref(x, xr, nw, 1e-5, w)[0], dtype)
        _close(lin.norm_swiglu(x, xr, nw, 1e-5, w13)[0], lin.norm_swiglu_ref(x, xr, nw, 1e-5, w13)[0], dtype)
        cos, sin = rope_tables(D, 64, 10000.0, device=DEVICE)
        pos = torch.randint(0, 64, (M,), generator=gen).to(DEVICE)
        slots = torch.randperm(NP * PS, generator=gen)[:M].to(DEVICE)
        kc = torch.full((NP, PS, HKV, D), float("nan"), dtype=dtype, device=DEVICE)
        vc, kc_ref, vc_ref = torch.full_like(kc, float("nan")), kc.clone(), kc.clone()
        q, _ = lin.norm_qkv_rope_write_kv_(x, xr, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc, vc, slots)
        q_ref, _ = lin.norm_qkv_rope_write_kv_ref_(x, xr, nw, 1e-5, wqkv, HQ, HKV, pos, cos, sin, kc_ref, vc_ref, slots)
        _close(q, q_ref, dtype)
        return [{k: kw[k] for k in ("BLOCK_N", "SPLIT", "BLOCK_K", "num_stages", "num_warps")}
                for n, kw in launches if n == "_fused_linear_kernel"]

    rules = run(8)
    kernel_options.set_(stream_tiles=here)
    tuned = run(8)
    assert not any("parts" in kw for _, kw in launches)  # no launcher hands the kernel a key it lacks
    want = {"BLOCK_N": 16, "SPLIT": 3, "BLOCK_K": 32, "num_stages": 2, "num_warps": 2}
    assert tuned[0] == tuned[1] == tuned[2] == want, tuned  # linear, linear_residual, norm_linear
    assert tuned[3]["BLOCK_N"] == 16 and tuned[3]["BLOCK_K"] == 64  # swiglu: "parts" is qkv's alone
    assert tuned[4]["BLOCK_N"] == 16 and tuned[4]["BLOCK_K"] == 32  # qkv: 2 programs per half head of 32
    assert rules[0]["BLOCK_N"] == 64 and rules[0]["SPLIT"] == 1
    outside = run(12)  # rows outside [6, 9]: the rules (the qkv entry holds for 1..64 rows)
    assert outside[0] == rules[0] and outside[3]["BLOCK_N"] == rules[3]["BLOCK_N"] and outside[4] == tuned[4]
    mine = run(8, {"block_n": 32})  # the caller's keys win, the entry fills the rest
    assert mine[0] == {**want, "BLOCK_N": 32}
    kernel_options.set_(stream_tiles=other)  # a table for another device: the rules
    assert run(8) == rules
    # "builtin" (the default) reads the packaged tables, each on its own device only
    monkeypatch.setattr(kernel_options, "builtin_tile_paths", lambda: [other, here])
    kernel_options._entries_cache.clear()
    kernel_options.set_(stream_tiles="builtin")
    assert run(8) == tuned
    monkeypatch.setattr(kernel_options, "builtin_tile_paths", lambda: [other])
    kernel_options._entries_cache.clear()
    assert run(8) == rules
    kernel_options.set_(stream_tiles=here)  # one row (the GEMV): the table does not apply
    one = run(1)  # (split_k 3 would be refused by the GEMV)
    assert all(d["SPLIT"] == 1 for d in one) and all(kw["GEMV"] for n, kw in launches if n == "_fused_linear_kernel")
