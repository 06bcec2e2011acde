"""The target model sharded over a tensor-parallel group (Megatron-style), one shard per rank.

Sharding of each layer for world size W at rank r (HQ query heads, HKV KV heads, F FFN width):

* ``wqkv`` column-parallel: rank r keeps query heads r*HQ/W .. (r+1)*HQ/W - 1 and the KV heads they
  read. With HKV >= W each rank keeps HKV/W KV heads; with HKV < W (W a multiple of HKV) a KV head is
  replicated on the W/HKV ranks whose query heads share it (each rank keeps one).
* ``wo`` row-parallel over the same query heads: its output is a partial sum, all-reduced.
* q/k/v bias (Qwen2) sharded with the rows of ``wqkv``; q/k norms (Qwen3) replicated: one weight [D]
  per layer shared by the heads, applied to each of the rank's own heads.
* ``w13`` column-parallel over F (rank r's gate rows and its up rows), ``w2`` row-parallel: all-reduced.
* MoE layers (Qwen3-MoE, Mixtral): every expert sharded along its intermediate dimension on every rank,
  as a dense MLP is (expert e's w13 [2F, H] column-parallel, its w2 [H, F] row-parallel); the router
  replicated, so every rank routes every token alike and runs the fused MoE kernel over its slices of
  the experts the tokens select; the combined output is a partial sum, all-reduced like w2's. (Expert
  parallelism, whole experts per rank, would move tokens instead: not implemented.)
* embedding and LM head vocab-parallel: rank r owns rows r*V/W .. (V rounded up to a multiple of W, zero
  padding). Lookup: ids outside the shard read zero, then an all-reduce (exact: one term is non-zero).
  Logits: each rank's [N, V/W] block, then an all-gather of the rows into [N, V] on every rank, so the
  verify / accept kernel sees exactly the logits a single device computes and greedy and sampled
  verification stay exact with no change (the gather moves N*V values per step, ~0.2 MB at N = 1 for
  SmolLM2's vocabulary in fp32; a vocab-parallel argmax would move less but needs a parallel
  sampler too: #25 measures).
* norms replicated; each rank's paged KV pools hold its own KV heads only ([L, P, PS, HKV/W, D]).

Every residual-stream tensor (h after each all-reduce, the captured EAGLE-3 features, the final hidden
state) is full-width and identical on every rank. That is why the EAGLE-3 head is replicated: it reads
3 captured layers of width H, which every rank has without communication, and it is a single layer
(the 8B-shape head is ~0.8 GB of bf16 weights beside the target's 16 GB); sharding it would add two
all-reduces per draft step (12.5 us each on two H200s inside a graph, FACTS.md) to each of the 5-7
sequential draft steps of a tree, where batch-1 latency is what speculation buys.

Layer boundaries (``allreduce``): ``"nccl"`` all-reduces the partial sum with the device group's
collective (NCCL on GPU, gloo on CPU) and keeps the single-device layer ops (norm fused into the next
projection); ``"fused"`` writes the partial sum into a symmetric-memory buffer and runs
``kernels_triton.fused_norm_allreduce`` (peer reads + residual add + RMSNorm, one launch), then the next
projection without a norm. At world size 1 ``"fused"`` is the kernel's no-communication path, used
wherever the single-device step runs a standalone add + RMSNorm (the final norm, and forwards too large
for the fused GEMV: prefill, tree verify, large batches); where the next projection's GEMV fuses the add
+ norm itself (decode at <= 16 rows), that stays, so the world-size-1 step launches no extra kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from . import ops
from .transformer import ExpertStats, ForwardOut, TransformerModel

ALLREDUCE = ("nccl", "fused")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp_shapes(config, size: int, what: str = "the target") -> None:
    """Raise ConfigError naming tp.size and the dimension it does not divide (and the valid sizes)."""
    HQ, HKV = config.num_attention_heads, config.num_key_value_heads
    widths = []  # (name, width) of every FFN the ranks split
    if len(getattr(config, "moe_layers", ())) < config.num_hidden_layers:
        widths.append(("FFN width", config.intermediate_size))
    if getattr(config, "moe_layers", ()):
        widths.append(("expert FFN width", config.moe_intermediate_size))
    if size < 1:
        raise ConfigError(f"tp.size={size}: must be an integer >= 1")
    valid = [d for d in divisors(HQ) if all(F % d == 0 for _, F in widths) and (HKV % d == 0 or d % HKV == 0)]
    problems = []
    if HQ % size:
        problems.append(f"its {HQ} query heads")
    if HKV % size and size % HKV:
        problems.append(f"its {HKV} KV heads (nor is it a multiple of them)")
    for name, F in widths:
        if F % size:
            problems.append(f"its {name} {F}")
    if problems:
        raise ConfigError(f"tp.size={size} does not fit {what}: it does not divide {', '.join(problems)}; "
                          f"valid tp sizes for {what}: {', '.join(map(str, valid))}")


class TPTransformerModel(ExpertStats, nn.Module):
    """One rank's shard of a :class:`~specdec.models.transformer.TransformerModel` (see the module
    docstring). ``config`` is the full model's (drafters and the engine read the real shapes); the
    shard's own sizes are ``n_q_heads``, ``n_kv_heads``, ``ffn``, ``expert_ffn``, ``vocab_shard``."""

    def __init__(self, full: TransformerModel, group, *, allreduce: str = "nccl", symm_rows: int = 256):
        super().__init__()
        if allreduce not in ALLREDUCE:
            raise ConfigError(f"tp.allreduce={allreduce!r}; valid: {', '.join(ALLREDUCE)}")
        c = self.config = full.config
        W, r = group.size, group.rank
        check_tp_shapes(c, W)
        if allreduce == "fused" and full.device.type != "cuda":
            raise ConfigError("tp.allreduce=fused needs CUDA (symmetric memory); on CPU use tp.allreduce=nccl "
                              "(gloo's all-reduce)")
        self.group, self.backend, self.allreduce = group, full.backend, allreduce
        HQ, HKV, D, F, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size, c.hidden_size
        Fe = c.moe_intermediate_size
        self.n_q_heads, self.ffn, self.expert_ffn = HQ // W, F // W, Fe // W
        self.n_kv_heads = HKV // W if HKV >= W else 1
        kv0 = r * self.n_kv_heads if HKV >= W else r // (W // HKV)  # first KV head this rank keeps
        q0 = r * self.n_q_heads
        V = c.vocab_size
        self.vocab_shard = -(-V // W)
        self.vocab_start = r * self.vocab_shard

        def vocab_rows(w):  # [V, H] -> this rank's [V/W, H] rows, zero-padded past V
            out = torch.zeros((self.vocab_shard, H), dtype=w.dtype, device=w.device)
            rows = w[self.vocab_start:self.vocab_start + self.vocab_shard]
            out[: rows.shape[0]] = rows
            return nn.Parameter(out, requires_grad=False)

        frozen = lambda t: nn.Parameter(t.contiguous().clone(), requires_grad=False)  # noqa: E731
        frozen_all = lambda ws: nn.ParameterList([frozen(w) for w in ws])  # noqa: E731
        kv = slice(kv0 * D, (kv0 + self.n_kv_heads) * D)
        qs = slice(q0 * D, (q0 + self.n_q_heads) * D)

        def heads(t):  # wqkv [(HQ + 2 HKV) D, ...] or its bias -> this rank's q | k | v rows
            q, k, v = t.split([HQ * D, HKV * D, HKV * D])
            return torch.cat([q[qs], k[kv], v[kv]])

        def cols(t, width, f):  # gate | up rows (dim -2) of a dense [2F, H] or experts' [E, 2F, H] w13
            gate, up = t.split([width, width], dim=-2)
            return torch.cat([gate[..., r * f:(r + 1) * f, :], up[..., r * f:(r + 1) * f, :]], dim=-2)

        self.embed = vocab_rows(full.embed)
        self.lm_head = None if full.lm_head is None else vocab_rows(full.lm_head)
        self.norm = frozen(full.norm)
        self.attn_norm, self.mlp_norm = frozen_all(full.attn_norm), frozen_all(full.mlp_norm)
        self.wqkv = frozen_all(heads(w) for w in full.wqkv)
        self.wo = frozen_all(w[:, qs] for w in full.wo)
        self.bqkv = None if full.bqkv is None else frozen_all(heads(b) for b in full.bqkv)
        self.q_norm = None if full.q_norm is None else frozen_all(full.q_norm)
        self.k_norm = None if full.k_norm is None else frozen_all(full.k_norm)
        self.moe_slot = dict(full.moe_slot)
        w13, w2 = [], []
        for i in range(c.num_hidden_layers):
            width, f = (Fe, self.expert_ffn) if i in self.moe_slot else (F, self.ffn)
            w13.append(cols(full.w13[i], width, f))
            w2.append(full.w2[i][..., r * f:(r + 1) * f])  # [H, F/W] or the experts' [E, H, F/W]
        self.w13, self.w2 = frozen_all(w13), frozen_all(w2)
        self.router = frozen_all(full.router)
        self.init_expert_stats_(len(self.moe_slot), c.num_experts, device=full.device)
        self.rope_cos, self.rope_sin = full.rope_cos, full.rope_sin
        self._symm = None
        if allreduce == "fused":
            from kernels_triton.fused_norm_allreduce import SymmBuffer

            # Partial sums of up to symm_rows tokens go through the one-shot kernel; longer forwards
            # (prefill chunks) take NCCL + the norm, where one-shot's W-fold reads stop paying.
            self._symm = SymmBuffer(symm_rows, H, self.dtype, self.device, group.group if W > 1 else None)

    @classmethod
    def shard(cls, full: TransformerModel, group, *, allreduce: str = "nccl") -> "TPTransformerModel":
        return cls(full, group, allreduce=allreduce)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def init_rope(self) -> "TPTransformerModel":
        return self

    def new_kv_cache(self, num_pages: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K and V pools: [L, P, PS, HKV/W, D] each (its own KV heads only)."""
        c = self.config
        shape = (c.num_hidden_layers, num_pages, page_size, self.n_kv_heads, c.head_dim)
        return (torch.zeros(shape, device=self.device, dtype=self.dtype),
                torch.zeros(shape, device=self.device, dtype=self.dtype))

    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.num_hidden_layers * self.n_kv_heads * c.head_dim * self.embed.element_size()

    # -- forward --------------------------------------------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-width embeddings [N, H] on every rank (vocab-parallel lookup + all-reduce)."""
        local = input_ids - self.vocab_start  # [N]
        inside = (local >= 0) & (local < self.vocab_shard)  # [N] bool
        h = self.embed[local.clamp(0, self.vocab_shard - 1)] * inside[:, None].to(self.dtype)  # [N, H]
        return self.group.all_reduce_(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits [N, V] on every rank: this rank's [N, V/W] block, gathered over the vocab."""
        w = self.embed if self.lm_head is None else self.lm_head
        part = ops.linear(hidden, w, backend=self.backend)  # [N, H] @ [H, V/W] -> [N, V/W]
        return self.group.all_gather_cols(part)[:, : self.config.vocab_size]  # [N, V]

    def _boundary(self, h, residual, weight, eps, next_w=None, swiglu=False):
        """Layer boundary over a partial sum h [N, H]. Fused kernel: (RMSNorm(s) * weight, s, True)
        with s = sum over ranks of h + residual. Otherwise (sum over ranks of h, residual, False):
        the next op fuses the residual add and the norm into its projection, as on one device."""
        N = h.shape[0]
        if self._symm is not None and N <= self._symm.rows:
            from kernels_triton.fused_norm_allreduce import fused_norm_allreduce

            if (self.group.size == 1 and next_w is not None
                    and ops._fused(self.backend, h, next_w, one_row_any_size=True, swiglu=swiglu)):
                # World size 1, few rows: the next projection's GEMV fuses the add + norm itself (one
                # launch fewer than kernel + GEMV); with nothing to all-reduce that is the cheaper boundary.
                return h, residual, False

            y, s = fused_norm_allreduce(h, residual, weight, eps, self._symm)
            return y, s, True
        return self.group.all_reduce_(h), residual, False

    def attention_extras(self, i: int) -> dict:
        return TransformerModel.attention_extras(self, i)

    @torch.no_grad()
    def forward(self, input_ids, positions, meta: ops.AttentionMeta, k_cache, v_cache,
                capture_layers: tuple[int, ...] = ()) -> ForwardOut:
        """As TransformerModel.forward, over this rank's heads and FFN columns; k_cache/v_cache:
        [L, P, PS, HKV/W, D]."""
        c, be = self.config, self.backend
        N = input_ids.shape[0]
        HQ, HKV, D, eps = self.n_q_heads, self.n_kv_heads, c.head_dim, c.rms_norm_eps
        h = self.embed_tokens(input_ids)  # [N, H] full (already reduced)
        residual, normed = None, False
        captured = []
        for i in range(c.num_hidden_layers):
            moe_j = self.moe_slot.get(i)
            # normed: h is RMSNorm(s) already (the fused boundary), residual = s
            q, s = ops.norm_qkv_rope_write_kv_(
                h, None if normed else residual, None if normed else self.attn_norm[i], eps, self.wqkv[i], HQ, HKV,
                positions, self.rope_cos, self.rope_sin, k_cache[i], v_cache[i], meta.slot_mapping, backend=be,
                **self.attention_extras(i))  # [N, HQ/W, D]
            if not normed:
                residual = s
            if i in capture_layers:
                captured.append(residual)  # [N, H]: the full residual stream entering layer i
            o = ops.paged_attention(q, k_cache[i], v_cache[i], meta, backend=be)  # [N, HQ/W, D]
            h = ops.linear(o.reshape(N, HQ * D), self.wo[i], backend=be)  # [N, H] partial sum
            h, residual, normed = self._boundary(h, residual, self.mlp_norm[i], eps,
                                                 None if moe_j is not None else self.w13[i], swiglu=True)
            if moe_j is not None:
                if not normed:
                    h, residual = ops.add_rms_norm(h, residual, self.mlp_norm[i], eps, backend=be)
                h = ops.moe(h, self.router[moe_j], self.w13[i], self.w2[i], c.num_experts_per_tok, c.norm_topk_prob,
                        expert_hits=self.expert_hits[moe_j], backend=be)  # [N, H] partial sum over F/W columns
            else:
                if normed:
                    x, _ = ops.norm_swiglu(h, None, None, eps, self.w13[i], backend=be)  # [N, F/W]
                else:
                    x, residual = ops.norm_swiglu(h, residual, self.mlp_norm[i], eps, self.w13[i], backend=be)
                h = ops.linear(x, self.w2[i], backend=be)  # [N, F/W] @ [F/W, H] -> [N, H] partial sum
            last = i + 1 == c.num_hidden_layers
            h, residual, normed = self._boundary(h, residual, self.norm if last else self.attn_norm[i + 1], eps,
                                                 None if last else self.wqkv[i + 1])
        if normed:
            out = h
        else:
            out, _ = ops.rms_norm(h, self.norm, eps, residual, backend=be)
        if self.moe_slot:
            self._count_experts_(N)
        cap = None
        if capture_layers:
            order = sorted(capture_layers)
            cap = torch.cat([captured[order.index(layer)] for layer in capture_layers], dim=-1)
        return ForwardOut(out, cap)


TPLlamaModel = TPTransformerModel  # the older name (the dist runner, benchmarks and tests import it)


def shard_target(model: TransformerModel, group, allreduce: str = "nccl") -> TPTransformerModel:
    """``model`` sharded for this rank of ``group``; the full model can be dropped afterwards."""
    return TPTransformerModel.shard(model, group, allreduce=allreduce)
