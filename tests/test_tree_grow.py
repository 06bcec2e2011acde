"""Draft-tree growth kernels (kernels_triton/tree_grow.py) against their torch references, and the
EAGLE-3 drafter's kernel-built trees against the grow_tree reference."""

import os

import pytest
import torch

from kernels_triton import tree_grow
from specdec.spec.tree import grow_tree, topk_of

from test_tree import brute_masks

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs a GPU or TRITON_INTERPRET=1")


def poisoned_candidates(B, C):
    """Candidate buffers with garbage everywhere: every read slot must have been written."""
    tok, sc, par, dep = tree_grow.new_candidates(B, C, DEV)
    return tok.fill_(-7), sc.fill_(float("nan")), par.fill_(-9), dep.fill_(-5)


def random_round(g, B, F, K, Vd, first):
    # log-probs (< 0, descending): a child scores below its parent, as in real growth
    lp = (-torch.rand(B, F, K, generator=g) * 3 - 0.01).sort(dim=-1, descending=True).values.to(DEV)
    cid = torch.randint(0, Vd, (B, F, K), generator=g).to(DEV)
    score = None if first else torch.randn(B, F, generator=g).to(DEV)
    fcid = None if first else torch.randint(0, 50, (B, F), generator=g).to(DEV)
    return lp, cid, score, fcid


@pytest.mark.parametrize("first,F,K,n,d2t,H", [
    (True, 1, 4, 0, True, 24), (False, 4, 4, 4, True, 24), (False, 3, 3, 9, False, 24), (False, 2, 2, 6, True, 24),
    (False, 4, 4, 12, True, 24), pytest.param(False, 8, 8, 48, True, 24, marks=pytest.mark.gpu),
    pytest.param(True, 1, 4, 0, True, 2 * tree_grow.EXPAND_BLOCK_H + 40, marks=pytest.mark.gpu),
    (False, 4, 4, 4, True, 2 * tree_grow.EXPAND_BLOCK_H + 40)])  # (gpu: one compile per K and H, two cases)
def test_tree_expand_matches_reference(first, F, K, n, d2t, H):
    """One round: candidates, next frontier and the next round's K rows (tokens, positions, masks =
    parent's mask | own bit n_done + i, parent hidden) equal the reference; n = scratch rows so far.
    H wider than one program's chunk: the hidden copy over several programs per row, the last partial."""
    g = torch.Generator().manual_seed(F * 10 + K + n)
    B, Vd, C = 3, 40, 80 + F * K
    lp, cid, score, fcid = random_round(g, B, F, K, Vd, first)
    table = torch.randperm(1000, generator=g)[:Vd].to(DEV) if d2t else None
    front_mask = None if first else torch.randint(-2**62, 2**62, (B, F), generator=g).to(DEV)
    h_front = torch.randn(B, F + 2, H, generator=g).to(DEV)[:, 1:F + 1]  # a strided view, like the drafter's
    valid = torch.tensor([True, False, True], device=DEV)
    seq = torch.tensor([5, 9, 17], dtype=torch.int32, device=DEV)
    off, depth = 7, 3
    for with_rows in (True, False):
        want_c, got_c = poisoned_candidates(B, C), poisoned_candidates(B, C)
        args = (lp, cid, table, score, fcid, (front_mask, n) if with_rows else None, h_front, valid, seq)
        want = tree_grow.tree_expand_ref(want_c, off, depth, *args[:2], *args[2:])
        got = tree_grow.tree_expand(got_c, off, depth, *args[:2], *args[2:])
        sl = slice(off, off + F * K)
        for w, x in zip(want_c, got_c):
            assert torch.equal(w[:, sl], x[:, sl])
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        if with_rows:
            for w, x in zip(want[2], got[2]):
                assert w.shape == x.shape and torch.equal(w, x)
            tok, pos, mask, hid = got[2]
            assert tok.shape == (B, K) and hid.shape == (B, K, H)
            assert tok[1].eq(0).all()  # the invalid row's draft tokens are 0
            own = torch.bitwise_left_shift(torch.ones(K, dtype=torch.int64, device=DEV),
                                           torch.arange(n, n + K, device=DEV))
            assert ((mask & own[None, :]) == own[None, :]).all()  # every new row carries its own bit
            assert torch.equal(pos, (seq.long() + depth - 1)[:, None].expand(B, K))
        else:
            assert got[2] is None


def grown_candidates(g, B, K, steps, Vd):
    """Candidates of a real growth (closed under ancestors) through the reference rounds."""
    C = K + (steps - 1) * K * K
    cand = poisoned_candidates(B, C)  # the rounds write every slot
    lp, cid, _, _ = random_round(g, B, 1, K, Vd, True)
    score, fcid, _ = tree_grow.tree_expand_ref(cand, 0, 1, lp, cid, None)
    for r in range(steps - 1):
        lp, cid, _, _ = random_round(g, B, K, K, Vd, False)
        score, fcid, _ = tree_grow.tree_expand_ref(cand, K + r * K * K, r + 2, lp, cid, None, score, fcid)
    return cand


@pytest.mark.parametrize("K,steps,n", [(4, 5, 16), (8, 6, 32), pytest.param(8, 7, 48, marks=pytest.mark.gpu), (1, 5, 5),
                                       (3, 3, 20), pytest.param(2, 4, 1, marks=pytest.mark.gpu)])
def test_tree_select_matches_reference_and_is_a_tree(K, steps, n):
    g = torch.Generator().manual_seed(K * 100 + steps)
    B = 3
    cand = grown_candidates(g, B, K, steps, 50)
    root = torch.tensor([11, 12, 13], device=DEV)
    want = tree_grow.tree_select_ref(root, cand, n, steps)
    got = tree_grow.tree_select(root, cand, n, steps)
    for w, x in zip(want, got):
        assert w.dtype == x.dtype and torch.equal(w, x)
    tok, par, dep, mask = (t.cpu() for t in got)
    assert torch.equal(mask, brute_masks(par))
    assert (par[:, 1:] < torch.arange(1, n + 1)).all() and (par[:, 0] == -1).all()  # topological
    assert torch.equal(dep[:, 1:], dep.gather(1, par[:, 1:].long()) + 1)


def test_growth_rounds_rebuild_grow_tree():
    """expand + select rounds over fixed children give exactly grow_tree's tree."""
    g = torch.Generator().manual_seed(3)
    B, K, steps, n, Vd = 2, 3, 4, 10, 30
    table = torch.randperm(500, generator=g)[:Vd].to(DEV)
    first = torch.randn(B, Vd, generator=g).log_softmax(-1).to(DEV)
    kids = [torch.randn(B, K, Vd, generator=g).log_softmax(-1).to(DEV) for _ in range(steps - 1)]
    root = torch.tensor([1, 2], device=DEV)

    def expand(r, tokens, parent_slot):
        return topk_of(kids[r], K)

    want = grow_tree(root, topk_of(first, K), expand, topk=K, steps=steps, num_draft_tokens=n,
                     to_target=lambda i: table[i])
    cand = poisoned_candidates(B, K + (steps - 1) * K * K)
    lp, ids = topk_of(first, K)
    score, fcid, _ = tree_grow.tree_expand(cand, 0, 1, lp[:, None], ids[:, None], table)
    for r in range(steps - 1):
        lp, ids = topk_of(kids[r], K)
        score, fcid, _ = tree_grow.tree_expand(cand, K + r * K * K, r + 2, lp, ids, table, score, fcid)
    got = tree_grow.tree_select(root, cand, n, steps)
    for w, x in zip((want.tokens, want.parents, want.depth, want.mask), got):
        assert torch.equal(w, x)


def test_drafter_kernel_trees_equal_reference(monkeypatch, kernel_options):
    """Eagle3Drafter.propose (tree_expand / tree_select) builds the same tree as propose_reference
    (grow_tree over torch ops) from the same draft state, with padding rows in the batch."""
    from test_engine import tiny_model
    from test_spec import tiny_head
    from specdec.engine.engine import Engine, EngineConfig
    from specdec.spec import Eagle3Drafter

    kernel_options.set_(step_kernels=True)
    model = tiny_model(layers=2, device=DEV, backend="auto")  # + step_kernels=True: tree kernels on CPU too
    calls = []
    real = tree_grow.tree_select
    monkeypatch.setattr(tree_grow, "tree_select", lambda *a: calls.append(1) or real(*a))
    for topk, steps, ntok in ((3, 3, 8), (1, 4, 4), (2, 4, 12)):
        drafter = Eagle3Drafter(tiny_head(model), model, topk=topk, steps=steps, num_draft_tokens=ntok)
        engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=512), drafter=drafter,
                        ks=(ntok,))
        for p in ([3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2], [1, 2, 3]):
            engine.add_request(p, 8)
        engine.step(ntok)  # prefill + a first speculative step: real root state for every row
        st = engine.state
        B, T = 4, drafter.num_nodes(ntok)
        valid = st.row_ids[:B] < st.num_rows
        want = drafter.propose_reference(st, B, T, valid)
        calls.clear()
        got = drafter.propose(st, B, T, valid)
        assert len(calls) == 1  # the kernels built this tree
        rows = valid.nonzero().flatten()
        for name in ("tokens", "parents", "depth", "mask"):
            w, x = getattr(want, name)[rows], getattr(got, name)[rows]
            assert torch.equal(w, x), (topk, steps, name, w.tolist(), x.tolist())


def test_windowed_draft_rounds_equal_recomputing_every_scratch_row(monkeypatch):
    """A draft round runs only its K new frontier rows; earlier rounds' rows are in the draft cache
    and the attention's tree window exposes each node's ancestors among them. That must give the
    frontier outputs of the plain way: re-running ALL scratch rows so far in one forward with their
    ancestor masks over exactly those rows (no window)."""

    from test_engine import tiny_model
    from test_spec import tiny_head
    from specdec.engine.engine import Engine, EngineConfig
    from specdec.spec import Eagle3Drafter

    model = tiny_model(layers=2, device=DEV, backend="torch")
    topk, steps, ntok = 2, 4, 8
    drafter = Eagle3Drafter(tiny_head(model), model, topk=topk, steps=steps, num_draft_tokens=ntok)
    engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=512), drafter=drafter,
                    ks=(ntok,))
    for p in ([3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2]):
        engine.add_request(p, 8)
    engine.step(ntok)
    st = engine.state
    B, T = 2, drafter.num_nodes(ntok)
    valid = st.row_ids[:B] < st.num_rows
    rounds = []  # (token ids, hidden in, positions, meta, outputs) of each windowed round
    real_run = drafter._run

    def run(tok, hid, pos, meta):
        out = real_run(tok, hid, pos, meta)  # (hidden, sums of squares or None)
        rounds.append((tok, hid, pos, meta, out[0]))
        return out

    monkeypatch.setattr(drafter, "_run", run)
    drafter.propose_reference(st, B, T, valid)
    assert len(rounds) == steps - 1 and all(r[3].tree_window == (i + 1) * topk for i, r in enumerate(rounds))
    K, seq = topk, st.seq_lens[:B]
    for r in range(1, steps - 1):  # round 0 has no earlier rows: windowed == plain trivially
        n = (r + 1) * K
        cat = lambda i: torch.cat([rounds[j][i].view(B, K, *rounds[j][i].shape[1:]) for j in range(r + 1)], 1)  # noqa: E731
        tok, hid, pos = cat(0).reshape(-1), cat(1).reshape(B * n, -1), cat(2).reshape(-1)
        mask = torch.cat([rounds[j][3].tree_mask.view(B, K) for j in range(r + 1)], 1).reshape(-1)
        meta, _ = st.block_meta(B, seq, n, valid, mask)  # all n scratch rows, no window
        full = real_run(tok, hid, pos, meta)[0].view(B, n, -1)[:, -K:]
        torch.testing.assert_close(full, rounds[r][4].view(B, K, -1), atol=1e-5, rtol=1e-5)
