"""Reading Hugging Face checkpoint directories: config.json and one or several safetensors files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError, SpecdecError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class CheckpointError(SpecdecError, ValueError):
    """A checkpoint directory is missing, malformed, or of an unsupported architecture."""


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """None/"auto" -> bf16 on GPU, fp32 on CPU; else a name from DTYPES."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> "LlamaConfig":
        arch = cfg.get("architectures") or []
        mtype = cfg.get("model_type")
        if mtype != "llama" and "LlamaForCausalLM" not in arch:
            raise CheckpointError(
                f"{source}: model_type {mtype!r} / architectures {arch} is not a Llama "
                "architecture; specdec targets need model_type 'llama' (LlamaForCausalLM)")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            # RoPE: transformers 4.x writes rope_theta + rope_scaling, 5.x one rope_parameters dict.
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = None
            eos = cfg.get("eos_token_id")
            eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            return cls(
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                vocab_size=int(cfg["vocab_size"]),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=theta,
                rope_scaling=rope,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=eos,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: missing or malformed field: {e}") from e

    @classmethod
    def from_dir(cls, path: str | Path) -> "LlamaConfig":
        path = Path(path)
        cfg_path = path / "config.json"
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        if not cfg_path.is_file():
            raise CheckpointError(f"{path} has no config.json (expected a Hugging Face checkpoint "
                                  "directory: config.json + *.safetensors)")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
        return cls.from_dict(cfg, str(cfg_path))


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file, or shards with or without an index)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read safetensors file: {e}") from e
    return tensors
