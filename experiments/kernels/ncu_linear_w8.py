"""Nsight Compute target: one shape of the int8 projection (kernels_triton/linear_w8.py) or of cuBLAS on
its bf16 weight, called --calls times (the first ones warm up; ncu picks one with --launch-skip).

  ncu --clock-control none --set full --nvtx --nvtx-include calls/ --launch-skip 4 --launch-count 1 -o R \
      python experiments/kernels/ncu_linear_w8.py --shape gate_up --rows 4 [--cublas]
  python experiments/kernels/ncu_stalls.py sass.csv     # ncu -i R.ncu-rep --page source --csv --print-source sass

--config JSON overrides the launch (e.g. '{"num_warps": 8}'), merged over linear_w8.launch_config.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments" / "kernels")]
from bench_linear_w8 import SHAPES  # noqa: E402

from kernels_triton import linear_w8 as w8  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="gate_up", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--cublas", action="store_true")
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    N, K = SHAPES[args.shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=gen) / K**0.5).to(torch.bfloat16)
    q, s = w8.quantize(w)
    x = torch.randn(args.rows, K, device="cuda", generator=gen).to(torch.bfloat16)
    cfg = None
    if args.config:
        cfg = json.loads(args.config)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("calls")  # ncu --nvtx --nvtx-include calls/: these launches only
    for _ in range(args.calls):
        y = x @ w.t() if args.cublas else w8.linear_w8(x, q, s, config=cfg)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(args.shape, args.rows, "cublas" if args.cublas else w8.launch_config(args.rows, N, K, x.device) | (cfg or {}),
          float(y.float().abs().sum()))


if __name__ == "__main__":
    main()
