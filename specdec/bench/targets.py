"""Random-weight targets with real shapes, for systems studies (e.g. Llama-3.1-8B on one H200).

Outputs of these models are meaningless token ids: every table and metrics file that reports one
must say "random weights". They have no tokenizer: :class:`IdsOnlyTokenizer` stands in, so only
synthetic workloads (random prompt ids) run on them.

The weights are created directly on the target device in the target dtype: building 8B parameters
in fp32 on the host first (what ``LlamaModel.random`` does) would take 32 GB of host memory and tens
of seconds. Same statistics as ``LlamaModel.random`` (normal, std 0.02; norms 1), different draws.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.llama import LlamaModel
from ..models.loading import LlamaConfig, resolve_dtype

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


def random_target(config: LlamaConfig, *, device="cpu", dtype=None, seed: int = 0,
                  backend: str = "auto") -> LlamaModel:
    """A LlamaModel of ``config``'s shapes with random weights drawn on ``device`` in ``dtype``."""
    dtype = resolve_dtype(dtype, device)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # nn.Parameter(torch.empty(...)) in __init__ takes it
    try:
        with torch.device(device):
            model = LlamaModel(config, backend=backend)
    finally:
        torch.set_default_dtype(prev)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.fill_(1.0)
            else:
                prm.normal_(0, 0.02, generator=gen)
    return model.init_rope()


def load_target_yaml(path: str | Path) -> dict:
    """A conf/target/*.yaml as a dict (plain YAML, no Hydra: benchmarks run where Hydra is absent)."""
    import yaml

    return yaml.safe_load(Path(path).read_text())
