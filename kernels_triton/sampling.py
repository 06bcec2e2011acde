"""Sampling warpers: temperature, top-k, top-p and min-p over rows of logits, each request its own.

A row is one tree node's target logits over the vocabulary (one row per request in plain decoding).
The warped row is the distribution plain sampling draws from and verification accepts against
(kernels_triton/verify_accept.py at temperature 1 on the warped logits), so speculative sampling
stays exact under the warpers: the multi-draft rejection rule needs only that p be the target's
distribution, whatever it is.

Math, for one row l [V] of request b with params[b] = (temperature t, top_k k, top_p P, min_p mu),
in Hugging Face's order (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
MinPLogitsWarper; each later warper sees the distribution the earlier ones left):

    t == 0 (greedy)  keep only the first index of max(l): the warped row is one-hot
    x = l / t                                    temperature (fp32)
    m = max(x),  e_v = exp(x_v - m)              unnormalised probabilities, e = 1 at the max
    top-k  (0 < k < V)  keep x_v >= theta_k, theta_k = the k-th largest x
    top-p  (P < 1)      of those, keep x_v >= theta_p, theta_p = the largest value theta with
                        sum_{kept, x_v >= theta} e_v >= P * sum_{kept} e_v
                        (the shortest head of the kept tokens by descending x holding mass >= P)
    min-p  (mu > 0)     keep e_v >= mu           (p_v >= mu * max p, since e = p / max p)
    out    w_v = x_v if kept else -inf           warped logits; the distribution is softmax(w)
           (``probs=True``: softmax(w) itself, zeros outside the kept set)

k = 0 or k >= V, P >= 1 and mu <= 0 switch a warper off. Every kept set is an upper set of x, so
the row's maximum always survives (at least one token). Tie rule: tokens with equal x are kept or
dropped together. For top-k that is Hugging Face's rule (``scores < topk(scores)[..., -1]``); for
top-p HF and vLLM cut a group of tied values wherever their sort happens to put it, so their kept
set depends on the sort's order among ties, and this one does not.

Sorting-free threshold search. theta_k and theta_p are found by searching the row's own values,
never by sorting. Each x maps to an int32 key that orders exactly as x does (``_key``: the fp32
bits with the lower 31 flipped for negatives; -0.0 reads as +0.0). For a non-increasing F (top-k:
the count of kept keys >= t; top-p: their e-mass) and a target (k; P * kept mass), the search
returns theta = the largest key present in the row with F(theta) >= target. Invariant: lo is a
present key with F(lo) >= target; every key >= hi has F < target. Each step is one pass over the
row evaluating NPIV = 8 pivots spread evenly over (lo, hi) at once ([NPIV, BLOCK_S] tiles): per
pivot F, the smallest key >= it and the largest key < it. With n pivots reaching the target, lo
moves to the smallest key >= pivot n and hi to the largest key < pivot n + 1, plus 1. Both snap to
keys present in the row, so (hi - lo) shrinks at least 9-fold per pass and collapses where the
row's values are sparse; the search stops at hi = lo + 1, theta = lo. At most 11 passes (32-bit
keys); on rows of 1000 to 128K random logits 5-8 (15-20 for plain bisection).

Passes over a row: 1 (max and min key), the top-k search (if on), 1 for the kept mass and the top-p
search (if on), 1 write (probabilities: 1 more for their sum). Greedy rows: 1 argmax pass + 1 write.

Exactness against the sort-based reference (``warp_logits_ref``): counts are exact, so theta_k is
the reference's exactly. Masses are fp32 sums; the search's F is still non-increasing in t (adding
non-negative terms is monotone under rounding, and every pass sums in the same order), so it returns
exactly the largest key whose computed mass reaches the target. The reference's sort + cumsum
decides the same unless the mass at a tied-group boundary lies within fp32 rounding of
P * total (~V * 1e-7 relative). min-p compares exp(x - m) with mu, so exp's last bit (the GPU's
ex2.approx vs torch) decides values within an ulp of mu. Tests compare away from those boundaries.

Shapes (named dims): B requests, T rows per request (tree nodes; 1 in plain decoding), V vocabulary
    logits  [B, T, V] (or [B, V]) fp32 / fp16 / bf16, last dim contiguous
    params  [B, 4] fp32 contiguous, per request (temperature, top_k, top_p, min_p); top_k an
            integer value (exact in fp32 below 2**24)
    out     [B, T, V] (or [B, V]) fp32: warped logits w, or probabilities with ``probs=True``
Kernel layout: grid (B * T,), one program per row streaming V in BLOCK_V chunks (the row stays in
L2 across passes). Parameters are read on the device: no host sync, CUDA-graph capturable.
"""

import torch
import triton
import triton.language as tl

from . import options
from .verify_accept import _row_argmax

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PARAMS = ("temperature", "top_k", "top_p", "min_p")  # the columns of ``params``
MAX_TOP_K = 1 << 24  # top_k is carried in fp32


# ----------------------------------------------------------------------------------------------
# Reference (plain torch, sort-based)
# ----------------------------------------------------------------------------------------------


def warp_logits_ref(logits, params, probs=False):
    """Sort-based warpers; see the module docstring. [B, T, V] or [B, V] -> fp32 of the same shape.
    Masses are summed in float64 (the closest to exact arithmetic a reference can be)."""
    flat = logits.dim() == 2
    lg = logits[:, None] if flat else logits
    B, T, V = lg.shape
    p = params.float()
    temp = p[:, 0].view(B, 1, 1)
    top_k = p[:, 1].round().long().view(B, 1, 1)
    top_p = p[:, 2].double().view(B, 1, 1)
    min_p = p[:, 3].view(B, 1, 1)
    greedy = temp <= 0
    x = lg.float() / torch.where(greedy, 1.0, temp)  # [B, T, V]
    m = x.amax(-1, keepdim=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    # top-k: keep x >= the k-th largest value (ties with it kept)
    xs = x.sort(-1, descending=True).values
    kth = xs.gather(-1, (top_k.clamp(1, V) - 1).expand(B, T, 1))
    on_k = (top_k > 0) & (top_k < V)
    keep &= ~on_k | (x >= kth)
    # top-p over the kept tokens: the shortest head by descending x whose mass reaches P * total
    e = torch.exp((x - m).double()) * keep  # [B, T, V] float64
    xk = torch.where(keep, x, float("-inf"))
    xs, order = xk.sort(-1, descending=True)
    cs = e.gather(-1, order).cumsum(-1)
    first = (cs < top_p * cs[..., -1:]).sum(-1, keepdim=True).clamp(max=V - 1)  # first index reaching it
    theta_p = xs.gather(-1, first)
    keep &= (top_p >= 1) | (x >= theta_p)
    # min-p: e >= mu (e = p / max p)
    keep &= torch.exp(x - m) >= min_p
    w = torch.where(keep, x, float("-inf"))
    hot = torch.arange(V, device=x.device) == lg.float().argmax(-1, keepdim=True)  # first index of the max
    w = torch.where(greedy, torch.where(hot, 0.0, float("-inf")), w)
    out = torch.softmax(w, -1) if probs else w
    return out[:, 0] if flat else out


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _key(b_x):
    """int32 keys that order like the fp32 values b_x (-0.0 and +0.0 equal)."""
    b_bits = b_x.to(tl.int32, bitcast=True)
    b_key = tl.where(b_bits < 0, b_bits ^ 0x7FFFFFFF, b_bits)
    return tl.where(b_x == 0.0, 0, b_key)


@triton.jit
def _scaled(p_row, v0, o_v, m_v, temperature):
    """x = logits / temperature of one chunk (fp32, correctly rounded like torch's division, not the GPU's
    default approximate one: the kept logits equal warp_logits_ref's bit for bit; padding lanes -inf)."""
    return tl.math.div_rn(tl.load(p_row + v0 + o_v, mask=m_v, other=float("-inf")).to(tl.float32), temperature)


@triton.jit
def _pivot_pass(p_row, V, temperature, m, kept, b_mid, MASS: tl.constexpr, NPIV: tl.constexpr,
                BLOCK_S: tl.constexpr, TILES: tl.constexpr):
    """One pass over the kept keys (>= kept) for NPIV pivots b_mid [NPIV] at once: per pivot F (count,
    or e-mass with MASS) of the keys >= it, the smallest key >= it and the largest key < it.
    TILES (kernel option warp_tiles): each lane of the [NPIV, BLOCK_S] tile keeps its own sum, min and
    max over the chunks and the tile is reduced once after the loop, instead of three cross-thread
    reductions per chunk. The mass then sums in another order (per lane, then across lanes), the same
    in every pass, so F stays non-increasing in the pivot (module docstring)."""
    o_v = tl.arange(0, BLOCK_S)
    if TILES:
        t_f = tl.zeros([NPIV, BLOCK_S], tl.float32)
        t_a = tl.full([NPIV, BLOCK_S], 2147483647, tl.int32)
        t_b = tl.full([NPIV, BLOCK_S], -2147483648, tl.int32)
    else:
        b_f = tl.zeros([NPIV], tl.float32)
        b_a = tl.full([NPIV], 2147483647, tl.int32)
        b_b = tl.full([NPIV], -2147483648, tl.int32)
    for v0 in range(0, V, BLOCK_S):
        m_v = v0 + o_v < V
        b_x = _scaled(p_row, v0, o_v, m_v, temperature)  # [BLOCK_S]
        b_k = _key(b_x)  # [BLOCK_S] int32
        m_in = (m_v & (b_k >= kept))[None, :]  # [1, BLOCK_S]
        m_ge = m_in & (b_k[None, :] >= b_mid[:, None])  # [NPIV, BLOCK_S]
        if MASS:
            b_w = tl.where(m_v, tl.exp(b_x - m), 0.0)  # [BLOCK_S]
        else:
            b_w = tl.where(m_v, 1.0, 0.0)
        if TILES:
            t_f += tl.where(m_ge, b_w[None, :], 0.0)  # [NPIV, BLOCK_S]
            t_a = tl.minimum(t_a, tl.where(m_ge, b_k[None, :], 2147483647))
            t_b = tl.maximum(t_b, tl.where(m_in & ~m_ge, b_k[None, :], -2147483648))
        else:
            b_f += tl.sum(tl.where(m_ge, b_w[None, :], 0.0), 1)  # [NPIV]
            b_a = tl.minimum(b_a, tl.min(tl.where(m_ge, b_k[None, :], 2147483647), 1))
            b_b = tl.maximum(b_b, tl.max(tl.where(m_in & ~m_ge, b_k[None, :], -2147483648), 1))
    if TILES:
        b_f = tl.sum(t_f, 1)
        b_a = tl.min(t_a, 1)
        b_b = tl.max(t_b, 1)
    return b_f, b_a, b_b


@triton.jit
def _threshold(p_row, V, temperature, m, lo, hi, target, MASS: tl.constexpr, NPIV: tl.constexpr,
               BLOCK_S: tl.constexpr, TILES: tl.constexpr):
    """The largest key >= lo present in the row whose F reaches target (lo: a present key with
    F(lo) >= target; every key >= hi below it): NPIV-way search with snapping (module docstring)."""
    kept = lo.to(tl.int32)
    o_p = tl.arange(0, NPIV)
    while hi - lo > 1:
        # Pivots spread evenly over (lo, hi), clamped inside it (hi - lo >= 2 here).
        b_mid = lo + ((hi - lo) * (o_p + 1)) // (NPIV + 1)  # [NPIV] int64, non-decreasing
        b_mid = tl.minimum(tl.maximum(b_mid, lo + 1), hi - 1).to(tl.int32)
        b_f, b_a, b_b = _pivot_pass(p_row, V, temperature, m, kept, b_mid, MASS, NPIV, BLOCK_S, TILES)
        n = tl.sum((b_f >= target).to(tl.int32), 0)  # F is non-increasing: pivots 0 .. n-1 reach it
        if n > 0:
            lo = tl.sum(tl.where(o_p == n - 1, b_a, 0), 0).to(tl.int64)
        if n < NPIV:
            hi = tl.sum(tl.where(o_p == n, b_b, 0), 0).to(tl.int64) + 1
    return lo


@triton.jit
def _warp_kernel(
    logits,  # [B, T, V]
    row_params,  # [B, 4] fp32: temperature, top_k, top_p, min_p (not `params`: tests/test_kernel_globals.py)
    out,  # [B, T, V] fp32, contiguous
    T,
    V,
    stride_lb,
    stride_lt,
    PROBS: tl.constexpr,
    NPIV: tl.constexpr,  # pivots per search pass
    BLOCK_V: tl.constexpr,  # chunk of the streaming passes
    BLOCK_S: tl.constexpr,  # chunk of the search passes ([NPIV, BLOCK_S] tiles)
    TILES: tl.constexpr,  # the search passes reduce their tiles once, after the loop (_pivot_pass)
):
    i_r = tl.program_id(0).to(tl.int64)  # row = request * T + node
    i_b = i_r // T
    p_row = logits + i_b * stride_lb + (i_r % T) * stride_lt
    p_out = out + i_r * V
    temperature = tl.load(row_params + i_b * 4)
    top_k = tl.load(row_params + i_b * 4 + 1)
    top_p = tl.load(row_params + i_b * 4 + 2)
    min_p = tl.load(row_params + i_b * 4 + 3)
    o_v = tl.arange(0, BLOCK_V)
    if temperature > 0.0:
        # Pass 1: max of x and the smallest key (the search's first lo).
        b_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
        b_kmin = tl.full([BLOCK_V], 2147483647, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            m_v = v0 + o_v < V
            b_x = _scaled(p_row, v0, o_v, m_v, temperature)  # [BLOCK_V]
            b_max = tl.maximum(b_max, b_x)
            b_kmin = tl.minimum(b_kmin, tl.where(m_v, _key(b_x), 2147483647))
        m = tl.max(b_max, 0)
        lo = tl.min(b_kmin, 0).to(tl.int64)
        hi = _key(m).to(tl.int64) + 1
        if (top_k >= 1.0) & (top_k < V):
            lo = _threshold(p_row, V, temperature, m, lo, hi, top_k, False, NPIV, BLOCK_S, TILES)
        if top_p < 1.0:
            # The kept mass, summed exactly as the search sums F (so F(lo) >= P * total holds as computed).
            kept = lo.to(tl.int32)
            b_f, _a, _b = _pivot_pass(p_row, V, temperature, m, kept, kept + tl.zeros([NPIV], tl.int32), True, NPIV,
                                      BLOCK_S, TILES)
            total = tl.max(b_f, 0)  # every pivot is ``kept``: all NPIV entries are the kept mass
            lo = _threshold(p_row, V, temperature, m, lo, hi, top_p * total, True, NPIV, BLOCK_S, TILES)
        theta = lo.to(tl.int32)
        s = tl.full([], 1.0, tl.float32)
        if PROBS:
            s = tl.full([], 0.0, tl.float32)
            for v0 in range(0, V, BLOCK_V):
                m_v = v0 + o_v < V
                b_x = _scaled(p_row, v0, o_v, m_v, temperature)
                b_e = tl.exp(b_x - m)
                s += tl.sum(tl.where(m_v & (_key(b_x) >= theta) & (b_e >= min_p), b_e, 0.0), 0)
        for v0 in range(0, V, BLOCK_V):
            m_v = v0 + o_v < V
            b_x = _scaled(p_row, v0, o_v, m_v, temperature)
            b_e = tl.exp(b_x - m)
            m_keep = (_key(b_x) >= theta) & (b_e >= min_p)
            if PROBS:
                b_w = tl.where(m_keep, b_e / s, 0.0)
            else:
                b_w = tl.where(m_keep, b_x, float("-inf"))
            tl.store(p_out + v0 + o_v, b_w, mask=m_v)
    else:
        # Greedy: one-hot at the first index of the maximum (token-identical to argmax decoding).
        idx = _row_argmax(p_row, V, BLOCK_V)
        for v0 in range(0, V, BLOCK_V):
            m_v = v0 + o_v < V
            if PROBS:
                b_w = tl.where(v0 + o_v == idx, 1.0, 0.0)
            else:
                b_w = tl.where(v0 + o_v == idx, 0.0, float("-inf"))
            tl.store(p_out + v0 + o_v, b_w, mask=m_v)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


NPIV = 8  # pivots per search pass: 9-way splits, about 6 passes per search on real rows vs 15-20 for bisection


def _launch_config(V):
    """(BLOCK_V, BLOCK_S, num_warps): 4096-wide chunks for the streaming passes (12 at V = 49152)
    and 512-wide ones for the search passes ([NPIV, 512] tiles: 16 fp32 lanes per thread at 8 warps)."""
    block_v = min(4096, triton.next_power_of_2(V))
    return block_v, min(512, block_v), 8 if block_v >= 4096 else 4 if block_v >= 1024 else 1


def warp_logits(logits, params, probs=False, out=None):
    """Warped logits (or, with ``probs``, probabilities) of every row; see the module docstring.

    Args:
        logits: [B, T, V] or [B, V] fp32 / fp16 / bf16, last dim contiguous.
        params: [B, 4] fp32 on the same device, per request (temperature, top_k, top_p, min_p):
            temperature 0 = greedy (one-hot); top_k 0 = off; top_p 1 = off; min_p 0 = off.
        probs: write softmax of the warped logits (zeros outside the kept set) instead.
        out: optional fp32 output of logits' shape, contiguous (a static buffer under CUDA graphs).

    Returns:
        fp32 tensor of logits' shape. Never reads tensor values on the host (capture-safe).
    """
    if logits.dim() not in (2, 3) or logits.dtype not in _FLOAT_DTYPES:
        raise ValueError("warp_logits: logits must be [B, T, V] or [B, V] float32/float16/bfloat16, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    if logits.stride(-1) != 1:
        raise ValueError("warp_logits: the vocab dim (last dim) of logits must be contiguous")
    lg = logits[:, None] if logits.dim() == 2 else logits
    B, T, V = lg.shape
    if V < 1:
        raise ValueError(f"warp_logits: logits must have V >= 1, got {tuple(logits.shape)}")
    if params.shape != (B, 4) or params.dtype != torch.float32 or not params.is_contiguous():
        raise ValueError(f"warp_logits: params must be [B, 4] = [{B}, 4] contiguous float32 (temperature, top_k, "
                         f"top_p, min_p per request), got {tuple(params.shape)} {params.dtype}")
    if params.device != logits.device:
        raise ValueError(f"warp_logits: params is on {params.device}, logits on {logits.device}")
    if out is None:
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    elif out.shape != logits.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"warp_logits: out must be contiguous float32 {tuple(logits.shape)}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if B * T == 0:
        return out
    block_v, block_s, num_warps = _launch_config(V)
    _warp_kernel[(B * T,)](lg, params, out, T, V, lg.stride(0), lg.stride(1), PROBS=bool(probs), NPIV=NPIV,
                           BLOCK_V=block_v, BLOCK_S=block_s, TILES=options.get().warp_tiles, num_warps=num_warps)
    return out
