"""Benchmark: the small per-round kernels of EAGLE-3 tree growth at batch 1 (SmolLM2 shapes).

Question: what do the draft's top-k (``topk_logprobs`` over the 8192-id draft vocabulary, one row
per frontier node) and ``tree_expand`` cost per call, and which ``num_warps`` suits the top-k?
Per-call microseconds from replaying a CUDA graph of 20 back-to-back calls (launch overhead
excluded, as inside the engine's graphed step).

Run:  python experiments/kernels/bench_draft_round.py --out outputs/kernels
      python experiments/kernels/bench_draft_round.py --quick --out /tmp/bench   (CPU smoke run)
"""

import argparse
import csv
import datetime
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from kernels_triton import topk as topk_mod  # noqa: E402
from kernels_triton import tree_grow  # noqa: E402
from specdec.bench.provenance import device_name, git_commit  # noqa: E402
from specdec.bench.timing import time_graph  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    V, H = (8192, 576) if not args.quick else (256, 32)
    g = torch.Generator().manual_seed(0)
    rows = []
    stamp = dict(commit=git_commit(), device=device_name(), date=datetime.datetime.now().isoformat(timespec="seconds"))
    for n_rows, k in ((1, 4), (4, 4), (8, 8)):
        x = torch.randn(n_rows, V, generator=g).to(dev, dt)
        for warps in (2, 4, 8, 16):
            if not cuda:  # smoke: run it once (time_graph needs CUDA)
                topk_mod._launch(x, k, True, "topk_logprobs", num_warps=warps)
            us = time_graph(lambda: topk_mod._launch(x, k, True, "topk_logprobs", num_warps=warps), calls=20)
            rows.append(dict(stamp, kernel="topk_logprobs", rows=n_rows, k=k, num_warps=warps, us=us))
    for first, F, K in ((True, 1, 4), (False, 4, 4), (True, 1, 8), (False, 8, 8)):
        B = 1
        C = K + 6 * K * K
        cand = tree_grow.new_candidates(B, C, dev)
        lp = (-torch.rand(B, F, K, generator=g)).sort(-1, descending=True).values.to(dev)
        cid = torch.randint(0, V, (B, F, K), generator=g).to(dev)
        d2t = torch.arange(V, device=dev)
        score = None if first else torch.randn(B, F, generator=g).to(dev)
        fcid = None if first else torch.randint(0, C, (B, F), generator=g).to(dev)
        fmask = None if first else torch.randint(0, 1 << 20, (B, F), generator=g).to(dev)
        h = torch.randn(B, F, H, generator=g).to(dev, dt)
        valid = torch.ones(B, dtype=torch.bool, device=dev)
        seq = torch.full((B,), 100, dtype=torch.int32, device=dev)
        off = 0 if first else K

        def call():
            tree_grow.tree_expand(cand, off, 2, lp, cid, d2t, score, fcid, (fmask, 0 if first else K), h, valid, seq)

        if not cuda:
            call()
        rows.append(dict(stamp, kernel="tree_expand", rows=F, k=K, num_warps=4, us=time_graph(call, calls=20)))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_draft_round.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"{r['kernel']:14s} rows {r['rows']:2d} k {r['k']:2d} warps {r['num_warps']:2d}: {r['us']:6.2f} us")
    print(f"{stamp} -> {path}")


if __name__ == "__main__":
    main()
