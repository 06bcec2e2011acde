"""EXPERIMENT: tree verify attention at small batch in a wide page table: how many busy splits, and who
merges them.

Question: a batch-1 tree verify at Llama-3.1-8B heads (32q / 8kv, d128, T = 17: BLOCK_M = 128, one
query block) in the engine's page table (capacity 4096 slots) gets 16 splits from
default_num_splits and a merge kernel (rows x D = 128 x 128 is above FUSED_MERGE_MAX_TILE). At
context 256-1024 only the first 5-17 splits hold tiles, and the merge launch costs about half the
attention's time. Alternatives: fewer busy splits (min_busy_tiles: a busy split takes at least this
many of the request's tiles), the fused merge (the last busy split folds the partials; with one busy
split the split writes the output itself, no partial), one split.

Columns: us per call (rotating timing of bench_attention: a CUDA graph of back-to-back calls over
>= 256 MB of distinct KV); ERR marks a difference > 0.02 from the default.

Run (H200, ~1 min):  python experiments/kernels/exp_tree_short_splits.py | tee OUT.txt
      python experiments/kernels/exp_tree_short_splits.py --quick   (CPU smoke run, timings meaningless)
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
from bench_attention import PS, Pool, n_pools, time_rotating  # noqa: E402

import kernels_triton.attention as attn  # noqa: E402
import kernels_triton.attention_launch as launch  # noqa: E402

CAPACITY = 4096  # the engine's page-table width in slots (max_seq_len of conf/engine)


def widen(batch, capacity):
    """The batch with its page table padded to capacity slots (entries past the length are never read)."""
    pt = batch["page_table"]
    cols = capacity // PS
    wide = torch.zeros((pt.shape[0], max(cols, pt.shape[1])), dtype=pt.dtype, device=pt.device)
    wide[:, : pt.shape[1]] = pt
    return dict(batch, page_table=wide.contiguous())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one tiny shape (CPU smoke run)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        sys.exit("exp_tree_short_splits.py times CUDA kernels: no GPU here (--quick runs a CPU smoke test)")
    dtype = torch.bfloat16 if cuda else torch.float16
    shapes = [((32, 8, 128), T, B, p) for T in (17, 4) for B in (1, 2, 4) for p in (256, 512, 1024, 2048, 3584)]
    shapes += [((9, 3, 64), 17, 1, p) for p in (256, 512, 1024, 2048)]
    capacity = CAPACITY
    if args.quick:
        shapes, capacity = [((4, 2, 16), 5, 1, 40)], 128
    print(f"page-table capacity {capacity} slots")
    for (HQ, HKV, D), T, B, prefix in shapes:
        kv_bytes = B * (prefix + T) * HKV * D * 2 * dtype.itemsize
        pools = [Pool(B, prefix, (HQ, HKV, D), dtype, T, seed=i) for i in range(n_pools(kv_bytes))]
        batches = [widen(p.batch(T, seed=1), capacity) for p in pools]
        cfg = launch.launch_config(T, HQ // HKV, D, dtype, capacity)
        lp = launch.plan(T, B, HKV, HQ // HKV, D, capacity, dtype, batches[0]["q"].device)
        ns = lp.num_splits
        variants = [("default", {}), ("merge kernel", dict(fused_merge=False)), ("1 split", dict(num_splits=1))]
        variants += [(f"fused busy>={m}", dict(fused_merge=True, min_busy_tiles=m)) for m in (1, 2, 4, 8, 16)]
        variants += [(f"kernel busy>={m}", dict(fused_merge=False, min_busy_tiles=m)) for m in (4, 16)]
        if args.quick:
            variants = variants[:4]
        ref = attn.paged_attention(**batches[0], max_q_len=T).float()
        line = (f"{HQ}q/{HKV}kv d{D} T={T} B={B} prefix={prefix:5d} BLOCK_M={cfg['BLOCK_M']} splits={ns} "
                f"fused={int(lp.fused_merge)} busy>={lp.min_busy_tiles}:")
        for label, kw in variants:
            err = (attn.paged_attention(**batches[0], max_q_len=T, **kw).float() - ref).abs().max().item()
            us = time_rotating([lambda b=b: attn.paged_attention(**b, max_q_len=T, **kw) for b in batches])
            line += f" | {label} {us:.2f}{' ERR' if err > 0.02 else ''}"
        print(line, flush=True)
        del pools, batches
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
