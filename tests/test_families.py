"""The target families against transformers: tiny random checkpoints written by ``save_pretrained``.

For Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norms, head_dim != hidden / heads; tied and untied), Qwen3-MoE
(dense and MoE layers mixed by mlp_only_layers / decoder_sparse_step) and Mixtral (top-2 of 8): specdec's
logits equal transformers' over a prefill and decode steps through the paged KV cache, greedy generation
is identical, and serving (n-gram and EAGLE-3 with a random head, k switching, a pool small enough to
preempt) is token-identical to plain decoding. Checkpoints load whether experts are stored one by one (the
published layout, and what save_pretrained writes) or fused, in one file or shards; an unsupported
architecture or feature is refused by name.
"""

import json

import pytest
import torch

from specdec.engine.engine import Engine, EngineConfig
from specdec.engine.reference import generate_reference
from specdec.models.families import ModelConfig
from specdec.models.loading import CheckpointError, load_safetensors
from specdec.models import ops
from specdec.models.ops import AttentionMeta
from specdec.models.transformer import TransformerModel

transformers = pytest.importorskip("transformers")

VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6)
# family -> (transformers class names, config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=96, num_hidden_layers=2, head_dim=16,
                                                      rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=96, num_hidden_layers=2, rope_theta=1e6)),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=96, num_hidden_layers=2, head_dim=24,
                                                           tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=96, num_hidden_layers=2, head_dim=24,
                                                      tie_word_embeddings=False, rope_theta=1e6)),
    # layers 1 and 3 MoE ((i + 1) % 2 == 0), 0 and 2 dense (0 also by mlp_only_layers); top-3 of 8, not renormalised
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, head_dim=16, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[0],
        tie_word_embeddings=False, rope_theta=1e6)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=32, num_hidden_layers=2,
                                                            num_local_experts=8, num_experts_per_tok=2,
                                                            rope_theta=1e6)),
}


def peaked_(model, seed=0):
    """Random weights whose logits are peaked (std 1 / sqrt(fan_in) matrices, std-1 embeddings, norms near
    1, biases of std 0.5), so greedy argmaxes are well separated and equality tests are about logic, not
    rounding. Works on a transformers module and on specdec's models alike (by parameter shape)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # biases
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def hf_model(family, seed=0):
    cfg_cls, model_cls, fields = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **fields}, attn_implementation="eager")
    torch.manual_seed(seed)
    return peaked_(getattr(transformers, model_cls)(cfg).eval(), seed)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    """(family, checkpoint directory, the transformers model) of each family, written by save_pretrained
    (Qwen3-MoE in shards of 100 KB)."""
    family = request.param
    hf = hf_model(family)
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path, **({"max_shard_size": "100KB"} if family == "qwen3_moe" else {}))
    return family, path, hf


def paged_step_logits(model, ids, n_prefill, page_size=4):
    """Logits [len(ids), V]: one causal prefill of ids[:n_prefill] (pages out of order), then one decode
    step per further token through the same KV cache."""
    n = len(ids)
    pages = -(-n // page_size)
    k, v = model.new_kv_cache(pages, page_size)
    table = torch.arange(pages - 1, -1, -1, dtype=torch.int32)[None]
    slots = torch.arange(n)
    slot = table[0, slots // page_size].long() * page_size + slots % page_size

    def run(a, b):
        meta = AttentionMeta(torch.tensor([0, b - a], dtype=torch.int32), torch.tensor([b], dtype=torch.int32),
                             table, slot[a:b], b - a)
        return model.logits(model(torch.tensor(ids[a:b]), torch.arange(a, b), meta, k, v).hidden)

    return torch.cat([run(0, n_prefill)] + [run(t, t + 1) for t in range(n_prefill, n)])


def test_logits_and_greedy_match_transformers(family_dir):
    family, path, hf = family_dir
    ours = TransformerModel.from_pretrained(path, dtype="float32", backend="torch")
    c = ours.config
    assert c.model_type == family.removesuffix("_tied")
    assert (ours.lm_head is None) == (family == "qwen3_tied")
    if family == "qwen3_moe":
        assert len(list(path.glob("*.safetensors"))) > 1  # sharded load
        assert c.moe_layers == (1, 3) and not c.norm_topk_prob and c.num_experts_per_tok == 3
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = paged_step_logits(ours, ids, n_prefill=9)
    assert (got - want).abs().max().item() <= 1e-4, family
    prompt = ids[:7]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert generate_reference(ours, prompt, 10).token_ids == ref


def test_capture_layers_are_the_residual_stream_entering_layers(family_dir):
    family, path, hf = family_dir
    if family not in ("qwen3", "qwen3_moe"):
        pytest.skip("one dense and one MoE family")
    ours = TransformerModel.from_pretrained(path, dtype="float32", backend="torch")
    ids = list(range(10, 22))
    n = len(ids)
    k, v = ours.new_kv_cache(1, 16)
    meta = AttentionMeta(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                         torch.tensor([[0]], dtype=torch.int32), torch.arange(n), n)
    layers = (1, 0, 1) if family == "qwen3" else (3, 1, 2)
    out = ours(torch.tensor(ids), torch.arange(n), meta, k, v, capture_layers=layers)
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # input of layer i = hs[i]
    torch.testing.assert_close(out.captured, torch.cat([hs[i][0] for i in layers], -1), atol=1e-5, rtol=1e-5)


def test_experts_load_fused_or_one_by_one(tmp_path):
    """transformers 5 keeps experts fused in memory and writes them per expert; a directory holding the
    fused names ([E, 2F, H] gate|up, [E, H, F] down) loads to the same model. Mixtral's per-expert names
    (block_sparse_moe.experts.N.w1/w3/w2) likewise."""
    for family in ("qwen3_moe", "mixtral"):
        hf = hf_model(family, seed=2)
        hf.save_pretrained(tmp_path / family)
        sd = load_safetensors(tmp_path / family)
        a = TransformerModel.from_pretrained(tmp_path / family, dtype="float32", backend="torch")
        fused = {}
        for name, t in hf.state_dict().items():
            fused[name] = t.contiguous()
        assert any(".experts.gate_up_proj" in k for k in fused) and not any(".experts.0." in k for k in fused)
        assert any(".experts.0." in k for k in sd)  # on disk: one by one
        from safetensors.torch import save_file

        (tmp_path / f"{family}_fused").mkdir()
        save_file(fused, str(tmp_path / f"{family}_fused" / "model.safetensors"))
        (tmp_path / f"{family}_fused" / "config.json").write_text((tmp_path / family / "config.json").read_text())
        b = TransformerModel.from_pretrained(tmp_path / f"{family}_fused", dtype="float32", backend="torch")
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert na == nb and torch.equal(pa, pb), (family, na)


def test_unsupported_architectures_and_features_are_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match=r"model_type 'gpt2'.*not a supported architecture; supported model_type: "
                                              r"llama, qwen2, qwen3, qwen3_moe, mixtral"):
        TransformerModel.from_pretrained(tmp_path)
    base = dict(BASE, intermediate_size=96, num_hidden_layers=2)
    for mtype, extra, what in [("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
                               ("qwen3", {"attention_bias": True}, "attention_bias=True"),
                               ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
                               ("mixtral", {"sliding_window": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
                                "sliding_window=64"),
                               ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'")]:
        with pytest.raises(CheckpointError, match=what.replace("(", r"\(")):
            ModelConfig.from_dict({**base, "model_type": mtype, **extra})
    # architectures alone picks the family when model_type is absent
    assert ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"]}).qkv_bias


def test_qwen3_moe_layer_selection_follows_transformers():
    for step, only, layers in [(1, [], 6), (2, [], 6), (1, [0, 5], 6), (3, [2], 7)]:
        cfg = transformers.Qwen3MoeConfig(**BASE, intermediate_size=96, moe_intermediate_size=16,
                                          num_hidden_layers=layers, num_experts=4, num_experts_per_tok=2,
                                          decoder_sparse_step=step, mlp_only_layers=only)
        hf = transformers.Qwen3MoeForCausalLM(cfg)
        want = tuple(i for i, layer in enumerate(hf.model.layers)
                     if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock")
        assert ModelConfig.from_dict(cfg.to_dict()).moe_layers == want, (step, only)


# -- serving --------------------------------------------------------------------------------------

def repetitive_prompts(n, seed=0):
    """Prompts that repeat a motif, so the n-gram drafter finds continuations the target may take."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        motif = torch.randint(0, VOCAB, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
        out.append((motif * 6)[: 8 + 3 * i])
    return out


def family_model(family, seed=0, backend="torch", **overrides):
    """specdec's model of a family, random (peaked) weights; no transformers round trip. ``overrides``:
    config fields (the Triton attention kernel takes power-of-two head dims: head_dim=16)."""
    cfg_cls, _, fields = FAMILIES[family]
    hf_cfg = getattr(transformers, cfg_cls)(**{**BASE, **fields, **overrides})
    model = TransformerModel.random(ModelConfig.from_dict(hf_cfg.to_dict()), dtype="float32", seed=seed,
                                    backend=backend)
    return peaked_(model, seed).init_rope()


def serve(model, prompts, max_new, drafter=None, ks=(0,), k_cycle=(0,), kv_tokens=4096):
    engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=kv_tokens, prefill_chunk=8),
                    drafter=drafter, ks=ks)
    reqs = [engine.add_request(p, max_new) for p in prompts]
    step = 0
    while engine.has_work():
        engine.step(k_cycle[step % len(k_cycle)])
        step += 1
    engine.check()
    return [r.output_ids for r in reqs], engine.scheduler.num_preemptions


def eagle3_drafter(model, seed=0):
    from specdec.models.eagle3 import Eagle3Config, Eagle3Head
    from specdec.spec import Eagle3Drafter

    L = model.config.num_hidden_layers
    cfg = Eagle3Config.for_target(model.config, 96, target_layers=(0, L // 2, L - 1))
    head = Eagle3Head(cfg, backend=model.backend).init_weights_(seed)
    head.set_vocab_(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:96])
    return Eagle3Drafter(head.to_device(model.device, torch.float32), model, topk=2, steps=3, num_draft_tokens=5)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("drafter_kind", ["ngram", "eagle3"])
def test_speculative_serving_is_plain_greedy(family, drafter_kind):
    """n-gram and EAGLE-3 drafting, k switching between 0 and the drafter's size every step or two, in a
    KV pool small enough to preempt: every output equals plain greedy decoding's."""
    from specdec.spec import NgramDrafter

    model = family_model(family, seed=1)
    prompts = repetitive_prompts(4, seed=2)
    want = [generate_reference(model, p, 12).token_ids for p in prompts]
    drafter, k = (NgramDrafter(), 4) if drafter_kind == "ngram" else (eagle3_drafter(model), 5)
    got, preempted = serve(model, prompts, 12, drafter=drafter, ks=(k,), k_cycle=(k, 0, k), kv_tokens=64)
    assert got == want
    assert preempted > 0


def test_expert_counts_are_the_routed_experts():
    """moe_stats: per forward and MoE layer, the distinct experts its tokens select (routing recomputed
    here from the layer's input), averaged over forwards; tokens per forward as run."""
    from kernels_triton.moe import moe_route_ref

    model = family_model("qwen3_moe", seed=3)
    c = model.config
    seen = {}
    real = model.moe_

    def spy(i, h, residual):
        out, s = real(i, h, residual)
        y, _ = ops.add_rms_norm(h, residual, model.mlp_norm[i], c.rms_norm_eps)
        _, ids = moe_route_ref(y @ model.router[model.moe_slot[i]].t(), c.num_experts_per_tok, c.norm_topk_prob)
        seen.setdefault(i, []).append(len(set(ids.flatten().tolist())))
        return out, s

    model.moe_ = spy
    model.reset_moe_stats_()
    ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    paged_step_logits(model, ids, n_prefill=6)  # forwards of 6, 1, 1, 1 tokens
    stats = model.moe_stats()
    assert stats["forwards"] == 4 and stats["tokens_per_forward"] == 9 / 4
    want = [sum(seen[i]) / 4 for i in c.moe_layers]
    assert stats["per_layer"] == pytest.approx(want)
    assert stats["distinct_experts_per_layer"] == pytest.approx(sum(want) / len(want))
    assert all(v == c.num_experts_per_tok for i in c.moe_layers for v in seen[i][1:])  # one token: top-k experts
    assert TransformerModel.random(ModelConfig(**{k: v for k, v in BASE.items() if k != "max_position_embeddings"},
                                               intermediate_size=96, num_hidden_layers=1, head_dim=16),
                                   dtype="float32").moe_stats() is None


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("family", ["qwen2", "qwen3", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_triton_blocks_match_torch_references(family):
    """The model's Triton path for the new blocks (bias add, per-head q/k norms, both folded into the RoPE + KV
    write kernel; the fused MoE kernel; under the interpreter on CPU) against its torch-reference path: a
    prefill, then decode steps."""
    overrides = {"head_dim": 16} if family == "qwen3" else {}  # the attention kernel: power-of-two head dims
    models = {be: family_model(family, seed=4, backend=be, **overrides) for be in ("triton", "torch")}
    ids = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(5)).tolist()
    got, want = (paged_step_logits(models[be], ids, n_prefill=5) for be in ("triton", "torch"))
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_step_read_bytes_counts_the_selected_experts():
    model = family_model("qwen3_moe", seed=3)
    c = model.config
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    experts = nbytes([model.w13[i] for i in c.moe_layers] + [model.w2[i] for i in c.moe_layers])
    everything = nbytes(model.parameters()) - nbytes([model.embed])  # untied: a step reads rows of the table
    assert model.step_read_bytes()["weights"] == everything
    got = model.step_read_bytes(distinct_experts_per_layer=2.0, kv_tokens=10)
    assert got["weights"] == everything - experts * (c.num_experts - 2) // c.num_experts
    assert got["kv"] == 10 * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    assert got["total"] == got["weights"] + got["kv"]


# -- the real-shape presets -----------------------------------------------------------------------

def preset_config(name):
    import yaml

    from specdec.bench.targets import config_from_dict

    path = __import__("pathlib").Path(__file__).resolve().parents[1] / "conf" / "target" / f"{name}.yaml"
    return config_from_dict(yaml.safe_load(path.read_text())["config"])


def test_qwen3_presets_have_the_published_shapes():
    """target=qwen3_8b_random / qwen3_30b_a3b_random: Qwen3-8B's and Qwen3-30B-A3B's config.json (FACTS.md),
    8.19B and 30.53B parameters (61.1 GB in bf16, the experts 58.0 GB), and EAGLE-3 heads of the published
    heads' shapes (one layer of the target; 32000 draft ids)."""
    from specdec.models.eagle3 import Eagle3Config
    from specdec.spec import random_draft_vocab

    for name, params, family in [("qwen3_8b_random", 8_190_735_360, "qwen3"),
                                 ("qwen3_30b_a3b_random", 30_532_122_624, "qwen3_moe")]:
        c = preset_config(name)
        with torch.device("meta"):
            model = TransformerModel(c)
        assert c.model_type == family and c.qk_norm and not c.tie_word_embeddings and c.vocab_size == 151936
        assert c.rope_theta == 1e6 and c.head_dim == 128
        assert sum(p.numel() for p in model.parameters()) == params
        head = Eagle3Config.for_target(c, random_draft_vocab(c.vocab_size))
        assert head.draft_vocab_size == 32000 and head.head_dim == 128
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (48, 2048, 32, 4)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (128, 8, 768, True)
    assert c.moe_layers == tuple(range(48))
    assert (head.hidden_size, head.intermediate_size, head.num_attention_heads) == (2048, 6144, 32)  # SpecForge's


SCALED_DOWN = [f"target.config.{k}={v}" for k, v in dict(
    num_hidden_layers=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    intermediate_size=192, vocab_size=1024, max_position_embeddings=1024).items()]
SCALED_DOWN += ["engine.dtype=float32", "device=cpu"]


MOE_SCALED_DOWN = ["target.config.moe_intermediate_size=32", "target.config.num_experts=16",
                   "target.config.num_experts_per_tok=4"]


@pytest.mark.parametrize("target,extra", [
    ("qwen3_8b_random", []),
    ("qwen3_30b_a3b_random", MOE_SCALED_DOWN),
    ("qwen3_30b_a3b_random_uniform", MOE_SCALED_DOWN)])
def test_qwen3_presets_serve_and_profile_scaled_down(target, extra, tmp_path):
    """The presets' command (draft=eagle3_random, replayed acceptance, policy always) at a scaled-down copy
    of each shape on the CPU, with the step-floor profile and the speculative step table; metrics name the MoE
    target's routing (the random router, or uniform steering)."""
    from hydra import compose, initialize_config_dir
    from test_run import CONF

    from specdec.run import run

    overrides = [f"target={target}", "draft=eagle3_random", "acceptance=replay", "acceptance.parametric.mean=3",
                 "workload=synthetic", "policy=always", *SCALED_DOWN, *extra, "workload.concurrency=2",
                 "workload.sources.0.num_prompts=3", "workload.sources.0.prompt_len=16",
                 "workload.sources.0.output_len=8", "engine.kv_cache_tokens=2048", "logger=none",
                 "engine.profile_steps=[1,2]", "engine.profile_spec_steps=[2]", "engine.profile_steps_context=16",
                 "engine.profile_steps_iters=2", f"run_dir={tmp_path}/run"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    m = run(cfg)
    assert m["failed_requests"] == 0 and m["output_tokens"] == 24
    floor, table = m["step_floor"], m["step_breakdown"]["batches"]["2"]
    assert floor["step_ms"]["1"] > 0 and table["k"]["48"]["step_ms"] > 0
    assert floor["bytes_touched"]["2"] > floor["bytes_touched"]["1"]  # the second row's context KV, its experts
    if target == "qwen3_8b_random":
        assert "distinct_experts_per_layer" not in floor and "plain_distinct_experts_per_layer" not in table
        assert "routing" not in m
        return
    want = {"qwen3_30b_a3b_random": ("random router", "router"), "qwen3_30b_a3b_random_uniform": ("uniform", "uniform")}
    assert (m["routing"]["label"], m["routing"]["kind"]) == want[target]
    # One token selects top-k = 4 distinct experts of 16; two tokens 4..8; a 49-token verify per row more.
    experts = floor["distinct_experts_per_layer"]
    assert experts["1"] == 4 and 4 <= experts["2"] <= 8
    assert 4 <= table["plain_distinct_experts_per_layer"] <= 8
    assert table["plain_distinct_experts_per_layer"] < table["k"]["48"]["distinct_experts_per_layer"] <= 16
