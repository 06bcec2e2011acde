"""Speculative decoding through the one step: greedy output is token-identical to plain greedy for
every drafter, tree shape, batch size and k schedule, and the draft KV stays in sync at k = 0."""

import os

import pytest
import torch
from test_engine import VOCAB, rand_prompts, reference, tiny_model

from specdec.engine.engine import Engine, EngineConfig
from specdec.models.eagle3 import Eagle3Config, Eagle3Head
from specdec.models.ops import AttentionMeta
from specdec.policy import Always, BatchThreshold, BatchView
from specdec.spec import Eagle3Drafter, NgramDrafter
from specdec.spec.tree import DraftTree, ancestor_masks


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(layers=2)


def repetitive_prompts(n, seed=0):
    """Prompts that repeat a motif, so the n-gram drafter finds continuations the target may take."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        motif = torch.randint(0, VOCAB, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
        out.append((motif * 6)[: 10 + 3 * i])
    return out


def tiny_head(model, draft_vocab=None, seed=0, layers=(0, 1, 1)):
    cfg = Eagle3Config.for_target(model.config, draft_vocab or VOCAB, target_layers=layers)
    head = Eagle3Head(cfg, backend=model.backend).init_weights_(seed)
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[: cfg.draft_vocab_size]
    head.set_vocab_(ids)
    return head.to_device(model.device, torch.float32)


def run_engine(model, prompts, max_new, *, drafter=None, ks=(0,), k_of_step=lambda i: 0, max_batch=8,
               page_size=4, policy=None, overlap=False):
    trace = []
    engine = Engine(model, EngineConfig(max_batch_size=max_batch, page_size=page_size, kv_cache_tokens=2048,
                                        overlap=overlap),
                    drafter=drafter, ks=ks, policy=policy, trace=trace.append)
    engine.accepted = [a for rec in trace for a in rec["accepted"]]  # filled in below
    reqs = [engine.add_request(p, max_new) for p in prompts]
    i = 0
    while engine.has_work():
        engine.step(None if policy is not None else k_of_step(i))
        engine.check()
        i += 1
    engine.flush_trace()
    engine.accepted = [a for rec in trace for a in rec["accepted"]]
    return [r.output_ids for r in reqs], engine


def test_overlapped_speculative_decoding_identical(tiny):
    """engine.overlap with EAGLE-3 trees and k switching every few steps (a step in flight while the
    next k is chosen and the previous step's accepted paths are committed): greedy output equals
    plain greedy (the tiny random head accepts little). The n-gram drafter drafts from host tokens:
    its speculative steps commit the step in flight first, so they see the same context as without
    overlap and accept the same paths, while its k = 0 steps overlap; also with a policy."""
    prompts = repetitive_prompts(5, seed=6)
    want = [reference(tiny, p, 16) for p in prompts]
    drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=3, num_draft_tokens=6)
    got, engine = run_engine(tiny, prompts, 16, drafter=drafter, ks=(6,), k_of_step=lambda i: 6 if i % 3 else 0,
                             overlap=True)
    assert engine.overlap and got == want
    prompts = repetitive_prompts(5)
    want = [reference(tiny, p, 20) for p in prompts]
    for k_of_step in (lambda i: 4, lambda i: 4 if i % 3 else 0):
        accepted = {}
        for overlap in (False, True):
            got, engine = run_engine(tiny, prompts, 20, drafter=NgramDrafter(), ks=(4,), k_of_step=k_of_step,
                                     overlap=overlap)
            assert got == want and engine.overlap == overlap
            accepted[overlap] = engine.accepted
        assert max(accepted[True]) >= 2 and accepted[True] == accepted[False]  # same drafts, same paths
    got, engine = run_engine(tiny, prompts, 20, drafter=NgramDrafter(), overlap=True,
                             policy=BatchThreshold(k=3, off_above=3, on_at_or_below=2))
    assert got == want


def test_ngram_greedy_identical_and_accepts(tiny):
    prompts = repetitive_prompts(5)
    want = [reference(tiny, p, 20) for p in prompts]
    got, engine = run_engine(tiny, prompts, 20, drafter=NgramDrafter(), ks=(4,), k_of_step=lambda i: 4)
    assert got == want
    assert max(engine.accepted) >= 2  # drafts were accepted, so multi-token commits were exercised
    assert engine.drafter.lookup([1, 2, 3, 1, 2], 3) == [3, 1, 2]
    assert engine.drafter._index  # the engine named its rows: drafts came from the per-request index


class OracleTrees:
    """Proposes random trees in which one path follows the target's own greedy continuation (known
    from the reference run) with deliberate corruptions, and the other nodes are wrong siblings:
    exercises every branch of tree verification and commit."""

    needs_context = True
    capturable = False

    def __init__(self, continuations, seed=0, **kw):
        super().__init__(**kw)
        self.cont = continuations  # prompt tuple -> full greedy output
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, state, B, T, valid, context):
        toks = torch.zeros(B, T, dtype=torch.long)
        parents = torch.full((B, T), -1, dtype=torch.int32)
        depth = torch.zeros(B, T, dtype=torch.int32)
        for r, hist in enumerate(context[:B]):
            future = next(c for p, c in self.cont.items() if hist[: len(p)] == list(p))
            done = len(hist) - next(len(p) for p in self.cont if hist[: len(p)] == list(p))
            future = future[done:] + [0] * T
            good = int(torch.randint(0, T, (1,), generator=self.gen))  # length of the true path
            # The true path sits at random increasing node indices (so commit must move its KV);
            # every other node is a wrong sibling hanging anywhere above it.
            path = sorted(torch.randperm(T - 1, generator=self.gen)[:good].add(1).tolist())
            prev = 0
            for i in range(1, T):
                if i in path:
                    parents[r, i] = prev
                    toks[r, i] = future[path.index(i)]
                    if torch.rand(1, generator=self.gen) < 0.15:
                        toks[r, i] = (toks[r, i] + 1) % VOCAB  # a wrong token on the path
                    prev = i
                else:
                    parents[r, i] = int(torch.randint(0, i, (1,), generator=self.gen))
                    toks[r, i] = int(torch.randint(0, VOCAB, (1,), generator=self.gen))
                depth[r, i] = depth[r, parents[r, i]] + 1
        dev = state.pending.device
        toks[:, 0] = state.pending[:B].cpu()
        return DraftTree(toks.to(dev), parents.to(dev), depth.to(dev), ancestor_masks(parents, T).to(dev))


class OracleDrafter(OracleTrees, NgramDrafter):
    pass


class OracleEagle(OracleTrees, Eagle3Drafter):
    """The EAGLE-3 drafter's real prefill / extend (draft KV sync) with oracle trees, so that its
    extend runs over multi-token accepted paths."""

    def num_nodes(self, k):
        return k + 1

    def max_path_nodes(self, T):  # oracle trees are chains: every node can be accepted
        return T


def test_trees_with_true_paths_identical_and_accept_deeply(tiny):
    prompts = rand_prompts([5, 17, 9, 30], seed=3)
    want = [reference(tiny, p, 24) for p in prompts]
    oracle = OracleDrafter({tuple(p): w for p, w in zip(prompts, want)})
    got, engine = run_engine(tiny, prompts, 24, drafter=oracle, ks=(7,), k_of_step=lambda i: 7)
    assert got == want
    assert max(engine.accepted) >= 4 and 0 in engine.accepted  # deep accepts and full rejections


@pytest.mark.parametrize("topk,steps,ntok", [(1, 3, 3), (2, 3, 6), (3, 2, 8)])
def test_eagle3_greedy_identical(tiny, topk, steps, ntok):
    prompts = rand_prompts([6, 13, 21], seed=topk)
    want = [reference(tiny, p, 16) for p in prompts]
    drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=topk, steps=steps, num_draft_tokens=ntok)
    got, _ = run_engine(tiny, prompts, 16, drafter=drafter, ks=(ntok,), k_of_step=lambda i: ntok)
    assert got == want


def draft_prefill_kv(drafter, model, tokens, with_hidden=False):
    """Draft KV [n, HKV, D] of rows 0..n-1 computed from scratch over ``tokens`` (n + 1 tokens)
    (with_hidden: and the draft hidden [H] of row n - 1, what the drafter's root state must be)."""
    n = len(tokens) - 1
    k, v = model.new_kv_cache(1 + n // 4, 4)
    dk, dv = drafter.head.new_kv_cache(1 + n // 4, 4)
    table = torch.arange(1 + n // 4, dtype=torch.int32)[None]
    meta = AttentionMeta(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                         table, torch.arange(n), n)
    out = model(torch.tensor(tokens[:n]), torch.arange(n), meta, k, v, capture_layers=drafter.capture_layers)
    emb = model.embed_tokens(torch.tensor(tokens[1:]))
    h, _ = drafter.head(emb, drafter.head.fuse(out.captured), torch.arange(n), meta, dk, dv)
    kv = dk[0].reshape(-1, *dk.shape[-2:])[:n]
    return (kv, h[n - 1]) if with_hidden else kv


@pytest.mark.parametrize("oracle,pad,sync", [(False, False, True), (True, False, True), (True, True, True),
                                             (False, False, False), (True, True, False)])
def test_alternating_k_keeps_draft_kv_in_sync(tiny, oracle, pad, sync):
    """sync: every k = 0 step extends the draft KV (in sync after every step); else (catch-up, the
    default) k = 0 steps leave a backlog that the next drafting step catches up first (in sync after
    every drafting step)."""
    prompts = rand_prompts([7, 12], seed=11)
    want = [reference(tiny, p, 18) for p in prompts]
    if oracle:  # multi-token accepted paths through the real draft extend
        drafter = OracleEagle({tuple(p): w for p, w in zip(prompts, want)}, head=tiny_head(tiny),
                              target=tiny, topk=2, steps=2, num_draft_tokens=4, sync_while_off=sync)
    else:
        drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4, sync_while_off=sync)
    trace = []
    # pad: prefill one chunk at a time through the padded static-buffer path a CUDA graph replays.
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024, pad_eager=pad,
                                       graph_buckets=(1, 2, 4), prefill_buckets=(8, 16)),
                    drafter=drafter, ks=(4,), trace=trace.append)
    assert (engine.stepper.prefill_runner is not None) == pad
    reqs = [engine.add_request(prompts[0], 18)]
    engine.step(0)
    reqs.append(engine.add_request(prompts[1], 18))
    def check_in_sync():
        # Every row's draft KV over its committed tokens, and its root state (the draft hidden of
        # its last committed row, which the next drafting step expands), equal a from-scratch
        # draft prefill.
        for row, req in enumerate(engine.scheduler.rows):
            s = req.seq_len
            pages = engine.kv.pages(req)
            slots = torch.tensor([pages[j // 4] * 4 + j % 4 for j in range(s)])
            live = drafter.k_cache[0].reshape(-1, *drafter.k_cache.shape[-2:])[slots]
            fresh, root = draft_prefill_kv(drafter, tiny, req.tokens[: s + 1], with_hidden=True)
            torch.testing.assert_close(live, fresh, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(drafter.root_hidden[row], root, atol=1e-4, rtol=1e-4)

    for k in [4, 0, 0, 4, 4, 0]:
        engine.step(k)
    if sync:
        check_in_sync()  # after a k = 0 step
    else:  # a backlog of one token per row, caught up by the next drafting step
        assert [d + 1 for d in engine.state.draft_lens_host] == engine.state.seq_lens_host
    engine.step(4)
    engine.flush_trace()
    if oracle:
        assert max(a for rec in trace for a in rec["accepted"]) >= 2
    check_in_sync()  # after a drafting step
    while engine.has_work():
        engine.step(4 if engine._step_no % 3 else 0)
    assert [r.output_ids for r in reqs] == want


def test_draft_left_behind_while_off_stays_greedy_identical(tiny):
    """sync_while_off=False, catch_up=False: k = 0 steps leave the draft KV and root state alone (the holes an
    engine without the sync has); output is still plain greedy, and the draft KV of a token
    committed by a k = 0 step is not written."""
    prompts = rand_prompts([7, 12], seed=5)
    want = [reference(tiny, p, 16) for p in prompts]
    drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4, sync_while_off=False,
                            catch_up=False)
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024), drafter=drafter, ks=(4,))
    reqs = [engine.add_request(p, 16) for p in prompts]
    engine.step(4)  # prefill + a drafting step
    req = engine.scheduler.rows[0]
    slot = engine.kv.pages(req)[req.seq_len // 4] * 4 + req.seq_len % 4  # the next committed row
    flat = drafter.k_cache[0].reshape(-1, *drafter.k_cache.shape[-2:])
    flat[slot] = 7.0
    root = drafter.root_hidden[0].clone()
    engine.step(0)
    assert bool((flat[slot] == 7.0).all()) and torch.equal(drafter.root_hidden[0], root)
    i = 0
    while engine.has_work():
        engine.step(4 if i % 3 == 2 else 0)
        i += 1
    assert [r.output_ids for r in reqs] == want


def test_batch_threshold_policy_switches_with_hysteresis(tiny):
    pol = BatchThreshold(k=3, off_above=4, on_at_or_below=2)
    seen = [pol.choose(BatchView(n, 0)) for n in [1, 4, 5, 4, 3, 2, 3, 5]]
    assert seen == [3, 3, 0, 0, 0, 3, 3, 0]
    prompts = repetitive_prompts(6, seed=2)
    want = [reference(tiny, p, 12) for p in prompts]
    got, engine = run_engine(tiny, prompts, 12, drafter=NgramDrafter(),
                             policy=BatchThreshold(k=3, off_above=3, on_at_or_below=2))
    assert got == want
    assert engine.ks == [0, 3]


def test_always_policy_with_smollm2_ngram(smollm2, smollm2_tokenizer):
    """The embedded model, real code prompts: n-gram speculation commits the same greedy tokens."""
    prompts = [smollm2_tokenizer.encode_chat([{"role": "user", "content": c}]) for c in
               ("Repeat exactly: a b c a b c a b c", "Write a Python function add(a, b).")]
    want = [reference(smollm2, p, 16, eos=[2]) for p in prompts]
    engine = Engine(smollm2, EngineConfig(max_batch_size=4, kv_cache_tokens=1024), eos_ids=[2],
                    drafter=NgramDrafter(), policy=Always(4))
    reqs = [engine.add_request(p, 16) for p in prompts]
    engine.run_until_done()
    assert [r.output_ids for r in reqs] == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["eagle3", "ngram"])
def test_cuda_graphs_speculative_identical(kind):
    """On the GPU: Triton kernels, CUDA graphs per (bucket, tree size), fp32: greedy spec output
    equals the torch-reference plain greedy loop."""
    model = tiny_model(layers=2, device="cuda", backend="auto")
    ref_model = tiny_model(layers=2, device="cuda", backend="torch")
    prompts = repetitive_prompts(5, seed=4)
    want = [reference(ref_model, p, 20) for p in prompts]
    if kind == "eagle3":
        head = tiny_head(ref_model)
        head.backend = "auto"
        drafter = Eagle3Drafter(head, model, topk=2, steps=3, num_draft_tokens=6)
        k = 6
    else:
        drafter, k = NgramDrafter(), 4
    engine = Engine(model, EngineConfig(max_batch_size=8, page_size=16, kv_cache_tokens=4096,
                                        graph_buckets=(1, 2, 4, 8)), drafter=drafter, ks=(k,))
    assert engine.graphed
    reqs = [engine.add_request(p, 20) for p in prompts]
    i = 0
    while engine.has_work():
        engine.step(k if i % 3 else 0)
        i += 1
    assert [r.output_ids for r in reqs] == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_bf16_steps_match_padded_eager():
    """bf16, the serving dtype: the graphed steps (plain and EAGLE-3 trees, k switching step by step,
    graphed prefills) give the same tokens as the same kernels run eagerly at the same padded shapes
    (a graph replays its captured launches, so any difference is a capture or buffer bug)."""
    from specdec.models.llama import LlamaModel

    cpu_model = tiny_model(layers=2)  # its config and a draft head of the same shapes
    outs = {}
    prompts = repetitive_prompts(5, seed=6)
    for mode in ("graph", "eager_padded"):
        model = LlamaModel.random(cpu_model.config, device="cuda", dtype="bfloat16", seed=0, backend="auto")
        head = tiny_head(cpu_model, seed=1).to_device(model.device, torch.bfloat16)
        head.backend = "auto"
        drafter = Eagle3Drafter(head, model, topk=2, steps=3, num_draft_tokens=6)
        engine = Engine(model, EngineConfig(max_batch_size=8, page_size=16, kv_cache_tokens=4096,
                                            graph_buckets=(1, 2, 4, 8), cuda_graphs=mode == "graph",
                                            pad_eager=mode != "graph"), drafter=drafter, ks=(6,))
        assert engine.graphed == (mode == "graph")
        reqs = [engine.add_request(p, 24) for p in prompts]
        i = 0
        while engine.has_work():
            engine.step(6 if i % 3 else 0)
            i += 1
        engine.check()
        outs[mode] = [r.output_ids for r in reqs]
    assert outs["graph"] == outs["eager_padded"]


def test_profile_step_phases_leaves_engine_clean(tiny):
    drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4)
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024),
                    drafter=drafter, ks=(4,))
    for k in (0, 4):
        phases = engine.profile_step_phases(3, 40, k, iters=2)
        assert set(phases) == {"draft", "verify", "commit", "batch", "context"}
        assert phases["batch"] == 3 and all(phases[p] >= 0 for p in ("draft", "verify", "commit"))
        assert phases["verify"] > 0 and phases["commit"] > 0
        if k == 0:  # the tree is the root alone: no draft forward
            assert phases["draft"] < phases["verify"]
    engine.check()  # borrowed rows and pages returned
    prompts = rand_prompts([6, 9], seed=21)
    reqs = [engine.add_request(p, 8) for p in prompts]
    while engine.has_work():
        engine.step(4)
    assert [r.output_ids for r in reqs] == [reference(tiny, p, 8) for p in prompts]


def test_graphed_phases_splits_the_step_and_leaves_engine_clean(tiny):
    # engine/profiling.graphed_phases (on the CPU its eager path, wall-clock marks): every phase of a
    # tree step in step order (root, one entry per growth round, ..., extend), the drafter's marks
    # switched off afterwards, the engine as before (greedy output still the reference's).
    from specdec.engine.profiling import graphed_phases

    drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=3, num_draft_tokens=5)
    engine = Engine(tiny, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=1024),
                    drafter=drafter, ks=(5,))
    res = graphed_phases(engine, 1, 20, 5, iters=1, warmup=0)
    assert [p["phase"] for p in res["phases"]] == ["draft_root", "draft_round1", "draft_round2", "draft",
                                                   "verify_forward", "verify", "kv_sync", "commit"]
    assert res["T"] == 6 and all(p["ms"] >= 0 for p in res["phases"]) and drafter.phase_marks is None
    assert abs(res["sum_ms"] - sum(p["ms"] for p in res["phases"])) < 1e-9
    plain = graphed_phases(engine, 1, 20, 0, iters=1, warmup=0)
    assert [p["phase"] for p in plain["phases"]] == ["draft", "verify_forward", "verify", "kv_sync", "commit"]
    engine.check()
    prompts = rand_prompts([7], seed=5)
    reqs = [engine.add_request(p, 6) for p in prompts]
    while engine.has_work():
        engine.step(5)
    assert [r.output_ids for r in reqs] == [reference(tiny, p, 6) for p in prompts]


def test_committed_smollm2_head_accepts_and_keeps_greedy(smollm2, smollm2_tokenizer):
    """The trained head in checkpoints/ loads through the draft config, drafts the target's own greedy
    continuation (a random head accepts ~nothing: τ ~ 1), and speculation stays token-identical."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from specdec.spec import build_drafter

    ckpt = Path(__file__).resolve().parents[1] / "checkpoints" / "eagle3-smollm2-135m"
    cfg = OmegaConf.create({"name": "eagle3", "path": str(ckpt), "topk": 4, "steps": 5, "num_draft_tokens": 16})
    drafter = build_drafter(cfg, smollm2, device=smollm2.device, dtype=torch.float32, backend=smollm2.backend)
    assert drafter.head.config.draft_vocab_size == 8192 and drafter.capture_layers == (2, 15, 27)
    prompts = [smollm2_tokenizer.encode_chat([{"role": "user", "content": c}]) for c in
               ("Write a Python function that returns the sum of a list of numbers.",
                "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n")]
    want = [reference(smollm2, p, 32, eos=[2]) for p in prompts]
    trace = []
    engine = Engine(smollm2, EngineConfig(max_batch_size=2, kv_cache_tokens=1024), eos_ids=[2],
                    drafter=drafter, policy=Always(16), trace=trace.append)
    reqs = [engine.add_request(p, 32) for p in prompts]
    engine.run_until_done()
    engine.flush_trace()
    assert [r.output_ids for r in reqs] == want
    accepted = [a for rec in trace for a in rec["accepted"]]
    assert sum(accepted) / len(accepted) + 1 > 2.0, accepted


def test_step_kernels_keep_greedy_and_draft_kv(tiny, monkeypatch, kernel_options):
    """The kernel option step_kernels=True (forced on the CPU): block_meta and ancestor_masks as Triton kernels (the interpreter
    here) inside the engine loop: trees stay token-identical and the draft KV in sync."""
    from kernels_triton import paging, tree_mask

    calls = {"block_meta": 0, "ancestor_masks": 0}
    for mod, name in ((paging, "block_meta"), (tree_mask, "ancestor_masks")):
        real = getattr(mod, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, name, counted)
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the tiny model lives on the CPU: its kernels need the interpreter (CUDA runs cover the GPU)")
    kernel_options.set_(step_kernels=True)
    test_eagle3_greedy_identical(tiny, 3, 2, 8)
    test_alternating_k_keeps_draft_kv_in_sync(tiny, oracle=True, pad=True, sync=False)
    assert calls["block_meta"] > 0 and calls["ancestor_masks"] > 0


def test_eagle3_fused_layer_kernels_keep_greedy(monkeypatch):
    """backend="triton" (the interpreter here): target and draft layers run the fused small-M kernels
    (norm + qkv + RoPE + KV write, norm + gate|up + SwiGLU, linear with the residual add) for decode,
    verify and draft rows, and greedy speculative output stays identical to plain greedy."""
    from kernels_triton import linear as lin

    from kernels_triton import options

    calls = {"rope": 0, "add": 0, "gathered_qkv": 0, "gathered_fc": 0}
    real_qkv, real_linear, real_linear_residual = lin.norm_qkv_rope_write_kv_, lin.linear, lin.linear_residual

    def qkv(*a, rows=None, **kw):
        calls["rope"] += 1
        calls["gathered_qkv"] += rows is not None
        return real_qkv(*a, rows=rows, **kw)

    def linear(x, w, add=None, config=None, rows=None):
        calls["add"] += add is not None
        calls["gathered_fc"] += rows is not None
        return real_linear(x, w, add, config, rows=rows)

    def linear_residual(x, w, residual, config=None):  # the residual added in the epilogue (streamed rows)
        calls["add"] += 1
        return real_linear_residual(x, w, residual, config)

    monkeypatch.setattr(lin, "norm_qkv_rope_write_kv_", qkv)
    monkeypatch.setattr(lin, "linear", linear)
    monkeypatch.setattr(lin, "linear_residual", linear_residual)
    model = tiny_model(layers=2, backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    prompts = rand_prompts([7, 12], seed=5)
    want = [reference(model, p, 10) for p in prompts]
    drafter = Eagle3Drafter(tiny_head(model), model, topk=2, steps=3, num_draft_tokens=6)
    got, _ = run_engine(model, prompts, 10, drafter=drafter, ks=(6,), k_of_step=lambda i: 6)
    assert got == want
    assert calls["rope"] > 0 and calls["add"] > 0  # target and draft went through the fused kernels
    # The draft rounds' token embeddings and the extend's accepted features were read by the kernels
    # (gathered rows); on the unfused path (kernel option fused_linear off) torch gathers them, same output.
    assert calls["gathered_qkv"] > 0 and calls["gathered_fc"] > 0, calls
    calls.update(gathered_qkv=0, gathered_fc=0)
    with options.use(fused_linear=False):
        got_off, _ = run_engine(model, prompts[:1], 10, drafter=drafter, ks=(6,), k_of_step=lambda i: 6)
    assert got_off == want[:1] and calls["gathered_qkv"] == calls["gathered_fc"] == 0


def test_padding_rows_never_move_kv(tiny, monkeypatch):
    """Rows past num_active in a padded bucket carry stale state (e.g. a finished request's page table);
    even if verification "accepts" drafts there, the commit must move no KV for them, and the live
    rows' output stays identical to plain greedy."""
    import specdec.engine.step as stepmod

    real_va, real_kv = stepmod.step_ops.verify_accept, stepmod.step_ops.kv_sync_
    engine = None
    padding_accepts = []

    def va(logits, tokens, parents, *a, **kw):
        acc, nodes, out = real_va(logits, tokens, parents, *a, **kw)
        n, T = engine.state.num_rows, tokens.shape[1]
        acc, nodes = acc.clone(), nodes.clone()
        acc[n:] = T - 1  # claim the whole chain on padding rows
        nodes[n:] = torch.arange(T, dtype=nodes.dtype)
        return acc, nodes, out

    def kv(caches, page_table, seq, nodes, acc, out, valid=None, into=None, **kw):
        n, T = engine.state.num_rows, nodes.shape[1]
        padding_accepts.extend(acc[n:].tolist())  # forced above: the commit must ignore them
        (k, v), PS = caches[0], caches[0][0].shape[2]
        before = (k.clone(), v.clone())
        res = real_kv(caches, page_table, seq, nodes, acc, out, valid, into, **kw)
        changed = ((k != before[0]) | (v != before[1])).flatten(3).any(-1).any(0).flatten()  # [P * PS] slots
        allowed = torch.zeros_like(changed)
        for r in range(n):  # the live rows' scratch slots seq .. seq + T - 1: the only ones a commit may write
            for s_ in range(int(seq[r]), int(seq[r]) + T):
                allowed[int(page_table[r, s_ // PS]) * PS + s_ % PS] = True
        assert not (changed & ~allowed).any(), "the commit wrote KV outside the live rows' scratch slots"
        if into is not None:  # padding rows commit nothing to the state either
            assert (into[2][n:] == -1).all() and torch.equal(into[0][n:], seq[n:])
        return res

    monkeypatch.setattr(stepmod.step_ops, "verify_accept", va)
    monkeypatch.setattr(stepmod.step_ops, "kv_sync_", kv)
    prompts = repetitive_prompts(3, seed=2)
    want = [reference(tiny, p, 12) for p in prompts]
    drafter = Eagle3Drafter(tiny_head(tiny), tiny, topk=2, steps=2, num_draft_tokens=4)
    engine = Engine(tiny, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=1024, pad_eager=True,
                                       graph_buckets=(4,)), drafter=drafter, ks=(4,))
    reqs = [engine.add_request(p, 12) for p in prompts]
    while engine.has_work():
        engine.step(4)
        engine.check()
    assert [r.output_ids for r in reqs] == want
    assert padding_accepts and all(padding_accepts)  # padding rows were there, "accepted", committed nothing


def test_ngram_index_drafts_what_the_scan_drafts():
    """The per-request n-gram index (prepare_ with a RowTokens context, as the engine passes it) uploads
    the same chains as the right-to-left scan over each history, step after step as rows grow, for
    several n ranges and small vocabularies (many repeats); a key whose tokens change (a new request
    under an old id) is re-indexed, and the indices of requests that left are dropped."""
    import random

    from specdec.engine.state import DecodeState
    from specdec.spec.base import RowTokens
    from specdec.spec.ngram import _GramIndex

    rng = random.Random(0)
    for mn, mx in ((1, 3), (2, 4), (1, 1)):
        scan = NgramDrafter(max_ngram=mx, min_ngram=mn)
        for _ in range(200):  # the index alone, grown token by token
            hist = [rng.randrange(rng.choice([2, 5, 50])) for _ in range(rng.randrange(1, 50))]
            ix = _GramIndex(mn, mx)
            for L in range(1, len(hist) + 1):
                if rng.random() < 0.5 or L == len(hist):
                    assert ix.continues(hist[:L])
                    for k in (1, 3, 8):
                        assert ix.extend_(hist[:L]).lookup(k) == scan.lookup(hist[:L], k)
        state = DecodeState(6, 8, 4, torch.device("cpu"), max_tree_nodes=9)
        indexed, parted, plain = (NgramDrafter(max_ngram=mx, min_ngram=mn) for _ in range(3))
        for d in (indexed, parted, plain):
            d.bind_(state, 32, 4)
        # the engine's rows: (prompt, output) lists per request id, the output growing a few tokens a step
        reqs = {f"r{i}": ([rng.randrange(4) for _ in range(rng.randrange(1, 12))], []) for i in range(5)}
        for step in range(30):
            for key in reqs:
                reqs[key][1].extend(rng.randrange(4) for _ in range(rng.randrange(0, 4)))
            if step == 10:  # a new request under an old id, sent with the same prompt list
                reqs["r0"] = (reqs["r0"][0], [rng.randrange(4) for _ in range(len(reqs["r0"][1]) + 3)])
            if step == 20:  # ... and one with a new prompt
                reqs["r1"] = ([rng.randrange(4) for _ in range(6)], [])
            keys = sorted(reqs, key=lambda _: rng.random())
            T = rng.choice([3, 5, 9])
            rows = [reqs[k][0] + reqs[k][1] for k in keys]
            indexed.prepare_(state, len(keys), T, RowTokens(rows, keys))
            parted.prepare_(state, len(keys), T, RowTokens(keys=keys, parts=[reqs[k] for k in keys]))
            plain.prepare_(state, len(keys), T, rows)
            assert torch.equal(indexed.buf[:len(keys), :T], plain.buf[:len(keys), :T])
            assert torch.equal(parted.buf[:len(keys), :T], plain.buf[:len(keys), :T])
        assert set(indexed._index) == set(reqs) == set(parted._index)
        assert RowTokens(keys=["a"], parts=[([1, 2], [3])])[0] == [1, 2, 3]
        assert RowTokens(keys=["a", "b"], parts=[([1], [2]), ([3], [])])[:2] == [[1, 2], [3]]
    big = NgramDrafter()
    big.bind_(state, 32, 4)
    for i in range(200):  # one row at a time, each a new request: old indices are pruned
        big.prepare_(state, 1, 3, RowTokens([[1, 2, 1, i]], [f"q{i}"]))
    assert len(big._index) <= 2 + 64 + 1


def test_ngram_follow_at_is_the_scan():
    """follow_at (the suffix found by bytes.rfind over the tokens packed 4 bytes each: what goodput's shadow
    scoring runs per draft) returns what the right-to-left scan returns over history[:end], for every end,
    with token ids whose bytes recur across token boundaries (a match off a 4-byte boundary must be
    skipped, not taken), ids above 2**31, and ids too large to pack (the scan then)."""
    import random

    rng = random.Random(5)
    pools = ([0, 1, 2], [0, 256, 65536, 1, 257, 16777216, 16777217], list(range(40)), [2 ** 31 + 5, 5, 2 ** 32 - 1],
             [2 ** 40, 3, 2 ** 40 + 1])
    aliased = 0
    for mn, mx in ((1, 3), (2, 4), (1, 1), (3, 3)):
        d = NgramDrafter(max_ngram=mx, min_ngram=mn)
        for _ in range(400):
            pool = rng.choice(pools)
            hist = [rng.choice(pool) for _ in range(rng.randrange(1, 50))]
            for end in range(1, len(hist) + 1):
                for k in (1, 3, 8):
                    assert d.follow_at(hist, end, k) == d.lookup(hist[:end], k), (hist, end, k, mn, mx)
            if pool is pools[1] and len(hist) > 8:
                packed = bytes(b for t in hist for b in t.to_bytes(4, "little"))
                for i in range(len(hist) - 1):  # an occurrence of a 2-token gram off the 4-byte grid
                    sub, p = packed[4 * i:4 * i + 8], packed.find(packed[4 * i:4 * i + 8])
                    while p >= 0 and not p % 4:
                        p = packed.find(sub, p + 1)
                    aliased += p >= 0
    assert aliased  # some histories had a match across token boundaries
    d = NgramDrafter()
    assert d.follow_at([1, 2, 3, 1, 2], 5, 3) == [3, 1, 2]
    assert d.shadow_commits([1, 2, 3, 1, 2, 3, 1], 5, 2) == 3  # follow [3, 1], both committed, + bonus
