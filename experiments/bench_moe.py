"""Benchmark: one MoE layer at the Qwen3-30B-A3B shape (H 2048, F 768, 128 experts, top-8, bf16).

Question: how close does the fused Triton layer (kernels_triton/moe.py) come to the bytes a step must
read, the touched-expert floor, from decode (1 token) through verify (8, 17, 64) to prefill (256,
1,024), beside what a model without it would run? Target: >= 75 % of the floor at 8-256 tokens, graphed.

Implementations (every output checked against moe.fused_moe_ref in the same run, max_abs_err):
    fused_graph    moe.fused_moe replayed in a CUDA graph (the engine's graphed step)
    fused_eager    moe.fused_moe launched from Python
    torch_loop     a loop over the experts the batch selects, in the weights' dtype (a model without the
                   kernel: per expert a gather, three GEMMs, index_add; host syncs, so eager only)
    grouped_mm     torch._grouped_mm over pairs sorted by expert (argsort, offsets from a device-side
                   count), eager; grouped_mm_graph: the same captured in a CUDA graph, where it captures
                   (capturable column; the error otherwise). Absent where this torch has no _grouped_mm.

Uniform random routing: random router weights, and NX = 8 different inputs per timing, called in turn,
so consecutive calls select different experts and the layer's weights (1.2 GB) are read from HBM, not
L2. Floor per call = (distinct experts of that input x 3 H F x 2 bytes + router E H + x in and out
2 T H, x 2 bytes) / the device-to-device copy bandwidth measured in this run (specdec.bench.timing,
read + written bytes per second); pct_floor = floor / time. distinct_experts is the mean over the NX
inputs. Graphed times: median over replays of a graph of the NX calls, per call; eager times:
triton.testing.do_bench median (L2 flushed between calls).

--sweep: per token count, a coordinate-descent sweep of each GEMM's tiles (BLOCK_M, BLOCK_N, BLOCK_K,
num_warps, num_stages; the other GEMM at its plan) on the graphed fused layer; prints the best per token
count beside the plan's, to set kernels_triton.moe._PLANS from one GPU run.

Run:  python experiments/bench_moe.py --out $OUT
      python experiments/bench_moe.py --sweep --out $OUT
      python experiments/bench_moe.py --smoke            (CPU smoke run: interpreter, tiny shapes, seconds)
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
import triton  # noqa: E402

from kernels_triton import moe  # noqa: E402
from specdec.bench.provenance import provenance  # noqa: E402
from specdec.bench.timing import copy_bandwidth_gbps  # noqa: E402

# The GPU run and the smoke run: the same code, other sizes.
SHAPES = {
    "qwen3_30b_a3b": dict(H=2048, F=768, E=128, top_k=8, tokens=(1, 8, 17, 64, 256, 1024), dtype="bfloat16",
                          inputs=8),
    "smoke": dict(H=32, F=16, E=16, top_k=4, tokens=(1, 5), dtype="float32", inputs=2),
}
SWEEP_VALUES = {"BLOCK_M": (16, 32, 64), "BLOCK_N": (16, 32, 64, 128), "BLOCK_K": (64, 128, 256),
                "num_warps": (4, 8), "num_stages": (2, 3, 4, 5)}


# ----------------------------------------------------------------------------------------------
# Implementations
# ----------------------------------------------------------------------------------------------


def torch_loop(x, router_w, w13, w2, top_k, renormalize):
    """The layer as a model without the kernel runs it: routing, then per selected expert a gather, the
    gate|up GEMM, SwiGLU, the down GEMM and a weighted index_add, in x's dtype (fp32 output buffer)."""
    F = w13.shape[1] // 2
    w, ids = moe.moe_route_ref(x.float() @ router_w.float().t(), top_k, renormalize)  # [T, K]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():  # host sync: the selected experts
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = x[tok] @ w13[e].t()  # [n, 2F]
        a = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
        out.index_add_(0, tok, (a @ w2[e].t()).float() * w[tok, slot, None])
    return out.to(x.dtype)


def grouped_mm(x, router_w, w13, w2, top_k, renormalize):
    """torch._grouped_mm over the pairs sorted by expert; counts by a device-side scatter (no bincount,
    whose output size needs a sync), so only the library decides whether it captures."""
    T, H = x.shape
    E, F = w13.shape[0], w13.shape[1] // 2
    w, ids = moe.moe_route_ref(x.float() @ router_w.float().t(), top_k, renormalize)
    flat = ids.reshape(-1).long()  # [P]
    order = torch.argsort(flat, stable=True)  # pairs by expert
    ones = torch.ones_like(flat, dtype=torch.int32)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).index_add_(0, flat, ones)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] group ends
    tok = order // top_k
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)  # [P, H] x [E, H, 2F] -> [P, 2F]
    a = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)  # [P, F] x [E, F, H] -> [P, H]
    y = y.float() * w.reshape(-1)[order, None]
    return torch.zeros((T, H), dtype=torch.float32, device=x.device).index_add_(0, tok, y).to(x.dtype)


def fused(config=None):
    def run(x, router_w, w13, w2, top_k, renormalize):
        return moe.fused_moe(x, router_w, w13, w2, top_k, renormalize, config=config)

    return run


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def time_eager(calls, cuda):
    """Median microseconds per call of the zero-argument fns in ``calls``, called in turn."""
    it = iter(range(1 << 62))

    def step():
        calls[next(it) % len(calls)]()

    if cuda:
        return triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median") * 1e3
    step()
    times = []
    for _ in range(len(calls)):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def time_graph(calls, cuda, replays=20):
    """Median microseconds per call over replays of one CUDA graph of all ``calls`` in turn (warmed up
    outside the capture). Without CUDA: the eager time (the smoke run exercises the rest)."""
    if not cuda:
        return time_eager(calls, cuda)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    us = statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / len(calls)
    del graph
    return us


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def make_layer(s, T, dev, seed=0):
    dtype = getattr(torch, s["dtype"])
    g = torch.Generator(device=dev).manual_seed(seed)
    H, F, E = s["H"], s["F"], s["E"]

    def r(*shape, scale):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    weights = (r(E, H, scale=H ** -0.5), r(E, 2 * F, H, scale=H ** -0.5), r(E, H, F, scale=F ** -0.5))
    return weights, [r(T, H, scale=1.0) for _ in range(s["inputs"])]


def distinct_experts(x, router_w, top_k):
    return int(moe.moe_route_ref(x.float() @ router_w.float().t(), top_k, True)[1].unique().numel())


def floor_us(s, T, distinct, gbps):
    bytes_read = (distinct * 3 * s["H"] * s["F"] + s["E"] * s["H"] + 2 * T * s["H"]) * 2
    return bytes_read / (gbps * 1e3)


def measure(impl, fn, weights, xs, s, graph, cuda, check=True):
    """One row: time per call (graphed or eager), output error on the first input; errors recorded."""
    top_k = s["top_k"]
    calls = [lambda x=x: fn(x, *weights, top_k, True) for x in xs]
    row = dict(impl=impl, graph=graph)
    try:
        if check:
            out = fn(xs[0], *weights, top_k, True)
            ref = moe.fused_moe_ref(xs[0], *weights, top_k, True)
            row["max_abs_err"] = float((out.float() - ref.float()).abs().max())
        row["us"] = (time_graph if graph else time_eager)(calls, cuda)
        row["capturable"] = True if graph and cuda else None
    except Exception as e:  # a baseline this torch cannot run or capture: recorded, the run goes on
        row.update(us=float("nan"), error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        if graph:
            row["capturable"] = False
    return row


def run_table(s, cuda, dev, gbps):
    # grouped_mm_graph last of all: a capture that fails part-way must not disturb the other rows.
    safe = [("fused_graph", fused(), True), ("fused_eager", fused(), False), ("torch_loop", torch_loop, False)]
    risky = []
    if hasattr(torch, "_grouped_mm"):
        safe.append(("grouped_mm", grouped_mm, False))
        risky.append(("grouped_mm_graph", grouped_mm, True))
    rows = []
    for impls in (safe, risky):
        for T in s["tokens"] if impls else ():
            weights, xs = make_layer(s, T, dev, seed=T)
            distinct = statistics.mean(distinct_experts(x, weights[0], s["top_k"]) for x in xs)
            fl = floor_us(s, T, distinct, gbps)
            for impl, fn, graph in impls:
                row = measure(impl, fn, weights, xs, s, graph, cuda, check=impls is safe)
                row.update(tokens=T, distinct_experts=distinct, floor_us=fl, pct_floor=100 * fl / row["us"])
                rows.append(row)
                print(f"  T {T:5d} {impl:17s} {row['us']:9.1f} us  {row['pct_floor']:5.1f} % of floor"
                      + (f"  ({row['error']})" if "error" in row else ""), flush=True)
            del weights, xs
    return rows


def sweep(s, cuda, dev, gbps):
    """Coordinate descent over each GEMM's tiles per token count, graphed; returns rows of the best."""
    rows = []
    for T in s["tokens"]:
        weights, xs = make_layer(s, T, dev, seed=T)
        distinct = statistics.mean(distinct_experts(x, weights[0], s["top_k"]) for x in xs)
        fl = floor_us(s, T, distinct, gbps)
        plan = moe.moe_plan(T, s["E"], s["top_k"], s["H"], s["F"])
        best = {k: dict(plan[k]) for k in ("gate_up", "down")}
        base = measure("plan", fused(best), weights, xs, s, True, cuda, check=False)["us"]
        best_us = base
        for kernel in ("gate_up", "down"):
            for key, values in SWEEP_VALUES.items():
                for v in values:
                    if v == best[kernel][key]:
                        continue
                    cand = {k: dict(c) for k, c in best.items()}
                    cand[kernel][key] = v
                    got = measure("sweep", fused(cand), weights, xs, s, True, cuda, check=False)
                    if got["us"] < best_us:
                        best, best_us = cand, got["us"]
        eff = moe.moe_plan(T, s["E"], s["top_k"], s["H"], s["F"], best)  # as clamped to the dims
        rows.append(dict(tokens=T, distinct_experts=distinct, floor_us=fl, plan_us=base, plan_pct=100 * fl / base,
                         best_us=best_us, best_pct=100 * fl / best_us,
                         best={k: eff[k] for k in ("gate_up", "down")}))
        print(f"  T {T:5d} plan {base:9.1f} us -> best {best_us:9.1f} us: {rows[-1]['best']}", flush=True)
        del weights, xs
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "kernels",
                    help="folder for bench_moe.json (--sweep: bench_moe_sweep.json)")
    ap.add_argument("--smoke", "--quick", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--sweep", action="store_true", help="tile sweep per token count instead of the table")
    ap.add_argument("--tokens", type=int, nargs="*", help="token counts (default: the shape's list)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    s = dict(SHAPES["qwen3_30b_a3b" if cuda else "smoke"])
    if args.tokens:
        s["tokens"] = tuple(args.tokens)
    gbps = copy_bandwidth_gbps(dev)
    print(f"{'GPU' if cuda else 'CPU smoke'}: H {s['H']} F {s['F']} E {s['E']} top-{s['top_k']} {s['dtype']}; "
          f"copy bandwidth {gbps:.0f} GB/s", flush=True)
    rows = (sweep if args.sweep else run_table)(s, cuda, dev, gbps)
    result = dict(provenance(dev), shape=s, copy_gbps=gbps, rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("bench_moe_sweep.json" if args.sweep else "bench_moe.json")
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"-> {path}")
    print(f"\n{result['device_name']} {result['commit']}, copy {gbps:.0f} GB/s; "
          f"pct = touched-expert floor / time")
    if args.sweep:
        print(f"{'tokens':>6s} {'experts':>7s} {'floor us':>9s} {'plan us':>9s} {'plan %':>6s} {'best us':>9s} "
              f"{'best %':>6s}  best tiles (gate_up | down)")
        for r in rows:
            tiles = " | ".join(" ".join(f"{k.replace('BLOCK_', '').replace('num_', '')}{v}"
                                        for k, v in r["best"][n].items()) for n in ("gate_up", "down"))
            print(f"{r['tokens']:6d} {r['distinct_experts']:7.1f} {r['floor_us']:9.1f} {r['plan_us']:9.1f} "
                  f"{r['plan_pct']:6.1f} {r['best_us']:9.1f} {r['best_pct']:6.1f}  {tiles}")
        return
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    print(f"{'tokens':>6s} {'experts':>7s} {'floor us':>9s} " + " ".join(f"{i:>21s}" for i in impls))
    for T in s["tokens"]:
        by = {r["impl"]: r for r in rows if r["tokens"] == T}
        first = next(iter(by.values()))
        cells = [f"{by[i]['us']:10.1f} us {by[i]['pct_floor']:5.1f}%" if i in by else f"{'-':>21s}" for i in impls]
        print(f"{T:6d} {first['distinct_experts']:7.1f} {first['floor_us']:9.1f} " + " ".join(cells))


if __name__ == "__main__":
    main()
