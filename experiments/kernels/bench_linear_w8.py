"""BENCHMARK: weight-only int8 projections (kernels_triton/linear_w8.py) against cuBLAS on the bf16
weight, at the EAGLE-3 draft head's shapes for a Llama-3.1-8B target (fc, q|k|v, o, gate|up, down,
lm_head over a 32000-id draft vocabulary) and few rows (draft rounds: 4 rows at batch 1 for tree16).

Per shape and row count: us per call of cuBLAS bf16 (x @ w^T) and of linear_w8 with its default launch
(and with --sweep, at 4 rows, the best of a small grid of BLOCK_N / BLOCK_K / stages / split), each in a
CUDA graph of back-to-back calls cycling through enough weight copies (>= 256 MB) that every call
streams its weight from HBM; GB/s of the weight bytes, and % of the copy bandwidth measured in the
same run.

Run (H200, ~1-2 min):  python experiments/kernels/bench_linear_w8.py [--sweep] [--out FILE.csv]
CPU smoke run:         python experiments/kernels/bench_linear_w8.py --quick
"""

import argparse
import csv
import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments" / "kernels")]
from bench_attention import time_rotating  # noqa: E402

from kernels_triton import linear_w8 as w8  # noqa: E402
from specdec.bench.provenance import device_name, git_commit  # noqa: E402
from specdec.bench.timing import copy_bandwidth_gbps  # noqa: E402

H, F, V = 4096, 14336, 32000
SHAPES = {  # name: (NOUT, K) of the 8B-shape EAGLE-3 head (conf/draft/eagle3_random.yaml)
    "fc": (H, 3 * H), "qkv": (6144, 2 * H), "wo": (H, H), "gate_up": (2 * F, H), "down": (H, F), "lm_head": (V, H),
}
ROTATE_BYTES = 256 << 20


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--sweep", action="store_true", help="also the best of a small launch grid per shape")
    ap.add_argument("--out", type=Path, default=None, help="CSV of every measurement")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--warps", default="4", help="--sweep: num_warps values of the grid")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        sys.exit("bench_linear_w8.py times CUDA kernels (--quick: a CPU smoke run)")
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    shapes = {n: SHAPES[n] for n in args.shapes.split(",")} if not args.quick else {"tiny": (96, 128)}
    rows = [int(r) for r in args.rows.split(",")] if not args.quick else [4]
    copy = copy_bandwidth_gbps() if cuda else float("nan")
    print(f"{device_name(dev)}, commit {git_commit()}, copy bandwidth {copy:.0f} GB/s")
    out = []
    grid = [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_stages=st, num_warps=nw)
            for bn, bk, st, nw in itertools.product((16, 32, 64), (128, 256, 512), (3, 4),
                                                    [int(w) for w in args.warps.split(",")])]
    for name, (N, K) in shapes.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        n_copies = max(1, min(16, math.ceil(ROTATE_BYTES / (N * K)))) if cuda else 1
        dense = [torch.randn(N, K, device=dev, generator=gen).to(dt) / K**0.5 for _ in range(n_copies)]
        quant = [w8.quantize(w) for w in dense]
        for M in rows:
            x = torch.randn(M, K, device=dev, generator=gen).to(dt)
            t_dense = time_rotating([lambda w=w: x @ w.t() for w in dense])
            t_w8 = time_rotating([lambda q=q, s=s: w8.linear_w8(x, q, s) for q, s in quant])
            err = (w8.linear_w8(x, *quant[0]).float() - w8.linear_w8_ref(x, *quant[0]).float()).abs().max().item()
            cfg = w8.launch_config(M, N, K, x.device)
            best = (t_w8, "default")
            if args.sweep and cuda and M == 4:  # the draft rounds' rows at batch 1 (tree16)
                splits = sorted({1, cfg["split"], 2})
                for g in grid:
                    for sp in splits:
                        c = g | dict(split=sp)
                        try:
                            t = time_rotating([lambda q=q, s=s, c=c: w8.linear_w8(x, q, s, config=c) for q, s in quant])
                        except Exception:  # noqa: BLE001 - a tile that does not fit (shared memory)
                            continue
                        out.append(dict(shape=name, M=M, kind="w8", cfg=c, us=t))
                        if t < best[0]:
                            best = (t, c)
            gbs = lambda nbytes, us: nbytes / (us * 1e-6) / 1e9  # noqa: E731
            print(f"{name:8s} M={M:2d} N={N:5d} K={K:5d} | cuBLAS bf16 {t_dense:7.2f} us "
                  f"({100 * gbs(2 * N * K, t_dense) / copy:4.1f}% copy) | w8 default {t_w8:7.2f} us "
                  f"({100 * gbs(N * K, t_w8) / copy:4.1f}%) {cfg} | best {best[0]:7.2f} us {best[1]} | "
                  f"dense / w8 {t_dense / best[0]:.2f}x | err {err:.1e}", flush=True)
            out.append(dict(shape=name, M=M, kind="cublas_bf16", cfg="", us=t_dense))
            out.append(dict(shape=name, M=M, kind="w8_default", cfg=cfg, us=t_w8))
        del dense, quant
    if args.out:
        with open(args.out, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=["commit", "device", "date", "shape", "M", "kind", "cfg", "us"])
            wr.writeheader()
            for r in out:
                wr.writerow(dict(commit=git_commit(), device=device_name(dev), date=time.strftime("%Y-%m-%d"), **r))


if __name__ == "__main__":
    main()
