"""Exact mode (engine.exact, kernel option ``exact``): a token's logits, KV and hidden states are the same bits
however the token is computed -- a 1-token decode step, a node of a verified tree, a row of a batch of any
size, a token of a prefill chunk -- so greedy speculative output is plain greedy output, also in bf16.

- Launch plans: every exact-mode launch (GEMM, attention, MoE) takes its blocks, splits and reduction order
  from the weight / head shape alone, checked over M = 1..64, batch compositions, trees and capacities by
  recording the launches (nothing runs).
- Bits on the CPU (interpreter, fp32): each kernel's rows, and a small model's logits, KV and captured
  hidden states, compared with torch.equal across those ways of computing one token. In the default mode
  the same comparisons differ in the last bits even in fp32 (around 1e-7 on this model: the fused 1-row
  GEMV, the streaming body and the attention's split plans each sum in their own order); greedy tokens
  agree there because fp32 leaves no near-ties in these tests.
- The engine end to end: plain decoding at C = 1 and all requests at once, EAGLE-3 and n-gram drafts,
  each equal to plain greedy with exact on (and the fp32 identity tests still pass with it off).
- On the GPU (``-m gpu``): the same bit-identity at a Llama-3.1-8B layer shape in bf16, and SmolLM2 with its
  EAGLE-3 head and the n-gram drafter equal to plain greedy in bf16 at batch 1 and under load.
"""

import os

import pytest
import torch

from kernels_triton import attention_exact, linear_exact, moe
from specdec.models import ops
from specdec.models.families import ModelConfig
from specdec.models.ops import AttentionMeta
from specdec.models.transformer import TransformerModel

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU interpreter runs; the GPU ones are marked gpu")
# The bit tests on the CPU compute each row of an interpreted tl.dot on its own (conftest row_invariant_dot).
BITS = pytest.mark.usefixtures("row_invariant_dot")


class Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kw)`` records (grid, constexprs and
    launch options) and runs nothing."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((tuple(grid), kw))
        return launch


def record(monkeypatch, module, *names):
    recs = {n: Recorder() for n in names}
    for n, r in recs.items():
        monkeypatch.setattr(module, n, r)
    return recs


# ------------------------------------------------------------------------------------------------
# Launch plans: functions of the weight / head shape only
# ------------------------------------------------------------------------------------------------

# Weights [N, K]: SmolLM2's qkv, o, gate|up, down and LM head; Llama-3.1-8B's qkv, down, LM head; odd sizes.
WEIGHTS = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (6144, 4096), (4096, 14336),
           (128256, 4096), (50, 37)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_linear_exact_launch_is_the_same_at_every_m(monkeypatch, dtype):
    rec = record(monkeypatch, linear_exact, "_linear_exact_kernel")["_linear_exact_kernel"]
    for N, K in WEIGHTS:
        w = torch.empty(N, K, dtype=dtype, device="meta")
        rec.calls.clear()
        for M in range(1, 65):
            linear_exact.linear_exact(torch.empty(M, K, dtype=dtype, device="meta"), w)
        plans = {tuple(sorted(kw.items())) for _, kw in rec.calls}
        assert len(plans) == 1, (N, K, plans)  # blocks, K chunk, warps, stages: one plan for M = 1..64
        cfg = linear_exact.plan(N, K, dtype)
        assert [g for g, _ in rec.calls] == [linear_exact.grid(M, N, cfg) for M in range(1, 65)]
        assert dict(rec.calls[0][1])["BLOCK_M"] == cfg["BLOCK_M"]  # a 1-row launch pads to the same row block


@cpu_only  # CPU tensors on the "triton" backend: the interpreter
def test_ops_route_every_projection_through_linear_exact(kernel_options):
    """Exact mode on the Triton backend: no fused small-M body at any M, no norm folding, no cuBLAS; inside
    ops.approximate() (the draft) and with exact off, the default routing."""
    be = "triton"
    calls = []
    real = linear_exact.linear_exact
    for N, K in WEIGHTS[:6]:
        w = torch.empty(N, K)
        for M in (1, 2, 4, 16, 17, 24, 48, 64):
            x = torch.empty(M, K)
            with kernel_options.use(exact=True):
                assert not ops._fused(be, x, w, one_row_any_size=True)
                assert not ops.sums_squares(be, x, w) and not ops.norm_folding(be, x, w)
                assert ops.exact(be, x) and not ops.exact("torch", x)
                with ops.approximate():
                    assert not ops.exact(be, x)
            assert not ops.exact(be, x)
    # ops.mm (every projection and the LM head below the fused ops) calls the exact GEMM
    try:
        linear_exact.linear_exact = lambda x, w, add=None: calls.append(x.shape[0]) or real(x, w, add)
        x, w = torch.randn(3, 40), torch.randn(24, 40)
        with kernel_options.use(exact=True):
            torch.testing.assert_close(ops.linear(x, w, backend=be), x @ w.t())
            y, s = ops.norm_linear(x, None, torch.ones(40), 1e-6, w, backend=be)
        assert calls == [3, 3]
    finally:
        linear_exact.linear_exact = real
    with kernel_options.use(exact=True), ops.approximate():  # the draft: the GEMV at one row, as by default
        assert ops._fused(be, torch.empty(1, 576), torch.empty(960, 576), one_row_any_size=True)


HEADS = [(9, 3, 64), (32, 8, 128), (8, 2, 32), (32, 4, 128)]  # SmolLM2, Llama-3.1-8B, G = 4 at d32, Qwen3-30B-A3B


def attention_inputs(Ts, capacity, heads, dtype, tree=False):
    HQ, HKV, D = heads
    PS = 16
    B = len(Ts)
    N = sum(Ts)
    cu = torch.tensor([0] + torch.tensor(Ts).cumsum(0).tolist(), dtype=torch.int32)
    return dict(q=torch.empty(N, HQ, D, dtype=dtype), k_cache=torch.empty(8, PS, HKV, D, dtype=dtype),
                v_cache=torch.empty(8, PS, HKV, D, dtype=dtype),
                page_table=torch.zeros(B, capacity // PS, dtype=torch.int32), cu_q_lens=cu,
                kv_lens=torch.full((B,), max(Ts), dtype=torch.int32),
                tree_mask=torch.zeros(N, dtype=torch.int64) if tree else None, max_q_len=max(Ts))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_attention_exact_launch_is_the_same_for_every_query_count_batch_and_tree(monkeypatch, dtype):
    rec = record(monkeypatch, attention_exact, "_attention_exact_kernel", "_attention_exact_merge_kernel")
    fwd = rec["_attention_exact_kernel"]
    order_keys = ("BLOCK_M", "BLOCK_T", "BLOCK_N", "SPLIT_TILES", "DOT_PREC", "num_warps", "num_stages",
                  "enable_fp_fusion", "G", "D")
    for heads in HEADS:
        fwd.calls.clear()
        for capacity in (64, 1024, 16384, 131072):
            for Ts in [[t] for t in range(1, 65)] + [[1] * 3, [1] * 7, [1] * 64, [1] * 256, [16] * 7, [48] * 64,
                                                     [2048], [300, 0, 7]]:
                for tree in (False, True):
                    if tree and max(Ts) > 64:
                        continue
                    attention_exact.paged_attention_exact(**attention_inputs(Ts, capacity, heads, dtype, tree))
        plans = {tuple(kw[k] for k in order_keys) for _, kw in fwd.calls}
        assert len(plans) == 1, (heads, plans)  # tiles, split size, MMA, no FMA contraction: one plan
        assert plans == {tuple({**attention_exact.plan(heads[0] // heads[1], heads[2], dtype),
                                "DOT_PREC": "ieee" if dtype == torch.float32 else "tf32", "enable_fp_fusion": False,
                                "G": heads[0] // heads[1], "D": heads[2]}[k] for k in order_keys)}
        # What may vary with the launch is how many split programs run side by side (PARALLEL: speed only,
        # the bits are checked equal below), never the split size.
        assert {kw["PARALLEL"] for _, kw in fwd.calls} <= {True, False}


@cpu_only  # CPU tensors on the "triton" backend: the interpreter
def test_ops_attention_routes_exact_except_windowed_draft_rounds(monkeypatch, kernel_options):
    rec = record(monkeypatch, attention_exact, "_attention_exact_kernel", "_attention_exact_merge_kernel")
    from kernels_triton import attention

    default = record(monkeypatch, attention, "_paged_attention_fwd_kernel", "_paged_attention_merge_kernel")
    args = attention_inputs([4], 64, HEADS[0], torch.float32, tree=True)
    meta = AttentionMeta(args["cu_q_lens"], args["kv_lens"], args["page_table"], torch.zeros(4, dtype=torch.int64),
                         4, args["tree_mask"])
    with kernel_options.use(exact=True):
        ops.paged_attention(args["q"], args["k_cache"], args["v_cache"], meta, backend="triton")
        assert len(rec["_attention_exact_kernel"].calls) == 1
        windowed = AttentionMeta(**{**meta.__dict__, "tree_window": 8})
        ops.paged_attention(args["q"], args["k_cache"], args["v_cache"], windowed, backend="triton")
        assert len(rec["_attention_exact_kernel"].calls) == 1 and len(default["_paged_attention_fwd_kernel"].calls) == 1
    ops.paged_attention(args["q"], args["k_cache"], args["v_cache"], meta, backend="triton")  # exact off
    assert len(rec["_attention_exact_kernel"].calls) == 1 and len(default["_paged_attention_fwd_kernel"].calls) == 2


MOE_SHAPES = [(128, 8, 2048, 768), (8, 2, 4096, 14336), (6, 2, 40, 24)]  # Qwen3-30B-A3B, Mixtral, a test size


def test_moe_exact_plan_and_launches_are_the_same_for_every_token_count(monkeypatch, kernel_options):
    for E, K, H, F in MOE_SHAPES:
        plans = {repr(moe.moe_plan(T, E, K, H, F, exact=True)) for T in [*range(1, 65), 256, 1024, 4096]}
        assert len(plans) == 1, (E, plans)
        assert moe.moe_plan(1, E, K, H, F, exact=False) != moe.moe_plan(1024, E, K, H, F, exact=False)  # default: by T
    names = ("_moe_router_kernel", "_moe_topk_kernel", "_moe_sort_kernel", "_moe_gate_up_kernel", "_moe_down_kernel",
             "_moe_combine_kernel")
    recs = record(monkeypatch, moe, *names)
    E, K, H, F = MOE_SHAPES[0]
    w13, w2, rw = (torch.empty(*s, dtype=torch.bfloat16, device="meta") for s in ((E, 2 * F, H), (E, H, F), (E, H)))
    with kernel_options.use(exact=True):
        for T in range(1, 65):
            moe.fused_moe(torch.empty(T, H, dtype=torch.bfloat16, device="meta"), rw, w13, w2, K, True)
    for n in names:  # every kernel launched at every T, with one set of constexprs (the grid follows T)
        kws = {repr(sorted(kw.items())) for _, kw in recs[n].calls}
        assert len(recs[n].calls) == 64 and len(kws) == 1, (n, kws)


# ------------------------------------------------------------------------------------------------
# Bits on the CPU: kernels
# ------------------------------------------------------------------------------------------------


@BITS
@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_exact_rows_are_bit_identical_at_any_m_and_position(dtype):
    g = torch.Generator().manual_seed(0)
    K, N = 80, 40
    w = torch.randn(N, K, generator=g).to(dtype)
    x = torch.randn(70, K, generator=g).to(dtype)
    add = torch.randn(70, N, generator=g).to(dtype)
    full = linear_exact.linear_exact(x, w, add)
    torch.testing.assert_close(full.float(), linear_exact.linear_exact_ref(x, w, add).float(), atol=2e-3, rtol=2e-3)
    for M, start in ((1, 0), (1, 37), (3, 5), (7, 60), (17, 2), (64, 6)):
        rows = slice(start, start + M)
        assert torch.equal(linear_exact.linear_exact(x[rows], w, add[rows]), full[rows])


def _ancestors(parents):
    masks = []
    for i, p in enumerate(parents):
        masks.append((1 << i) | (masks[p] if p >= 0 else 0))
    return masks


def _tree_with_path(T, path, g):
    """Parents of a random T-node tree whose nodes ``path`` (increasing, path[0] = 0) form a root-to-leaf
    chain; the other nodes hang anywhere before them."""
    parents = [-1] * T
    for a, b in zip(path, path[1:]):
        parents[b] = a
    for i in range(1, T):
        if i not in path:
            parents[i] = int(torch.randint(0, i, (1,), generator=g))
    return parents


@BITS
@cpu_only
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 16)])
def test_attention_exact_query_bits_independent_of_launch(heads, monkeypatch):
    """One query at position p = L0 + d with keys 0..p: its output computed as a decode step, as the depth-d
    node of trees of 5 / 16 / 40 nodes whose other nodes sit between its ancestors, inside batches, as a row
    of a prefill chunk, with parallel or sequential splits: torch.equal every time."""
    HQ, HKV, D = heads
    g = torch.Generator().manual_seed(3)
    monkeypatch.setattr(attention_exact, "FP32_SPLIT_KEYS", 64)  # 3 splits of the 155 keys (a plan constant)
    PS, L0, d = 8, 150, 4
    p = L0 + d
    keys = torch.randn(p + 1, HKV, D, generator=g), torch.randn(p + 1, HKV, D, generator=g)  # committed K, V
    qrow = torch.randn(HQ, D, generator=g)

    def launch(reqs, parallel=None, tree=False):
        """reqs: (kv [slots, HKV, D] x 2, q [T, HQ, D], masks or None); one launch, outputs per request."""
        n_pages = sum(-(-r[0][0].shape[0] // PS) for r in reqs) + 2
        kc = torch.full((n_pages, PS, HKV, D), float("nan"))
        vc = kc.clone()
        perm = torch.randperm(n_pages, generator=g).tolist()
        MP = max(-(-r[0][0].shape[0] // PS) for r in reqs) + 1
        table = torch.tensor([[perm[-1]] * MP] * len(reqs), dtype=torch.int32)
        for b, ((k, v), q, _) in enumerate(reqs):
            n = k.shape[0]
            table[b, :-(-n // PS)] = torch.tensor([perm.pop(0) for _ in range(-(-n // PS))], dtype=torch.int32)
            s = torch.arange(n)
            kc[table[b, s // PS].long(), s % PS], vc[table[b, s // PS].long(), s % PS] = k, v
        q = torch.cat([r[1] for r in reqs])
        Ts = [r[1].shape[0] for r in reqs]
        masks = torch.tensor(sum((r[2] for r in reqs), []), dtype=torch.int64) if tree else None
        out = attention_exact.paged_attention_exact(
            q, kc, vc, table, torch.tensor([0] + torch.tensor(Ts).cumsum(0).tolist(), dtype=torch.int32),
            torch.tensor([r[0][0].shape[0] for r in reqs], dtype=torch.int32), masks, max_q_len=max(Ts),
            parallel=parallel)
        return out.split(Ts)

    def other(n, T=1, tree=False):
        ks = (torch.randn(n + T, HKV, D, generator=g), torch.randn(n + T, HKV, D, generator=g))
        masks = _ancestors(_tree_with_path(T, [0], g)) if tree else None
        return ks, torch.randn(T, HQ, D, generator=g), masks

    want = launch([((keys[0], keys[1]), qrow[None], None)], parallel=False)[0][0]
    G = HQ // HKV
    scores = torch.einsum("hd,lhd->hl", qrow, keys[0].repeat_interleave(G, 1)) / D ** 0.5  # [HQ, p + 1]
    dense = torch.einsum("hl,lhd->hd", scores.softmax(-1), keys[1].repeat_interleave(G, 1))
    torch.testing.assert_close(want, dense, atol=1e-5, rtol=1e-5)
    got = {"decode parallel": launch([((keys[0], keys[1]), qrow[None], None)], parallel=True)[0][0]}
    for B, me in ((3, 1), (7, 6)):
        reqs = [other(int(torch.randint(1, 300, (1,), generator=g))) for _ in range(B)]
        reqs[me] = ((keys[0], keys[1]), qrow[None], None)
        got[f"decode in batch {B}"] = launch(reqs, parallel=B == 3)[me][0]
    # prefill chunks: the query is row d of a chunk L0..p, or a middle row of a chunk from 120
    chunk_q = torch.randn(p + 1, HQ, D, generator=g)
    chunk_q[p] = qrow
    got["chunk from L0"] = launch([((keys[0], keys[1]), chunk_q[L0:], None)])[0][d]
    more = [torch.cat([k, torch.randn(2, HKV, D, generator=g)]) for k in keys]  # two later tokens' keys
    got["chunk from 120"] = launch([(more, torch.cat([chunk_q[120:], chunk_q[:2]]), None)])[0][p - 120]
    for T, B, path in ((5, 1, [0, 1, 2, 3, 4]), (16, 3, [0, 3, 4, 9, 15]), (40, 1, [0, 7, 8, 21, 39])):
        parents = _tree_with_path(T, path, g)
        masks = _ancestors(parents)
        kt = torch.randn(L0 + T, HKV, D, generator=g), torch.randn(L0 + T, HKV, D, generator=g)  # scratch slots
        for i in range(2):
            kt[i][:L0] = keys[i][:L0]
            for depth, node in enumerate(path):
                kt[i][L0 + node] = keys[i][L0 + depth]
        qt = torch.randn(T, HQ, D, generator=g)
        qt[path[-1]] = qrow
        reqs = [other(int(torch.randint(1, 200, (1,), generator=g)), T, tree=True) for _ in range(B)]
        reqs[-1] = (kt, qt, masks)
        for par in (False, True):
            got[f"tree {T} in batch {B} parallel={par}"] = launch(reqs, parallel=par, tree=True)[-1][path[-1]]
    for name, out in got.items():
        assert torch.equal(out, want), f"{name}: {(out - want).abs().max():.2e}"


@BITS
@cpu_only
def test_moe_exact_token_bits_independent_of_token_count(kernel_options):
    g = torch.Generator().manual_seed(5)
    E, K, H, F = 6, 2, 40, 24
    x = torch.randn(40, H, generator=g)
    rw = torch.randn(E, H, generator=g)
    w13, w2 = torch.randn(E, 2 * F, H, generator=g) / 6, torch.randn(E, H, F, generator=g) / 5
    with kernel_options.use(exact=True):
        full = moe.fused_moe(x, rw, w13, w2, K, True)
        for start, T in ((0, 1), (9, 1), (3, 5), (17, 20)):
            assert torch.equal(moe.fused_moe(x[start:start + T], rw, w13, w2, K, True), full[start:start + T])
    torch.testing.assert_close(full, moe.fused_moe_ref(x, rw, w13, w2, K, True), atol=1e-4, rtol=1e-4)


@cpu_only
def test_greedy_verify_takes_the_plain_steps_argmax():
    """verify_accept's greedy target at a node is the first index of the row's maximum whether the step is
    a 1-node plain step or a tree, and whether the vocabulary is split over programs or walked by one:
    identical logits in give the identical token out (ties included)."""
    from kernels_triton.verify_accept import verify_accept

    g = torch.Generator().manual_seed(2)
    V = 5000
    row = torch.randn(V, generator=g)
    row[[17, 2600, 4097]] = row.max() + 1  # a three-way tie across vocabulary chunks: 17 wins
    for T in (1, 16):
        logits = torch.randn(2, T, V, generator=g)
        logits[1, 0] = row
        tokens = torch.full((2, T), -5, dtype=torch.int64)  # no child matches: the bonus is the root's argmax
        parents = torch.tensor([[-1] + [0] * (T - 1)] * 2, dtype=torch.int32)
        for split in (False, True):
            _, _, out = verify_accept(logits, tokens, parents, 0.0, split_vocab=split)
            assert int(out[1, 0]) == 17


# ------------------------------------------------------------------------------------------------
# Bits on the CPU: a model's logits, KV and captured hidden states
# ------------------------------------------------------------------------------------------------

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, head_dim=16, max_position_embeddings=256)


class Pool:
    """A KV pool of random values (stand-ins for other requests' keys) whose requests get pages in
    scrambled order."""

    def __init__(self, model, n_pages=160, PS=4, seed=0):
        self.PS, self.dev = PS, model.device
        g = torch.Generator(device=model.device).manual_seed(seed)
        self.k, self.v = (t.normal_(generator=g) for t in model.new_kv_cache(n_pages, PS))
        self.free = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed)).tolist()

    def pages(self, n_slots):
        return [self.free.pop() for _ in range(-(-n_slots // self.PS))]

    def slot(self, pages, s):
        return pages[s // self.PS] * self.PS + s % self.PS

    def slots(self, pages, n):
        return torch.tensor([self.slot(pages, s) for s in range(n)], device=self.dev)

    def kv(self, pages, s):
        """(K, V) [L, HKV, D] of logical slot s of a request."""
        sl = self.slot(pages, s)
        return self.k[:, sl // self.PS, sl % self.PS].clone(), self.v[:, sl // self.PS, sl % self.PS].clone()

    def copy_(self, src, src_pages, pages, n):
        """Slots 0 .. n-1 of a request of pool ``src`` into ``pages`` of this pool (bit copies)."""
        a, b = src.slots(src_pages, n), self.slots(pages, n)
        for mine, theirs in ((self.k, src.k), (self.v, src.v)):
            mine.flatten(1, 2)[:, b] = theirs.flatten(1, 2)[:, a]


def forward(model, pool, reqs, capture=(0, 1)):
    """One forward over requests dict(pages, ids, pos, slots (logical), kv_len, mask=None): logits, captured
    residual streams and each request's rows."""
    dev = pool.dev
    MP = max(len(r["pages"]) for r in reqs) + 1
    table = torch.zeros(len(reqs), MP, dtype=torch.int32)
    cu, cols, rows = [0], {k: [] for k in ("ids", "pos", "slots", "mask")}, []
    for b, r in enumerate(reqs):
        table[b, :len(r["pages"])] = torch.tensor(r["pages"], dtype=torch.int32)
        cu.append(cu[-1] + len(r["ids"]))
        rows.append(list(range(cu[-2], cu[-1])))
        cols["ids"] += r["ids"]
        cols["pos"] += r["pos"]
        cols["slots"] += [pool.slot(r["pages"], s) for s in r["slots"]]
        cols["mask"] += r.get("mask") or [0] * len(r["ids"])
    tree = any(r.get("mask") for r in reqs)
    meta = AttentionMeta(torch.tensor(cu, dtype=torch.int32, device=dev),
                         torch.tensor([r["kv_len"] for r in reqs], dtype=torch.int32, device=dev), table.to(dev),
                         torch.tensor(cols["slots"], device=dev), max(len(r["ids"]) for r in reqs),
                         torch.tensor(cols["mask"], dtype=torch.int64, device=dev) if tree else None)
    out = model(torch.tensor(cols["ids"], device=dev), torch.tensor(cols["pos"], device=dev), meta, pool.k, pool.v,
                capture_layers=capture)
    return model.logits(out.hidden), out.captured, rows


def _token_ways(model, n, chunk_from, batches, trees, PS=4, n_pages=160, seed=1):
    """Token n - 1 of a random sequence computed as: the last row of one prefill chunk of all n tokens (the
    reference), the last row of a chunk from ``chunk_from``, a decode row of batches (B, our row) of other
    requests' decode rows, and the deepest path node of trees (T, path, B, our row) in batches of trees
    (path d holds token n - len(path) + d; the other nodes sit between and after its ancestors).
    Returns {way: (logits, captured, K, V)} and the reference's."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    toks = torch.randint(0, V, (n,), generator=g).tolist()
    p = n - 1

    def rand_ids(k):
        return torch.randint(0, V, (k,), generator=g).tolist()

    ref_pool = Pool(model, n_pages, PS, seed=0)
    ref_pages = ref_pool.pages(n)
    lg, cap, _ = forward(model, ref_pool, [dict(pages=ref_pages, ids=toks, pos=list(range(n)), slots=list(range(n)),
                                                kv_len=n)])
    ref = (lg[p], cap[p], *ref_pool.kv(ref_pages, p))
    ways = {}
    pool = Pool(model, n_pages, PS, seed=1)
    pages = pool.pages(n)
    pool.copy_(ref_pool, ref_pages, pages, chunk_from)
    lg, cap, _ = forward(model, pool, [dict(pages=pages, ids=toks[chunk_from:], pos=list(range(chunk_from, n)),
                                            slots=list(range(chunk_from, n)), kv_len=n)])
    ways[f"prefill chunk {chunk_from}..{p}"] = (lg[-1], cap[-1], *pool.kv(pages, p))
    for B, me in batches:
        pool = Pool(model, n_pages, PS, seed=2 + B)
        reqs = []
        for b in range(B):
            m = n if b == me else int(torch.randint(2, n + 40, (1,), generator=g))
            pg = pool.pages(m)
            if b == me:
                pool.copy_(ref_pool, ref_pages, pg, p)
                mine = pg
            reqs.append(dict(pages=pg, ids=toks[p:] if b == me else rand_ids(1), pos=[m - 1], slots=[m - 1], kv_len=m))
        lg, cap, rows = forward(model, pool, reqs)
        r = rows[me][0]
        ways[f"decode, row {me} of {B}"] = (lg[r], cap[r], *pool.kv(mine, p))
    for T, path, B, me in trees:
        L0 = n - len(path)
        masks = _ancestors(_tree_with_path(T, path, g))
        depth = [bin(m).count("1") - 1 for m in masks]
        pool = Pool(model, n_pages, PS, seed=20 + T + B)
        reqs = []
        for b in range(B):
            pg = pool.pages(L0 + T)
            tt = rand_ids(T)
            if b == me:
                pool.copy_(ref_pool, ref_pages, pg, L0)
                for d, node in enumerate(path):
                    tt[node] = toks[L0 + d]
                mine = pg
            reqs.append(dict(pages=pg, ids=tt, pos=[L0 + d for d in depth], slots=[L0 + i for i in range(T)],
                             kv_len=L0 + T, mask=masks))
        lg, cap, rows = forward(model, pool, reqs)
        r = rows[me][path[-1]]
        ways[f"tree of {T}, node {path[-1]} at depth {len(path) - 1}, request {me} of {B}"] = (
            lg[r], cap[r], *pool.kv(mine, L0 + path[-1]))
    return ways, ref


def assert_same_bits(ways, ref):
    bad = [f"{way}: {name} differs by {(a.float() - b.float()).abs().max():.2e}"
           for way, got in ways.items() for name, a, b in zip(("logits", "captured", "K", "V"), got, ref)
           if not torch.equal(a, b)]
    assert not bad, "\n".join(bad)


@BITS
@cpu_only
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_model_token_bits_independent_of_how_it_is_computed(family, kernel_options):
    """A token's logits, captured residual streams and K / V in every layer: torch.equal between a prefill
    chunk, a second chunk, decode steps in batches of 1 / 3 / 7 and a tree node alone and in a batch, with
    exact on (the Triton kernels under the interpreter, fp32)."""
    over = {} if family == "llama" else dict(model_type="qwen3_moe", qk_norm=True, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=(1,))
    kernel_options.set_(exact=True)
    model = TransformerModel.random(ModelConfig(**{**TINY, **over}), dtype="float32", seed=0, backend="triton")
    ways, ref = _token_ways(model, n=29, chunk_from=9, batches=((1, 0), (3, 1), (7, 5)),
                            trees=((12, [0, 2, 3, 6, 8, 9, 11], 1, 0), (12, [0, 2, 3, 6, 8, 9, 11], 3, 2)))
    assert len(ways) == 6
    assert_same_bits(ways, ref)


# ------------------------------------------------------------------------------------------------
# The engine end to end (CPU interpreter, fp32)
# ------------------------------------------------------------------------------------------------


class Counted:
    """Counts the calls of kernels_triton functions on the engine's path (monkeypatched wrappers)."""

    def __init__(self, monkeypatch):
        from kernels_triton import linear as lin

        self.calls = {"exact_gemm": 0, "exact_attention": 0, "fused": 0}
        for key, mod, name in (("exact_gemm", linear_exact, "linear_exact"),
                               ("exact_attention", attention_exact, "paged_attention_exact"),
                               ("fused", lin, "norm_qkv_rope_write_kv_")):
            monkeypatch.setattr(mod, name, self.wrap(key, getattr(mod, name)))

    def wrap(self, key, fn):
        def wrapper(*a, **kw):
            self.calls[key] += 1
            return fn(*a, **kw)
        return wrapper


@cpu_only
def test_engine_plain_greedy_alone_equals_batched_in_exact_mode(kernel_options, monkeypatch):
    """Plain greedy decoding one request at a time and all at once (other batches, other prefill chunks)
    gives the reference's tokens with exact on, the target running only the exact GEMM and attention."""
    from test_engine import reference, tiny_model
    from test_spec import repetitive_prompts, run_engine

    counted = Counted(monkeypatch)
    kernel_options.set_(exact=True)
    model = tiny_model(layers=2, backend="triton")
    prompts = repetitive_prompts(2, seed=4)
    want = [reference(tiny_model(layers=2), p, 6) for p in prompts]
    alone = [run_engine(model, [p], 6)[0][0] for p in prompts]
    together, _ = run_engine(model, prompts, 6)
    assert alone == together == want
    assert counted.calls["exact_gemm"] > 0 and counted.calls["exact_attention"] > 0 and counted.calls["fused"] == 0


@cpu_only
@pytest.mark.parametrize("exact", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["exact", "default"])
def test_engine_speculative_greedy_identity_in_both_modes(exact, kernel_options, monkeypatch):
    """n-gram chains and EAGLE-3 trees (k switching on and off) give plain greedy's tokens with exact on and
    off; the EAGLE-3 head runs its default fused kernels in both (a draft need not be exact)."""
    from test_engine import reference, tiny_model
    from test_spec import repetitive_prompts, run_engine, tiny_head

    from specdec.spec import Eagle3Drafter, NgramDrafter

    counted = Counted(monkeypatch)
    kernel_options.set_(exact=exact)
    model = tiny_model(layers=2, backend="triton")
    prompts = repetitive_prompts(2, seed=4)
    want = [reference(tiny_model(layers=2), p, 6) for p in prompts]
    ngram, engine = run_engine(model, prompts, 6, drafter=NgramDrafter(), ks=(3,), k_of_step=lambda i: 3)
    assert ngram == want and max(engine.accepted) >= 1
    drafter = Eagle3Drafter(tiny_head(model), model, topk=2, steps=2, num_draft_tokens=4)
    eagle, _ = run_engine(model, prompts, 6, drafter=drafter, ks=(4,), k_of_step=lambda i: 4 if i % 3 else 0)
    assert eagle == want
    assert counted.calls["fused"] > 0 and (counted.calls["exact_attention"] > 0) == exact


@cpu_only
def test_engine_speculative_greedy_identity_with_preemption_in_exact_mode(kernel_options):
    """EAGLE-3 trees switching on and off in a KV pool too small for the batch: preempted requests are
    recomputed as prefill chunks of other lengths, and every output is still plain greedy's."""
    from test_engine import rand_prompts, reference, tiny_model
    from test_spec import tiny_head

    from specdec.engine.engine import Engine, EngineConfig
    from specdec.spec import Eagle3Drafter

    kernel_options.set_(exact=True)
    model = tiny_model(layers=2, backend="triton")
    prompts = rand_prompts([3, 14, 7, 22, 9, 5], seed=7)
    want = [reference(tiny_model(layers=2), p, 12) for p in prompts]
    drafter = Eagle3Drafter(tiny_head(model), model, topk=2, steps=2, num_draft_tokens=4)
    engine = Engine(model, EngineConfig(max_batch_size=6, page_size=4, kv_cache_tokens=64, prefill_chunk=8),
                    drafter=drafter, ks=(4,))
    reqs = [engine.add_request(p, 12) for p in prompts]
    i = 0
    while engine.has_work():
        engine.step(4 if i % 3 else 0)
        engine.check()
        i += 1
    assert engine.scheduler.num_preemptions > 0, "pool too large: the test must force preemption"
    assert [r.output_ids for r in reqs] == want


# ------------------------------------------------------------------------------------------------
# On the GPU (bf16)
# ------------------------------------------------------------------------------------------------

LLAMA8B_2L = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, head_dim=128, rope_theta=500000.0,
                  max_position_embeddings=8192)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_llama8b_shape_bf16_token_bits_independent_of_how_it_is_computed(kernel_options):
    """Llama-3.1-8B widths (2 of its 32 layers, random weights), bf16, exact on, graphless: token 699's logits,
    captured residual streams and K / V are torch.equal between a prefill chunk, a decode step in batches of
    1, 7 and 64 rows, and the deepest node of a 16- and a 48-node tree, alone and in a batch of 4 trees. Its
    prefix spans two attention splits (512 keys each)."""
    kernel_options.set_(exact=True)
    model = TransformerModel.random(ModelConfig(**LLAMA8B_2L), device="cuda", dtype="bfloat16", seed=0)
    path16 = [0, 1, 4, 5, 9, 12, 15]  # depth 6
    path48 = [0, 2, 3, 7, 11, 12, 18, 25, 26, 33, 40, 41, 47]  # depth 12
    ways, ref = _token_ways(model, n=700, chunk_from=300, PS=16, n_pages=4096,
                            batches=((1, 0), (7, 3), (64, 41)),
                            trees=((16, path16, 1, 0), (48, path48, 1, 0), (16, path16, 4, 1), (48, path48, 4, 3)))
    assert_same_bits(ways, ref)


SMOLLM2_PROMPTS = (
    "Write a Python function that returns the sum of a list of numbers.",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about speculative decoding.",
    "from typing import List\n\ndef running_max(xs: List[int]) -> List[int]:\n",
    "List three prime numbers greater than 100 and say why each is prime.",
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat",
    "Write a SQL query that counts the orders per customer in a table orders(id, customer_id).",
)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_smollm2_bf16_speculative_greedy_equals_plain_in_exact_mode(smollm2_path, smollm2_tokenizer, kernel_options):
    """SmolLM2 in bf16 with CUDA graphs, exact on: plain greedy at batch 1 is the reference; plain greedy with
    16 requests in flight (24 requests, so batches and their padding keep changing), the committed EAGLE-3
    head's tree16 and n-gram chains, each at batch 1 and at 16 in flight, give the same tokens bit for bit."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from specdec.engine.engine import Engine, EngineConfig
    from specdec.models.llama import LlamaModel
    from specdec.policy import Always
    from specdec.spec import NgramDrafter, build_drafter

    ckpt = Path(__file__).resolve().parents[1] / "checkpoints" / "eagle3-smollm2-135m"
    if not (ckpt / "config.json").exists():
        pytest.skip(f"the committed EAGLE-3 head is not staged at {ckpt}")
    kernel_options.set_(exact=True)
    model = LlamaModel.from_pretrained(smollm2_path, device="cuda", dtype="bfloat16", backend="auto")
    prompts = [smollm2_tokenizer.encode_chat([{"role": "user", "content": c}]) for c in SMOLLM2_PROMPTS]
    max_new = 64

    def serve(requests, max_batch, drafter=None, policy=None):
        cfg = EngineConfig(max_batch_size=max_batch, kv_cache_tokens=16384, graph_buckets=(1, 4, 16),
                           prefill_buckets=(), prefill_fit=False)
        engine = Engine(model, cfg, eos_ids=[2], drafter=drafter, policy=policy)
        reqs = [engine.add_request(p, max_new) for p in requests]
        engine.run_until_done()
        return [r.output_ids for r in reqs]

    want = serve(prompts, 1)
    loaded = prompts * 3
    got = {"plain, 16 in flight": serve(loaded, 16)}
    eagle = OmegaConf.create({"name": "eagle3", "path": str(ckpt), "topk": 4, "steps": 5, "num_draft_tokens": 16})
    for B, requests in ((1, prompts), (16, loaded)):
        drafter = build_drafter(eagle, model, device=model.device, dtype=torch.bfloat16, backend=model.backend)
        got[f"EAGLE-3 tree16, {B} in flight"] = serve(requests, B, drafter, Always(16))
        got[f"n-gram, {B} in flight"] = serve(requests, B, NgramDrafter(), Always(4))
    for name, outs in got.items():
        expect = want * (len(outs) // len(want))
        diff = [i for i, (a, b) in enumerate(zip(outs, expect)) if a != b]
        assert not diff, f"{name}: {len(diff)} of {len(outs)} outputs differ from plain greedy at batch 1 ({diff})"


# ------------------------------------------------------------------------------------------------
# The report pairs each exact run with its default twin
# ------------------------------------------------------------------------------------------------


def test_report_pairs_exact_runs_with_their_default_twins(tmp_path):
    """experiment=exact_cost's report: per method and C, default and exact tok/s, their ratio, speed-ups, and
    how many outputs equal plain greedy at C = 1 of the same mode (here the default EAGLE-3 runs differ on
    one request, the exact ones on none); config engine.exact is what pairs them."""
    import json

    from test_report import _edit_config, make_run, table

    from specdec import report

    outs = {"a": [1, 2, 3], "b": [4, 5], "c": [6]}
    n = 0
    for C in (1, 16):
        for method in ("plain", "eagle3"):
            for exact in (False, True):
                spec = method == "eagle3"
                tok = (100.0 if C == 1 else 900.0) * (2.5 if spec else 1.0) * (0.9 if exact else 1.0)
                path = make_run(tmp_path / "exact_cost" / str(n), tok_s=tok, draft=method if spec else "none",
                                policy="always" if spec else "never", concurrency=C, k=16)
                n += 1
                _edit_config(path, engine={"exact": exact, "max_batch_size": C})
                ids = ["a", "b", "c"] + (["a#1", "b#1"] if C == 16 else [])
                with open(path / "requests.jsonl", "w") as f:
                    for i in ids:
                        wrong = spec and not exact and i == "b#1"  # a default-mode near-tie flipped under load
                        f.write(json.dumps({"id": i, "output_ids": [9] if wrong else outs[i.split("#")[0]]}) + "\n")
    md, _ = report.build_report(report.load_runs([tmp_path / "exact_cost"]), tmp_path / "out")
    rows = table(md, "Exact mode: cost against the default kernels")
    assert len(rows) == 1 + 4  # plain and EAGLE-3 at C = 1 and 16
    assert set(map(float, report_col(rows, "exact / default"))) == {0.9}
    assert report_col(rows, "runs") == ["1 + 1"] * 4
    same_default, same_exact = report_col(rows, "= plain C=1, default"), report_col(rows, "= plain C=1, exact")
    assert sorted(same_exact) == ["-", "3/3", "5/5", "5/5"] and sorted(same_default) == ["-", "3/3", "4/5", "5/5"]
    assert report_col(rows, "speed-up exact").count("2.50×") == 2  # each mode over its own plain run


def report_col(rows, header):
    return [r[rows[0].index(header)] for r in rows[1:]]
