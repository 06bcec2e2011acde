"""Which config.json maps to which blocks: the target families specdec serves, and their checkpoint names.

Every family is one decoder-only transformer (specdec/models/transformer.py): RMSNorm, GQA attention with
RoPE over the paged KV cache, a SwiGLU MLP that is dense or a mixture of experts, tied or untied LM head.
A family only switches blocks on or off and names its tensors:

    model_type   attention                         MLP
    llama        q|k|v (no bias)                   dense
    qwen2        q|k|v with bias                   dense
    qwen3        q|k|v, q_norm / k_norm per head   dense
    qwen3_moe    as qwen3                          MoE (softmax router, top-k, norm_topk_prob) where
                                                   decoder_sparse_step / mlp_only_layers say, else dense
    mixtral      q|k|v (no bias)                   MoE in every layer (top-2 of 8, renormalised)

q_norm / k_norm: an RMSNorm over each head's D channels (weight [D], shared by the heads), applied to q and
k after the projection and before RoPE (transformers' Qwen3Attention). Mixtral's router (softmax over all
experts, top-k, the k weights renormalised to sum 1) is Qwen3-MoE's with norm_topk_prob true.

Expert weights: the model holds each MoE layer as w13 [E, 2F, H] (expert e's gate rows, then its up rows)
and w2 [E, H, F], the fused kernel's layout (kernels_triton/moe.py). Checkpoints name experts one by one
(``mlp.experts.{e}.{gate,up,down}_proj.weight``; Mixtral ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``
with router ``block_sparse_moe.gate.weight``): that is what the published checkpoints hold, and what
transformers 5's ``save_pretrained`` writes (it keeps the experts fused in memory, as
``mlp.experts.gate_up_proj`` [E, 2F, H] and ``mlp.experts.down_proj`` [E, H, F], and converts them back to
per-expert names when saving). A directory holding the fused names is read too.

Features a family's config can switch on that change the function and are not implemented (sliding-window
attention, an o-projection or MLP bias, an activation other than SiLU, RoPE types other than default and
llama3) are refused by name, never run wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .loading import CheckpointError, read_json_object

# model_type -> the architectures class names transformers writes for it
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
SUPPORTED = tuple(ARCHITECTURES)
# transformers' config defaults where config.json leaves a field out (checked in transformers 5.25:
# Qwen3Config().head_dim == 128 whatever the width; MixtralConfig's eps 1e-5 and rope_theta 1e6).
RMS_NORM_EPS = {"mixtral": 1e-5}
ROPE_THETA = {"mixtral": 1e6}
ROPE_TYPES = ("default", "llama3")


@dataclass
class ModelConfig:
    """The target's shapes and blocks, from config.json (:meth:`from_dict` / :meth:`from_dir`).

    ``intermediate_size`` is the dense MLP's width (Mixtral: each expert's), ``moe_intermediate_size`` an
    expert's; ``moe_layers`` lists the layers whose MLP is a mixture of ``num_experts`` experts of which
    each token takes ``num_experts_per_tok`` (renormalised to sum 1 when ``norm_topk_prob``)."""

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
    model_type: str = "llama"
    qkv_bias: bool = False  # q / k / v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self):
        self.moe_layers = tuple(sorted(int(i) for i in self.moe_layers))
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise CheckpointError(f"MoE layers {bad} lie outside the {self.num_hidden_layers} layers")
        if self.moe_layers and not (self.num_experts >= 1 and 1 <= self.num_experts_per_tok <= self.num_experts
                                    and self.moe_intermediate_size >= 1):
            raise CheckpointError(f"MoE layers need num_experts >= 1, 1 <= num_experts_per_tok <= num_experts and "
                                  f"moe_intermediate_size >= 1; got {self.num_experts}, {self.num_experts_per_tok}, "
                                  f"{self.moe_intermediate_size}")

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in moe)

    # -- config.json ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> "ModelConfig":
        """From config.json fields; ``model_type`` (or ``architectures``) picks the family. An
        unsupported architecture, or a feature of a supported one that specdec does not compute, is
        a CheckpointError naming it."""
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source}: expected a JSON object of config fields, got {type(cfg).__name__}")
        mtype = family_of(cfg, source)
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
            # RoPE: transformers 4.x writes rope_theta + rope_scaling, 5.x one rope_parameters dict.
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", cfg.get("rope_theta", ROPE_THETA.get(mtype, 10000.0))))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise CheckpointError(f"{source}: rope_type {rope_type!r} is not implemented; supported: "
                                      f"{', '.join(ROPE_TYPES)}")
            if rope_type == "default":
                rope = None
            eos = cfg.get("eos_token_id")
            eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            head_dim = cfg.get("head_dim") or (128 if mtype == "qwen3" and "head_dim" not in cfg else hidden // heads)
            fields = dict(
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                vocab_size=int(cfg["vocab_size"]),
                head_dim=int(head_dim),
                # transformers' defaults when absent (LlamaConfig / Qwen*Config 1e-6, MixtralConfig 1e-5).
                rms_norm_eps=float(cfg.get("rms_norm_eps", RMS_NORM_EPS.get(mtype, 1e-6))),
                rope_theta=theta,
                rope_scaling=rope,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=eos,
                model_type=mtype,
                qkv_bias=mtype == "qwen2",
                qk_norm=mtype in ("qwen3", "qwen3_moe"),
            )
            fields.update(_moe_fields(mtype, cfg, layers))
            return cls(**fields)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{source}: missing or malformed field: {e}") from e

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """config.json of a checkpoint directory, with the stop ids of its generation_config.json added."""
        path = Path(path)
        cfg_path = path / "config.json"
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        if not cfg_path.is_file():
            raise CheckpointError(f"{path} has no config.json (expected a Hugging Face checkpoint "
                                  "directory: config.json + *.safetensors)")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
        config = cls.from_dict(cfg, str(cfg_path))
        # generation_config.json holds the stop ids generate() uses (Llama-3.1: <|end_of_text|>,
        # <|eom_id|>, <|eot_id|>), often more than config.json lists: stop on all of them.
        gen_path = path / "generation_config.json"
        gen = read_json_object(gen_path, "generation config")
        eos = gen.get("eos_token_id")
        ints = isinstance(eos, list) and all(isinstance(e, int) for e in eos)
        if not (eos is None or isinstance(eos, int) or ints):
            raise CheckpointError(f"{gen_path}: expected a JSON object whose eos_token_id is an integer or a list "
                                  "of integers")
        for e in [eos] if isinstance(eos, int) else eos or []:
            if e not in config.eos_token_id:
                config.eos_token_id.append(e)
        return config


def family_of(cfg: dict, source: str = "config") -> str:
    """The family (model_type) of config.json fields, from ``model_type`` or else ``architectures``;
    a CheckpointError naming it and the supported ones when specdec has no blocks for it, or when the
    config switches on a feature that changes the function and is not implemented."""
    arch = cfg.get("architectures") or []
    mtype = cfg.get("model_type")
    if mtype is None:
        mtype = next((m for m, a in ARCHITECTURES.items() if a in arch), None)
    if mtype not in ARCHITECTURES:
        raise CheckpointError(
            f"{source}: model_type {mtype!r} / architectures {arch} is not a supported architecture; "
            f"supported model_type: {', '.join(SUPPORTED)} ({', '.join(ARCHITECTURES.values())})")
    refused = []
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        refused.append(f"hidden_act={cfg['hidden_act']!r}")
    if mtype in ("llama", "qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        refused.append("attention_bias=True (an o_proj bias)")
    if cfg.get("mlp_bias"):
        refused.append("mlp_bias=True")
    if cfg.get("use_sliding_window"):
        refused.append("use_sliding_window=True")
    window = cfg.get("sliding_window")
    if mtype == "mixtral" and window is not None and int(window) < int(cfg.get("max_position_embeddings", 0)):
        refused.append(f"sliding_window={window}")
    if int(cfg.get("pretraining_tp") or 1) != 1:
        refused.append(f"pretraining_tp={cfg['pretraining_tp']!r}")
    if mtype == "qwen3_moe" and int(cfg.get("shared_expert_intermediate_size") or 0):
        refused.append("shared_expert_intermediate_size (shared experts)")
    if refused:
        raise CheckpointError(f"{source}: {', '.join(refused)} changes the {mtype} model's function and is not "
                              "implemented by specdec")
    return mtype


def _moe_fields(mtype: str, cfg: dict, layers: int) -> dict:
    """ModelConfig's MoE fields for a family: Qwen3-MoE's layers from decoder_sparse_step and
    mlp_only_layers (transformers: layer i is sparse when i is not in mlp_only_layers and (i + 1) is a
    multiple of decoder_sparse_step), Mixtral's every layer."""
    if mtype not in ("qwen3_moe", "mixtral"):
        return {}
    # Hub configs say num_experts (Qwen3-MoE) or num_local_experts (Mixtral; transformers 5 writes that
    # name for both).
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg["num_experts_per_tok"])
    if mtype == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(cfg["intermediate_size"]),
                    norm_topk_prob=True, moe_layers=tuple(range(layers)))
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
    moe = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=moe)


# -- checkpoint tensors ---------------------------------------------------------------------------

def attention_names(i: int) -> dict[str, str]:
    pre = f"model.layers.{i}."
    return {"attn_norm": pre + "input_layernorm.weight", "mlp_norm": pre + "post_attention_layernorm.weight",
            **{p: f"{pre}self_attn.{p}_proj.weight" for p in "qkvo"},
            **{f"b{p}": f"{pre}self_attn.{p}_proj.bias" for p in "qkv"},
            "q_norm": pre + "self_attn.q_norm.weight", "k_norm": pre + "self_attn.k_norm.weight"}


def dense_mlp_names(i: int) -> tuple[str, str, str]:
    pre = f"model.layers.{i}.mlp."
    return pre + "gate_proj.weight", pre + "up_proj.weight", pre + "down_proj.weight"


def take_experts(sd: dict, mtype: str, i: int, shapes: dict, dtype, source: str):
    """(router [E, H], w13 [E, 2F, H], w2 [E, H, F]) of MoE layer i, popped from the state dict ``sd``
    in ``dtype`` (each source tensor is released once copied: a checkpoint's experts are never held
    twice). Accepts the per-expert names and the fused ones (module docstring)."""
    E, H, F = shapes["E"], shapes["H"], shapes["F"]
    prefixes = [f"model.layers.{i}.mlp."]
    if mtype == "mixtral":
        prefixes.insert(0, f"model.layers.{i}.block_sparse_moe.")
    per_expert = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}[mtype]
    for pre in prefixes:
        if pre + "gate.weight" in sd:
            break
    else:
        raise CheckpointError(f"{source}: missing tensor {prefixes[-1]}gate.weight (layer {i}'s router; config.json "
                              "says this layer is a mixture of experts)")

    def pop(name, shape):
        t = sd.pop(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{source}: {name} has shape {tuple(t.shape)}, config.json implies {tuple(shape)}")
        return t.to(dtype)

    router = pop(pre + "gate.weight", (E, H))
    fused = [pre + "experts.gate_up_proj", pre + "experts.down_proj"]
    fused = [n if n in sd else n + ".weight" for n in fused]
    if all(n in sd for n in fused):
        return router, pop(fused[0], (E, 2 * F, H)).contiguous(), pop(fused[1], (E, H, F)).contiguous()
    g, u, d = per_expert
    w13 = torch.empty((E, 2 * F, H), dtype=dtype)
    w2 = torch.empty((E, H, F), dtype=dtype)
    for e in range(E):
        names = [f"{pre}experts.{e}.{p}.weight" for p in (g, u, d)]
        missing = [n for n in names if n not in sd]
        if missing:
            raise CheckpointError(f"{source}: missing tensor {missing[0]} (expected per-expert "
                                  f"{pre}experts.N.{{{g},{u},{d}}}.weight or fused {pre}experts.gate_up_proj / "
                                  "down_proj)")
        w13[e, :F] = pop(names[0], (F, H))
        w13[e, F:] = pop(names[1], (F, H))
        w2[e] = pop(names[2], (H, F))
    return router, w13, w2
