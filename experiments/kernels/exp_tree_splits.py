"""EXPERIMENT: the tree-tile occupancy plan (kernels_triton/attention_launch.py occupancy_splits) vs the
split counts around it, for tree verification (T=16) over a grid of batch sizes and prefixes.

Question: one tree program (BLOCK_M = 64) walks its KV tiles as a dependent chain and is bound by
that chain, not by DRAM (the ablation at the end: the tree headline with every K/V read hitting L2
vs from DRAM). Does splitting the KV range until ~3 programs per SM (d64, with a 168-register cap and
the fused merge folding one partial per step; 2 per SM at d128) beat filling the SMs once (the
split count default_num_splits gives, used by the tree tile before the plan)?

Columns (us, % of the copy bandwidth measured in the same run): "default" (the plan where it
applies), "fill once" (default_num_splits' count with its default merge: the previous default),
"1 split", and 2 / 4 / 8 splits under the plan's launch options. max |diff| against "default" is
checked (ERR marks a difference > 0.02).

Timing: bench_attention's rotating timing (a CUDA graph of back-to-back calls over >= 256 MB of
distinct KV).

Run (H200, ~1 min):  python experiments/kernels/exp_tree_splits.py | tee OUT.txt
      python experiments/kernels/exp_tree_splits.py --quick   (CPU smoke run, timings meaningless)
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
import kernels_triton.attention_launch as launch  # noqa: E402
from specdec.bench.timing import copy_bandwidth_gbps  # noqa: E402


def plan_kw(splits, D):
    kw = dict(num_splits=splits, fused_merge=True, merge_chunk=1)
    return kw | (dict(maxnreg=launch.TREE_MAXNREG) if D <= 64 else {})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one tiny shape (CPU smoke run)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        sys.exit("exp_tree_splits.py times CUDA kernels: no GPU here (--quick runs a CPU smoke test)")
    dtype = torch.bfloat16 if cuda else torch.float16
    T = 16
    shapes = [((9, 3, 64), B, p) for B in (16, 32, 64, 128) for p in (1024, 4096, 16384)]
    shapes += [((32, 8, 128), B, p) for B in (8, 16, 32, 64) for p in (1024, 4096, 16384)]
    if args.quick:
        shapes = [((9, 3, 64), 2, 100)]
    copy = copy_bandwidth_gbps() if cuda else float("nan")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 0
    print(f"copy bandwidth {copy:.0f} GB/s, {sms} SMs, T={T}")
    for (HQ, HKV, D), B, prefix in shapes:
        kv_bytes = B * (prefix + T) * HKV * D * 2 * dtype.itemsize
        pools = [Pool(B, prefix, (HQ, HKV, D), dtype, T, seed=i) for i in range(n_pools(kv_bytes))]
        batches = [p.batch(T, seed=1) for p in pools]
        cfg = launch.launch_config(T, HQ // HKV, D, dtype)
        cap = batches[0]["page_table"].shape[1] * pools[0].k_cache.shape[1]
        dev = batches[0]["q"].device
        fill = launch.default_num_splits(B, HKV, D, 1, cap, cfg, dev)
        plan = launch.occupancy_splits(B, HKV, D, 1, cap, cfg, dev, dtype)
        variants = [("default", {}), (f"fill once ({fill})", dict(num_splits=fill)), ("1 split", dict(num_splits=1))]
        variants += [(f"{s} splits", plan_kw(s, D)) for s in (2, 4, 8)]
        if args.quick:
            variants = variants[:2]
        ref = attn.paged_attention(**batches[0], max_q_len=T).float()
        line = f"{HQ}q/{HKV}kv d{D} B={B:3d} prefix={prefix:5d} plan={plan}:"
        for label, kw in variants:
            err = (attn.paged_attention(**batches[0], max_q_len=T, **kw).float() - ref).abs().max().item()
            us = time_rotating([lambda b=b: attn.paged_attention(**b, max_q_len=T, **kw) for b in batches])
            pct = 100 * kv_bytes / (us * 1e-6) / 1e9 / copy
            line += f" | {label} {us:.1f} ({pct:.0f}%){' ERR' if err > 0.02 else ''}"
        print(line, flush=True)
        del pools, batches
        if cuda:
            torch.cuda.empty_cache()

    # Ablation at the tree headline: the default launch with every page-table entry folded onto 8
    # pages (K/V reads then hit L2): what the tile loop costs without DRAM.
    B, prefix = (64, 1024) if not args.quick else (2, 100)
    pool = Pool(B, prefix, (9, 3, 64), dtype, T, seed=0)
    b = pool.batch(T, seed=1)
    for label, pt in (("from DRAM", b["page_table"]), ("8 pages (L2)", b["page_table"] % 8)):
        bb = dict(b, page_table=pt.contiguous())
        us = time_rotating([lambda: attn.paged_attention(**bb, max_q_len=T)] * 8)
        print(f"tree headline (9q/3kv d64 B={B} prefix={prefix} T={T}), K/V {label}: {us:.2f} us", flush=True)


if __name__ == "__main__":
    main()
