"""n-gram drafting on the device (``draft.lookup=device``, kernels_triton/ngram.py).

- The lookup kernel and the recording kernel equal their torch references on random paged histories
  (random page tables, valid masks, n ranges, chain lengths), and the chains are the host drafter's
  ``lookup`` of the same history.
- Under the engine, with random on/off schedules, rows joining and leaving, preemptions while a row's
  tokens are behind and a catch-up chunked over several forwards: every drafting step drafts the
  chains the host drafter drafts at that step (same trees), the token cache over every row's committed
  slots holds its committed tokens after each drafting step, and greedy output is plain greedy's; with
  the step kernels (forced on the CPU under the interpreter) and with their references.
- A drafting step of the device drafter does no host work before it (no prepare_, no host context), so
  overlapped decoding keeps its speculative steps in flight; its k = 0 steps run plain decoding's body.
- Configuration: ``draft.lookup`` host / device, anything else a ConfigError naming it.
"""

import os
import random

import pytest
import torch
from omegaconf import OmegaConf
from test_engine import rand_prompts, reference, tiny_model
from test_spec import repetitive_prompts

from kernels_triton import ngram as kn
from specdec.engine.engine import Engine, EngineConfig
from specdec.errors import ConfigError
from specdec.spec import DeviceNgramDrafter, NgramDrafter, build_drafter

needs_kernels = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                   reason="needs a GPU or TRITON_INTERPRET=1")


def paged_rows(seed, B, T, PS, MP, vocab):
    """B rows of random histories (committed tokens; the last is pending) in a token cache under a
    random page table, with a random valid mask."""
    g, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    P = B * MP + 3
    table = torch.randperm(P, generator=g)[: B * MP].view(B, MP).to(torch.int32)
    seq = torch.tensor([rnd.randrange(0, MP * PS - T) for _ in range(B)], dtype=torch.int32)
    hist = [[rnd.randrange(vocab) for _ in range(int(s) + 1)] for s in seq]
    tok = torch.full((P * PS + 1,), -1, dtype=torch.int32)
    for b, h in enumerate(hist):
        for p, t in enumerate(h[:-1]):
            tok[int(table[b, p // PS]) * PS + p % PS] = t
    pend = torch.tensor([h[-1] for h in hist])
    valid = torch.tensor([rnd.random() < 0.8 for _ in range(B)])
    return tok, table, seq, pend, valid, hist


@needs_kernels
@pytest.mark.parametrize("seed,B,T,PS,MP,vocab,min_n,max_n", [
    (0, 5, 9, 4, 40, 6, 1, 3), (1, 4, 5, 4, 40, 3, 1, 3), (2, 3, 3, 4, 30, 3, 2, 4), (3, 2, 17, 16, 40, 50, 1, 3),
    (4, 6, 2, 8, 70, 4, 3, 3),
])
def test_ngram_kernels_equal_references_and_the_host_lookup(seed, B, T, PS, MP, vocab, min_n, max_n):
    tok, table, seq, pend, valid, hist = paged_rows(seed, B, T, PS, MP, vocab)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok, table, seq, pend, valid = (x.to(dev) for x in (tok, table, seq, pend, valid))
    res = []
    for fn in (kn.ngram_propose_ref_, kn.ngram_propose_):
        t, out = tok.clone(), torch.full((B, T), 7, dtype=torch.int64, device=dev)
        fn(t, table, seq, pend, valid, out, PS, min_n, max_n)
        res.append((t, out))
    (t_ref, o_ref), (t_ker, o_ker) = res
    assert torch.equal(t_ref, t_ker) and torch.equal(o_ref, o_ker)
    host = NgramDrafter(max_n, min_n)
    found = 0
    for b in range(B):
        assert o_ker[b, 0] == 7  # the root column is left alone
        if not valid[b]:
            assert (o_ker[b, 1:] == -1).all()
            continue
        chain = host.lookup(hist[b], T - 1)
        found += bool(chain)
        assert o_ker[b, 1:].tolist() == chain + [-1] * (T - 1 - len(chain))
        L = int(seq[b])  # the pending token went to its slot
        assert t_ker[int(table[b, L // PS]) * PS + L % PS] == hist[b][-1]
    assert found  # some rows matched
    A = torch.tensor([random.Random(seed).randrange(0, T) for _ in range(B)], dtype=torch.int32)
    A = A.to(dev)
    out_tokens = torch.randint(0, 100, (B, T), generator=torch.Generator().manual_seed(seed)).to(dev)
    rec = []
    for fn in (kn.ngram_record_ref_, kn.ngram_record_):
        t = tok.clone()
        fn(t, table, seq, out_tokens, A, valid, PS)
        rec.append(t)
    assert torch.equal(rec[0], rec[1])
    for b in range(B):
        for i in range(int(A[b]) if valid[b] else 0):
            p = int(seq[b]) + 1 + i
            assert rec[1][int(table[b, p // PS]) * PS + p % PS] == out_tokens[b, i]
    assert int((rec[1] != tok).sum()) <= int(A[valid].sum())  # nothing else written


def committed_tokens_in_cache(engine) -> None:
    ps, tok = engine.kv.page_size, engine.drafter.tok
    for req in engine.scheduler.rows:
        pages = engine.kv.pages(req)
        got = [int(tok[pages[j // ps] * ps + j % ps]) for j in range(req.seq_len)]
        assert got == req.tokens[: req.seq_len]


def record_trees(drafter) -> list:
    trees, real = [], drafter.propose

    def propose(*a, **kw):
        tree = real(*a, **kw)
        trees.append(tree.tokens.clone())
        return tree

    drafter.propose = propose
    return trees


def run_schedule(model, drafter, prompts, max_new, seed, *, overlap, check=None):
    rng = random.Random(seed)
    engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=112, prefill_chunk=8,
                                        pad_eager=True, graph_buckets=(1, 2, 4), prefill_buckets=(8,),
                                        overlap=overlap),
                    drafter=drafter, ks=(0, 2, 5))
    reqs, arrive = [None] * len(prompts), {i: rng.randint(0, 12) for i in range(len(prompts))}
    step, forced = 0, 0
    while step < 500 and (engine.has_work() or any(r is None for r in reqs)):
        for i, at in arrive.items():
            if at == step:
                reqs[i] = engine.add_request(prompts[i], max_new[i])
        k = rng.choice([2, 5]) if rng.random() < 0.4 else 0
        engine.step(k)
        engine.check()
        behind = [r for i, r in enumerate(engine.scheduler.rows)
                  if engine.state.draft_lens_host[i] < engine.state.seq_lens_host[i]]
        if not k and behind and (not forced or rng.random() < 0.15):  # preempt a row whose tokens are behind
            engine.scheduler._preempt_(behind[-1])
            engine.check()
            forced += 1
        if k and engine.state.num_rows and check is not None:
            while engine._unread:  # overlapped: commit the step in flight (as a drain does)
                engine._commit_oldest_()
            check(engine)
        step += 1
    return [r.output_ids for r in reqs], engine


@pytest.mark.parametrize("seed,overlap,kernels", [(0, False, False), (1, True, False), (2, False, True), (3, True, True)])
def test_device_ngram_drafts_the_host_chains_under_random_schedules(kernel_options, seed, overlap, kernels):
    if kernels and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    kernel_options.set_(step_kernels=kernels)
    model = tiny_model(layers=2, backend="auto")
    rng = random.Random(seed)
    prompts = repetitive_prompts(4, seed=seed) + rand_prompts([rng.randint(3, 14) for _ in range(2)], seed=seed + 10)
    max_new = [rng.randint(10, 24) for _ in prompts]
    want = [reference(model, p, m) for p, m in zip(prompts, max_new)]
    host, device = NgramDrafter(chains=[2, 5]), DeviceNgramDrafter(chains=[2, 5])
    host_trees, device_trees = record_trees(host), record_trees(device)
    got_host, _ = run_schedule(model, host, prompts, max_new, seed, overlap=overlap)
    got, engine = run_schedule(model, device, prompts, max_new, seed, overlap=overlap, check=committed_tokens_in_cache)
    assert got == want and got_host == want
    assert engine.num_catch_ups > 2 and engine.scheduler.num_preemptions > 0
    if not overlap:  # the same iterations: the same trees (overlapped, the host drafter's speculative
        # steps commit the step in flight first and the device drafter's do not, so batches differ)
        assert len(device_trees) == len(host_trees) > 5
        for h, d in zip(host_trees, device_trees):
            assert torch.equal(h, d)
    assert sum(int((t[:, 1:] >= 0).sum()) for t in device_trees) > 10  # chains were drafted


def test_device_ngram_steps_stay_overlapped_and_k0_is_plain():
    """A drafting step asks nothing of the host (no prepare_, no context), so overlapped decoding keeps
    one step in flight through speculative steps too; a k = 0 step, and a prefill while off, do not see
    the drafter."""
    model = tiny_model(layers=2)
    prompts = repetitive_prompts(3, seed=4)
    want = [reference(model, p, 16) for p in prompts]
    drafter = DeviceNgramDrafter(chains=[4])
    calls = []
    for name in ("propose", "extend_", "prefill_"):
        real = getattr(drafter, name)
        setattr(drafter, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=512, overlap=True),
                    drafter=drafter, ks=(0, 4))
    in_flight = []  # (k, steps launched and not read back) at each launch
    launch = engine.stepper.launch_
    engine.stepper.launch_ = lambda k=0, *a, **kw: in_flight.append((k, len(engine._unread))) or launch(k, *a, **kw)
    reqs = [engine.add_request(p, 16) for p in prompts]
    schedule = [4] * 6 + [0] * 4 + [4] * 40
    for k in schedule:
        if not engine.has_work():
            break
        engine.step(k)
    while engine.has_work():
        engine.step(4)
    assert [r.output_ids for r in reqs] == want
    # steady speculative steps launch behind the step in flight (the host drafter reads it back first: 0)
    assert in_flight[1:6] == [(4, 1)] * 5 and in_flight[11:14] == [(4, 1)] * 3
    n_drafted = calls.count("propose")
    calls.clear()
    engine.add_request(prompts[0], 4)
    engine.step(4)  # prefill drafted + a drafting step
    calls.clear()
    engine.step(0)
    assert calls == []  # a k = 0 step: plain decoding's body, no drafter call
    engine.add_request(prompts[1], 4)
    engine.step(0)  # a prompt prefilled while off: the target's prefill alone (its tokens wait for the catch-up)
    assert calls == [] and engine.undrafted_prefill_tokens > 0
    assert n_drafted > 5


def test_lookup_config():
    target = tiny_model(layers=1)
    cfg = OmegaConf.create({"name": "ngram", "chains": [2, 4], "lookup": "device"})
    d = build_drafter(cfg, target, device="cpu")
    assert isinstance(d, DeviceNgramDrafter) and d.sizes == (2, 4) and d.host_ms_per_row == 0.0
    assert type(build_drafter(OmegaConf.create({"name": "ngram"}), target, device="cpu")) is DeviceNgramDrafter
    assert type(build_drafter(OmegaConf.create({"name": "ngram", "lookup": "host"}), target, device="cpu")) is NgramDrafter
    with pytest.raises(ConfigError, match="draft.lookup='gpu'"):
        build_drafter(OmegaConf.create({"name": "ngram", "lookup": "gpu"}), target, device="cpu")


@pytest.mark.parametrize("lookup", ["host", "device"])
def test_a_request_ending_at_the_last_position_speculates_to_its_end(lookup):
    """A request whose prompt + max_new_tokens fill the model's positions drafts chain-8 trees whose
    nodes pass the last position near its end (their RoPE rows are out of the table: zeros, never
    kept; overlapped, the step launched behind its last one runs past it too): the step runs, the other
    request in the batch is not affected, greedy output is plain greedy's."""
    model = tiny_model(layers=1)
    P = model.config.max_position_embeddings
    prompts = repetitive_prompts(2, seed=7)
    news = [P - len(prompts[0]), 20]
    want = [reference(model, p, m) for p, m in zip(prompts, news)]
    drafter = (DeviceNgramDrafter if lookup == "device" else NgramDrafter)(chains=[8])
    engine = Engine(model, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=4 * P, overlap=True), drafter=drafter,
                    ks=(8,))
    reqs = [engine.add_request(p, m, ignore_eos=True) for p, m in zip(prompts, news)]
    while engine.has_work():
        engine.step(8)
    assert [r.finish_reason for r in reqs] == ["length", "length"]
    assert [r.output_ids for r in reqs] == [w[:m] for w, m in zip(want, news)]
