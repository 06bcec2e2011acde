"""paged_attention / write_kv_ against their plain-torch references.

Runs under TRITON_INTERPRET=1 on CPU (conftest) and natively on the GPU. Shapes are small but odd:
ragged kv_lens, shuffled physical pages, a T_b = 0 padding request, 9 query / 3 KV heads at d=64 and
8 / 2 at d=32. Every cache slot that is not a valid KV slot (tails of last pages, pages not owned by
any request, garbage page-table entries) holds NaN, so a read past kv_len shows up in the output.
"""

import math

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
BF16 = [torch.bfloat16] if DEVICE == "cuda" else []


def with_dtypes(cases, gpu_cases=()):
    """Parameters: every case (a tuple) in fp32 and fp16, and the ``gpu_cases`` also in bf16 on a GPU (the
    ``-m gpu`` selection compiles every case's kernel variants, so it keeps a representative few)."""
    return [(*c, dt) for c in cases for dt in DTYPES] + [(*c, dt) for c in gpu_cases for dt in BF16]
# fp32 runs an ieee tl.dot; fp16 / bf16 round P to the input dtype before the PV product.
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
HEADS = [(9, 3, 64), (8, 2, 32)]  # (HQ, HKV, D): SmolLM2's 9/3 at d64, and G = 4


def _seeded(seed):
    return torch.Generator().manual_seed(seed)


def make_batch(T, prefix, heads, PS, dtype, seed=0):
    """A paged batch: request b has prefix[b] cached slots plus T[b] new ones (kv_len = sum).

    Physical pages are a random permutation of the pool; unused page-table entries point at spare
    pages; every slot outside [0, kv_len) of some request is NaN.
    """
    g = _seeded(seed)
    HQ, HKV, D = heads
    B = len(T)
    kv = [t + p for t, p in zip(T, prefix)]
    n_pages = [math.ceil(L / PS) for L in kv]
    MP = max(n_pages) + 2
    n_spare = 3
    P = sum(n_pages) + n_spare
    perm = torch.randperm(P, generator=g)
    k_cache = torch.full((P, PS, HKV, D), float("nan"))
    v_cache = torch.full((P, PS, HKV, D), float("nan"))
    spare = perm[sum(n_pages) :]
    page_table = spare[torch.randint(0, n_spare, (B, MP), generator=g)].clone()  # garbage -> NaN pages
    used = 0
    for b in range(B):
        pages = perm[used : used + n_pages[b]]
        used += n_pages[b]
        page_table[b, : n_pages[b]] = pages
        for s in range(kv[b]):
            page, off = pages[s // PS], s % PS
            k_cache[page, off] = torch.randn(HKV, D, generator=g)
            v_cache[page, off] = torch.randn(HKV, D, generator=g)
    N = sum(T)
    q = torch.randn(N, HQ, D, generator=g)
    cu = torch.tensor([0] + list(torch.tensor(T).cumsum(0).tolist()), dtype=torch.int32)
    to = dict(device=DEVICE)
    return dict(
        q=q.to(dtype=dtype, **to),
        k_cache=k_cache.to(dtype=dtype, **to),
        v_cache=v_cache.to(dtype=dtype, **to),
        page_table=page_table.to(torch.int32).to(**to),
        cu_q_lens=cu.to(**to),
        kv_lens=torch.tensor(kv, dtype=torch.int32, device=DEVICE),
    )


def tree_masks(T, g):
    """Random tree of T nodes (node 0 the root, parent[i] < i): ancestor-closure bitmask per node."""
    masks = []
    for i in range(T):
        parent = int(torch.randint(0, i, (1,), generator=g)) if i > 0 else -1
        masks.append((1 << i) | (masks[parent] if parent >= 0 else 0))
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]  # as signed int64


def batch_tree_mask(T, seed, chain=False):
    g = _seeded(seed + 1000)
    rows = []
    for t in T:
        rows += [(1 << (i + 1)) - 1 for i in range(t)] if chain else tree_masks(t, g)
    rows = [m - (1 << 64) if m >= 1 << 63 else m for m in rows]
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


def call_poisoned(fn, shape, dtype):
    """Run fn() right after freeing a NaN tensor of the output's size, so the (caching) allocator
    most likely hands the launcher NaN memory: an element the kernel forgets to write stays NaN."""
    poison = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    del poison
    return fn()


def check(batch, dtype, max_q_len, splits, tree_mask=None, sm_scale=None):
    from kernels_triton.attention import paged_attention, paged_attention_ref

    ref = paged_attention_ref(**batch, tree_mask=tree_mask, sm_scale=sm_scale)
    atol, rtol = TOL[dtype]
    for ns in splits:
        # split-KV partials merged by the last split of each group (default) or by a second kernel;
        # every tile in one loop, or the unmasked tiles and then the masked ones; softmax sums per
        # element (l2d) or per row, each with both loop structures
        if ns == 1:
            combos = [(True, True, False), (True, False, True)]
        else:
            combos = [(True, True, True), (True, False, False), (False, True, False)]
        for fused, one_loop, l2d in combos:
            kwargs = dict(tree_mask=tree_mask, sm_scale=sm_scale, max_q_len=max_q_len, num_splits=ns,
                          fused_merge=fused, one_loop=one_loop, l2d=l2d)
            out = call_poisoned(lambda: paged_attention(**batch, **kwargs), batch["q"].shape, dtype)
            assert out.shape == ref.shape and out.dtype == dtype
            msg = lambda m: f"num_splits={ns}, fused_merge={fused}, one_loop={one_loop}, l2d={l2d}: {m}"  # noqa: E731
            torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol, msg=msg)
    return ref


@pytest.mark.parametrize("heads,PS,dtype", with_dtypes([(h, PS) for h in HEADS for PS in (16, 8)], [(HEADS[1], 16)]))
def test_paged_attention_prefill(dtype, heads, PS):
    # ragged chunks: with a prefix, from scratch, a T_b = 0 padding entry; 50 queries span several
    # query blocks (42 / 32 / 21 / 8 queries each, by dtype and G), and max_q_len is a bucket bound
    # above the longest chunk.
    # prefix 62: the first query sees exactly slots 0..62, one short of a 64-slot tile boundary.
    batch = make_batch(T=[7, 0, 50, 13], prefix=[9, 5, 0, 62], heads=heads, PS=PS, dtype=dtype, seed=1)
    check(batch, dtype, max_q_len=56, splits=[1, 3, None])


@pytest.mark.parametrize("heads,PS,dtype", with_dtypes([(h, PS) for h in HEADS for PS in (16, 8)], [(HEADS[0], 8)]))
def test_paged_attention_decode(dtype, heads, PS):
    # kv_len 1, 127 and 128: a tile boundary (64 slots) one past and exactly at the last slot
    batch = make_batch(T=[1, 1, 0, 1, 1, 1], prefix=[0, 40, 3, 126, 127, 17], heads=heads, PS=PS, dtype=dtype, seed=2)
    check(batch, dtype, max_q_len=1, splits=[1, 4, None])


@pytest.mark.parametrize("heads,PS,dtype", with_dtypes([(h, PS) for h in HEADS for PS in (16, 8)], [(HEADS[0], 16)]))
def test_paged_attention_tree(dtype, heads, PS):
    T = [1, 9, 0, 16]
    batch = make_batch(T=T, prefix=[30, 0, 8, 45], heads=heads, PS=PS, dtype=dtype, seed=3)
    check(batch, dtype, max_q_len=16, splits=[1, 4, None], tree_mask=batch_tree_mask(T, seed=3))
    # short trees (17-32 query rows at G = 3 / 4): the wgmma tile with 16-bit inputs at d <= 64
    T = [1, 7, 0, 8]
    batch = make_batch(T=T, prefix=[30, 0, 8, 45], heads=heads, PS=PS, dtype=dtype, seed=5)
    check(batch, dtype, max_q_len=8, splits=[1, 3], tree_mask=batch_tree_mask(T, seed=5))


def test_tree_chain_equals_causal():
    """A chain mask (1 << (i + 1)) - 1 is causal attention, including bit 63 of a 64-node chain."""
    from kernels_triton.attention import paged_attention

    T = [64, 5]
    batch = make_batch(T=T, prefix=[21, 3], heads=(9, 3, 64), PS=16, dtype=torch.float32, seed=4)
    tm = batch_tree_mask(T, seed=4, chain=True)
    causal = check(batch, torch.float32, max_q_len=64, splits=[1])
    tree = paged_attention(**batch, tree_mask=tm, max_q_len=64, num_splits=2)
    torch.testing.assert_close(tree, causal, atol=2e-5, rtol=1e-4)


def test_tree_64_nodes():
    T = [64, 2]
    batch = make_batch(T=T, prefix=[7, 70], heads=(8, 2, 32), PS=8, dtype=torch.float16, seed=5)
    tm = batch_tree_mask(T, seed=5)
    assert int(tm[63]) < 0  # node 63's own bit is the sign bit
    check(batch, torch.float16, max_q_len=64, splits=[1, 3], tree_mask=tm)


@pytest.mark.parametrize("dtype", DTYPES + BF16)
def test_tree_window_sees_only_marked_earlier_slots(dtype):
    """tree_window W: the queries are the last T_b of W masked slots (a draft round's new nodes after
    earlier rounds' nodes, already cached); mask bit j is slot kv_len - W + j. Kernel (several split
    counts) and reference against a dense softmax over exactly the prefix + the marked slots."""
    from kernels_triton.attention import paged_attention, paged_attention_ref

    W, Tq, prefix = 12, [4, 1, 0, 12], [10, 70, 3, 0]
    batch = make_batch(T=[W] * 4, prefix=prefix, heads=(9, 3, 64), PS=8, dtype=dtype, seed=7)
    g = _seeded(17)
    rows, masks = [], []
    for b, t in enumerate(Tq):
        for i in range(t):
            w = W - t + i  # window index of this query's own slot
            bits = int(torch.randint(0, 1 << w, (1,), generator=g)) if w else 0  # any earlier subset
            rows.append(b * W + w)
            masks.append((1 << w) | bits)
    q = batch["q"][rows]
    cu = torch.tensor([0] + torch.tensor(Tq).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    b2 = dict(batch, q=q, cu_q_lens=cu)
    tm = torch.tensor(masks, dtype=torch.int64, device=DEVICE)
    # dense: query n of request b sees prefix slots and the window slots whose bit is set
    kc, vc, pt = batch["k_cache"].float(), batch["v_cache"].float(), batch["page_table"]
    want = torch.empty(len(rows), 9, 64)
    n = 0
    for b, t in enumerate(Tq):
        for i in range(t):
            vis = list(range(prefix[b])) + [prefix[b] + j for j in range(W) if masks[n] >> j & 1]
            k = torch.stack([kc[pt[b, s // 8], s % 8] for s in vis]).cpu()  # [L, 3, 64]
            v = torch.stack([vc[pt[b, s // 8], s % 8] for s in vis]).cpu()
            qq = q[n].float().cpu().view(3, 3, 64)  # [kv head, group, D]
            att = torch.softmax(torch.einsum("kgd,lkd->kgl", qq, k) / 8.0, -1)
            want[n] = torch.einsum("kgl,lkd->kgd", att, v).reshape(9, 64)
            n += 1
    atol, rtol = TOL[dtype]
    ref = paged_attention_ref(**b2, tree_mask=tm, tree_window=W)
    torch.testing.assert_close(ref.float().cpu(), want, atol=atol, rtol=rtol)
    for ns in (1, 3, None):
        out = call_poisoned(lambda: paged_attention(**b2, tree_mask=tm, max_q_len=12, num_splits=ns, tree_window=W),
                            q.shape, dtype)
        torch.testing.assert_close(out.float().cpu(), want, atol=atol, rtol=rtol, msg=lambda m: f"splits {ns}: {m}")
    with pytest.raises(ValueError, match="tree_window"):
        paged_attention(**b2, tree_mask=tm, max_q_len=12, tree_window=8)  # narrower than max_q_len


def test_sm_scale_and_default_splits_large_prefix():
    # a long prefix with one short chunk: the default picks split-KV from static shapes
    batch = make_batch(T=[3], prefix=[300], heads=(9, 3, 64), PS=32, dtype=torch.float32, seed=6)
    check(batch, torch.float32, max_q_len=3, splits=[None, 8], sm_scale=0.3)


@pytest.mark.parametrize("T,prefix,tree", [([1, 1, 0], [37, 130, 5], False), ([3, 5], [70, 21], True)])
def test_v_cache_with_its_own_strides(T, prefix, tree):
    # The KV pools of a layer share strides, and the kernel then computes each slot's address once
    # for K and V. A V cache laid out differently ([P, HKV, PS, D] storage seen as [P, PS, HKV, D])
    # must take its own strides: reading V at K's offsets would mix heads and slots.
    batch = make_batch(T=T, prefix=prefix, heads=(9, 3, 64), PS=16, dtype=torch.float32, seed=12)
    v = batch["v_cache"]
    batch["v_cache"] = v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # same values, other strides
    assert batch["v_cache"].stride() != batch["k_cache"].stride()
    check(batch, torch.float32, max_q_len=max(T), splits=[1, 3],
          tree_mask=batch_tree_mask(T, seed=12) if tree else None)


def test_short_requests_in_a_wide_page_table_leave_splits_empty(monkeypatch):
    # The engine's page table is as wide as the longest allowed sequence, so the default split count
    # is sized for that capacity; short requests then leave most splits without a tile (kv_len 1..70
    # over 64 splits: at most 2 busy). Empty splits skip their loads; the merge must still be exact.
    # The table's spare columns point at NaN pages, so reading past kv_len would show, and every
    # workspace starts NaN, so a split partial the kernel forgets to write would too.
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    T = [1, 0, 1, 3]
    batch = make_batch(T=T, prefix=[69, 4, 0, 40], heads=(9, 3, 64), PS=16, dtype=torch.float32, seed=9)
    spare = batch["page_table"][:, -1:]  # a garbage (NaN) page from make_batch
    batch["page_table"] = torch.cat([batch["page_table"], spare.expand(-1, 60)], dim=1).contiguous()
    check(batch, torch.float32, max_q_len=3, splits=[64, None])
    check(batch, torch.float32, max_q_len=3, splits=[17], tree_mask=batch_tree_mask(T, seed=9))


def test_fused_merge_leaves_arrival_counters_zeroed():
    # The last split of each group resets its counter, so the workspace is all zeros after every
    # launch and a second launch (a graph replay) merges exactly like the first. Query blocks of a
    # prefill chunk (50 queries -> several blocks per request) each own a counter.
    import kernels_triton.attention as attn

    batch = make_batch(T=[7, 0, 50, 1], prefix=[9, 5, 70, 126], heads=(9, 3, 64), PS=16, dtype=torch.float32,
                       seed=11)
    ref = attn.paged_attention_ref(**batch)
    for _ in range(2):
        out = call_poisoned(lambda: attn.paged_attention(**batch, max_q_len=50, num_splits=5, fused_merge=True),
                            batch["q"].shape, torch.float32)
        torch.testing.assert_close(out, ref, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])
        counters = attn._COUNTERS[(batch["q"].device, "paged_attention")]
        assert int(counters.count_nonzero()) == 0


def test_min_busy_tiles_one_busy_split_writes_the_output():
    # min_busy_tiles: a busy split takes at least that many of its request's KV tiles, so a short
    # request in a wide page table runs one busy split; under the fused merge that split writes the
    # output itself (no partial, no arrival: the counters stay zero), a longer one still merges.
    # NaN-poisoned output and workspaces: a row nobody writes fails. Tiles of 32 (fp32, d64).
    import kernels_triton.attention as attn

    T = [16, 1, 16]
    batch = make_batch(T=T, prefix=[40, 5, 300], heads=(8, 2, 64), PS=16, dtype=torch.float32, seed=14)
    spare = batch["page_table"][:, -1:]
    batch["page_table"] = torch.cat([batch["page_table"], spare.expand(-1, 40)], dim=1).contiguous()
    tm = batch_tree_mask(T, seed=14)
    ref = attn.paged_attention_ref(**batch, tree_mask=tm)
    for busy in (1, 4, 64):
        for fused in (True, False):
            out = call_poisoned(lambda: attn.paged_attention(**batch, tree_mask=tm, max_q_len=16, num_splits=8,
                                                             fused_merge=fused, min_busy_tiles=busy),
                                batch["q"].shape, torch.float32)
            torch.testing.assert_close(out, ref, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1],
                                       msg=lambda m: f"min_busy_tiles={busy}, fused_merge={fused}: {m}")
    counters = attn._COUNTERS[(batch["q"].device, "paged_attention")]
    assert int(counters.count_nonzero()) == 0
    with pytest.raises(ValueError, match="min_busy_tiles"):
        attn.paged_attention(**batch, tree_mask=tm, max_q_len=16, num_splits=8, min_busy_tiles=0)


def test_launch_tuning_options_keep_results():
    # merge_chunk (partials folded per fused-merge step) and maxnreg (a register cap, ignored by the
    # interpreter) change how the kernel runs, not what it computes; bad merge_chunk values fail.
    import kernels_triton.attention as attn

    batch = make_batch(T=[16, 3, 16], prefix=[70, 5, 140], heads=(9, 3, 64), PS=16, dtype=torch.float32, seed=12)
    tm = batch_tree_mask([16, 3, 16], seed=12)
    ref = attn.paged_attention_ref(**batch, tree_mask=tm)
    for chunk in (1, 2, 8):
        out = call_poisoned(lambda: attn.paged_attention(**batch, tree_mask=tm, max_q_len=16, num_splits=3,
                                                         fused_merge=True, merge_chunk=chunk, maxnreg=168),
                            batch["q"].shape, torch.float32)
        torch.testing.assert_close(out, ref, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])
    for bad in (0, 3, 2.0):
        with pytest.raises(ValueError, match="merge_chunk"):
            attn.paged_attention(**batch, tree_mask=tm, max_q_len=16, num_splits=3, merge_chunk=bad)


def test_tree_occupancy_plan(monkeypatch):
    # Tree tiles (BLOCK_M = 64) split past one program per SM when each split keeps enough tiles
    # (occupancy_splits), launched with the fused merge, merge_chunk 1 and a register cap; at run
    # time a short request runs fewer busy splits (min_busy_tiles). The plan's launch must give the
    # reference result with ragged lengths (one request below two splits' worth of tiles), pages
    # out of order and NaN-poisoned workspaces. Scaled down: 6 SMs, 4 tiles per split.
    import kernels_triton.attention as attn
    import kernels_triton.attention_launch as launch

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    monkeypatch.setattr(launch, "sm_count", lambda device: 6)
    monkeypatch.setattr(launch, "TREE_MIN_SPLIT_TILES", 4)
    T = [16, 5, 16]
    batch = make_batch(T=T, prefix=[300, 40, 500], heads=(9, 3, 64), PS=16, dtype=torch.float16, seed=13)
    tm = batch_tree_mask(T, seed=13)
    cfg = launch.launch_config(16, 3, 64, torch.float16)
    cap = batch["page_table"].shape[1] * 16
    dev = batch["q"].device
    assert launch.default_num_splits(3, 3, 64, 1, cap, cfg, dev) == 1
    assert launch.occupancy_splits(3, 3, 64, 1, cap, cfg, dev, torch.float16) == 2
    assert launch.occupancy_splits(3, 3, 64, 1, cap, cfg, dev, torch.float32) == 1  # fp32: other tiles
    ref = attn.paged_attention_ref(**batch, tree_mask=tm)
    for _ in range(2):  # the fused merge's counters are left zeroed for the next launch
        out = call_poisoned(lambda: attn.paged_attention(**batch, tree_mask=tm, max_q_len=16),
                            batch["q"].shape, torch.float16)
        torch.testing.assert_close(out, ref, atol=TOL[torch.float16][0], rtol=TOL[torch.float16][1])


def test_tree_occupancy_rule_h200_shapes(monkeypatch):
    # The measured cases (experiments/kernels/exp_tree_splits.py): 132 SMs, T = 16, capacity
    # prefix + 16 slots. 3 programs per SM at d64, 2 at d128, >= 16 tiles of 64 per split.
    import kernels_triton.attention_launch as launch

    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    want = {(3, 64, 16, 4096): 4, (3, 64, 32, 16384): 4, (3, 64, 64, 4096): 2, (3, 64, 64, 1024): 1,
            (3, 64, 128, 16384): 1, (8, 128, 16, 4096): 2, (8, 128, 8, 16384): 4, (8, 128, 32, 4096): 1}
    for (HKV, D, B, prefix), n in want.items():
        cfg = launch.launch_config(16, 12 // HKV if D == 64 else 4, D, torch.bfloat16)
        assert cfg["BLOCK_M"] == 64
        assert launch.occupancy_splits(B, HKV, D, 1, prefix + 16, cfg, dev, torch.bfloat16) == n, (HKV, D, B, prefix)
    cfg = launch.launch_config(8, 4, 128, torch.bfloat16, kv_capacity=512)  # 32-row tiles: not planned
    assert cfg["BLOCK_M"] == 32 and launch.occupancy_splits(16, 8, 128, 1, 512, cfg, dev, torch.bfloat16) == 1
    cfg = launch.launch_config(8, 3, 64, torch.bfloat16)  # T = 8 at d64 takes the wgmma tile and its plan
    assert cfg["BLOCK_M"] == 64 and launch.occupancy_splits(16, 3, 64, 1, 16384, cfg, dev, torch.bfloat16) == 8


def test_launch_plan_pinned_h200_shapes(monkeypatch):
    # attention_launch.plan for representative launches on an H200 (132 SMs), pinned so that a change
    # to the launch policy is a deliberate one (each value follows from a rule in attention_launch.py).
    import kernels_triton.attention_launch as launch

    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    fields = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "num_splits", "fused_merge", "s_chunk", "one_loop",
              "l2d", "min_busy_tiles", "maxnreg")
    want = {
        # SmolLM2 decode (9q/3kv d64), B=1, 8192 slots: 16-row mma.sync tile, 32 splits, merged in-kernel
        (1, 1, 3, 3, 64, 8192, bf16): (16, 64, 4, 5, 32, True, 32, True, True, 1, None),
        # the tree headline (T=16, B=64, prefix 1024): wgmma tile, one program per SM, two loops
        (16, 64, 3, 3, 64, 1040, bf16): (64, 64, 4, 5, 1, False, 1, False, False, 1, None),
        # T=16, B=32, prefix 16384: the occupancy plan (4 splits, fused merge one partial per step, cap 168)
        (16, 32, 3, 3, 64, 16400, bf16): (64, 64, 4, 5, 4, True, 1, False, False, 16, 168),
        # Llama-3.1-8B decode (32q/8kv d128), B=1: N=32 at d128
        (1, 1, 8, 4, 128, 4096, bf16): (16, 32, 4, 5, 32, True, 16, True, True, 1, None),
        # 8B T=8 chain at capacity 512: mma.sync (below WGMMA_MIN_CAPACITY_D128), merge kernel (4096 values)
        (8, 8, 8, 4, 128, 512, bf16): (32, 32, 4, 5, 4, False, 2, True, True, 1, None),
        # a prefill chunk of 128 tokens: 128-row tile, 8 warps, 4 query blocks
        (128, 1, 3, 3, 64, 4096, bf16): (128, 64, 8, 3, 8, False, 1, True, False, 1, None),
        # fp32 (tests): the ieee-dot tile
        (16, 4, 3, 3, 64, 1040, torch.float32): (64, 32, 8, 2, 8, False, 2, True, False, 1, None),
    }
    for args, values in want.items():
        lp = launch.plan(*args, cpu)
        got = tuple(lp.cfg[f] if f in lp.cfg else getattr(lp, f) for f in fields)
        assert got == values, (args, dict(zip(fields, got)))
    # Explicit arguments win over the plan's defaults.
    lp = launch.plan(16, 32, 3, 3, 64, 16400, bf16, cpu, num_splits=2, one_loop=True)
    assert (lp.num_splits, lp.fused_merge, lp.maxnreg, lp.min_busy_tiles, lp.one_loop) == (2, False, None, 1, True)


def test_fused_merge_argument_selects_the_merge(monkeypatch):
    # fused_merge=False runs the separate merge kernel, True merges in the attention kernel (both give
    # the reference result); the occupancy plan's fused merge yields to an explicit False.
    import kernels_triton.attention as attn
    import kernels_triton.attention_launch as launch

    launches = []
    real_merge = attn._paged_attention_merge_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real_merge[grid]

    monkeypatch.setattr(attn, "_paged_attention_merge_kernel", Spy())
    batch = make_batch(T=[1, 1], prefix=[40, 90], heads=(9, 3, 64), PS=16, dtype=torch.float32, seed=21)
    ref = attn.paged_attention_ref(**batch)
    for fused in (False, True):
        launches.clear()
        out = attn.paged_attention(**batch, max_q_len=1, num_splits=4, fused_merge=fused)
        torch.testing.assert_close(out, ref, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])
        assert len(launches) == (0 if fused else 1), fused
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert launch.plan(16, 32, 3, 3, 64, 16400, torch.bfloat16, cpu).fused_merge
    assert not launch.plan(16, 32, 3, 3, 64, 16400, torch.bfloat16, cpu, fused_merge=False).fused_merge


def test_default_splits_keep_min_tiles_of_capacity(monkeypatch):
    import kernels_triton.attention_launch as launch

    monkeypatch.setattr(launch, "sm_count", lambda device: 132)  # H200
    for B in (1, 2, 8, 64):
        for capacity in (16, 100, 512, 8192, 131072):
            for max_q_len in (1, 16):
                cfg = launch.launch_config(max_q_len, 3, 64, torch.bfloat16)
                n_qblocks = -(-max_q_len // cfg["BLOCK_T"])
                ns = launch.default_num_splits(B, 3, 64, n_qblocks, capacity, cfg, torch.device("cpu"))
                assert 1 <= ns <= launch.MAX_SPLITS and ns & (ns - 1) == 0
                assert ns == 1 or capacity // ns >= launch.MIN_SPLIT_TILES * cfg["BLOCK_N"]
    # Decode at B = 1 with an 8192-slot table: the SM count allows 176 programs per KV head, the
    # capacity 8192 / (4 * 64) = 32 splits; at B = 64 the batch alone fills the GPU.
    cfg = launch.launch_config(1, 3, 64, torch.bfloat16)
    assert launch.default_num_splits(1, 3, 64, 1, 8192, cfg, torch.device("cpu")) == 32
    assert launch.default_num_splits(64, 3, 64, 1, 8192, cfg, torch.device("cpu")) == 2
    assert launch.default_num_splits(1, 3, 64, 1, 128, cfg, torch.device("cpu")) == 1


def test_reference_matches_dense_sdpa():
    """The reference itself: one request laid out contiguously equals SDPA with a bottom-right
    causal mask over [prefix + T] keys (GQA expanded)."""
    from kernels_triton.attention import paged_attention_ref

    torch.manual_seed(7)
    T, prefix, HQ, HKV, D, PS = 6, 11, 9, 3, 64, 4
    L = T + prefix
    k = torch.randn(L, HKV, D)
    v = torch.randn(L, HKV, D)
    q = torch.randn(T, HQ, D)
    P = math.ceil(L / PS)
    k_cache = torch.zeros(P * PS, HKV, D)
    v_cache = torch.zeros(P * PS, HKV, D)
    k_cache[:L], v_cache[:L] = k, v
    out = paged_attention_ref(
        q,
        k_cache.view(P, PS, HKV, D),
        v_cache.view(P, PS, HKV, D),
        torch.arange(P, dtype=torch.int32)[None],
        torch.tensor([0, T], dtype=torch.int32),
        torch.tensor([L], dtype=torch.int32),
    )
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=prefix)
    G = HQ // HKV
    k_e, v_e = k.repeat_interleave(G, 1).transpose(0, 1), v.repeat_interleave(G, 1).transpose(0, 1)  # [HQ, L, D]
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k_e, v_e, attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("HKV,D,PS,dtype", with_dtypes([(3, 64, 16), (3, 64, 8), (2, 24, 16), (2, 24, 8)],
                                                      [(2, 24, 8)]))
def test_write_kv(dtype, HKV, D, PS):
    from kernels_triton.attention import write_kv_, write_kv_ref_

    g = _seeded(8)
    P, N = 5, 11
    k_cache = torch.randn(P, PS, HKV, D, generator=g).to(dtype=dtype, device=DEVICE)
    v_cache = torch.randn(P, PS, HKV, D, generator=g).to(dtype=dtype, device=DEVICE)
    k = torch.randn(N, HKV, D, generator=g).to(dtype=dtype, device=DEVICE)
    v = torch.randn(N, HKV, D, generator=g).to(dtype=dtype, device=DEVICE)
    slots = torch.randperm(P * PS, generator=g)[:N]
    slots[[2, 7]] = -1  # padding tokens: their k/v must not land anywhere
    slots = slots.to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref_(k_ref, v_ref, k, v, slots)
    write_kv_(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    written = slots[slots >= 0]
    assert torch.equal(k_cache.view(-1, HKV, D)[written], k[slots >= 0])
    untouched = torch.ones(P * PS, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    k0 = torch.randn(P, PS, HKV, D, generator=_seeded(8)).to(dtype=dtype, device=DEVICE)
    assert torch.equal(k_cache.view(-1, HKV, D)[untouched], k0.view(-1, HKV, D)[untouched])


def test_argument_errors():
    from kernels_triton.attention import paged_attention, write_kv_

    batch = make_batch(T=[2], prefix=[3], heads=(9, 3, 64), PS=8, dtype=torch.float32, seed=9)
    with pytest.raises(ValueError, match="page_table"):
        paged_attention(**{**batch, "page_table": batch["page_table"].long()}, max_q_len=2)
    with pytest.raises(ValueError, match="multiple of HKV"):
        paged_attention(**{**batch, "q": batch["q"][:, :8]}, max_q_len=2)
    with pytest.raises(ValueError, match="max_q_len"):
        paged_attention(**batch, max_q_len=0)
    with pytest.raises(ValueError, match="at most 64"):
        tm = torch.ones(2, dtype=torch.int64, device=DEVICE)
        paged_attention(**batch, tree_mask=tm, max_q_len=65)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(**batch, max_q_len=2, num_splits=0)
    with pytest.raises(ValueError, match="slot_mapping"):
        k = torch.zeros(2, 3, 64, device=DEVICE)
        write_kv_(batch["k_cache"], batch["v_cache"], k, k, torch.zeros(2, dtype=torch.int32, device=DEVICE))


def test_pdl_on_off_and_cuda_only(kernel_options):
    # Programmatic dependent launch (griddepcontrol): the late trigger by default, none with the kernel
    # option pdl off, only on a CUDA device of compute capability >= 9; never under the CPU
    # interpreter, which has no such instruction.
    from kernels_triton.attention_launch import PDL_LATE, pdl_mode

    cc9 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    assert kernel_options.get().pdl is True
    for flag, want in ((True, PDL_LATE), (False, 0), ("on", PDL_LATE), ("off", 0)):
        kernel_options.set_(pdl=flag)
        assert pdl_mode(torch.device("cpu")) == 0
        if torch.cuda.is_available():
            assert pdl_mode(torch.device("cuda")) == (want if cc9 else 0)
    before = kernel_options.get()
    for bad in ("early", "yes", 0, None):
        with pytest.raises(ValueError, match=r"pdl=.*valid: true, false"):
            kernel_options.set_(pdl=bad)
    assert kernel_options.get() == before  # a refused value changes nothing


def test_default_l2d_rule():
    import kernels_triton.attention_launch as launch

    assert launch.default_l2d(launch.launch_config(1, 4, 128))  # decode: mma.sync tile
    assert launch.default_l2d(launch.launch_config(8, 4, 128, kv_capacity=512))  # short chain at d128: BLOCK_M 32
    assert not launch.default_l2d(launch.launch_config(16, 3, 64))  # T=16 tree: wgmma tile
    assert not launch.default_l2d(launch.launch_config(64, 3, 64))  # prefill chunk


def test_short_chains_and_trees_take_the_wgmma_tile():
    # 17-32 rows: the 64-row wgmma tile with 16-bit inputs at d <= 64, and at d128 from a page-table
    # capacity of WGMMA_MIN_CAPACITY_D128 slots; 16 rows or fewer (decode) and fp32 keep mma.sync.
    import kernels_triton.attention_launch as launch

    cap = launch.WGMMA_MIN_CAPACITY_D128
    m = lambda *a, **kw: launch.launch_config(*a, **kw)["BLOCK_M"]  # noqa: E731
    assert m(6, 3, 64, torch.bfloat16) == 64 and m(10, 3, 64, torch.float16) == 64  # 18 / 30 rows
    assert launch.launch_config(6, 3, 64)["BLOCK_T"] == 21
    assert m(5, 3, 64, torch.bfloat16) == 16  # 15 rows
    assert m(6, 3, 64, torch.float32) == 32
    assert m(8, 4, 128, torch.bfloat16, kv_capacity=cap - 16) == 32
    assert m(8, 4, 128, torch.bfloat16, kv_capacity=cap) == 64
    assert m(8, 4, 128, torch.bfloat16) == 32  # capacity unknown


def test_default_one_loop_rule():
    # one loop for mma.sync tiles (BLOCK_M <= 32) whatever the length; for wgmma tiles only while a
    # split holds at most ONE_LOOP_MAX_TILES tiles of capacity (the tree headline's 17 tiles: two loops)
    import kernels_triton.attention_launch as launch

    decode = launch.launch_config(1, 3, 64)
    tree = launch.launch_config(16, 3, 64)
    assert decode["BLOCK_M"] <= 32 and tree["BLOCK_M"] == 64
    assert launch.default_one_loop(decode, 16384 + 1, 1)
    assert not launch.default_one_loop(tree, 1024 + 16, 1)
    assert launch.default_one_loop(tree, 1024 + 16, 4)  # 5 tiles per split
    cap = launch.ONE_LOOP_MAX_TILES * tree["BLOCK_N"]
    assert launch.default_one_loop(tree, cap, 1) and not launch.default_one_loop(tree, cap + 1, 1)
