"""EXPERIMENT (run at 1aebf23; results/kernels/exp_tree_occupancy_1aebf23.txt): can split-KV tree
launches run 3 programs per SM and beat one split?

Answer (H200, bf16): not at the tree headline (one split 23.5 us; 2 splits with the fused merge
folding one partial per step and a 168-register cap 25.2 us, vs 33.7 us uncapped and 42.4 us with
the merge kernel), nor at B=88 or at 32q/8kv B=64 prefix 1024; yes at long prefixes: 9q/3kv B=64
prefix 4096 61.2 us vs 70.7 us (78.5% vs 68.0% of copy). That became the tree-tile occupancy plan
(attention_launch.occupancy_splits), swept wider in exp_tree_splits.py.

Question: the tree tile (BLOCK_M = 64, 9q/3kv d64) uses 168 registers per thread without split-KV
(3 programs per SM on sm_90) but 203 with the merge kernel and 230-244 with the fused merge (2 per
SM), so a second split (384 programs at B=64) runs in 1.5 waves: 33.6 us vs 23.6 us for one split at
the tree headline (B=64, prefix 1024, T=16; H200 at 9aa95c6). With a register cap of 168
(`paged_attention(maxnreg=168)`, the fused merge folding one partial per step: `merge_chunk=1`)
ptxas fits them without spills (24 bytes with the fused merge), so 2 splits would be one wave of
~3 programs per SM with ~8 tiles each. Why more programs per SM should help: one program's tile loop
is a dependent chain (QK wgmma, wait, softmax, PV wgmma, wait), ~440 SASS instructions per tile per
warp (34 MUFU.EX2, 64 FMUL, 50 IMAD; sm_90 ptxas at 40d85ed), and measured at ~1.2 us per tile with
one program per SM (B=44) vs ~0.75 us with two (B=88) and ~0.67 us with three (B=132). This times split counts x merge kind x register cap x loop
structure at the headline and nearby shapes, beside the default launch, in one run.

Timing: bench_attention's rotating timing (a CUDA graph of back-to-back calls over >= 256 MB of
distinct KV); %copy against the copy bandwidth measured in the same run; max |diff| against the
default launch's output.

Run (H200, ~2-3 min):  python experiments/kernels/exp_tree_occupancy.py | tee OUT.txt
      python experiments/kernels/exp_tree_occupancy.py --quick   (CPU smoke run, timings meaningless)
"""

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first @triton.jit

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments" / "kernels")]
from bench_attention import Pool, n_pools, time_rotating  # noqa: E402

import kernels_triton.attention as attn  # noqa: E402
from specdec.bench.timing import copy_bandwidth_gbps  # noqa: E402

VARIANTS = [  # (label, paged_attention kwargs)
    ("default", {}),
    ("1 split, two loops", dict(num_splits=1, one_loop=False)),
    ("1 split, one loop", dict(num_splits=1, one_loop=True)),
    ("2 splits, merge kernel", dict(num_splits=2, fused_merge=False)),
    ("2 splits, merge kernel, maxnreg 168", dict(num_splits=2, fused_merge=False, maxnreg=168)),
    ("2 splits, fused", dict(num_splits=2, fused_merge=True)),
    ("2 splits, fused chunk 1, maxnreg 168", dict(num_splits=2, fused_merge=True, merge_chunk=1, maxnreg=168)),
    ("2 splits, fused chunk 1, maxnreg 168, one loop",
     dict(num_splits=2, fused_merge=True, merge_chunk=1, maxnreg=168, one_loop=True)),
    ("4 splits, fused chunk 1, maxnreg 168", dict(num_splits=4, fused_merge=True, merge_chunk=1, maxnreg=168)),
    ("4 splits, merge kernel, maxnreg 168", dict(num_splits=4, fused_merge=False, maxnreg=168)),
]
SHAPES = [  # (heads, B, prefix, T)
    ((9, 3, 64), 64, 1024, 16),  # the tree headline of the kernels issue
    ((9, 3, 64), 88, 1024, 16),
    ((9, 3, 64), 64, 4096, 16),
    ((9, 3, 64), 8, 4096, 16),
    ((32, 8, 128), 64, 1024, 16),
    ((32, 8, 128), 8, 4096, 16),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one tiny shape, three variants (CPU smoke run)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        sys.exit("exp_tree_occupancy.py times CUDA kernels: no GPU here (--quick runs a CPU smoke test)")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes, variants = SHAPES, VARIANTS
    if args.quick:
        shapes, variants = [((9, 3, 64), 2, 100, 16)], VARIANTS[:1] + VARIANTS[5:7]
    copy = copy_bandwidth_gbps() if cuda else float("nan")
    print(f"copy bandwidth {copy:.0f} GB/s")
    for heads, B, prefix, T in shapes:
        HQ, HKV, D = heads
        kv_bytes = B * (prefix + T) * HKV * D * 2 * (2 if dtype != torch.float32 else 4)
        pools = [Pool(B, prefix, heads, dtype, T, seed=i) for i in range(n_pools(kv_bytes))]
        batches = [p.batch(T, seed=1) for p in pools]
        ref = attn.paged_attention(**batches[0], max_q_len=T).float()
        print(f"\n{HQ}q/{HKV}kv d{D} B={B} prefix={prefix} T={T} ({kv_bytes / 2**20:.0f} MB of KV)")
        for label, kw in variants:
            try:
                err = (attn.paged_attention(**batches[0], max_q_len=T, **kw).float() - ref).abs().max().item()
                us = time_rotating([lambda b=b: attn.paged_attention(**b, max_q_len=T, **kw) for b in batches])
            except Exception as e:  # e.g. out of resources
                print(f"  {label:48s} {type(e).__name__}: {str(e)[:80]}")
                continue
            pct = 100 * kv_bytes / (us * 1e-6) / 1e9 / copy
            print(f"  {label:48s} {us:8.2f} us {pct:5.1f}% copy  max|diff| {err:.3g}", flush=True)
        del pools, batches
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
