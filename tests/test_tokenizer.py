"""SmolLM2 tokenizer built from GGUF metadata: round trips, digit split, chat template."""

import inspect
import json

import pytest

CODE_SAMPLES = [
    inspect.getsource(json.dumps),
    "def f(x):\n\treturn x ** 2  # tabs, 2 spaces\n\n\n    x = [1,2,  3]\r\n",
    "números 123 4567 — ünïcode ✓ 日本語 😀\n",
]


@pytest.mark.parametrize("text", CODE_SAMPLES)
def test_round_trip_exact(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text


def test_digits_are_split_individually(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("x = 2026")
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[-4:] == ["2", "0", "2", "6"]


def test_special_tokens_and_chat_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds a default system turn
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> first; two <|im_end|> (system, user)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_matches_transformers_on_text_without_digits(smollm2_tokenizer, smollm2_path):
    transformers = pytest.importorskip("transformers")
    gguf = next(smollm2_path.glob("*.gguf")).name
    ref = transformers.AutoTokenizer.from_pretrained(str(smollm2_path), gguf_file=gguf)
    text = "def add(a, b):\n    return a + b  # sum\n"
    assert smollm2_tokenizer.encode(text) == ref.encode(text, add_special_tokens=False)
