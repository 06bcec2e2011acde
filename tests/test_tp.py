"""Tensor parallelism on CPU: ranks spawned over gloo from the test (tests/tp_workers.py holds the rank
functions), and the fused all-reduce + residual + RMSNorm kernel under the Triton interpreter.

The invariants: a sharded forward computes the single-device logits (fp32, to rounding of the split
sums); greedy serving under TP (plain, n-gram, EAGLE-3; through preemption and an abort) is
token-identical to TP1, and so is seeded sampling; the ranks stay in lockstep (a follower whose engine
diverges stops with TPDesyncError, naming the state); sizes that do not fit the heads, more ranks than
GPUs and unknown all-reduce paths fail with errors naming them.
"""

import pytest
import torch

import tp_workers as w
from specdec.dist.launch import check_launch, launch
from specdec.errors import ConfigError
from specdec.models.families import ModelConfig
from specdec.models.tp import TPLlamaModel, check_tp_shapes

IDS = [1, 5, 7, 9, 11, 3, 2]
# Head layouts: Llama-style GQA at tp2 and tp4 (KV heads split; at tp4 each KV head replicated on 2
# ranks; a vocabulary of 90 pads to 92 at tp4), SmolLM2-135M's 9 query / 3 KV heads at tp3.
LAYOUTS = [(2, dict(heads=4, kv_heads=2)), (4, dict(heads=8, kv_heads=2, vocab=90, tied=False)),
           (3, dict(heads=9, kv_heads=3, head_dim=8))]


# The new families' blocks sharded: Qwen3's q/k norms (replicated, per local head), Qwen2's bias (with the
# heads), Qwen3-MoE's experts along their intermediate dimension (tp2: 16 of 32 columns each; tp4 with KV
# heads replicated: 8).
FAMILY_LAYOUTS = [(2, dict(family="qwen3", tied=False)), (2, dict(family="qwen2")), (2, dict(family="qwen3_moe")),
                  (4, dict(family="qwen3_moe", heads=8, kv_heads=2, tied=False))]


@pytest.mark.parametrize("size,shape", LAYOUTS + FAMILY_LAYOUTS,
                         ids=["llama-tp2", "llama-tp4", "smollm2-layout-tp3", "qwen3-tp2", "qwen2-tp2", "qwen3_moe-tp2",
                              "qwen3_moe-tp4"])
def test_tp_logits_equal_tp1(size, shape):
    got = launch(w.logits_rank, size, "cpu", shape, IDS)
    assert got["shape"] == (len(IDS), shape.get("vocab", w.VOCAB))
    # fp32: only the order of the sharded sums differs (logits are O(10)).
    assert got["max_diff"] < 1e-4 and got["cap_diff"] < 1e-5 and got["argmax_same"]


SCENARIOS = [dict(), dict(drafter_kind="ngram", k_cycle=(0, 4, 4)), dict(drafter_kind="eagle3", k_cycle=(0, 6)),
             dict(kv_tokens=48, aborts=((3, 1),)), dict(temperature=1.0, drafter_kind="ngram", k_cycle=(4,))]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_tp2_serving_token_identical_to_tp1(family):
    """One launch, five engines in turn: greedy plain, n-gram and EAGLE-3 (random head) switching k,
    a pool small enough to preempt plus an abort mid-run, and seeded sampling with speculation."""
    shape = dict(heads=4, kv_heads=2, family=family)
    reqs = [(p, 8) for p in w.prompts(4, seed=1, repeat=True)]
    want = [w.serve(w.tiny_llama(**shape), reqs, **kw) for kw in SCENARIOS]
    got = launch(w.serve_many_rank, 2, "cpu", shape, reqs, SCENARIOS)
    for kw, g, e in zip(SCENARIOS, got, want):
        assert g["out"] == e["out"] and g["reasons"] == e["reasons"], kw
    assert want[3]["preempted"] > 0 and got[3]["preempted"] == want[3]["preempted"]
    assert got[3]["reasons"][1] == "abort"


@pytest.mark.slow
def test_tp3_smollm2_layout_serving_identical():
    shape = dict(heads=9, kv_heads=3, head_dim=8)
    reqs = [(p, 8) for p in w.prompts(4, seed=2, repeat=True)]
    scen = SCENARIOS[:3]
    want = [w.serve(w.tiny_llama(**shape), reqs, **kw) for kw in scen]
    got = launch(w.serve_many_rank, 3, "cpu", shape, reqs, scen)
    assert [g["out"] for g in got] == [e["out"] for e in want]


def test_follower_out_of_step_is_detected():
    """A follower whose engine differs from rank 0's (a smaller KV pool) stops before the first step
    with TPDesyncError naming the state, instead of hanging in a mismatched collective."""
    with pytest.raises(RuntimeError, match="out of step with rank 0"):
        launch(w.desync_rank, 2, "cpu", dict(heads=4, kv_heads=2))


def test_tp_world_size_1_is_the_model():
    """TPLlamaModel at world size 1 (nccl path: no communication) computes the model's logits exactly."""
    from specdec.dist import TPGroup

    full = w.tiny_llama()
    want, _ = w.forward_logits(full, IDS)
    got, _ = w.forward_logits(TPLlamaModel(full, TPGroup(rank=0, size=1, device=torch.device("cpu"))), IDS)
    assert torch.equal(got, want)


def smollm2_like(**kw):
    base = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, vocab_size=49152, head_dim=64)
    return ModelConfig(**{**base, **kw})


def test_bad_tp_sizes_fail_cleanly():
    with pytest.raises(ConfigError, match=r"tp.size=2 .*9 query heads.*valid tp sizes.*: 1, 3$"):
        check_tp_shapes(smollm2_like(), 2, "SmolLM2")
    with pytest.raises(ConfigError, match=r"tp.size=4 .*FFN width 1534"):
        check_tp_shapes(smollm2_like(num_attention_heads=8, num_key_value_heads=8, intermediate_size=1534), 4)
    moe = dict(num_attention_heads=8, num_key_value_heads=8, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=100)
    with pytest.raises(ConfigError, match=r"tp.size=8 .*expert FFN width 100; valid tp sizes.*: 1, 2, 4$"):
        check_tp_shapes(smollm2_like(**moe, moe_layers=tuple(range(30))), 8)  # every layer MoE: F is not split
    with pytest.raises(ConfigError, match=r"tp.size=8 .*its FFN width 1540, its expert FFN width 100"):
        check_tp_shapes(smollm2_like(**moe, intermediate_size=1536 + 4, moe_layers=(1,)), 8)
    check_tp_shapes(smollm2_like(), 3)  # 3 query heads and one KV head per rank
    check_tp_shapes(smollm2_like(num_attention_heads=32, num_key_value_heads=8), 8)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ConfigError, match=r"tp.size=64 needs 64 GPUs"):
            check_launch(64, "cuda")
    with pytest.raises(ConfigError, match="tp.allreduce=fused needs CUDA"):
        from specdec.dist import TPGroup

        TPLlamaModel(w.tiny_llama(), TPGroup(0, 1, torch.device("cpu")), allreduce="fused")


def test_cli_bad_tp_fails_cleanly(tmp_path):
    from test_run import TINY_RANDOM, run_cli

    proc = run_cli(*TINY_RANDOM, "tp=tp8", "workload=synthetic", "logger=none", tmp_path=tmp_path)
    assert proc.returncode == 2 and "tp.size=8 does not fit" in proc.stderr and "valid tp sizes" in proc.stderr
    from hydra import compose, initialize_config_dir
    from test_run import CONF

    from specdec.run import run

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY_RANDOM, "tp=tp2", "tp.allreduce=ring", "logger=none",
                                           f"run_dir={tmp_path}/ring"])
    with pytest.raises(ConfigError, match="tp.allreduce='ring'; valid: nccl, fused"):
        run(cfg)


def test_cli_tp2_end_to_end(tmp_path):
    """specdec.run tp=tp2 (n-gram + policy always, compare_plain: two engines, and the profiled
    steps): rank 0 writes the run, every output equals plain decoding's and the TP1 run's."""
    import json

    from hydra import compose, initialize_config_dir
    from test_run import CONF, TINY_RANDOM

    from specdec.run import run

    outs = {}
    for tp in ("tp1", "tp2"):
        overrides = TINY_RANDOM + [
            "workload=synthetic", "workload.concurrency=2", "workload.sources.0.num_prompts=3",
            "workload.sources.0.prompt_len=12", "workload.sources.0.output_len=6", "engine.kv_cache_tokens=1024",
            "logger=none", "draft=ngram", "policy=always", "compare_plain=true", "engine.profile_steps=[1]",
            "engine.profile_steps_context=32", "engine.profile_steps_iters=2", f"run_dir={tmp_path}/{tp}", f"tp={tp}"]
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
        m = run(cfg)
        assert m["outputs_identical_to_plain"] == 1.0 and m["failed_requests"] == 0
        assert m["step_floor"]["step_ms"]["1"] > 0
        outs[tp] = [json.loads(line)["output_ids"] for line in (tmp_path / tp / "requests.jsonl").read_text().splitlines()]
    assert outs["tp2"] == outs["tp1"] and len(outs["tp1"]) == 3
    assert json.loads((tmp_path / "tp2" / "config.json").read_text())["tp"]["size"] == 2


@pytest.mark.slow
def test_cli_smollm2_tp3_real_prompts(tmp_path):
    """SmolLM2-135M at tp=tp3 on the quickstart's real prompts: the same tokens as tp=tp1."""
    import json

    from test_run import run_cli

    for tp in ("tp1", "tp3"):
        proc = run_cli(f"tp={tp}", "logger=none", "engine.max_new_tokens=8", tmp_path=tmp_path / tp)
        assert proc.returncode == 0, proc.stderr[-3000:]
    recs = {tp: [json.loads(line) for line in (tmp_path / tp / "run" / "requests.jsonl").read_text().splitlines()]
            for tp in ("tp1", "tp3")}
    assert [r["output_ids"] for r in recs["tp3"]] == [r["output_ids"] for r in recs["tp1"]]
    assert all(r["output"].strip() for r in recs["tp3"])


# -- the fused kernel (interpreter on CPU) ----------------------------------------------------------

def _inputs(W, N, H, dtype, seed=0, residual=True):
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(W, N, H, generator=g).to(dtype)
    res = torch.randn(N, H, generator=g).to(dtype) if residual else None
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    return parts, res, weight


@pytest.mark.parametrize("W,N,H", [(1, 5, 123), (2, 3, 64), (3, 17, 576), (4, 1, 100), (8, 2, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_norm_allreduce_peers_simulated(W, N, H, dtype):
    """The kernel's arithmetic (sum over W peers in fp32 + residual + RMSNorm), peers stacked in one
    process, against the reference; the sum alone against a plain fp32 sum."""
    from kernels_triton.fused_norm_allreduce import fused_norm_allreduce_ref, fused_norm_allreduce_stacked

    parts, res, weight = _inputs(W, N, H, dtype, seed=W * 100 + N)
    out, s = fused_norm_allreduce_stacked(parts, res, weight, 1e-5)
    ref_out, ref_s = fused_norm_allreduce_ref(parts, res, weight, 1e-5)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(s, ref_s, **tol)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(s.double(), (parts.double().sum(0) + res.double()), atol=1e-3 if dtype == torch.float16 else 1e-5,
                               rtol=1e-3)
    out2, s2 = fused_norm_allreduce_stacked(parts, None, weight, 1e-5)  # no residual: s = the reduced sum
    torch.testing.assert_close(out2, fused_norm_allreduce_ref(parts, None, weight, 1e-5)[0], **tol)


def test_fused_norm_allreduce_world_size_1_is_the_norm():
    """World size 1 (no communication) is exactly the fused residual add + RMSNorm of norm.py."""
    from kernels_triton.fused_norm_allreduce import fused_norm_allreduce
    from kernels_triton.norm import rms_norm

    parts, res, weight = _inputs(1, 7, 200, torch.float32)
    out, s = fused_norm_allreduce(parts[0], res, weight, 1e-6)
    want_out, want_s = rms_norm(parts[0], weight, 1e-6, res)
    assert torch.equal(out, want_out) and torch.equal(s, want_s)
    with pytest.raises(ValueError, match="residual must be like x"):
        fused_norm_allreduce(parts[0], res[:, :10], weight, 1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_fused_boundary_wiring_world_size_1(family):
    """The model's fused-boundary branch (kernel-normed input, norm-free projections or MoE layer, s carried
    as the residual) computes the model's logits; run on CPU through the kernel's world-size-1 path under
    the interpreter (the CUDA check is what keeps users off it on CPU, so the test sets the buffer itself)."""
    from kernels_triton.fused_norm_allreduce import SymmBuffer
    from specdec.dist import TPGroup

    full = w.tiny_llama(family=family)
    want, want_cap = w.forward_logits(full, IDS)
    model = TPLlamaModel(full, TPGroup(rank=0, size=1, device=torch.device("cpu")))
    model._symm = SymmBuffer(16, full.config.hidden_size, torch.float32, "cpu")
    got, got_cap = w.forward_logits(model, IDS)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got_cap, want_cap, atol=1e-5, rtol=1e-5)


def test_launch_under_torchrun_env(monkeypatch):
    """Under torchrun (its env vars set) launch joins the group in this process instead of spawning,
    and a tp.size other than the processes torchrun started is an error naming both."""
    from specdec.dist import current
    from specdec.dist.launch import _free_port

    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = launch(lambda group, x: (group.rank, group.size, group.backend, current() is group, x), 1, "cpu", 7)
    assert got == (0, 1, "gloo", True, 7) and current() is None
    with pytest.raises(ConfigError, match="tp.size=2 but torchrun started 1 processes"):
        launch(lambda group: None, 2, "cpu")


COMPILE_SYMM = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels_triton.fused_norm_allreduce import _fused_norm_allreduce_symm_kernel as kernel
sig = {"buf_ptrs": "*i64", "pad_ptrs": "*i64", "r_ptr": "*bf16", "w_ptr": "*bf16", "o_ptr": "*bf16", "s_ptr": "*bf16",
       "n_rows": "i32", "H": "i32", "stride_r": "i32", "stride_o": "i32", "stride_s": "i32", "eps": "fp32",
       "RANK": "constexpr", "WORLD": "constexpr", "PROGRAMS": "constexpr", "HAS_RESIDUAL": "constexpr",
       "ROWS": "constexpr", "BLOCK_H": "constexpr"}
const = dict(RANK=1, WORLD=4, PROGRAMS=32, HAS_RESIDUAL=True, ROWS=1, BLOCK_H=4096)
names = list(sig)
src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
print("release.sys.cas", ptx.count("atom.global.release.sys.cas"))
print("acquire.sys.cas", ptx.count("atom.global.acquire.sys.cas"))
print("multimem", ptx.count("multimem"))
'''


def test_symm_kernel_compiles_for_h100_class_gpus():
    """The one-shot kernel cannot run under the interpreter (it follows pointers loaded from memory),
    but it compiles here for sm_90: 3 peers x 2 barriers of system-scope signal CAS (release to send,
    acquire to wait) and no multimem / NVLink-multicast instruction anywhere."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", COMPILE_SYMM], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0 and "ptxas" in proc.stderr:
        pytest.skip("no ptxas for an sm_90 target in this Triton install")
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = dict(line.rsplit(" ", 1) for line in proc.stdout.strip().splitlines())
    assert int(counts["release.sys.cas"]) >= 6 and int(counts["acquire.sys.cas"]) >= 6
    assert counts["multimem"] == "0"
