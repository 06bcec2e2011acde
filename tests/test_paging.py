"""Paging and tree-mask helpers of the step (one launch each on the GPU) against their torch
references: block_meta (slots, positions, query offsets, KV lengths of a block of new tokens per
row) and ancestor_masks (tree attention bitmasks). Random shapes, pages out of order, padding rows
anywhere, stale rows pointing past their pages, outputs poisoned so unwritten elements fail."""

import pytest
import torch

from kernels_triton.paging import block_meta, block_meta_ref, tree_meta, tree_meta_ref
from kernels_triton.tree_mask import ancestor_masks, ancestor_masks_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("B,n,PS,MP", [(1, 1, 16, 4), (3, 17, 4, 9), (8, 6, 16, 3),
                                       pytest.param(37, 70, 8, 12, marks=pytest.mark.gpu)])  # (gpu: one case)
def test_block_meta_matches_reference(poison, B, n, PS, MP):
    g = torch.Generator().manual_seed(B * 100 + n)
    table = torch.stack([torch.randperm(500, generator=g)[:MP] for _ in range(B)]).int().to(DEVICE)
    start = torch.randint(0, MP * PS + 5, (B,), generator=g).int().to(DEVICE)  # some past their pages
    valid = (torch.rand(B, generator=g) < 0.7).to(DEVICE)
    got, want = block_meta(start, valid, table, n, PS), block_meta_ref(start, valid, table, n, PS)
    for name, x, y in zip(("slot", "pos", "cu", "kv_lens"), got, want):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    start64 = start.long()
    for x, y in zip(block_meta(start64, valid, table, n, PS), block_meta_ref(start64, valid, table, n, PS)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("B,n,PS,MP", [(1, 1, 16, 4), (3, 17, 4, 9), pytest.param(37, 70, 8, 12, marks=pytest.mark.gpu)])
def test_tree_meta_matches_reference_and_block_meta(poison, B, n, PS, MP):
    """Tree addressing: slots / cu / kv_lens exactly block_meta's, positions start + depth, input ids
    the tokens (both 0 on padding rows)."""
    g = torch.Generator().manual_seed(B * 7 + n)
    table = torch.stack([torch.randperm(500, generator=g)[:MP] for _ in range(B)]).int().to(DEVICE)
    start = torch.randint(0, MP * PS + 5, (B,), generator=g).int().to(DEVICE)
    valid = (torch.rand(B, generator=g) < 0.7).to(DEVICE)
    valid[0] = True
    tokens = torch.randint(1, 49152, (B, n), generator=g).to(DEVICE)
    depth = torch.randint(0, 8, (B, n), generator=g).int().to(DEVICE)
    got, want = tree_meta(start, valid, table, tokens, depth, PS), tree_meta_ref(start, valid, table, tokens, depth, PS)
    for name, x, y in zip(("slot", "pos", "ids", "cu", "kv_lens"), got, want):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    slot, pos, ids, cu, kv_lens = got
    bm = block_meta_ref(start, valid, table, n, PS)
    assert torch.equal(slot, bm[0]) and torch.equal(cu, bm[2]) and torch.equal(kv_lens, bm[3])
    v = valid[:, None]
    assert torch.equal(pos, torch.where(v, start[:, None].long() + depth, 0))
    assert torch.equal(ids.view(B, n), torch.where(v, tokens, 0))
    with pytest.raises(ValueError, match="tree_meta"):
        tree_meta(start, valid, table, tokens[:, ::2], depth[:, ::2], PS)


def test_block_meta_rejects_bad_arguments():
    t = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    s = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="bool"):
        block_meta(s, s, t, 4, 16)
    with pytest.raises(ValueError, match="int32"):
        block_meta(s, s > 0, t.long(), 4, 16)


def random_parents(B, T, g):
    par = torch.full((B, T), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(1, T):
            par[b, i] = int(torch.randint(0, i, (1,), generator=g))
    return par


def depth_of(par):
    d = torch.zeros_like(par)
    for b in range(par.shape[0]):
        for i in range(1, par.shape[1]):
            d[b, i] = d[b, par[b, i]] + 1
    return int(d.max())


@pytest.mark.parametrize("B,T", [(1, 1), (4, 9), (3, 17), pytest.param(2, 64, marks=pytest.mark.gpu)])
def test_ancestor_masks_match_reference(poison, B, T):
    g = torch.Generator().manual_seed(T)
    par = random_parents(B, T, g)
    D = depth_of(par)
    got = ancestor_masks(par.to(DEVICE), D)
    assert torch.equal(got, ancestor_masks_ref(par.to(DEVICE), D))
    if T == 64:  # a chain through node 63 sets the sign bit
        chain = (torch.arange(64, dtype=torch.int32) - 1)[None]
        m = ancestor_masks(chain.to(DEVICE), 63)
        assert int(m[0, 63]) == -1 and torch.equal(m, ancestor_masks_ref(chain.to(DEVICE), 63))


def test_ancestor_masks_survive_garbage_parents(poison):
    """Padding rows of a graphed step hold arbitrary parents: no fault, real rows unaffected."""
    g = torch.Generator().manual_seed(0)
    par = random_parents(3, 8, g)
    par[1] = torch.tensor([5, 7, 7, 100, -9, 3, 2, 1], dtype=torch.int32)  # not a tree
    got = ancestor_masks(par.to(DEVICE), 4)
    want = ancestor_masks_ref(par[[0, 2]].to(DEVICE), 4)
    assert torch.equal(got[[0, 2]], want)
