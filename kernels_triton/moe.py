"""Fused mixture-of-experts layer (Qwen3-MoE / Mixtral SwiGLU experts) for decode, verify and prefill.

Math, for T tokens x [T, H] in dtype ``dt``, E experts, K = top_k, router_w [E, H],
w13 [E, 2F, H] (expert e's gate rows 0..F-1, then its up rows F..2F-1), w2 [E, H, F]:

    logits   = fp32(x) @ fp32(router_w)^T                              [T, E] fp32 (never rounded to dt)
    p        = softmax(logits, -1)                                     fp32
    w, ids   = top-K of p per token (ties: the lower expert id)        [T, K] fp32, int32
    w        = w / sum_j w[:, j]            when renormalize           (Qwen3-MoE norm_topk_prob; Mixtral's
                                                                        softmax over the selected is the same)
    for each pair (t, j), e = ids[t, j]:
        g, u     = dt(x[t] @ gate_e^T), dt(x[t] @ up_e^T)              [F] fp32 accumulation, rounded as the
                                                                        model's unfused linears round them
        a        = dt(silu(g) * u)                                     [F] (activation.py, one rounding)
        y[t, j]  = w[t, j] * (a @ w2_e^T)                              [H] fp32, not rounded
    out[t]   = dt(y[t, 0] + y[t, 1] + ... + y[t, K-1])                 [T, H] summed in slot order, rounded once

In fp32 every rounding vanishes and this is the textbook layer; in bf16 it is what a loop over experts
with fp32 accumulation gives (``fused_moe_ref``), up to GEMM summation order.

Named dims: T tokens, H hidden, F expert intermediate, E experts, K = top_k slots per token,
P = T * K (token, slot) pairs, pair id p = t * K + j (so w.view(-1)[p], ids.view(-1)[p]).

Launches (all shapes fixed by T, E, K, H, F; no host sync, no data-dependent shape, so a CUDA graph
captures the layer per token bucket and replays it with any routing):

    _moe_router_kernel    logits [T, E] fp32 = x @ router_w^T; grid (token blocks, expert blocks), so
                          a decode step reads the 0.5 MB router of a 128 x 2048 layer over several SMs
    _moe_topk_kernel      per block of BLOCK_R tokens: softmax, top-K, renormalise; w, ids; the block's
                          expert histogram [NB, E] (and expert_hits += it, an integer atomic add); with one
                          block (NB = 1, decode and verify) it also does the sort below in the same program
    _moe_sort_kernel      (NB > 1) counting sort of the P pairs by expert: each block's pairs are placed at
                          offset[e] + (pairs of e in earlier blocks) + (rank in this block), slot-major
                          within a block; deterministic (no atomics), so sorted_pairs [P] and the expert
                          counts [E] are a pure function of ids
    _moe_gate_up_kernel   grouped GEMM + SwiGLU: program (b, n) takes block b of BLOCK_M sorted pairs (all
                          of one expert) and BLOCK_N gate and BLOCK_N up columns; writes a [P, F] in dt
    _moe_down_kernel      grouped GEMM, routing weight applied: y [P, H] fp32 rows by pair id
    _moe_combine_kernel   out[t] = dt(sum over j in order of y[t * K + j])

Expert blocks. Each GEMM program finds its expert from the expert counts alone (cumulative
cdiv(count_e, BLOCK_M) over experts, 128 integers from L2): block b belongs to the first expert whose
cumulative block count exceeds b; rows past that expert's count are masked; blocks past the last expert
exit at once. The grid is the worst case, max_blocks = min(P, P // BLOCK_M + min(E, P)) (sum over the
non-empty experts of cdiv(c_e, BLOCK_M) <= P / BLOCK_M + their number, and each block holds >= 1 pair),
so it depends on shapes only. Every program of one (expert block, N tile) streams its columns of that
expert's weights once for all of the block's pairs: at decode (T <= BLOCK_M pairs per expert, as a token
picks an expert at most once) each expert the step touches is read exactly once; 1 token with top-8 reads
8 experts. The sorted pair list itself needs no padding (blocks index it at offset_e + i * BLOCK_M).

Combine: per-slot fp32 rows y [P, H], then a fixed-order sum, instead of an fp32 atomic add into the
output: the result is bit-identical from run to run (the summation order of atomics is not), one
rounding to dt. It costs one [P, H] fp32 write and read: 2 % of the weight bytes at 256 tokens of a
Qwen3-30B-A3B layer, 11 % at 1,024 (where the layer is no longer bound by expert reads alone).

Launch plan: ``moe_plan(T, E, K, H, F)`` picks each GEMM's BLOCK_M from the mean pairs per expert
P / E (16 at decode and verify, larger for prefill) and its tiles from a table (``_PLANS``), from
shapes only; ``fused_moe(..., config=)`` overrides it (experiments/bench_moe.py --sweep).

Invariants: x [T, H] and the weights share one float dtype; last dims contiguous; 1 <= top_k <= E;
expert_hits (optional) int32 [E] on x's device, added to in place. fp32 inputs run ieee dots (exact-path
tests), half precision ones tensor-core dots with fp32 accumulation.
"""

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------


def moe_route_ref(router_logits, top_k: int, renormalize: bool):
    """Softmax over experts (fp32), top-k, optionally renormalised: (w [T, K] fp32, ids [T, K] int32)."""
    p = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    w, ids = p.topk(top_k, dim=-1)  # [T, K] each, largest first
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


def fused_moe_ref(x, router_w, w13, w2, top_k: int, renormalize: bool):
    """The layer as a loop over experts (module docstring math) -> [T, H] in x's dtype."""
    T, H = x.shape
    E, F = w13.shape[0], w13.shape[1] // 2
    dt = x.dtype
    w, ids = moe_route_ref(x.float() @ router_w.float().t(), top_k, renormalize)  # [T, K]
    y = torch.zeros((T, top_k, H), dtype=torch.float32, device=x.device)  # per-slot rows
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)  # pairs routed to e
        if tok.numel() == 0:
            continue
        xe = x[tok].float()  # [n, H]
        g = (xe @ w13[e, :F].float().t()).to(dt)  # [n, F]
        u = (xe @ w13[e, F:].float().t()).to(dt)
        a = (torch.nn.functional.silu(g.float()) * u.float()).to(dt)
        y[tok, slot] = w[tok, slot, None] * (a.float() @ w2[e].float().t())  # [n, H]
    out = y[:, 0].clone()
    for j in range(1, top_k):  # slot order, as the combine kernel sums
        out += y[:, j]
    return out.to(dt)


# ----------------------------------------------------------------------------------------------
# Launchers (Triton kernels follow)
# ----------------------------------------------------------------------------------------------


def _check(x, router_w, w13, w2, top_k, expert_hits):
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"fused_moe: x must be [T, H] float32/float16/bfloat16, got {tuple(x.shape)} {x.dtype}")
    T, H = x.shape
    if router_w.dim() != 2 or router_w.shape[1] != H:
        raise ValueError(f"fused_moe: router_w must be [E, H={H}], got {tuple(router_w.shape)}")
    E = router_w.shape[0]
    if w13.dim() != 3 or w13.shape[0] != E or w13.shape[2] != H or w13.shape[1] % 2:
        raise ValueError(f"fused_moe: w13 must be [E={E}, 2F, H={H}] (gate rows, then up rows), got {tuple(w13.shape)}")
    F = w13.shape[1] // 2
    if w2.shape != (E, H, F):
        raise ValueError(f"fused_moe: w2 must be [E, H, F] = [{E}, {H}, {F}], got {tuple(w2.shape)}")
    for name, t in (("router_w", router_w), ("w13", w13), ("w2", w2)):
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"fused_moe: {name} must be {x.dtype} on {x.device} like x, got {t.dtype} on {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"fused_moe: {name}'s last dim must be contiguous")
    if not 1 <= int(top_k) <= E:
        raise ValueError(f"fused_moe: top_k must be in 1..E={E}, got {top_k}")
    if expert_hits is not None and (expert_hits.shape != (E,) or expert_hits.dtype != torch.int32
                                    or expert_hits.device != x.device):
        raise ValueError(f"fused_moe: expert_hits must be int32 [E={E}] on {x.device}, got "
                         f"{expert_hits.dtype} {tuple(expert_hits.shape)} on {expert_hits.device}")


def fused_moe(x, router_w, w13, w2, top_k: int, renormalize: bool, *, expert_hits=None, config=None):
    """The MoE layer (module docstring) -> new [T, H] in x's dtype. ``expert_hits`` (int32 [E]): the
    number of pairs routed to each expert is added to it in place, without a host sync."""
    _check(x, router_w, w13, w2, top_k, expert_hits)
    out = fused_moe_ref(x, router_w, w13, w2, top_k, renormalize)
    if expert_hits is not None:
        _, ids = moe_route_ref(x.float() @ router_w.float().t(), top_k, renormalize)
        expert_hits.index_add_(0, ids.reshape(-1).long(), torch.ones_like(ids.reshape(-1)))
    return out


def moe_route(router_logits, top_k: int, renormalize: bool):
    """Routing alone (moe_route_ref's math) -> (w [T, K] fp32, ids [T, K] int32)."""
    return moe_route_ref(router_logits, top_k, renormalize)
