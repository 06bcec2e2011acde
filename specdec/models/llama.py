"""Llama-architecture target model over a paged KV cache.

One forward serves prefill (a chunk of causal queries), decode (one query per request) and tree
verification (tree nodes with an ancestor mask): the difference lives entirely in
:class:`~specdec.models.ops.AttentionMeta`. Layers: RMSNorm (fused with the residual add), RoPE at
arbitrary positions (Llama-3 scaling from config.json), GQA attention over paged KV, SwiGLU MLP,
tied or untied LM head. The forward can return the residual stream entering chosen layers
(EAGLE-3 reads three of them).

Weights use fused projections: ``wqkv`` [(HQ + 2 HKV) * D, H] and ``w13`` [2 F, H] (gate | up).
A layer is three calls around attention (``specdec.models.ops``): RMSNorm(h + residual) -> qkv ->
RoPE -> K/V written to the cache; o-projection; RMSNorm(h + residual) -> gate|up -> SwiGLU; then the
down projection. With few rows (N <= ops.FUSED_MAX_ROWS: decode at small batch) and small weights on the
Triton backend each of them is one fused launch (kernels_triton/linear.py, five per layer with
attention); otherwise (prefill, tree verify, large batches or large models) they run as Triton
RMSNorm / RoPE + KV write / SwiGLU kernels around cuBLAS GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import ops
from .loading import CheckpointError, LlamaConfig, load_safetensors, resolve_dtype


@dataclass
class ForwardOut:
    hidden: torch.Tensor  # [N, H] final-normed hidden states (feed to .logits)
    captured: torch.Tensor | None  # [N, len(capture_layers) * H] residual stream entering layers


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, *, backend: str = "auto"):
        super().__init__()
        c = self.config = config
        self.backend = ops.check_backend(backend)
        H, D, HQ, HKV, F = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
        L = c.num_hidden_layers
        self.embed = nn.Parameter(torch.empty(c.vocab_size, H), requires_grad=False)
        self.lm_head = None if c.tie_word_embeddings else nn.Parameter(torch.empty(c.vocab_size, H), requires_grad=False)
        self.norm = nn.Parameter(torch.empty(H), requires_grad=False)
        p = lambda *shape: nn.ParameterList(  # noqa: E731
            [nn.Parameter(torch.empty(*shape), requires_grad=False) for _ in range(L)])
        self.attn_norm, self.mlp_norm = p(H), p(H)
        self.wqkv, self.wo = p((HQ + 2 * HKV) * D, H), p(H, HQ * D)
        self.w13, self.w2 = p(2 * F, H), p(H, F)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, *, device="cpu", dtype=None, backend="auto") -> "LlamaModel":
        """Load a Hugging Face Llama checkpoint directory, cast to ``dtype`` (auto: bf16 on GPU)."""
        config = LlamaConfig.from_dir(path)
        tensors = load_safetensors(path)
        model = cls(config, backend=backend)
        model.load_hf_state_dict(tensors, source=str(path))
        return model.to(device=device, dtype=resolve_dtype(dtype, device)).init_rope()

    @classmethod
    def random(cls, config: LlamaConfig, *, device="cpu", dtype=None, seed=0, backend="auto"):
        """Random weights with real shapes (systems studies): normal, std 0.02; norms 1. The weights
        are drawn directly on ``device`` in ``dtype`` (auto: bf16 on GPU): building 8B parameters
        in fp32 on the host first would take 32 GB of host memory and tens of seconds."""
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

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        c = self.config

        def take(name, shape):
            if name not in sd:
                raise CheckpointError(f"{source}: missing tensor {name}")
            t = sd[name]
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{source}: {name} has shape {tuple(t.shape)}, config.json "
                                      f"implies {tuple(shape)}")
            return t.float()

        H, D, F = c.hidden_size, c.head_dim, c.intermediate_size
        HQ, HKV = c.num_attention_heads, c.num_key_value_heads
        with torch.no_grad():
            self.embed.data = take("model.embed_tokens.weight", (c.vocab_size, H))
            self.norm.data = take("model.norm.weight", (H,))
            if self.lm_head is not None:
                self.lm_head.data = take("lm_head.weight", (c.vocab_size, H))
            for i in range(c.num_hidden_layers):
                pre = f"model.layers.{i}."
                self.attn_norm[i].data = take(pre + "input_layernorm.weight", (H,))
                self.mlp_norm[i].data = take(pre + "post_attention_layernorm.weight", (H,))
                self.wqkv[i].data = torch.cat([take(pre + "self_attn.q_proj.weight", (HQ * D, H)),
                                               take(pre + "self_attn.k_proj.weight", (HKV * D, H)),
                                               take(pre + "self_attn.v_proj.weight", (HKV * D, H))])
                self.wo[i].data = take(pre + "self_attn.o_proj.weight", (H, HQ * D))
                self.w13[i].data = torch.cat([take(pre + "mlp.gate_proj.weight", (F, H)),
                                              take(pre + "mlp.up_proj.weight", (F, H))])
                self.w2[i].data = take(pre + "mlp.down_proj.weight", (H, F))

    def init_rope(self) -> "LlamaModel":
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

    def norm_folded_weights(self) -> tuple[list, list]:
        """(wqkv, w13) of every layer with its norm weight folded into the input columns
        (ops.fold_norm), for the kernel option norm_stats "fold"; made on first use (an eager run before
        any graph capture) and again when a source weight changes (tensor versions are compared)."""
        return ops.derived(self, "norm_folded", [*self.wqkv, *self.attn_norm, *self.w13, *self.mlp_norm],
                           lambda: ([ops.fold_norm(w, n) for w, n in zip(self.wqkv, self.attn_norm)],
                                    [ops.fold_norm(w, n) for w, n in zip(self.w13, self.mlp_norm)]))

    # -- forward --------------------------------------------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[input_ids]  # [N, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed if self.lm_head is None else self.lm_head
        return ops.linear(hidden, w, backend=self.backend)  # [N, H] @ [H, V] -> [N, V]

    @torch.no_grad()
    def forward(self, input_ids, positions, meta: ops.AttentionMeta, k_cache, v_cache,
                capture_layers: tuple[int, ...] = ()) -> ForwardOut:
        """input_ids, positions: [N]; k_cache/v_cache: [L, P, PS, HKV, D] (written in place)."""
        c, be = self.config, self.backend
        N = input_ids.shape[0]
        HQ, HKV, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = self.embed_tokens(input_ids)  # [N, H]
        residual = sumsq = None
        fq = f13 = [None] * c.num_hidden_layers
        if ops.norm_folding(be, h, self.wo[0]):  # norm_stats "fold" on these rows: norm weights in wqkv / w13
            fq, f13 = self.norm_folded_weights()
        captured = []
        for i in range(c.num_hidden_layers):
            # RMSNorm(h + residual) -> qkv -> RoPE -> K/V into this layer's cache slots; s = h + residual
            # is the residual stream entering layer i. (Where the projection before added the residual
            # itself, h is s, residual None and sumsq its rows' squares: ops.linear_residual.)
            q, residual = ops.norm_qkv_rope_write_kv_(
                h, residual, self.attn_norm[i], c.rms_norm_eps, self.wqkv[i], HQ, HKV, positions,
                self.rope_cos, self.rope_sin, k_cache[i], v_cache[i], meta.slot_mapping, backend=be,
                sumsq=sumsq, folded=fq[i])  # [N, HQ, D]
            if i in capture_layers:
                captured.append(residual)
            o = ops.paged_attention(q, k_cache[i], v_cache[i], meta, backend=be)  # [N, HQ, D]
            h, residual, sumsq = ops.linear_residual(o.reshape(N, HQ * D), self.wo[i], residual, backend=be)  # [N, H]
            x, residual = ops.norm_swiglu(h, residual, self.mlp_norm[i], c.rms_norm_eps, self.w13[i],
                                          backend=be, sumsq=sumsq, folded=f13[i])  # [N, F]
            h, residual, sumsq = ops.linear_residual(x, self.w2[i], residual, backend=be)  # [N, F] @ [F, H]
        out = ops.rms_norm(h, self.norm, c.rms_norm_eps, residual, backend=be)
        if residual is not None:
            out = out[0]  # (normed, h + residual)
        cap = None
        if capture_layers:
            order = sorted(capture_layers)
            cap = torch.cat([captured[order.index(layer)] for layer in capture_layers], dim=-1)
        return ForwardOut(out, cap)


def load_target(path: str | Path, *, device="cpu", dtype=None, backend="auto") -> LlamaModel:
    return LlamaModel.from_pretrained(path, device=device, dtype=dtype, backend=backend)
