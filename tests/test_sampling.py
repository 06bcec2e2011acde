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

import json
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


@pytest.mark.parametrize("case", ["3x2x4097", "1x1x4097", "ties", "by-hand"])
def test_warp_with_tile_accumulators_matches_ref(case, kernel_options):
    """Kernel option warp_tiles (the search passes reduce their tiles once per pass): the same kept sets
    and values as the reference, away from the documented rounding boundaries, ties included."""
    kernel_options.set_(warp_tiles=True)
    if case == "by-hand":
        return test_tie_rule_by_hand()
    if case == "ties":
        return test_warp_ties_match_ref()
    B, T, V, scale = (3, 2, 4097, 3.0) if case == "3x2x4097" else (1, 1, 4097, 6.0)
    gen = torch.Generator().manual_seed(B * 7 + V)
    check_against_ref((torch.randn(B, T, V, generator=gen) * scale), random_params(B, V, gen))


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


# ------------------------------------------------------------------------------ exactness, statistically

# A Markov-chain target over STAT_V tokens: the target's logits after token a are L[a], so plain
# sampling's marginal at every position is known exactly (pi_1 = P[root], pi_{d+1} = pi_d @ P with
# P[a] = the warped softmax of L[a]). Speculative generation of STAT_N sequences (a draft chain
# Ld, correlated with L so drafts are often accepted) through the verify rule on warped logits
# must give each position the same marginal.
#
# Sample size: chi-square over the tokens the warpers keep. Moving 0.01 of probability between the
# two likeliest tokens (p ~ 0.3 each: the hardest 1% bias for chi-square, whose terms are delta^2 / p)
# gives a noncentrality N * 2 * 0.01^2 / 0.3 = 80 at N = 120000; chi2(11) then exceeds its 1e-6
# critical value (48.9) with probability ~0.99, while a correct sampler fails with probability 1e-6
# per check (and, with fixed seeds, deterministically never). ``test_stat_check_catches_a_one_percent_bias``
# checks that power on the samples themselves.
STAT_V = 12
STAT_N = 120_000
POSITIONS = 3
WARPERS = {  # (temperature, top_k, top_p, min_p)
    "top_p": (1.0, 0, 0.8, 0.0),
    "top_k": (0.9, 3, 1.0, 0.0),
    "min_p": (1.0, 0, 1.0, 0.15),
    "top_k+top_p": (0.8, 5, 0.7, 0.0),
    "all": (1.2, 6, 0.9, 0.05),
}
SHAPES = {"chain": [-1, 0, 1, 2], "tree": [-1, 0, 0, 1, 1, 2, 3], "plain": [-1]}


def chi2_critical(df: int, z: float = 4.753) -> float:
    """Upper 1e-6 quantile of chi2(df) (Wilson-Hilferty; z = the normal 1e-6 quantile), slightly
    conservative: 49.9 at df = 11 where the exact value is 48.9."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def markov(seed=0):
    gen = torch.Generator().manual_seed(seed)
    L = torch.randn(STAT_V, STAT_V, generator=gen) * 1.5  # [V, V] target logits after each token
    Ld = L + torch.randn(STAT_V, STAT_V, generator=gen) * 0.8  # the draft's
    return L, Ld


def warped_probs(logits, params):
    """[.., V] -> float64 probabilities of the warped distribution (the reference warper)."""
    rows = logits.reshape(-1, logits.shape[-1])
    p = torch.tensor(params, dtype=torch.float32).expand(rows.shape[0], 4)
    return torch.softmax(warp_logits_ref(rows, p).double(), -1).view(logits.shape)


def plain_marginals(L, params, root=0):
    """[POSITIONS, V] float64: the exact per-position marginals of plain sampling."""
    P = warped_probs(L, params)  # [V, V]
    pis = [P[root]]
    for _ in range(POSITIONS - 1):
        pis.append(pis[-1] @ P)
    return torch.stack(pis)


def speculate(L, Ld, params, shape, drafts, N=STAT_N, seed=1, root=0, warp_target=True):
    """[N, POSITIONS] tokens generated by N sequences from ``root`` through the verify rule.

    ``drafts``: "deterministic" (a node's children are its parent's top draft tokens, q = one-hot),
    "sampled" (children i.i.d. from q = softmax(Ld[parent]), draft_probs = q) or "sampled_warped"
    (q = the draft's warped distribution). ``warp_target`` False verifies against the unwarped
    target (a negative control)."""
    gen = torch.Generator().manual_seed(seed)
    par = torch.tensor(shape, dtype=torch.int32)
    T = par.numel()
    rank = [sum(1 for j in range(1, i) if shape[j] == shape[i]) for i in range(T)]  # sibling rank
    # The warper works row by row, so a node's warped row is the warped table's row of its token.
    pw = torch.tensor(params, dtype=torch.float32).expand(STAT_V, 4)
    W = warp_logits_ref(L, pw) if warp_target else L  # [V, V]
    Q = warped_probs(Ld, params).float() if drafts == "sampled_warped" else torch.softmax(Ld, -1)  # [V, V]
    top = Ld.topk(T, -1).indices  # [V, T] the draft's best tokens after each token
    seqs = torch.full((N, POSITIONS + T), -1, dtype=torch.long)
    filled = torch.zeros(N, dtype=torch.long)
    cur = torch.full((N,), root, dtype=torch.long)
    while int(filled.min()) < POSITIONS:
        tokens = torch.zeros(N, T, dtype=torch.long)
        tokens[:, 0] = cur
        dp = None if drafts == "deterministic" else torch.zeros(N, T, STAT_V)
        for i in range(1, T):
            parent = tokens[:, shape[i]]
            if drafts == "deterministic":
                tokens[:, i] = top[parent, rank[i]]
            else:
                tokens[:, i] = torch.multinomial(Q[parent], 1, generator=gen)[:, 0]
                dp[:, i] = Q[parent]
        target = W[tokens]  # [N, T, V]
        u = torch.rand(N, T, 2, generator=gen)
        acc, _, out = verify_accept_ref(target, tokens, par.expand(N, T), 1.0 if warp_target else params[0], u, dp)
        n_new = acc.long() + 1
        for j in range(T):  # committed tokens j = 0 .. acc into each row's next free positions
            put = (j < n_new) & (filled + j < seqs.shape[1])
            seqs[put.nonzero()[:, 0], (filled + j)[put]] = out[put, j]
        cur = out[torch.arange(N), acc.long()]
        filled += n_new
    return seqs[:, :POSITIONS]


def position_chi2(seqs, pis):
    """Per position: (chi2 over the kept tokens, its 1e-6 critical value, counts outside the support)."""
    res = []
    for d in range(POSITIONS):
        counts = torch.bincount(seqs[:, d], minlength=STAT_V).double()
        exp = seqs.shape[0] * pis[d]
        sup = pis[d] > 0
        chi = float(((counts[sup] - exp[sup]) ** 2 / exp[sup]).sum())
        res.append((chi, chi2_critical(int(sup.sum()) - 1), int(counts[~sup].sum())))
    return res


# Every warper and the top-k + top-p combination once, over chains and trees and each kind of draft
# (~5-15 s each on 2 CPU cores: verify_accept_ref over 120000 rows); the whole grid, plain sampling
# through the same rule and all four warpers together are marked slow.
FAST = [("top_p", "chain", "deterministic"), ("top_k", "tree", "sampled"), ("min_p", "tree", "deterministic"),
        ("top_k+top_p", "chain", "sampled_warped"), ("top_k+top_p", "tree", "deterministic")]
GRID = [(w, s, d) for w in WARPERS for s in ("chain", "tree") for d in ("deterministic", "sampled", "sampled_warped")]
GRID += [(w, "plain", "deterministic") for w in WARPERS]


@pytest.mark.parametrize("warper,shape,drafts", FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in GRID
                                                        if c not in FAST], ids=lambda v: str(v))
def test_speculative_sampling_matches_plain_per_position(warper, shape, drafts):
    L, Ld = markov()
    params = WARPERS[warper]
    pis = plain_marginals(L, params)
    assert ((pis > 0).sum(-1) < STAT_V).all() or warper == "all", "the warper removes tokens somewhere"
    seqs = speculate(L, Ld, params, SHAPES[shape], drafts)
    for d, (chi, crit, outside) in enumerate(position_chi2(seqs, pis)):
        assert outside == 0, f"position {d + 1}: {outside} tokens the warpers remove were committed"
        assert chi < crit, f"position {d + 1}: chi2 = {chi:.1f} >= {crit:.1f}"


def test_stat_check_catches_a_one_percent_bias():
    # Power, on real samples: the same counts tested against marginals with 0.01 moved between the
    # two likeliest tokens fail; and verifying against the unwarped target (warpers applied by plain
    # sampling only) fails by far.
    L, Ld = markov()
    params = WARPERS["top_k+top_p"]
    pis = plain_marginals(L, params)
    seqs = speculate(L, Ld, params, SHAPES["tree"], "deterministic")
    shifted = pis.clone()
    for d in range(POSITIONS):
        a, b = pis[d].topk(2).indices.tolist()
        shifted[d, a] += 0.01
        shifted[d, b] -= 0.01
    assert all(chi > crit for chi, crit, _ in position_chi2(seqs, shifted))
    unwarped = speculate(L, Ld, params, SHAPES["tree"], "deterministic", N=20_000, warp_target=False)
    chi, crit, outside = position_chi2(unwarped, pis)[0]
    assert outside > 0 or chi > 10 * crit


@pytest.mark.parametrize("drafts", ["deterministic", "sampled"])
def test_kernels_make_the_references_decisions(drafts):
    # One speculative step of 8 sequences (56 tree rows) through the Triton warper and verify kernels (on the
    # interpreter here) commits exactly what the reference path commits for the same uniforms.
    L, Ld = markov()
    params = WARPERS["all"]
    shape = SHAPES["tree"]
    N, T = 8, len(shape)
    gen = torch.Generator().manual_seed(9)
    par = torch.tensor(shape, dtype=torch.int32).expand(N, T).contiguous()
    tokens = torch.randint(0, STAT_V, (N, T), generator=gen)
    dp = None if drafts == "deterministic" else torch.softmax(Ld[tokens[:, par[0].clamp(min=0)]], -1)
    logits = L[tokens].contiguous()  # [N, T, V]
    pw = torch.tensor(params, dtype=torch.float32).expand(N, 4).contiguous()
    u = torch.rand(N, T, 2, generator=gen)
    want = verify_accept_ref(warp_logits_ref(logits, pw), tokens, par, 1.0, u, dp)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = verify_accept(warp_logits(dev(logits), dev(pw)), dev(tokens), dev(par), 1.0, dev(u), dev(dp))
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu())


# ------------------------------------------------------------------------------ end to end (engine)


@pytest.fixture(scope="module")
def tiny():
    from test_engine import tiny_model

    return tiny_model(layers=2)


def eagle3(tiny, topk, steps, ntok):
    from test_spec import tiny_head

    from specdec.spec import Eagle3Drafter

    return Eagle3Drafter(tiny_head(tiny), tiny, topk=topk, steps=steps, num_draft_tokens=ntok)


def serve(model, requests, max_new, *, drafter=None, k=0, sampling=None, seed=0, max_batch=64):
    """Run (prompt, sampling or None) requests to the end at a fixed k; returns the requests."""
    from specdec.engine.engine import Engine, EngineConfig

    # Short requests: max_seq_len bounds the page table the reference attention reads per row
    cfg = EngineConfig(max_batch_size=max_batch, page_size=4, kv_cache_tokens=4096, max_seq_len=40, seed=seed,
                       per_request_sampling=True, **(sampling or {}))
    engine = Engine(model, cfg, drafter=drafter, ks=(k,))
    reqs = [engine.add_request(p, max_new, sampling=s) for p, s in requests]
    while engine.has_work():
        engine.step(k)
    engine.check()
    return reqs


@pytest.mark.parametrize("shape", [None, (2, 2, 4), (1, 3, 3)], ids=["plain", "tree", "chain"])
def test_engine_greedy_and_argmax_equivalent_rows_stay_token_identical(tiny, shape):
    # Per-row sampling: greedy rows, top_k = 1 rows and min_p = 1 rows (all three keep the argmax
    # alone) share batches with sampled rows; the first three must equal plain greedy decoding.
    from test_engine import rand_prompts, reference

    prompts = rand_prompts([5, 9, 12, 7, 6, 11], seed=2)
    kinds = [None, {"temperature": 0.8, "top_k": 1}, {"temperature": 1.3, "min_p": 1.0},
             {"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.0}]
    drafter = None if shape is None else eagle3(tiny, *shape)
    reqs = serve(tiny, list(zip(prompts, kinds)), 12, drafter=drafter, k=0 if shape is None else shape[2])
    for r, p, kind in zip(reqs, prompts, kinds):
        assert r.error is None and len(r.output_ids) == 12
        if kind is None or kind.get("top_k") == 1 or kind.get("min_p") == 1.0:
            assert r.output_ids == reference(tiny, p, 12), kind
    if shape is not None:
        assert any(r.accept_stats for r in reqs)


def test_engine_refuses_bad_request_sampling_alone(tiny):
    from test_engine import rand_prompts

    from specdec.engine.engine import Engine, EngineConfig

    p = rand_prompts([5, 6, 7], seed=1)
    reqs = serve(tiny, [(p[0], {"top_p": 1.5}), (p[1], {"top_q": 0.9}), (p[2], {"temperature": 1.0, "top_k": 4})], 4)
    assert reqs[0].finish_reason == "error" and "sampling.top_p=1.5" in reqs[0].error
    assert reqs[1].finish_reason == "error" and "unknown key sampling.top_q" in reqs[1].error
    assert reqs[2].error is None and len(reqs[2].output_ids) == 4
    # An engine that samples every row alike refuses a request asking otherwise (naming the fix).
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=512))
    r = engine.add_request(p[0], 4, sampling={"temperature": 1.0})
    assert r.finish_reason == "error" and "per_request_sampling" in r.error
    ok = engine.add_request(p[1], 4, sampling={"temperature": 0.0})  # the engine's own parameters
    engine.run_until_done()
    assert ok.error is None and len(ok.output_ids) == 4


def first_two_token_marginals(model, prompt, params):
    """Exact [2, V] marginals of the first two sampled tokens after ``prompt`` (reference forwards)."""
    from specdec.engine.reference import generate_reference  # noqa: F401 (the ground truth's model use)

    def next_probs(ids):
        with torch.no_grad():
            return probs_from_logits(model_logits(model, ids), params).double()

    p1 = next_probs(prompt)
    p2 = sum(p1[x] * next_probs(prompt + [x]) for x in p1.nonzero()[:, 0].tolist())
    return torch.stack([p1, p2])


def model_logits(model, ids):
    from specdec.models.ops import AttentionMeta

    n, ps = len(ids), 16
    pages = -(-n // ps)
    k, v = model.new_kv_cache(pages, ps)
    table = torch.arange(pages, dtype=torch.int32)[None]
    meta = AttentionMeta(cu_q_lens=torch.tensor([0, n], dtype=torch.int32), kv_lens=torch.tensor([n], dtype=torch.int32),
                         page_table=table, slot_mapping=torch.arange(n), max_q_len=n)
    out = model(torch.tensor(ids), torch.arange(n), meta, k, v)
    return model.logits(out.hidden[-1:])[0]


def oracle(model, prompt, tree: bool):
    """A drafter whose drafts follow the target's greedy continuation of ``prompt`` (likely under the
    warpers, so drafts get accepted): a chain of it, or with ``tree`` the 4-node tree
    root -> {g1, g1 + 1}, g1 -> g2 (g = the greedy continuation; the sibling is usually wrong)."""
    from test_engine import VOCAB, reference
    from test_spec import OracleDrafter

    from specdec.spec.tree import DraftTree, ancestor_masks

    class Oracle(OracleDrafter):
        def propose(self, state, B, T, valid, context):
            (p, cont), = self.cont.items()
            fut = torch.tensor([(cont[len(h) - len(p):] + [0] * T)[:T] for h in context[:B]])  # [B, T]
            toks = torch.zeros(B, T, dtype=torch.long)
            toks[:, 0] = state.pending[:B].cpu()
            if tree:  # T = 4
                parents = torch.tensor([-1, 0, 0, 1], dtype=torch.int32)
                toks[:, 1], toks[:, 2], toks[:, 3] = fut[:, 0], (fut[:, 0] + 1) % VOCAB, fut[:, 1]
            else:
                parents = torch.arange(T, dtype=torch.int32) - 1
                toks[:, 1:] = fut[:, : T - 1]
            depth = torch.tensor([0, 1, 1, 2] if tree else list(range(T)), dtype=torch.int32)
            parents, depth = parents.expand(B, T).contiguous(), depth.expand(B, T).contiguous()
            return DraftTree(toks, parents, depth, ancestor_masks(parents, T))

    return Oracle({tuple(prompt): reference(model, prompt, 12)})


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "chain"])
def test_engine_speculative_sampling_follows_the_warped_target(tiny, tree):
    # 256 copies of one prompt at temperature 0.9, top-k 6, top-p 0.8, speculating 3 tokens a step:
    # the first two tokens never leave the warped support, and their frequencies pass a chi-square
    # against the exact marginals (a gross-error check at this size, ~15 s per case on 2 CPU cores;
    # the verify-rule tests above carry the 1% one).
    from test_engine import rand_prompts

    params = SamplingParams(0.9, 6, 0.8, 0.0)
    prompt = rand_prompts([7], seed=11)[0]
    pis = first_two_token_marginals(tiny, prompt, params)
    N = 256
    reqs = serve(tiny, [(prompt, None)] * N, 2, drafter=oracle(tiny, prompt, tree), k=3,
                 sampling=params.as_dict(), seed=5)
    seqs = torch.tensor([r.output_ids[:2] for r in reqs])
    assert all(r.accept_stats for r in reqs)  # every request speculated
    assert sum(1 for r in reqs for st in r.accept_stats if st[2] >= 0) > N // 10  # and drafts got accepted
    for d in range(2):
        counts = torch.bincount(seqs[:, d], minlength=pis.shape[1]).double()
        sup = pis[d] > 0
        assert counts[~sup].sum() == 0, f"position {d + 1} left the warped support"
        exp = N * pis[d][sup]
        chi = float(((counts[sup] - exp) ** 2 / exp).sum())
        assert chi < chi2_critical(int(sup.sum()) - 1), f"position {d + 1}: chi2 {chi:.1f}"


# ------------------------------------------------------------------------------ the command line


def test_cli_bad_sampling_config_named(tmp_path):
    # Bad run-level values and unknown keys stop the run before anything loads, naming the key.
    from test_run import run_cli

    proc = run_cli("sampling.top_p=1.5", "device=cpu", "logger=none", tmp_path=tmp_path / "a")
    assert proc.returncode == 2 and "sampling.top_p=1.5: must be in (0, 1]" in proc.stderr, proc.stderr[-2000:]
    proc = run_cli("+sampling.top_q=0.9", "device=cpu", "logger=none", tmp_path=tmp_path / "b")
    assert proc.returncode == 2 and "unknown config key sampling.top_q" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow  # SmolLM2 on the CPU: ~40 s
def test_cli_per_request_sampling_overrides(tmp_path):
    # In a jsonl workload a request's bad sampling fails that request alone, its key named in the record.
    from test_run import run_cli

    f = tmp_path / "prompts.jsonl"
    f.write_text('{"id": "a", "prompt": "Say hello.", "sampling": {"temperature": 0.8, "top_p": 0.9, "top_k": 20}}\n'
                 '{"id": "b", "prompt": "Say hi.", "sampling": {"top_p": 7}}\n'
                 '{"id": "c", "prompt": "Say bye.", "sampling": {"topp": 0.9}}\n'
                 '{"id": "d", "prompt": "Say yes."}\n')
    proc = run_cli("workload=jsonl", f"workload.path={f}", "engine.max_new_tokens=4", "device=cpu", "logger=none",
                   tmp_path=tmp_path / "c")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "c" / "run" / "requests.jsonl").read_text().splitlines())}
    assert records["a"]["sampling"] == {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.0}
    assert records["a"]["output_tokens"] == 4 and records["d"]["output_tokens"] > 0 and "sampling" not in records["d"]
    assert "sampling.top_p=7: must be in (0, 1]" in records["b"]["error"]
    assert "unknown key sampling.topp" in records["c"]["error"]


def test_warped_path_without_warpers_is_the_temperature_path():
    # Per-row sampling with every warper off verifies warped logits x = l / t at temperature 1: the
    # same numbers verify_accept computes from l at temperature t, so the same decisions exactly.
    gen = torch.Generator().manual_seed(4)
    B, T, V = 6, 5, 300
    logits = torch.randn(B, T, V, generator=gen) * 2
    par = torch.tensor([-1, 0, 0, 1, 2], dtype=torch.int32).expand(B, T).contiguous()
    tokens = torch.randint(0, V, (B, T), generator=gen)
    tokens[:, 1] = logits[:, 0].argmax(-1)
    u = torch.rand(B, T, 2, generator=gen)
    params = torch.tensor([[0.7, 0, 1.0, 0.0]] * B)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    want = verify_accept(dev(logits), dev(tokens), dev(par), 0.7, dev(u))
    got = verify_accept(warp_logits(dev(logits), dev(params)), dev(tokens), dev(par), 1.0, dev(u))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ on the GPU (-m gpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("V", [49152, 151936])
@pytest.mark.parametrize("tiles", [False, True])
def test_warp_on_gpu_matches_ref_at_model_vocabularies(V, tiles, kernel_options):
    # The compiled kernel (not the interpreter) at SmolLM2's and Qwen3's vocabularies, bf16 logits, a
    # batch of 1..17-node trees, every warper on, off and combined; both settings of warp_tiles.
    kernel_options.set_(warp_tiles=tiles)
    gen = torch.Generator().manual_seed(V)
    for B, T in ((1, 1), (3, 17), (8, 4)):
        logits = (torch.randn(B, T, V, generator=gen) * 4).to(torch.bfloat16)
        check_against_ref(logits, random_params(B, V, gen))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [0, 3])
def test_engine_on_gpu_samples_with_run_level_warpers(k):
    # What `sampling.temperature=1.0 sampling.top_p=0.95` runs: Triton kernels, CUDA graphs, one set of
    # parameters for every row (no per-request sampling), plain (k = 0) and an EAGLE-3 tree.
    from test_engine import rand_prompts, tiny_model

    from specdec.engine.engine import Engine, EngineConfig

    model = tiny_model(layers=2, device="cuda", backend="auto")
    drafter = eagle3(model, 2, 2, 3) if k else None
    cfg = EngineConfig(max_batch_size=8, page_size=4, kv_cache_tokens=4096, max_seq_len=64, seed=0,
                       temperature=1.0, top_p=0.95)
    engine = Engine(model, cfg, drafter=drafter, ks=(k,))
    reqs = [engine.add_request(p, 8) for p in rand_prompts([5, 9, 3], seed=2)]
    while engine.has_work():
        engine.step(k)
    engine.check()
    assert all(len(r.output_ids) == 8 for r in reqs)
