"""Top-k log-probabilities of rows of logits, in one launch (two for wide rows): the draft tree's branching step.

Math, for one row x of V logits (any float dtype, computed in fp32):

    lse      = max(x) + log(sum(exp(x - max(x))))        # logsumexp
    ids[j]   = index of the j-th largest x (j < K), ties broken by the lower index
    logp[j]  = x[ids[j]] - lse                           # log_softmax(x)[ids[j]], descending

Equal to ``log_softmax(x.float()).topk(K)`` up to the order of tied values (torch leaves that
unspecified; here it is the lower index first) and fp32 rounding of the logsumexp. A draft step
needs exactly this: the K best children and their log-probabilities, never the full [N, V]
log-softmax. torch's log_softmax + radix-select ``topk`` take ~20 launches per call, this kernel one
(two for the split row): in a graphed batch-1 tree step the five calls went from a few hundred
microseconds to a few tens.

Shapes: logits [N, V] (leading dims flattened: [..., V] works), returns logp [..., K] fp32 and ids
[..., K] int64 (new, contiguous). K <= V and K <= 64; V <= 16384 (MAX_V) in one program, wider rows
(up to MAX_SPLIT_V = 1048576) split over several (below).

Kernel layout: grid (N,); one program loads its row once (BLOCK_V = next power of two of V,
padding = -inf), packs each (value, index) into one int64 that orders like (value descending, index
ascending) (``ranked_key``), reduces the row for the logsumexp, then K times takes the max key (one
reduction: value and lowest index at once), stores both and masks that element out. N rides on the grid and is not an argument,
so one compile serves every batch size (captured per bucket in a CUDA graph).

Split row (V > MAX_V: 32000-id EAGLE-3 draft vocabularies of Llama-3 targets, or a target's whole
128256 / 151936 vocabulary), two launches. Stage 1, grid (N, S): program (n, s) loads chunk s of row
n (CHUNK ids, ``split_plan``), packs the same ranked keys with the global ids, and writes its local
max m_s, its sum of exp(x - m_s) and its K best keys to scratch. Stage 2, grid (N,): the row's
logsumexp from the S partials,

    lse = M + log(sum_s sumexp_s * exp(m_s - M)),   M = max_s m_s

and K max reductions over the S * K candidate keys. The row's K best are among them (each is among
its chunk's K best), the keys are distinct, so the result is the one-program kernel's: the same ids
in the same order (ties lowest index first, across chunk borders too), the values up to fp32
rounding of the logsumexp. The last chunk's slots past the row's end hold padding keys (-inf,
id >= V) that rank below every real element, and K <= V real ones always exist, so none is picked.
The scratch ([N, S, K] int64 + 2 x [N, S] fp32) is allocated per call like the outputs: static
shapes, no host sync, safe to record in a CUDA graph.

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
MAX_SPLITS = 64  # the split row's chunks per row (split_plan grows CHUNK beyond this)
MAX_SPLIT_V = MAX_SPLITS * MAX_V  # 1048576: the widest row the split kernels take


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



@triton.jit
def topk_chunk_kernel(
    x_ptr,  # [N, V]
    key_ptr,  # [N, S, K] int64 scratch: each chunk's K best ranked keys, descending
    m_ptr,  # [N, S] fp32 scratch: each chunk's max (LOG_SOFTMAX only)
    s_ptr,  # [N, S] fp32 scratch: each chunk's sum(exp(x - max)) (LOG_SOFTMAX only)
    V,
    stride_x,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    LOG_SOFTMAX: tl.constexpr,
):
    """Stage 1 of the split row, grid (N, S): chunk s = ids [s * CHUNK, (s + 1) * CHUNK) of row n."""
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    S = tl.num_programs(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)  # global ids: the keys carry them to the merge
    x = tl.load(x_ptr + n * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # NaN ranks last (as in the one-program kernel)
    key = ranked_key(x, offs)  # padding (-inf, id >= V) ranks below every real element
    best = tl.max(key, axis=0)
    part = n * S + c
    if LOG_SOFTMAX:
        mx = ranked_value(best)
        # A chunk of only -inf (or NaN, or padding) contributes sum 0, not exp(-inf - -inf) = NaN;
        # a +inf keeps its NaN (inf - inf), as log_softmax does.
        shift = tl.where(mx == float("-inf"), 0.0, mx)
        tl.store(m_ptr + part, mx)
        tl.store(s_ptr + part, tl.sum(tl.exp(x - shift), axis=0))
    for j in tl.static_range(K):
        if j > 0:
            best = tl.max(key, axis=0)
        tl.store(key_ptr + part * K + j, best)
        key = tl.where(key == best, -9223372036854775807 - 1, key)


@triton.jit
def topk_merge_kernel(
    key_ptr,  # [N, S, K] int64 (stage 1)
    m_ptr,  # [N, S] fp32
    s_ptr,  # [N, S] fp32
    v_ptr,  # [N, K] fp32 (row stride stride_v)
    i_ptr,  # [N, K] int64 (row stride stride_i)
    V,
    S,
    stride_v,
    stride_i,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,  # >= S * K
    BLOCK_S: tl.constexpr,  # >= S
    LOG_SOFTMAX: tl.constexpr,
):
    """Stage 2 of the split row, grid (N,): the row's K best of the S * K candidates, minus its logsumexp."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    key = tl.load(key_ptr + n * S * K + offs, mask=offs < S * K, other=0)
    key = tl.where(offs < S * K, key, -9223372036854775807 - 1)
    if LOG_SOFTMAX:
        so = tl.arange(0, BLOCK_S)
        m = tl.load(m_ptr + n * S + so, mask=so < S, other=float("-inf"))
        sm = tl.load(s_ptr + n * S + so, mask=so < S, other=0.0)
        mx = tl.max(m, axis=0)
        # lse = mx + log(sum_s sum_s' exp(m_s - mx)); an all -inf row gives NaN (-inf - -inf), as the
        # one-program kernel and log_softmax do.
        lse = mx + tl.log(tl.sum(sm * tl.exp(m - mx), axis=0))
    else:
        lse = 0.0
    for j in tl.static_range(K):
        best = tl.max(key, axis=0)
        idx = tl.minimum(ranked_index(best), V - 1)  # always a valid id, whatever the row holds
        tl.store(v_ptr + n * stride_v + j, ranked_value(best) - lse)
        tl.store(i_ptr + n * stride_i + j, idx.to(tl.int64))
        key = tl.where(key == best, -9223372036854775807 - 1, key)


def split_plan(V: int, chunk: int | None = None) -> tuple[int, int]:
    """(CHUNK, S) of the split row for a row of V values: S = cdiv(V, CHUNK) chunks.

    Default CHUNK: 2048 for V <= 65536 (32000-id draft vocabularies: S = 16 programs per row, so a
    batch-1 round still spreads over 16 SMs), 4096 above (128256 / 151936: S = 32 / 38), doubled
    while S > MAX_SPLITS (64) so the merge sees at most 64 * K candidates (262144: S = 64). With
    num_warps = CHUNK / 512 every thread holds 16 values, like the one-program kernel. The choice is
    a starting point, not a measured optimum (experiments/kernels/bench_topk.py sweeps CHUNK). A
    given ``chunk`` (a power of two in [64, MAX_V]) overrides it (tests, benchmarks)."""
    if chunk is None:
        chunk = 2048 if V <= 65536 else 4096
        while triton.cdiv(V, chunk) > MAX_SPLITS and chunk < MAX_V:
            chunk *= 2
    elif chunk < MAX_K or chunk > MAX_V or chunk & (chunk - 1):
        raise ValueError(f"split_plan: chunk must be a power of two in [{MAX_K}, {MAX_V}], got {chunk}")
    if triton.cdiv(V, chunk) > 4 * MAX_SPLITS:
        raise ValueError(f"split_plan: chunk {chunk} splits a row of {V} into more than {4 * MAX_SPLITS} chunks")
    return chunk, triton.cdiv(V, chunk)


def topk_logprobs(logits, k: int, out=None):
    """The k largest log-probabilities of each row of ``logits`` [..., V] and their indices, in
    descending order: (logp [..., k] fp32, ids [..., k] int64). One launch for V <= MAX_V, the split
    row's two above (up to MAX_SPLIT_V); see the module docstring. ``out`` = (logp, ids) writes into
    those tensors ([..., k] fp32 / int64, last dim contiguous, e.g. rows of a persistent buffer)
    instead of new ones."""
    if logits.dim() >= 1 and logits.shape[-1] > MAX_V:
        return _launch_split(logits, k, True, "topk_logprobs", out)
    return _launch(logits, k, True, "topk_logprobs", out)


def topk_ref(x, k: int):
    """Plain torch: the k largest values of each row (fp32) and their indices."""
    v, i = x.float().topk(k, dim=-1)
    return v.contiguous(), i.contiguous()


def topk(x, k: int):
    """The k largest values of each row of ``x`` [..., V] (as fp32) and their indices, descending,
    ties lowest index first: the same kernels without the logsumexp (split above MAX_V)."""
    if x.dim() >= 1 and x.shape[-1] > MAX_V:
        return _launch_split(x, k, False, "topk")
    return _launch(x, k, False, "topk")


def _prepare(logits, k: int, name: str, out, max_v: int, hint: str):
    """Checks and flattens the arguments: (x2 [N, V] with a contiguous last dim, (vals, ids) as
    returned, their [N, k] views)."""
    if logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: logits must be float32/float16/bfloat16, got {logits.dtype}")
    if logits.dim() < 1:
        raise ValueError(f"{name}: logits must be [..., V]")
    V = logits.shape[-1]
    if not isinstance(k, int) or not 1 <= k <= min(V, MAX_K):
        raise ValueError(f"{name}: k must be an int in [1, min(V, {MAX_K})] = [1, {min(V, MAX_K)}], got {k!r}")
    if V > max_v:
        raise ValueError(f"{name}: rows of {V} > {max_v} values {hint}; use {name}_ref")
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
    return x2, (vals, ids), v2, i2


def _launch(logits, k: int, log_softmax: bool, name: str, out=None, num_warps=None):
    """The one-program-per-row kernel (V <= MAX_V)."""
    x2, res, v2, i2 = _prepare(logits, k, name, out, MAX_V, "do not fit one program")
    N, V = x2.shape
    if N == 0:
        return res
    block_v = max(16, triton.next_power_of_2(V))
    if num_warps is None:  # benchmarks may sweep it
        # ~16 fp32 values per thread, at most 8 warps (16 warps were slower on 8192-wide rows;
        # experiments/kernels/bench_draft_round.py)
        num_warps = max(1, min(8, block_v // 512))
    topk_logprobs_kernel[(N,)](x2, v2, i2, V, x2.stride(0), v2.stride(0), i2.stride(0), K=k, BLOCK_V=block_v,
                               LOG_SOFTMAX=log_softmax, num_warps=num_warps)
    return res


def _launch_split(logits, k: int, log_softmax: bool, name: str, out=None, chunk=None):
    """The split row (any V <= MAX_SPLIT_V; V <= MAX_V too, e.g. tests with a small ``chunk``): stage
    1 grid (N, S) writes each chunk's K best keys and (max, sum exp) into scratch the launcher
    allocates ([N, S, K] int64 + 2 x [N, S] fp32: static shapes, no host sync, so it records in a
    CUDA graph), stage 2 grid (N,) merges them into the outputs."""
    x2, res, v2, i2 = _prepare(logits, k, name, out, MAX_SPLIT_V, "exceed the split row's limit")
    N, V = x2.shape
    chunk, S = split_plan(V, chunk)
    if N == 0:
        return res
    keys = torch.empty((N, S, k), dtype=torch.int64, device=x2.device)
    if log_softmax:
        m = torch.empty((N, S), dtype=torch.float32, device=x2.device)
        s = torch.empty((N, S), dtype=torch.float32, device=x2.device)
    else:
        m = s = keys  # not read or written
    topk_chunk_kernel[(N, S)](x2, keys, m, s, V, x2.stride(0), K=k, CHUNK=chunk, LOG_SOFTMAX=log_softmax,
                              num_warps=max(1, min(8, chunk // 512)))
    block_c = max(16, triton.next_power_of_2(S * k))
    topk_merge_kernel[(N,)](keys, m, s, v2, i2, V, S, v2.stride(0), i2.stride(0), K=k, BLOCK_C=block_c,
                            BLOCK_S=max(16, triton.next_power_of_2(S)), LOG_SOFTMAX=log_softmax,
                            num_warps=max(1, min(8, block_c // 512)))
    return res
