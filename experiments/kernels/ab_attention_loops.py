"""A/B: paged_attention with one loop over all KV tiles vs an unmasked then a masked loop.

Question: which loop structure is faster, per launch shape, so that _default_one_loop in
kernels_triton/attention.py can pick from static shapes? Both are timed in the same run, twice each
(best kept), with bench_attention's inputs and rotating timing (a CUDA graph of back-to-back calls
over >= 256 MB of distinct KV), at the default split count. Prints one line per shape:
config, B, prefix, T, BLOCK_M, splits, tiles of capacity per split, one-loop us, two-loop us, the
faster, and two-loop / one-loop.

Run (H200, ~80 s):  python experiments/kernels/ab_attention_loops.py | tee OUT.txt
Result: experiments/results/kernels/ab_attention_loops_eb3d046.txt (NVIDIA H200, 2026-11-30,
commit eb3d046).
"""

import sys
from pathlib import Path

import torch
import triton

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments" / "kernels")]
from bench_attention import Pool, n_pools, time_rotating  # noqa: E402

import kernels_triton.attention as attn  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("ab_attention_loops.py times CUDA kernels: no GPU here")
dev = torch.device("cuda")
print("config B prefix T BLOCK_M splits tiles/split one two", flush=True)
for heads in ((9, 3, 64), (32, 8, 128)):
    HQ, HKV, D = heads
    for T in (1, 8, 16, 64):
        for B in (1, 8, 64):
            for p in (512, 4096, 16384):
                if B == 64 and p == 16384 and T == 64: continue
                kvb = B * (p + T) * HKV * D * 4
                pools = [Pool(B, p, heads, torch.bfloat16, T, seed=i) for i in range(n_pools(kvb))]
                args = [pp.batch(T, seed=1) for pp in pools]
                cfg = attn._launch_config(T, HQ // HKV, D)
                nq = triton.cdiv(T, cfg["BLOCK_T"])
                s = attn._default_num_splits(B, HKV, D, nq, pools[0].page_table.shape[1] * 16, cfg, dev)
                r = {}
                for ol in (True, False, True, False):
                    us = time_rotating([lambda a=a: attn.paged_attention(**a, max_q_len=T, one_loop=ol) for a in args])
                    r[ol] = min(r.get(ol, 1e9), us)
                tiles = triton.cdiv(triton.cdiv(p + T, cfg["BLOCK_N"]), s)
                print(f"{HQ}q/{HKV}kv {B} {p} {T} {cfg['BLOCK_M']} {s} {tiles} {r[True]:.2f} {r[False]:.2f} {'ONE' if r[True] < r[False] else 'two'} {r[False]/r[True]:.3f}", flush=True)
                del pools, args
                torch.cuda.empty_cache()
