"""The commit: move the accepted tree nodes' KV into place and advance the sequence state.

During verification the target (and the draft) wrote the KV of tree node i of request b at logical
slot seq_lens[b] + i (scratch past the committed length). After verify_accept picked the path
0 = n_0 < n_1 < ... < n_A (A = accept_len[b]), the committed sequence is root, n_1, ..., n_A, so

    for i in 1..A:   KV[slot seq_lens[b] + i] <- KV[slot seq_lens[b] + n_i]     (every layer, head, pool)
    new_seq_lens[b] = seq_lens[b] + A + 1        (the root and the accepted nodes now hold committed KV)
    pending[b]      = out_tokens[b, A]           (the bonus token: next step's root, no KV yet)

Rejected nodes' KV stays behind in scratch and is overwritten next step; nothing is freed.

With ``valid`` [B] bool and ``into`` = (seq_out [B], pending_out [B], sampled_out [B, T]) the same
launch commits into the engine's state buffers (the step's whole commit in one kernel): rows with
valid[b] False are padding (stale state) and count as A = 0 with nothing written but

    seq_out[b] = seq_lens[b];  sampled_out[b, :] = -1           (pending_out[b] kept)
and valid rows get seq_out[b] = new_seq_lens[b], pending_out[b] = pending[b], sampled_out[b, :] =
out_tokens[b, :]. With ``valid``, accept_len is also zeroed in place on padding rows. seq_lens itself stays an input (other programs read it while the state row is
written), so ``into`` must not alias it.

Shapes (named dims):
    B requests, T tree nodes, L layers, P pages, PS slots per page, HKV KV heads, D head dim, MP pages
    per request
    caches          list of (k_cache, v_cache), each [L, P, PS, HKV, D]; pools (e.g. target and draft)
                    may differ in L / HKV / D / dtype but share P, PS and the page table
    page_table      [B, MP] int32   logical slot s of request b -> page_table[b, s // PS], offset s % PS
    seq_lens        [B] int32       committed lengths before the step (not modified)
    accepted_nodes  [B, T] int32    from verify_accept: path node indices, n_0 = 0, -1 after the path
    accept_len      [B] int32       from verify_accept, 0 <= A < T
    out_tokens      [B, T] int64    from verify_accept: committed tokens, bonus at index A
    returns new_seq_lens [B] int32, pending [B] (dtype of out_tokens); both new tensors

Aliasing: a slot can be both a source and a destination (path 0, 2, 3 moves slot 2 -> 1 and
3 -> 2: row 1 reads slot 2, row 2 writes it). Since the path increases (n_j >= j), row j's
destination (slot j) is read only by EARLIER rows i < j (n_i = j), never by later ones. So the rows
are moved in increasing order, a block of rows at a time: load the block's K/V, barrier (other lanes
of this block, and the previous blocks, have finished reading), store. The barrier makes a store
wait for every earlier read, which is all this order needs.

Kernel layout: one program per (request, layer x KV head of one pool) moves its path rows in
[BLOCK_R, D] tiles (~1024 elements; rows with n_i == i, already in place, are masked off). Two pools
go in one launch (grid axis 1 = L_a * HKV_a + L_b * HKV_b, branch on the program id), so the usual
target + draft pair costs one launch; the launcher loops over further pairs. Programs of the first
launch with axis-1 id 0 write new_seq_lens and pending (inputs are never written, so no race).
Requests with A = 0 only do that. Capture-safe: nothing is read on the host.

Invariants: the scratch slots seq_lens[b] .. seq_lens[b] + T - 1 of different requests are distinct
physical slots, and their pages are valid in page_table; 0 <= accept_len[b] < T.
"""

import torch
import triton
import triton.language as tl

MAX_TREE_TOKENS = 1024


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


def kv_sync_ref_(caches, page_table, seq_lens, accepted_nodes, accept_len, out_tokens, valid=None, into=None):
    """Plain-torch commit (mutates the caches, and ``into``, in place); returns (new_seq_lens, pending)."""
    B, T = accepted_nodes.shape
    if valid is not None:
        accept_len.masked_fill_(~valid, 0)  # in place, as the kernel does
    n = accept_len.long()
    o_i = torch.arange(T, device=accepted_nodes.device)
    move = (o_i >= 1) & (o_i <= n[:, None])  # [B, T]
    b_idx, i_idx = move.nonzero(as_tuple=True)  # [M] each
    base = seq_lens.long()[b_idx]
    src = base + accepted_nodes[b_idx, i_idx].long()  # [M] logical slots
    dst = base + i_idx
    for k_cache, v_cache in caches:
        PS = k_cache.shape[2]
        p_src, o_src = page_table[b_idx, src // PS].long(), src % PS
        p_dst, o_dst = page_table[b_idx, dst // PS].long(), dst % PS
        for cache in (k_cache, v_cache):
            rows = cache[:, p_src, o_src].clone()  # [L, M, HKV, D], all read before any write
            cache[:, p_dst, o_dst] = rows
    new_seq_lens = (seq_lens + accept_len + 1).to(torch.int32)
    pending = out_tokens.gather(1, n[:, None])[:, 0]
    if into is None:
        return new_seq_lens, pending
    seq_out, pending_out, sampled_out = into
    v = valid if valid is not None else torch.ones(B, dtype=torch.bool, device=seq_lens.device)
    sampled_out.copy_(torch.where(v[:, None], out_tokens, -1))
    pending_out.copy_(torch.where(v, pending, pending_out))
    seq_out.copy_(torch.where(v, new_seq_lens, seq_lens))
    return seq_out, pending_out


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _move_rows(
    k_cache, v_cache, p_pt, p_nodes, sl, n, T, i_l, i_h,
    stride_kl, stride_kp, stride_ks, stride_kh, stride_vl, stride_vp, stride_vs, stride_vh,
    PS: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Path rows i = 1..n of one (layer, KV head) slice: slot sl + nodes[i] -> sl + i, BLOCK_R rows
    at a time in increasing i (see the module docstring for why that order is alias-safe)."""
    o_r = tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    i_l = i_l.to(tl.int64)
    for r0 in range(1, n + 1, BLOCK_R):
        o_i = r0 + o_r  # [BLOCK_R] path positions
        m_i = (o_i <= n) & (o_i < T)
        b_node = tl.load(p_nodes + o_i, mask=m_i, other=0)  # [BLOCK_R]
        m_i = m_i & (b_node != o_i)  # already in place (e.g. a chain's prefix): nothing to move
        m_id = m_i[:, None] & (o_d < D)[None, :]
        src = sl + b_node  # [BLOCK_R] logical slots
        dst = sl + o_i
        pg_src = tl.load(p_pt + src // PS, mask=m_i, other=0).to(tl.int64)  # [BLOCK_R]
        pg_dst = tl.load(p_pt + dst // PS, mask=m_i, other=0).to(tl.int64)  # [BLOCK_R]
        off_src = (src % PS).to(tl.int64)
        off_dst = (dst % PS).to(tl.int64)
        row_k_src = i_l * stride_kl + pg_src * stride_kp + off_src * stride_ks + i_h * stride_kh
        row_v_src = i_l * stride_vl + pg_src * stride_vp + off_src * stride_vs + i_h * stride_vh
        b_k = tl.load(k_cache + row_k_src[:, None] + o_d[None, :], mask=m_id)  # [BLOCK_R, BLOCK_D]
        b_v = tl.load(v_cache + row_v_src[:, None] + o_d[None, :], mask=m_id)  # [BLOCK_R, BLOCK_D]
        # A row of this block may overwrite a slot another lane of the block (or of the previous
        # block) has just read (path 0, 2, 3: slot 2 is read by row 1, written by row 2).
        tl.debug_barrier()
        row_k_dst = i_l * stride_kl + pg_dst * stride_kp + off_dst * stride_ks + i_h * stride_kh
        row_v_dst = i_l * stride_vl + pg_dst * stride_vp + off_dst * stride_vs + i_h * stride_vh
        tl.store(k_cache + row_k_dst[:, None] + o_d[None, :], b_k, mask=m_id)
        tl.store(v_cache + row_v_dst[:, None] + o_d[None, :], b_v, mask=m_id)


@triton.jit
def _kv_sync_kernel(
    ka, va,  # pool a: [L_a, P, PS, HKV_a, D_a] each
    kb, vb,  # pool b: [L_b, P, PS, HKV_b, D_b] each (unused unless NUM_POOLS == 2)
    page_table,  # [B, MP] int32
    seq_lens,  # [B] int32
    accepted_nodes,  # [B, T] int32
    accept_len,  # [B] int32
    out_tokens,  # [B, T] int64 / int32
    new_seq_lens,  # [B] int32 out (WRITE_STATE)
    pending,  # [B] out (WRITE_STATE)
    valid,  # [B] bool (HAS_VALID)
    sampled,  # [B, T] out, row stride stride_sm (WRITE_SAMPLED)
    T,
    stride_pt,
    stride_an,
    stride_ot,
    stride_sm,
    s_kal, s_kap, s_kas, s_kah, s_val, s_vap, s_vas, s_vah,
    s_kbl, s_kbp, s_kbs, s_kbh, s_vbl, s_vbp, s_vbs, s_vbh,
    N_A,  # L_a * HKV_a programs on axis 1 belong to pool a, the rest to pool b
    HKV_A: tl.constexpr,
    HKV_B: tl.constexpr,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    PS: tl.constexpr,
    NUM_POOLS: tl.constexpr,
    WRITE_STATE: tl.constexpr,
    HAS_VALID: tl.constexpr,
    WRITE_SAMPLED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_RA: tl.constexpr,  # path rows moved per block, pool a
    BLOCK_RB: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr,
):  # fmt: skip
    i_b = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    n = tl.load(accept_len + i_b)
    sl = tl.load(seq_lens + i_b)
    if HAS_VALID:
        ok = tl.load(valid + i_b).to(tl.int32) != 0
        n = tl.where(ok, n, 0)  # padding row: stale page table, nothing moves
    else:
        ok = True
    if WRITE_STATE:
        if i_s == 0:
            tl.store(new_seq_lens + i_b, tl.where(ok, sl + n + 1, sl))
            if HAS_VALID:
                # Zeroed in place on padding rows for later readers (the drafter's extend). Programs
                # of this launch that still read the old value mask it with ``valid`` themselves.
                tl.store(accept_len + i_b, n)
            if ok:
                tl.store(pending + i_b, tl.load(out_tokens + i_b * stride_ot + n))
            if WRITE_SAMPLED:
                for t0 in range(0, T, BLOCK_T):
                    o_t = t0 + tl.arange(0, BLOCK_T)
                    m_t = o_t < T
                    b_tok = tl.load(out_tokens + i_b * stride_ot + o_t, mask=m_t & ok, other=-1)
                    tl.store(sampled + i_b * stride_sm + o_t, b_tok.to(sampled.dtype.element_ty), mask=m_t)
    if NUM_POOLS > 0:
        if n > 0:  # A = 0: nothing to move
            p_pt = page_table + i_b * stride_pt
            p_nodes = accepted_nodes + i_b * stride_an
            if i_s < N_A:
                _move_rows(
                    ka, va, p_pt, p_nodes, sl, n, T, i_s // HKV_A, i_s % HKV_A,
                    s_kal, s_kap, s_kas, s_kah, s_val, s_vap, s_vas, s_vah, PS, D_A, BLOCK_RA, BLOCK_DA,
                )  # fmt: skip
            else:
                if NUM_POOLS == 2:
                    i_sb = i_s - N_A
                    _move_rows(
                        kb, vb, p_pt, p_nodes, sl, n, T, i_sb // HKV_B, i_sb % HKV_B,
                        s_kbl, s_kbp, s_kbs, s_kbh, s_vbl, s_vbp, s_vbs, s_vbh, PS, D_B, BLOCK_RB, BLOCK_DB,
                    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _check_pool(idx, pool, ref_shape):
    if not isinstance(pool, (tuple, list)) or len(pool) != 2:
        raise ValueError(f"kv_sync_: caches[{idx}] must be a (k_cache, v_cache) pair")
    k, v = pool
    if k.dim() != 5 or v.shape != k.shape:
        raise ValueError(
            f"kv_sync_: caches[{idx}] k and v must both be [L, P, PS, HKV, D], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if v.dtype != k.dtype:
        raise ValueError(f"kv_sync_: caches[{idx}] k is {k.dtype} but v is {v.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"kv_sync_: caches[{idx}] head dim (last dim) must be contiguous")
    if v.device != k.device:
        raise ValueError(f"kv_sync_: caches[{idx}] k is on {k.device}, v on {v.device}")
    if ref_shape is not None and k.shape[1:3] != ref_shape:
        raise ValueError(
            f"kv_sync_: all pools share the page table, so (P, PS) must match: caches[{idx}] has "
            f"{tuple(k.shape[1:3])}, caches[0] has {tuple(ref_shape)}"
        )


def _row_block(T, D):
    """(BLOCK_R, BLOCK_D): ~1024-element [rows, D] tiles. Holding all T - 1 rows at once instead
    needs 255 registers and spills at T = 64, d128 (ptxas, sm_90)."""
    block_d = triton.next_power_of_2(D)
    return max(1, min(triton.next_power_of_2(max(T - 1, 1)), 1024 // block_d)), block_d


def _strides(k, v):
    return (k.stride(0), k.stride(1), k.stride(2), k.stride(3), v.stride(0), v.stride(1), v.stride(2), v.stride(3))


def kv_sync_(caches, page_table, seq_lens, accepted_nodes, accept_len, out_tokens, valid=None, into=None):
    """Commit one verification step (mutates every cache in ``caches`` in place).

    Args:
        caches: list of (k_cache, v_cache) pairs, each [L, P, PS, HKV, D] (any float dtype; pools
            may differ in L / HKV / D / dtype, share P and PS), head dim contiguous.
        page_table: [B, MP] int32. seq_lens: [B] int32 committed lengths (not modified).
        accepted_nodes, accept_len, out_tokens: verify_accept's outputs ([B, T] int32, [B] int32,
            [B, T] int64 or int32).

        valid: [B] bool or None: rows with False commit nothing (padding rows of a graph bucket).
        into: None, or (seq_out [B] int32, pending_out [B], sampled_out [B, T] int64) state buffers to
            commit into in place (see the module docstring); must not alias seq_lens.

    Returns:
        (new_seq_lens [B] int32 = seq_lens + accept_len + 1, pending [B] = out_tokens[b, accept_len[b]]),
        or (seq_out, pending_out) with ``into``. One launch per two pools (one for the usual target +
        draft pair); the first also writes the state.
    """
    if accepted_nodes.dim() != 2 or accepted_nodes.dtype != torch.int32:
        raise ValueError(
            f"kv_sync_: accepted_nodes must be [B, T] int32, got {tuple(accepted_nodes.shape)} {accepted_nodes.dtype}"
        )
    B, T = accepted_nodes.shape
    if T < 1 or T > MAX_TREE_TOKENS:
        raise ValueError(f"kv_sync_: T={T} must be in [1, {MAX_TREE_TOKENS}]")
    dev = accepted_nodes.device
    for name, t, shape in (("seq_lens", seq_lens, (B,)), ("accept_len", accept_len, (B,))):
        if t.shape != shape or t.dtype != torch.int32:
            raise ValueError(f"kv_sync_: {name} must be [B] = [{B}] int32, got {tuple(t.shape)} {t.dtype}")
    if out_tokens.shape != (B, T) or out_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"kv_sync_: out_tokens must be [B, T] = [{B}, {T}] int64/int32, got "
            f"{tuple(out_tokens.shape)} {out_tokens.dtype}"
        )
    if page_table.dim() != 2 or page_table.shape[0] != B or page_table.dtype != torch.int32:
        raise ValueError(
            f"kv_sync_: page_table must be [B, MP] = [{B}, MP] int32, got {tuple(page_table.shape)} {page_table.dtype}"
        )
    for name, t in (("seq_lens", seq_lens), ("accept_len", accept_len), ("out_tokens", out_tokens),
                    ("page_table", page_table)):
        if t.device != dev:
            raise ValueError(f"kv_sync_: {name} is on {t.device}, accepted_nodes on {dev}")
    pools = list(caches)
    for idx, pool in enumerate(pools):
        _check_pool(idx, pool, pools[0][0].shape[1:3] if idx > 0 else None)
        if pool[0].device != dev:
            raise ValueError(f"kv_sync_: caches[{idx}] is on {pool[0].device}, accepted_nodes on {dev}")

    if valid is not None and (valid.shape != (B,) or valid.dtype != torch.bool or valid.device != dev):
        raise ValueError(f"kv_sync_: valid must be [B] = [{B}] bool on {dev}, got {tuple(valid.shape)} {valid.dtype}")
    if into is not None:
        new_seq_lens, pending, sampled = into
        if (new_seq_lens.shape != (B,) or new_seq_lens.dtype != torch.int32 or pending.shape != (B,)
                or sampled.shape != (B, T) or sampled.stride(1) != 1
                or any(t.device != dev for t in into)):
            raise ValueError(f"kv_sync_: into must be (seq [B] int32, pending [B], sampled [B, T] rows contiguous) "
                             f"with B={B}, T={T}, got {[tuple(t.shape) for t in into]}")
        if new_seq_lens.data_ptr() == seq_lens.data_ptr():
            raise ValueError("kv_sync_: into's seq buffer must not alias seq_lens (an input of every program)")
    else:
        new_seq_lens = torch.empty(B, dtype=torch.int32, device=dev)
        pending = torch.empty(B, dtype=out_tokens.dtype, device=dev)
        sampled = new_seq_lens  # placeholder (WRITE_SAMPLED False)
    if B == 0:
        return new_seq_lens, pending
    if valid is not None and not accept_len.is_contiguous():
        raise ValueError("kv_sync_: with valid, accept_len is written in place and must be contiguous")
    seq_lens, accept_len = seq_lens.contiguous(), accept_len.contiguous()
    PS = pools[0][0].shape[2] if pools else 1
    pairs = [pools[i : i + 2] for i in range(0, len(pools), 2)] or [[]]
    for idx, pair in enumerate(pairs):
        a = pair[0] if len(pair) > 0 else (accepted_nodes, accepted_nodes)  # placeholders when no pool
        b = pair[1] if len(pair) > 1 else a
        if len(pair) > 0:
            (L_a, _, _, hkv_a, d_a), (L_b, _, _, hkv_b, d_b) = a[0].shape, b[0].shape
            s_a, s_b = _strides(*a), _strides(*b)
        else:
            L_a = hkv_a = d_a = L_b = hkv_b = d_b = 1
            s_a = s_b = (0,) * 8
        n_a = L_a * hkv_a
        n_b = L_b * hkv_b if len(pair) == 2 else 0
        (block_ra, block_da), (block_rb, block_db) = _row_block(T, d_a), _row_block(T, d_b)
        tile = max(block_ra * block_da, block_rb * block_db)
        _kv_sync_kernel[(B, max(1, n_a + n_b))](
            a[0], a[1], b[0], b[1], page_table, seq_lens, accepted_nodes, accept_len, out_tokens,
            new_seq_lens, pending, valid if valid is not None else seq_lens, sampled,
            T, page_table.stride(0), accepted_nodes.stride(0), out_tokens.stride(0),
            sampled.stride(0) if into is not None else 0,
            *s_a, *s_b, n_a,
            HKV_A=hkv_a, HKV_B=hkv_b, D_A=d_a, D_B=d_b, PS=PS,
            NUM_POOLS=len(pair), WRITE_STATE=idx == 0, HAS_VALID=valid is not None,
            WRITE_SAMPLED=into is not None, BLOCK_T=min(64, triton.next_power_of_2(T)),
            BLOCK_RA=block_ra, BLOCK_RB=block_rb, BLOCK_DA=block_da, BLOCK_DB=block_db,
            num_warps=4 if tile >= 1024 else 2 if tile >= 256 else 1,  # ~8 elements per thread
        )  # fmt: skip
    return new_seq_lens, pending
