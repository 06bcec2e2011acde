"""Acceptance per draft depth: the device statistics (kernels_triton/accept_stats.py) against their
reference, the host sums (specdec.bench.metrics) on hand-made steps, and an engine run whose
per-request and per-run numbers agree with its step trace."""

import pytest
import torch

from kernels_triton.accept_stats import accept_stats_, accept_stats_ref_
from kernels_triton.verify_accept import verify_accept_ref
from specdec.bench.metrics import acceptance_counts, acceptance_summary, request_record, scalars, summarize_requests

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_trees(B, T, gen):
    """[B, T] parents (random recursive trees, chains, and padded rows whose tail is padding) and depths."""
    par = torch.full((B, T), -1, dtype=torch.int32)
    for b in range(B):
        kind = b % 3
        n = T if kind != 2 else int(torch.randint(1, T + 1, (1,), generator=gen))
        for i in range(1, n):
            par[b, i] = i - 1 if kind == 1 else int(torch.randint(0, i, (1,), generator=gen))
    depth = torch.zeros(B, T, dtype=torch.int32)
    for i in range(1, T):
        depth[:, i] = torch.where(par[:, i] >= 0, depth.gather(1, par[:, i:i + 1].clamp(min=0).long())[:, 0] + 1, 0)
    return par, depth


@pytest.mark.parametrize("B,T", [(1, 2), (9, 7), (5, 33)])
def test_accept_stats_matches_ref(B, T):
    gen = torch.Generator().manual_seed(B * 100 + T)
    par, depth = random_trees(B, T, gen)
    V = 6
    logits = torch.randn(B, T, V, generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    # Half the nodes carry their parent's target token, so greedy paths run deep and through later siblings.
    target = logits.argmax(-1).gather(1, par.clamp(min=0).long())  # [B, T]
    tokens = torch.where(torch.rand(B, T, generator=gen) < 0.5, target, tokens)
    tokens[:, 1] = target[:, 1]  # node 1 (the root's first child, or padding) always
    acc, nodes, _ = verify_accept_ref(logits, tokens, par, 0.0)
    assert acc.max() >= 1
    stride = T + 5  # written into a wider buffer, as the engine's step output
    want = accept_stats_ref_(par, depth, nodes, acc, torch.full((B, stride), 99, dtype=torch.int64)[:, :T + 1])
    buf = torch.full((B, stride), 99, dtype=torch.int64, device=DEVICE)
    accept_stats_(par.to(DEVICE), depth.to(DEVICE), nodes.to(DEVICE), acc.to(DEVICE), buf[:, :T + 1])
    assert torch.equal(buf[:, :T + 1].cpu(), want)
    assert (buf[:, T + 1:] == 99).all()  # nothing written past the row's columns
    # Spot-check the meaning on the reference: drafted depth, draft nodes, ranks along the path.
    for b in range(B):
        real = [i for i in range(1, T) if par[b, i] >= 0]
        assert want[b, 0] == max([int(depth[b, i]) for i in real], default=0) and want[b, 1] == len(real)
        for d in range(1, int(acc[b]) + 1):
            n = int(nodes[b, d])
            assert want[b, 1 + d] == sum(1 for j in real if j < n and par[b, j] == par[b, n])
        assert (want[b, 2 + int(acc[b]):] == -1).all()


def test_accept_stats_bad_inputs():
    par = torch.tensor([[-1, 0, 0]], dtype=torch.int32)
    z = torch.zeros(1, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="out"):
        accept_stats_(par, z, z, torch.zeros(1, dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="depth"):
        accept_stats_(par, z[:, :2], z, torch.zeros(1, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int64))


def test_acceptance_counts_by_hand():
    # Three steps of a tree drafting 3 deep: accepted lengths 2, 0, 3; ranks along the paths.
    rows = [[3, 6, 0, 1, -1], [3, 6, -1, -1, -1], [3, 6, 1, 0, 0], [2, 2, 0, -1]]  # the last: a 2-deep chain
    acc = acceptance_counts(rows)
    assert acc["drafted"] == [4, 4, 3] and acc["accepted"] == [3, 2, 1]
    assert acc["histogram"] == {2: 1, 0: 1, 3: 1, 1: 1}
    assert acc["ranks"] == [[2, 1], [1, 1], [1]] and acc["branched"]
    assert acceptance_counts([]) is None
    assert not acceptance_counts([[2, 2, 0, 0]])["branched"]  # chains only: no rank histogram


class FakeRequest:
    def __init__(self, rid, stats, error=None):
        self.id, self.prompt_ids, self.error = rid, [1, 2], error
        self.output_ids, self.token_times = [5, 6, 7], [1.0, 1.1, 1.2]
        self.finish_reason, self.first_token_s, self.arrival_s, self.finish_s = "length", 1.0, 0.5, 1.2
        self.admitted_s, self.num_preemptions, self.accept_stats, self.sampling = 0.6, 0, stats, None


def test_records_and_run_summary_keys():
    tree = request_record(FakeRequest("a", [[2, 4, 0, 1], [2, 4, -1, -1]]))
    assert tree["acceptance_by_depth"] == [0.5, 0.5] and tree["drafted_by_depth"] == [2, 2]
    assert tree["accepted_by_depth"] == [1, 1] and tree["accepted_histogram"] == {"0": 1, "2": 1}
    assert tree["accepted_rank_by_depth"] == [[1], [0, 1]]
    chain = request_record(FakeRequest("b", [[3, 3, 0, 0, -1]]))
    assert "accepted_rank_by_depth" not in chain and chain["acceptance_by_depth"] == [1.0, 1.0, 0.0]
    plain = request_record(FakeRequest("c", []))
    assert "acceptance_by_depth" not in plain
    failed = request_record(FakeRequest("d", [[3, 3, 0, 0, 0]], error="bad"))
    m = summarize_requests([tree, chain, plain, failed], wall_s=1.0)
    assert m["acceptance_by_depth"] == {"rate": [0.666667, 0.666667, 0.0], "drafted": [3, 3, 1], "accepted": [2, 2, 0]}
    assert m["accepted_rank_by_depth"] == [[1], [0, 1]]
    assert acceptance_summary([plain]) == {}
    flat = scalars({**m, "accepted_histogram": {"0": 1, "2": 1}, "name": "x"})
    assert flat["acceptance_by_depth/rate_d1"] == pytest.approx(2 / 3) and flat["acceptance_by_depth/drafted_d3"] == 1
    assert flat["accepted_rank_by_depth/d2_r1"] == 1 and flat["accepted_histogram/2"] == 1 and "name" not in flat
    assert all(isinstance(v, (int, float)) for v in flat.values())


@pytest.fixture(scope="module")
def tiny():
    from test_engine import tiny_model

    return tiny_model(layers=2)


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_acceptance_per_depth_agrees_with_the_trace(tiny, overlap):
    # Oracle trees (test_spec: a true path at random node indices among wrong siblings) over a few
    # requests: each request's accepted-length histogram is exactly its speculative steps' accepted
    # counts in the step trace, and its per-depth counts follow from them.
    from test_engine import rand_prompts, reference
    from test_spec import OracleDrafter

    from specdec.engine.engine import Engine, EngineConfig

    prompts = rand_prompts([5, 17, 9], seed=3)
    oracle = OracleDrafter({tuple(p): reference(tiny, p, 20) for p in prompts})
    trace = []
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024, overlap=overlap),
                    drafter=oracle, ks=(5,), trace=trace.append)
    reqs = [engine.add_request(p, 20) for p in prompts]
    i = 0
    while engine.has_work():
        engine.step(5 if i % 4 != 3 else 0)  # some plain steps in between
        i += 1
    engine.flush_trace()
    records = [request_record(r) for r in reqs]
    for r, rec in zip(reqs, records):
        accepted = [a for s in trace for a, rid in zip(s["accepted"], s["accepted_ids"]) if rid == r.id]
        hist = {}
        for a in accepted:
            hist[str(a)] = hist.get(str(a), 0) + 1
        assert rec["accepted_histogram"] == dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        assert rec["accepted_by_depth"] == [sum(a >= d for a in accepted) for d in range(1, len(rec["drafted_by_depth"]) + 1)]
        assert all(n <= len(accepted) for n in rec["drafted_by_depth"]) and "accepted_rank_by_depth" in rec
    m = summarize_requests(records, wall_s=1.0)
    assert m["acceptance_by_depth"]["accepted"][0] == sum(1 for s in trace for a in s["accepted"] if a >= 1)
    assert max(m["acceptance_by_depth"]["accepted"]) > 0 and len(m["acceptance_by_depth"]["rate"]) <= 5
