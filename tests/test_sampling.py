"""Sampling warpers (temperature, top-k, top-p, min-p): the kernel against its sort-based reference,
the tie rule, per-request parameters, validation, and exactness of speculative sampling under them.

Kernel vs reference: random rows (odd vocabularies 1000 / 4097, 1..70 rows, per-request parameters
with every warper on, off and combined, greedy rows, integer-valued logits for ties). The kept set
must be the reference's exactly; rows where a top-p group boundary or a min-p test lies within
fp32 rounding of the threshold are the documented exception and are left out (and counted).

Exactness (the statistical tests): a Markov-chain target over a tiny vocabulary, whose per-position
marginals under plain sampling are known exactly, generated speculatively with chains and trees
through the verify rule on warped logits; each position's token counts are chi-square-tested
against plain sampling's marginals.
"""

import math

import pytest
import torch

from kernels_triton.sampling import warp_logits, warp_logits_ref
from kernels_triton.verify_accept import verify_accept, verify_accept_ref
from specdec.errors import ConfigError
from specdec.spec.sampling import KEYS, SamplingParams, probs_from_logits, sample

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ------------------------------------------------------------------------------ kernel vs reference


def random_params(B, V, gen):
    """[B, 4] per-request (temperature, top_k, top_p, min_p), each warper on or off at random."""
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]  # noqa: E731
    rows = []
    for _ in range(B):
        rows.append([pick([0.0, 0.5, 0.8, 1.0, 1.5]), float(pick([0, 0, 1, 5, 50, V - 1, V])),
                     pick([1.0, 1.0, 0.1, 0.5, 0.9, 0.99]), pick([0.0, 0.0, 0.01, 0.1])])
    return torch.tensor(rows, dtype=torch.float32)


def boundary_rows(logits, params, tol=2e-6):
    """[B, T] bool: rows whose top-p group boundary or min-p test lies within ``tol`` (relative) of
    its threshold, where fp32 summation order or exp's last bit may decide (the documented exception:
    a few ulps for exp, about sqrt(V) ulps for a sum of V terms)."""
    lg = logits.double()
    B, T, V = lg.shape
    out = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        t, k, P, mu = params[b].tolist()
        if t <= 0:
            continue
        for i in range(T):
            x = (lg[b, i].float() / t).double()
            e = torch.exp(x - x.max())
            if mu > 0 and ((e - mu).abs() <= tol * mu).any():
                out[b, i] = True
            if P >= 1:
                continue
            keep = x >= x.sort(descending=True).values[int(k) - 1] if 0 < k < V else torch.ones(V, dtype=torch.bool)
            vals, inv = torch.unique(x[keep], return_inverse=True)  # ascending groups of equal x
            mass = torch.zeros(vals.numel(), dtype=torch.float64).index_add_(0, inv, e[keep])
            cum = mass.flip(0).cumsum(0)  # mass of the groups >= each value, from the top
            total = cum[-1]
            if ((cum - P * total).abs() <= tol * total).any():
                out[b, i] = True
    return out


def check_against_ref(logits, params, min_checked=0.8):
    out = warp_logits(logits.to(DEVICE), params.to(DEVICE)).cpu()
    ref = warp_logits_ref(logits, params)
    lg = logits if logits.dim() == 3 else logits[:, None]
    o3, r3 = (out, ref) if logits.dim() == 3 else (out[:, None], ref[:, None])
    edge = boundary_rows(lg, params)
    ok = ~edge
    kept, kept_ref = o3 > float("-inf"), r3 > float("-inf")
    bad = (kept != kept_ref).any(-1) & ok
    assert not bad.any(), f"kept sets differ in rows {bad.nonzero().tolist()}"
    assert torch.equal(o3[ok & True][kept[ok]], r3[ok][kept_ref[ok]]), "kept values differ"
    assert (kept.sum(-1) >= 1).all(), "a row kept nothing"
    assert ok.float().mean() >= min_checked, f"only {int(ok.sum())} of {ok.numel()} rows away from a boundary"
    probs = warp_logits(logits.to(DEVICE), params.to(DEVICE), probs=True).cpu()
    torch.testing.assert_close(probs[ok.view(probs.shape[:-1])] if logits.dim() == 3 else probs[ok[:, 0]],
                               torch.softmax(ref, -1)[ok.view(probs.shape[:-1])] if logits.dim() == 3
                               else torch.softmax(ref, -1)[ok[:, 0]], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("B,T,V,dtype,scale", [
    (24, 1, 1000, torch.float32, 3.0),  # many requests, plain decoding
    pytest.param(70, 1, 1000, torch.float32, 3.0, marks=pytest.mark.slow),  # ~30 s in the interpreter
    (3, 2, 4097, torch.float32, 3.0),  # tree rows of three requests, several search chunks
    (1, 1, 4097, torch.float32, 6.0),  # one row, peaked
    (4, 3, 1000, torch.float16, 2.0),  # half-precision logits
], ids=["24x1x1000", "70x1x1000", "3x2x4097", "1x1x4097", "fp16"])
def test_warp_matches_ref(B, T, V, dtype, scale):
    gen = torch.Generator().manual_seed(B * 7 + V)
    logits = (torch.randn(B, T, V, generator=gen) * scale).to(dtype)
    check_against_ref(logits, random_params(B, V, gen))


def test_warp_ties_match_ref():
    # Integer-valued logits over a 1000-token vocabulary: ~100 tokens share each value, so every
    # threshold falls inside a group of ties.
    gen = torch.Generator().manual_seed(3)
    B, V = 24, 1000
    logits = torch.randint(-4, 5, (B, 1, V), generator=gen).float() * 0.7
    check_against_ref(logits, random_params(B, V, gen), min_checked=0.7)


def test_tie_rule_by_hand():
    # x = [3, 2, 2, 2, 1, 0] at temperature 1
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]]).expand(4, 6).contiguous()
    params = torch.tensor([
        [1.0, 2, 1.0, 0.0],  # top-k 2: the 2nd largest is 2, tied three ways -> keep 4 tokens
        [1.0, 0, 0.5, 0.0],  # top-p 0.5: p(3) = 0.40 < 0.5, the 2s bring it past -> all three 2s kept
        [1.0, 0, 0.3, 0.0],  # top-p 0.3: the max alone holds 0.40 -> 1 token
        [1.0, 0, 1.0, 0.3],  # min-p 0.3: e = [1, .37, .37, .37, .14, .05] -> 4 tokens
    ])
    want = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]]).bool()
    for fn in (warp_logits, warp_logits_ref):
        out = fn(logits.to(DEVICE), params.to(DEVICE)).cpu()
        assert torch.equal(out > float("-inf"), want), fn.__name__


def test_greedy_rows_are_one_hot_at_the_first_maximum():
    logits = torch.tensor([[[0.5, 2.0, 2.0, -1.0]], [[1.0, 1.0, 1.0, 1.0]]])
    params = torch.tensor([[0.0, 1, 0.5, 0.2], [0.0, 0, 1.0, 0.0]])  # warpers ignored when greedy
    out = warp_logits(logits.to(DEVICE), params.to(DEVICE)).cpu()
    assert torch.equal(out, warp_logits_ref(logits, params))
    assert torch.equal(out.argmax(-1).flatten(), torch.tensor([1, 0]))
    assert torch.equal((out > float("-inf")).sum(-1).flatten(), torch.tensor([1, 1]))
    probs = warp_logits(logits.to(DEVICE), params.to(DEVICE), probs=True).cpu()
    assert torch.equal(probs.flatten(1), torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))


def test_each_request_gets_its_own_parameters():
    # Two requests, three tree rows each: the same logits, different parameters per request.
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(200, generator=gen) * 2
    logits = row.expand(2, 3, 200).contiguous()
    params = torch.tensor([[1.0, 7, 1.0, 0.0], [0.7, 0, 0.6, 0.0]])
    out = warp_logits(logits.to(DEVICE), params.to(DEVICE)).cpu()
    kept = (out > float("-inf")).sum(-1)
    assert (kept[0] == 7).all()
    assert torch.equal(out, warp_logits_ref(logits, params))
    assert (kept[1] == kept[1, 0]).all() and kept[1, 0] != 7


def test_warp_bad_inputs():
    logits = torch.randn(2, 3, 50, device=DEVICE)
    params = torch.tensor([[1.0, 0, 1.0, 0.0]] * 2, device=DEVICE)
    with pytest.raises(ValueError, match="params"):
        warp_logits(logits, params[:1])
    with pytest.raises(ValueError, match="params"):
        warp_logits(logits, params.double())
    with pytest.raises(ValueError, match="logits"):
        warp_logits(logits.int(), params)
    with pytest.raises(ValueError, match="contiguous"):
        warp_logits(logits.transpose(1, 2), params)
    with pytest.raises(ValueError, match="out"):
        warp_logits(logits, params, out=torch.empty(2, 3, 49, device=DEVICE))


# ------------------------------------------------------------------------------ parameters


def test_sampling_params_validation_names_the_key():
    assert SamplingParams.from_mapping(None) == SamplingParams()
    p = SamplingParams.from_mapping({"top_p": 0.9}, base=SamplingParams(temperature=0.7))
    assert p == SamplingParams(0.7, 0, 0.9, 0.0) and p.warps and not p.greedy
    for values, match in [({"top_q": 0.9}, r"unknown key sampling\.top_q; known sampling keys: " + ", ".join(KEYS)),
                          ({"top_p": 1.5}, r"sampling\.top_p=1\.5: must be in \(0, 1\]"),
                          ({"top_p": 0}, r"sampling\.top_p=0"),
                          ({"top_k": -1}, r"sampling\.top_k=-1"),
                          ({"top_k": 2.5}, r"sampling\.top_k=2\.5: must be an integer"),
                          ({"min_p": -0.1}, r"sampling\.min_p=-0\.1: must be in \[0, 1\]"),
                          ({"temperature": -1}, r"sampling\.temperature=-1"),
                          ({"temperature": 1e-9}, r"must be 0 \(greedy\) or at least"),
                          ({"temperature": "hot"}, r"sampling\.temperature='hot': must be a number"),
                          ({"temperature": float("nan")}, r"finite"),
                          ({"top_k": True}, r"sampling\.top_k=True")]:
        with pytest.raises(ConfigError, match=match):
            SamplingParams.from_mapping(values)
    with pytest.raises(ConfigError, match=r"request 7\.top_p"):
        SamplingParams.from_mapping({"top_p": 2}, where="request 7")
    with pytest.raises(ConfigError, match="must be a mapping"):
        SamplingParams.from_mapping([0.9])


def test_sample_and_probs_apply_the_warpers():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 64, generator=gen)
    p = probs_from_logits(logits, 0.8, top_k=5)
    assert torch.equal((p > 0).sum(-1), torch.tensor([5, 5, 5]))
    draws = sample(logits.expand(2000, 3, 64)[:, 1], SamplingParams(1.0, 0, 0.5, 0.0), torch.Generator().manual_seed(0))
    allowed = probs_from_logits(logits[1], 1.0, top_p=0.5) > 0
    assert allowed[draws].all()
    assert torch.equal(sample(logits, 0.0), logits.argmax(-1))
