"""Random-weight targets with real shapes, for systems studies (e.g. Llama-3.1-8B on one H200).

Outputs of these models are meaningless token ids: every table and metrics file that reports one
must say "random weights". They have no tokenizer: :class:`IdsOnlyTokenizer` stands in, so only
synthetic workloads (random prompt ids) run on them.

The model itself comes from :meth:`specdec.models.llama.LlamaModel.random` (weights drawn on the
device in the target dtype).
"""

from __future__ import annotations

from pathlib import Path

from ..models.loading import LlamaConfig

RANDOM_WEIGHTS_LABEL = "random weights"


class IdsOnlyTokenizer:
    """Tokenizer stand-in for a random-weight target: knows the vocabulary size, renders ids."""

    is_ids_only = True
    eos_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, **_):
        raise ValueError("a random-weight target has no tokenizer; use workload=synthetic")

    encode_chat = encode

    def decode(self, ids, **_) -> str:
        return ""  # random weights: the ids carry no text


def llama_config_from_dict(d: dict) -> LlamaConfig:
    """LlamaConfig from a plain dict of Hugging Face config.json field names."""
    return LlamaConfig.from_dict({"model_type": "llama", **d}, source="random target config")


def load_target_yaml(path: str | Path) -> dict:
    """A conf/target/*.yaml as a dict (plain YAML, no Hydra: benchmarks run where Hydra is absent)."""
    import yaml

    return yaml.safe_load(Path(path).read_text())
