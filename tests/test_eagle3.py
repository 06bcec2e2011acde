"""EAGLE-3 checkpoints: official key layout round trip, pytorch_model.bin, clear rejections."""

import json

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


def test_wrong_architecture_and_missing_dir_are_rejected(target, tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        Eagle3Head.load(tmp_path / "nope", target=target.config)
    make_head(target).save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="is not an EAGLE-3 head|not \\['LlamaForCausalLMEagle3'\\]"):
        Eagle3Head.load(tmp_path, target=target.config)


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
