"""Replayed acceptance (specdec.acceptance) and the random EAGLE-3 head: draws follow the trace, the
forced verdict is a real tree path whose KV (and only that) is committed, labels reach the outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_engine import VOCAB, rand_prompts, tiny_model

from specdec import acceptance as acc_mod
from specdec.acceptance import (AcceptanceTrace, ReplayAcceptance, SizeTrace, build_trace, forced_verdict,
                                parametric_trace, solve_p)
from specdec.engine.engine import Engine, EngineConfig
from specdec.engine.step import PrefillChunk, prefill_body_, prefill_inputs
from specdec.engine.kv_cache import KVCache
from specdec.errors import ConfigError
from specdec.models.llama import LlamaModel
from specdec.bench.targets import llama_config_from_dict
from specdec.spec import Eagle3Drafter, random_draft_vocab, random_eagle3_head
from specdec.spec.tree import ancestor_masks

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "experiments/results/eagle3/humaneval_full_41d1e6b/1"  # tree16, batch 1, mean 3.293


def _tree(parents):
    par = torch.tensor(parents, dtype=torch.int32)  # [B, T]
    B, T = par.shape
    depth = torch.zeros(B, T, dtype=torch.int32)
    for j in range(1, T):
        depth[:, j] = depth.gather(1, par[:, j:j + 1].long())[:, 0] + 1
    return par, depth, ancestor_masks(par, int(depth.max()))


def test_forced_verdict_is_the_path_to_the_deepest_node():
    # Row 0: root -> 1 -> 3 -> 5 (deepest, depth 3); row 1: two depth-2 leaves 3 and 4: the lower index.
    par, depth, mask = _tree([[-1, 0, 0, 1, 2, 3], [-1, 0, 0, 1, 2, 2]])
    B, T, V = 2, 6, 11
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    logits = torch.randn(B, T, V, generator=torch.Generator().manual_seed(1))
    want_path = [[0, 1, 3, 5], [0, 1, 3]]
    for drawn in ([0, 0], [2, 1], [9, 9], [3, 2]):
        a, nodes, out = forced_verdict(tokens, depth, mask, logits, torch.tensor(drawn), max_depth=3)
        for b in range(B):
            path = want_path[b]
            n = min(drawn[b], len(path) - 1)
            assert a[b] == n
            assert nodes[b].tolist() == path[:n + 1] + [-1] * (T - n - 1)
            last = path[n]
            assert out[b].tolist() == [int(tokens[b, j]) for j in path[1:n + 1]] + [int(logits[b, last].argmax())] \
                + [-1] * (T - n - 1)
    # max_depth caps the path too (a chain's depth, say)
    a, nodes, _ = forced_verdict(tokens, depth, mask, logits, torch.tensor([9, 9]), max_depth=1)
    assert a.tolist() == [1, 1] and nodes[:, 2:].eq(-1).all()


def test_replay_draws_reproduce_the_trace_distribution():
    hist = {0: 300, 1: 150, 3: 600, 5: 450}  # counts per accepted drafts at k = 16
    tr = AcceptanceTrace(sizes={16: SizeTrace(dict(hist))}, source=["test"])

    class FakeDrafter:
        def num_nodes(self, k):
            return k + 1

        def max_path_nodes(self, T):
            return 6  # depth 5

    class FakeState:
        def add_row_buffer(self, name, shape, dtype, follows="rows"):
            return torch.zeros(8, dtype=dtype)

    def draws(seed, n=40000):
        r = ReplayAcceptance(tr, seed=seed)
        r.bind_(FakeState(), FakeDrafter(), [0, 16])
        return r.draw(16, [f"x{i}" for i in range(n)])

    got = draws(0)
    total = sum(hist.values())
    for a in range(6):
        # 40000 draws: the standard error of a frequency is <= 0.0025; 0.012 is ~5 of them
        assert abs(got.count(a) / len(got) - hist.get(a, 0) / total) < 0.012, a
    assert draws(0, 500) == got[:500]  # seeded
    assert draws(1, 500) != got[:500]
    # A shallower tree caps the recorded lengths at its depth: 5 -> 3 for a depth-3 tree.
    r = ReplayAcceptance(tr, seed=0)
    FakeDrafter.max_path_nodes = lambda self, T: 4
    r.bind_(FakeState(), FakeDrafter(), [16])
    capped = r.draw(16, ["y"] * 20000)
    assert max(capped) == 3 and abs(capped.count(3) / 20000 - 1050 / 1500) < 0.02


def test_replay_per_request_sequences_then_the_empirical_distribution():
    st = SizeTrace({0: 1, 4: 1})
    for a in (1, 2, 3):
        st.add_(a, "HumanEval/7")
    tr = AcceptanceTrace(sizes={3: st}, source=["t"])
    r = ReplayAcceptance(tr, seed=0)
    r._cdf[3] = __import__("numpy").cumsum(tr.probs(3, 3))
    r._depth[3], r.size_map[3] = 3, 3
    # a repeat of the prompt (id#1) replays the same sequence with its own cursor
    assert [r.draw(3, ["HumanEval/7", "HumanEval/7#1"]) for _ in range(3)] == [[1, 1], [2, 2], [3, 3]]
    rest = [r.draw(3, ["HumanEval/7"])[0] for _ in range(200)]  # past its end: the size's distribution
    assert set(rest) <= {0, 1, 2, 3} and len(set(rest)) > 1
    # per_request=False: the id's sequence is ignored, its rows draw like any other id's
    a, b = (ReplayAcceptance(tr, seed=5, per_request=False), ReplayAcceptance(tr, seed=5))
    for x in (a, b):
        x._cdf, x._depth, x.size_map = r._cdf, r._depth, r.size_map
    assert [a.draw(3, ["HumanEval/7"])[0] for _ in range(30)] == [b.draw(3, ["other"])[0] for _ in range(30)]


def test_parametric_trace_has_the_asked_mean():
    p = solve_p(6.0, 7)
    tr = parametric_trace(6.0, 7)
    probs = tr.probs(48, 7)
    assert abs(sum(probs) - 1) < 1e-9 and abs(1 + sum(i * x for i, x in enumerate(probs)) - 6.0) < 1e-6
    assert tr.p == p and 0.9 < p < 0.93  # geometric: P(a >= i) = p^i
    chain3 = tr.probs(3, 3)  # a shallower tree: the same p, truncated
    assert abs(chain3[3] - p ** 3) < 1e-9 and 1 + sum(i * x for i, x in enumerate(chain3)) < 4
    with pytest.raises(ConfigError, match="must lie in"):
        solve_p(9.0, 7)


def test_build_trace_cli_from_steps_and_metrics(tmp_path):
    run1 = tmp_path / "runs" / "0"
    run1.mkdir(parents=True)
    steps = [{"k": 16, "accepted": [2, 5], "accepted_ids": ["a", "b"]}, {"k": 0, "accepted": []},
             {"k": 16, "accepted": [3], "accepted_ids": ["a"]}, {"k": 3, "accepted": [1, 1]}]
    (run1 / "steps.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    run2 = tmp_path / "runs" / "1"  # a run that kept only metrics.json, one k
    run2.mkdir()
    (run2 / "metrics.json").write_text(json.dumps({"k_step_fraction": {"48": 1.0}, "accepted_histogram": {"0": 3, "7": 1}}))
    run3 = tmp_path / "runs" / "2"  # several k in one histogram: cannot be split, skipped
    run3.mkdir()
    (run3 / "metrics.json").write_text(json.dumps({"k_step_fraction": {"3": 0.5, "16": 0.5}, "accepted_histogram": {"1": 9}}))
    out = tmp_path / "trace.json"
    assert acc_mod.main(["build-trace", str(tmp_path / "runs"), "-o", str(out)]) == 0
    tr = build_trace([out])
    assert tr.sizes[16].hist == {2: 1, 5: 1, 3: 1} and tr.sizes[16].requests == {"a": [2, 3], "b": [5]}
    assert tr.sizes[3].hist == {1: 2} and tr.sizes[48].hist == {0: 3, 7: 1}
    assert str(run3) not in tr.source and len(tr.source) == 2
    assert acc_mod.main(["build-trace", str(tmp_path / "nope"), "-o", str(out)]) == 2


def test_committed_trace_matches_its_recorded_runs():
    tr = build_trace(["pkg://specdec/data/acceptance_smollm2_eagle3_humaneval.json"])  # installed with the package
    m = json.loads((RECORDED / "metrics.json").read_text())
    assert abs(tr.sizes[16].mean_length() - m["mean_accepted_length"]) < 1e-9


def test_eagle3_random_builds_for_other_shapes():
    # A tiny random Llama of another shape (GQA 6/2, head_dim 8, 5 layers, untied vocab 300)
    cfg = llama_config_from_dict(dict(hidden_size=48, intermediate_size=80, num_hidden_layers=5, num_attention_heads=6,
                                      num_key_value_heads=2, head_dim=8, vocab_size=300, max_position_embeddings=512,
                                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False))
    model = LlamaModel.random(cfg, dtype="float32", backend="torch")
    head = random_eagle3_head(model, "auto", None, device="cpu", dtype=torch.float32, backend="torch")
    c = head.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (48, 6, 2, 8, 80)
    assert c.target_layers == (2, 2, 2) and c.draft_vocab_size == 300  # min(vocab, 32000)
    assert head.w("fc.weight").shape == (48, 144) and head.w("lm_head.weight").shape == (300, 48)
    assert head.to_target_ids(torch.arange(300)).tolist() == list(range(300)) and head.t2d.all()
    # Llama-3's 128256 ids -> 32000 draft ids (the published head's); SmolLM2's 49152 -> 32000 too
    assert random_draft_vocab(128256) == 32000 and random_draft_vocab(49152) == 32000
    assert random_draft_vocab(300, 100) == 100
    with pytest.raises(ConfigError, match="draft_vocab_size=400"):
        random_draft_vocab(300, 400)


def test_eagle3_random_builds_for_smollm2_and_grows_deep_trees():
    """SmolLM2-135M shapes (random target weights: the head's shapes are the point): the head matches
    the committed head's layout, and its peaked draft logits grow trees to their full depth, which
    replay needs to accept long paths."""
    cfg = llama_config_from_dict(dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=1024,
                                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True))
    model = LlamaModel.random(cfg, dtype="float32", backend="torch")
    head = random_eagle3_head(model, "auto", None, device="cpu", dtype=torch.float32, backend="torch")
    assert head.config.target_layers == (2, 15, 27) and head.config.draft_vocab_size == 32000
    assert head.w("midlayer.self_attn.q_proj.weight").shape == (576, 1152)
    drafter = Eagle3Drafter(head, model, trees=[(4, 5, 16)])
    eng = Engine(model, EngineConfig(max_batch_size=2, kv_cache_tokens=512), drafter=drafter, ks=(16,))
    for p in rand_prompts([12, 9], seed=3):
        eng.add_request([t + 300 for t in p], 2, ignore_eos=True)
    eng.step(0)  # prefill (+ a plain step)
    st = eng.state
    tree = drafter.propose(st, 2, 17, st.row_ids[:2] < 2)
    assert tree.depth.max(1).values.tolist() == [5, 5]


def _committed_kv_matches(model, engine, req) -> bool:
    """Target KV at the request's committed slots == a fresh prefill's over its committed tokens."""
    toks = req.tokens[:req.seq_len]
    kv2 = KVCache(model, 8, 64)
    ids, pos, meta = prefill_inputs([PrefillChunk(toks, 0, list(range(pages_needed(len(toks), 64))))], 64, "cpu")
    prefill_body_(model, kv2, None, ids, pos, meta, None)
    pages = engine.kv.pages(req)
    ps = engine.kv.page_size
    slots = torch.tensor([pages[s // ps] * ps + s % ps for s in range(len(toks))])
    k1 = engine.kv.k.flatten(1, 2)[:, slots]  # [L, n, HKV, D]
    k2 = kv2.k.flatten(1, 2)[:, : len(toks)]
    v1 = engine.kv.v.flatten(1, 2)[:, slots]
    v2 = kv2.v.flatten(1, 2)[:, : len(toks)]
    return torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)


def pages_needed(n, ps):
    return (n + ps - 1) // ps


def _replay_engine(model, mean=4.5):
    head = random_eagle3_head(model, 64, None, device="cpu", dtype=torch.float32, backend="torch")
    drafter = Eagle3Drafter(head, model, trees=[(2, 4, 8)])
    acc = ReplayAcceptance(parametric_trace(mean, 4), seed=0)
    return Engine(model, EngineConfig(max_batch_size=2, kv_cache_tokens=1024), drafter=drafter, ks=(8,),
                  acceptance=acc)


def test_replay_commits_exactly_the_accepted_nodes_kv(monkeypatch):
    model = tiny_model(layers=4)

    def serve():
        eng = _replay_engine(model)
        reqs = [eng.add_request(p, 64, ignore_eos=True) for p in rand_prompts([9, 13], seed=2)]
        eng.step(0)
        ok, accepted = True, []
        for _ in range(5):
            before = [r.seq_len for r in reqs]
            eng.step(8)
            accepted += [r.seq_len - b - 1 for r, b in zip(reqs, before)]
            ok &= all(_committed_kv_matches(model, eng, r) for r in reqs)
        return ok, accepted

    ok, accepted = serve()
    assert ok and max(accepted) >= 3  # long replayed paths, and their KV is the committed tokens' KV
    real = acc_mod.forced_verdict

    def corrupt(tokens, depth, mask, logits, drawn, max_depth):
        a, nodes, out = real(tokens, depth, mask, logits, drawn, max_depth)
        T = tokens.shape[1]
        bad = torch.where(nodes > 0, nodes % (T - 1) + 1, nodes)  # another node's KV, same tokens
        return a, bad, out

    monkeypatch.setattr(acc_mod, "forced_verdict", corrupt)
    ok, _ = serve()
    assert not ok  # the KV check notices accepted indices that do not match the committed path


def test_replay_steps_are_graph_shaped_and_label_the_trace():
    """The engine's step records carry the rows' request ids (per-request traces) and the replayed
    lengths follow the drawn ones."""
    model = tiny_model(layers=2)
    eng = _replay_engine(model, mean=3.0)
    trace = []
    eng.trace = trace.append
    for i, p in enumerate(rand_prompts([7, 8], seed=4)):
        eng.add_request(p, 16, request_id=f"q{i}", ignore_eos=True)
    while eng.has_work():
        eng.step(8)
    eng.flush_trace()
    spec = [r for r in trace if r["k"] == 8 and r["accepted"]]
    assert spec and all(len(r["accepted_ids"]) == len(r["accepted"]) for r in spec)
    assert {i for r in spec for i in r["accepted_ids"]} == {"q0", "q1"}
    d = eng.acceptance.describe()
    assert d["acceptance"] == "replayed" and d["acceptance_kind"] == "parametric"


def run_cli(*overrides, tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "specdec.run", *overrides, f"hydra.run.dir={tmp_path}/run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_replay_on_smollm2_reproduces_the_recorded_mean_and_is_labelled(tmp_path):
    """SmolLM2 with a random head (it accepts ~nothing by itself) replaying the recorded tree16 run:
    the served mean accepted length is the recorded one's, and metrics.json and the report say
    "replayed"."""
    proc = run_cli("draft=eagle3_random", "policy=always16", "acceptance=replay", f"acceptance.trace={RECORDED}",
                   "workload=humaneval", "workload.sources.0.limit=4", "workload.concurrency=4",
                   "engine.max_new_tokens=32", "workload.chat=false", "+workload.ignore_eos=true", "engine.profile_iters=1",
                   "logger=none", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "run/metrics.json").read_text())
    assert m["acceptance"] == "replayed" and str(RECORDED) in m["acceptance_trace"]
    recorded = json.loads((RECORDED / "metrics.json").read_text())["mean_accepted_length"]  # 3.293
    n = sum(m["accepted_histogram"].values())
    assert n >= 25
    # per-row std of the recorded distribution is ~1.8: 4 standard errors at n rows
    assert abs(m["mean_accepted_length"] - recorded) < 4 * 1.8 / n ** 0.5, (m["mean_accepted_length"], n)
    from specdec.report import build_report, load_runs

    md, _ = build_report(load_runs([tmp_path / "run"]), tmp_path / "report")
    assert "replayed acceptance (1)" in md  # the trace (run directory 1) named in the Target label


def test_bad_replay_configs_are_named(tmp_path):
    with pytest.raises(ConfigError, match="needs acceptance.trace"):
        acc_mod.build_acceptance({"name": "replay"})
    with pytest.raises(ConfigError, match="valid: real, replay"):
        acc_mod.build_acceptance({"name": "nope"})
    with pytest.raises(ConfigError, match="does not exist"):
        acc_mod.build_acceptance({"name": "replay", "trace": str(tmp_path / "missing")})
    model = tiny_model(layers=2)
    head = random_eagle3_head(model, 64, None, device="cpu", dtype=torch.float32, backend="torch")
    tr = AcceptanceTrace(sizes={16: SizeTrace({1: 1})}, source=["only16"])
    with pytest.raises(ConfigError, match=r"no steps at tree size k=8 \(recorded sizes: \[16\]\)"):
        Engine(model, EngineConfig(max_batch_size=1, kv_cache_tokens=256),
               drafter=Eagle3Drafter(head, model, trees=[(2, 4, 8)]), ks=(8,), acceptance=ReplayAcceptance(tr))
    r = ReplayAcceptance(tr, missing="nearest")
    Engine(model, EngineConfig(max_batch_size=1, kv_cache_tokens=256),
           drafter=Eagle3Drafter(head, model, trees=[(2, 4, 8)]), ks=(8,), acceptance=r)
    assert r.size_map == {8: 16}


def test_replay_counterfactual_is_quantile_coupled():
    """With counterfactual sizes, a draw at k also scores each smaller k' at the same quantile: the
    k draws are the ones drawn without it (same seed), the k' samples follow the trace's k'
    distribution, and (k' shallower, stochastically smaller) never exceed the row's k length."""
    tr = AcceptanceTrace(sizes={3: SizeTrace({0: 500, 1: 300, 2: 150, 3: 50}),
                                16: SizeTrace({0: 200, 1: 200, 2: 200, 3: 200, 4: 100, 5: 100})}, source=["t"])

    class FakeDrafter:
        def num_nodes(self, k):
            return k + 1

        def max_path_nodes(self, T):
            return 4 if T == 4 else 6

    class FakeState:
        def add_row_buffer(self, name, shape, dtype, follows="rows"):
            return torch.zeros(8, dtype=dtype)

    def make(cf):
        r = ReplayAcceptance(tr, seed=3)
        r.bind_(FakeState(), FakeDrafter(), [3, 16])
        if cf:
            r.counterfactual_({16: (3,)})
        return r

    ids = [f"x{i}" for i in range(20000)]
    plain, coupled = make(False), make(True)
    big = coupled.draw(16, ids)
    assert big == plain.draw(16, ids) and plain.last_cf is None
    small = [c - 1 for c in coupled.last_cf[3]]  # commits -> accepted drafts
    for a, want in ((0, 0.5), (1, 0.3), (2, 0.15), (3, 0.05)):
        assert abs(small.count(a) / len(small) - want) < 0.015, a
    assert all(s <= b for s, b in zip(small, big)) and sum(small) < sum(big)
    assert coupled.draw(3, ids[:5]) and coupled.last_cf is None  # nothing smaller than 3 was asked for
    with pytest.raises(ConfigError, match="not bound"):
        coupled.counterfactual_({16: (8,)})


def test_replayed_goodput_learns_smaller_sizes_from_larger_steps():
    """An engine with replayed acceptance feeds a counterfactual goodput the smaller sizes' samples
    from every step at a larger one (labelled "replayed"), as a real EAGLE-3 drafter does."""
    from specdec.policy import Goodput

    model = tiny_model(layers=2)
    head = random_eagle3_head(model, 64, None, device="cpu", dtype=torch.float32, backend="torch")
    drafter = Eagle3Drafter(head, model, trees=[(1, 3, 3), (2, 4, 8)])

    class Largest(Goodput):
        """goodput that speculates at its largest size on every decode step: what is under test is what the
        engine feeds it, not its choice (which this CPU's start-up timings would decide)."""

        def choose(self, view):
            k = super().choose(view)
            return max(self.ks) if k is not None else k

    policy = Largest([3, 8], counterfactual=True, explore_every=0, probe_rows=1)
    engine = Engine(model, EngineConfig(max_batch_size=2, kv_cache_tokens=1024), drafter=drafter, policy=policy,
                    acceptance=ReplayAcceptance(parametric_trace(3.0, 4), seed=0))
    for p in rand_prompts([9, 13], seed=2):
        engine.add_request(p, 24, ignore_eos=True)
    engine.run_until_done()
    assert policy.counterfactual_pairs == {(3, 8): "replayed"}
    assert policy.counterfactual_rows[3] > 0 and policy.rows_seen[3] >= policy.counterfactual_rows[3]
