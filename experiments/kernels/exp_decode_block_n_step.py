"""EXPERIMENT (run at 7f65cf4; results/kernels/exp_decode_block_n_step_7f65cf4.txt): the graphed
batch-1 step (Llama-3.1-8B shapes by default, random bf16 weights, context 512, 4096-slot page table)
under attention launch variants for the decode tile (BLOCK_M <= 32): BLOCK_N, stages, warps, and
forced split counts, each in a fresh engine (graph capture) in one process; the baseline runs first
and last to show drift. See exp_decode_block_n.py for the answer.

Run (H200, ~1 min): python experiments/kernels/exp_decode_block_n_step.py [llama8b|smollm2]
"""
import sys
from pathlib import Path
import torch
REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments")]
from profile_step import SMOLLM2  # noqa
from specdec.bench.targets import llama_config_from_dict, load_target_yaml
from specdec.models.llama import LlamaModel
from specdec.engine.engine import Engine, EngineConfig
import kernels_triton.attention_launch as launch
shape = sys.argv[1] if len(sys.argv) > 1 else "llama8b"
cfg = dict(load_target_yaml(REPO / "conf/target/llama31_8b_random.yaml")["config"]) if shape == "llama8b" else SMOLLM2
model = LlamaModel.random(llama_config_from_dict(cfg), device="cuda", dtype=torch.bfloat16, seed=0)
orig_lc, orig_ns = launch.launch_config, launch.default_num_splits

def variant(lc_over=None, splits=None):
    def lc(max_q_len, G, D, dtype=torch.bfloat16):
        c = orig_lc(max_q_len, G, D, dtype)
        if lc_over and c["BLOCK_M"] <= 32:
            c.update(lc_over)
        return c
    launch.launch_config = lc
    launch.default_num_splits = (lambda *a, **k: splits) if splits else orig_ns

V = [("base", None, None), ("BN64 st3", dict(BLOCK_N=64, num_stages=3), None), ("BN64 st4", dict(BLOCK_N=64, num_stages=4), None),
     ("BN16 st5", dict(BLOCK_N=16, num_stages=5), None), ("splits 16", None, 16), ("splits 8", None, 8),
     ("BN64 st3 splits 8", dict(BLOCK_N=64, num_stages=3), 8), ("w2", dict(num_warps=2), None), ("base", None, None)]
for label, over, sp in V:
    variant(over, sp)
    try:
        eng = Engine(model, EngineConfig(max_batch_size=1, graph_buckets=(1,), kv_cache_tokens=8192, max_seq_len=4096, page_size=16))
        ms = [eng.profile_decode_step(1, 512, iters=200) for _ in range(3)]
        print(f"{shape} {label:22s} step {min(ms):.4f} ms {[round(m, 4) for m in ms]}", flush=True)
        del eng
    except Exception as e:
        print(f"{shape} {label:22s} {type(e).__name__}: {str(e)[:100]}", flush=True)
    torch.cuda.empty_cache()
