"""Top-k log-probabilities of rows of logits, in one launch (the draft tree's branching step).

Math, for one row x of V logits (any float dtype, computed in fp32):

    lse      = max(x) + log(sum(exp(x - max(x))))        # logsumexp
    ids[j]   = index of the j-th largest x (j < K), ties broken by the lower index
    logp[j]  = x[ids[j]] - lse                           # log_softmax(x)[ids[j]], descending

Equal to ``log_softmax(x.float()).topk(K)`` up to the order of tied values (torch leaves that
unspecified; here it is the lower index first) and fp32 rounding of the logsumexp. A draft step
needs exactly this: the K best children and their log-probabilities, never the full [N, V]
log-softmax. In a batch-1 EAGLE-3 tree step of SmolLM2 (H200, CUDA graph, 8192-wide draft rows)
torch's log_softmax + radix-select ``topk`` took ~250 us per step, this kernel ~30 us for the same
five calls (experiments/results/profile/profile_step_*.json).

Shapes: logits [N, V] (leading dims flattened: [..., V] works), returns logp [..., K] fp32 and ids
[..., K] int64 (new, contiguous). K <= V and K <= 64; V <= 16384 (MAX_V: the whole row lives in
registers of one program; a wider row raises, use the reference there).

Kernel layout: grid (N,); one program loads its row once (BLOCK_V = next power of two of V,
padding = -inf), packs each (value, index) into one int64 that orders like (value descending, index
ascending) (``ranked_key``), reduces the row for the logsumexp, then K times takes the max key (one
reduction: value and lowest index at once), stores both and masks that element out. N rides on the grid and is not an argument,
so one compile serves every batch size (captured per bucket in a CUDA graph).

``topk(x, k)`` is the same kernel without the logsumexp: the k largest values themselves (the
tree's frontier and final node selection over a few dozen candidate scores).

Invariants: the last dim of logits is contiguous (row stride is free). Every returned id is in
[0, V), whatever the row holds: NaN ranks below -inf (padding rows of a CUDA graph carry garbage,
and their ids still index tables such as the draft's d2t).
"""

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_V = 16384
MAX_K = 64


def _into(v, i, out):
    if out is None:
        return v, i
    out[0].copy_(v)
    out[1].copy_(i)
    return out


def topk_logprobs_ref(logits, k: int, out=None):
    """Plain torch: the k largest log_softmax values of each row (fp32) and their indices."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    v, i = lp.topk(k, dim=-1)
    return _into(v.contiguous(), i.contiguous(), out)


@triton.jit
def ranked_key(key, idx):
    """Keys that order like (key descending, idx ascending) and are all distinct: the fp32 key's
    bits made order-preserving as int32 (negatives flipped) in the high word, 2^31 - 1 - idx in the
    low word. One max (or one bitonic sort) of these finds the best (value, lowest index) pair."""
    bits = key.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) + (2147483647 - idx).to(tl.int64)


@triton.jit
def ranked_index(packed):
    """The idx that ``ranked_key`` packed."""
    return (2147483647 - (packed & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def ranked_value(packed):
    """The fp32 key that ``ranked_key`` packed (exact: the bit transform is an involution)."""
    hi = (packed >> 32).to(tl.int32)
    return tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)


@triton.jit
def topk_logprobs_kernel(
    x_ptr,  # [N, V]
    v_ptr,  # [N, K] fp32 (row stride stride_v)
    i_ptr,  # [N, K] int64 (row stride stride_i)
    V,
    stride_x,
    stride_v,
    stride_i,
    K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LOG_SOFTMAX: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    x = tl.load(x_ptr + n * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # NaN (e.g. a padding row's garbage) ranks last
    # (value, index) packed into one distinct int64 per element: each of the K picks is ONE max
    # reduction (the lowest index among equal values wins by construction), not a max and a min.
    key = ranked_key(x, offs)  # [BLOCK_V]; padding (-inf, index >= V) ranks below every real -inf
    best = tl.max(key, axis=0)
    if LOG_SOFTMAX:
        mx = ranked_value(best)
        lse = mx + tl.log(tl.sum(tl.exp(x - mx), axis=0))
    else:
        lse = 0.0
    for j in tl.static_range(K):
        if j > 0:
            best = tl.max(key, axis=0)
        idx = tl.minimum(ranked_index(best), V - 1)  # always a valid id, whatever the row holds
        tl.store(v_ptr + n * stride_v + j, ranked_value(best) - lse)
        tl.store(i_ptr + n * stride_i + j, idx.to(tl.int64))
        key = tl.where(key == best, -9223372036854775807 - 1, key)


def topk_logprobs(logits, k: int, out=None):
    """The k largest log-probabilities of each row of ``logits`` [..., V] and their indices, in
    descending order: (logp [..., k] fp32, ids [..., k] int64). One launch; see the module docstring.
    ``out`` = (logp, ids) writes into those tensors ([..., k] fp32 / int64, last dim contiguous,
    e.g. rows of a persistent buffer) instead of new ones."""
    return _launch(logits, k, True, "topk_logprobs", out)


def topk_ref(x, k: int):
    """Plain torch: the k largest values of each row (fp32) and their indices."""
    v, i = x.float().topk(k, dim=-1)
    return v.contiguous(), i.contiguous()


def topk(x, k: int):
    """The k largest values of each row of ``x`` [..., V] (as fp32) and their indices, descending,
    ties lowest index first: the same kernel without the logsumexp."""
    return _launch(x, k, False, "topk")


def _launch(logits, k: int, log_softmax: bool, name: str, out=None, num_warps=None):
    if logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: logits must be float32/float16/bfloat16, got {logits.dtype}")
    if logits.dim() < 1:
        raise ValueError(f"{name}: logits must be [..., V]")
    V = logits.shape[-1]
    if not isinstance(k, int) or not 1 <= k <= min(V, MAX_K):
        raise ValueError(f"{name}: k must be an int in [1, min(V, {MAX_K})] = [1, {min(V, MAX_K)}], got {k!r}")
    if V > MAX_V:
        raise ValueError(f"{name}: rows of {V} > {MAX_V} values do not fit one program; use {name}_ref")
    x2 = logits.reshape(-1, V)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    N = x2.shape[0]
    shape = (*logits.shape[:-1], k)
    if out is None:
        vals = torch.empty(shape, dtype=torch.float32, device=logits.device)
        ids = torch.empty(shape, dtype=torch.int64, device=logits.device)
    else:
        vals, ids = out
        if (vals.shape != shape or ids.shape != shape or vals.dtype != torch.float32 or ids.dtype != torch.int64
                or vals.device != logits.device or ids.device != logits.device):
            raise ValueError(f"{name}: out must be ([..., k] float32, [..., k] int64) = {shape} on "
                             f"{logits.device}, got {tuple(vals.shape)} {vals.dtype} / {tuple(ids.shape)} {ids.dtype}")
    v2, i2 = vals.view(N, k), ids.view(N, k)  # raises if out's rows are not one stride apart
    if v2.stride(-1) != 1 or i2.stride(-1) != 1:
        raise ValueError(f"{name}: out tensors need a contiguous last dim")
    if N == 0:
        return vals, ids
    block_v = max(16, triton.next_power_of_2(V))
    if num_warps is None:  # benchmarks may sweep it
        # ~16 fp32 values per thread, at most 8 warps (H200, 8192-wide rows: 4.2 us at 8 warps, 4.7 at
        # 16; results/kernels/bench_draft_round.csv)
        num_warps = max(1, min(8, block_v // 512))
    topk_logprobs_kernel[(N,)](x2, v2, i2, V, x2.stride(0), v2.stride(0), i2.stride(0), K=k, BLOCK_V=block_v,
                               LOG_SOFTMAX=log_softmax, num_warps=num_warps)
    return vals, ids
