"""The model's view of the hot kernels: one call per layer op, Triton or the torch reference behind it.

The step's addressing and commit kernels are dispatched in ``specdec/engine/step_ops.py``, the draft
tree's in ``specdec/spec/tree_ops.py``; both choose their backend with :func:`use_triton` below.

``backend="auto"`` uses the Triton kernels on CUDA tensors and the torch references on CPU;
``"triton"`` forces the kernels (on CPU that needs ``TRITON_INTERPRET=1``: slow, for tests);
``"torch"`` forces the references (a baseline for benchmarks and a debugging aid).

Exact mode (kernel option ``exact``, ``engine.exact``; :func:`exact`): on the Triton backend every op
takes one path at every row count -- RMSNorm, RoPE + KV write and SwiGLU kernels (per row already)
around the batch-invariant GEMM (kernels_triton/linear_exact.py) for every projection and the LM head,
the fixed-order attention (kernels_triton/attention_exact.py), the MoE kernel's fixed plan -- instead of
the fused small-M kernels at a few rows and cuBLAS at many, which sum in other orders. A token's
logits, KV and hidden states are then the same bits in a decode step, a verified tree, any batch and
any prefill chunk. The torch references (``backend="torch"``, the CPU default) are not row-invariant
(BLAS picks kernels by shape) and are left as they are. Inside :func:`approximate` (the draft model,
whose tokens verification only proposes) ops keep their default kernels.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from ..errors import ConfigError

BACKENDS = ("auto", "triton", "torch")


@dataclass
class AttentionMeta:
    """Where every query token of a forward pass sits in the paged KV cache.

    N query tokens of B requests, concatenated request by request. Request b's queries are rows
    ``cu_q_lens[b]:cu_q_lens[b+1]`` (T_b of them) and occupy its logical KV slots
    ``kv_lens[b] - T_b .. kv_lens[b] - 1``; their K/V are written to ``slot_mapping`` (flat slot =
    page * page_size + offset, -1 = padding) before attention reads them.
    ``tree_mask`` None means causal; else int64 [N], bit j = "may see new token j of my request",
    or with ``tree_window`` W, "may see slot kv_lens[b] - W + j" (the last W slots, of which the
    queries are the last T_b: a draft round's new nodes under the nodes of earlier rounds).
    """

    cu_q_lens: torch.Tensor  # [B+1] int32
    kv_lens: torch.Tensor  # [B] int32
    page_table: torch.Tensor  # [B, MP] int32
    slot_mapping: torch.Tensor  # [N] int64
    max_q_len: int  # static upper bound on T_b (host int: no sync to read it)
    tree_mask: torch.Tensor | None = None  # [N] int64
    tree_window: int | None = None  # host int W >= max_q_len: mask bits over the last W slots

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]


@dataclass(frozen=True)
class W8:
    """A projection weight stored weight-only int8 for few rows (kernels_triton/linear_w8.py): q [NOUT, K]
    int8 and scale [NOUT] fp32 (w ~ q * scale per output row), beside the ``dense`` original [NOUT, K]
    that more than ``W8_MAX_ROWS`` rows (prefill chunks, larger batches) multiply through cuBLAS.
    Every op below that takes a weight accepts one (:func:`mm`): its fused kernels are for dense
    weights, so a W8 takes the unfused composition (norm kernel, the int8 GEMM, epilogue kernel)."""

    q: torch.Tensor
    scale: torch.Tensor
    dense: torch.Tensor

    @classmethod
    def of(cls, w: torch.Tensor) -> "W8":
        from kernels_triton.linear_w8 import quantize

        q, scale = quantize(w.detach())
        return cls(q, scale, w)

    @property
    def shape(self):
        return self.dense.shape

    @property
    def dtype(self):
        return self.dense.dtype


# Rows up to which a W8 weight multiplies in int8 (linear_w8), cuBLAS on its dense original above: at the
# 8B-shape head's projections the int8 kernel beats cuBLAS bf16 on every one at 1-16 rows and loses from
# 32-64 (experiments/kernels/bench_linear_w8.py; docs/kernel_notes.md, "Weight-only int8").
W8_MAX_ROWS = 16


def mm(x, w, add=None, *, backend="auto"):
    """x [N, K] @ w^T (+ add, rounded once like torch.addmm) for a dense weight or a :class:`W8` (its
    int8 weight for up to W8_MAX_ROWS rows, the dense original above). In exact mode a dense weight
    multiplies through the batch-invariant GEMM (kernels_triton/linear_exact.py), never cuBLAS."""
    if isinstance(w, W8):
        from kernels_triton import linear_w8

        if x.shape[0] <= W8_MAX_ROWS:
            fn = linear_w8.linear_w8 if use_triton(backend, x) else linear_w8.linear_w8_ref
            return fn(x, w.q, w.scale, add)
        w = w.dense
    if exact(backend, x):
        from kernels_triton import linear_exact

        return linear_exact.linear_exact(x, w, add)
    return x @ w.t() if add is None else torch.addmm(add, x, w.t())


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown kernel backend {backend!r}; valid: {', '.join(BACKENDS)}")
    return backend


def use_triton(backend: str, t: torch.Tensor) -> bool:
    """Whether an op on tensor t runs its Triton kernel under ``backend`` (else its torch reference)."""
    if backend == "auto":
        return t.is_cuda
    if backend == "triton":
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set "
                               "before kernels_triton is imported")
        return True
    return False


# > 0 inside approximate(): exact mode leaves these ops on their default kernels.
_approximate_depth = 0


def exact(backend: str, x: torch.Tensor) -> bool:
    """Whether an op over x runs exact mode's batch-invariant kernels (module docstring): the kernel
    option exact is on, the op runs on the Triton backend, and it is not inside :func:`approximate`."""
    from kernels_triton import options

    return options.get().exact and _approximate_depth == 0 and use_triton(backend, x)


@contextlib.contextmanager
def approximate():
    """``with approximate():`` (or ``@approximate()`` on a method): ops inside take their default
    kernels even in exact mode. For the draft model: its tokens are proposals that verification
    accepts or not, so it need not be exact, and its rounds keep the fused small-M kernels."""
    global _approximate_depth
    _approximate_depth += 1
    try:
        yield
    finally:
        _approximate_depth -= 1


def rms_norm(x, weight, eps, residual=None, *, backend="auto"):
    from kernels_triton import norm

    fn = norm.rms_norm if use_triton(backend, x) else norm.rms_norm_ref
    return fn(x, weight, eps, residual)


def rope(q, k, positions, cos, sin, *, backend="auto"):
    from kernels_triton import rope as rope_mod

    fn = rope_mod.rope if use_triton(backend, q) else rope_mod.rope_ref
    return fn(q, k, positions, cos, sin)


def write_kv_(k_cache, v_cache, k, v, slot_mapping, *, backend="auto") -> None:
    from kernels_triton import attention

    fn = attention.write_kv_ if use_triton(backend, k) else attention.write_kv_ref_
    fn(k_cache, v_cache, k, v, slot_mapping)


def rope_write_kv_(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, *, backend="auto", bias=None,
                   q_norm=None, k_norm=None, eps=None):
    """RoPE on q and k, rotated k and v written to the cache slots (in place); returns rotated q. With a
    q | k | v ``bias`` and / or per-head ``q_norm`` / ``k_norm`` RMSNorms (``eps``) applied first, in the
    same launch (kernels_triton/rope.py)."""
    from kernels_triton import rope as rope_mod

    fn = rope_mod.rope_write_kv_ if use_triton(backend, q) else rope_mod.rope_write_kv_ref_
    return fn(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, bias, q_norm, k_norm, eps)


def silu_mul(x, *, backend="auto"):
    """SwiGLU of a fused [..., 2F] gate|up projection: silu(gate) * up, [..., F]."""
    from kernels_triton import activation

    fn = activation.silu_mul if use_triton(backend, x) else activation.silu_mul_ref
    return fn(x)


# Routing of the fused small-M layer kernels (kernels_triton/linear.py; the measurements behind each
# limit: docs/kernel_notes.md "Fused small-M layers"). One row (batch-1 decode) runs the GEMV body at any
# weight size: one launch per layer op beats norm + cuBLAS + epilogue kernels at small and large models.
# Several rows run the streaming body up to FUSED_MAX_ROWS rows (kernel option fused_rows overrides it):
# a 16-node tree's verify and the draft rounds; a 49-row verify is faster on cuBLAS, and at 25-40 rows
# the streamed verify lost too.
FUSED_MAX_ROWS = 24
# ... for weights up to FUSED_MAX_WEIGHT_BYTES (SmolLM2's layers; small LM heads). Larger projections
# (Llama-3.1-8B's) are bound by their weight stream either way: streamed they win only at a tree verify's
# rows (STREAM_LARGE_MIN_ROWS and up), while batched plain decoding at 2-16 rows and the 4-row draft
# rounds are as fast or faster through cuBLAS, and a batch bucket of plain decoding never falls in 17-24.
FUSED_MAX_WEIGHT_BYTES = 16 << 20
STREAM_LARGE_MIN_ROWS = 17


def _fused(backend: str, x: torch.Tensor, w: torch.Tensor, one_row_any_size: bool = False,
           swiglu: bool = False, m: int | None = None) -> bool:
    """Small-M fused layers for decode / draft / verify rows on the Triton backend (the routing above).
    The kernel option fused_linear=False (kernels_triton/options.py) falls back to the unfused kernels +
    cuBLAS (the baseline of the kernel benchmarks). ``one_row_any_size``: a single row goes to the fused
    GEMV whatever the weight size (output widths up to kernels_triton.linear.GEMV_MAX_COLUMNS; wider
    ones, LM heads, keep the limits), and so do STREAM_LARGE_MIN_ROWS .. FUSED_MAX_ROWS rows."""
    from kernels_triton import linear as lin
    from kernels_triton import options

    opts = options.get()
    if isinstance(w, W8) or not use_triton(backend, x) or not opts.fused_linear or exact(backend, x):
        return False  # exact mode: one path at every M, the unfused kernels around linear_exact
    M = x.shape[0] if m is None else m  # m: the rows a gathered input yields
    projection = w.shape[0] // (2 if swiglu else 1) <= lin.GEMV_MAX_COLUMNS  # not an LM head
    if one_row_any_size and M == 1 and projection:
        return True
    if M > (opts.fused_rows or FUSED_MAX_ROWS):
        return False
    if w.numel() * w.element_size() <= FUSED_MAX_WEIGHT_BYTES:
        return True
    return one_row_any_size and projection and M >= STREAM_LARGE_MIN_ROWS


def gathers_rows(backend: str, x: torch.Tensor, w: torch.Tensor, rows) -> bool:
    """Whether a layer over gathered rows (``rows`` = (index [G, W], group) into x) reads them inside the
    fused kernel: the fused path for its G * W rows, one dtype."""
    if isinstance(w, W8) or x.dtype != w.dtype:
        return False
    return _fused(backend, x, w, one_row_any_size=True, m=rows[0].numel())


def gather_rows(x, rows):
    """The rows ``rows`` = (index [G, W], group) picks from x, by torch ops (kernels_triton.linear.gather_rows_ref)."""
    from kernels_triton import linear as lin

    return lin.gather_rows_ref(x, *rows)


def linear(x, w, add=None, *, backend="auto", rows=None):
    """x [N, K] @ w [NOUT, K]^T (+ add [N, NOUT], rounded once like torch.addmm). ``rows`` = (index
    [G, W], group): the N = G * W input rows are x[g * group + max(index[g, j], 0)], read inside the
    fused kernel where it runs, else gathered first."""
    from kernels_triton import linear as lin

    if rows is not None:
        if gathers_rows(backend, x, w, rows):
            return lin.linear(x, w, add, rows=rows)
        x = gather_rows(x, rows)
    if _fused(backend, x, w, one_row_any_size=True):
        return lin.linear(x, w, add)
    return mm(x, w, add, backend=backend)


def linear_residual(x, w, residual, *, backend="auto"):
    """The projection that closes a residual block (o-projection, down projection), as the next norm op's
    input: (x', residual', sumsq). Where the streaming body runs several rows, one launch adds the
    residual in its epilogue: (s = x @ w^T + residual, None, the per-column-block sums of s^2,
    kernels_triton.linear.linear_residual), and the next norm_* op normalises s from those sums with the
    norm weight folded into its weight (:func:`fold_norm`, 1 / rms in the epilogue), without a prologue
    launch. Elsewhere (one row: the GEMV computes its own norm; cuBLAS; CPU) (x @ w^T, residual, None):
    the add stays in the next norm's kernel, as before. Either way the norm op that follows gets
    ``(x', residual', sumsq=sumsq)``."""
    from kernels_triton import linear as lin

    if residual is not None and sums_squares(backend, x, w):
        s, ss = lin.linear_residual(x, w, residual)
        return s, None, ss
    return linear(x, w, backend=backend), residual, None


def sums_squares(backend: str, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear_residual` over rows x with weight w hands the next norm op its rows' sums of
    squares: several rows (the streaming body) on the fused path."""
    return x.shape[0] > 1 and _fused(backend, x, w, one_row_any_size=True)


def norm_folding(backend: str | None = None, x: torch.Tensor | None = None, w: torch.Tensor | None = None) -> bool:
    """Whether models pass the norm ops their weights with the norm weight folded in (``folded=``,
    :func:`fold_norm`): wherever a projection hands over sums (given backend, rows x and the weight w of
    the projection before a norm: :func:`sums_squares`; without them: always)."""
    return x is None or sums_squares(backend, x, w)


def derived(owner, name: str, sources, build):
    """A weight derived from ``sources`` (tensors) by ``build()``, kept on ``owner`` under ``name`` and
    rebuilt when a source changes (moved, cast, loaded or updated in place: data pointers, tensor
    versions and dtypes are compared). Made on first use: an eager run before any graph capture."""
    sig = tuple((t.data_ptr(), t._version, t.dtype) for t in sources)
    cache = owner.__dict__.setdefault("_derived_weights", {})
    if name not in cache or cache[name][0] != sig:
        with torch.no_grad():
            cache[name] = (sig, build())
    return cache[name][1]


def fold_norm(w, norm_weight):
    """w [NOUT, K] with its input columns scaled by the RMSNorm weight [K], in w's dtype:
    RMSNorm(s) @ w^T = rstd(s) * (s @ fold_norm(w, nw)^T) (the norm weight applied before the GEMM's
    rounding instead of to the normalised rows)."""
    return (w.float() * norm_weight.float()[None, :]).to(w.dtype).contiguous()


def _norm_args(norm_weight, w, sumsq, folded):
    """(norm weight, weight) for a fused norm op: with row sums and a folded weight, the folded weight and
    no norm weight (1 / rms scales the rows in the epilogue)."""
    if sumsq is not None and folded is not None:
        return None, folded
    return norm_weight, w


def _norm(x, residual, norm_weight, eps, backend):
    """(RMSNorm(x + residual), x + residual); residual None: (RMSNorm(x), x); norm_weight None: (x, x)."""
    if norm_weight is None:
        return x, x
    if residual is None:
        return rms_norm(x, norm_weight, eps, backend=backend), x
    return rms_norm(x, norm_weight, eps, residual, backend=backend)


def norm_linear(x, residual, norm_weight, eps, w, *, backend="auto", sumsq=None, folded=None):
    """(RMSNorm(x + residual) @ w^T, x + residual); residual None: s = x. ``sumsq``: x's rows' sums of
    squares from :func:`linear_residual` (used by the fused kernel); ``folded``: fold_norm(w, norm_weight),
    used with them."""
    from kernels_triton import linear as lin

    if _fused(backend, x, w, one_row_any_size=True):
        nw, wf = _norm_args(norm_weight, w, sumsq, folded)
        return lin.norm_linear(x, residual, nw, eps, wf, sumsq=sumsq)
    y, s = _norm(x, residual, norm_weight, eps, backend)
    return mm(y, w, backend=backend), s


def norm_swiglu(x, residual, norm_weight, eps, w13, *, backend="auto", sumsq=None, folded=None):
    """(silu(gate) * up of RMSNorm(x + residual) @ w13^T [N, F], x + residual); residual None: x.
    ``sumsq``: x's rows' sums of squares from :func:`linear_residual` (used by the fused kernel);
    ``folded``: fold_norm(w13, norm_weight), used with them."""
    from kernels_triton import linear as lin

    if _fused(backend, x, w13, one_row_any_size=True, swiglu=True):
        nw, w = _norm_args(norm_weight, w13, sumsq, folded)
        return lin.norm_swiglu(x, residual, nw, eps, w, sumsq=sumsq)
    y, s = _norm(x, residual, norm_weight, eps, backend)
    # silu(gate) * up read straight from the fused [N, 2F] projection: one launch, fp32 math.
    return silu_mul(mm(y, w13, backend=backend), backend=backend), s


def norm_qkv_rope_write_kv_(x, residual, norm_weight, eps, wqkv, n_q_heads, n_kv_heads, positions, cos, sin,
                            k_cache, v_cache, slot_mapping, x2=None, norm_weight2=None, *, backend="auto", rows=None,
                            sumsq=None, folded=None, bias=None, q_norm=None, k_norm=None):
    """The attention block's input side: RMSNorm(x + residual) @ wqkv^T, RoPE, K/V written to the cache
    slots (in place). Returns (rotated q [N, HQ, D], s = x + residual, or x without a residual).
    norm_weight None projects x as is. With ``x2`` (and ``norm_weight2``) the projected rows are
    [RMSNorm(x) | RMSNorm2(x2)] (EAGLE-3's draft layer: token embedding beside hidden state).
    ``rows`` = (index [G, W], group): x's rows gathered as in :func:`linear` (no residual; s is then
    the gathered rows, or None when the kernel gathered them). ``sumsq``: x's rows' sums of squares
    from :func:`linear_residual` (used by the fused kernel); ``folded``: fold_norm(wqkv, norm_weight), used
    with them. A family's attention extras: ``bias`` [(HQ + 2 HKV) D] added to q|k|v (Qwen2), ``q_norm`` /
    ``k_norm`` [D] RMSNorms over each query / key head before RoPE (Qwen3); see _qkv_extras_rope_write_kv_."""
    from kernels_triton import linear as lin

    if bias is not None or q_norm is not None or k_norm is not None:
        return _qkv_extras_rope_write_kv_(x, residual, norm_weight, eps, wqkv, n_q_heads, n_kv_heads, positions,
                                          cos, sin, k_cache, v_cache, slot_mapping, backend, sumsq, folded, bias,
                                          q_norm, k_norm)
    if rows is not None:
        if residual is None and gathers_rows(backend, x, wqkv, rows):
            return lin.norm_qkv_rope_write_kv_(x, None, norm_weight, eps, wqkv, n_q_heads, n_kv_heads, positions,
                                               cos, sin, k_cache, v_cache, slot_mapping, x2, norm_weight2, rows=rows)
        x = gather_rows(x, rows)

    N, D = x.shape[0], k_cache.shape[-1]
    if _fused(backend, x, wqkv, one_row_any_size=True):
        nw, w = _norm_args(norm_weight, wqkv, sumsq, folded)
        return lin.norm_qkv_rope_write_kv_(x, residual, nw, eps, w, n_q_heads, n_kv_heads, positions,
                                           cos, sin, k_cache, v_cache, slot_mapping, x2, norm_weight2, sumsq=sumsq)
    y, s = _norm(x, residual, norm_weight, eps, backend)
    if x2 is not None:
        y = torch.cat([y, rms_norm(x2, norm_weight2, eps, backend=backend)], dim=-1)  # [N, K + K2]
    qkv = mm(y, wqkv, backend=backend)  # [N, H] @ [H, (HQ+2HKV)D]
    q, k, v = qkv.split([n_q_heads * D, n_kv_heads * D, n_kv_heads * D], dim=-1)  # views, no copies
    # One launch: rotate q and k, write rotated k and v into this layer's cache slots.
    q = rope_write_kv_(q.view(N, n_q_heads, D), k.view(N, n_kv_heads, D), v.view(N, n_kv_heads, D), positions,
                       cos, sin, k_cache, v_cache, slot_mapping, backend=backend)
    return q, s


def _qkv_extras_rope_write_kv_(x, residual, norm_weight, eps, wqkv, n_q_heads, n_kv_heads, positions, cos, sin,
                               k_cache, v_cache, slot_mapping, backend, sumsq, folded, bias, q_norm, k_norm):
    """norm_qkv_rope_write_kv_ with a bias and / or q/k norms between the projection and RoPE, in two launches:
    the RMSNorm + qkv projection (norm_linear: one launch for few rows), then one kernel adding the bias
    (rounded to the model dtype, as ``qkv + bias``: nn.Linear's addmm rounds (x @ W^T) + b once, bf16 here
    twice), norming each query / key head (as ``rms_norm`` on the heads) and doing the RoPE + KV write
    (kernels_triton/rope.py). A Llama layer's second launch is the same kernel compiled without the extras."""
    N, D = x.shape[0], k_cache.shape[-1]
    qkv, s = norm_linear(x, residual, norm_weight, eps, wqkv, backend=backend, sumsq=sumsq,
                         folded=folded)  # [N, (HQ + 2 HKV) D]
    q, k, v = qkv.split([n_q_heads * D, n_kv_heads * D, n_kv_heads * D], dim=-1)  # views, no copies
    q = rope_write_kv_(q.view(N, n_q_heads, D), k.view(N, n_kv_heads, D), v.view(N, n_kv_heads, D), positions,
                       cos, sin, k_cache, v_cache, slot_mapping, backend=backend, bias=bias, q_norm=q_norm,
                       k_norm=k_norm, eps=eps)  # [N, HQ, D]
    return q, s


def add_rms_norm(x, residual, weight, eps, *, backend="auto"):
    """(RMSNorm(x + residual), x + residual); residual None: (RMSNorm(x), x)."""
    if residual is None:
        return rms_norm(x, weight, eps, backend=backend), x
    return rms_norm(x, weight, eps, residual, backend=backend)


def moe(x, router_w, w13, w2, top_k: int, renormalize: bool, *, expert_hits=None, steer=None, backend="auto"):
    """The MoE layer over normed rows x [T, H] -> [T, H] (kernels_triton/moe.py): the fused kernel on the
    Triton backend, else its torch reference (a loop over experts), which counts ``expert_hits`` [E] int32
    (pairs routed to each expert, added in place) as the kernel does. ``steer`` = (sel [T, K] int32, margin):
    steered routing (fused_moe)."""
    from kernels_triton import moe as moe_mod

    if use_triton(backend, x):
        return moe_mod.fused_moe(x, router_w, w13, w2, top_k, renormalize, expert_hits=expert_hits, steer=steer)
    return _moe_ref(x, router_w, w13, w2, top_k, renormalize, expert_hits, steer)


def _moe_ref(x, router_w, w13, w2, top_k, renormalize, expert_hits, steer):
    """The MoE layer's torch reference, counting expert_hits as the kernel does."""
    from kernels_triton import moe as moe_mod

    if expert_hits is not None:
        logits = moe_mod.steer_logits_ref(x.float() @ router_w.float().t(), steer)
        _, ids = moe_mod.moe_route_ref(logits, top_k, renormalize)  # [T, K]
        expert_hits.index_add_(0, ids.reshape(-1).long(), torch.ones(ids.numel(), dtype=torch.int32, device=x.device))
    return moe_mod.fused_moe_ref(x, router_w, w13, w2, top_k, renormalize, steer)


def moe_norm(x, residual, norm_weight, eps, router_w, w13, w2, top_k: int, renormalize: bool, *, expert_hits=None,
             steer=None, backend="auto"):
    """RMSNorm(x + residual) and the MoE layer over it: (out [T, H], x + residual). On the Triton backend
    kernels_triton.moe.fused_moe_norm (at decode and verify sizes the norm, router and routing are one
    launch); elsewhere :func:`add_rms_norm` and :func:`moe`. ``steer``: as :func:`moe`'s."""
    from kernels_triton import moe as moe_mod

    if use_triton(backend, x):
        return moe_mod.fused_moe_norm(x, residual, norm_weight, eps, router_w, w13, w2, top_k, renormalize,
                                      expert_hits=expert_hits, steer=steer)
    y, s = add_rms_norm(x, residual, norm_weight, eps, backend=backend)
    return _moe_ref(y, router_w, w13, w2, top_k, renormalize, expert_hits, steer), s


def paged_attention(q, k_cache, v_cache, meta: AttentionMeta, sm_scale=None, *, backend="auto"):
    """Attention of q [N, HQ, D] over the paged KV per ``meta``; in exact mode the fixed-order kernel
    (kernels_triton/attention_exact.py; a windowed draft round keeps the default one)."""
    from kernels_triton import attention

    if exact(backend, q) and meta.tree_window is None:
        from kernels_triton import attention_exact

        return attention_exact.paged_attention_exact(q, k_cache, v_cache, meta.page_table, meta.cu_q_lens,
                                                     meta.kv_lens, meta.tree_mask, sm_scale, max_q_len=meta.max_q_len)
    if use_triton(backend, q):
        return attention.paged_attention(q, k_cache, v_cache, meta.page_table, meta.cu_q_lens,
                                         meta.kv_lens, meta.tree_mask, sm_scale,
                                         max_q_len=meta.max_q_len, tree_window=meta.tree_window)
    return attention.paged_attention_ref(q, k_cache, v_cache, meta.page_table, meta.cu_q_lens,
                                         meta.kv_lens, meta.tree_mask, sm_scale, meta.tree_window)
