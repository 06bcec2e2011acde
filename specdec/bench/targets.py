"""Random-weight targets with real shapes, for systems studies (Llama-3.1-8B, Qwen3-8B, Qwen3-30B-A3B).

Outputs of these models are meaningless token ids: every table and metrics file that reports one
must say "random weights". They have no tokenizer: :class:`IdsOnlyTokenizer` stands in, so only
synthetic workloads (random prompt ids) run on them.

The model itself comes from :meth:`specdec.models.transformer.TransformerModel.random` (weights drawn
on the device in the target dtype); ``config.model_type`` picks the family (default llama).
"""

from __future__ import annotations

from pathlib import Path

from ..models.families import ModelConfig

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


def config_from_dict(d: dict) -> ModelConfig:
    """The target config from a plain dict of Hugging Face config.json field names (a conf/target/*.yaml's
    ``config``); ``model_type`` picks the family, llama when absent."""
    return ModelConfig.from_dict({"model_type": "llama", **d}, source="random target config")


llama_config_from_dict = config_from_dict  # the older name (benchmark scripts import it)


def load_target_yaml(path: str | Path) -> dict:
    """A conf/target/*.yaml as a dict (plain YAML, no Hydra: benchmarks run where Hydra is absent)."""
    import yaml

    return yaml.safe_load(Path(path).read_text())
