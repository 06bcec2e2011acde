"""topk_logprobs (the draft tree's branching step) against log_softmax + topk.

Odd shapes (N = 1, 5, 37; V = 50, 1000, 8192; k = 1, 4, 8), leading dims, a row stride wider than
the row, every dtype the device supports, outputs NaN-poisoned so unwritten elements fail; ties
must come out lowest index first (a stable sort is the reference there).
"""

import pytest
import torch

from kernels_triton.topk import MAX_V, _launch, topk, topk_logprobs, topk_logprobs_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,V,k", [(1, 8192, 4), (5, 1000, 8), (37, 50, 1), (3, 8192, 1)])
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
        topk_logprobs(torch.zeros(1, MAX_V + 1, device=DEVICE), 2)
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
