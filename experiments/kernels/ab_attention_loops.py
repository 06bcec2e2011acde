"""A/B: paged_attention with one loop over all KV tiles vs an unmasked then a masked loop.

Question: which loop structure is faster, per launch shape, so that default_one_loop in
kernels_triton/attention.py can pick from static shapes? Both are timed in the same run, twice each
(best kept), with bench_attention's inputs and rotating timing (a CUDA graph of back-to-back calls
over >= 256 MB of distinct KV), at the default split count. Prints one line per shape:
config, B, prefix, T, BLOCK_M, splits, tiles of capacity per split, one-loop us, two-loop us, the
faster, and two-loop / one-loop.

Run (H200, ~80 s):  python experiments/kernels/ab_attention_loops.py | tee OUT.txt
      python experiments/kernels/ab_attention_loops.py --quick   (two tiny shapes; CPU smoke run
      under TRITON_INTERPRET=1 when there is no GPU, timings meaningless)
Result: experiments/results/kernels/ab_attention_loops_eb3d046.txt (NVIDIA H200, 2026-11-30,
commit eb3d046).
"""

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first @triton.jit
import triton  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments" / "kernels")]
from bench_attention import Pool, n_pools, time_rotating  # noqa: E402

import kernels_triton.attention as attn  # noqa: E402
import kernels_triton.attention_launch as launch  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--quick", action="store_true", help="two tiny shapes (CPU smoke run)")
args_cli = ap.parse_args()
CUDA = torch.cuda.is_available()
if not CUDA and not args_cli.quick:
    sys.exit("ab_attention_loops.py times CUDA kernels: no GPU here (--quick runs a CPU smoke test)")
dev = torch.device("cuda" if CUDA else "cpu")
dtype = torch.bfloat16 if CUDA else torch.float32
if args_cli.quick:
    shapes = [((9, 3, 64), 1, 2, 40), ((9, 3, 64), 16, 2, 100)]  # (heads, T, B, prefix)
else:
    shapes = [(h, T, B, p) for h in ((9, 3, 64), (32, 8, 128)) for T in (1, 8, 16, 64) for B in (1, 8, 64)
              for p in (512, 4096, 16384) if not (B == 64 and p == 16384 and T == 64)]
print("config B prefix T BLOCK_M splits tiles/split one two", flush=True)
for heads, T, B, p in shapes:
    HQ, HKV, D = heads
    kvb = B * (p + T) * HKV * D * 4
    pools = [Pool(B, p, heads, dtype, T, seed=i) for i in range(n_pools(kvb))]
    args = [pp.batch(T, seed=1) for pp in pools]
    cfg = launch.launch_config(T, HQ // HKV, D, dtype)
    nq = triton.cdiv(T, cfg["BLOCK_T"])
    s = launch.default_num_splits(B, HKV, D, nq, pools[0].page_table.shape[1] * 16, cfg, dev)
    best = {}
    for ol in (True, False, True, False):
        us = time_rotating([lambda a=a: attn.paged_attention(**a, max_q_len=T, one_loop=ol) for a in args])
        best[ol] = min(best.get(ol, float("inf")), us)
    tiles = triton.cdiv(triton.cdiv(p + T, cfg["BLOCK_N"]), s)
    faster = "ONE" if best[True] < best[False] else "two"
    print(f"{HQ}q/{HKV}kv {B} {p} {T} {cfg['BLOCK_M']} {s} {tiles} {best[True]:.2f} {best[False]:.2f} {faster} "
          f"{best[False] / best[True]:.3f}", flush=True)
    del pools, args
    if CUDA:
        torch.cuda.empty_cache()
