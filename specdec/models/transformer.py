"""The target model: one decoder-only transformer over a paged KV cache, its blocks chosen per family.

One forward serves prefill (a chunk of causal queries), decode (one query per request) and tree
verification (tree nodes with an ancestor mask): the difference lives entirely in
:class:`~specdec.models.ops.AttentionMeta`. A layer is RMSNorm (fused with the residual add), GQA
attention with RoPE at arbitrary positions over the paged KV, then RMSNorm and a SwiGLU MLP, dense or a
mixture of experts; tied or untied LM head. The family (config.json's ``model_type``,
specdec/models/families.py) switches the blocks: q/k/v bias (Qwen2), per-head q/k RMSNorm before RoPE
(Qwen3), MoE MLPs (Qwen3-MoE where decoder_sparse_step / mlp_only_layers say, Mixtral everywhere). The
forward can return the residual stream entering chosen layers (EAGLE-3 reads three of them).

Weights use fused projections: ``wqkv`` [(HQ + 2 HKV) * D, H] and, per dense layer, ``w13`` [2 F, H]
(gate | up); an MoE layer holds ``router`` [E, H], ``w13`` [E, 2 F, H] and ``w2`` [E, H, F]. A dense layer
is three calls around attention (``specdec.models.ops``): RMSNorm(h + residual) -> qkv -> RoPE -> K/V
written to the cache; o-projection; RMSNorm(h + residual) -> gate|up -> SwiGLU; then the down projection.
With few rows on the Triton backend each of them is one fused launch (kernels_triton/linear.py);
otherwise they run as Triton RMSNorm / RoPE + KV write / SwiGLU kernels around cuBLAS GEMMs. A bias or
qk-norm family keeps the fused RMSNorm + qkv launch and folds its bias add and per-head q/k norms into the
RoPE + KV write kernel: two launches for the attention input side (a Llama layer launches exactly what it
did). An MoE layer is RMSNorm(h + residual) and the fused MoE kernel (kernels_triton/moe.py: routing,
grouping and both grouped GEMMs, no host sync, capturable in every graph bucket).

Experts read: every MoE layer adds the number of (token, slot) pairs routed to each expert to
``expert_hits`` [L_moe, E] (the kernel's counter, an integer atomic); at the end of each forward the
count of distinct experts per layer (hits > 0) is added to ``moe_counts`` and the hits are zeroed, on
the device and inside whatever graph replays the forward (no host sync). :meth:`moe_stats` reads the
means (one sync: at the end of a run or a profile), :meth:`reset_moe_stats_` starts a window.

Routing: a random-weight MoE target may route by a stated model instead of its random router
(``routing``, an ExpertSteering of specdec/models/routing.py, set by apply_routing_; None: the router's
own choice): each forward selects its tokens' experts once (each MoE layer through its own expert
permutation), and every MoE layer's kernel raises those experts' router logits by the layer's margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import ops
from .families import ModelConfig, attention_names, dense_mlp_names, take_experts
from .loading import CheckpointError, load_safetensors, resolve_dtype


@dataclass
class ForwardOut:
    hidden: torch.Tensor  # [N, H] final-normed hidden states (feed to .logits)
    captured: torch.Tensor | None  # [N, len(capture_layers) * H] residual stream entering layers


def frozen_list(shapes) -> nn.ParameterList:
    return nn.ParameterList([nn.Parameter(torch.empty(*s), requires_grad=False) for s in shapes])


class ExpertStats:
    """Experts read per forward (module docstring) and the bytes a forward reads, for a model with ``config``,
    its weights (``embed``, ``lm_head``, ``w13`` / ``w2`` per layer), ``moe_slot`` (layer -> MoE row),
    ``kv_bytes_per_token()``, and ``expert_hits`` int32 [L_moe, E] and ``moe_counts`` int64 [L_moe + 2]
    buffers (init_expert_stats_)."""

    routing = None  # ExpertSteering (specdec/models/routing.py) or None: the router's own choice
    _selection = None  # the steered routing's [L_moe, N, K] int32 experts per MoE layer of the forward under way

    def init_expert_stats_(self, n_moe_layers: int, n_experts: int, device=None) -> None:
        self.register_buffer("expert_hits", torch.zeros(n_moe_layers, n_experts, dtype=torch.int32, device=device),
                             persistent=False)
        self.register_buffer("moe_counts", torch.zeros(n_moe_layers + 2, dtype=torch.int64, device=device),
                             persistent=False)

    def reset_moe_stats_(self) -> None:
        """Start a window of :meth:`moe_stats` (device work, no sync)."""
        self.moe_counts.zero_()
        self.expert_hits.zero_()

    def moe_stats(self) -> dict | None:
        """Experts read over the forwards since :meth:`reset_moe_stats_` (None for a dense model):
        ``forwards``, ``tokens_per_forward`` (rows, padding included: padded rows are routed and read
        experts too), ``distinct_experts_per_layer`` (mean over MoE layers and forwards of the experts
        a forward's tokens select), its per-layer means, and the model's ``experts`` and ``top_k``.
        One host sync."""
        if not self.moe_slot:
            return None
        Lm = len(self.moe_slot)
        counts = self.moe_counts.tolist()
        fwd = counts[Lm]
        per_layer = [d / fwd if fwd else 0.0 for d in counts[:Lm]]
        return {"forwards": fwd, "tokens_per_forward": counts[Lm + 1] / fwd if fwd else 0.0,
                "distinct_experts_per_layer": sum(per_layer) / Lm, "per_layer": per_layer,
                "experts": self.config.num_experts, "top_k": self.config.num_experts_per_tok}

    def step_read_bytes(self, distinct_experts_per_layer: float | None = None, kv_tokens: int = 0) -> dict:
        """Bytes a forward must read (the step-time floor's numerator): ``weights``, every parameter once
        except an untied embedding table (a step reads only its rows) and, of each MoE layer, only the
        ``distinct_experts_per_layer`` experts the forward's tokens select (all of them when None); ``kv``,
        ``kv_tokens`` slots of every layer's K and V (each row's context); and their ``total``."""
        params = sum(p.numel() * p.element_size() for p in self.parameters())
        if self.lm_head is not None:
            params -= self.embed.numel() * self.embed.element_size()
        if self.moe_slot and distinct_experts_per_layer is not None:
            experts = sum(w[i].numel() * w[i].element_size() for i in self.moe_slot for w in (self.w13, self.w2))
            params -= experts * (1 - float(distinct_experts_per_layer) / self.config.num_experts)
        kv = int(kv_tokens) * self.kv_bytes_per_token()
        return {"weights": int(params), "kv": kv, "total": int(params) + kv}

    def _count_experts_(self, n_tokens: int) -> None:
        Lm = len(self.moe_slot)
        self.moe_counts[:Lm] += torch.count_nonzero(self.expert_hits, dim=-1)  # [L_moe] distinct experts
        self.moe_counts[Lm] += 1
        self.moe_counts[Lm + 1] += n_tokens
        self.expert_hits.zero_()


class TransformerModel(ExpertStats, nn.Module):
    def __init__(self, config: ModelConfig, *, backend: str = "auto"):
        super().__init__()
        c = self.config = config
        self.backend = ops.check_backend(backend)
        H, D, HQ, HKV, F = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
        L = c.num_hidden_layers
        self.embed = nn.Parameter(torch.empty(c.vocab_size, H), requires_grad=False)
        self.lm_head = None if c.tie_word_embeddings else nn.Parameter(torch.empty(c.vocab_size, H),
                                                                       requires_grad=False)
        self.norm = nn.Parameter(torch.empty(H), requires_grad=False)
        self.attn_norm, self.mlp_norm = frozen_list([(H,)] * L), frozen_list([(H,)] * L)
        self.wqkv, self.wo = frozen_list([((HQ + 2 * HKV) * D, H)] * L), frozen_list([(H, HQ * D)] * L)
        self.bqkv = frozen_list([((HQ + 2 * HKV) * D,)] * L) if c.qkv_bias else None
        self.q_norm = frozen_list([(D,)] * L) if c.qk_norm else None
        self.k_norm = frozen_list([(D,)] * L) if c.qk_norm else None
        # Per layer: dense [2F, H] / [H, F], or an MoE layer's experts [E, 2Fe, H] / [E, H, Fe].
        E, Fe = c.num_experts, c.moe_intermediate_size
        moe = set(c.moe_layers)
        self.w13 = frozen_list([(E, 2 * Fe, H) if i in moe else (2 * F, H) for i in range(L)])
        self.w2 = frozen_list([(E, H, Fe) if i in moe else (H, F) for i in range(L)])
        self.moe_slot = {layer: j for j, layer in enumerate(c.moe_layers)}  # layer -> its row of router / hits
        self.router = frozen_list([(E, H)] * len(c.moe_layers))
        Lm = len(c.moe_layers)
        # Experts read (module docstring): hits of the forward under way, and per MoE layer the sum over
        # forwards of its distinct experts, then the forwards and their tokens.
        self.init_expert_stats_(Lm, E)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, *, device="cpu", dtype=None, backend="auto") -> "TransformerModel":
        """Load a Hugging Face checkpoint directory of a supported family (families.SUPPORTED), cast
        to ``dtype`` (auto: bf16 on GPU) as each tensor is taken (no fp32 copy of a bf16 checkpoint)."""
        config = ModelConfig.from_dir(path)
        tensors = load_safetensors(path)
        model = cls(config, backend=backend)  # untouched torch.empty: load_hf_state_dict_ sets every tensor
        model.load_hf_state_dict_(tensors, source=str(path), dtype=resolve_dtype(dtype, device))
        return model.to(device=device).init_rope()

    @classmethod
    def random(cls, config: ModelConfig, *, device="cpu", dtype=None, seed=0, backend="auto"):
        """Random weights with real shapes (systems studies): normal, std 0.02; norms 1. The weights
        are drawn directly on ``device`` in ``dtype`` (auto: bf16 on GPU): building 8B parameters
        in fp32 on the host first would take 32 GB of host memory and tens of seconds, and a
        Qwen3-30B-A3B-shape model holds its 61 GB of bf16 weights once (no fp32 or second copy)."""
        dtype = resolve_dtype(dtype, device)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # nn.Parameter(torch.empty(...)) in __init__ takes it
        try:
            with torch.device(device):
                model = cls(config, backend=backend)
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

    def load_hf_state_dict_(self, sd: dict[str, torch.Tensor], source: str = "checkpoint", dtype=None) -> None:
        """Set every weight from a Hugging Face state dict (families.py names the tensors), each cast to
        ``dtype`` (default the model's). Tensors are popped from ``sd`` as they are taken."""
        c = self.config
        dtype = dtype or self.dtype

        def take(name, shape):
            if name not in sd:
                raise CheckpointError(f"{source}: missing tensor {name}")
            t = sd.pop(name)
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{source}: {name} has shape {tuple(t.shape)}, config.json "
                                      f"implies {tuple(shape)}")
            return t.to(dtype)

        def put(p: nn.Parameter, t: torch.Tensor):
            p.data = t.contiguous()

        H, D, F = c.hidden_size, c.head_dim, c.intermediate_size
        HQ, HKV = c.num_attention_heads, c.num_key_value_heads
        with torch.no_grad():
            put(self.embed, take("model.embed_tokens.weight", (c.vocab_size, H)))
            put(self.norm, take("model.norm.weight", (H,)))
            if self.lm_head is not None:
                put(self.lm_head, take("lm_head.weight", (c.vocab_size, H)))
            for i in range(c.num_hidden_layers):
                n = attention_names(i)
                put(self.attn_norm[i], take(n["attn_norm"], (H,)))
                put(self.mlp_norm[i], take(n["mlp_norm"], (H,)))
                put(self.wqkv[i], torch.cat([take(n["q"], (HQ * D, H)), take(n["k"], (HKV * D, H)),
                                             take(n["v"], (HKV * D, H))]))
                put(self.wo[i], take(n["o"], (H, HQ * D)))
                if self.bqkv is not None:
                    put(self.bqkv[i], torch.cat([take(n["bq"], (HQ * D,)), take(n["bk"], (HKV * D,)),
                                                 take(n["bv"], (HKV * D,))]))
                if self.q_norm is not None:
                    put(self.q_norm[i], take(n["q_norm"], (D,)))
                    put(self.k_norm[i], take(n["k_norm"], (D,)))
                j = self.moe_slot.get(i)
                if j is None:
                    gate, up, down = dense_mlp_names(i)
                    put(self.w13[i], torch.cat([take(gate, (F, H)), take(up, (F, H))]))
                    put(self.w2[i], take(down, (H, F)))
                else:
                    shapes = dict(E=c.num_experts, H=H, F=c.moe_intermediate_size)
                    router, w13, w2 = take_experts(sd, c.model_type, i, shapes, dtype, source)
                    put(self.router[j], router)
                    put(self.w13[i], w13)
                    put(self.w2[i], w2)

    def init_rope(self) -> "TransformerModel":
        from kernels_triton.rope import rope_tables

        c = self.config
        self.rope_cos, self.rope_sin = rope_tables(c.head_dim, c.max_position_embeddings, c.rope_theta,
                                                   c.rope_scaling, device=self.embed.device)
        return self

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def new_kv_cache(self, num_pages: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V page pools for all layers: two tensors [L, P, PS, HKV, D]."""
        c = self.config
        shape = (c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads, c.head_dim)
        return (torch.zeros(shape, device=self.device, dtype=self.dtype),
                torch.zeros(shape, device=self.device, dtype=self.dtype))

    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.embed.element_size()

    def norm_folded_weights(self) -> tuple[list, list]:
        """(wqkv, w13) of every layer with its norm weight folded into the input columns
        (ops.fold_norm; None for an MoE layer's experts, which take the norm unfused), for the fused
        norm ops that get row sums; made on first use (an eager run before any graph capture) and
        again when a source weight changes (tensor versions are compared)."""
        return ops.derived(self, "norm_folded", [*self.wqkv, *self.attn_norm, *self.w13, *self.mlp_norm],
                           lambda: ([ops.fold_norm(w, n) for w, n in zip(self.wqkv, self.attn_norm)],
                                    [ops.fold_norm(w, n) if w.dim() == 2 else None
                                     for w, n in zip(self.w13, self.mlp_norm)]))

    # -- forward --------------------------------------------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[input_ids]  # [N, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed if self.lm_head is None else self.lm_head
        return ops.linear(hidden, w, backend=self.backend)  # [N, H] @ [H, V] -> [N, V]

    def attention_extras(self, i: int) -> dict:
        """Layer i's q/k/v bias and q/k norms (the families that have them), as norm_qkv_rope_write_kv_ takes them."""
        return {"bias": None if self.bqkv is None else self.bqkv[i],
                "q_norm": None if self.q_norm is None else self.q_norm[i],
                "k_norm": None if self.k_norm is None else self.k_norm[i]}

    def moe_(self, i: int, h, residual):
        """MoE layer i over the attention block's output: (experts' output [N, H], s = h + residual)."""
        c, j = self.config, self.moe_slot[i]
        steer = None if self._selection is None else (self._selection[j], self.routing.margins[j])
        return ops.moe_norm(h, residual, self.mlp_norm[i], c.rms_norm_eps, self.router[j], self.w13[i], self.w2[i],
                            c.num_experts_per_tok, c.norm_topk_prob, expert_hits=self.expert_hits[j], steer=steer,
                            backend=self.backend)  # ([N, H], [N, H])

    @torch.no_grad()
    def forward(self, input_ids, positions, meta: ops.AttentionMeta, k_cache, v_cache,
                capture_layers: tuple[int, ...] = ()) -> ForwardOut:
        """input_ids, positions: [N]; k_cache/v_cache: [L, P, PS, HKV, D] (written in place)."""
        c, be = self.config, self.backend
        N = input_ids.shape[0]
        HQ, HKV, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = self.embed_tokens(input_ids)  # [N, H]
        if self.routing is not None:
            self._selection = self.routing.selection(input_ids, positions, meta)  # [L_moe, N, K] steered
        residual = sumsq = None
        fq = f13 = [None] * c.num_hidden_layers
        if ops.norm_folding(be, h, self.wo[0]):  # folded norms on these rows: norm weights in wqkv / w13
            fq, f13 = self.norm_folded_weights()
        captured = []
        for i in range(c.num_hidden_layers):
            # RMSNorm(h + residual) -> qkv (+ bias, q/k norms) -> RoPE -> K/V into this layer's cache slots;
            # s = h + residual is the residual stream entering layer i. (Where the projection before added
            # the residual itself, h is s, residual None and sumsq its rows' squares: ops.linear_residual.)
            q, residual = ops.norm_qkv_rope_write_kv_(
                h, residual, self.attn_norm[i], c.rms_norm_eps, self.wqkv[i], HQ, HKV, positions,
                self.rope_cos, self.rope_sin, k_cache[i], v_cache[i], meta.slot_mapping, backend=be,
                sumsq=sumsq, folded=fq[i], **self.attention_extras(i))  # [N, HQ, D]
            if i in capture_layers:
                captured.append(residual)
            o = ops.paged_attention(q, k_cache[i], v_cache[i], meta, backend=be)  # [N, HQ, D]
            h, residual, sumsq = ops.linear_residual(o.reshape(N, HQ * D), self.wo[i], residual, backend=be)  # [N, H]
            if i in self.moe_slot:
                h, residual = self.moe_(i, h, residual)  # [N, H]
                sumsq = None
                continue
            x, residual = ops.norm_swiglu(h, residual, self.mlp_norm[i], c.rms_norm_eps, self.w13[i],
                                          backend=be, sumsq=sumsq, folded=f13[i])  # [N, F]
            h, residual, sumsq = ops.linear_residual(x, self.w2[i], residual, backend=be)  # [N, F] @ [F, H]
        out = ops.rms_norm(h, self.norm, c.rms_norm_eps, residual, backend=be)
        if residual is not None:
            out = out[0]  # (normed, h + residual)
        if self.moe_slot:
            self._count_experts_(N)
        cap = None
        if capture_layers:
            order = sorted(capture_layers)
            cap = torch.cat([captured[order.index(layer)] for layer in capture_layers], dim=-1)
        return ForwardOut(out, cap)


def load_target(path: str | Path, *, device="cpu", dtype=None, backend="auto") -> TransformerModel:
    return TransformerModel.from_pretrained(path, device=device, dtype=dtype, backend=backend)
