"""Counterfactual acceptance (kernels_triton/counterfactual.py): what each smaller tree would have
committed, read off the verified path of a larger one.

- Same growth (topk, steps), N' < N: the counterfactual commits equal what drafting and verifying
  the N'-tree from the same draft / target logits commits, greedy and at temperature > 0 (the small
  tree's coins taken from the same nodes of the large tree), several seeds.
- A chain under a wider tree: never more than the chain commits, equal whenever the chain's nodes
  lie in the wider tree; other growths: equal whenever the small growth's candidates all lie in the
  large tree.
- The kernel (and tree_select's candidate ids) equal their torch references.
- goodput fed counterfactual samples skips the smaller k's first tries and picks by the table.
- The engine (EAGLE-3 random head, goodput, counterfactual on / off): greedy output is plain
  greedy's, the policy gets samples of every smaller k only when on.
"""

import os
import zlib

import pytest
import torch
from test_engine import reference, tiny_model
from test_spec import repetitive_prompts, run_engine, tiny_head

from kernels_triton import counterfactual as cfk
from kernels_triton import tree_grow
from kernels_triton.verify_accept import verify_accept_ref
from specdec.policy import BatchView, Goodput, Policy, StepStats, build_policy
from specdec.spec import Eagle3Drafter
from specdec.spec.tree import grow_tree, topk_of

V = 12  # vocabulary of the synthetic draft / target
CHAIN3, TREE8, TREE16, TREE32 = (1, 3, 3), (2, 4, 8), (4, 5, 16), (8, 6, 32)  # draft=eagle3_smollm2_trees


def _logits(path, salt, scale):
    g = torch.Generator().manual_seed(zlib.crc32(repr((salt, path)).encode()))
    return torch.randn(V, generator=g) * scale


def draft_logp(path):
    """Draft log-probs after a token path (a deterministic function of the path, as a draft whose
    hidden state attends to a node's ancestors only)."""
    return torch.log_softmax(_logits(path, "draft", 3.0), -1)


def target_logits(path):
    """Target logits after a path: the draft's plus noise, so the target often agrees with the draft."""
    return draft_logp(path) * 2.0 + _logits(path, "target", 1.0)


def grow(roots, shape, cand_ids=False, expanded=None):
    """The EAGLE-2 tree of ``shape`` = (topk, steps, N) over rows with root tokens ``roots``;
    ``expanded`` (a list of per-row sets), filled with the paths of the frontier nodes expanded."""
    K, S, N = shape
    B = len(roots)
    first = topk_of(torch.stack([draft_logp((r,)) for r in roots]), K)
    front = {}

    def expand(r, tokens, parent_slot):
        paths = [[((roots[b],) if r == 0 else front[b][int(parent_slot[b, i])]) + (int(tokens[b, i]),)
                  for i in range(K)] for b in range(B)]
        front.update(enumerate(paths))
        if expanded is not None:
            for b, row in enumerate(paths):
                expanded[b].update(row)
        lp = torch.stack([torch.stack([draft_logp(p) for p in row]) for row in paths])  # [B, K, V]
        return topk_of(lp, K)

    return grow_tree(torch.tensor(roots), first, expand, topk=K, steps=S, num_draft_tokens=N, cand_ids=cand_ids)


def node_paths(tree):
    """Per row, each node's token path from the root."""
    out = []
    for tok, par in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths = []
        for i, p in enumerate(par):
            paths.append((tok[0],) if p < 0 else paths[p] + (tok[i],))
        out.append(paths)
    return out


def verify(tree, temperature=0.0, uniforms=None):
    paths = node_paths(tree)
    logits = torch.stack([torch.stack([target_logits(p) for p in row]) for row in paths])  # [B, T, V]
    return verify_accept_ref(logits, tree.tokens, tree.parents, temperature, uniforms)


def counterfactual(big, nodes, acc, shapes, kernel=False):
    fn = cfk.counterfactual_commits if kernel else cfk.counterfactual_commits_ref
    return fn(big.cand, big.cand_ids, big.parents, nodes, acc, torch.tensor(shapes, dtype=torch.int32), big.topk)


def roots_for(seed, B=8):
    return torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("big,small", [((4, 5, 24), [(4, 5, 4), (4, 5, 9), (4, 5, 16)]),
                                       (TREE32, [(8, 6, 12), (8, 6, 20)]), (TREE8, [(2, 4, 3), (2, 4, 5)]),
                                       ((1, 5, 5), [(1, 5, 2), (1, 5, 4)])])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_same_growth_counterfactual_is_what_the_smaller_tree_commits(big, small, temperature):
    """For each seed: grow the N-tree and the N'-trees from the same draft, verify each against the
    same target; the counterfactual commits off the N-tree's path equal the N'-trees' commits. At
    temperature > 0 a small tree node takes the coins of the same node of the large tree."""
    seen = 0
    for seed in range(6):
        roots = roots_for(seed)
        tree = grow(roots, big, cand_ids=True)
        g = torch.Generator().manual_seed(seed)
        uni = torch.rand(len(roots), tree.num_nodes, 2, generator=g)
        acc, nodes, _ = verify(tree, temperature, uni)
        got = counterfactual(tree, nodes, acc, small)
        big_paths = node_paths(tree)
        for m, shape in enumerate(small):
            st = grow(roots, shape)
            idx = [[row.index(p) for p in sp] for row, sp in zip(big_paths, node_paths(st))]  # small node -> big
            su = torch.stack([uni[b, ix] for b, ix in enumerate(idx)])
            s_acc, _, _ = verify(st, temperature, su)
            assert got[:, m].tolist() == (s_acc + 1).tolist(), (seed, shape)
            seen += int((s_acc > 0).sum())
        assert (got <= (acc + 1)[:, None]).all()
    assert seen > 10  # the trees accept something: the test compares real paths


@pytest.mark.parametrize("big", [TREE8, TREE16, TREE32])
def test_chain_counterfactual_is_a_lower_bound_exact_inside_the_tree(big):
    """chain3 under a wider tree: never more than drafting and verifying the chain commits, and the
    same whenever the chain's nodes are nodes of the wider tree (its membership rule is exact)."""
    inside = 0
    for seed in range(6):
        roots = roots_for(seed)
        tree = grow(roots, big, cand_ids=True)
        acc, nodes, _ = verify(tree)
        got = counterfactual(tree, nodes, acc, [CHAIN3])[:, 0]
        chain = grow(roots, CHAIN3)
        c_acc, _, _ = verify(chain)
        for b, (row, cp) in enumerate(zip(node_paths(tree), node_paths(chain))):
            assert got[b] <= c_acc[b] + 1
            if set(cp) <= set(row):
                inside += 1
                assert got[b] == c_acc[b] + 1, (seed, b)
    assert inside >= 30


@pytest.mark.parametrize("big,small", [(TREE16, TREE8), (TREE32, TREE8), (TREE32, TREE16), (TREE16, (2, 4, 6))])
def test_other_growth_counterfactual_exact_when_the_small_candidates_are_inside(big, small):
    """A smaller tree of another growth: the counterfactual equals what it commits whenever the small
    tree and every frontier node its growth expanded are nodes of the large tree."""
    inside = 0
    for seed in range(8):
        roots = roots_for(seed)
        tree = grow(roots, big, cand_ids=True)
        acc, nodes, _ = verify(tree)
        got = counterfactual(tree, nodes, acc, [small])[:, 0]
        expanded = [set() for _ in roots]
        st = grow(roots, small, expanded=expanded)
        s_acc, _, _ = verify(st)
        for b, (row, sp) in enumerate(zip(node_paths(tree), node_paths(st))):
            if set(sp) | expanded[b] <= set(row):
                inside += 1
                assert got[b] == s_acc[b] + 1, (seed, b)
    assert inside >= 4


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_kernels_match_references():
    """tree_select's candidate ids and the counterfactual kernel equal their torch references, on
    grown trees with real verified paths and on random paths (accept lengths anywhere)."""
    for seed, big, small in ((0, TREE32, [CHAIN3, TREE8, TREE16]), (1, TREE16, [CHAIN3, TREE8]),
                             (2, (4, 5, 24), [(4, 5, 9), (2, 3, 5)])):
        roots = roots_for(seed, B=5)
        tree = grow(roots, big, cand_ids=True)
        K, S, N = big
        root = torch.tensor(roots)
        ref = tree_grow.tree_select_ref(root, tree.cand, N, S, cand_ids=True)
        got = tree_grow.tree_select(root, tree.cand, N, S, cand_ids=True)
        for w, x in zip(ref, got):
            assert torch.equal(w, x)
        acc, nodes, _ = verify(tree)
        for a, n in ((acc, nodes), *random_paths(tree, seed)):
            want = counterfactual(tree, n, a, small)
            out = torch.full((len(roots), len(small) + 3), -5, dtype=torch.int64)
            cfk.counterfactual_commits(tree.cand, tree.cand_ids, tree.parents, n, a,
                                       torch.tensor(small, dtype=torch.int32), K, out[:, 1:len(small) + 1])
            assert torch.equal(out[:, 1:len(small) + 1], want.long())
            assert (out[:, 0] == -5).all() and (out[:, len(small) + 1:] == -5).all()  # only its columns


def random_paths(tree, seed):
    """(accept_len, nodes) of random root-to-node paths of the tree (any node, any depth)."""
    g = torch.Generator().manual_seed(100 + seed)
    B, T = tree.tokens.shape
    par = tree.parents.tolist()
    out = []
    for _ in range(3):
        acc, nodes = [], []
        for b in range(B):
            x = int(torch.randint(0, T, (1,), generator=g))
            path = [x]
            while par[b][path[-1]] >= 0:
                path.append(par[b][path[-1]])
            path = path[::-1]
            acc.append(len(path) - 1)
            nodes.append(path + [-1] * (T - len(path)))
        out.append((torch.tensor(acc, dtype=torch.int32), torch.tensor(nodes, dtype=torch.int32)))
    return out


def test_labels():
    head_free = Eagle3Drafter.__new__(Eagle3Drafter)  # labels depend on the shapes alone
    head_free.trees = {3: CHAIN3, 5: (1, 5, 5), 8: TREE8, 12: (2, 4, 12), 16: TREE16, 32: TREE32}
    lab = head_free.counterfactual_label
    assert lab(8, 12) == "exact" and lab(3, 5) == "exact"
    assert lab(3, 32) == "lower_bound" and lab(5, 8) == "lower_bound"
    assert lab(8, 32) == "approximate" and lab(16, 32) == "approximate"


# -- goodput ------------------------------------------------------------------------------------
# ms per step at batch 1 / 8: tree16 is the best at batch 1 when its acceptance is high.
CF_TABLE = {0: {1: 1.0, 8: 1.2}, 3: {1: 1.2, 8: 1.5}, 8: {1: 1.3, 8: 2.0}, 16: {1: 1.4, 8: 3.0}, 32: {1: 2.6, 8: 6.0}}


def test_goodput_counterfactual_samples_replace_first_tries():
    """With counterfactual samples the first try is the largest k; its steps bring samples of the
    smaller ks covering probe_rows rows, so none of them is tried first, and the choice follows the
    table: tree16 at a(16) = 4 (4 / 1.4 per ms) beats tree32 at a(32) = 4.2 (4.2 / 2.6)."""
    pol = Goodput([3, 8, 16, 32], margin=0.0, explore_every=0, probe_rows=4, counterfactual=True,
                  probe_cost=float("inf"), probe_requests=0)
    assert pol.wants_counterfactual
    pol.set_table(CF_TABLE)
    pol.counterfactual_({(3, 32): "lower_bound", (8, 32): "approximate", (16, 32): "approximate",
                         (3, 16): "lower_bound", (8, 16): "approximate", (3, 8): "lower_bound"})
    rows = ("a", "b")
    chosen = []
    for _ in range(2):  # two steps of 2 rows: probe_rows covered
        k = pol.choose(BatchView(num_decode=2, num_waiting=0, rows=rows))
        chosen.append(k)
        pol.update(StepStats(k=k, num_decode=2, committed=[5, 4], rows=list(rows),
                             counterfactual={3: [3, 3], 8: [3, 4], 16: [4, 4]}))
    assert chosen == [32, 32]
    assert pol.rows_seen == {3: 4, 8: 4, 16: 4, 32: 4} and pol.counterfactual_rows == {3: 4, 8: 4, 16: 4, 32: 0}
    assert pol.accept[16] == 4.0 and pol.accept[3] == 3.0
    k = pol.choose(BatchView(num_decode=1, num_waiting=0, rows=("a",)))
    assert k == 16  # no first try of 3 / 8: the rates decide (a rows' own a(32) = 4.1 / 2.6 < 4 / 1.4)
    d = pol.describe()
    assert d["counterfactual"] and d["counterfactual_rows"]["k=16"] == 4
    assert d["counterfactual_pairs"]["k=3<k=32"] == "lower_bound"
    # Without them: the first tries go smallest first.
    off = Goodput([3, 8, 16, 32], margin=0.0, explore_every=0, probe_rows=4, counterfactual=False)
    off.set_table(CF_TABLE)
    assert not off.wants_counterfactual and off.choose(BatchView(num_decode=2, num_waiting=0)) == 3


def test_goodput_counterfactual_config():
    from omegaconf import OmegaConf

    cfg = OmegaConf.load("conf/policy/goodput.yaml")
    cfg.profile_context = 512  # auto is resolved by specdec.run from the workload
    assert cfg.counterfactual is None and build_policy(cfg, sizes=(3, 8)).wants_counterfactual  # the default: on
    cfg.counterfactual = "false"
    assert not build_policy(cfg, sizes=(3, 8)).wants_counterfactual
    cfg.counterfactual = "true"
    assert build_policy(cfg, sizes=(3, 8)).wants_counterfactual
    cfg.counterfactual = "maybe"
    with pytest.raises(Exception, match="counterfactual"):
        build_policy(cfg, sizes=(3, 8))


# -- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return tiny_model(layers=2)


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_counterfactual_greedy_identical(tiny, overlap):
    """EAGLE-3 (random head, chain3 / tree6 / tree12), goodput with counterfactual on and off: greedy
    output equals plain greedy either way; on, every speculative step at a larger k brings samples of
    each smaller k (and those reach the policy's describe()), off none; the k = 0 output buffer keeps
    its layout (no counterfactual columns)."""
    prompts = repetitive_prompts(4, seed=3)
    want = [reference(tiny, p, 14) for p in prompts]
    trees = [(1, 3, 3), (2, 3, 6), (4, 3, 12)]
    for on in (False, True):
        drafter = Eagle3Drafter(tiny_head(tiny), tiny, trees=trees)
        pol = Goodput([3, 6, 12], margin=0.0, explore_every=0, probe_rows=2, counterfactual=on, probe_cost=float("inf"))
        seen = []
        real_update = pol.update
        pol.update = lambda s, _u=real_update: seen.append(s) or _u(s)
        got, engine = run_engine(tiny, prompts, 14, drafter=drafter, policy=pol, overlap=overlap)
        assert got == want
        spec = [s for s in seen if s.k > 0]
        assert spec
        if not on:
            assert all(s.counterfactual is None for s in seen) and engine.state.cf_widths == {}
            assert sum(pol.counterfactual_rows.values()) == 0 and drafter.counterfactual_sizes == set()
            continue
        assert engine.state.cf_widths == {7: 1, 13: 2} and drafter.counterfactual_sizes == {6, 12}
        for s in spec:
            smaller = [j for j in (3, 6, 12) if j < s.k]
            assert (s.counterfactual is None) == (not smaller)
            if smaller:
                assert sorted(s.counterfactual) == smaller
                for counts in s.counterfactual.values():  # every tree has 3 steps: 1 .. 4 tokens
                    assert len(counts) == s.num_decode and all(1 <= c <= 4 for c in counts)
        d = pol.describe()
        assert d["counterfactual"] and d["counterfactual_rows"]["k=3"] > 0
        assert d["counterfactual_pairs"] == {"k=3<k=12": "lower_bound", "k=3<k=6": "lower_bound",
                                             "k=6<k=12": "approximate"}
        # the first tries went to the largest tree; the smaller ones were sampled counterfactually
        assert spec[0].k == 12


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_engine_counterfactual_kernels_equal_references(kernel_options):
    """The same engine run with the step kernels (tree_select's candidate ids and the counterfactual
    kernel, forced on the CPU under the interpreter) and with their torch versions: the drafter's
    trees carry the same candidate ids, the policy gets the same counterfactual samples step for
    step, greedy output is plain greedy's."""
    model = tiny_model(layers=2, backend="auto")
    prompts = repetitive_prompts(3, seed=5)
    want = [reference(model, p, 10) for p in prompts]
    samples = {}
    for kernels in (False, True):
        kernel_options.set_(step_kernels=kernels)
        drafter = Eagle3Drafter(tiny_head(model), model, trees=[(1, 3, 3), (2, 3, 6), (4, 3, 12)])
        pol = ScheduledPolicy([12, 6, 12, 0, 3, 12])
        got, engine = run_engine(model, prompts, 10, drafter=drafter, policy=pol)
        assert got == want and pol.pairs == {(3, 6): "lower_bound", (3, 12): "lower_bound", (6, 12): "approximate"}
        samples[kernels] = list(pol.seen)
        if kernels:  # the kernel-built tree's candidate ids are the reference's
            st = engine.state
            for p in ([3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2]):
                engine.add_request(p, 4)
            engine.step(12)
            B, T = 2, 13
            valid = st.row_ids[:B] < st.num_rows
            ref, ker = drafter.propose_reference(st, B, T, valid), drafter.propose(st, B, T, valid)
            assert torch.equal(ref.cand_ids, ker.cand_ids) and torch.equal(ref.tokens, ker.tokens)
    assert samples[True] == samples[False] and sum(bool(cf) for _, cf in samples[True]) >= 4


class ScheduledPolicy(Policy):
    """Cycles through a k schedule, asks for counterfactual samples and records (k, samples)."""

    name = "scheduled"
    wants_counterfactual = True

    def __init__(self, schedule):
        self.schedule, self.i, self.seen, self.pairs = schedule, 0, [], None
        self.ks = tuple(sorted({0, *schedule}))

    def counterfactual_(self, pairs):
        self.pairs = pairs

    def choose(self, view):
        k = self.schedule[self.i % len(self.schedule)]
        self.i += 1
        return k

    def update(self, stats):
        self.seen.append((stats.k, stats.counterfactual))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_counterfactual_samples_equal_eager():
    """On the GPU, fp32: the counterfactual columns ride the graphed steps (per bucket and tree size):
    the same k schedule run graphed and eagerly at the same padded shapes gives the same samples step
    for step, and greedy output equal to the torch-reference plain loop. Both engines run without
    overlapped decoding (its default, on with graphs only, launches a step more for rows that finished
    in the step in flight: another step sequence), and the eager one pads to the graph buckets (exact
    shapes pick other GEMM tilings, whose rounding can reorder near-tied draft scores)."""
    from specdec.engine.engine import Engine, EngineConfig

    model = tiny_model(layers=2, device="cuda", backend="auto")
    ref_model = tiny_model(layers=2, device="cuda", backend="torch")
    prompts = repetitive_prompts(5, seed=7)
    want = [reference(ref_model, p, 16) for p in prompts]
    seen = {}
    for graphed in (True, False):
        head = tiny_head(ref_model)
        head.backend = "auto"
        drafter = Eagle3Drafter(head, model, trees=[(1, 3, 3), (2, 3, 6), (4, 3, 12)])
        pol = ScheduledPolicy([12, 6, 0, 12, 3])
        engine = Engine(model, EngineConfig(max_batch_size=8, page_size=16, kv_cache_tokens=4096,
                                            graph_buckets=(1, 2, 4, 8), cuda_graphs=graphed,
                                            pad_eager=not graphed, overlap=False),
                        drafter=drafter, ks=pol.ks[1:], policy=pol)
        assert engine.graphed == graphed and not engine.overlap
        reqs = [engine.add_request(p, 16) for p in prompts]
        engine.run_until_done()
        assert [r.output_ids for r in reqs] == want
        seen[graphed] = pol.seen
    assert seen[True] == seen[False] and sum(bool(cf) for _, cf in seen[True]) >= 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_engine_gives_goodput_its_catch_up_forward_times():
    """On the GPU, graphed: goodput's switch back on is priced by the catch-up forwards timed at
    start-up (one entry per prefill token bucket, positive), not by the decode table's ms per row."""
    from specdec.engine.engine import Engine, EngineConfig
    from specdec.policy.goodput import Goodput

    model = tiny_model(layers=2, device="cuda", backend="auto")
    head = tiny_head(model)
    head.backend = "auto"
    drafter = Eagle3Drafter(head, model, trees=[(1, 3, 3), (2, 3, 6)])
    pol = Goodput([3, 6], profile_context=32, profile_iters=1)
    engine = Engine(model, EngineConfig(max_batch_size=4, page_size=16, kv_cache_tokens=4096, graph_buckets=(1, 2, 4),
                                        prefill_buckets=(64, 128), prefill_chunk=256),
                    drafter=drafter, ks=[3, 6], policy=pol)
    runner = engine.stepper.catch_up_runner
    assert engine.graphed and runner is not None and set(runner.forward_ms) == {64, 128, 256}
    assert pol.describe()["catch_up_forward_ms"] == runner.forward_ms
    assert all(ms > 0 for ms in runner.forward_ms.values())
