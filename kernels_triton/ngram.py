"""n-gram drafting on the device: prompt lookup over each row's committed tokens, kept in a paged
token cache beside the KV (one int32 per KV slot), so a drafting step needs nothing from the host.

Token cache: ``tok[slot]`` is the token whose KV sits at ``slot`` (page_table[b, p // PS] * PS +
p % PS for position p of row b); it holds positions 0 .. seq_lens[b] - 1 of every row (written by
the drafter's prefill, by ``ngram_propose_`` for the pending token, by ``ngram_record_`` for the
accepted ones). The row's committed history is those tokens plus the pending token (position
seq_lens[b], its KV not written yet): H = seq_lens[b] + 1 tokens.

    ngram_propose_(tok, page_table, seq_lens, pending, valid, out, PS, min_n, max_n)
        per valid row b < B: tok[slot(L)] = pending[b] (L = seq_lens[b]: the root's slot, already
        allocated for the step's tree), then for n = min(max_n, H - 1) .. min_n the latest start s
        <= H - 1 - n with history[s : s + n] == history[H - n : H]; the first n with a match gives
        out[b, 1 + i] = history[s + n + i] for i < min(T - 1, H - s - n), -1 elsewhere (no match,
        padding rows: all -1). Column 0 is left alone (the tree's root is the pending token).
        The same chain as ``specdec.spec.ngram.NgramDrafter.lookup(history, T - 1)``.
    ngram_record_(tok, page_table, seq_old, out_tokens, accept_len, valid, PS)
        per valid row: tok[slot(seq_old[b] + 1 + i)] = out_tokens[b, i] for i < accept_len[b]
        (the accepted draft tokens, whose KV the commit moved to those slots; the bonus token is
        the next pending one).

Kernel layout: one program per row. The search scans candidate starts in blocks of BLOCK from the
newest down and stops at the first block with a match (HumanEval / MT-bench rows: a block or two);
each block gathers n tokens per start through the page table. Capture-safe: nothing is read on the host.
"""

import torch
import triton
import triton.language as tl


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
def _slots(page_table, b, pos, PS):
    pos = torch.as_tensor(pos, dtype=torch.int64, device=page_table.device)
    return page_table[b, pos // PS].long() * PS + pos % PS


def ngram_propose_ref_(tok, page_table, seq_lens, pending, valid, out, page_size: int, min_n: int, max_n: int):
    B, T = out.shape
    for b in range(B):
        if T > 1:
            out[b, 1:] = -1
        if not bool(valid[b]):
            continue
        L = int(seq_lens[b])
        tok[_slots(page_table, b, L, page_size)] = int(pending[b])
        hist = tok[_slots(page_table, b, torch.arange(L + 1), page_size)].tolist()
        H = len(hist)
        for n in range(min(max_n, H - 1), min_n - 1, -1):
            suffix = hist[H - n:]
            hit = next((s for s in range(H - 1 - n, -1, -1) if hist[s:s + n] == suffix), None)
            if hit is not None:
                follow = hist[hit + n:hit + n + T - 1]
                out[b, 1:1 + len(follow)] = torch.tensor(follow, dtype=out.dtype)
                break


def ngram_record_ref_(tok, page_table, seq_old, out_tokens, accept_len, valid, page_size: int):
    for b in range(out_tokens.shape[0]):
        A = int(accept_len[b])
        if bool(valid[b]) and A > 0:
            pos = int(seq_old[b]) + 1 + torch.arange(A)
            tok[_slots(page_table, b, pos, page_size)] = out_tokens[b, :A].to(tok.dtype)


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------
@triton.jit
def _hist(tok_ptr, pt_row, pos, mask, L, pend, PS: tl.constexpr):
    """history[pos] of one row (the pending token at pos == L), gathered through its page table."""
    page = tl.load(pt_row + pos // PS, mask=mask & (pos < L), other=0).to(tl.int64)
    t = tl.load(tok_ptr + page * PS + pos % PS, mask=mask & (pos < L), other=-1).to(tl.int64)
    return tl.where(pos == L, pend, t)


@triton.jit
def _ngram_propose_kernel(tok_ptr, pt_ptr, stride_pt, seq_ptr, pend_ptr, valid_ptr, out_ptr, stride_out, T,
                          PS: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr,
                          KB: tl.constexpr):
    b = tl.program_id(0)
    ok = tl.load(valid_ptr + b).to(tl.int32) != 0
    oi = tl.arange(0, KB)
    if ok:
        L = tl.load(seq_ptr + b).to(tl.int64)
        pend = tl.load(pend_ptr + b).to(tl.int64)
        pt_row = pt_ptr + b * stride_pt
        root_page = tl.load(pt_row + L // PS).to(tl.int64)
        tl.store(tok_ptr + root_page * PS + L % PS, pend.to(tok_ptr.dtype.element_ty))
        found = tl.zeros((), dtype=tl.int64) - 1  # start of the match
        fn = tl.zeros((), dtype=tl.int64)  # its n
        ob = tl.arange(0, BLOCK)
        for i in range(0, MAX_N - MIN_N + 1):  # n = MAX_N .. MIN_N, the first with a match wins
            n = MAX_N - i
            if (found < 0) & (n <= L):  # H - 1 = L tokens before the pending one
                top = L - n  # the latest start with a follower
                while (top >= 0) & (found < 0):
                    s = top - ob  # newest first
                    ms = s >= 0
                    hit = ms
                    for j in tl.static_range(MAX_N):  # the suffix's token j (j < n)
                        want = _hist(tok_ptr, pt_row, L - n + 1 + j + tl.zeros((), dtype=tl.int64), j < n, L,
                                     pend, PS)
                        hit = hit & ((_hist(tok_ptr, pt_row, s + j, ms & (j < n), L, pend, PS) == want) | (j >= n))
                    best = tl.max(tl.where(hit, s, -1), axis=0)
                    fn = tl.where(best >= 0, best * 0 + n, fn)
                    found = tl.where(best >= 0, best, found)
                    top -= BLOCK
        f = found + fn + oi  # follower positions
        keep = (found >= 0) & (oi < T - 1) & (f <= L)
        chain = _hist(tok_ptr, pt_row, f, keep, L, pend, PS)
        tl.store(out_ptr + b * stride_out + 1 + oi, tl.where(keep, chain, -1), mask=oi < T - 1)
    else:
        tl.store(out_ptr + b * stride_out + 1 + oi, tl.full((KB,), -1, tl.int64), mask=oi < T - 1)


@triton.jit
def _ngram_record_kernel(tok_ptr, pt_ptr, stride_pt, seq_ptr, out_ptr, stride_out, acc_ptr, valid_ptr, T,
                         PS: tl.constexpr, KB: tl.constexpr):
    b = tl.program_id(0)
    ok = tl.load(valid_ptr + b).to(tl.int32) != 0
    A = tl.load(acc_ptr + b).to(tl.int64)
    oi = tl.arange(0, KB)
    m = ok & (oi < A) & (oi < T)
    pos = tl.load(seq_ptr + b).to(tl.int64) + 1 + oi
    page = tl.load(pt_ptr + b * stride_pt + pos // PS, mask=m, other=0).to(tl.int64)
    t = tl.load(out_ptr + b * stride_out + oi, mask=m, other=0)
    tl.store(tok_ptr + page * PS + pos % PS, t.to(tok_ptr.dtype.element_ty), mask=m)


def _check(name, tok, page_table, rows, *vecs):
    if tok.dim() != 1 or tok.dtype != torch.int32:
        raise ValueError(f"{name}: tok must be a flat int32 token cache, got {tuple(tok.shape)} {tok.dtype}")
    if page_table.dtype != torch.int32 or page_table.stride(1) != 1 or page_table.shape[0] < rows:
        raise ValueError(f"{name}: page_table must be [>= {rows}, MP] int32 with contiguous rows")
    for v in vecs:
        if v.shape[0] < rows:
            raise ValueError(f"{name}: per-row inputs need {rows} rows, got {tuple(v.shape)}")


def ngram_propose_(tok, page_table, seq_lens, pending, valid, out, page_size: int, min_n: int, max_n: int):
    """One launch of the lookup above over rows 0 .. B - 1 of ``out`` ([B, T] int64, row-contiguous)."""
    B, T = out.shape
    _check("ngram_propose_", tok, page_table, B, seq_lens, pending, valid)
    if out.dtype != torch.int64 or out.stride(1) != 1:
        raise ValueError("ngram_propose_: out must be [B, T] int64 with contiguous rows")
    if B == 0 or T < 2:
        return
    _ngram_propose_kernel[(B,)](
        tok, page_table, page_table.stride(0), seq_lens, pending, valid, out, out.stride(0), T,
        PS=page_size, MIN_N=min_n, MAX_N=max_n, BLOCK=256, KB=triton.next_power_of_2(T - 1),
    )  # fmt: skip


def ngram_record_(tok, page_table, seq_old, out_tokens, accept_len, valid, page_size: int):
    """One launch of the recording above over rows 0 .. B - 1 of ``out_tokens`` ([B, T])."""
    B, T = out_tokens.shape
    _check("ngram_record_", tok, page_table, B, seq_old, accept_len, valid)
    if B == 0:
        return
    _ngram_record_kernel[(B,)](
        tok, page_table, page_table.stride(0), seq_old, out_tokens, out_tokens.stride(0), accept_len, valid, T,
        PS=page_size, KB=triton.next_power_of_2(T),
    )  # fmt: skip
