"""Tensor parallelism on one GPU: the fused all-reduce + norm kernel's world-size-1 path, alone (bf16)
and inside the graphed step (fp32, so the graphed engines differ only in where the norm is fused:
greedy tokens must be identical). The multi-GPU paths are measured by experiments/bench_tp.py."""

import pytest
import torch

import tp_workers as w

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("H", [576, 4096, 8192])
@pytest.mark.parametrize("N", [1, 8, 64, 256])
def test_fused_norm_allreduce_ws1_matches_norm_bf16(N, H):
    from kernels_triton.fused_norm_allreduce import fused_norm_allreduce, fused_norm_allreduce_ref
    from kernels_triton.norm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(N + H)
    x = torch.randn(N, H, device="cuda", generator=gen).bfloat16()
    r = torch.randn(N, H, device="cuda", generator=gen).bfloat16()
    wt = (1 + 0.1 * torch.randn(H, device="cuda", generator=gen)).bfloat16()
    out, s = fused_norm_allreduce(x, r, wt, 1e-5)
    want_out, want_s = rms_norm(x, wt, 1e-5, r)
    assert torch.equal(s, want_s)
    torch.testing.assert_close(out, want_out, atol=1e-2, rtol=1e-2)
    ref_out, ref_s = fused_norm_allreduce_ref(x[None], r, wt, 1e-5)
    torch.testing.assert_close(out, ref_out, atol=1e-2, rtol=1e-2)


def test_fused_ws1_graphed_step_token_identical():
    """Engine over TPLlamaModel(world size 1, tp.allreduce=fused) with CUDA graphs: the same greedy
    tokens as the plain model's graphed engine (plain decode and EAGLE-3 with a random head)."""
    from specdec.dist import TPGroup
    from specdec.engine.engine import Engine, EngineConfig
    from specdec.models.tp import TPLlamaModel

    full = w.tiny_llama().to("cuda").init_rope()
    full.backend = "auto"
    reqs = [(p, 12) for p in w.prompts(5, seed=4, repeat=True)]
    fused = TPLlamaModel(full, TPGroup(rank=0, size=1, device=torch.device("cuda")), allreduce="fused")
    outs = {}
    for name, model in (("plain", full), ("fused", fused)):
        for kind in (None, "eagle3"):
            drafter, ks = w._drafter(kind, model)
            engine = Engine(model, EngineConfig(max_batch_size=8, page_size=16, kv_cache_tokens=4096, cuda_graphs=True),
                            drafter=drafter, ks=ks)
            assert engine.graphed
            hs = [engine.add_request(p, n) for p, n in reqs]
            i = 0
            while engine.has_work():
                engine.step(ks[-1] if i % 2 else 0)
                i += 1
            outs[name, kind] = [h.output_ids for h in hs]
    assert outs["fused", None] == outs["plain", None]
    assert outs["fused", "eagle3"] == outs["plain", "eagle3"] == outs["plain", None]
