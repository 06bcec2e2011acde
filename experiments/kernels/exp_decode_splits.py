"""EXPERIMENT (run at 311924a; results/kernels/exp_decode_splits_311924a.txt): decode (T=1) at mid
batch and long prefixes with 2x and 4x the default split count (default merge choice).

Answer (H200, bf16): the default is fastest at every shape; e.g. 9q/3kv B=8 prefix 16384 32.8 us
(73% of copy) vs 38.8 / 44.5 us with 32 / 64 splits, 32q/8kv B=16 prefix 4096 71.2 vs 76.9 / 84.9
us. The B=8 d64 decode gap to 75% is not a split-count problem.

Run (H200, ~20 s): python experiments/kernels/exp_decode_splits.py
"""
import sys
from pathlib import Path
import torch
REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments" / "kernels")]
from bench_attention import Pool, n_pools, time_rotating
import kernels_triton.attention as attn
import kernels_triton.attention_launch as launch
from specdec.bench.timing import copy_bandwidth_gbps
copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f}")
for heads in ((9, 3, 64), (32, 8, 128)):
    HQ, HKV, D = heads
    for B in (8, 16, 32):
        for prefix in (4096, 16384):
            T = 1
            kvb = B * (prefix + T) * HKV * D * 4
            pools = [Pool(B, prefix, heads, torch.bfloat16, T, seed=i) for i in range(n_pools(kvb))]
            bs = [p.batch(T, seed=1) for p in pools]
            cfg = launch.launch_config(T, HQ // HKV, D, torch.bfloat16)
            cap = bs[0]["page_table"].shape[1] * 16
            d, _ = launch.default_split_count(B, HKV, D, 1, cap, cfg, bs[0]["q"].device, torch.bfloat16)
            line = f"{HQ}q/{HKV}kv B={B:2d} p={prefix:5d} default={d}"
            for s in sorted({d, min(64, 2 * d), min(64, 4 * d)}):
                for fused in (None,):
                    us = time_rotating([lambda b=b: attn.paged_attention(**b, max_q_len=T, num_splits=s) for b in bs])
                    line += f" | sp{s} {us:6.1f} ({100*kvb/(us*1e-6)/1e9/copy:3.0f}%)"
            print(line, flush=True)
            del pools, bs; torch.cuda.empty_cache()
