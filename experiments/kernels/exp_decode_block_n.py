"""EXPERIMENT (run at 7f65cf4; results/kernels/exp_decode_block_n_7f65cf4.txt): decode and short-chain
tiles (BLOCK_M <= 32) with BLOCK_N = 64 (d128; 128 at d64) instead of launch_config's 32 (d128; 64 at
d64), in isolation (rotating timing, page table as wide as prefix + T, so the split count follows).

Answer (H200, bf16): not as a default. Decode slows at most shapes (32q/8kv B=1 prefix 512: 9.2 ->
13.8 us; B=64 prefix 4096: 248.9 -> 319.0 us); only T=8 chains at B=64 gain (prefix 4096: 380.1 ->
352.6 us). In the graphed Llama-3.1-8B batch-1 step, where the page table is 4096 slots wide, the
same change measured 4.293 vs 4.306 / 4.312 ms (exp_decode_block_n_step.py, same run): too small
and too shape-dependent to adopt.

Run (H200, ~1 min): python experiments/kernels/exp_decode_block_n.py
"""
import os, sys, contextlib
from pathlib import Path
import torch
REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments" / "kernels")]
from bench_attention import Pool, n_pools, time_rotating
import kernels_triton.attention as attn
import kernels_triton.attention_launch as launch
from specdec.bench.timing import copy_bandwidth_gbps
orig = launch.launch_config
def patch(over):
    def lc(max_q_len, G, D, dtype=torch.bfloat16):
        c = orig(max_q_len, G, D, dtype)
        if c["BLOCK_M"] <= 32 and over:
            c.update(over)
        return c
    launch.launch_config = lc
copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f}")
V = [("base", None), ("BN64 st3", dict(BLOCK_N=64, num_stages=3)), ("BN64 st4", dict(BLOCK_N=64, num_stages=4)), ("base", None)]
for heads in ((32, 8, 128), (9, 3, 64)):
    HQ, HKV, D = heads
    for T in (1, 8) if D == 128 else (1,):
        for B in (1, 8, 64):
            for prefix in (512, 1024, 4096, 16384):
                if D == 64 and prefix < 4096: continue
                kvb = B * (prefix + T) * HKV * D * 4
                pools = [Pool(B, prefix, heads, torch.bfloat16, T, seed=i) for i in range(n_pools(kvb))]
                bs = [p.batch(T, seed=1) for p in pools]
                line = f"{HQ}q/{HKV}kv T={T} B={B:2d} p={prefix:5d}"
                ref = attn.paged_attention(**bs[0], max_q_len=T).float()
                for label, over in V:
                    if D == 64 and over: over = dict(over, BLOCK_N=128)
                    patch(over)
                    err = (attn.paged_attention(**bs[0], max_q_len=T).float() - ref).abs().max().item()
                    us = time_rotating([lambda b=b: attn.paged_attention(**b, max_q_len=T) for b in bs])
                    line += f" | {label} {us:6.1f} ({100*kvb/(us*1e-6)/1e9/copy:3.0f}%){' ERR' if err > 0.02 else ''}"
                launch.launch_config = orig
                print(line, flush=True)
                del pools, bs; torch.cuda.empty_cache()
