"""Fused MoE layer against its loop-over-experts reference (kernels_triton/moe.py).

CPU (interpreter), fp32 and fp16: odd shapes (1, 3, 17, 64 tokens; 300 in the slow selection), 8 / 16 /
128 experts, top-1 / 2 / 8, renormalised or not, hidden and intermediate sizes no tile divides, experts
that receive no token; outputs and scratch buffers NaN-poisoned (conftest ``poison``), so an unwritten
row or a read of an unwritten one fails. expert_hits against a bincount of the reference ids.
GPU (``-m gpu``): bf16 at the Qwen3-30B-A3B layer shape, and the layer captured in a CUDA graph and
replayed with other routings.
"""

import pytest
import torch
import triton

from kernels_triton import moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}


def _layer(T, H, F, E, dtype, seed, device=DEVICE):
    """Random x [T, H], router [E, H], w13 [E, 2F, H], w2 [E, H, F] scaled so every stage is O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: a real-shape layer is 600M values

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    return r(T, H), r(E, H, scale=H ** -0.5), r(E, 2 * F, H, scale=H ** -0.5), r(E, H, F, scale=F ** -0.5)


def _bincount(ids, E):
    return torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)


def _ref_ids(x, router_w, top_k):
    return moe.moe_route_ref(x.float() @ router_w.float().t(), top_k, False)[1]


# (T, H, F, E, top_k, renormalize): every token count with every expert count and top-k at least once;
# H and F of 40 / 24 / 48 leave partial K and N tiles.
CASES = [
    (1, 32, 16, 8, 2, True), (1, 40, 24, 16, 8, False), (1, 32, 16, 128, 8, True),
    (3, 40, 24, 8, 1, False), (3, 64, 48, 16, 8, True), (3, 32, 16, 128, 2, False),
    (17, 64, 48, 8, 2, True), (17, 40, 24, 16, 1, True), (17, 32, 16, 128, 8, False),
    (64, 48, 32, 8, 8, False), (64, 32, 16, 16, 2, True), (64, 32, 16, 128, 8, True),
]


@pytest.mark.parametrize("T,H,F,E,top_k,renormalize", CASES)
def test_fused_moe_matches_ref(T, H, F, E, top_k, renormalize, poison):
    x, rw, w13, w2 = _layer(T, H, F, E, torch.float32, seed=T * 131 + E + top_k)
    hits = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    out = moe.fused_moe(x, rw, w13, w2, top_k, renormalize, expert_hits=hits)
    assert out.shape == (T, H) and out.dtype == x.dtype
    torch.testing.assert_close(out, moe.fused_moe_ref(x, rw, w13, w2, top_k, renormalize), atol=2e-5, rtol=2e-5)
    assert torch.equal(hits, _bincount(_ref_ids(x, rw, top_k), E))


@pytest.mark.parametrize("T,E,top_k", [(5, 8, 2), (40, 16, 8)])
def test_fused_moe_fp16(T, E, top_k, poison):
    H, F = 48, 40
    x, rw, w13, w2 = _layer(T, H, F, E, torch.float16, seed=T + E)
    out = moe.fused_moe(x, rw, w13, w2, top_k, True)
    torch.testing.assert_close(out, moe.fused_moe_ref(x, rw, w13, w2, top_k, True), atol=3e-3, rtol=3e-3)


@pytest.mark.slow
@pytest.mark.parametrize("E,top_k", [(128, 8), (16, 2)])
def test_fused_moe_300_tokens(E, top_k, poison):
    """300 tokens: several routing blocks, so the grouping runs as its own sort launch."""
    T, H, F = 300, 32, 16
    x, rw, w13, w2 = _layer(T, H, F, E, torch.float32, seed=E)
    hits = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    out = moe.fused_moe(x, rw, w13, w2, top_k, True, expert_hits=hits)
    torch.testing.assert_close(out, moe.fused_moe_ref(x, rw, w13, w2, top_k, True), atol=2e-5, rtol=2e-5)
    assert torch.equal(hits, _bincount(_ref_ids(x, rw, top_k), E))


def test_fused_moe_several_route_blocks(poison):
    """More tokens than one routing block holds (128 experts: 64 rows a block): the sort launch, fast."""
    T, H, F, E, top_k = 70, 32, 16, 128, 2
    x, rw, w13, w2 = _layer(T, H, F, E, torch.float32, seed=70)
    assert moe.moe_plan(T, E, top_k, H, F)["route_rows"] < T
    hits = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    out = moe.fused_moe(x, rw, w13, w2, top_k, False, expert_hits=hits)
    torch.testing.assert_close(out, moe.fused_moe_ref(x, rw, w13, w2, top_k, False), atol=2e-5, rtol=2e-5)
    assert torch.equal(hits, _bincount(_ref_ids(x, rw, top_k), E))


def test_experts_without_tokens(poison):
    """A router that never picks experts 3..7 (their logits ~ -100): those experts get no block, the others
    several (up to 17 pairs each: two 16-row blocks), and expert_hits keeps adding over calls."""
    T, H, F, E, top_k = 17, 32, 24, 8, 2
    x, rw, w13, w2 = _layer(T, H, F, E, torch.float32, seed=3)
    x[:, 0] = 5.0
    rw[3:, 0] = -20.0
    hits = torch.full((E,), 7, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        out = moe.fused_moe(x, rw, w13, w2, top_k, True, expert_hits=hits)
    counts = _bincount(_ref_ids(x, rw, top_k), E)
    assert counts[3:].sum() == 0 and counts[:3].sum() == T * top_k
    assert torch.equal(hits, 7 + 2 * counts)
    torch.testing.assert_close(out, moe.fused_moe_ref(x, rw, w13, w2, top_k, True), atol=2e-5, rtol=2e-5)


def test_fused_moe_deterministic():
    x, rw, w13, w2 = _layer(17, 32, 16, 16, torch.float32, seed=5)
    assert torch.equal(moe.fused_moe(x, rw, w13, w2, 8, True), moe.fused_moe(x, rw, w13, w2, 8, True))


@pytest.mark.parametrize("T", [1, 3, 17, 64, 130])
@pytest.mark.parametrize("E,top_k", [(8, 1), (8, 2), (16, 8), (128, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_moe_route_matches_ref(T, E, top_k, renormalize, poison):
    g = torch.Generator().manual_seed(T * 7 + E)
    logits = (torch.randn(T, E, generator=g) * 2).to(DEVICE)
    w, ids = moe.moe_route(logits, top_k, renormalize)
    w_ref, ids_ref = moe.moe_route_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (T, top_k)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


# (T, H, F, E, top_k, residual): the fused routing with H split over programs (H = 512: 4 splits of 128 at
# 8 experts), without a split, one routing block of 64 rows, and past the fused sizes (65 rows of 128
# experts: two routing blocks; 300 rows: the combine kernel too).
NORM_CASES = [
    (1, 512, 16, 8, 2, True), (1, 40, 24, 16, 8, False), (3, 256, 32, 16, 4, True), (17, 64, 48, 128, 8, True),
    (64, 32, 16, 32, 8, False), (65, 32, 16, 128, 8, True), (300, 48, 16, 16, 4, True),
]


@pytest.mark.parametrize("T,H,F,E,top_k,with_residual", NORM_CASES)
def test_fused_moe_norm_matches_ref(T, H, F, E, top_k, with_residual, poison):
    x, rw, w13, w2 = _layer(T, H, F, E, torch.float32, seed=T * 7 + H + E)
    g = torch.Generator(device=DEVICE).manual_seed(T)
    residual = torch.randn(T, H, generator=g, device=DEVICE) if with_residual else None
    nw = torch.rand(H, generator=g, device=DEVICE) + 0.5
    hits = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    out, s = moe.fused_moe_norm(x, residual, nw, 1e-6, rw, w13, w2, top_k, True, expert_hits=hits)
    ref, ref_s = moe.fused_moe_norm_ref(x, residual, nw, 1e-6, rw, w13, w2, top_k, True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(s, ref_s)
    y = ref_s.float() * torch.rsqrt(ref_s.float().pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    assert torch.equal(hits, _bincount(_ref_ids(y, rw, top_k), E))
    out2, _ = moe.fused_moe_norm(x, residual, nw, 1e-6, rw, w13, w2, top_k, True)  # counters were reset
    assert torch.equal(out, out2)


@pytest.mark.parametrize("T,E,top_k,norm", [(1, 16, 4, True), (17, 128, 8, False), (70, 16, 2, True)])
def test_steered_routing_raises_the_selected_logits(T, E, top_k, norm, poison):
    """steer = (sel, margin): each row's sel experts get margin added to their logits in the router kernel
    (the fused routing at 1 and 17 tokens, the router + top-k kernels at 70), so with a large margin the
    selection is what routes, weighted by the router's own logits; the output equals the reference's."""
    H, F = 32, 16
    x, rw, w13, w2 = _layer(T, H, F, E, torch.float32, seed=T + E)
    g = torch.Generator(device=DEVICE).manual_seed(T)
    sel = torch.rand(T, E, generator=g, device=DEVICE).argsort(-1)[:, :top_k].to(torch.int32).contiguous()
    steer = (sel, 50.0)
    hits = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    if norm:
        nw = torch.rand(H, generator=g, device=DEVICE) + 0.5
        out, _ = moe.fused_moe_norm(x, None, nw, 1e-6, rw, w13, w2, top_k, True, expert_hits=hits, steer=steer)
        ref, _ = moe.fused_moe_norm_ref(x, None, nw, 1e-6, rw, w13, w2, top_k, True, steer=steer)
    else:
        out = moe.fused_moe(x, rw, w13, w2, top_k, True, expert_hits=hits, steer=steer)
        ref = moe.fused_moe_ref(x, rw, w13, w2, top_k, True, steer=steer)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(hits, _bincount(sel, E))  # every row routed to its selection
    with pytest.raises(ValueError, match="steer's selection"):
        moe.fused_moe(x, rw, w13, w2, top_k, True, steer=(sel.long(), 50.0))


def test_fused_plan_sizes(kernel_options):
    """Fused routing at one routing block up to 64 rows (not in exact mode, nor with kernel option fused_moe
    off), H split to about 64 programs; the combine in the down kernel up to 1,024 pairs."""
    plan = moe.moe_plan(1, 128, 8, 2048, 768, exact=False)
    assert plan["fused_route"] == dict(BLOCK_T=16, BLOCK_E=16, BLOCK_K=128, SPLIT=8) and plan["combine_in_down"]
    assert moe.moe_plan(64, 128, 8, 2048, 768, exact=False)["fused_route"]["SPLIT"] == 2
    assert moe.moe_plan(65, 128, 8, 2048, 768, exact=False)["fused_route"] is None
    assert not moe.moe_plan(129, 128, 8, 2048, 768, exact=False)["combine_in_down"]
    exact = moe.moe_plan(1, 128, 8, 2048, 768, exact=True)
    assert exact["fused_route"] is None and not exact["combine_in_down"]
    with kernel_options.use(fused_moe=False):
        off = moe.moe_plan(1, 128, 8, 2048, 768, exact=False)
    assert off["fused_route"] is None and not off["combine_in_down"]


def test_moe_route_half_logits():
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    w, ids = moe.moe_route(logits, 4, True)
    w_ref, ids_ref = moe.moe_route_ref(logits, 4, True)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


def test_max_blocks_bounds_every_routing():
    """The grid's worst case covers adversarial routings: one expert, all experts, uneven counts."""
    gen = torch.Generator().manual_seed(0)
    for P, E, bm in [(8, 128, 16), (17, 8, 16), (2048, 128, 32), (8192, 128, 64), (5, 2, 16)]:
        routings = [torch.tensor([P] + [0] * (E - 1)), torch.bincount(torch.arange(P) % E, minlength=E)]
        routings += [torch.bincount(torch.randint(0, E, (P,), generator=gen), minlength=E) for _ in range(20)]
        spill = torch.zeros(E, dtype=torch.int64)  # as many experts as fit get bm + 1 pairs (two blocks each)
        n = min(E, P // (bm + 1))
        spill[:n] = bm + 1
        spill[0] += P - int(spill.sum())
        routings.append(spill)
        for counts in routings:
            assert int(((counts + bm - 1) // bm).sum()) <= moe._max_blocks(P, E, bm), (P, E, bm, counts)


def test_plan_depends_on_shapes_only():
    plan = moe.moe_plan(1, 128, 8, 2048, 768)
    assert plan["gate_up"]["BLOCK_M"] == 16 and plan["route_rows"] == 1
    assert moe.moe_plan(1024, 128, 8, 2048, 768)["gate_up"]["BLOCK_M"] == 64
    small = moe.moe_plan(3, 8, 2, 40, 24, config={"down": {"BLOCK_N": 256}})
    assert small["down"]["BLOCK_N"] == 64  # an override, clamped to the dim
    assert small["gate_up"]["BLOCK_N"] == 16  # the plan's, narrowed: 6 experts x 1 column tile < MIN_PROGRAMS
    mixtral = moe.moe_plan(1, 8, 2, 4096, 14336)  # 2 experts: the down projection's H in tiles of 32
    assert 2 * triton.cdiv(4096, mixtral["down"]["BLOCK_N"]) >= moe.MIN_PROGRAMS
    with pytest.raises(ValueError, match="config"):
        moe.moe_plan(1, 8, 2, 32, 16, config={"gate_up": {"BLOCK_X": 16}})


def test_bad_inputs_are_named():
    x, rw, w13, w2 = _layer(2, 32, 16, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="w13"):
        moe.fused_moe(x, rw, w13[:, :-1], w2, 2, True)
    with pytest.raises(ValueError, match="w2"):
        moe.fused_moe(x, rw, w13, w2.transpose(1, 2), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        moe.fused_moe(x, rw, w13, w2, 9, True)
    with pytest.raises(ValueError, match="expert_hits"):
        moe.fused_moe(x, rw, w13, w2, 2, True, expert_hits=torch.zeros(8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="router_w"):
        moe.fused_moe(x, rw.half(), w13, w2, 2, True)


def test_zero_tokens():
    x, rw, w13, w2 = _layer(0, 32, 16, 8, torch.float32, seed=0)
    assert moe.fused_moe(x, rw, w13, w2, 2, True).shape == (0, 32)


# ----------------------------------------------------------------------------------------------
# GPU: bf16 at the Qwen3-30B-A3B layer shape, CUDA graphs
# ----------------------------------------------------------------------------------------------

QWEN3_MOE = dict(H=2048, F=768, E=128, top_k=8)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _unambiguous_rows(x, rw, top_k, margin=1e-5):
    """Tokens whose k-th and (k+1)-th router probabilities differ by more than ``margin``: on those the
    kernel's routing (another fp32 summation order for the logits) must pick the reference's experts."""
    p = torch.softmax(x.float() @ rw.float().t(), dim=-1).topk(top_k + 1, dim=-1).values
    return (p[:, top_k - 1] - p[:, top_k]) > margin


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 17, 64, 256])
def test_fused_moe_bf16_qwen3_30b_a3b_shape(T):
    H, F, E, top_k = QWEN3_MOE.values()
    x, rw, w13, w2 = _layer(T, H, F, E, torch.bfloat16, seed=T)
    hits = torch.zeros(E, dtype=torch.int32, device="cuda")
    out = moe.fused_moe(x, rw, w13, w2, top_k, True, expert_hits=hits)
    ref = moe.fused_moe_ref(x, rw, w13, w2, top_k, True)
    rows = _unambiguous_rows(x, rw, top_k)
    assert rows.float().mean() > 0.9
    torch.testing.assert_close(out[rows], ref[rows], atol=3e-2, rtol=3e-2)
    assert int(hits.sum()) == T * top_k


@pytest.mark.gpu
@needs_cuda
def test_fused_moe_cuda_graph_replays_other_routings():
    """Captured once at 17 tokens, replayed with inputs that route elsewhere: outputs follow the new
    routing and expert_hits counts every replay."""
    H, F, E, top_k = QWEN3_MOE.values()
    T = 17
    x, rw, w13, w2 = _layer(T, H, F, E, torch.bfloat16, seed=1)
    static_x = x.clone()
    hits = torch.zeros(E, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        moe.fused_moe(static_x, rw, w13, w2, top_k, True, expert_hits=hits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe.fused_moe(static_x, rw, w13, w2, top_k, True, expert_hits=hits)
    hits.zero_()
    want = torch.zeros(E, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(3):
        new_x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        ref = moe.fused_moe_ref(new_x, rw, w13, w2, top_k, True)
        rows = _unambiguous_rows(new_x, rw, top_k)
        torch.testing.assert_close(static_out[rows], ref[rows], atol=3e-2, rtol=3e-2)
        want += _bincount(_ref_ids(new_x, rw, top_k), E)
    assert int(hits.sum()) == 3 * T * top_k
    assert (hits - want).abs().sum() <= 2 * top_k  # equal up to a near-tie routing


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 17, 64])
def test_fused_moe_norm_bf16_graph_replays(T, kernel_options):
    """The fused routing and combine (arrival counters) at the Qwen3-30B-A3B shape in bf16, captured in a
    CUDA graph and replayed with other inputs: each replay equals an eager call, the reference and the
    six-launch path (kernel option fused_moe off)."""
    H, F, E, top_k = QWEN3_MOE.values()
    x, rw, w13, w2 = _layer(T, H, F, E, torch.bfloat16, seed=T + 5)
    g = torch.Generator(device="cuda").manual_seed(T)
    res = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
    nw = (torch.rand(H, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    sx, sr = x.clone(), res.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe.fused_moe_norm(sx, sr, nw, 1e-6, rw, w13, w2, top_k, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_s = moe.fused_moe_norm(sx, sr, nw, 1e-6, rw, w13, w2, top_k, True)
    for _ in range(3):
        sx.copy_(torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16))
        graph.replay()
        eager, eager_s = moe.fused_moe_norm(sx, sr, nw, 1e-6, rw, w13, w2, top_k, True)
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager) and torch.equal(static_s, eager_s)
        ref, ref_s = moe.fused_moe_norm_ref(sx, sr, nw, 1e-6, rw, w13, w2, top_k, True)
        assert torch.equal(static_s, ref_s)
        y = ref_s.float() * torch.rsqrt(ref_s.float().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()
        rows = _unambiguous_rows(y, rw, top_k)
        torch.testing.assert_close(static_out[rows], ref[rows], atol=3e-2, rtol=3e-2)
        with kernel_options.use(fused_moe=False):
            six, six_s = moe.fused_moe_norm(sx, sr, nw, 1e-6, rw, w13, w2, top_k, True)
        assert torch.equal(six_s, static_s)
        torch.testing.assert_close(static_out[rows], six[rows], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("T", [3, 300])  # one routing block (the top-k program sorts), several (the sort kernel)
def test_every_launch_takes_programmatic_dependent_launch_with_the_option(monkeypatch, kernel_options, T):
    """Under PDL (forced here: the CPU interpreter has none) every kernel of the layer is launched with it
    and compiled to wait for its predecessor; without it (kernel option pdl off, or no such device) none is."""
    from kernels_triton.attention_launch import PDL_LATE

    seen = []

    class Recorder:  # stands in for a kernel: records the launch's PDL arguments, computes nothing
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((self.name, kw["USE_PDL"], kw.get("launch_pdl", False)))

    names = ("route_fused", "router", "topk", "sort", "gate_up", "down", "combine")
    for n in names:
        monkeypatch.setattr(moe, f"_moe_{n}_kernel", Recorder(n))
    E, K, H, F = 128, 8, 32, 16  # 128 experts: 64 routing rows a block, so T = 300 takes the sort kernel
    x, router_w = torch.randn(T, H), torch.randn(E, H)
    w13, w2 = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    for mode, want in ((PDL_LATE, True), (0, False)):
        seen.clear()
        monkeypatch.setattr(moe, "pdl_mode", lambda device, mode=mode: mode)
        moe.fused_moe(x, router_w, w13, w2, K, True)
        launched = [n for n, _, _ in seen]
        fused = ("route_fused", "gate_up", "down")  # decode / verify: routing in one launch, the combine in down
        assert launched == (list(fused) if T == 3 else [n for n in names if n != "route_fused"])
        if T == 3:  # kernel option fused_moe off: the six-launch path (one routing block: no sort kernel)
            seen.clear()
            with kernel_options.use(fused_moe=False):
                moe.fused_moe(x, router_w, w13, w2, K, True)
            assert [n for n, _, _ in seen] == ["router", "topk", "gate_up", "down", "combine"]
        assert T < 300 or T > moe.moe_plan(T, E, K, H, F)["route_rows"]
        assert all(use == want and lp == want for _, use, lp in seen)
