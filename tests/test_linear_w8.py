"""Weight-only int8 projections (kernels_triton/linear_w8.py, ops.W8, draft.weight_dtype=int8).

The kernel against its torch reference on random inputs (fp32 / fp16 on the CPU, bf16 on the GPU;
odd shapes no block divides; split-K and not; outputs NaN-poisoned), the quantizer's error bound,
the row routing of ops.mm, an int8 EAGLE-3 head against the same head with dequantized weights, and
speculative decoding with it greedy-identical to the target.
"""

import pytest
import torch
from test_engine import rand_prompts, reference, tiny_model

from kernels_triton import linear_w8 as w8
from specdec.errors import ConfigError
from specdec.models import ops
from specdec.models.eagle3 import Eagle3Config, Eagle3Head

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
BF16 = [torch.bfloat16] if DEVICE == "cuda" else []


def with_dtypes(cases, gpu_cases=()):
    """Parameters: every case (a tuple) in fp32 and fp16, and the ``gpu_cases`` also in bf16 on a GPU (the
    ``-m gpu`` selection compiles every case's kernel variants, so it keeps a representative few)."""
    return [(*c, dt) for c in cases for dt in DTYPES] + [(*c, dt) for c in gpu_cases for dt in BF16]
TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


@pytest.fixture
def poison(monkeypatch):
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))


def test_quantize_error_bound_and_zero_rows():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 53, generator=gen) * torch.rand(37, 1, generator=gen) * 3
    w[5] = 0.0
    q, scale = w8.quantize(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.abs().max() <= w8.QMAX
    err = (w8.dequantize(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()  # round to nearest: at most half a step per row
    assert scale[5] == 1.0 and (q[5] == 0).all()
    # every row uses its full range: the largest |w| maps to +-127
    assert (q.abs().amax(dim=1)[torch.arange(37) != 5] == w8.QMAX).all()


SMALL = dict(BLOCK_N=16, BLOCK_K=128, num_stages=2)  # other tiles than the default's


W8_CASES = [
    (1, 2100, 64, None), (4, 96, 160, None), (4, 96, 160, {"split": 3}), (5, 40, 300, {"split": 2}),
    (8, 70, 512, None), (4, 96, 160, SMALL), (4, 70, 512, SMALL | {"split": 2}),
    (9, 50, 520, None), (17, 300, 72, None), (33, 50, 520, {"split": 4}),
    (3, 70, 512, None), (3, 70, 768, {"split": 2}), (12, 70, 768, {"split": 2}),  # K a multiple of BLOCK_K
    (4, 150, 512, {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3}),  # the wide projections' tiles
]


@pytest.mark.parametrize("M,NOUT,K,config,dtype", with_dtypes(W8_CASES, [W8_CASES[1], W8_CASES[3], W8_CASES[13]]))
def test_linear_w8_matches_reference(dtype, M, NOUT, K, config, poison):
    gen = torch.Generator().manual_seed(M * 1000 + K)
    w = torch.randn(NOUT, K, generator=gen) / K**0.5
    q, scale = (t.to(DEVICE) for t in w8.quantize(w))
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    add = torch.randn(M, NOUT, generator=gen).to(DEVICE, dtype)
    atol, rtol = TOL[dtype]
    for a in (None, add):
        y = w8.linear_w8(x, q, scale, a, config=config)
        assert y.dtype == dtype and y.shape == (M, NOUT)
        torch.testing.assert_close(y.float(), w8.linear_w8_ref(x, q, scale, a).float(), atol=atol, rtol=rtol)


def test_launch_config_splits_narrow_projections(monkeypatch):
    # 8B-shape head on a 132-SM device: 4096 / 6144 wide -> two K splits; 28672 / 32000 wide -> 64-row blocks,
    # whole K; a 576-wide one (SmolLM2) -> split until the SMs have work, >= 4 chunks a split; up to 16 rows
    # one warp per 16 weight rows of a 32-row block (each weight element converted once)
    monkeypatch.setattr(w8, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    c = w8.launch_config(4, 4096, 14336, dev)
    assert (c["split"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]) == (2, 32, 256, 2)
    c = w8.launch_config(16, 32000, 4096, dev)
    assert (c["split"], c["BLOCK_N"], c["num_warps"], c["num_stages"]) == (1, 64, 2, 3)
    assert w8.launch_config(4, 4096, 2048, dev)["split"] == 1  # short K: whole
    assert w8.launch_config(4, 576, 1152, dev)["split"] == 1  # 1152 / (4 x 256) -> 1 chunk group
    assert w8.launch_config(4, 576, 4608, dev)["split"] == 3  # 36 blocks: 132 // 36
    c = w8.launch_config(40, 4096, 14336, dev)
    assert (c["split"], c["num_warps"]) == (1, 4)  # 64-row tiles: whole K, 4 warps


def test_linear_w8_rejects_bad_inputs():
    q, scale = w8.quantize(torch.randn(8, 16))
    with pytest.raises(ValueError, match="at most 64 rows"):
        w8.linear_w8(torch.randn(65, 16), q, scale)
    with pytest.raises(ValueError, match="share K"):
        w8.linear_w8(torch.randn(2, 15), q, scale)
    with pytest.raises(ValueError, match="int8"):
        w8.linear_w8(torch.randn(2, 16), q.float(), scale)
    with pytest.raises(ValueError, match="add must be"):
        w8.linear_w8(torch.randn(2, 16), q, scale, torch.randn(3, 8))


def test_mm_routes_few_rows_to_int8_and_more_to_the_dense_weight():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(24, 40, generator=gen)
    wq = ops.W8.of(w)
    deq = w8.dequantize(wq.q, wq.scale)
    for rows, want_w in ((ops.W8_MAX_ROWS, deq), (ops.W8_MAX_ROWS + 1, w)):
        x = torch.randn(rows, 40, generator=gen)
        torch.testing.assert_close(ops.mm(x, wq, backend="torch"), x @ want_w.t(), atol=1e-4, rtol=1e-5)
    x = torch.randn(3, 40, generator=gen)
    assert not ops._fused("triton", x, wq) and not ops.sums_squares("triton", x, wq)


def _head(target, seed=3, draft_vocab=40):
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab, target_layers=(0, 1, 1)),
                      backend="torch").init_weights_(seed)
    head.set_vocab_(torch.arange(0, 2 * draft_vocab, 2))
    return head.to_device("cpu", torch.float32)


PROJ = ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_int8_head_equals_the_head_with_dequantized_weights(backend):
    """weight_dtype int8: fc, layer and logits over few rows equal the same head whose projection
    weights are replaced by their int8 round trip (so they differ from the original head), and over
    more than ops.W8_MAX_ROWS rows the original head's (the dense weights)."""
    from specdec.models.ops import AttentionMeta

    target = tiny_model(layers=2)
    head = _head(target).set_weight_dtype_("int8")
    head.backend = backend
    deq = _head(target)
    with torch.no_grad():
        for key in PROJ:  # per-row quantization of q, k, v separately equals that of their concatenation
            deq.w(key).copy_(w8.dequantize(*w8.quantize(deq.w(key))))
    plain = _head(target)
    H, PS = head.config.hidden_size, 4
    gen = torch.Generator().manual_seed(1)
    for T, want_head in ((7, deq), (ops.W8_MAX_ROWS + 3, plain)):
        emb, hidden = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
        feats = torch.randn(T, 3 * H, generator=gen)
        pages = -(-T // PS)
        meta = AttentionMeta(cu_q_lens=torch.tensor([0, T], dtype=torch.int32),
                             kv_lens=torch.tensor([T], dtype=torch.int32),
                             page_table=torch.arange(pages, dtype=torch.int32)[None].flip(1).contiguous(),
                             slot_mapping=torch.tensor([(pages - 1 - i // PS) * PS + i % PS for i in range(T)]),
                             max_q_len=T)
        got, want = [], []
        for h, out in ((head, got), (want_head, want)):
            kc, vc = h.new_kv_cache(pages, PS)
            o, logits = h(emb, h.fuse(feats), torch.arange(T), meta, kc, vc)
            out += [h.fuse(feats), o, logits, kc]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=2e-4, rtol=2e-4)
    # the int8 head is not the original one at few rows
    assert not torch.allclose(head.fuse(feats[:3]), plain.fuse(feats[:3]), atol=1e-4)


def test_weight_dtype_is_checked_and_reaches_the_random_head():
    from omegaconf import OmegaConf

    from specdec.spec import build_drafter

    target = tiny_model(layers=2)
    with pytest.raises(ConfigError, match="draft.weight_dtype='fp4'"):
        _head(target).set_weight_dtype_("fp4")
    cfg = OmegaConf.create({"name": "eagle3", "random": True, "draft_vocab_size": "auto", "target_layers": None,
                            "logit_std": 12.0, "trees": [{"topk": 2, "steps": 2, "num_draft_tokens": 3}],
                            "weight_dtype": "int8"})
    drafter = build_drafter(cfg, target, device="cpu", dtype=torch.float32, backend="torch")
    assert drafter.head.weight_dtype == "int8" and isinstance(drafter.head.proj("lm_head.weight"), ops.W8)
    # auto: int8 only for a wide head on a GPU (8B shapes); the tiny head on the CPU keeps its own dtype
    auto = build_drafter(OmegaConf.merge(cfg, {"weight_dtype": "auto"}), target, device="cpu", dtype=torch.float32,
                         backend="torch")
    assert auto.head.weight_dtype == "model" and not isinstance(auto.head.proj("lm_head.weight"), ops.W8)


def test_weight_dtype_auto_resolves_by_width_and_device():
    from specdec.models.eagle3 import AUTO_INT8_HIDDEN, resolve_weight_dtype

    assert resolve_weight_dtype("auto", 4096, "cuda") == "int8"  # Llama-3.1-8B shape on a GPU
    assert resolve_weight_dtype("auto", AUTO_INT8_HIDDEN, "cuda") == "int8"
    assert resolve_weight_dtype("auto", 576, "cuda") == "model"  # SmolLM2: int8 measured slower
    assert resolve_weight_dtype("auto", 4096, "cpu") == "model"
    assert resolve_weight_dtype("model", 4096, "cuda") == "model" and resolve_weight_dtype("int8", 64, "cpu") == "int8"
    with pytest.raises(ConfigError, match="weight_dtype='bf8'"):
        resolve_weight_dtype("bf8", 4096, "cuda")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_speculative_decoding_with_an_int8_head_is_greedy_identical(backend):
    from specdec.engine.engine import Engine, EngineConfig
    from specdec.spec import Eagle3Drafter

    target = tiny_model(layers=2, backend=backend)
    head = _head(target, seed=5).set_weight_dtype_("int8")
    head.backend = backend
    prompts = rand_prompts([9, 14, 5], seed=4)
    engine = Engine(target, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=512),
                    drafter=Eagle3Drafter(head, target, topk=2, steps=3, num_draft_tokens=5), ks=(5,))
    reqs = [engine.add_request(p, 12) for p in prompts]
    while engine.has_work():
        engine.step(5)
    assert [r.output_ids for r in reqs] == [reference(target, p, 12) for p in prompts]
