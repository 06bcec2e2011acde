"""Rank functions for the tensor-parallel tests (spawned processes import them from here).

Each takes (group, ...) as specdec.dist.launch.launch calls it and returns plain data (rank 0's result
comes back to the test). The models are the tests' tiny random models (Llama, or another family's blocks),
built identically on every rank from their seed, so TP1 (the full model, computed on rank 0) and the shards
can be compared.
"""

from __future__ import annotations

import torch

from specdec.engine.engine import Engine, EngineConfig
from specdec.models.families import ModelConfig
from specdec.models.transformer import TransformerModel

VOCAB = 96


# The blocks of each family at tiny sizes: Qwen2's q/k/v bias, Qwen3's q/k norms, Qwen3-MoE's MoE layer
# (layer 1 of 2: one dense, one MoE; 4 experts of 32, top-2).
FAMILY_FIELDS = {"llama": {}, "qwen2": dict(qkv_bias=True), "qwen3": dict(qk_norm=True),
                 "qwen3_moe": dict(qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=True, moe_layers=(1,))}


def tiny_llama(heads=4, kv_heads=2, layers=2, ffn=96, vocab=VOCAB, head_dim=16, seed=0, tied=True, family="llama"):
    """A tiny random model of ``family``'s blocks with peaked logits (std 1/sqrt(fan_in) weights): greedy
    ties cannot flip between the sharded and the single-device sums."""
    cfg = ModelConfig(hidden_size=64, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=vocab, head_dim=head_dim, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=tied, model_type=family, **FAMILY_FIELDS[family])
    model = TransformerModel.random(cfg, dtype="float32", seed=seed, backend="torch")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in ("embed", "lm_head"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.init_rope()


def prompts(n, seed=0, lo=3, hi=12, vocab=VOCAB, repeat=False):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
        out.append((p * 4)[: len(p) * 2 + i] if repeat else p)
    return out


def forward_logits(model, ids, page_size=4):
    """Logits of one prompt's prefill forward (fresh KV pool): [T, V]."""
    from specdec.models.ops import AttentionMeta

    T = len(ids)
    k, v = model.new_kv_cache(-(-T // page_size), page_size)
    meta = AttentionMeta(cu_q_lens=torch.tensor([0, T], dtype=torch.int32), kv_lens=torch.tensor([T], dtype=torch.int32),
                         page_table=torch.arange(-(-T // page_size), dtype=torch.int32)[None],
                         slot_mapping=torch.arange(T, dtype=torch.int64), max_q_len=T)
    ids_t = torch.tensor(ids)
    out = model(ids_t, torch.arange(T), meta, k, v, capture_layers=(0, 1))
    return model.logits(out.hidden), out.captured


def logits_rank(group, shape: dict, ids: list[int]):
    """TP logits and captured features vs the full model's (each rank checks its own copy)."""
    from specdec.models.tp import TPLlamaModel

    full = tiny_llama(**shape)
    want, want_cap = forward_logits(full, ids)
    got, got_cap = forward_logits(TPLlamaModel(full, group), ids)
    return {"rank": group.rank, "max_diff": (got - want).abs().max().item(),
            "cap_diff": (got_cap - want_cap).abs().max().item(), "argmax_same": bool((got.argmax(-1) == want.argmax(-1)).all()),
            "shape": tuple(got.shape)}


def _drafter(kind, model, seed=0):
    from specdec.spec import Eagle3Drafter, NgramDrafter

    if kind == "ngram":
        return NgramDrafter(), (4,)
    if kind == "eagle3":
        from specdec.models.eagle3 import Eagle3Config, Eagle3Head

        cfg = Eagle3Config.for_target(model.config, VOCAB, target_layers=(0, 1, 1))
        head = Eagle3Head(cfg, backend=model.backend).init_weights_(seed)
        head.set_vocab_(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[: cfg.draft_vocab_size])
        return Eagle3Drafter(head.to_device(model.device, torch.float32), model, topk=2, steps=3, num_draft_tokens=6), (6,)
    return None, (0,)


def serve(model, reqs, *, drafter_kind=None, k_cycle=(0,), kv_tokens=2048, page_size=4, max_batch=8,
          aborts=(), tp_group=None, temperature=0.0):
    """Serve (prompt, max_new) requests through an Engine (LeaderEngine on rank 0 under TP); returns
    the output ids, the finish reasons and the number of preemptions. ``k_cycle``: the k of step i is
    k_cycle[i % len]; ``aborts``: (step, request index)."""
    from specdec.dist.plan import LeaderEngine

    drafter, ks = _drafter(drafter_kind, model)
    engine = Engine(model, EngineConfig(max_batch_size=max_batch, page_size=page_size, kv_cache_tokens=kv_tokens,
                                        temperature=temperature, seed=3),
                    drafter=drafter, ks=ks, trace=(trace := []).append)
    if tp_group is not None:
        engine = LeaderEngine(engine, tp_group)
    handles = [engine.add_request(p, n) for p, n in reqs]
    step = 0
    aborts = dict(aborts)
    while engine.has_work():
        if step in aborts:
            engine.abort(handles[aborts[step]].id)
        engine.step(k_cycle[step % len(k_cycle)])
        step += 1
    engine.flush_trace()
    if tp_group is not None:
        engine.close()
    return {"out": [h.output_ids for h in handles], "reasons": [h.finish_reason for h in handles],
            "preempted": sum(r["preempted"] for r in trace), "steps": step}


def serve_rank(group, shape: dict, reqs, kwargs: dict):
    """Rank 0 serves through a LeaderEngine; the others follow its plans with their own engines."""
    from specdec.dist.plan import follow
    from specdec.models.tp import TPLlamaModel

    model = TPLlamaModel(tiny_llama(**shape), group)
    if group.is_leader:
        return serve(model, reqs, tp_group=group, **kwargs)
    kw = dict(kwargs)
    drafter, ks = _drafter(kw.get("drafter_kind"), model)
    engine = Engine(model, EngineConfig(max_batch_size=kw.get("max_batch", 8), page_size=kw.get("page_size", 4),
                                        kv_cache_tokens=kw.get("kv_tokens", 2048),
                                        temperature=kw.get("temperature", 0.0), seed=3),
                    drafter=drafter, ks=ks)
    follow(engine, group)
    return None


def serve_many_rank(group, shape: dict, reqs, scenarios):
    """serve_rank over several scenarios in one launch (one engine each, in turn)."""
    return [serve_rank(group, shape, reqs, kw) for kw in scenarios]


def desync_rank(group, shape: dict):
    """Rank 0 serves with a 2048-slot pool, the follower builds a 1024-slot one: out of step."""
    reqs = [(p, 4) for p in prompts(2)]
    if group.is_leader:
        return serve_rank(group, shape, reqs, {})
    return serve_rank(group, shape, reqs, {"kv_tokens": 1024})
