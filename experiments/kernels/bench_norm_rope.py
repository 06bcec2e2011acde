"""Benchmark: RMSNorm (+ fused residual add) and RoPE on decode / verify shapes, Triton vs torch eager.

Question: how close do the norm and rope kernels get to copy bandwidth, and where (small N) are
they bound by launch latency instead? Shapes: N in {1, 64, 1024, 4096} tokens (batch x tree tokens);
norm H in {576 (SmolLM2-135M), 4096 (Llama-3.1-8B)}, bf16, with and without the residual add;
rope 9/3 heads d64 and 32/8 heads d128.

Columns (per op and shape):
  us, GB/s, %copy  triton.testing.do_bench median (L2 flushed before each call) and
                   bytes read + written / time, as a fraction of the device copy bandwidth measured
                   in this run (1 GiB copy_, bytes read + written);
  ref us           the plain-torch reference the tests use (torch eager, several kernels);
  graph us         per call, replaying a CUDA graph that holds 50 back-to-back calls: no launch
                   overhead, warm L2; the floor an engine that captures the step pays;
  loop us          per call, wall time of 200 back-to-back eager calls: what an uncaptured step pays
                   (host launch cost dominates at small N; compare with the empty kernel's loop us).

Run:  python experiments/kernels/bench_norm_rope.py --out outputs/kernels
      python experiments/kernels/bench_norm_rope.py --quick --out /tmp/bench   (CPU smoke run; under
      TRITON_INTERPRET=1 when there is no GPU, timings meaningless)
"""

import argparse
import csv
import datetime
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Must precede the first @triton.jit (kernels_triton import below).
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without `pip install -e .`
from specdec.bench.console import print_table as console_table  # noqa: E402
from specdec.bench.provenance import git_commit  # noqa: E402
from specdec.bench.timing import copy_bandwidth_gbps  # noqa: E402
from specdec.bench.timing import time_graph as _time_graph  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels_triton.norm import rms_norm, rms_norm_ref  # noqa: E402
from kernels_triton.rope import rope, rope_ref, rope_tables  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GRAPH_CALLS = 50  # calls captured per graph
LOOP_CALLS = 200  # eager calls per host-loop measurement
ROPE_POSITIONS = 8192  # table rows; tree positions are drawn from [0, ROPE_POSITIONS)


def time_graph(fn):
    return _time_graph(fn, calls=GRAPH_CALLS, replays=20)


@triton.jit
def empty_kernel(x_ptr):
    pass


# ------------------------------------------------------------------------------------- timers


def time_bench(fn):
    """Device time per call in us (median; L2 flushed before each call on the GPU)."""
    if CUDA:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e6




def time_loop(fn):
    """Per-call wall time in us of LOOP_CALLS back-to-back eager calls (GPU only)."""
    if not CUDA:
        return float("nan")
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(LOOP_CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / LOOP_CALLS * 1e6




# ------------------------------------------------------------------------------------- cases


def norm_case(N, H, dtype, residual):
    gen = torch.Generator().manual_seed(N + H)
    x = torch.randn(N, H, generator=gen).to(DEVICE, dtype)
    w = torch.randn(H, generator=gen).to(DEVICE, dtype)
    r = torch.randn(N, H, generator=gen).to(DEVICE, dtype) if residual else None
    es = x.element_size()
    nbytes = N * H * es * (4 if residual else 2) + H * w.element_size()
    name = "add+rmsnorm" if residual else "rmsnorm"
    got = rms_norm(x, w, 1e-5, residual=r)
    want = rms_norm_ref(x, w, 1e-5, residual=r)
    got, want = (got, want) if residual else ((got,), (want,))
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    return dict(
        op=name, N=N, shape=f"H={H}", dtype=str(dtype).replace("torch.", ""), bytes=nbytes, max_err=err,
        kernel=lambda: rms_norm(x, w, 1e-5, residual=r),
        ref=lambda: rms_norm_ref(x, w, 1e-5, residual=r),
    )


def rope_case(N, HQ, HKV, D, dtype, tables):
    gen = torch.Generator().manual_seed(N + D)
    cos, sin = tables[D]
    q = torch.randn(N, HQ, D, generator=gen).to(DEVICE, dtype)
    k = torch.randn(N, HKV, D, generator=gen).to(DEVICE, dtype)
    pos = torch.randint(0, ROPE_POSITIONS, (N,), generator=gen).to(DEVICE, torch.int32)
    es = q.element_size()
    # q, k read and written; positions read; one cos and one sin row per token.
    nbytes = 2 * N * (HQ + HKV) * D * es + N * 4 + 2 * N * (D // 2) * 4
    (qa, ka), (qb, kb) = rope(q, k, pos, cos, sin), rope_ref(q, k, pos, cos, sin)
    err = max((qa.float() - qb.float()).abs().max().item(), (ka.float() - kb.float()).abs().max().item())
    return dict(
        op="rope", N=N, shape=f"{HQ}/{HKV}x{D}", dtype=str(dtype).replace("torch.", ""), bytes=nbytes,
        max_err=err,
        kernel=lambda: rope(q, k, pos, cos, sin),
        ref=lambda: rope_ref(q, k, pos, cos, sin),
    )


def measure(case, copy_gbps):
    row = {key: case[key] for key in ("op", "shape", "N", "dtype", "bytes", "max_err")}
    t_us = time_bench(case["kernel"])
    r_us = time_bench(case["ref"])
    row.update(
        triton_us=t_us,
        triton_gbps=case["bytes"] / (t_us * 1e-6) / 1e9,
        ref_us=r_us,
        ref_gbps=case["bytes"] / (r_us * 1e-6) / 1e9,
        speedup=r_us / t_us,
        triton_graph_us=time_graph(case["kernel"]),
        ref_graph_us=time_graph(case["ref"]),
        triton_loop_us=time_loop(case["kernel"]),
        ref_loop_us=time_loop(case["ref"]),
    )
    row["pct_copy"] = 100 * row["triton_gbps"] / copy_gbps
    return row


# ------------------------------------------------------------------------------------- output


TABLE_COLS = [  # (csv key, header, format)
    ("op", "op", "{}"), ("shape", "shape", "{}"), ("N", "N", "{}"),
    ("triton_us", "us", "{:.1f}"), ("triton_gbps", "GB/s", "{:.0f}"), ("pct_copy", "%copy", "{:.0f}"),
    ("ref_us", "ref us", "{:.1f}"), ("ref_gbps", "ref GB/s", "{:.0f}"), ("speedup", "x ref", "{:.1f}"),
    ("triton_graph_us", "graph us", "{:.2f}"), ("ref_graph_us", "ref graph us", "{:.2f}"),
    ("triton_loop_us", "loop us", "{:.1f}"), ("ref_loop_us", "ref loop us", "{:.1f}"),
    ("max_err", "max err", "{:.1e}"),
]


def print_table(rows, title):
    cells = [[fmt.format(row[key]) for key, _, fmt in TABLE_COLS] for row in rows]
    headers = [header for _, header, _ in TABLE_COLS]
    console_table(title, headers, cells)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "kernels",
                        help="directory for the CSV")
    parser.add_argument("--quick", action="store_true", help="tiny subset (CPU smoke run)")
    args = parser.parse_args()

    if args.quick:
        dtype, ns, hs, heads = (torch.bfloat16 if CUDA else torch.float32), [1, 5], [576], [(9, 3, 64)]
    else:
        dtype, ns, hs, heads = torch.bfloat16, [1, 64, 1024, 4096], [576, 4096], [(9, 3, 64), (32, 8, 128)]
    device_name = torch.cuda.get_device_name() if CUDA else "cpu (TRITON_INTERPRET=1)"

    copy_gbps = copy_bandwidth_gbps()
    dummy = torch.empty(1, device=DEVICE)
    empty = lambda: empty_kernel[(1,)](dummy)  # noqa: E731
    empty_us = time_bench(empty)
    empty_graph_us = time_graph(empty)
    empty_loop_us = time_loop(empty)

    tables = {D: rope_tables(D, ROPE_POSITIONS, 10000.0, device=DEVICE) for _, _, D in heads}
    cases = [norm_case(N, H, dtype, residual) for H in hs for residual in (False, True) for N in ns]
    cases += [rope_case(N, hq, hkv, D, dtype, tables) for hq, hkv, D in heads for N in ns]
    rows = []
    for case in cases:
        rows.append(measure(case, copy_gbps))
        print(f"  measured {case['op']} {case['shape']} N={case['N']}", file=sys.stderr)

    commit = git_commit()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_norm_rope_{datetime.datetime.now():%Y%m%d-%H%M%S}.csv"
    extra = dict(commit=commit, device=device_name, date=date, copy_gbps=copy_gbps, empty_kernel_us=empty_us,
                 empty_kernel_graph_us=empty_graph_us, empty_kernel_loop_us=empty_loop_us)
    fields = list(extra) + ["op", "shape", "N", "dtype", "bytes"] + [k for k, _, _ in TABLE_COLS[3:]]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({**extra, **{k: row[k] for k in fields if k in row}})

    print(f"wrote {path}")
    print(f"device {device_name}, commit {commit}, {date}, dtype {str(dtype).replace('torch.', '')}")
    print(f"copy bandwidth {copy_gbps:.0f} GB/s (read + write); empty Triton kernel: {empty_us:.2f} us "
          f"do_bench, {empty_graph_us:.2f} us per call in a CUDA graph, {empty_loop_us:.1f} us per eager launch")
    print_table(rows, "RMSNorm / RoPE: Triton vs torch eager reference")


if __name__ == "__main__":
    main()
