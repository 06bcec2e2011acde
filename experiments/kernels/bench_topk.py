"""Benchmark: the draft's top-k log-probabilities over wide vocabularies (V > MAX_V = 16384).

Question: what does one ``topk_logprobs`` call cost at Llama-3 draft shapes (32000-id EAGLE-3 draft
vocabulary; the full 128256-id vocabulary) as torch's log_softmax + radix-select topk (the fallback
before the split row, ~20 launches) versus the split-row Triton kernels (kernels_triton/topk.py: 2
launches), and which CHUNK suits the split? Per-call microseconds from replaying a CUDA graph of 20
back-to-back calls (launch overhead excluded, as inside the engine's graphed step), bf16 logits,
rows N in {1, 8, 16, 64}, K in {8, 10}. Each split row's values are checked against torch in the
same run (max_abs_err column; ids_match: the same ids as torch, which may differ only at ties, and
bf16 rows of random logits have many; ids_valid: the log-probabilities at the returned ids equal
torch's top-k values, ties or not).

Rows of the CSV: impl = torch (log_softmax + topk) | split (chunk = the default split_plan) |
split_cN (chunk forced to N); S = chunks per row.

Run:  python experiments/kernels/bench_topk.py --out outputs/kernels
      python experiments/kernels/bench_topk.py --quick --out /tmp/bench   (CPU smoke run)
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
from specdec.bench.provenance import device_name, git_commit  # noqa: E402
from specdec.bench.timing import time_graph  # noqa: E402

SWEEP_CHUNKS = (1024, 2048, 4096)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    vocabs, rows_list, ks = ((32000, 128256), (1, 8, 16, 64), (8, 10)) if cuda else ((topk_mod.MAX_V + 16,), (1, 3), (8,))
    g = torch.Generator().manual_seed(0)
    stamp = dict(commit=git_commit(), device=device_name(), date=datetime.datetime.now().isoformat(timespec="seconds"))
    rows = []
    for V in vocabs:
        default_chunk, _ = topk_mod.split_plan(V)
        chunks = [None] + ([c for c in SWEEP_CHUNKS if c != default_chunk] if cuda else [])
        for n_rows in rows_list:
            x = (torch.randn(n_rows, V, generator=g) * 3).to(dev, dt)
            for k in ks:
                ref_v, ref_i = topk_mod.topk_logprobs_ref(x, k)

                def torch_call():
                    topk_mod.topk_logprobs_ref(x, k)

                rows.append(dict(stamp, impl="torch", V=V, rows=n_rows, k=k, chunk="", S="",
                                 us=time_graph(torch_call, calls=20), max_abs_err=0.0, ids_match=True, ids_valid=True))
                lp = torch.log_softmax(x.float(), dim=-1)
                for chunk in chunks:
                    c, S = topk_mod.split_plan(V, chunk)

                    def split_call():
                        return topk_mod._launch_split(x, k, True, "topk_logprobs", chunk=chunk)

                    v, i = split_call()  # check (and compile) outside the graph
                    err = float((v - ref_v).abs().max())
                    if not err < 1e-3:
                        raise SystemExit(f"split V={V} N={n_rows} k={k} chunk={c}: max |err| {err} vs torch")
                    rows.append(dict(stamp, impl="split" if chunk is None else f"split_c{c}", V=V, rows=n_rows, k=k,
                                     chunk=c, S=S, us=time_graph(split_call, calls=20), max_abs_err=err,
                                     ids_match=bool(torch.equal(i, ref_i)),
                                     ids_valid=bool(torch.allclose(lp.gather(-1, i), ref_v, atol=1e-5, rtol=0))))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_topk.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"V {r['V']:6d} rows {r['rows']:2d} k {r['k']:2d} {r['impl']:12s} chunk {str(r['chunk']):>5s} "
              f"S {str(r['S']):>2s}: {r['us']:7.2f} us  err {r['max_abs_err']:.1e} ids_match {r['ids_match']} ids_valid {r['ids_valid']}")
    print(f"{stamp} -> {path}")


if __name__ == "__main__":
    main()
