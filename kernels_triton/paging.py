"""Paged-KV addressing of a block of n new tokens per row, in one launch (every step needs it for
the verify, each draft round and the draft extend; composed of torch ops it is ~12 kernels).

Inputs, for rows b < B: start[b] (logical slot of the block's first token, int32/int64; plus a host
int ``offset``, default 0), valid[b] (bool: padding rows get nothing), page_table [B, MP] int32
(logical page -> physical page), n, PS.

    pos[b, j]     = start[b] + j                                   # logical slot = RoPE position
    slot[b * n + j] = page_table[b, min(pos // PS, MP - 1)] * PS + pos % PS   if valid[b] else -1
    cu[0] = 0,  cu[b + 1] = n * (valid rows among 0 .. b)          # int32 query offsets
    kv_lens[b]    = start[b] + n if valid[b] else 0                # int32

The clamp keeps stale rows (which may point past their page list) in bounds; their slot is -1
anyway. Returns (slot [B * n] int64, pos [B, n] int64, cu [B + 1] int32, kv_lens [B] int32).

``tree_meta`` is the same addressing for a verify step's tree of n nodes per row (node j still
sits at slot start + j) plus the target's inputs, so a step builds them in the same launch:

    pos[b, j] = start[b] + depth[b, j]  if valid[b] else 0         # RoPE position: prefix + depth
    ids[b * n + j] = tokens[b, j]       if valid[b] else 0         # input ids (padding rows: 0)

Kernel layout: grid (B,), one program per row; it sums valid[0 .. b] itself (B <= 4096 rows, one
block), so no separate scan launch. n and B are runtime arguments: one compile serves every
bucket and block size.
"""

import torch
import triton
import triton.language as tl

MAX_ROWS = 4096


def block_meta_ref(start, valid, page_table, n: int, page_size: int, offset: int = 0):
    B, MP = page_table.shape
    start = start + offset
    pos = start[:, None].long() + torch.arange(n, device=start.device)[None, :]  # [B, n]
    col = torch.clamp(pos // page_size, max=MP - 1)
    page = page_table.gather(1, col).long()
    slot = torch.where(valid[:, None], page * page_size + pos % page_size, -1).reshape(-1)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=start.device)
    cu[1:] = (valid.to(torch.int32) * n).cumsum(0)
    kv_lens = torch.where(valid, start + n, 0).to(torch.int32)
    return slot, pos, cu, kv_lens


@triton.jit(do_not_specialize=["n", "offset"])
def block_meta_kernel(
    start_ptr,  # [B]
    valid_ptr,  # [B] bool
    pt_ptr,  # [B, MP] int32
    depth_ptr,  # [B, n] int32 (TREE)
    tok_ptr,  # [B, n] int64 (TREE)
    slot_ptr,  # [B * n] int64
    pos_ptr,  # [B, n] int64
    ids_ptr,  # [B * n] int64 (TREE)
    cu_ptr,  # [B + 1] int32
    kvl_ptr,  # [B] int32
    n,
    offset,
    MP,
    stride_pt,
    PS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    TREE: tl.constexpr,
):
    b = tl.program_id(0)
    s0 = tl.load(start_ptr + b).to(tl.int64) + offset
    v = tl.load(valid_ptr + b).to(tl.int32) != 0
    ob = tl.arange(0, BLOCK_B)
    before = tl.load(valid_ptr + ob, mask=ob <= b, other=0).to(tl.int32)
    tl.store(cu_ptr + b + 1, (tl.sum(before, axis=0) * n).to(tl.int32))
    if b == 0:
        tl.store(cu_ptr, 0)
    tl.store(kvl_ptr + b, tl.where(v, s0 + n, 0).to(tl.int32))
    for j0 in range(0, n, BLOCK_N):
        oj = j0 + tl.arange(0, BLOCK_N)
        mj = oj < n
        p = s0 + oj
        col = tl.minimum(p // PS, MP - 1)
        page = tl.load(pt_ptr + b * stride_pt + col, mask=mj, other=0).to(tl.int64)
        slot = tl.where(v, page * PS + p % PS, -1)
        tl.store(slot_ptr + b * n + oj, slot, mask=mj)
        if TREE:
            dep = tl.load(depth_ptr + b * n + oj, mask=mj, other=0).to(tl.int64)
            tok = tl.load(tok_ptr + b * n + oj, mask=mj, other=0).to(tl.int64)
            tl.store(pos_ptr + b * n + oj, tl.where(v, s0 + dep, 0), mask=mj)
            tl.store(ids_ptr + b * n + oj, tl.where(v, tok, 0), mask=mj)
        else:
            tl.store(pos_ptr + b * n + oj, p, mask=mj)


def _check(name, start, valid, page_table, n):
    B, MP = page_table.shape
    if start.shape != (B,) or valid.shape != (B,) or valid.dtype != torch.bool:
        raise ValueError(f"{name}: start and valid (bool) must be [B] = [{B}], got "
                         f"{tuple(start.shape)} and {tuple(valid.shape)} {valid.dtype}")
    if page_table.dtype != torch.int32 or page_table.stride(1) != 1:
        raise ValueError(f"{name}: page_table must be [B, MP] int32 with contiguous rows")
    if B > MAX_ROWS or n < 1:
        raise ValueError(f"{name}: B must be <= {MAX_ROWS} and n >= 1, got B={B}, n={n}")


def _launch(start, valid, page_table, n, page_size, depth=None, tokens=None, offset=0):
    B, MP = page_table.shape
    dev = start.device
    tree = depth is not None
    slot = torch.empty(B * n, dtype=torch.int64, device=dev)
    pos = torch.empty(B, n, dtype=torch.int64, device=dev)
    ids = torch.empty(B * n, dtype=torch.int64, device=dev) if tree else slot
    cu = torch.empty(B + 1, dtype=torch.int32, device=dev)
    kv_lens = torch.empty(B, dtype=torch.int32, device=dev)
    if B == 0:
        cu.zero_()
    else:
        block_meta_kernel[(B,)](
            start, valid, page_table, depth if tree else start, tokens if tree else start,
            slot, pos, ids, cu, kv_lens, n, int(offset), MP, page_table.stride(0),
            PS=page_size, BLOCK_N=min(64, triton.next_power_of_2(n)), BLOCK_B=max(16, triton.next_power_of_2(B)),
            TREE=tree,
        )  # fmt: skip
    return slot, pos, ids, cu, kv_lens


def block_meta(start, valid, page_table, n: int, page_size: int, offset: int = 0):
    """One launch of the addressing above; see the module docstring."""
    _check("block_meta", start, valid, page_table, n)
    slot, pos, _, cu, kv_lens = _launch(start, valid, page_table, n, page_size, offset=offset)
    return slot, pos, cu, kv_lens


def tree_meta_ref(start, valid, page_table, tokens, depth, page_size: int):
    B, n = tokens.shape
    slot, _, cu, kv_lens = block_meta_ref(start, valid, page_table, n, page_size)
    pos = torch.where(valid[:, None], start[:, None].long() + depth.long(), 0)  # [B, n]
    ids = torch.where(valid[:, None], tokens.long(), 0).reshape(-1)  # [B * n]
    return slot, pos, ids, cu, kv_lens


def tree_meta(start, valid, page_table, tokens, depth, page_size: int):
    """Addressing + target inputs of a tree verify in one launch: (slot [B*n] int64, pos [B, n] int64,
    ids [B*n] int64, cu [B+1] int32, kv_lens [B] int32); see the module docstring."""
    B = page_table.shape[0]
    n = tokens.shape[-1] if tokens.dim() == 2 else 0
    _check("tree_meta", start, valid, page_table, n)
    if tokens.shape != (B, n) or depth.shape != (B, n) or tokens.stride(1) != 1 or depth.stride(1) != 1 \
            or tokens.stride(0) != n or depth.stride(0) != n:
        raise ValueError(f"tree_meta: tokens and depth must be contiguous [B, n] = [{B}, {n}], got "
                         f"{tuple(tokens.shape)} and {tuple(depth.shape)}")
    return _launch(start, valid, page_table, n, page_size, depth, tokens)
