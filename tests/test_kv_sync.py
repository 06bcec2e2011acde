"""kv_sync_ (the commit) against its plain-torch reference, bit for bit.

Random pools with shuffled page tables (pages of a request scattered over the pool), random
accepted paths including the aliasing case (path 0, 2, 3: slot 2 -> 1 while 3 -> 2), requests with
nothing accepted, two pools of different shapes and dtypes in one call (target + draft), and three
pools (two launches). The caches are filled with random values and NaNs, compared as raw bits, so a
copy that touched a slot off the path or of another request, or moved the wrong row, fails.
"""

import pytest
import torch

from kernels_triton.kv_sync import kv_sync_, kv_sync_ref_
from kernels_triton.verify_accept import verify_accept

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
BF16 = [torch.bfloat16] if DEVICE == "cuda" else []


def with_dtypes(cases, gpu_cases=()):
    """Parameters: every case (a tuple) in fp32 and fp16, and the ``gpu_cases`` also in bf16 on a GPU (the
    ``-m gpu`` selection compiles every case's kernel variants, so it keeps a representative few)."""
    return [(*c, dt) for c in cases for dt in DTYPES] + [(*c, dt) for c in gpu_cases for dt in BF16]
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def bits(t):
    return t.view(_BITS[t.dtype])


def make_pool(L, P, PS, HKV, D, dtype, gen):
    """k and v filled with random values, ~10% NaN (a copy of a NaN must stay a NaN bit pattern)."""
    out = []
    for _ in range(2):
        x = torch.randn(L, P, PS, HKV, D, generator=gen)
        x[torch.rand(x.shape, generator=gen) < 0.1] = float("nan")
        out.append(x.to(dtype).to(DEVICE))
    return tuple(out)


def random_path(T, gen):
    """An increasing node sequence 0 < n_1 < ... < n_A of random length (some chains, some jumps)."""
    A = int(torch.randint(0, T, (1,), generator=gen))
    nodes = sorted(torch.randperm(T - 1, generator=gen)[:A].add(1).tolist())
    return [0] + nodes


def make_state(B, T, PS, MP, P, gen, paths=None):
    """Shuffled page table (distinct pages per request), seq_lens leaving room for T scratch slots,
    paths (random unless given) as verify_accept returns them."""
    assert B * MP <= P
    page_table = torch.randperm(P, generator=gen)[: B * MP].view(B, MP).to(torch.int32)
    seq_lens = torch.randint(0, MP * PS - T + 1, (B,), generator=gen).to(torch.int32)
    paths = paths or [random_path(T, gen) for _ in range(B)]
    accept_len = torch.tensor([len(p) - 1 for p in paths], dtype=torch.int32)
    nodes = torch.full((B, T), -1, dtype=torch.int32)
    out_tokens = torch.full((B, T), -1, dtype=torch.long)
    for b, p in enumerate(paths):
        nodes[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
        out_tokens[b, : len(p)] = torch.randint(0, 50000, (len(p),), generator=gen)
    return [t.to(DEVICE) for t in (page_table, seq_lens, nodes, accept_len, out_tokens)]


def run_both(pools, state):
    """Run kernel and reference on separate copies; compare caches bitwise and the returned state."""
    page_table, seq_lens, nodes, accept_len, out_tokens = state
    got_pools = [(k.clone(), v.clone()) for k, v in pools]
    ref_pools = [(k.clone(), v.clone()) for k, v in pools]
    inputs = [t.clone() for t in state]
    new_lens, pending = kv_sync_(got_pools, page_table, seq_lens, nodes, accept_len, out_tokens)
    ref_lens, ref_pending = kv_sync_ref_(ref_pools, page_table, seq_lens, nodes, accept_len, out_tokens)
    for i, ((kg, vg), (kr, vr)) in enumerate(zip(got_pools, ref_pools)):
        assert torch.equal(bits(kg), bits(kr)), f"pool {i} k differs from the reference"
        assert torch.equal(bits(vg), bits(vr)), f"pool {i} v differs from the reference"
    assert new_lens.dtype == torch.int32 and torch.equal(new_lens, ref_lens)
    assert pending.dtype == out_tokens.dtype and torch.equal(pending, ref_pending)
    for before, after in zip(inputs, state):
        assert torch.equal(before, after), "an input was modified"
    return got_pools, new_lens, pending


@pytest.mark.parametrize("B,T,PS,dtype", with_dtypes([(5, 9, 16), (3, 16, 5), (7, 4, 1)], [(3, 16, 5)]))
def test_kv_sync_matches_ref_two_pools(B, T, PS, dtype, poison):
    gen = torch.Generator().manual_seed(B * 100 + T + PS)
    MP = (T + 40) // PS + 2
    P = B * MP + 3
    target = make_pool(3, P, PS, 3, 64, dtype, gen)  # 3 layers, 3 KV heads, d64
    draft = make_pool(1, P, PS, 2, 24, torch.float16, gen)  # a 1-layer draft, another shape/dtype
    state = make_state(B, T, PS, MP, P, gen)
    run_both([target, draft], state)


def test_kv_sync_aliasing_path_by_hand(poison):
    # Independent of the reference: path 0, 2, 3 at seq_len 6 moves slot 8 -> 7 and 9 -> 8, where
    # slot 8 is both a source and a destination. Slots 6 (root), 9 and beyond keep their values.
    gen = torch.Generator().manual_seed(0)
    PS, MP = 4, 5
    pool = make_pool(2, 8, PS, 3, 16, torch.float32, gen)
    page_table = torch.tensor([[7, 2, 5, 0, 3]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([6], dtype=torch.int32, device=DEVICE)
    nodes = torch.tensor([[0, 2, 3, -1, -1, -1]], dtype=torch.int32, device=DEVICE)
    accept_len = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    out_tokens = torch.tensor([[11, 12, 13, -1, -1, -1]], device=DEVICE)
    k, v = pool[0].clone(), pool[1].clone()

    def slot(cache, s):
        return cache[:, int(page_table[0, s // PS]), s % PS]

    before = {s: (slot(k, s).clone(), slot(v, s).clone()) for s in range(MP * PS)}
    new_lens, pending = kv_sync_([(k, v)], page_table, seq_lens, nodes, accept_len, out_tokens)
    assert new_lens.tolist() == [9] and pending.tolist() == [13]
    moved = {7: 8, 8: 9}  # destination slot <- source slot
    for s in range(MP * PS):
        src = moved.get(s, s)
        assert torch.equal(bits(slot(k, s)), bits(before[src][0])), f"k slot {s}"
        assert torch.equal(bits(slot(v, s)), bits(before[src][1])), f"v slot {s}"


def test_kv_sync_edge_paths(poison):
    # Aliasing chains of jumps, a full chain (already in place: nothing moves), nothing accepted,
    # the deepest possible path, scratch crossing page boundaries. The d256 pool moves 4 rows per
    # block, so [0, 2, 3, 4, 5, 6, 7] aliases across blocks (row 4 reads slot 5, row 5 writes it).
    gen = torch.Generator().manual_seed(1)
    T, PS, MP = 8, 3, 8
    paths = [[0, 2, 3], [0, 1, 2, 3], [0], [0, 3, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7], [0, 7], [0, 2, 4, 6],
             [0, 2, 3, 4, 5, 6, 7]]
    B = len(paths)
    P = B * MP
    pools = [make_pool(2, P, PS, 3, 32, torch.float32, gen), make_pool(3, P, PS, 1, 64, torch.float16, gen),
             make_pool(1, P, PS, 2, 256, torch.float32, gen)]
    state = make_state(B, T, PS, MP, P, gen, paths=paths)
    got, new_lens, pending = run_both(pools, state)
    seq_lens, accept_len, out_tokens = state[1], state[3], state[4]
    assert torch.equal(new_lens.cpu(), (seq_lens + accept_len + 1).cpu())
    assert pending.tolist() == [out_tokens[b, len(p) - 1].item() for b, p in enumerate(paths)]
    # A chain, or nothing accepted, leaves the cache bit-identical.
    unchanged = [(k.clone(), v.clone()) for k, v in pools]
    chain_state = make_state(2, T, PS, MP, P, gen, paths=[[0, 1, 2, 3], [0]])
    kv_sync_(unchanged, *chain_state)
    for (k0, v0), (k1, v1) in zip(pools, unchanged):
        assert torch.equal(bits(k0), bits(k1)) and torch.equal(bits(v0), bits(v1))


def test_kv_sync_three_pools_and_no_pools(poison):
    # Three pools take two launches (a pair, then one); an empty pool list still returns the state.
    gen = torch.Generator().manual_seed(2)
    B, T, PS, MP = 4, 6, 4, 4
    P = B * MP
    pools = [make_pool(2, P, PS, 3, 16, torch.float32, gen), make_pool(1, P, PS, 2, 64, torch.float16, gen),
             make_pool(2, P, PS, 1, 8, torch.float32, gen)]
    state = make_state(B, T, PS, MP, P, gen)
    run_both(pools, state)
    new_lens, pending = kv_sync_([], *state)
    ref_lens, ref_pending = kv_sync_ref_([], *state)
    assert torch.equal(new_lens, ref_lens) and torch.equal(pending, ref_pending)


def test_kv_sync_strided_pools(poison):
    # k and v as views of one [2, L, P, PS, HKV, D] allocation (non-contiguous in the page dim).
    gen = torch.Generator().manual_seed(3)
    B, T, PS, MP = 3, 5, 4, 5
    P = B * MP
    kv = torch.randn(2, 2, P, PS, 3, 32, generator=gen).to(DEVICE)
    wide = torch.randn(2, P, PS, 6, 32, generator=gen).to(DEVICE)[:, :, :, 1:4]  # strided heads
    state = make_state(B, T, PS, MP, P, gen, paths=[[0, 2, 3], [0, 1, 4], [0]])
    run_both([(kv[0], kv[1]), (wide, wide.clone())], state)


def test_verify_then_commit_end_to_end(poison):
    # verify_accept's outputs feed kv_sync_ directly; the committed slots then hold the KV of the
    # accepted nodes in path order.
    gen = torch.Generator().manual_seed(4)
    B, T, V, PS, MP = 4, 7, 50, 4, 6
    P = B * MP
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]] * B, dtype=torch.int32, device=DEVICE)
    logits = torch.randn(B, T, V, generator=gen).to(DEVICE)
    am = logits.argmax(-1)
    tokens = torch.randint(0, V, (B, T), generator=gen).to(DEVICE)
    tokens[:, 2] = am[:, 0]
    tokens[:, 3] = am[:, 1]
    tokens[:2, 5] = am[:2, 2]
    accept_len, nodes, out_tokens = verify_accept(logits, tokens, parents, 0.0)
    state = make_state(B, T, PS, MP, P, gen)
    page_table, seq_lens = state[0], state[1]
    pool = make_pool(2, P, PS, 2, 16, torch.float32, gen)
    k, v = pool[0].clone(), pool[1].clone()

    def slot(cache, b, s):
        return cache[:, int(page_table[b, s // PS]), s % PS]

    before = [[slot(k, b, int(seq_lens[b]) + i).clone() for i in range(T)] for b in range(B)]
    new_lens, pending = kv_sync_([(k, v)], page_table, seq_lens, nodes, accept_len, out_tokens)
    for b in range(B):
        A = int(accept_len[b])
        assert int(new_lens[b]) == int(seq_lens[b]) + A + 1
        assert int(pending[b]) == int(out_tokens[b, A])
        for i in range(A + 1):
            assert torch.equal(bits(slot(k, b, int(seq_lens[b]) + i)), bits(before[b][int(nodes[b, i])]))
    assert accept_len.tolist() == [2, 2, 1, 1]


def test_kv_sync_bad_inputs():
    gen = torch.Generator().manual_seed(5)
    pool = make_pool(1, 8, 4, 2, 16, torch.float32, gen)
    state = make_state(2, 4, 4, 4, 8, gen)
    page_table, seq_lens, nodes, accept_len, out_tokens = state
    with pytest.raises(ValueError, match="accepted_nodes"):
        kv_sync_([pool], page_table, seq_lens, nodes.long(), accept_len, out_tokens)
    with pytest.raises(ValueError, match="seq_lens"):
        kv_sync_([pool], page_table, seq_lens.long(), nodes, accept_len, out_tokens)
    with pytest.raises(ValueError, match="page_table"):
        kv_sync_([pool], page_table[:1], seq_lens, nodes, accept_len, out_tokens)
    with pytest.raises(ValueError, match=r"\(P, PS\)"):
        kv_sync_([pool, make_pool(1, 8, 2, 2, 16, torch.float32, gen)], *state)
    with pytest.raises(ValueError, match=r"\[L, P, PS, HKV, D\]"):
        kv_sync_([(pool[0][0], pool[1][0])], *state)
    with pytest.raises(ValueError, match="pair"):
        kv_sync_([pool[0]], *state)


@pytest.mark.parametrize("dtype", DTYPES + BF16)
def test_commit_into_state_with_padding_rows(dtype):
    """valid / into: the step's whole commit. Padding rows (valid False) carry a stale page table that
    shares pages with live rows and a forced full acceptance: they must move no KV, keep their
    seq_len and pending, get sampled -1 and accept_len 0; live rows match the plain commit. Kernel
    and reference write the same state buffers (rows of wider persistent buffers), bit for bit."""
    gen = torch.Generator().manual_seed(23)
    B, T, PS, MP, P = 5, 7, 4, 6, 40
    pools = [make_pool(2, P, PS, 3, 16, dtype, gen)]
    page_table, seq_lens, nodes, accept_len, out_tokens = make_state(B, T, PS, MP, P, gen)
    valid = torch.tensor([True, False, True, True, False], device=DEVICE)
    page_table[1] = page_table[0]  # stale: a finished request's pages, now owned by row 0
    page_table[4] = page_table[3]
    for b in (1, 4):
        accept_len[b] = T - 1
        nodes[b] = torch.arange(T, dtype=torch.int32)
    results = []
    for fn in (kv_sync_, kv_sync_ref_):
        got_pools = [(k.clone(), v.clone()) for k, v in pools]
        acc = accept_len.clone()
        seq_buf = torch.full((B + 3,), -5, dtype=torch.int32, device=DEVICE)
        pend_buf = torch.arange(B + 3, dtype=torch.int64, device=DEVICE) + 1000
        samp_buf = torch.full((B + 3, T + 2), -9, dtype=torch.int64, device=DEVICE)
        out = fn(got_pools, page_table, seq_lens, nodes, acc, out_tokens, valid,
                 (seq_buf[:B], pend_buf[:B], samp_buf[:B, :T]))
        assert out[0].data_ptr() == seq_buf.data_ptr()
        results.append((got_pools, acc, seq_buf, pend_buf, samp_buf))
    (kp, acc, seq_buf, pend_buf, samp_buf), (kp_r, acc_r, seq_r, pend_r, samp_r) = results
    for (kg, vg), (kr, vr) in zip(kp, kp_r):
        assert torch.equal(bits(kg), bits(kr)) and torch.equal(bits(vg), bits(vr))
    for a, b_ in ((acc, acc_r), (seq_buf, seq_r), (pend_buf, pend_r), (samp_buf, samp_r)):
        assert torch.equal(a, b_)
    # What the commit means, row by row (independent of the reference).
    live = valid.tolist()
    plain_pools = [(k.clone(), v.clone()) for k, v in pools]
    keep = torch.where(valid, accept_len, 0)
    want_lens, want_pending = kv_sync_ref_(plain_pools, page_table, seq_lens, nodes, keep, out_tokens)
    for (kg, vg), (kw, vw) in zip(kp, plain_pools):
        assert torch.equal(bits(kg), bits(kw)) and torch.equal(bits(vg), bits(vw))
    for b in range(B):
        if live[b]:
            assert seq_buf[b] == want_lens[b] and pend_buf[b] == want_pending[b] and acc[b] == accept_len[b]
            assert samp_buf[b, :T].tolist() == out_tokens[b].tolist()
        else:
            assert seq_buf[b] == seq_lens[b] and pend_buf[b] == 1000 + b and acc[b] == 0
            assert (samp_buf[b, :T] == -1).all()
    assert (seq_buf[B:] == -5).all() and (samp_buf[:, T:] == -9).all() and (samp_buf[B:] == -9).all()
