"""EAGLE-3 draft head in the official checkpoint layout.

The head reads the target's residual stream captured entering three layers (default 2, L//2, L-3),
fuses them with ``fc`` (3H -> H), and runs one Llama decoder layer whose attention input is the
concatenation [input_layernorm(embed(token)), hidden_norm(h)] (width 2H). Its output hidden state
(pre-norm, width H) is fed back as ``h`` for the next draft step, skipping ``fc``; ``norm`` +
``lm_head`` give logits over a compact draft vocabulary mapped to target ids by ``d2t``
(target_id = draft_id + d2t[draft_id]); ``t2d`` marks which target ids are in it.

Alignment: draft row j pairs the feature of target position j with the token at position j + 1
and predicts the token at j + 2. It is stored at draft KV slot j (same page table as the target)
with RoPE position j, so after a commit that leaves ``seq_len`` target tokens with KV, the draft
KV covers slots 0 .. seq_len - 1 as well.

Checkpoint keys (official layout): fc.weight, midlayer.{hidden_norm, input_layernorm,
post_attention_layernorm}.weight, midlayer.self_attn.{q,k,v,o}_proj.weight,
midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight, d2t, t2d; config.json with
architectures ["LlamaForCausalLMEagle3"], llama fields, num_hidden_layers 1, draft_vocab_size. The
embedding is the target's unless the checkpoint carries its own ``embed_tokens.weight``.

Loading follows the official rules (SafeAILab/EAGLE; docs/checkpoints.md lists them): a head is
recognised by its keys whatever ``architectures`` says; ``fc`` is 3 * target_hidden_size -> H
(target_hidden_size when present, else H); missing fields take LlamaConfig's defaults (rms_norm_eps
1e-6, rope_theta 10000); a draft vocabulary as large as the target's is the identity (d2t / t2d
optional); RoPE positions reach the target's limit, whatever the head's ``max_position_embeddings``
says. Config flags that change the function and are not implemented are refused by name. Heads written
by SpecForge for Qwen3 / Qwen3-MoE targets load as they are: ``head_dim`` is read from config.json when
present (as SpecForge and SGLang build the layer: a Qwen3-30B-A3B head is 32 query heads of 128 over
hidden 2048; hidden // heads otherwise), the capture layers from
``eagle_config.eagle_aux_hidden_state_layer_ids``, and a head narrower than its target carries
``target_hidden_size`` and its own ``embed_tokens.weight``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from . import ops
from .families import ModelConfig
from .loading import SHARD_BYTES, CheckpointError, read_json_object, resolve_dtype, write_safetensors

ARCH = "LlamaForCausalLMEagle3"
# Keys that identify the EAGLE-3 layout (the EAGLE repository's own training configs say
# "LlamaForCausalLM", so `architectures` alone cannot tell).
EAGLE3_KEYS = ("fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight")
# transformers' LlamaConfig default (checked in transformers 5.24: LlamaConfig().rms_norm_eps == 1e-6);
# the official loader builds the head from a LlamaConfig, so a config without the field gets it.
HF_LLAMA_RMS_NORM_EPS = 1e-6
# Tree nodes sit up to 63 positions past the committed length (draft.steps x draft.topk <= 63).
ROPE_SLACK = 64
# draft.weight_dtype: the head's own dtype, weight-only int8 projections for few rows, or auto (set_weight_dtype_)
WEIGHT_DTYPES = ("model", "int8", "auto")
# weight_dtype auto: int8 on a CUDA device for heads at least this wide, else the head's dtype: at hidden 4096 the
# draft rounds read the weights and halving their bytes shortens the tree step; at SmolLM2's 576 the rounds are
# launch-bound and the dequantising body is slower (measured verdicts: the results ledger).
AUTO_INT8_HIDDEN = 2048


def resolve_weight_dtype(weight_dtype: str, hidden_size: int, device_type: str) -> str:
    """draft.weight_dtype as a head uses it: auto -> int8 on a CUDA device for a head at least AUTO_INT8_HIDDEN wide
    (where int8 measured faster), else model; model / int8 as given."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"draft.weight_dtype={weight_dtype!r}; valid: {', '.join(WEIGHT_DTYPES)}")
    if weight_dtype != "auto":
        return weight_dtype
    return "int8" if hidden_size >= AUTO_INT8_HIDDEN and device_type == "cuda" else "model"


def _refused_flags(cfg: dict) -> list[str]:
    """Config fields (SpecForge / speculators / vLLM variants) that change the head's function and
    that this implementation does not compute; a head carrying any of them is refused, not run wrong."""
    bad = [f"{k}={cfg[k]!r}" for k in ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc",
                                       "attention_bias", "mlp_bias") if cfg.get(k)]
    if cfg.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={cfg['hidden_act']!r}")
    if int(cfg.get("pretraining_tp") or 1) != 1:
        bad.append(f"pretraining_tp={cfg['pretraining_tp']!r}")
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if eagle.get("use_aux_hidden_state", True) is False:
        bad.append("eagle_config.use_aux_hidden_state=False")
    return bad


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    target_layers: tuple[int, ...] = (2, 15, 27)  # captured target layers (inputs of)
    target_hidden_size: int | None = None  # width of each captured feature (default hidden_size)
    own_embedding: bool = False  # the head embeds tokens with its own embed_tokens.weight [vocab, H]

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int, target_layers=None) -> "Eagle3Config":
        """A head shaped like one layer of ``target``."""
        return cls(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                   num_attention_heads=target.num_attention_heads,
                   num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                   vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size,
                   rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                   rope_scaling=target.rope_scaling,
                   max_position_embeddings=target.max_position_embeddings,
                   target_layers=tuple(target_layers or default_capture_layers(target.num_hidden_layers)))

    def to_hf(self) -> dict:
        """config.json as the official loader and other engines read it: ``target_hidden_size`` only
        when it differs from hidden_size (the official loader builds ``fc`` from the key whenever it
        is present, and then skips the target's embedding), ``rope_scaling`` only when set."""
        d = asdict(self)
        skip = ("rope_scaling", "target_layers", "target_hidden_size", "own_embedding")
        out = {"architectures": [ARCH], "model_type": "llama", "num_hidden_layers": 1,
               **{k: v for k, v in d.items() if k not in skip}}
        if self.target_hidden_size is not None and self.target_hidden_size != self.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.target_layers)}
        out["torch_dtype"] = "float32"
        return out

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json", keys=None) -> "Eagle3Config":
        """From config.json; ``keys`` (the checkpoint's tensor names) identify the layout when
        ``architectures`` names another class, and tell whether the head has its own embedding."""
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
        arch = cfg.get("architectures") or []
        keys = set(keys or ())
        if ARCH not in arch and not all(k in keys for k in EAGLE3_KEYS):
            raise CheckpointError(f"{source}: architectures {arch} is not [{ARCH!r}] and the weights lack "
                                  f"the EAGLE-3 keys {list(EAGLE3_KEYS)}: not an EAGLE-3 head")
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise CheckpointError(f"{source}: an EAGLE-3 head has num_hidden_layers 1, "
                                  f"not {cfg.get('num_hidden_layers')}")
        refused = _refused_flags(cfg)
        if refused:
            raise CheckpointError(f"{source}: {', '.join(refused)} changes the head's function and is not "
                                  "implemented by specdec (supported: the official EAGLE-3 layer, SiLU, no "
                                  "biases, no extra norms)")
        base = ModelConfig.from_dict({**cfg, "model_type": "llama",
                                      "rms_norm_eps": cfg.get("rms_norm_eps", HF_LLAMA_RMS_NORM_EPS)}, source)
        layers = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        th = cfg.get("target_hidden_size")  # null (older specdec heads) reads as absent
        try:
            return cls(hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
                       num_attention_heads=base.num_attention_heads,
                       num_key_value_heads=base.num_key_value_heads, head_dim=base.head_dim,
                       vocab_size=base.vocab_size,
                       draft_vocab_size=int(cfg.get("draft_vocab_size") or base.vocab_size),
                       rms_norm_eps=base.rms_norm_eps, rope_theta=base.rope_theta,
                       rope_scaling=base.rope_scaling,
                       max_position_embeddings=base.max_position_embeddings,
                       target_layers=tuple(int(i) for i in layers) if layers else (),
                       target_hidden_size=None if th is None else int(th),
                       own_embedding="embed_tokens.weight" in keys)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: malformed field: {e}") from e


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config, *, backend: str = "auto"):
        super().__init__()
        c = self.config = config
        self.backend = ops.check_backend(backend)
        H, D, HQ, HKV, F = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
        TH = c.target_hidden_size or H
        shapes = {
            "fc.weight": (H, 3 * TH),
            "midlayer.hidden_norm.weight": (H,),
            "midlayer.input_layernorm.weight": (H,),
            "midlayer.post_attention_layernorm.weight": (H,),
            "midlayer.self_attn.q_proj.weight": (HQ * D, 2 * H),
            "midlayer.self_attn.k_proj.weight": (HKV * D, 2 * H),
            "midlayer.self_attn.v_proj.weight": (HKV * D, 2 * H),
            "midlayer.self_attn.o_proj.weight": (H, HQ * D),
            "midlayer.mlp.gate_proj.weight": (F, H),
            "midlayer.mlp.up_proj.weight": (F, H),
            "midlayer.mlp.down_proj.weight": (H, F),
            "norm.weight": (H,),
            "lm_head.weight": (c.draft_vocab_size, H),
        }
        if c.own_embedding:
            shapes["embed_tokens.weight"] = (c.vocab_size, H)
        self.shapes = shapes
        self.weights = nn.ParameterDict({k.replace(".", "__"): nn.Parameter(torch.empty(s)) for k, s in shapes.items()})
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.weight_dtype = "model"  # set_weight_dtype_: "int8" streams the projections weight-only int8

    def w(self, key: str) -> torch.Tensor:
        return self.weights[key.replace(".", "__")]

    def set_weight_dtype_(self, weight_dtype: str) -> "Eagle3Head":
        """How inference reads the projection weights (fc, q|k|v, o, gate|up, down, lm_head): "model"
        in the head's dtype; "auto" (the configs' default): "int8" on a CUDA device for a head at least
        AUTO_INT8_HIDDEN wide, else "model" (``weight_dtype`` holds the choice); "int8": weight-only int8 with a scale per output row (ops.W8,
        kernels_triton/linear_w8.py) wherever a projection multiplies at most ops.W8_MAX_ROWS rows
        (draft rounds and extends at small batches: half the bytes), the head's own weights above
        that (prefill chunks, large batches). Drafts change, verification does not: output stays
        exact. Training reads the parameters themselves either way."""
        weight_dtype = resolve_weight_dtype(weight_dtype, self.config.hidden_size, self.w("fc.weight").device.type)
        self.weight_dtype = weight_dtype
        if weight_dtype == "int8" and self.w("fc.weight").device.type != "meta":
            self.fused_weights()  # quantized here, outside any CUDA graph capture
            for key in ("fc.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight",
                        "lm_head.weight"):
                self.proj(key)
        return self

    def proj(self, key: str, w: torch.Tensor | None = None):
        """The projection weight ``key`` (or the given derived weight ``w`` named key) as inference
        multiplies it: the parameter, or its ops.W8 under weight_dtype "int8" (made once per weight
        version, ops.derived)."""
        w = self.w(key) if w is None else w
        if self.weight_dtype != "int8":
            return w
        return ops.derived(self, "w8_" + key, (w,), lambda: ops.W8.of(w))

    def embed(self, token_ids: torch.Tensor, target) -> torch.Tensor:
        """[N] target token ids -> [N, H] embeddings: the head's own table when it has one (then its
        width is the head's, e.g. a head narrower than its target), else the target's."""
        if self.config.own_embedding:
            return self.w("embed_tokens.weight")[token_ids]
        return target.embed_tokens(token_ids)

    # -- construction / checkpoint I/O -----------------------------------------------------------
    def init_weights_(self, seed: int = 0) -> "Eagle3Head":
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for key in self.shapes:
                p = self.w(key)
                if key.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return self

    def set_vocab_(self, draft_to_target: torch.Tensor) -> None:
        """Draft vocabulary = the listed target ids (sorted ascending, as d2t offsets assume)."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.long).sort().values.to(self.d2t.device)
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"{ids.numel()} draft ids for draft_vocab_size {self.config.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def state_dict_official(self) -> dict[str, torch.Tensor]:
        sd = {k: self.w(k).detach().cpu().contiguous() for k in self.shapes}
        sd["d2t"] = self.d2t.cpu()
        sd["t2d"] = self.t2d.cpu()
        return sd

    def save(self, path: str | Path, extra_files: dict[str, str] | None = None, *,
             dtype: torch.dtype | None = None, shard_bytes: int | None = SHARD_BYTES) -> list[str]:
        """config.json + weights (``dtype``: cast floating tensors; default as held, fp32 after
        ``init_weights_``): one model.safetensors unless larger than ``shard_bytes``. Returns the
        weight file names."""
        path = Path(path)
        sd = self.state_dict_official()
        if dtype is not None:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        names = write_safetensors(path, sd, shard_bytes)
        cfg = self.config.to_hf()
        cfg["torch_dtype"] = str(sd["fc.weight"].dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        for name, text in (extra_files or {}).items():
            (path / name).write_text(text)
        return names

    @classmethod
    def load(cls, path: str | Path, *, device="cpu", dtype=None, backend="auto",
             target: ModelConfig | None = None) -> "Eagle3Head":
        """Load safetensors or pytorch_model.bin in the official layout; check it fits ``target``."""
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"draft checkpoint {path} has no config.json")
        raw = read_json_object(cfg_path, "the draft's config")
        sd = _read_state_dict(path)
        config = Eagle3Config.from_hf(raw, str(cfg_path), keys=sd.keys())
        if target is not None:
            if not config.target_layers:
                config.target_layers = default_capture_layers(target.num_hidden_layers)
            if config.vocab_size != target.vocab_size:
                raise CheckpointError(f"{cfg_path}: vocab_size {config.vocab_size} != target vocab "
                                      f"{target.vocab_size}")
            th = config.target_hidden_size or config.hidden_size
            if th != target.hidden_size:
                what = "target_hidden_size" if config.target_hidden_size else "hidden size"
                raise CheckpointError(f"{cfg_path}: {what} {th} does not match the target's {target.hidden_size} "
                                      "(fc reads the target's hidden states: 3 x target_hidden_size wide)")
            if config.hidden_size != target.hidden_size and not config.own_embedding:
                raise CheckpointError(f"{cfg_path}: hidden_size {config.hidden_size} differs from the target's "
                                      f"{target.hidden_size} and the checkpoint has no embed_tokens.weight: "
                                      "the target's embedding cannot feed this head")
            if max(config.target_layers) >= target.num_hidden_layers:
                raise CheckpointError(f"{cfg_path}: captured layers {config.target_layers} exceed "
                                      f"the target's {target.num_hidden_layers} layers")
        head = cls(config, backend=backend)
        missing = [k for k in head.shapes if k not in sd]
        identity = config.draft_vocab_size == config.vocab_size
        if not identity and "d2t" not in sd:
            missing.append("d2t")
        if missing:
            raise CheckpointError(f"draft checkpoint {path}: missing keys {missing}")
        with torch.no_grad():
            for key, shape in head.shapes.items():
                t = sd[key]
                if tuple(t.shape) != tuple(shape):
                    raise CheckpointError(f"draft checkpoint {path}: {key} has shape {tuple(t.shape)}, "
                                          f"config.json implies {tuple(shape)}")
                head.w(key).copy_(t.float())
            if identity:
                # The official loader drops d2t / t2d when the vocabularies are equal: draft id = target id.
                head.t2d.fill_(True)
            else:
                if tuple(sd["d2t"].shape) != (config.draft_vocab_size,):
                    raise CheckpointError(f"draft checkpoint {path}: d2t has shape {tuple(sd['d2t'].shape)}, "
                                          f"expected ({config.draft_vocab_size},) (draft_vocab_size)")
                head.d2t.copy_(sd["d2t"].long())
                ids = head.draft_to_target_table()
                if ids.min() < 0 or ids.max() >= config.vocab_size:
                    raise CheckpointError(f"draft checkpoint {path}: d2t maps draft ids outside the target "
                                          f"vocabulary 0..{config.vocab_size - 1}")
                if "t2d" in sd:
                    if tuple(sd["t2d"].shape) != (config.vocab_size,):
                        raise CheckpointError(f"draft checkpoint {path}: t2d has shape {tuple(sd['t2d'].shape)}, "
                                              f"expected ({config.vocab_size},) (vocab_size)")
                    head.t2d.copy_(sd["t2d"].bool())
                else:  # other engines skip t2d; it follows from d2t
                    head.t2d[ids] = True
        return head.to_device(device, dtype, max_positions=None if target is None
                              else target.max_position_embeddings)

    def to_device(self, device, dtype=None, max_positions: int | None = None) -> "Eagle3Head":
        """Move and cast; RoPE tables cover ``max_positions`` (the target's limit) when given."""
        self.weights.to(device=device, dtype=resolve_dtype(dtype, device))
        self.d2t, self.t2d = self.d2t.to(device), self.t2d.to(device)
        self.rope_cos = self.rope_sin = None
        self.ensure_rope_(max_positions or 0)
        self.fused_weights()  # built here, outside any CUDA graph capture
        self.draft_to_target_table()  # likewise
        return self

    def ensure_rope_(self, max_positions: int) -> None:
        """(Re)build the cos/sin tables to cover positions 0 .. max_positions + ROPE_SLACK - 1 (at least
        the head's own max_position_embeddings). A head's max_position_embeddings is not a context
        limit: published heads say 2048 while their targets run 128K, and the official code grows its
        RoPE cache on demand. Call outside CUDA graph capture (the engine's drafter does, at build)."""
        from kernels_triton.rope import rope_tables

        c = self.config
        n = max(c.max_position_embeddings, int(max_positions) + ROPE_SLACK if max_positions else 0)
        if self.rope_cos is not None and self.rope_cos.shape[0] >= n and self.rope_cos.device == self.device:
            return
        self.rope_cos, self.rope_sin = rope_tables(c.head_dim, n, c.rope_theta, c.rope_scaling, device=self.device)

    @property
    def device(self):
        return self.w("fc.weight").device

    @property
    def dtype(self):
        return self.w("fc.weight").dtype

    def new_kv_cache(self, num_pages: int, page_size: int):
        c = self.config
        shape = (1, num_pages, page_size, c.num_key_value_heads, c.head_dim)
        return (torch.zeros(shape, device=self.device, dtype=self.dtype),
                torch.zeros(shape, device=self.device, dtype=self.dtype))

    # -- forward ---------------------------------------------------------------------------------
    def embedding_table(self, target) -> torch.Tensor | None:
        """[vocab, H] the table ``embed`` reads: the head's own, else the target's when it holds the
        whole vocabulary (None for a tensor-parallel shard, whose lookup ``embed`` must call)."""
        if self.config.own_embedding:
            return self.w("embed_tokens.weight")
        table = getattr(target, "embed", None)
        if table is None or table.dim() != 2 or table.shape[0] != self.config.vocab_size:
            return None
        return table

    @ops.approximate()  # the draft need not be exact (engine.exact): its ops keep the default kernels
    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """[N, 3H] captured target features -> [N, H] draft input hidden."""
        return ops.mm(target_features, self.proj("fc.weight"), backend=self.backend)

    @ops.approximate()
    def fuse_rows(self, target_features: torch.Tensor, index: torch.Tensor, group: int) -> torch.Tensor:
        """``fuse`` of the rows ``index`` [G, W] picks from [G * group, 3H] features (row g * group +
        max(index[g, j], 0)) -> [G * W, H], the fc reading them itself: one launch for the gather, clamp
        and GEMM (callers check ``gathers_rows``)."""
        w = self.proj("fc.weight")
        return ops.linear(target_features.to(w.dtype), w, backend=self.backend, rows=(index, group))

    @ops.approximate()
    def gathers_rows(self, table: torch.Tensor, n: int, fc_features: torch.Tensor | None = None) -> bool:
        """Whether the draft layer reads n token rows of the embedding ``table`` inside its qkv kernel
        (and, with ``fc_features``, the fc its n feature rows): the fused path runs for n rows
        (specdec.models.ops.gathers_rows)."""
        if table is None:
            return False
        ids = torch.empty(1, n, dtype=torch.int32, device="meta")  # only its size is read
        wqkv = self.proj("wqkv", self.fused_weights()[0])
        ok = table.dtype == self.dtype and ops.gathers_rows(self.backend, table, wqkv, (ids, 0))
        if ok and fc_features is not None:
            ok = fc_features.dtype == self.dtype and ops.gathers_rows(self.backend, fc_features,
                                                                      self.proj("fc.weight"), (ids, 0))
        return ok

    def forward(self, token_embeds, hidden, positions, meta: ops.AttentionMeta, k_cache, v_cache,
                with_logits: bool = True, token_rows=None):
        """One draft layer. token_embeds, hidden: [N, H] -> (draft hidden [N, H] pre-norm, logits
        [N, draft_vocab] or None without ``with_logits``: callers that need a few rows' logits take
        ``logits(hidden[rows])``). ``hidden`` is ``fuse(features)`` or a previous draft hidden state.
        ``token_rows`` = (table [vocab, H], token ids [G, W] with G * W = N) instead of token_embeds: the
        embedding rows read by the qkv kernel itself (ids < 0 read row 0)."""
        out, sumsq = self.layer(token_embeds, hidden, positions, meta, k_cache, v_cache, token_rows)
        return out, (self.logits(out, sumsq) if with_logits else None)

    @ops.approximate()
    def layer(self, token_embeds, hidden, positions, meta: ops.AttentionMeta, k_cache, v_cache, token_rows=None):
        """The draft layer of :meth:`forward`: (draft hidden [N, H] pre-norm, its rows' sums of squares or
        None). Where the down projection runs on the streaming body
        (several rows: tree rounds, extends), it adds the residual in its epilogue (two roundings, as
        the training step computes) and hands :meth:`logits` the sums (``sumsq``), sparing the final
        norm's prologue launch; elsewhere the residual add is the projection's (one rounding) and the
        sums None."""
        c, be = self.config, self.backend
        N = hidden.shape[0]
        HQ, HKV, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        wqkv, w13 = self.fused_weights()
        wqkv, w13 = self.proj("wqkv", wqkv), self.proj("w13", w13)
        rows = None
        if token_rows is not None:
            token_embeds, ids = token_rows
            rows = (ids, 0)
        # [RMSNorm(embeds) | RMSNorm(hidden)] [N, 2H] -> qkv -> RoPE -> K/V into the draft cache (one launch
        # for few rows on the Triton backend, no concatenated copy).
        q, _ = ops.norm_qkv_rope_write_kv_(
            token_embeds, None, self.w("midlayer.input_layernorm.weight"), c.rms_norm_eps, wqkv, HQ, HKV, positions,
            self.rope_cos, self.rope_sin, k_cache[0], v_cache[0], meta.slot_mapping,
            hidden, self.w("midlayer.hidden_norm.weight"), backend=be, rows=rows)  # [N, HQ, D]
        o = ops.paged_attention(q, k_cache[0], v_cache[0], meta, backend=be)  # [N, HQ, D]
        # RMSNorm(attn + hidden) -> gate|up -> SwiGLU, then residual + act @ down. (Where the
        # o-projection adds the residual itself, attn is the sum and sumsq its rows' squares.)
        attn, residual, sumsq = ops.linear_residual(o.reshape(N, HQ * D), self.proj("midlayer.self_attn.o_proj.weight"),
                                                    hidden, backend=be)
        post_norm = self.w("midlayer.post_attention_layernorm.weight")
        folded = self.folded_weight("w13", w13, post_norm) if sumsq is not None and ops.norm_folding() else None
        act, residual = ops.norm_swiglu(attn, residual, post_norm, c.rms_norm_eps, w13, backend=be, sumsq=sumsq,
                                        folded=folded)  # [N, F]
        w_down = self.proj("midlayer.mlp.down_proj.weight")
        if ops.sums_squares(be, act, w_down):
            out, _, sumsq = ops.linear_residual(act, w_down, residual, backend=be)
            return out, sumsq
        return ops.linear(act, w_down, residual, backend=be), None  # [N, H]

    @ops.approximate()
    def logits(self, hidden: torch.Tensor, sumsq: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] pre-norm draft hidden -> [N, draft_vocab] logits (final norm + lm_head). ``sumsq``: the
        rows' sums of squares from :meth:`layer` (the norm then needs no prologue launch)."""
        nw, w = self.w("norm.weight"), self.proj("lm_head.weight")
        folded = self.folded_weight("lm_head", w, nw) if sumsq is not None and ops.norm_folding() else None
        return ops.norm_linear(hidden, None, nw, self.config.rms_norm_eps, w, backend=self.backend, sumsq=sumsq,
                               folded=folded)[0]

    def fused_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q|k|v [(HQ + 2 HKV) D, 2H], gate|up [2F, H]) for inference: one GEMM each. Rebuilt when a
        source weight changes (ops.derived)."""
        keys = ("midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                "midlayer.self_attn.v_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight")
        ws = [self.w(k) for k in keys]
        return ops.derived(self, "fused", ws, lambda: (torch.cat(ws[:3]).contiguous(), torch.cat(ws[3:]).contiguous()))

    def folded_weight(self, name: str, w: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        """w with the norm weight before it folded in (ops.fold_norm):
        gate|up with the post-attention norm, lm_head with the final norm; rebuilt when either changes."""
        return ops.derived(self, "folded_" + name, (w, norm_weight),
                           lambda: ops.fold_norm(w, norm_weight))

    def draft_to_target_table(self) -> torch.Tensor:
        """[draft_vocab] target id of each draft id (d2t holds offsets); rebuilt when d2t changes."""
        key = (self.d2t.data_ptr(), self.d2t._version)
        if getattr(self, "_d2t_key", None) != key:
            self._d2t_abs = self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)
            self._d2t_key = key
        return self._d2t_abs

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids: one gather."""
        return self.draft_to_target_table()[draft_ids]


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .loading import safetensors_files

    files = safetensors_files(path)
    sd: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            sd.update(load_file(str(f)))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"draft checkpoint {path}: cannot read safetensors: {e}") from e
    if not files:
        bin_path = path / "pytorch_model.bin"
        if not bin_path.is_file():
            raise CheckpointError(f"draft checkpoint {path} has no *.safetensors or pytorch_model.bin")
        try:
            sd = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for a corrupt pickle
            raise CheckpointError(f"{bin_path}: cannot read: {e}") from e
    return sd
