"""EAGLE-3 checkpoints: official key layout round trip, pytorch_model.bin, clear rejections."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import tiny_model

from specdec.models.eagle3 import ARCH, Eagle3Config, Eagle3Head
from specdec.models.loading import CheckpointError

OFFICIAL_KEYS = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.fixture(scope="module")
def target():
    return tiny_model(layers=2)


def make_head(target, draft_vocab=40, seed=0):
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab, target_layers=(0, 1, 1)),
                      backend="torch").init_weights_(seed)
    head.set_vocab_(torch.arange(0, 2 * draft_vocab, 2))  # every other target id
    return head.to_device("cpu", torch.float32)


def test_round_trip_official_layout(target, tmp_path):
    head = make_head(target)
    head.save(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert set(sd) == OFFICIAL_KEYS
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [ARCH] and cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 40
    back = Eagle3Head.load(tmp_path, target=target.config, backend="torch")
    for k in head.shapes:
        assert torch.equal(back.w(k), head.w(k)), k
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)
    # d2t maps draft ids to target ids: target = draft + d2t[draft]
    assert back.to_target_ids(torch.arange(40)).tolist() == list(range(0, 80, 2))
    assert back.t2d.sum() == 40 and back.t2d[2] and not back.t2d[1]


def test_pytorch_model_bin_loads(target, tmp_path):
    head = make_head(target, seed=1)
    head.save(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    back = Eagle3Head.load(tmp_path, target=target.config, backend="torch")
    assert torch.equal(back.w("fc.weight"), head.w("fc.weight"))


def test_missing_key_is_rejected(target, tmp_path):
    make_head(target).save(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["midlayer.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys \['midlayer.mlp.up_proj.weight'\]"):
        Eagle3Head.load(tmp_path, target=target.config)


def test_mismatched_hidden_size_is_rejected(target, tmp_path):
    make_head(target).save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="hidden size 128 does not match the target's 64"):
        Eagle3Head.load(tmp_path, target=target.config)


def test_architecture_by_keys_and_missing_dir(target, tmp_path):
    """The EAGLE repository's own training configs say LlamaForCausalLM: the keys decide. A target
    Llama directory (no EAGLE-3 keys) is refused by name."""
    with pytest.raises(CheckpointError, match="has no config.json"):
        Eagle3Head.load(tmp_path / "nope", target=target.config)
    head = make_head(target)
    head.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = Eagle3Head.load(tmp_path, target=target.config, backend="torch")
    assert torch.equal(back.w("fc.weight"), head.w("fc.weight"))
    llama = tmp_path / "llama"
    llama.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(128, 64)}, str(llama / "model.safetensors"))
    (llama / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match="lack the EAGLE-3 keys .*not an EAGLE-3 head"):
        Eagle3Head.load(llama, target=target.config)


def test_corrupt_weights_file_is_rejected(target, tmp_path):
    make_head(target).save(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        Eagle3Head.load(tmp_path, target=target.config)


def test_inference_forward_matches_training_form_and_tracks_weight_updates(target):
    """Eagle3Head.forward (paged KV, fused q|k|v and gate|up) equals the TTT training form of the
    layer on a causal block, also after a weight changes in place (the fused copy is rebuilt)."""
    from specdec.models.ops import AttentionMeta
    from specdec.training.ttt import draft_layer, draft_logits

    head = make_head(target, seed=3)
    H, T, PS = head.config.hidden_size, 7, 4
    gen = torch.Generator().manual_seed(1)
    emb, hidden = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    pos = torch.arange(T)
    meta = AttentionMeta(cu_q_lens=torch.tensor([0, T], dtype=torch.int32), kv_lens=torch.tensor([T], dtype=torch.int32),
                         page_table=torch.tensor([[2, 0, 1]], dtype=torch.int32),
                         slot_mapping=torch.tensor([2 * PS + i if i < PS else (i - PS) for i in range(T)]), max_q_len=T)
    for _ in range(2):
        kc, vc = head.new_kv_cache(3, PS)
        out, logits = head(emb, hidden, pos, meta, kc, vc)
        want = draft_layer(head, emb[None], hidden[None], pos, [], [])[0]
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits, draft_logits(head, want), atol=1e-4, rtol=1e-4)
        with torch.no_grad():  # an optimizer-style in-place update of fused source weights
            head.w("midlayer.self_attn.k_proj.weight").mul_(1.5)
            head.w("midlayer.mlp.up_proj.weight").add_(0.01)


def test_to_target_ids_follow_vocab_changes(target):
    head = make_head(target)  # every other target id
    ids = torch.tensor([0, 3, 39])
    assert head.to_target_ids(ids).tolist() == [0, 6, 78]
    head.set_vocab_(torch.arange(40) + 1)  # in place: the cached table must be rebuilt
    assert head.to_target_ids(ids).tolist() == [1, 4, 40]


# ------------------------------------------------------------------------------------------------
# Heads as published and as other engines write them
# ------------------------------------------------------------------------------------------------

def official_rules_load(path, head_dim_from_config=False):
    """Build and load a head the way the official EAGLE code does (SafeAILab/EAGLE cnets.py /
    ea_model.py, read 2026-12-01), independently of specdec: ONE weight file (pytorch_model.bin, else
    model.safetensors; an index is not read); fc = Linear(3 * target_hidden_size -> H) when the
    config has that key (None would break it), else 3H -> H; head_dim = hidden // heads; rope_theta
    10000 and rms_norm_eps 1e-6 (LlamaConfig's default) when absent; load_state_dict(strict=False);
    when draft and target vocabularies are equal, d2t / t2d are dropped (identity). Returns (config,
    weights) where weights holds every parameter the official module has, shaped as it builds them.
    ``head_dim_from_config``: the SpecForge / SGLang rule instead (head_dim from config.json when present: a
    Qwen3-30B-A3B head is 32 heads of 128 over hidden 2048)."""
    from transformers import LlamaConfig as HFLlamaConfig

    path = Path(path)
    files = [path / n for n in ("pytorch_model.bin", "model.safetensors") if (path / n).is_file()]
    assert files, f"{path}: the official loader reads pytorch_model.bin or model.safetensors"
    sd = torch.load(files[0]) if files[0].suffix == ".bin" else load_file(str(files[0]))
    cfg = json.loads((path / "config.json").read_text())
    hf = HFLlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    D = cfg.get("head_dim") or H // heads if head_dim_from_config else H // heads
    TH = cfg["target_hidden_size"] if "target_hidden_size" in cfg else H
    F, V, Vd = cfg["intermediate_size"], cfg["vocab_size"], cfg.get("draft_vocab_size", cfg["vocab_size"])
    shapes = {"fc.weight": (H, 3 * TH), "embed_tokens.weight": (V, H), "norm.weight": (H,),
              "lm_head.weight": (Vd, H), "midlayer.hidden_norm.weight": (H,),
              "midlayer.input_layernorm.weight": (H,), "midlayer.post_attention_layernorm.weight": (H,),
              "midlayer.self_attn.q_proj.weight": (heads * D, 2 * H),
              "midlayer.self_attn.k_proj.weight": (kv * D, 2 * H),
              "midlayer.self_attn.v_proj.weight": (kv * D, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, heads * D),
              "midlayer.mlp.gate_proj.weight": (F, H), "midlayer.mlp.up_proj.weight": (F, H),
              "midlayer.mlp.down_proj.weight": (H, F), "d2t": (Vd,), "t2d": (V,)}
    unexpected = set(sd) - set(shapes)
    assert not unexpected, f"keys the official module does not have: {unexpected}"
    for k, t in sd.items():  # load_state_dict raises on a shape mismatch even with strict=False
        assert tuple(t.shape) == shapes[k], (k, tuple(t.shape), shapes[k])
    own_emb = "target_hidden_size" in cfg  # else the target's embedding is loaded (then the file's, if any)
    w = {k: sd[k].float() for k in shapes if k in sd and k not in ("d2t", "t2d")}
    missing = set(shapes) - set(sd) - {"d2t", "t2d"} - ({"embed_tokens.weight"} if not own_emb else set())
    assert not missing, f"parameters the official module would leave random: {missing}"
    if Vd == V:
        d2t = torch.zeros(V, dtype=torch.long)
    else:
        d2t = sd["d2t"].long()
    conf = dict(H=H, heads=heads, kv=kv, D=D, eps=hf.rms_norm_eps,
                theta=cfg.get("rope_theta", 10000.0), d2t=d2t, own_emb="embed_tokens.weight" in sd)
    return conf, w


def official_forward(conf, w, emb, feat):
    """The official EAGLE-3 layer on one causal block: emb [T, H] token embeddings, feat [T, 3TH]
    target features -> (pre-norm hidden [T, H], target ids of the argmax draft token [T])."""
    def rms(x, g):
        return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + conf["eps"]))

    T, H, D, nq, nkv = emb.shape[0], conf["H"], conf["D"], conf["heads"], conf["kv"]
    h = feat @ w["fc.weight"].t()
    residual = h
    x = torch.cat([rms(emb, w["midlayer.input_layernorm.weight"]), rms(h, w["midlayer.hidden_norm.weight"])], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].t()).view(T, nq, D).transpose(0, 1)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].t()).view(T, nkv, D).transpose(0, 1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].t()).view(T, nkv, D).transpose(0, 1)
    inv = 1.0 / conf["theta"] ** (torch.arange(0, D, 2).float() / D)
    ang = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rot(t):
        return t * cos + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(nq // nkv, 0), v.repeat_interleave(nq // nkv, 0)
    att = (q @ k.transpose(1, 2)) / D ** 0.5
    att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    o = (att @ v).transpose(0, 1).reshape(T, nq * D)
    h = residual + o @ w["midlayer.self_attn.o_proj.weight"].t()
    m = rms(h, w["midlayer.post_attention_layernorm.weight"])
    h = h + (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].t())
             * (m @ w["midlayer.mlp.up_proj.weight"].t())) @ w["midlayer.mlp.down_proj.weight"].t()
    draft = (rms(h, w["norm.weight"]) @ w["lm_head.weight"].t()).argmax(-1)
    return h, draft + conf["d2t"][draft]


def specdec_block(head, emb, feat):
    """specdec's paged inference forward over the same causal block (positions 0..T-1)."""
    from specdec.models.ops import AttentionMeta

    T, PS = emb.shape[0], 4
    pages = -(-T // PS)
    meta = AttentionMeta(cu_q_lens=torch.tensor([0, T], dtype=torch.int32), kv_lens=torch.tensor([T], dtype=torch.int32),
                         page_table=torch.arange(pages, dtype=torch.int32)[None], slot_mapping=torch.arange(T),
                         max_q_len=T)
    kc, vc = head.new_kv_cache(pages, PS)
    h, logits = head(emb, head.fuse(feat), torch.arange(T), meta, kc, vc)
    return h, head.to_target_ids(logits.argmax(-1))


def narrow_head(target, seed=0):
    """A head narrower than its target (H 32 vs 64): target_hidden_size 64, its own embedding."""
    c = target.config
    cfg = Eagle3Config(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=c.max_position_embeddings,
                       target_layers=(0, 1, 1), target_hidden_size=c.hidden_size, own_embedding=True)
    return Eagle3Head(cfg, backend="torch").init_weights_(seed).to_device("cpu", torch.float32)


@pytest.mark.parametrize("kind", ["trained", "narrow"])
def test_written_head_loads_under_official_rules_with_the_same_function(target, tmp_path, kind):
    from specdec.train import save_checkpoint

    head = make_head(target, seed=4) if kind == "trained" else narrow_head(target, seed=4)
    names = save_checkpoint(head, tmp_path, "# card\n", dtype="float32")
    assert names == ["model.safetensors"] and not (tmp_path / "model.safetensors.index.json").exists()
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert None not in cfg.values()
    assert ("target_hidden_size" in cfg) == (kind == "narrow")  # only when it differs from hidden_size
    conf, w = official_rules_load(tmp_path)
    ours = Eagle3Head.load(tmp_path, target=target.config, backend="torch")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (9,), generator=gen)
    feat = torch.randn(9, 3 * target.config.hidden_size, generator=gen)
    emb_official = w["embed_tokens.weight"][tokens] if conf["own_emb"] else target.embed_tokens(tokens)
    want_h, want_ids = official_forward(conf, w, emb_official, feat)
    got_h, got_ids = specdec_block(ours, ours.embed(tokens, target), feat)
    torch.testing.assert_close(got_h, want_h, atol=1e-4, rtol=1e-4)
    assert torch.equal(got_ids, want_ids)


def test_committed_head_follows_the_official_rules():
    root = Path(__file__).resolve().parents[1] / "checkpoints" / "eagle3-smollm2-135m"
    assert sorted(p.name for p in root.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    cfg = json.loads((root / "config.json").read_text())
    assert "target_hidden_size" not in cfg and None not in cfg.values()
    conf, w = official_rules_load(root)
    assert w["fc.weight"].shape == (576, 3 * 576) and conf["D"] == 64 and conf["eps"] == cfg["rms_norm_eps"]
    assert "one `model.safetensors`" in (root / "README.md").read_text()


def test_rewrite_checkpoint_joins_shards_and_drops_nulls(target, tmp_path):
    from specdec.models.loading import load_safetensors
    from specdec.train import rewrite_checkpoint, save_checkpoint

    head = make_head(target, seed=2)
    save_checkpoint(head, tmp_path, "# card\nweights in bfloat16 in `model.safetensors` or shards of at most 0.03 MiB.\n",
                    dtype="bfloat16", shard_mb=0.03)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "target_hidden_size": None, "rope_scaling": None}))
    before = load_safetensors(tmp_path)
    assert rewrite_checkpoint(tmp_path) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    after = load_file(str(tmp_path / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert after["fc.weight"].dtype == torch.bfloat16
    new_cfg = json.loads((tmp_path / "config.json").read_text())
    assert "target_hidden_size" not in new_cfg and "rope_scaling" not in new_cfg
    official_rules_load(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "in one `model.safetensors` (shards of at most 0.03 MiB joined by" in card and "or shards" not in card


def test_full_vocabulary_without_d2t_is_the_identity(target, tmp_path):
    head = Eagle3Head(Eagle3Config.for_target(target.config, 128, target_layers=(0, 1, 1)),
                      backend="torch").init_weights_(0)
    head.save(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["d2t"], sd["t2d"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    back = Eagle3Head.load(tmp_path, target=target.config, backend="torch")
    assert back.to_target_ids(torch.arange(128)).tolist() == list(range(128)) and bool(back.t2d.all())


def test_d2t_required_for_a_smaller_vocabulary_and_t2d_derived(target, tmp_path):
    head = make_head(target, draft_vocab=40)
    head.save(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["t2d"]  # vLLM skips it; it follows from d2t
    save_file(sd, str(tmp_path / "model.safetensors"))
    back = Eagle3Head.load(tmp_path, target=target.config, backend="torch")
    assert torch.equal(back.t2d, head.t2d)
    del sd["d2t"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys \['d2t'\]"):
        Eagle3Head.load(tmp_path, target=target.config)


def test_missing_fields_take_the_official_defaults(target, tmp_path):
    from transformers import LlamaConfig as HFLlamaConfig

    make_head(target).save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for k in ("rms_norm_eps", "rope_theta", "head_dim", "max_position_embeddings"):
        cfg.pop(k)
    cfg["target_hidden_size"] = None  # older specdec heads: null reads as absent
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = Eagle3Head.load(tmp_path, target=target.config, backend="torch").config
    assert c.rms_norm_eps == HFLlamaConfig().rms_norm_eps == 1e-6
    assert c.rope_theta == HFLlamaConfig().rope_parameters["rope_theta"] == 10000.0
    assert c.head_dim == 64 // 4 and c.target_hidden_size is None


@pytest.mark.parametrize("flag,value", [("fc_norm", True), ("norm_output", True), ("norm_before_residual", True),
                                        ("norm_before_fc", True), ("attention_bias", True), ("mlp_bias", True),
                                        ("hidden_act", "gelu")])
def test_flags_that_change_the_function_are_refused_by_name(target, tmp_path, flag, value):
    make_head(target).save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, flag: not value if value is True else "silu"}))
    Eagle3Head.load(tmp_path, target=target.config)  # the default value is fine
    (tmp_path / "config.json").write_text(json.dumps({**cfg, flag: value}))
    with pytest.raises(CheckpointError, match=f"{flag}={value!r} changes the head's function and is not implemented"):
        Eagle3Head.load(tmp_path, target=target.config)


def test_narrow_head_without_its_embedding_is_refused(target, tmp_path):
    narrow_head(target).save(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["embed_tokens.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="hidden_size 32 differs from the target's 64 and the checkpoint "
                                              "has no embed_tokens.weight"):
        Eagle3Head.load(tmp_path, target=target.config)


def test_narrow_head_drafts_in_the_engine_greedy_identical(target, tmp_path):
    from test_engine import rand_prompts, reference

    from specdec.engine.engine import Engine, EngineConfig
    from specdec.spec import Eagle3Drafter

    narrow_head(target, seed=1).save(tmp_path)
    head = Eagle3Head.load(tmp_path, target=target.config, backend="torch")
    assert head.w("fc.weight").shape == (32, 3 * 64) and head.config.own_embedding
    prompts = rand_prompts([9, 14], seed=3)
    engine = Engine(target, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=512),
                    drafter=Eagle3Drafter(head, target, topk=2, steps=2, num_draft_tokens=4), ks=(4,))
    reqs = [engine.add_request(p, 10) for p in prompts]
    while engine.has_work():
        engine.step(4)
    assert [r.output_ids for r in reqs] == [reference(target, p, 10) for p in prompts]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_request_past_the_heads_max_position_embeddings(tmp_path, backend):
    """A head whose config says max_position_embeddings 32 drafts a request that grows past 32
    positions exactly as the same weights with a 4096-position config do (its RoPE reaches the
    target's limit, not the head's), and greedy output stays the target's. Triton: the kernels under
    the interpreter on CPU, against the torch run of the 4096-position head."""
    from test_engine import rand_prompts, reference, tiny_model

    from specdec.engine.engine import Engine, EngineConfig
    from specdec.spec import Eagle3Drafter

    def run(model, cfg, name, prompt, max_new):
        Eagle3Head(cfg, backend="torch").init_weights_(7).save(tmp_path / name)
        head = Eagle3Head.load(tmp_path / name, target=model.config, backend=model.backend)
        trace = []
        engine = Engine(model, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=256),
                        drafter=Eagle3Drafter(head, model, topk=2, steps=2, num_draft_tokens=3), ks=(3,),
                        trace=trace.append)
        req = engine.add_request(prompt, max_new)
        while engine.has_work():
            engine.step(3)
        engine.flush_trace()
        # The draft K pool: the one request's pages (the same in both runs), committed and scratch slots.
        return req.output_ids, [a for rec in trace for a in rec["accepted"]], engine.drafter.k_cache[0].clone()

    torch_model = tiny_model(layers=2)
    small = Eagle3Config.for_target(torch_model.config, 128, target_layers=(0, 1, 1))
    small.max_position_embeddings = 32
    big = dataclasses.replace(small, max_position_embeddings=4096)
    prompt, max_new = (rand_prompts([27], seed=9)[0], 12) if backend == "torch" else (rand_prompts([31], seed=9)[0], 5)
    want = run(torch_model, big, "big", prompt, max_new)
    assert want[0] == reference(torch_model, prompt, max_new)
    model = torch_model if backend == "torch" else tiny_model(layers=2, backend="triton")
    got = run(model, small, "small", prompt, max_new)
    assert len(prompt) + len(got[0]) > 32 + 2  # drafted past the head's 32 positions
    assert got[:2] == want[:2]  # outputs and accepted lengths
    # Draft keys carry RoPE: past position 32 they differ unless the tables reach that far.
    torch.testing.assert_close(got[2], want[2], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# Heads for Qwen3 / Qwen3-MoE targets in the SpecForge layout
# ------------------------------------------------------------------------------------------------

def specforge_head_dir(path, target, *, hidden=48, draft_vocab=40, layers=(0, 1, 1), seed=0, own_embedding=True):
    """A head as SpecForge writes one for a Qwen3-family target, from random weights, without specdec's
    writer: config.json with ``eagle_config.eagle_aux_hidden_state_layer_ids``, ``target_hidden_size`` (the
    target's width, here != the head's ``hidden_size``), explicit ``head_dim`` (4 x 16 = 64 != 48, as a
    Qwen3-30B-A3B head is 32 x 128 over 2048), rope_theta 1e6 and eps 1e-6 as Qwen3's; the head's own
    ``embed_tokens.weight``; a draft vocabulary (d2t / t2d) of ``draft_vocab`` ids."""
    c = target.config
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "attention_bias": False,
           "hidden_act": "silu", "hidden_size": hidden, "intermediate_size": 80, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False,
           "torch_dtype": "float32", "vocab_size": c.vocab_size, "draft_vocab_size": draft_vocab,
           "target_hidden_size": c.hidden_size, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}
    H, TH, D, F = hidden, c.hidden_size, 16, 80
    gen = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (H, 3 * TH), "midlayer.hidden_norm.weight": (H,), "midlayer.input_layernorm.weight": (H,),
              "midlayer.post_attention_layernorm.weight": (H,), "midlayer.self_attn.q_proj.weight": (4 * D, 2 * H),
              "midlayer.self_attn.k_proj.weight": (2 * D, 2 * H), "midlayer.self_attn.v_proj.weight": (2 * D, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, 4 * D), "midlayer.mlp.gate_proj.weight": (F, H),
              "midlayer.mlp.up_proj.weight": (F, H), "midlayer.mlp.down_proj.weight": (H, F), "norm.weight": (H,),
              "lm_head.weight": (draft_vocab, H)}
    if own_embedding:
        shapes["embed_tokens.weight"] = (c.vocab_size, H)
    sd = {k: (1 + 0.1 * torch.randn(s, generator=gen)) if k.endswith("norm.weight")
          else torch.randn(s, generator=gen) / s[-1] ** 0.5 for k, s in shapes.items()}
    ids = torch.randperm(c.vocab_size, generator=gen)[:draft_vocab].sort().values
    sd["d2t"] = ids - torch.arange(draft_vocab)
    sd["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool)
    sd["t2d"][ids] = True
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_specforge_head_for_a_qwen3_target_loads_unchanged_and_drafts(family, tmp_path):
    """A SpecForge-layout head for a Qwen3 / Qwen3-MoE target (narrower than the target, its own embedding,
    explicit head_dim, a 40-id draft vocabulary, capture layers in eagle_config) loads as written, computes
    the function the SpecForge / SGLang rules give it, and drafts in the engine with greedy output equal to
    plain decoding."""
    from test_engine import rand_prompts, reference
    from test_families import family_model

    from specdec.engine.engine import Engine, EngineConfig
    from specdec.spec import Eagle3Drafter

    model = family_model(family, seed=2)
    L = model.config.num_hidden_layers
    layers = (0, L // 2, L - 1)
    specforge_head_dir(tmp_path, model, layers=layers, seed=3)
    head = Eagle3Head.load(tmp_path, target=model.config, backend="torch")
    c = head.config
    assert (c.hidden_size, c.target_hidden_size, c.head_dim, c.draft_vocab_size) == (48, 64, 16, 40)
    assert c.own_embedding and c.target_layers == layers and c.rope_theta == 1e6 and c.rms_norm_eps == 1e-6
    assert head.w("fc.weight").shape == (48, 3 * 64)
    conf, w = official_rules_load(tmp_path, head_dim_from_config=True)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (9,), generator=gen)
    feat = torch.randn(9, 3 * 64, generator=gen)
    want_h, want_ids = official_forward(conf, w, w["embed_tokens.weight"][tokens], feat)
    got_h, got_ids = specdec_block(head, head.embed(tokens, model), feat)
    torch.testing.assert_close(got_h, want_h, atol=1e-4, rtol=1e-4)
    assert torch.equal(got_ids, want_ids)
    prompts = rand_prompts([9, 14, 5], seed=4)
    engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=64),
                    drafter=Eagle3Drafter(head, model, topk=2, steps=3, num_draft_tokens=5), ks=(5,))
    reqs = [engine.add_request(p, 10) for p in prompts]
    step = 0
    while engine.has_work():
        engine.step(5 if step % 3 else 0)  # k switching: the draft catches up after the k = 0 steps
        step += 1
    assert engine.scheduler.num_preemptions > 0
    assert [r.output_ids for r in reqs] == [reference(model, p, 10) for p in prompts]


def test_specforge_head_drafts_through_the_fused_kernels(tmp_path):
    """The same head layout on the Triton backend (interpreter on CPU): the draft rounds and extends that
    read the head's own embedding rows and the target's 3 x 64-wide features inside the fused kernels give
    the drafts of the torch backend."""
    from test_engine import rand_prompts
    from test_families import family_model

    from specdec.engine.engine import Engine, EngineConfig
    from specdec.spec import Eagle3Drafter

    outs = []
    for be in ("torch", "triton"):
        model = family_model("qwen3", seed=2, backend=be, head_dim=16)
        specforge_head_dir(tmp_path / be, model, seed=5)
        head = Eagle3Head.load(tmp_path / be, target=model.config, backend=be)
        trace = []
        engine = Engine(model, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=128),
                        drafter=Eagle3Drafter(head, model, topk=2, steps=2, num_draft_tokens=3), ks=(3,),
                        trace=trace.append)
        req = engine.add_request(rand_prompts([7], seed=6)[0], 4)
        while engine.has_work():
            engine.step(3)
        engine.flush_trace()
        outs.append((req.output_ids, [a for rec in trace for a in rec["accepted"]]))
    assert outs[0] == outs[1]
