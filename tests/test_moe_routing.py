"""MoE routing and its cost, on tiny random MoE models (CPU): the distinct experts the model records
equal a count from the routing reference; ``target.routing`` kind router leaves the model's own router,
uniform draws every token's experts independently, zipf routes each token to the experts it planned, with
the configured reuse between consecutive tokens and a Zipf-like popularity; goodput prices an MoE cost
model's non-monotonic step costs; its start-up table covers every batch bucket."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from kernels_triton.moe import moe_route_ref, steer_logits_ref
from specdec.errors import ConfigError
from specdec.models import ops
from specdec.models.families import ModelConfig
from specdec.models.ops import AttentionMeta
from specdec.models.routing import (RoutingConfig, Selector, apply_routing_, consecutive_reuse, routing_facts,
                                    solve_keep)
from specdec.models.transformer import TransformerModel
from specdec.policy import BatchView, Goodput, StepStats

VOCAB = 128
E, K = 16, 4


def tiny_moe(backend="torch", seed=0, routing=None, layers=2, **fields):
    c = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                    model_type="qwen3_moe", qk_norm=True, num_experts=E, num_experts_per_tok=K,
                    moe_intermediate_size=32, moe_layers=tuple(range(layers)), **fields)
    model = TransformerModel.random(c, dtype="float32", seed=seed, backend=backend)
    if routing is not None:
        apply_routing_(model, OmegaConf.create({"name": "tiny", "random_weights": True, "routing": routing}))
    return model


def prefill(model, prompts, page_size=4, first_page=1):
    """One causal forward over every prompt (one row each, own pages from ``first_page`` on)."""
    lens = [len(p) for p in prompts]
    pages = [-(-n // page_size) for n in lens]
    mp = max(pages)
    table = torch.zeros(len(prompts), mp, dtype=torch.int32)
    slots, nxt = [], first_page
    for r, (n, pg) in enumerate(zip(lens, pages)):
        table[r, :pg] = torch.arange(nxt, nxt + pg)
        nxt += pg
        t = torch.arange(n)
        slots.append(table[r, t // page_size].long() * page_size + t % page_size)
    k, v = model.new_kv_cache(nxt, page_size)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    meta = AttentionMeta(cu, torch.tensor(lens, dtype=torch.int32), table, torch.cat(slots), max(lens))
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(n) for n in lens])
    return model(ids, pos, meta, k, v)


@pytest.fixture
def routed(monkeypatch):
    """Per call of ops.moe, the experts the routing reference picks from the router input it was given
    (a list of [N, K] id tensors, in call order: layer by layer, forward by forward)."""
    from kernels_triton.norm import rms_norm_ref

    seen = []
    real, real_norm = ops.moe, ops.moe_norm

    def spy(x, router_w, w13, w2, top_k, renormalize, **kw):
        _, ids = moe_route_ref(steer_logits_ref(x.float() @ router_w.float().t(), kw.get("steer")), top_k, renormalize)
        seen.append(ids.long())
        return real(x, router_w, w13, w2, top_k, renormalize, **kw)

    def spy_norm(x, residual, norm_weight, eps, router_w, w13, w2, top_k, renormalize, **kw):  # the router kind
        y = rms_norm_ref(x, norm_weight, eps) if residual is None else rms_norm_ref(x, norm_weight, eps, residual)[0]
        _, ids = moe_route_ref(steer_logits_ref(y.float() @ router_w.float().t(), kw.get("steer")), top_k, renormalize)
        seen.append(ids.long())
        return real_norm(x, residual, norm_weight, eps, router_w, w13, w2, top_k, renormalize, **kw)

    monkeypatch.setattr(ops, "moe", spy)
    monkeypatch.setattr(ops, "moe_norm", spy_norm)
    return seen


def rand_prompts(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("routing", [None, {"kind": "zipf", "skew": 1.0, "reuse": 0.6}])
def test_recorded_distinct_experts_equal_the_routing_reference(routing, routed):
    """The fused kernel's expert_hits (Triton, under the interpreter on CPU): moe_stats per layer equals the
    distinct experts moe_route_ref selects from the same router inputs, over a prefill of two rows and two
    decode-shaped forwards, under the model's own router and steered routing."""
    model = tiny_moe("triton", seed=2, routing=routing)
    model.reset_moe_stats_()
    prefill(model, rand_prompts(2, 6, seed=3))
    prefill(model, [[5], [9]])  # two rows of one token
    prefill(model, [[17]])
    stats = model.moe_stats()
    Lm = len(model.moe_slot)
    per = [[len(set(ids.flatten().tolist())) for ids in routed[j::Lm]] for j in range(Lm)]  # [layer][forward]
    assert stats["forwards"] == 3 and stats["tokens_per_forward"] == pytest.approx(15 / 3)
    assert stats["per_layer"] == pytest.approx([sum(p) / 3 for p in per])
    assert all(p[2] == K for p in per)  # one token: top-k distinct experts


def test_steered_routing_selects_the_planned_experts(routed):
    """Every token of every MoE layer is routed to exactly the layer's permutation of the forward's
    planned selection (the router's own logits cannot outvote the steering margin), and the routing of
    a token depends on its request, position and id only: the same tokens in another forward, beside
    other rows, route the same; siblings (another id at the same position) route apart."""
    model = tiny_moe(seed=1, routing={"kind": "zipf", "skew": 1.2, "reuse": 0.5, "seed": 3})
    steer = model.routing
    prompts = rand_prompts(3, 9, seed=4)
    prefill(model, prompts)
    sel = model._selection  # [L_moe, N, K] each layer's experts
    base = torch.argsort(steer.perm[0].long())[sel[0].long()]  # [N, K] planned base experts (layer 0's inverse)
    assert all(len(set(row.tolist())) == K for row in base)
    assert len(routed) == len(model.moe_slot)
    for j, ids in enumerate(routed):
        want = steer.perm[j].long()[base].sort(-1).values
        assert torch.equal(ids.sort(-1).values, want), j
        assert torch.equal(sel[j].long().sort(-1).values, want), j
    # the second row alone (its own pages again: the same request key) routes as beside the others
    routed.clear()
    prefill(model, [prompts[1]], first_page=4)  # rows' pages: 1-3, 4-6, 7-9 above
    assert torch.equal(model._selection, sel[:, 9:18])
    # siblings: the same request and position, another token id
    g = torch.Generator().manual_seed(0)
    sib = Selector(128, 8, 1.2, seed=3, keep=0.4)
    keys, pos = torch.randint(0, 10**6, (200,), generator=g), torch.randint(0, 4000, (200,), generator=g)
    tok = torch.randint(0, 10**5, (200,), generator=g)
    a, b = sib.ids(keys, pos, tok).sort(-1).values, sib.ids(keys, pos, tok + 1).sort(-1).values
    assert (a == b).all(-1).float().mean() < 0.05
    assert torch.equal(a, sib.ids(keys, pos, tok).sort(-1).values)  # deterministic


@pytest.mark.parametrize("reuse", [0.5, 0.8, None])
def test_reuse_between_consecutive_tokens_is_the_configured_one(reuse, routed):
    """reuse r, measured on the tiny model: the mean fraction of a token's experts that the request's previous
    token also selected, over 24 requests of 20 tokens in one forward, per MoE layer, is r within 0.06 (null:
    the chance overlap keep = 0 gives, which the build reports)."""
    model = tiny_moe(seed=5, routing={"kind": "zipf", "skew": 1.0, "reuse": reuse})
    R, T = 24, 20
    prefill(model, rand_prompts(R, T, seed=6))
    want = model.routing.reuse if reuse is None else reuse
    for ids in routed:
        assert consecutive_reuse(ids.view(R, T, K)) == pytest.approx(want, abs=0.06)
    info = model.routing.describe()
    assert info["label"] == f"zipf s=1 reuse {'chance' if reuse is None else f'{reuse:g}'}"
    assert info["chance_reuse"] < 0.45 and (reuse is None) == (info["keep"] == 0.0)


def test_uniform_routing_draws_every_token_independently(routed):
    """kind uniform: no working set (keep 0) and no popularity, so a request's T consecutive tokens in one forward
    read E (1 - (1 - K / E)^T) distinct experts per MoE layer (16 experts, top-4, T = 6: 13.15; mean over 32
    requests within 0.6) and consecutive tokens share K / E of their experts (within 0.06). At Qwen3-30B-A3B's
    128 experts, top-8, the selection gives a 17-token verify 85.3 (mean over 64 requests within 2)."""
    model = tiny_moe(seed=7, routing={"kind": "uniform"})
    info = model.routing.describe()
    assert info["label"] == "uniform" and info["kind"] == "uniform" and info["keep"] == 0.0 and info["skew"] == 0.0
    assert info["chance_reuse"] == pytest.approx(K / E, abs=0.03)
    R, T = 32, 6
    prefill(model, rand_prompts(R, T, seed=9))
    assert len(routed) == len(model.moe_slot)
    for ids in routed:
        per_request = ids.view(R, T * K)
        distinct = sum(len(set(row.tolist())) for row in per_request) / R
        assert distinct == pytest.approx(E * (1 - (1 - K / E) ** T), abs=0.6)
        assert consecutive_reuse(ids.view(R, T, K)) == pytest.approx(K / E, abs=0.06)
    # the Qwen3-30B-A3B shape's selection: 64 requests' 17-token trees at consecutive positions
    config = RoutingConfig.of({"kind": "uniform"})
    keep = solve_keep(128, 8, config.skew, config.reuse, config.seed)[0]
    assert keep == 0.0
    n = torch.arange(64 * 17)
    ids = Selector(128, 8, config.skew, config.seed, keep).ids(n // 17 + 10**6, n % 17 + 200, (n * 7919) % 100000)
    distinct = sum(len(set(row.tolist())) for row in ids.view(64, 17 * 8)) / 64
    assert distinct == pytest.approx(128 * (1 - (1 - 8 / 128) ** 17), abs=2.0)  # 85.3


def test_router_kind_leaves_the_model_untouched():
    """kind router (and no target.routing): no steering, the forward equals the unrouted model's, and metrics
    label a random-weight MoE target "random router"."""
    plain, routed_model = tiny_moe(seed=4), tiny_moe(seed=4, routing={"kind": "router"})
    assert routed_model.routing is None
    prompts = rand_prompts(3, 5, seed=2)
    assert torch.equal(prefill(plain, prompts).hidden, prefill(routed_model, prompts).hidden)
    for conf in ({"kind": "router"}, None):
        target = OmegaConf.create({"name": "tiny", "random_weights": True, "routing": conf})
        apply_routing_(routed_model, target)
        assert routed_model.routing is None
        assert routing_facts(target, routed_model) == {"routing": {"label": "random router", "kind": "router"}}


@pytest.mark.parametrize("skew", [0.0, 0.8, 1.2])
def test_popularity_is_zipf_like(skew):
    """Over many requests' tokens (E = 128, top-8, reuse 0.5), an expert's selection frequency against its
    popularity rank i falls as i^-skew: the log-log slope over ranks 16..128 (where sampling without
    replacement no longer saturates) is -skew within 0.15; uniform (skew 0) is flat."""
    keep = solve_keep(128, 8, skew, 0.5, 0)[0]
    sel = Selector(128, 8, skew, seed=0, keep=keep)
    N = 16000
    n = torch.arange(N)
    ids = sel.ids(n // 16 + 10**6, n % 16 + 300, (n * 7919) % 100000)
    freq = torch.bincount(ids.flatten(), minlength=128).float() / N
    x, y = torch.arange(16, 129).float().log(), freq[15:].log()
    slope = (((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()).item()
    assert slope == pytest.approx(-skew, abs=0.15)
    if skew == 0:
        assert freq.std() / freq.mean() < 0.15  # a request's tokens share its working set: ~1,000 draws per expert
    else:
        assert freq[0] > 4 * freq[-1]


def test_routing_config_and_refusals():
    assert RoutingConfig.of(None).kind == "router" and RoutingConfig.of(None).label() == "random router"
    assert RoutingConfig.of({"kind": "uniform", "skew": 0.0, "reuse": None}).label() == "uniform"
    assert RoutingConfig.of({"kind": "zipf", "skew": 1.2, "reuse": 0.5}).label() == "zipf s=1.2 reuse 0.5"
    for bad, match in [({"kind": "lognormal"}, "valid: router, uniform, zipf"), ({"skew": -1}, ">= 0"),
                       ({"kind": "zipf", "reuse": 1.5}, r"\[0, 1\]"), ({"spread": 1}, "unknown keys"),
                       ({"kind": "uniform", "skew": 1.2}, "kind=uniform with skew=1.2"),
                       ({"kind": "router", "reuse": 0.5}, "kind=router with reuse=0.5"),
                       ({"skew": 1.0, "reuse": 0.5}, "kind=router with skew=1.0, reuse=0.5")]:
        with pytest.raises(ConfigError, match=match):
            RoutingConfig.of(bad)
    with pytest.raises(ConfigError, match="below the chance overlap"):
        solve_keep(128, 8, 1.2, 0.1, 0)  # popular experts recur by chance more often than that
    zipf = {"kind": "zipf", "skew": 1.0, "reuse": 0.5}
    model = tiny_moe()
    for conf, kw, match in [({"name": "real", "random_weights": False, "routing": zipf}, {}, "kind to router"),
                            ({"name": "real", "random_weights": False, "routing": {"kind": "uniform"}}, {},
                             "real weights"),
                            ({"name": "r", "random_weights": True, "routing": zipf}, {"tp_size": 2}, "tp.size=2"),
                            ({"name": "r", "random_weights": True, "routing": zipf}, {"exact": True},
                             "engine.exact=true.*KV is placed"),
                            ({"name": "r", "random_weights": True, "routing": {"kind": "uniform"}}, {"exact": True},
                             "kind=uniform with engine.exact")]:
        with pytest.raises(ConfigError, match=match):
            apply_routing_(model, OmegaConf.create(conf), **kw)
    apply_routing_(model, OmegaConf.create({"name": "real", "routing": {"kind": "router"}}))  # router: fine
    assert model.routing is None
    dense = TransformerModel.random(ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=16), dtype="float32")
    with pytest.raises(ConfigError, match="no MoE layers"):
        apply_routing_(dense, OmegaConf.create({"name": "d", "random_weights": True, "routing": zipf}))


# -- goodput on an MoE cost model ----------------------------------------------------------------------
# A decode step of B rows of T tokens each (T = k + 1 at a chain of k) costs a fixed A ms (launch-bound
# layers, attention and dense weights), the bytes of the distinct experts its tokens select (X ms for all E
# of them), and c ms of compute per token. A row's T tokens share experts (each token after the first
# brings (1 - reuse) K new ones); the B rows are independent requests. So speculation multiplies the expert
# bytes at small B; from the middle batches on the plain step already reads most experts and the
# speculative one all of them; at large B every expert is read either way and only compute grows.
MOE = dict(E=128, K=8, reuse=0.7, A=3.0, X=6.0, c=0.001)


def moe_step_ms(B, T, E, K, reuse, A, X, c):
    row = K + (T - 1) * K * (1 - reuse)  # distinct experts of one row's T tokens
    distinct = E * (1 - (1 - row / E) ** B)  # ... of B independent rows
    return A + X * distinct / E + c * B * T


BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def moe_table(ks):
    return {k: {b: moe_step_ms(b, k + 1, **MOE) for b in BUCKETS} for k in (0, *ks)}  # k drafts: k + 1 tokens a row


def test_moe_cost_model_is_non_monotonic():
    """The table the goodput test prices: a 3-token chain's step costs few plain steps at B = 1 and from B = 32 on,
    most from B = 4 to 16."""
    ratio = {b: moe_step_ms(b, 4, **MOE) / moe_step_ms(b, 1, **MOE) for b in BUCKETS}
    assert ratio[16] > 1.19 and ratio[1] < 1.11 and ratio[256] < 1.09
    assert max(ratio, key=ratio.get) in (8, 16, 32)


@pytest.mark.parametrize("a3,want", [(1.15, {1: 3, 8: 0, 12: 0, 16: 0, 64: 3, 200: 3, 256: 3}),
                                     (1.05, {1: 0, 16: 0, 256: 0}),
                                     (1.30, {1: 3, 16: 3, 256: 3})])
def test_goodput_prices_the_moe_step_costs(a3, want):
    """goodput with the MoE cost model's start-up table and a(3) = a3 tokens per row: k = 3 where a3 exceeds the
    step's cost in plain steps (1.10 at B = 1, 1.26 at 8, 1.20 at 16, 1.03 at 64, 1.08 at 256), k = 0 where it does
    not: on at B = 1, off from 8 to 16, on again from 64 when a3 lies between (1.15); off at B = 1, 16 and 256 at
    1.05; on everywhere at 1.30. tree16 (a(16) = 1.2) never beats the chain at these batches. A batch between
    buckets takes the bucket above."""
    pol = Goodput([3, 16], margin=0.0, probe_requests=0, explore_every=0, time_ema=0.0, counterfactual=False,
                  shadow_evals=0)
    pol.set_table(moe_table([3, 16]))
    n3 = 200
    hi = round((a3 - 1) * n3)
    pol.update(StepStats(k=3, num_decode=n3, committed=[2] * hi + [1] * (n3 - hi)))
    pol.update(StepStats(k=16, num_decode=100, committed=[2] * 20 + [1] * 80))
    assert pol.accept[3] == pytest.approx(a3) and pol.accept[16] == pytest.approx(1.2)
    for batch, k in want.items():
        assert pol.choose(BatchView(num_decode=batch, num_waiting=0)) == k, (batch, list(pol.switch_log)[-1:])


def test_goodput_table_covers_every_bucket_of_a_routed_moe_engine():
    """An engine serving a tiny MoE target under zipf routing with EAGLE-3 trees and goodput: the start-up table
    holds a graphed-step time for every k at every power-of-two bucket up to max_batch_size (the default
    buckets), the served step times land in their buckets, and every request finishes."""
    from test_spec import tiny_head

    from specdec.engine.engine import Engine, EngineConfig
    from specdec.spec import Eagle3Drafter

    model = tiny_moe(seed=3, routing={"kind": "zipf", "skew": 1.0, "reuse": 0.5}, layers=3)
    drafter = Eagle3Drafter(tiny_head(model, layers=(0, 1, 2)), model, trees=[(1, 3, 3), (2, 3, 5)])
    pol = Goodput(sorted(drafter.trees), profile_context=16, probe_requests=0)
    engine = Engine(model, EngineConfig(max_batch_size=8, page_size=4, kv_cache_tokens=2048), drafter=drafter,
                    policy=pol)
    reqs = [engine.add_request(p, 6) for p in rand_prompts(6, 7, seed=8)]
    engine.run_until_done()
    engine.check()
    assert all(len(r.output_ids) == 6 for r in reqs)
    assert engine.buckets == [1, 2, 4, 8]
    ks = (0, *sorted(drafter.trees))
    assert {k: [b for b, _ in rows] for k, rows in pol.table.items()} == {k: [1, 2, 4, 8] for k in ks}
    assert pol.observed and all(b in (1, 2, 4, 8) for _, b in pol.observed)
    assert math.isfinite(model.moe_stats()["distinct_experts_per_layer"])
