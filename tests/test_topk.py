"""topk_logprobs (the draft tree's branching step) against log_softmax + topk.

Odd shapes (N = 1, 5, 37; V = 50, 1000, 8192; k = 1, 4, 8), leading dims, a row stride wider than
the row, every dtype the device supports, outputs NaN-poisoned so unwritten elements fail; ties
must come out lowest index first (a stable sort is the reference there).

The split row (V > MAX_V: 16385, 32000, 50000, 131072; k = 1 .. 64): the same checks, ties across
chunk borders, NaN / -inf / +inf / all-equal rows against the one-program kernel's semantics, bf16 /
fp16 / fp32, strided rows, out= rows, and forced small chunks at V <= MAX_V (many chunks, cheap
under the interpreter) against the one-program kernel itself.
"""

import pytest
import torch

from kernels_triton.topk import (MAX_SPLIT_V, MAX_V, _launch, _launch_split, split_plan, topk, topk_logprobs,
                                 topk_logprobs_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
BF16 = [torch.bfloat16] if DEVICE == "cuda" else []


def with_dtypes(cases, gpu_cases=()):
    """Parameters: every case (a tuple) in fp32 and fp16, and the ``gpu_cases`` also in bf16 on a GPU (the
    ``-m gpu`` selection compiles every case's kernel variants, so it keeps a representative few)."""
    return [(*c, dt) for c in cases for dt in DTYPES] + [(*c, dt) for c in gpu_cases for dt in BF16]


@pytest.mark.parametrize("N,V,k,dtype", with_dtypes([(1, 8192, 4), (5, 1000, 8), (37, 50, 1), (3, 8192, 1)],
                                                   [(1, 8192, 4)]))
def test_matches_reference(poison, dtype, N, V, k):
    g = torch.Generator().manual_seed(N * 131 + V + k)
    x = (torch.randn(N, V, generator=g) * 4).to(DEVICE, dtype)
    v, i = topk_logprobs(x, k)
    rv, ri = topk_logprobs_ref(x, k)
    assert v.shape == (N, k) and i.shape == (N, k) and v.dtype == torch.float32 and i.dtype == torch.int64
    torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
    # The ids carry those values (ties in half precision may order differently from torch's topk).
    lp = torch.log_softmax(x.float(), -1)
    torch.testing.assert_close(lp.gather(1, i), rv, atol=1e-5, rtol=1e-5)
    assert all(len(set(row)) == k for row in i.tolist())
    if dtype == torch.float32:
        assert torch.equal(i, ri)


def test_ties_lowest_index_first_and_leading_dims(poison):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (2, 3, 300), generator=g).float().to(DEVICE)  # many ties
    v, i = topk_logprobs(x, 6)
    lp = torch.log_softmax(x, -1)
    sv, si = torch.sort(lp, dim=-1, descending=True, stable=True)
    assert v.shape == (2, 3, 6)
    assert torch.equal(i, si[..., :6])
    torch.testing.assert_close(v, sv[..., :6], atol=1e-6, rtol=1e-6)


def test_strided_rows_and_masked_logits(poison):
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 700, generator=g).to(DEVICE)
    x = wide[:, :500]  # row stride 700
    x[1, 10:] = float("-inf")  # only 10 finite logits in row 1
    v, i = topk_logprobs(x, 8)
    rv, _ = topk_logprobs_ref(x, 8)
    torch.testing.assert_close(v, rv)
    assert i[1].tolist() == torch.log_softmax(x[1], -1)[:10].argsort(descending=True)[:8].tolist()


def test_bad_arguments_are_rejected():
    x = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match="k must be"):
        topk_logprobs(x, 11)
    with pytest.raises(ValueError, match="do not fit"):
        _launch(torch.zeros(1, MAX_V + 1, device=DEVICE), 2, True, "topk_logprobs")
    with pytest.raises(ValueError, match="split row's limit"):
        topk_logprobs(torch.zeros(1, MAX_SPLIT_V + 1, device=DEVICE), 2)
    with pytest.raises(ValueError, match="k must be"):
        topk_logprobs(torch.zeros(1, MAX_V + 1, device=DEVICE), 65)
    with pytest.raises(ValueError, match="chunk must be"):
        _launch_split(x, 2, True, "topk_logprobs", chunk=96)
    with pytest.raises(ValueError, match="float32"):
        topk_logprobs(torch.zeros(2, 10, dtype=torch.int32, device=DEVICE), 2)


def test_plain_topk_values(poison):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 68, generator=g).to(DEVICE)
    x[0, 0, :4] = 1.5  # ties
    v, i = topk(x, 16)
    sv, si = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(i, si[..., :16]) and torch.equal(v, sv[..., :16])


def test_garbage_rows_still_give_valid_ids(poison):
    """Padding rows of a graphed step hold garbage: NaN / inf must never yield an id outside [0, V)."""
    x = torch.full((3, 100), float("nan"), device=DEVICE)
    x[1, :50] = float("-inf")
    x[2, 7] = 3.0
    for fn in (topk_logprobs, topk):
        _, i = fn(x, 4)
        assert bool(((i >= 0) & (i < 100)).all()), i
        assert int(i[2, 0]) == 7


def test_out_writes_rows_of_a_persistent_buffer():
    """``out=`` fills the first rows of wider [R, k] buffers (a drafter's per-row root state) and
    leaves the other rows alone; negative zero, infinities and equal values keep their exact bits."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 300, generator=g) * 3).to(DEVICE)
    x[0, :4] = torch.tensor([float("inf"), -0.0, 0.0, float("-inf")])
    x[1, 10:14] = 20.0  # a 4-way tie at the top
    vals = torch.full((5, 6), -3.0, device=DEVICE)
    ids = torch.full((5, 6), -9, dtype=torch.int64, device=DEVICE)
    rv, ri = topk(x, 6)
    got = _launch(x, 6, False, "topk", out=(vals[:3], ids[:3]))
    assert got[0].data_ptr() == vals.data_ptr()
    assert torch.equal(vals[:3], rv) and torch.equal(ids[:3], ri)
    assert ids[1, :4].tolist() == [10, 11, 12, 13]
    assert (vals[3:] == -3.0).all() and (ids[3:] == -9).all()
    lv, li = torch.empty_like(vals[:3]), torch.empty_like(ids[:3])
    topk_logprobs(x, 6, out=(lv, li))
    rlv, rli = topk_logprobs_ref(x[1:], 6)
    torch.testing.assert_close(lv[1:], rlv, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="out must be"):
        topk_logprobs(x, 6, out=(vals[:2], ids[:2]))


# ---- the split row (V > MAX_V) ----------------------------------------------------------------------

def semantic_ref(x, k: int, log_softmax: bool = True):
    """The kernels' contract in torch: NaN ranks as -inf, ids = a stable descending sort of the fp32
    values (ties lowest id first), values minus the row's logsumexp (NaN where it is NaN: all -inf,
    or a +inf)."""
    xf = x.float()
    xf = torch.where(torch.isnan(xf), float("-inf"), xf)
    sv, si = torch.sort(xf, dim=-1, descending=True, stable=True)
    sv, si = sv[..., :k], si[..., :k]
    if log_softmax:
        mx = xf.amax(-1, keepdim=True)
        lse = mx + torch.log(torch.exp(xf - mx).sum(-1, keepdim=True))
        sv = sv - lse
    return sv.contiguous(), si.contiguous()


def test_split_plan():
    """CHUNK and S per V (the documented choice), and every V up to MAX_SPLIT_V fits 64 chunks."""
    assert split_plan(16385) == (2048, 9)
    assert split_plan(32000) == (2048, 16)
    assert split_plan(65536) == (2048, 32)
    assert split_plan(128256) == (4096, 32)
    assert split_plan(151936) == (4096, 38)
    assert split_plan(262144) == (4096, 64)
    assert split_plan(262145) == (8192, 33)
    assert split_plan(MAX_SPLIT_V) == (MAX_V, 64)
    assert split_plan(1000, 64) == (64, 16)
    with pytest.raises(ValueError, match="more than"):
        split_plan(100000, 64)


@pytest.mark.parametrize("N,V,k,dtype", [(3, 16385, 10, torch.float32), (8, 32000, 8, torch.float16),
                                         (1, 32000, 64, torch.bfloat16), (3, 50000, 1, torch.float32),
                                         (1, 131072, 10, torch.float32)])
def test_split_matches_reference(poison, N, V, k, dtype):
    g = torch.Generator().manual_seed(N * 7 + V + k)
    x = (torch.randn(N, V, generator=g) * 4).to(DEVICE, dtype)
    v, i = topk_logprobs(x, k)
    rv, ri = topk_logprobs_ref(x, k)
    assert v.shape == (N, k) and i.shape == (N, k) and v.dtype == torch.float32 and i.dtype == torch.int64
    torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
    sv, si = semantic_ref(x, k)
    assert torch.equal(i, si)  # the exact order, ties (fp16 / bf16 have many) lowest id first
    torch.testing.assert_close(v, sv, atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        assert torch.equal(i, ri)
    pv, pi = topk(x, k)  # the plain top-k shares the kernels: exact values
    assert torch.equal(pi, si) and torch.equal(pv, x.float().gather(1, si))


@pytest.mark.parametrize("V,k,chunk,dtype", [(1000, 8, 64, torch.float16), (777, 10, 128, torch.bfloat16),
                                             (1200, 64, 128, torch.float32), (1000, 1, 64, torch.float32)])
def test_split_equals_one_program_kernel(poison, V, k, chunk, dtype):
    """Forced small chunks (S = 16, 7, 10, the last chunk partial): the same ids as the one-program
    kernel, bit for bit, and its values up to the logsumexp's rounding, also with many ties."""
    g = torch.Generator().manual_seed(V + k)
    x = torch.randn(4, V, generator=g) * 4
    x[2] = torch.randint(0, 3, (V,), generator=g).float()  # heavy ties across every chunk border
    x = x.to(DEVICE, dtype)
    for log_softmax, name in ((True, "topk_logprobs"), (False, "topk")):
        v, i = _launch_split(x, k, log_softmax, name, chunk=chunk)
        ov, oi = _launch(x, k, log_softmax, name)
        assert torch.equal(i, oi)
        torch.testing.assert_close(v, ov, atol=1e-5, rtol=1e-5)
        if not log_softmax:
            assert torch.equal(v, ov)
    sv, si = semantic_ref(x, k)
    assert torch.equal(i, si)


def test_split_ties_across_chunk_borders(poison):
    """Equal maxima on both sides of the 2048-id chunk borders of a 32000-wide row come out lowest
    id first; an all-equal row gives ids 0..k-1 and -log(V); k tied maxima in the last chunk."""
    V, k = 32000, 10
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    top = [31999, 4096, 2047, 30720, 2048, 4095, 0, 6143]
    x[0, top] = 9.0
    x[1] = 0.5
    x[2, V - k:] = 9.0  # the k best all in the last (partial) chunk: every one of its candidates counts
    x = x.to(DEVICE, torch.float16)
    v, i = topk_logprobs(x, k)
    assert i[0, :8].tolist() == sorted(top)
    assert i[1].tolist() == list(range(k))
    assert i[2].tolist() == list(range(V - k, V))
    torch.testing.assert_close(v[1], torch.full((k,), -torch.log(torch.tensor(float(V))).item(), device=DEVICE),
                               atol=1e-5, rtol=1e-5)
    sv, si = semantic_ref(x, k)
    assert torch.equal(i, si)
    torch.testing.assert_close(v, sv, atol=1e-5, rtol=1e-5)


def test_split_nan_inf_rows_give_valid_ids(poison):
    """Garbage rows (a graphed step's padding): NaN ranks below -inf, every id stays in [0, V), an
    all -inf / NaN row has NaN log-probs (as log_softmax), a row with a +inf too."""
    V, k = 20000, 8
    x = torch.randn(5, V, generator=torch.Generator().manual_seed(2))
    x[0] = float("nan")
    x[1] = float("-inf")
    x[2, :] = float("nan")
    x[2, [5, 19999, 12000]] = torch.tensor([1.0, 3.0, 2.0])  # 3 finite values in a NaN row
    x[3, : V // 2] = float("-inf")  # the first chunks all -inf: they add 0 to the sum
    x[3, 100] = 7.0
    x[4, 17000] = float("inf")
    x = x.to(DEVICE)
    for fn in (topk_logprobs, topk):
        v, i = fn(x, k)
        assert bool(((i >= 0) & (i < V)).all()), i
        assert torch.equal(i, semantic_ref(x, k, fn is topk_logprobs)[1])
    v, i = topk_logprobs(x, k)
    assert i[0].tolist() == list(range(k)) and i[1].tolist() == list(range(k))
    assert i[2, :3].tolist() == [19999, 12000, 5] and i[2, 3:].tolist() == [0, 1, 2, 3, 4]
    assert int(i[3, 0]) == 100 and int(i[4, 0]) == 17000
    assert torch.isnan(v[[0, 1, 4]]).all()
    sv, _ = semantic_ref(x, k)
    torch.testing.assert_close(v[2:4], sv[2:4], atol=1e-5, rtol=1e-5)  # finite lse, -inf below the finite ones
    assert torch.isinf(v[2, 3:]).all() and torch.isfinite(v[2, :3]).all()


def test_split_strided_rows_leading_dims_and_out(poison):
    """A row stride wider than the row, leading dims, and ``out=`` rows of wider persistent buffers
    (the other rows untouched)."""
    V, k = 18000, 8
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(4, V + 333, generator=g).to(DEVICE, torch.bfloat16)
    x = wide[:, :V].unflatten(0, (2, 2))  # row stride V + 333
    v, i = topk_logprobs(x, k)
    sv, si = semantic_ref(x, k)
    assert v.shape == (2, 2, k) and torch.equal(i, si)
    torch.testing.assert_close(v, sv, atol=1e-5, rtol=1e-5)
    vals = torch.full((6, k), -3.0, device=DEVICE)
    ids = torch.full((6, k), -9, dtype=torch.int64, device=DEVICE)
    got = topk_logprobs(x.flatten(0, 1), k, out=(vals[1:5], ids[1:5]))
    assert got[0].data_ptr() == vals[1:5].data_ptr() and got[1].data_ptr() == ids[1:5].data_ptr()
    assert torch.equal(ids[1:5], si.flatten(0, 1)) and torch.equal(vals[1:5], v.flatten(0, 1))
    assert (vals[[0, 5]] == -3.0).all() and (ids[[0, 5]] == -9).all()
    with pytest.raises(ValueError, match="out must be"):
        topk_logprobs(x.flatten(0, 1), k, out=(vals[:3], ids[:3]))


def test_tree_ops_routes_wide_rows(monkeypatch):
    """tree_ops: rows wider than MAX_V take the split kernels on the Triton backend, torch's log_softmax +
    topk on the torch backend."""
    from kernels_triton import topk as topk_mod
    from specdec.spec import tree_ops

    calls = []
    real = topk_mod._launch_split
    monkeypatch.setattr(topk_mod, "_launch_split", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    x = torch.randn(2, MAX_V + 100, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    rv, ri = topk_logprobs_ref(x, 4)
    be = "triton" if DEVICE == "cpu" else "auto"
    out = (torch.empty(2, 4, device=DEVICE), torch.empty(2, 4, dtype=torch.int64, device=DEVICE))
    got = tree_ops.topk_logprobs(x, 4, backend=be, out=out)
    assert got[0] is out[0] and torch.equal(out[1], ri)
    torch.testing.assert_close(out[0], rv, atol=1e-5, rtol=1e-5)
    assert torch.equal(tree_ops.topk(x, 4, backend=be)[1], ri)
    assert calls == ["topk_logprobs", "topk"]
    v, i = tree_ops.topk_logprobs(x, 4, backend="torch")
    assert calls == ["topk_logprobs", "topk"] and torch.equal(i, ri)
