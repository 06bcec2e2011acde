"""verify_accept (greedy and exact stochastic tree verification) against its plain-torch reference.

Random trees (random recursive trees, chains, wide EAGLE-like trees, padding nodes), tokens planted
on target argmaxes / samples so accept lengths vary, odd vocabularies (1000, 4099), T = 1 (plain
decoding). Outputs are allocated poisoned so unwritten entries fail. Exactness of the stochastic rule
is checked statistically on the reference over a large batch (the committed tokens must follow the
target distribution), with a lossy shortcut as a negative control; the kernel must make the same
decisions as the reference for the same uniforms.
"""

import pytest
import torch

from kernels_triton.verify_accept import MAX_TREE_TOKENS, verify_accept, verify_accept_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter rounds fp32 -> bf16 by truncation (FACTS.md): bf16 runs on the GPU only.
DTYPES = [torch.float32, torch.float16]
BF16 = [torch.bfloat16] if DEVICE == "cuda" else []


def with_dtypes(cases, gpu_cases=()):
    """Parameters: every case (a tuple) in fp32 and fp16, and the ``gpu_cases`` also in bf16 on a GPU (the
    ``-m gpu`` selection compiles every case's kernel variants, so it keeps a representative few)."""
    return [(*c, dt) for c in cases for dt in DTYPES] + [(*c, dt) for c in gpu_cases for dt in BF16]
INT_POISON = 0x5A5A  # not a valid output value (outputs are node indices < T, tokens < V, or -1)


@pytest.fixture
def poison(monkeypatch):
    """torch.empty / torch.empty_like return NaN-filled (float) or INT_POISON-filled (int) tensors."""
    real_empty, real_empty_like = torch.empty, torch.empty_like
    count = {"n": 0}

    def fill(t):
        count["n"] += 1
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(INT_POISON)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(real_empty_like(*a, **kw)))
    return count


# ------------------------------------------------------------------------------------- inputs


def random_parents(T, kind, gen):
    """[T] int32 parent array of one tree: 'chain', 'random' (random recursive tree), 'wide' (each
    node hangs off one of the 4 previous nodes, like an EAGLE top-k tree), 'padded' (a random tree
    over the first n <= T nodes, the rest padding)."""
    par = torch.full((T,), -1, dtype=torch.int32)
    n = T
    if kind == "padded":
        n = int(torch.randint(1, T + 1, (1,), generator=gen))
    for i in range(1, n):
        if kind == "chain":
            par[i] = i - 1
        elif kind == "wide":
            par[i] = int(torch.randint(max(0, i - 4), i, (1,), generator=gen))
        else:
            par[i] = int(torch.randint(0, i, (1,), generator=gen))
    return par


def children(par, node):
    return [c for c in range(node + 1, par.numel()) if int(par[c]) == node]


def make_greedy_case(B, T, V, dtype, kinds, gen, scale=3.0):
    """Logits, tokens, parents with target argmaxes planted along a random path of random depth
    (sometimes on two siblings, so the lowest-index rule matters); other tokens random."""
    logits = (torch.randn(B, T, V, generator=gen) * scale).to(dtype)
    am = logits.float().argmax(-1)  # [B, T]
    tokens = torch.randint(0, V, (B, T), generator=gen)
    parents = torch.stack([random_parents(T, kinds[b % len(kinds)], gen) for b in range(B)])
    for b in range(B):
        depth = int(torch.randint(0, T, (1,), generator=gen))
        cur = 0
        for _ in range(depth):
            kids = children(parents[b], cur)
            if not kids:
                break
            pick = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
            tokens[b, pick] = am[b, cur]
            if len(kids) > 1 and torch.rand(1, generator=gen) < 0.3:
                tokens[b, kids[0]] = am[b, cur]  # duplicate target token on a lower-index sibling
                pick = min(pick, kids[0])
            cur = pick
        for c in children(parents[b], cur):  # stop here unless a random token happens to match
            if tokens[b, c] == am[b, cur] and torch.rand(1, generator=gen) < 0.8:
                tokens[b, c] = (am[b, cur] + 1) % V
    return logits.to(DEVICE), tokens.to(DEVICE), parents.to(DEVICE)


def make_stochastic_case(B, T, V, dtype, kinds, gen, temperature, with_q, scale=2.0):
    """Child tokens drawn from a draft distribution close to the target at the parent (so paths get
    accepted): q = softmax(target logits / t + noise); with_q returns it as draft_probs (siblings
    i.i.d. from q), otherwise tokens are the same draws and the drafts count as deterministic."""
    logits = (torch.randn(B, T, V, generator=gen) * scale).to(dtype)
    parents = torch.stack([random_parents(T, kinds[b % len(kinds)], gen) for b in range(B)])
    tokens = torch.zeros(B, T, dtype=torch.long)
    q_rows = torch.softmax(logits.float() / temperature + 0.7 * torch.randn(B, T, V, generator=gen), -1)
    draft_probs = torch.zeros(B, T, V)
    for b in range(B):
        for c in range(1, T):
            par = int(parents[b, c])
            if par < 0:
                tokens[b, c] = int(torch.randint(0, V, (1,), generator=gen))  # padding: any token
                continue
            draft_probs[b, c] = q_rows[b, par]
            tokens[b, c] = int(torch.multinomial(q_rows[b, par], 1, generator=gen))
    uniforms = torch.rand(B, T, 2, generator=gen)
    dp = draft_probs.to(DEVICE) if with_q else None
    return logits.to(DEVICE), tokens.to(DEVICE), parents.to(DEVICE), uniforms.to(DEVICE), dp


def check_outputs_consistent(res, logits, tokens, parents):
    """Structural checks independent of the reference: a parent-linked path from the root, the
    committed tokens are the path's tokens then one in-vocab bonus, -1 after."""
    accept_len, nodes, out = (t.cpu() for t in res)
    B, T = tokens.shape
    V = logits.shape[-1]
    tokens, parents = tokens.cpu(), parents.cpu()
    for b in range(B):
        n = int(accept_len[b])
        assert 0 <= n < T
        assert int(nodes[b, 0]) == 0
        for i in range(1, n + 1):
            c = int(nodes[b, i])
            assert int(parents[b, c]) == int(nodes[b, i - 1]) and c > int(nodes[b, i - 1])
            assert int(out[b, i - 1]) == int(tokens[b, c])
        assert 0 <= int(out[b, n]) < V
        assert torch.all(nodes[b, n + 1 :] == -1) and torch.all(out[b, n + 1 :] == -1)


def assert_same(res, ref):
    for got, want, name in zip(res, ref, ("accept_len", "accepted_nodes", "out_tokens")):
        assert got.dtype == want.dtype, name
        assert torch.equal(got.cpu(), want.cpu()), f"{name}:\n{got}\nvs reference\n{want}"


TIE_EPS = 1e-5  # uniform shift that moves a decision across a threshold only if it was within 1e-5


def assert_matches_ref_up_to_ties(res, logits, tokens, parents, temperature, uniforms, dp, ref=None):
    """Kernel == reference, except requests whose decision sat within TIE_EPS of a threshold.

    The kernel's exp (ex2.approx on the GPU) and blocked cumsum differ from torch's by a few fp32
    ulps, so a uniform that falls between the two cumulative sums (probability ~ V * 1e-7 per bonus
    draw) may pick the neighbouring token. Such a request must then match the reference run with
    all its uniforms shifted by +-TIE_EPS, and there may be at most max(1, B / 100) of them; a real
    bug changes decisions far from any threshold and fails.
    """
    ref = ref if ref is not None else verify_accept_ref(logits, tokens, parents, temperature, uniforms, dp)
    for got, want in zip(res, ref):
        assert got.dtype == want.dtype and got.shape == want.shape
    got = [t.cpu() for t in res]
    want = [t.cpu() for t in ref]
    bad = (got[0] != want[0]) | (got[1] != want[1]).any(-1) | (got[2] != want[2]).any(-1)
    if not bad.any():
        return
    B = got[0].shape[0]
    assert int(bad.sum()) <= max(1, B // 100), f"{int(bad.sum())} of {B} requests differ from the reference"
    for shift in (TIE_EPS, -TIE_EPS):
        u = (uniforms + shift).clamp(0.0, 1.0 - 2**-24)
        alt = [t.cpu() for t in verify_accept_ref(logits, tokens, parents, temperature, u, dp)]
        same = (got[0] == alt[0]) & (got[1] == alt[1]).all(-1) & (got[2] == alt[2]).all(-1)
        bad = bad & ~same
    assert not bad.any(), (
        f"requests {bad.nonzero()[:, 0].tolist()} differ from the reference away from any threshold:\n"
        f"{got[2][bad]}\nvs\n{want[2][bad]}"
    )


# ------------------------------------------------------------------------------------- greedy


SPLITS = pytest.mark.parametrize("split", [False, True], ids=["one_program", "split_vocab"])


GREEDY_CASES = [
    (5, 1, 1000, ["random"]),  # plain decode
    (9, 9, 1000, ["random", "chain", "padded"]),
    (7, 16, 4099, ["wide", "chain", "padded", "random"]),
]


@SPLITS
@pytest.mark.parametrize("B,T,V,kinds,dtype", with_dtypes(GREEDY_CASES, GREEDY_CASES[2:]))
def test_greedy_matches_ref(B, T, V, kinds, dtype, poison, split):
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + V)
    logits, tokens, parents = make_greedy_case(B, T, V, dtype, kinds, gen)
    res = verify_accept(logits, tokens, parents, 0.0, split_vocab=split)
    assert poison["n"] >= 3
    ref = verify_accept_ref(logits, tokens, parents, 0.0)
    assert_same(res, ref)
    check_outputs_consistent(res, logits, tokens, parents)
    if T > 1:
        assert len(set(res[0].tolist())) >= 3, f"accept lengths do not vary: {res[0].tolist()}"


@SPLITS
def test_greedy_is_argmax_walk(split):
    # Independent of the reference: a chain whose first 3 drafts are the target argmaxes and whose
    # 4th is not; bonus = argmax at node 3. T = 1 is plain greedy decoding.
    gen = torch.Generator().manual_seed(1)
    V, T = 1000, 6
    logits = torch.randn(2, T, V, generator=gen).to(DEVICE)
    am = logits.argmax(-1).cpu()
    parents = torch.tensor([[-1, 0, 1, 2, 3, 4]] * 2, dtype=torch.int32, device=DEVICE)
    tokens = torch.zeros(2, T, dtype=torch.long)
    for i in range(1, T):
        tokens[:, i] = am[:, i - 1]
    tokens[:, 4] = (am[:, 3] + 7) % V
    tokens = tokens.to(DEVICE)
    accept_len, nodes, out = verify_accept(logits, tokens, parents, 0.0, split_vocab=split)
    assert accept_len.tolist() == [3, 3]
    assert nodes[0].tolist() == [0, 1, 2, 3, -1, -1]
    assert out[0].tolist() == [am[0, 0], am[0, 1], am[0, 2], am[0, 3], -1, -1]

    accept_len, nodes, out = verify_accept(logits[:, :1], tokens[:, :1], parents[:, :1], 0.0, split_vocab=split)
    assert accept_len.tolist() == [0, 0] and nodes.tolist() == [[0], [0]]
    assert out[:, 0].tolist() == am[:, 0].tolist()


@SPLITS
def test_greedy_ties_pick_lowest_index(split):
    # Equal maxima in different BLOCK_V chunks (V = 9001 spans three 4096-wide chunks): torch.argmax
    # and the kernel both return the first one.
    V = 9001
    logits = torch.randn(4, 1, V).clamp(max=2.0)
    logits[0, 0, [8500, 4100, 5000]] = 5.0
    logits[1, 0, [4097, 100]] = 5.0
    logits[2, 0, [9000]] = 5.0
    logits[3, 0, [8292, 4196, 100]] = 5.0  # the same lane (100 mod 4096) of three chunks
    logits = logits.to(DEVICE)
    tok = torch.zeros(4, 1, dtype=torch.long, device=DEVICE)
    par = torch.full((4, 1), -1, dtype=torch.int32, device=DEVICE)
    _, _, out = verify_accept(logits, tok, par, 0.0, split_vocab=split)
    assert out[:, 0].tolist() == [4100, 100, 9000, 100]


# ------------------------------------------------------------------------------------- stochastic


STOCHASTIC_CASES = [
    (6, 1, 1000, ["random"], 1.0),  # plain sampling
    (9, 9, 1000, ["random", "chain", "padded"], 0.7),
    (6, 16, 4099, ["wide", "padded", "random"], 1.3),
]


@pytest.mark.parametrize("with_q", [False, True], ids=["deterministic", "draft_probs"])
@pytest.mark.parametrize("B,T,V,kinds,temperature,dtype", with_dtypes(STOCHASTIC_CASES, STOCHASTIC_CASES[2:]))
def test_stochastic_matches_ref(B, T, V, kinds, temperature, dtype, with_q, poison):
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + V + int(with_q))
    logits, tokens, parents, u, dp = make_stochastic_case(B, T, V, dtype, kinds, gen, temperature, with_q)
    if dp is not None and dtype != torch.float32:
        dp = dp.to(dtype)
    res = verify_accept(logits, tokens, parents, temperature, u, dp)
    assert_matches_ref_up_to_ties(res, logits, tokens, parents, temperature, u, dp)
    check_outputs_consistent(res, logits, tokens, parents)
    if T > 1:
        assert len(set(res[0].tolist())) >= 2, f"accept lengths do not vary: {res[0].tolist()}"


@pytest.mark.parametrize("with_q", [False, True], ids=["deterministic", "draft_probs"])
def test_stochastic_later_siblings_match_ref(with_q, poison):
    # A root with 4 children (each with one child of its own): later siblings are tried against the
    # residual after earlier rejections, so the renormalisation (deterministic: p(x) / (1 - rejected
    # mass); draft_probs: the materialised max(r - q, 0)) decides many requests here.
    gen = torch.Generator().manual_seed(11 + int(with_q))
    B, T, V, temperature = 96, 9, 37, 0.8
    logits = torch.randn(B, T, V, generator=gen) * 1.5
    parents = torch.tensor([[-1, 0, 0, 0, 0, 1, 2, 3, 4]] * B, dtype=torch.int32)
    p0 = torch.softmax(logits[:, 0] / temperature, -1)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    dp = None
    if with_q:
        q = torch.softmax(logits[:, 0] / temperature + torch.randn(B, V, generator=gen), -1)
        tokens[:, 1:5] = torch.multinomial(q, 4, replacement=True, generator=gen)
        dp = torch.softmax(torch.randn(B, T, V, generator=gen), -1)
        dp[:, 1:5] = q[:, None]
    else:
        top = p0.topk(4, -1).indices  # the 4 most likely tokens, in random order
        tokens[:, 1:5] = top.gather(1, torch.argsort(torch.rand(B, 4, generator=gen), -1))
    u = torch.rand(B, T, 2, generator=gen)
    args = [t.to(DEVICE) for t in (logits, tokens, parents, u)]
    dp = dp.to(DEVICE) if dp is not None else None
    res = verify_accept(*args[:3], temperature, args[3], dp)
    assert_matches_ref_up_to_ties(res, *args[:3], temperature, args[3], dp)
    first = res[1][:, 1].cpu()
    assert int((first >= 2).sum()) >= 10, f"too few later siblings accepted: {first.tolist()}"


@pytest.mark.parametrize("with_q", [False, True], ids=["deterministic", "draft_probs"])
def test_stochastic_edge_cases(with_q, poison):
    # Children with out-of-vocab tokens, with p(x) = 0 (logit -inf), duplicate siblings, and (with
    # draft_probs) q(x) = 0 are never accepted; kernel and reference agree.
    gen = torch.Generator().manual_seed(7)
    B, T, V = 8, 6, 300
    logits = torch.randn(B, T, V, generator=gen) * 2
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1]] * B, dtype=torch.int32)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    tokens[:, 1] = torch.tensor([-3, V, V + 5, -1, 5, 6, 7, 8])  # out of range for b < 4
    logits[4:, 0, 5:9] = float("-inf")  # p(x) = 0 for b >= 4 (tokens 5..8)
    tokens[:, 2] = tokens[:, 3] = logits[:, 0].argmax(-1)  # duplicate siblings on the mode
    u = torch.rand(B, T, 2, generator=gen)
    dp = None
    if with_q:
        dp = torch.softmax(torch.randn(B, T, V, generator=gen), -1)
        dp[torch.arange(B), 2, tokens[:, 2]] = 0.0  # q(x) = 0 at node 2
    args = [t.to(DEVICE) for t in (logits, tokens, parents)]
    u, dp = u.to(DEVICE), dp.to(DEVICE) if dp is not None else None
    res = verify_accept(*args, 1.0, u, dp)
    assert_matches_ref_up_to_ties(res, *args, 1.0, u, dp)
    nodes = res[1].cpu()
    assert not (nodes == 1).any(), "a child with p(x) = 0 or an out-of-vocab token was accepted"
    if with_q:
        assert not (nodes == 2).any(), "a child with q(x) = 0 was accepted"
    else:
        # Node 3 repeats node 2's token: it can only be tried after 2 was rejected, and then r(x) = 0.
        assert not (nodes == 3).any(), "a duplicate of a rejected sibling was accepted"


def test_stochastic_all_zero_residual_falls_back_to_p(poison):
    # Unnormalised draft rows q = 1.5 p make max(p - q, 0) = 0: after a rejection (probability 1/3)
    # the residual is empty and the reference falls back to p; the kernel must agree.
    gen = torch.Generator().manual_seed(3)
    B, T, V = 24, 3, 77
    logits = torch.randn(B, T, V, generator=gen)
    parents = torch.tensor([[-1, 0, 0]] * B, dtype=torch.int32)
    p0 = torch.softmax(logits[:, 0], -1)
    dp = torch.zeros(B, T, V)
    dp[:, 1] = dp[:, 2] = 1.5 * p0
    tokens = torch.multinomial(p0, 2, replacement=True, generator=gen)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), tokens], 1)
    u = torch.rand(B, T, 2, generator=gen)
    args = [t.to(DEVICE) for t in (logits, tokens, parents)]
    u, dp = u.to(DEVICE), dp.to(DEVICE)
    res = verify_accept(*args, 1.0, u, dp)
    assert_matches_ref_up_to_ties(res, *args, 1.0, u, dp)
    assert (res[0].cpu() == 0).any() and (res[0].cpu() == 1).any()


# ------------------------------------------------------------------------------------- statistics

# Statistical check: the committed tokens must follow the target. With T nodes the first committed
# token must be ~ p0 = softmax(l0 / t), and the second, given the first is x, ~ softmax(L[x] / t)
# (L[x] = the target's logits after x). Chi-square over V = 12 bins (11 dof) with a fixed seed:
# the 1e-6 tail of chi2(11) is 48.9, so a correct sampler fails with probability ~1e-6 per check
# for a fresh seed (and deterministically never with this one); the lossy control scores > 1000.
STAT_V = 12
STAT_N = 40000
STAT_TEMPERATURE = 0.9
CHI2_LIMIT = 48.9  # chi2(11) quantile at 1 - 1e-6


def chi_square(samples, probs):
    counts = torch.bincount(samples.cpu(), minlength=probs.numel()).double()
    expected = samples.numel() * probs.double()
    return float(((counts - expected) ** 2 / expected).sum())


def stat_target(gen):
    """Root target p0 with one token above 0.3 (so the lossy shortcut has something to grab) and
    the conditional target logits L [V, V]."""
    p0 = torch.tensor([0.06, 0.04, 0.36, 0.05, 0.12, 0.03, 0.08, 0.05, 0.07, 0.04, 0.06, 0.04])
    l0 = torch.log(p0) * STAT_TEMPERATURE  # softmax(l0 / t) = p0
    L = torch.randn(STAT_V, STAT_V, generator=gen) * 1.2
    return l0, L


def deterministic_stat_case(N, gen):
    """Tree 0 -> {1, 2, 3}, 1 -> {4, 5}, 2 -> {6}; fixed root tokens (the 0.36 token second), fixed
    grandchildren; logits of a child with token x = L[x] (grandchildren rows random)."""
    l0, L = stat_target(gen)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2], dtype=torch.int32)
    tokens = torch.tensor([0, 4, 2, 9, 1, 7, 3])
    T = parents.numel()
    logits = torch.randn(T, STAT_V, generator=gen)
    logits[0] = l0
    for c in (1, 2, 3):
        logits[c] = L[tokens[c]]
    uniforms = torch.rand(N, T, 2, generator=gen)
    return (logits.expand(N, T, STAT_V), tokens.expand(N, T), parents.expand(N, T), uniforms, None, l0, L)


def sampled_stat_case(N, gen):
    """Tree 0 -> {1, 2, 3} i.i.d. from q0, each root child c -> one grandchild ~ Q[x_c]; draft_probs
    carry q0 / Q[x_c]; logits of a root child with token x = L[x] (duplicates get equal rows)."""
    l0, L = stat_target(gen)
    # The draft over-proposes the 0.36 token (q0 = 0.6), so the exact rule rejects it 40% of the time.
    q0 = 0.4 * torch.softmax(torch.randn(STAT_V, generator=gen), -1)
    q0[2] += 0.6
    Q = torch.softmax(torch.randn(STAT_V, STAT_V, generator=gen) * 1.5, -1)
    parents = torch.tensor([-1, 0, 0, 0, 1, 2, 3], dtype=torch.int32)
    T = parents.numel()
    tokens = torch.zeros(N, T, dtype=torch.long)
    tokens[:, 1:4] = torch.multinomial(q0, N * 3, replacement=True, generator=gen).view(N, 3)
    dp = torch.zeros(N, T, STAT_V)
    dp[:, 1:4] = q0
    for g, c in ((4, 1), (5, 2), (6, 3)):
        rows = Q[tokens[:, c]]  # [N, V]
        tokens[:, g] = torch.multinomial(rows, 1, generator=gen)[:, 0]
        dp[:, g] = rows
    logits = torch.randn(N, T, STAT_V, generator=gen)
    logits[:, 0] = l0
    logits[:, 1:4] = L[tokens[:, 1:4]]
    uniforms = torch.rand(N, T, 2, generator=gen)
    return logits, tokens, parents.expand(N, T), uniforms, dp, l0, L


def stat_scores(out_tokens, accept_len, l0, L):
    """(chi2 of the first token vs p0, worst chi2 of the second token vs softmax(L[x] / t) over the
    first tokens x that were accepted drafts in >= 2000 trials)."""
    p0 = torch.softmax(l0 / STAT_TEMPERATURE, -1)
    first = out_tokens[:, 0].cpu()
    scores = [chi_square(first, p0)]
    second = []
    acc = accept_len.cpu() >= 1
    for x in range(STAT_V):
        sel = acc & (first == x)
        if int(sel.sum()) >= 2000:
            second.append(chi_square(out_tokens[sel.to(out_tokens.device), 1].cpu(),
                                     torch.softmax(L[x] / STAT_TEMPERATURE, -1)))
    assert second, "no accepted first token with enough trials"
    return scores[0], max(second)


def lossy_uniforms(uniforms, tokens, parents, l0):
    """The shortcut 'always accept a root child whose p0(x) > 0.3' as uniforms: coin 0 never loses."""
    p0 = torch.softmax(l0 / STAT_TEMPERATURE, -1)
    grab = (parents == 0) & (p0[tokens.clamp(0, STAT_V - 1)] > 0.3)
    u = uniforms.clone()
    u[..., 0] = torch.where(grab, 0.0, u[..., 0])
    return u


@pytest.mark.parametrize("case", [deterministic_stat_case, sampled_stat_case], ids=["deterministic", "draft_probs"])
def test_stochastic_is_exact_statistically(case):
    gen = torch.Generator().manual_seed(2024)
    logits, tokens, parents, uniforms, dp, l0, L = case(STAT_N, gen)
    acc_len, nodes, out = verify_accept_ref(logits, tokens, parents, STAT_TEMPERATURE, uniforms, dp)
    assert (acc_len >= 1).float().mean() > 0.3  # the drafts are accepted often enough to matter
    chi_first, chi_second = stat_scores(out, acc_len, l0, L)
    assert chi_first < CHI2_LIMIT, f"first committed token does not follow p0: chi2 = {chi_first:.1f}"
    assert chi_second < CHI2_LIMIT, f"second committed token does not follow its target: chi2 = {chi_second:.1f}"

    # Negative control: the same test rejects the lossy shortcut.
    u_lossy = lossy_uniforms(uniforms, tokens, parents, l0)
    acc_l, _, out_l = verify_accept_ref(logits, tokens, parents, STAT_TEMPERATURE, u_lossy, dp)
    chi_lossy, _ = stat_scores(out_l, acc_l, l0, L)
    assert chi_lossy > 10 * CHI2_LIMIT, f"the lossy shortcut passes the test: chi2 = {chi_lossy:.1f}"

    # The kernel makes the reference's decisions for the same uniforms: exact on a sub-batch under
    # the CPU interpreter, and the full statistical check on the GPU.
    n = STAT_N if DEVICE == "cuda" else 128
    dev = [t[:n].contiguous().to(DEVICE) if t is not None else None for t in (logits, tokens, parents, uniforms, dp)]
    res = verify_accept(dev[0], dev[1], dev[2], STAT_TEMPERATURE, dev[3], dev[4])
    assert_matches_ref_up_to_ties(res, *dev[:3], STAT_TEMPERATURE, dev[3], dev[4],
                                  ref=(acc_len[:n], nodes[:n], out[:n]))
    if DEVICE == "cuda":
        k_first, k_second = stat_scores(res[2], res[0], l0, L)
        assert k_first < CHI2_LIMIT and k_second < CHI2_LIMIT


def test_stat_check_power_on_plain_sampling():
    # T = 1 is plain sampling: the bonus draw alone must follow p0 (and a biased draw must not).
    gen = torch.Generator().manual_seed(5)
    l0, _ = stat_target(gen)
    N = STAT_N
    logits = l0.expand(N, 1, STAT_V)
    tok = torch.zeros(N, 1, dtype=torch.long)
    par = torch.full((N, 1), -1, dtype=torch.int32)
    u = torch.rand(N, 1, 2, generator=gen)
    _, _, out = verify_accept_ref(logits, tok, par, STAT_TEMPERATURE, u)
    p0 = torch.softmax(l0 / STAT_TEMPERATURE, -1)
    assert chi_square(out[:, 0], p0) < CHI2_LIMIT
    _, _, out_b = verify_accept_ref(logits, tok, par, STAT_TEMPERATURE, u ** 1.05)  # slightly biased
    assert chi_square(out_b[:, 0], p0) > CHI2_LIMIT


# ------------------------------------------------------------------------------------- errors


def test_verify_accept_bad_inputs():
    B, T, V = 2, 3, 50
    logits = torch.randn(B, T, V, device=DEVICE)
    tok = torch.zeros(B, T, dtype=torch.long, device=DEVICE)
    par = torch.tensor([[-1, 0, 0]] * B, dtype=torch.int32, device=DEVICE)
    u = torch.rand(B, T, 2, device=DEVICE)
    with pytest.raises(ValueError, match="logits"):
        verify_accept(logits[0], tok, par, 0.0)
    with pytest.raises(ValueError, match="tokens"):
        verify_accept(logits, tok[:, :2], par, 0.0)
    with pytest.raises(ValueError, match="parents"):
        verify_accept(logits, tok, par.float(), 0.0)
    with pytest.raises(ValueError, match="uniforms"):
        verify_accept(logits, tok, par, 1.0)
    with pytest.raises(ValueError, match="uniforms"):
        verify_accept(logits, tok, par, 1.0, u.double())
    with pytest.raises(ValueError, match="draft_probs"):
        verify_accept(logits, tok, par, 1.0, u, torch.rand(B, T, V + 1, device=DEVICE))
    with pytest.raises(ValueError, match="temperature"):
        verify_accept(logits, tok, par, -0.5, u)
    with pytest.raises(ValueError, match=str(MAX_TREE_TOKENS)):
        big = MAX_TREE_TOKENS + 1
        verify_accept(torch.randn(1, big, 2, device=DEVICE), torch.zeros(1, big, dtype=torch.long, device=DEVICE),
                      torch.zeros(1, big, dtype=torch.int32, device=DEVICE), 0.0)


@SPLITS
def test_greedy_argmax_across_many_chunks(split):
    # V = 40001: ten 4096-wide chunks; maxima tied across chunks far apart, in one lane of several
    # chunks, in the last (partial) chunk and in neighbouring chunks.
    V = 40001
    logits = torch.randn(4, 1, V).clamp(max=2.0)
    logits[0, 0, [36000, 20000, 17000]] = 5.0  # chunks 8, 4 and 4 -> 17000
    logits[1, 0, [100 + 4096 * 9, 100 + 4096 * 5, 100 + 4096 * 2]] = 5.0  # lane 100 of chunks 9, 5, 2
    logits[2, 0, [40000]] = 5.0  # the last, partial chunk
    logits[3, 0, [12287, 12289]] = 5.0  # chunk 2 vs 3 of the first iteration
    logits = logits.to(DEVICE)
    tok = torch.zeros(4, 1, dtype=torch.long, device=DEVICE)
    par = torch.full((4, 1), -1, dtype=torch.int32, device=DEVICE)
    _, _, out = verify_accept(logits, tok, par, 0.0, split_vocab=split)
    assert out[:, 0].tolist() == [17000, 100 + 4096 * 2, 40000, 12287]


def test_greedy_nan_rows_give_valid_tokens():
    # Padding requests of a captured batch can carry garbage logits: NaN counts as -inf in both
    # variants, so every token is a valid index, and the two agree (an all-NaN row gives token 0).
    V = 5000
    logits = torch.randn(3, 4, V)
    logits[0] = float("nan")
    logits[1, :, ::3] = float("nan")
    logits[1, :, 4097] = 9.0
    logits = logits.to(DEVICE)
    tokens = torch.zeros(3, 4, dtype=torch.long, device=DEVICE)
    parents = torch.tensor([[-1, 0, 1, 2]] * 3, dtype=torch.int32, device=DEVICE)
    one = verify_accept(logits, tokens, parents, 0.0, split_vocab=False)
    split = verify_accept(logits, tokens, parents, 0.0, split_vocab=True)
    assert_same(split, one)
    assert split[2][0, 0].item() == 0 and split[2][1, 0].item() == 4097
    assert ((split[2] >= -1) & (split[2] < V)).all()


def test_split_greedy_counters_reset_and_default_rule(monkeypatch):
    # The split variant leaves its per-request arrival counters at 0 (the next launch, e.g. the next
    # replay of a captured step, counts from 0 again), and it is the default only for small logits.
    import kernels_triton.attention as attn
    import kernels_triton.verify_accept as va

    gen = torch.Generator().manual_seed(5)
    logits, tokens, parents = make_greedy_case(6, 8, 3000, torch.float32, ["random", "chain"], gen)
    want = verify_accept_ref(logits, tokens, parents, 0.0)
    for _ in range(3):
        assert_same(verify_accept(logits, tokens, parents, 0.0, split_vocab=True), want)
    assert not attn._COUNTERS[(logits.device, "verify_accept")][:6].any()

    launched = []
    real = va._greedy_split_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(va, "_greedy_split_kernel", Spy())
    assert_same(verify_accept(logits, tokens, parents, 0.0), want)  # 6 * 8 * 3000 * 4 bytes: split
    assert launched == [(2, 8, 6)]  # 2048-wide chunks
    monkeypatch.setattr(va, "SPLIT_GREEDY_MAX_BYTES", 6 * 8 * 3000 * 4 - 1)
    assert_same(verify_accept(logits, tokens, parents, 0.0), want)
    assert len(launched) == 1
