"""Tree verification: accepted path and bonus token for every request, greedy or exact stochastic.

A step drafts a tree of T nodes per request and the target scores all of them in one forward:
node 0 is the root (the pending token, whose logits predict the first new token), nodes 1..T-1 are
draft tokens in topological order (parents[b, i] < i). This kernel walks each tree from the root and
returns the accepted path plus one bonus token. With T = 1 it is plain decoding (greedy argmax or
sampling from softmax(logits / temperature)).

Shapes (named dims):
    B   requests, T tree nodes per request (T <= MAX_TREE_TOKENS), V vocabulary
    logits       [B, T, V]  fp32 / fp16 / bf16; row i = target logits at node i (predicts i's child)
    tokens       [B, T]     int64 (int32 accepted); tokens[:, 0] (the root) is never matched
    parents      [B, T]     int32 (int64 accepted); parents[:, 0] = -1; a node i > 0 with parent < 0
                            is padding (smaller trees in a batch), never accepted
    uniforms     [B, T, 2]  fp32 in [0, 1); [b, i, 0] = acceptance coin of node i when it is tried
                            as a child, [b, i, 1] = bonus draw when i is the last accepted node
    draft_probs  [B, T, V]  float or None; row i = the distribution node i's token was drawn from
    accept_len      [B]     int32, accepted draft nodes (0..depth)
    accepted_nodes  [B, T]  int32, path node indices [0, n1, n2, ...] then -1
    out_tokens      [B, T]  int64, tokens of the accepted nodes then the bonus token, then -1;
                            out_tokens[b, :accept_len[b] + 1] are the newly committed tokens

Walk (both modes): cur = 0; children of cur (parents == cur, index > cur) are tried in index order;
an accepted child becomes cur and its own children are tried next; the walk stops at a node where no
child is accepted, and the bonus token is drawn there.

Greedy (temperature == 0): target token at cur = argmax(logits[b, cur]) (first index on ties); the
lowest-index child carrying that token is accepted; bonus = the argmax at the last accepted node.
Token-identical to plain greedy decoding.

Stochastic (temperature > 0), exact multi-draft rejection sampling (SpecInfer / EAGLE):
    p = softmax(fp32(logits[b, cur]) / temperature); r = p          (residual target)
    for each child c of cur, token x, draft distribution q_c (one-hot(x) when draft_probs is None):
        accept c  iff  q_c(x) > 0  and  uniforms[b, c, 0] < r(x) / q_c(x)
        else      r = norm(max(r - q_c, 0))      (if that is all zero: r = p, see below)
    no child accepted: bonus = inverse CDF of r at uniforms[b, cur, 1]:
        the first v with cumsum(r)[v] > u * sum(r) (rounding fallback: the last v with r(v) > 0)
The committed tokens are then distributed exactly as sampling from the target one token at a time,
provided siblings' tokens are drawn as draft_probs says (i.i.d. from q, or q_c conditioned on the
earlier siblings). Top-k / top-p / min-p (per request): pass the warped logits of every node
(kernels_triton/sampling.py: kept tokens x = l / t, the rest -inf) at temperature 1; p is then the
warped target, and the rule above keeps speculative sampling exact under the warpers. With deterministic drafts (draft_probs None) q_c = one-hot(x), so a rejection
just removes x from r: the rule is "sample x ~ p, accept if x is a child". A threshold shortcut
(e.g. always accepting when p(x) is large) is lossy and not offered.
Edge cases: p(x) = 0 rejects; q_c(x) = 0 (impossible if x ~ q_c) rejects; a token outside [0, V)
never matches (greedy) / rejects; a residual that is all zero (reachable through rounding, or when
p <= q_c everywhere, e.g. unnormalised draft rows) falls back to r = p.

Kernel layout: one program per request walks its path (grid (B,)). Only rows on the path are read:
V is streamed in BLOCK_V chunks; greedy does one argmax pass per visited node; stochastic does one
pass for (row max, row sum) per visited node, reads p(x) = exp(l_x / temperature - max) / sum with
one scalar load per tried child, and one early-exit inverse-CDF pass at the last node. Deterministic
drafts never materialise r: the residual mass after rejecting x_1..x_k is sum - sum_k e(x_k) (e =
unnormalised exp), and the final pass zeroes the children's tokens on the fly (only chunks holding a
child token pay for it). With draft_probs the residual is materialised, unnormalised, in an fp32
workspace [B, V] allocated by the launcher (one read of q_c and of r, one write, per rejection).

Greedy split-vocabulary variant (small batches, see SPLIT_GREEDY_MAX_BYTES): grid (chunk, node,
request); every program takes the argmax of one BLOCK_V chunk of one node's row and stores (max,
first index) to a workspace; the last program of a request to arrive (an int32 arrival counter per
request, left at 0 for the next launch) walks the tree reading only those partials. All T rows are
read once, in parallel, instead of the visited rows one after another: the single-program walk
streams V / BLOCK_V chunks per visited node in sequence (~17 us for one 128K-vocabulary row), which
is latency, not bandwidth. Same decisions as the single-program kernel (first index of
the maximum, ties across chunks included).

Invariants: parents[b, i] < i for real nodes (entries >= i are never accepted); logits contain no
NaN and no row is all -inf; the launcher never reads tensor values on the host (capture-safe).
Kernel and reference agree exactly on the decisions except when a uniform falls within a few fp32
ulps of a threshold (different summation orders; the GPU's exp is ex2.approx): about V * 1e-7 per
bonus draw. Also in the degenerate deterministic-draft case where rounding leaves a residual of
mass ~0 (the kernel divides by sum - rejected mass, the reference renormalises the remainder).
With draft_probs, the kernel's scalar read of r(x) and the in-place residual update are separated
by CTA barriers, so all threads take the same accept/reject branch.
"""

import torch
import triton
import triton.language as tl

from .attention import arrival_counters

MAX_TREE_TOKENS = 1024  # tokens/parents of one request are held as one [BLOCK_T] register vector
# Greedy verification splits the vocabulary across programs when the logits of the whole batch are at
# most this many bytes (batch-1 decode and tree steps): every row is then read, in parallel, so at
# large B * T the single-program walk, which reads only the visited rows, moves fewer bytes.
SPLIT_GREEDY_MAX_BYTES = 16 << 20
SPLIT_MAX_CHUNKS = 64  # vocabulary chunks per row in the split variant (bounds the walk's partial loads)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------------
# Reference (plain torch, vectorised over the batch)
# ----------------------------------------------------------------------------------------------


def _inverse_cdf_ref(r, u):
    """First v with cumsum(r)[v] > u * sum(r) per row; rounding fallback: last v with r(v) > 0."""
    V = r.shape[-1]
    c = r.cumsum(-1)  # [B, V], non-decreasing
    idx = (c <= (u * r.sum(-1))[:, None]).sum(-1)  # [B]
    last = V - 1 - (r > 0).flip(-1).int().argmax(-1)  # [B]
    return torch.where(idx < V, idx, last)


def verify_accept_ref(logits, tokens, parents, temperature, uniforms=None, draft_probs=None):
    """Plain-torch tree verification; see the module docstring. Returns (accept_len, accepted_nodes,
    out_tokens). One ascending sweep over the nodes: since parents precede children, child j of the
    current node is tried exactly when the walk reaches it in the docstring's order."""
    B, T, V = logits.shape
    dev = logits.device
    greedy = float(temperature) == 0.0
    o_t = torch.arange(T, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # current node
    n_acc = torch.zeros(B, dtype=torch.long, device=dev)
    nodes = torch.where(o_t == 0, 0, -1).expand(B, T).clone()  # [B, T]
    out = torch.full((B, T), -1, dtype=torch.long, device=dev)  # [B, T]
    if greedy:
        tgt = logits[:, 0].float().argmax(-1)  # [B] target token at cur
    else:
        p = torch.softmax(logits[:, 0].float() / temperature, dim=-1)  # [B, V] target at cur
        r = p.clone()  # [B, V] residual target at cur
    for j in range(1, T):
        x = tokens[:, j].long()  # [B]
        cand = parents[:, j].long() == cur  # j is the next untried child of cur
        if greedy:
            acc = cand & (x == tgt)
        else:
            valid = (x >= 0) & (x < V)
            xs = x.clamp(0, V - 1)
            if draft_probs is None:
                q = torch.nn.functional.one_hot(xs, V).float() * valid[:, None]  # [B, V]
            else:
                q = draft_probs[:, j].float()  # [B, V]
            r_x = r.gather(1, xs[:, None])[:, 0]
            q_x = q.gather(1, xs[:, None])[:, 0]
            ratio = r_x / torch.where(q_x > 0, q_x, 1.0)
            acc = cand & valid & (q_x > 0) & (uniforms[:, j, 0].float() < ratio)
            res = (r - q).clamp_min(0.0)
            z = res.sum(-1, keepdim=True)
            res = torch.where(z > 0, res / torch.where(z > 0, z, 1.0), p)  # all-zero residual: back to p
            r = torch.where((cand & ~acc)[:, None], res, r)
        nodes = torch.where(acc[:, None] & (o_t == n_acc[:, None] + 1), j, nodes)
        out = torch.where(acc[:, None] & (o_t == n_acc[:, None]), x[:, None], out)
        n_acc = n_acc + acc.long()
        cur = torch.where(acc, j, cur)
        if greedy:
            tgt = torch.where(acc, logits[:, j].float().argmax(-1), tgt)
        else:
            p_j = torch.softmax(logits[:, j].float() / temperature, dim=-1)
            p = torch.where(acc[:, None], p_j, p)
            r = torch.where(acc[:, None], p_j, r)
    if greedy:
        bonus = tgt
    else:
        u = uniforms[torch.arange(B, device=dev), cur, 1].float()
        bonus = _inverse_cdf_ref(r, u)
    out = torch.where(o_t == n_acc[:, None], bonus[:, None], out)
    return n_acc.to(torch.int32), nodes.to(torch.int32), out


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _row_argmax(p_row, V, BLOCK_V: tl.constexpr):
    """First index of the maximum of one row [V]; per-lane running max, one reduction at the end."""
    o_v = tl.arange(0, BLOCK_V)
    b_best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    b_idx = o_v
    for v0 in range(0, V, BLOCK_V):
        b_l = tl.load(p_row + v0 + o_v, mask=v0 + o_v < V, other=float("-inf")).to(tl.float32)  # [BLOCK_V]
        m_up = b_l > b_best  # strict: a lane keeps its earliest maximum
        b_idx = tl.where(m_up, v0 + o_v, b_idx)
        b_best = tl.where(m_up, b_l, b_best)
    b_max = tl.max(b_best, 0)
    return tl.min(tl.where(b_best == b_max, b_idx, 2147483647), 0)


@triton.jit
def _child_token_mask(o_v, v0, cur, b_child, b_tok, p_tok, p_par, T, BLOCK_V: tl.constexpr):
    """[BLOCK_V] True where token o_v is NOT carried by a child of cur. Chunks holding no child token
    (all but a few) skip the per-child loop."""
    b_keep = o_v >= 0
    n_in = tl.sum((b_child & (b_tok >= v0) & (b_tok < v0 + BLOCK_V)).to(tl.int32), 0)
    if n_in > 0:
        for t in range(cur + 1, T):
            tok_t = tl.load(p_tok + t)
            par_t = tl.load(p_par + t)
            b_keep = b_keep & ((o_v != tok_t) | (par_t != cur))
    return b_keep


@triton.jit
def _row_stats(p_row, V, temperature, cur, b_child, b_tok, p_tok, p_par, T,
               EXCLUDE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Online (max, sum of exp) of logits / temperature over one row; with EXCLUDE also the sum over
    tokens not carried by a child of cur (the residual mass once every child is rejected)."""
    o_v = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    s_keep = tl.full([], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        m_v = v0 + o_v < V
        b_x = tl.load(p_row + v0 + o_v, mask=m_v, other=float("-inf")).to(tl.float32) / temperature  # [BLOCK_V]
        m_new = tl.maximum(m, tl.max(b_x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # -inf chunk: avoid -inf - -inf
        b_alpha = tl.exp(m - m_safe)
        b_e = tl.exp(b_x - m_safe)  # [BLOCK_V]
        s = s * b_alpha + tl.sum(b_e, 0)
        if EXCLUDE:
            b_keep = _child_token_mask(v0 + o_v, v0, cur, b_child, b_tok, p_tok, p_par, T, BLOCK_V)
            s_keep = s_keep * b_alpha + tl.sum(tl.where(b_keep, b_e, 0.0), 0)
        m = m_new
    return m, s, s_keep


@triton.jit
def _inverse_cdf(p_src, V, temperature, m, target, excl, cur, b_child, b_tok, p_tok, p_par, T,
                 FROM_WS: tl.constexpr, EXCLUDE: tl.constexpr, BLOCK_V: tl.constexpr):
    """First v whose cumulative weight exceeds target; weights are the fp32 workspace row (FROM_WS)
    or exp(l / temperature - m) of a logits row, with children's tokens zeroed when excl != 0.
    Stops at the chunk that crosses target; fallback: last v with positive weight."""
    o_v = tl.arange(0, BLOCK_V)
    carry = tl.full([], 0.0, tl.float32)
    found = tl.full([], -1, tl.int32)
    last = tl.full([], -1, tl.int32)
    v0 = tl.full([], 0, tl.int32)
    while (v0 < V) & (found < 0):
        m_v = v0 + o_v < V
        if FROM_WS:
            b_w = tl.load(p_src + v0 + o_v, mask=m_v, other=0.0)  # [BLOCK_V] fp32
        else:
            b_x = tl.load(p_src + v0 + o_v, mask=m_v, other=float("-inf")).to(tl.float32)  # [BLOCK_V]
            b_w = tl.exp(b_x / temperature - m)
            if EXCLUDE:
                b_keep = _child_token_mask(v0 + o_v, v0, cur, b_child, b_tok, p_tok, p_par, T, BLOCK_V)
                b_w = tl.where(b_keep | (excl == 0), b_w, 0.0)
        b_w = tl.where(m_v, b_w, 0.0)
        b_c = tl.cumsum(b_w, 0) + carry  # [BLOCK_V]
        first = tl.min(tl.where((b_c > target) & m_v, v0 + o_v, 2147483647), 0)
        found = tl.where(first < 2147483647, first, found)
        last = tl.maximum(last, tl.max(tl.where(b_w > 0.0, v0 + o_v, -1), 0))
        carry = carry + tl.sum(b_w, 0)
        v0 += BLOCK_V
    return tl.where(found >= 0, found, tl.maximum(last, 0))


@triton.jit
def _residual_update(p_row, p_q, p_ws, V, temperature, m, s, S, has_res, BLOCK_V: tl.constexpr):
    """w <- max(r - q, 0) into the workspace, r = w / S (has_res) or p = exp(l / t - m) / s; returns
    sum(w). Each lane rewrites only the elements it read, so the in-place update needs no barrier."""
    o_v = tl.arange(0, BLOCK_V)
    s_new = tl.full([], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        m_v = v0 + o_v < V
        if has_res != 0:
            b_r = tl.load(p_ws + v0 + o_v, mask=m_v, other=0.0) / S  # [BLOCK_V]
        else:
            b_x = tl.load(p_row + v0 + o_v, mask=m_v, other=float("-inf")).to(tl.float32)  # [BLOCK_V]
            b_r = tl.exp(b_x / temperature - m) / s
        b_q = tl.load(p_q + v0 + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BLOCK_V]
        b_w = tl.where(m_v, tl.maximum(b_r - b_q, 0.0), 0.0)
        tl.store(p_ws + v0 + o_v, b_w, mask=m_v)
        s_new += tl.sum(b_w, 0)
    return s_new


@triton.jit
def _verify_accept_kernel(
    logits,  # [B, T, V]
    tokens,  # [B, T] int32/int64, contiguous
    parents,  # [B, T] int32/int64, contiguous
    uniforms,  # [B, T, 2] fp32, contiguous (unused when GREEDY)
    draft_probs,  # [B, T, V] (unused unless HAS_Q)
    workspace,  # [B, V] fp32 residual (unused unless HAS_Q)
    accept_len,  # [B] int32 out
    accepted_nodes,  # [B, T] int32 out
    out_tokens,  # [B, T] int64 out
    temperature,
    T,
    V,
    stride_lb,
    stride_lt,
    stride_qb,
    stride_qt,
    GREEDY: tl.constexpr,
    HAS_Q: tl.constexpr,
    EXCLUDE: tl.constexpr,  # deterministic drafts: zero rejected children's tokens on the fly
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_t = tl.arange(0, BLOCK_T)
    m_t = o_t < T
    p_tok = tokens + i_b * T
    p_par = parents + i_b * T
    b_tok = tl.load(p_tok + o_t, mask=m_t, other=-1).to(tl.int64)  # [BLOCK_T]
    b_par = tl.load(p_par + o_t, mask=m_t, other=-1).to(tl.int32)  # [BLOCK_T]
    p_lb = logits + i_b * stride_lb

    cur = tl.full([], 0, tl.int32)
    n_acc = tl.full([], 0, tl.int32)
    go = tl.full([], 1, tl.int32)
    b_path = tl.where(o_t == 0, 0, -1).to(tl.int32)  # [BLOCK_T]
    b_out = tl.full([BLOCK_T], -1, tl.int64)

    if GREEDY:
        n_acc, b_path, b_out, bonus = _greedy_walk(p_lb, stride_lt, logits, logits, 0, b_tok, b_par, o_t, m_t, V,
                                                   False, BLOCK_T, BLOCK_V, 1)
    else:
        b_child = (b_par == cur) & (o_t > cur) & m_t
        m, s, s_keep = _row_stats(p_lb, V, temperature, cur, b_child, b_tok, p_tok, p_par, T, EXCLUDE, BLOCK_V)
        e_rej = tl.full([], 0.0, tl.float32)  # deterministic drafts: exp mass of rejected tokens
        has_res = tl.full([], 0, tl.int32)  # draft_probs: the workspace holds the residual
        S = tl.full([], 1.0, tl.float32)  # its sum
        last_tried = tl.full([], 0, tl.int32)
        while go != 0:
            b_child = (b_par == cur) & (o_t > cur) & m_t
            c = tl.min(tl.where(b_child & (o_t > last_tried), o_t, BLOCK_T), 0)  # next child to try
            if c < BLOCK_T:
                x = tl.sum(tl.where(o_t == c, b_tok, 0), 0)  # int64 token of c
                valid = (x >= 0) & (x < V)
                xs = tl.where(valid, x, 0)
                p_row = p_lb + cur.to(tl.int64) * stride_lt
                u = tl.load(uniforms + (i_b * T + c) * 2)
                e_x = tl.exp(tl.load(p_row + xs).to(tl.float32) / temperature - m)
                if HAS_Q:
                    p_q = draft_probs + i_b * stride_qb + c.to(tl.int64) * stride_qt
                    p_ws = workspace + i_b * V
                    q_x = tl.load(p_q + xs).to(tl.float32)
                    r_ws = tl.load(p_ws + xs, mask=has_res != 0, other=0.0) / S
                    r_x = tl.where(has_res != 0, r_ws, e_x / s)
                    ok = valid & (q_x > 0.0) & (u < r_x / tl.where(q_x > 0.0, q_x, 1.0))
                else:
                    # x already rejected at this node (a duplicate sibling): its residual mass is 0.
                    n_dup = tl.sum((b_child & (o_t < c) & (b_tok == x)).to(tl.int32), 0)
                    den = s - e_rej
                    den = tl.where(den > 0.0, den, s)
                    ok = valid & (n_dup == 0) & (u < e_x / den)
                if ok:
                    n_acc += 1
                    b_path = tl.where(o_t == n_acc, c, b_path)
                    b_out = tl.where(o_t == n_acc - 1, x, b_out)
                    cur = c
                    b_child = (b_par == cur) & (o_t > cur) & m_t
                    m, s, s_keep = _row_stats(p_lb + c.to(tl.int64) * stride_lt, V, temperature, cur, b_child,
                                              b_tok, p_tok, p_par, T, EXCLUDE, BLOCK_V)
                    e_rej = tl.full([], 0.0, tl.float32)
                    has_res = tl.full([], 0, tl.int32)
                    S = tl.full([], 1.0, tl.float32)
                else:
                    if HAS_Q:
                        # Every thread must have read r(x) above before any lane overwrites it,
                        # or threads could disagree on `ok` and diverge.
                        tl.debug_barrier()
                        s_new = _residual_update(p_row, p_q, p_ws, V, temperature, m, s, S, has_res, BLOCK_V)
                        # The next child's scalar read of r(x) may hit an element another lane wrote.
                        tl.debug_barrier()
                        has_res = (s_new > 0.0).to(tl.int32)  # all-zero residual: back to p
                        S = tl.where(s_new > 0.0, s_new, 1.0)
                    else:
                        e_rej += tl.where(valid & (n_dup == 0), e_x, 0.0)
                last_tried = c
            else:
                go = 0
        # Bonus token at the last accepted node, from its residual target.
        u_b = tl.load(uniforms + (i_b * T + cur) * 2 + 1)
        p_row = p_lb + cur.to(tl.int64) * stride_lt
        b_child = (b_par == cur) & (o_t > cur) & m_t
        if HAS_Q:
            if has_res != 0:
                bonus = _inverse_cdf(workspace + i_b * V, V, temperature, m, u_b * S, 0, cur, b_child, b_tok,
                                     p_tok, p_par, T, True, False, BLOCK_V)
            else:
                bonus = _inverse_cdf(p_row, V, temperature, m, u_b * s, 0, cur, b_child, b_tok,
                                     p_tok, p_par, T, False, False, BLOCK_V)
        else:
            # Every child of cur was rejected: sample from p without their tokens (mass s_keep).
            excl = (s_keep > 0.0).to(tl.int32)
            target = u_b * tl.where(excl != 0, s_keep, s)
            bonus = _inverse_cdf(p_row, V, temperature, m, target, excl, cur, b_child, b_tok,
                                 p_tok, p_par, T, False, True, BLOCK_V)

    b_out = tl.where(o_t == n_acc, bonus.to(tl.int64), b_out)
    tl.store(accept_len + i_b, n_acc)
    tl.store(accepted_nodes + i_b * T + o_t, b_path, mask=m_t)
    tl.store(out_tokens + i_b * T + o_t, b_out, mask=m_t)


@triton.jit
def _best_of_chunks(p_max, p_idx, n_chunks, BLOCK_C: tl.constexpr):
    """First index of the maximum of a row from its per-chunk (max, first index) partials."""
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < n_chunks
    b_m = tl.load(p_max + o_c, mask=m_c, other=float("-inf"), cache_modifier=".cg")  # [BLOCK_C]
    b_i = tl.load(p_idx + o_c, mask=m_c, other=2147483647, cache_modifier=".cg")  # [BLOCK_C]
    b_best = tl.max(b_m, 0)
    return tl.min(tl.where(b_m == b_best, b_i, 2147483647), 0)


@triton.jit
def _greedy_walk(p_lb, stride_lt, p_max, p_idx, n_chunks, b_tok, b_par, o_t, m_t, V, SPLIT: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
    """Greedy walk from the root: (accepted count, path nodes, path tokens, bonus token). A node's
    target token is the argmax of its logits row (p_lb + node * stride_lt), or with SPLIT of its
    per-chunk partials (p_max / p_idx + node * n_chunks)."""
    cur = tl.full([], 0, tl.int32)
    n_acc = tl.full([], 0, tl.int32)
    go = tl.full([], 1, tl.int32)
    b_path = tl.where(o_t == 0, 0, -1).to(tl.int32)  # [BLOCK_T]
    b_out = tl.full([BLOCK_T], -1, tl.int64)
    if SPLIT:
        tgt = _best_of_chunks(p_max, p_idx, n_chunks, BLOCK_C)
    else:
        tgt = _row_argmax(p_lb, V, BLOCK_V)
    while go != 0:
        b_match = (b_par == cur) & (o_t > cur) & m_t & (b_tok == tgt)
        c = tl.min(tl.where(b_match, o_t, BLOCK_T), 0)  # lowest-index child with the target token
        if c < BLOCK_T:
            n_acc += 1
            b_path = tl.where(o_t == n_acc, c, b_path)
            b_out = tl.where(o_t == n_acc - 1, tgt.to(tl.int64), b_out)
            cur = c
            if SPLIT:
                tgt = _best_of_chunks(p_max + c.to(tl.int64) * n_chunks, p_idx + c.to(tl.int64) * n_chunks,
                                      n_chunks, BLOCK_C)
            else:
                tgt = _row_argmax(p_lb + c.to(tl.int64) * stride_lt, V, BLOCK_V)
        else:
            go = 0
    return n_acc, b_path, b_out, tgt


@triton.jit
def _greedy_split_kernel(
    logits,  # [B, T, V]
    tokens,  # [B, T] int32/int64, contiguous
    parents,  # [B, T] int32/int64, contiguous
    part_max,  # [B, T, n_chunks] fp32 workspace
    part_idx,  # [B, T, n_chunks] int32 workspace
    counters,  # [>= B] int32 arrivals, zero between launches
    accept_len,  # [B] int32 out
    accepted_nodes,  # [B, T] int32 out
    out_tokens,  # [B, T] int64 out
    T,
    V,
    n_chunks,
    stride_lb,
    stride_lt,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_c, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_v = i_c * BLOCK_V + tl.arange(0, BLOCK_V)
    b_l = tl.load(logits + i_b * stride_lb + i_t * stride_lt + o_v, mask=o_v < V,
                  other=float("-inf")).to(tl.float32)  # [BLOCK_V]
    # NaN counts as -inf, as in _row_argmax (whose strict > never takes a NaN): rows of padding
    # requests may hold garbage, and their token must still be a valid index.
    b_l = tl.where(b_l == b_l, b_l, float("-inf"))
    b_max = tl.max(b_l, 0)
    p_part = (i_b * T + i_t) * n_chunks + i_c
    tl.store(part_max + p_part, b_max)
    tl.store(part_idx + p_part, tl.min(tl.where(b_l == b_max, o_v, 2147483647), 0))
    # Every program stored its partial before its increment (barrier, then release); the last one
    # to arrive reads complete partials (acquire) and walks the tree.
    tl.debug_barrier()
    arrived = tl.atomic_add(counters + i_b, 1, sem="acq_rel")
    if arrived == T * n_chunks - 1:
        tl.store(counters + i_b, 0)
        o_t = tl.arange(0, BLOCK_T)
        m_t = o_t < T
        b_tok = tl.load(tokens + i_b * T + o_t, mask=m_t, other=-1).to(tl.int64)  # [BLOCK_T]
        b_par = tl.load(parents + i_b * T + o_t, mask=m_t, other=-1).to(tl.int32)  # [BLOCK_T]
        p_rows = i_b * T * n_chunks
        n_acc, b_path, b_out, bonus = _greedy_walk(logits, 0, part_max + p_rows, part_idx + p_rows, n_chunks, b_tok,
                                                   b_par, o_t, m_t, V, True, BLOCK_T, BLOCK_V, BLOCK_C)
        b_out = tl.where(o_t == n_acc, bonus.to(tl.int64), b_out)
        tl.store(accept_len + i_b, n_acc)
        tl.store(accepted_nodes + i_b * T + o_t, b_path, mask=m_t)
        tl.store(out_tokens + i_b * T + o_t, b_out, mask=m_t)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _launch_config(V):
    """BLOCK_V and num_warps from V only: 4096-wide chunks (12 passes at V = 49152) keep a single
    program per request streaming; 8 warps give 16 fp32 lanes per thread."""
    block_v = min(4096, triton.next_power_of_2(V))
    num_warps = 8 if block_v >= 4096 else 4 if block_v >= 1024 else 1
    return block_v, num_warps


def _split_config(V):
    """BLOCK_V and num_warps of the split greedy variant: 2048-wide chunks (more for vocabularies
    past 2048 * SPLIT_MAX_CHUNKS), 16 fp32 lanes per thread."""
    block_v = max(2048, triton.next_power_of_2(triton.cdiv(V, SPLIT_MAX_CHUNKS)))
    return min(block_v, triton.next_power_of_2(V)), max(1, min(16, block_v // 512))


def verify_accept(logits, tokens, parents, temperature, uniforms=None, draft_probs=None, *, split_vocab=None):
    """Accepted path and bonus token for every request of a batch of draft trees, in one launch.

    Args:
        logits: [B, T, V] fp32 / fp16 / bf16, last dim contiguous; row i = target logits at node i.
        tokens: [B, T] int64 (or int32) node tokens; tokens[:, 0] is the root and is not matched.
        parents: [B, T] int32 (or int64); parents[:, 0] = -1, parents[b, i] < i, < 0 = padding node.
        temperature: python float, 0 = greedy, > 0 = exact stochastic verification.
        uniforms: [B, T, 2] fp32 in [0, 1) (required when temperature > 0): [..., 0] acceptance
            coin of the node as a child, [..., 1] bonus draw at the node.
        draft_probs: None (deterministic drafts, q = one-hot) or [B, T, V] float, last dim contiguous:
            row i = distribution node i's token was drawn from. Ignored when greedy.
        split_vocab: greedy only: True splits each row's vocabulary across programs (see the module
            docstring), False keeps one program per request; None: split when the logits are at
            most SPLIT_GREEDY_MAX_BYTES (from shapes only, capture-safe).

    Returns:
        (accept_len [B] int32, accepted_nodes [B, T] int32, out_tokens [B, T] int64); see the
        module docstring. Never reads tensor values on the host (CUDA-graph capturable).
    """
    if logits.dim() != 3 or logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            "verify_accept: logits must be [B, T, V] float32/float16/bfloat16, got "
            f"{tuple(logits.shape)} {logits.dtype}"
        )
    B, T, V = logits.shape
    if T < 1 or V < 1:
        raise ValueError(f"verify_accept: logits must have T >= 1 and V >= 1, got {tuple(logits.shape)}")
    if T > MAX_TREE_TOKENS:
        raise ValueError(f"verify_accept: T={T} tree nodes exceeds the supported maximum {MAX_TREE_TOKENS}")
    if logits.stride(-1) != 1:
        raise ValueError("verify_accept: the vocab dim (last dim) of logits must be contiguous")
    dev = logits.device
    for name, t in (("tokens", tokens), ("parents", parents)):
        if t.shape != (B, T) or t.dtype not in _INT_DTYPES:
            raise ValueError(
                f"verify_accept: {name} must be [B, T] = [{B}, {T}] int32/int64, got {tuple(t.shape)} {t.dtype}"
            )
        if t.device != dev:
            raise ValueError(f"verify_accept: {name} is on {t.device}, logits on {dev}")
    temperature = float(temperature)
    if not temperature >= 0.0:
        raise ValueError(f"verify_accept: temperature must be >= 0 (0 = greedy), got {temperature}")
    greedy = temperature == 0.0
    if not greedy:
        if uniforms is None:
            raise ValueError("verify_accept: temperature > 0 needs uniforms [B, T, 2] float32")
        if uniforms.shape != (B, T, 2) or uniforms.dtype != torch.float32:
            raise ValueError(
                f"verify_accept: uniforms must be [B, T, 2] = [{B}, {T}, 2] float32, got "
                f"{tuple(uniforms.shape)} {uniforms.dtype}"
            )
        if uniforms.device != dev:
            raise ValueError(f"verify_accept: uniforms is on {uniforms.device}, logits on {dev}")
        if draft_probs is not None:
            if draft_probs.shape != (B, T, V) or draft_probs.dtype not in _FLOAT_DTYPES:
                raise ValueError(
                    f"verify_accept: draft_probs must be [B, T, V] = [{B}, {T}, {V}] float, got "
                    f"{tuple(draft_probs.shape)} {draft_probs.dtype}"
                )
            if draft_probs.stride(-1) != 1:
                raise ValueError("verify_accept: the vocab dim (last dim) of draft_probs must be contiguous")
            if draft_probs.device != dev:
                raise ValueError(f"verify_accept: draft_probs is on {draft_probs.device}, logits on {dev}")
    has_q = (not greedy) and draft_probs is not None

    accept_len = torch.empty(B, dtype=torch.int32, device=dev)
    accepted_nodes = torch.empty(B, T, dtype=torch.int32, device=dev)
    out_tokens = torch.empty(B, T, dtype=torch.int64, device=dev)
    if B == 0:
        return accept_len, accepted_nodes, out_tokens
    tokens = tokens.contiguous()
    parents = parents.contiguous()
    unif = uniforms.contiguous() if not greedy else logits  # placeholder pointer when greedy
    if has_q:
        q = draft_probs
        workspace = torch.empty(B, V, dtype=torch.float32, device=dev)
    else:
        q, workspace = logits, logits  # placeholders, never dereferenced
    if greedy and (split_vocab if split_vocab is not None
                   else B * T * V * logits.element_size() <= SPLIT_GREEDY_MAX_BYTES):
        block_v, num_warps = _split_config(V)
        n_chunks = triton.cdiv(V, block_v)
        part_max = torch.empty(B, T, n_chunks, dtype=torch.float32, device=dev)
        part_idx = torch.empty(B, T, n_chunks, dtype=torch.int32, device=dev)
        _greedy_split_kernel[(n_chunks, T, B)](
            logits, tokens, parents, part_max, part_idx, arrival_counters(dev, B, "verify_accept"), accept_len, accepted_nodes,
            out_tokens, T, V, n_chunks, logits.stride(0), logits.stride(1),
            BLOCK_T=triton.next_power_of_2(T), BLOCK_V=block_v, BLOCK_C=triton.next_power_of_2(n_chunks),
            num_warps=num_warps,
        )  # fmt: skip
        return accept_len, accepted_nodes, out_tokens
    block_v, num_warps = _launch_config(V)
    _verify_accept_kernel[(B,)](
        logits, tokens, parents, unif, q, workspace, accept_len, accepted_nodes, out_tokens,
        temperature if not greedy else 1.0, T, V,
        logits.stride(0), logits.stride(1), q.stride(0), q.stride(1),
        GREEDY=greedy, HAS_Q=has_q, EXCLUDE=not greedy and not has_q,
        BLOCK_T=triton.next_power_of_2(T), BLOCK_V=block_v,
        num_warps=num_warps,
    )  # fmt: skip
    return accept_len, accepted_nodes, out_tokens
