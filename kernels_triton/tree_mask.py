"""Ancestor bitmasks of draft trees, in one launch (the attention mask of tree verification).

Input parents [B, T] (int32/int64; root -1; topological: parents[b, i] < i), max_depth (static
bound on node depth). Output mask [B, T] int64:

    mask[b, i] = bit(i) | bit(p1) | bit(p2) | ...   over the ancestors p1 = parents[b, i],
                                                    p2 = parents[b, p1], ... (T <= 64 nodes)

Bit 63 is the sign bit (node 63 of a 64-node tree); the attention kernel reads masks as bit sets.
Composed of torch ops this is ~8 kernels per tree level; here one program per row walks every
node's ancestor chain max_depth steps with gathers inside its own row.

Invariants: T <= 64; parents of padding rows may hold anything in [-1, T) (their masks are unused
but must not fault: indices are clamped into the row).
"""

import torch
import triton
import triton.language as tl

MAX_NODES = 64


def _bit(i: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_left_shift(torch.ones_like(i, dtype=torch.int64), i.to(torch.int64))


def ancestor_masks_ref(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Plain torch: one gather per tree level."""
    B, T = parents.shape
    idx = torch.arange(T, device=parents.device).expand(B, T)
    mask = _bit(idx)
    anc = parents.long()
    for _ in range(max_depth):  # depth <= max_depth, never T
        valid = anc >= 0
        mask = mask | torch.where(valid, _bit(anc.clamp(min=0)), torch.zeros_like(mask))
        anc = torch.where(valid, parents.long().gather(1, anc.clamp(min=0)), anc)
    return mask


@triton.jit
def ancestor_masks_kernel(par_ptr, out_ptr, T, stride_p, max_depth, BLOCK_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_T)
    m = i < T
    par = tl.load(par_ptr + b * stride_p + i, mask=m, other=-1).to(tl.int64)
    one = tl.full([BLOCK_T], 1, tl.int64)
    mask = one << i.to(tl.int64)
    anc = tl.minimum(par, T - 1)
    for _ in range(max_depth):
        v = m & (anc >= 0)
        a = tl.maximum(anc, 0)
        mask = mask | tl.where(v, one << a, 0)
        nxt = tl.load(par_ptr + b * stride_p + a, mask=v, other=-1).to(tl.int64)
        anc = tl.where(v, tl.minimum(nxt, T - 1), -1)
    tl.store(out_ptr + b * T + i, mask, mask=m)


def ancestor_masks(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, T] parents -> [B, T] int64 ancestor-or-self bitmasks in one launch (see the docstring)."""
    if parents.dim() != 2 or parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ancestor_masks: parents must be [B, T] int32/int64, got {tuple(parents.shape)} {parents.dtype}")
    B, T = parents.shape
    if not 1 <= T <= MAX_NODES:
        raise ValueError(f"ancestor_masks: 1 <= T <= {MAX_NODES} nodes per tree, got {T}")
    if parents.stride(1) != 1:
        parents = parents.contiguous()
    out = torch.empty(B, T, dtype=torch.int64, device=parents.device)
    if B:
        ancestor_masks_kernel[(B,)](parents, out, T, parents.stride(0), int(max_depth),
                                    BLOCK_T=max(16, triton.next_power_of_2(T)))
    return out
