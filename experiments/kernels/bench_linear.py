"""Benchmark: fused small-M layer kernels (kernels_triton/linear.py) vs the unfused path they replace.

Question: per decode / verify layer op, how much do the fused kernels save over Triton RMSNorm /
RoPE + KV write / SwiGLU kernels around cuBLAS GEMMs, and how close to copy bandwidth do they stream
the weights? Shapes: SmolLM2-135M (H 576, F 1536, 9/3 heads d64, V 49152) and Llama-3.1-8B (H 4096,
F 14336, 32/8 heads d128, V 128256), bf16, M in {1, 17, 64} rows (batch-1 decode, a 16-node tree
verify, batch 64).

Ops ("fused": the kernels_triton/linear.py launcher, whatever rows / weight size; "unfused": the model's
path through specdec.models.ops with the kernel option fused_linear=False):
  qkv      RMSNorm(x + r) -> wqkv -> RoPE -> K/V into a paged cache
  wo       o @ wo^T
  mlp_in   RMSNorm(x + r) -> w13 -> silu(gate) * up
  w2       act @ w2^T
  lm_head  hidden @ embed^T

Columns: us per call inside a CUDA graph of 50 back-to-back calls (what a graphed step pays: launch
latency included, host excluded; consecutive calls read different copies of the weight, >= 256 MB in
all, so a weight smaller than the L2 is streamed from HBM as in a real step), weight GB/s and % of the
copy bandwidth measured in this run.
``--sweep`` also times tile / grid / BLOCK_K / stages / warps variants of the fused kernels at M = 1
(see sweep_variants: the GEMV's, and the streaming body's on one row as a wide LM head runs it).

``--small-m`` (instead of the table above): the multi-row streaming body at M in {8, 17, 33, 49}
(EAGLE-3 draft rounds, tree verify of 16 / 32 / 48 nodes), qkv / wo / mlp_in / w2 of both shapes,
against unfused (norm + cuBLAS + epilogue kernels): "stream" (prologue launch + swap-AB pipelined
GEMM with its L2 weight prefetch before the PDL wait, split-K where the column blocks do not fill the
GPU) and "no_prefetch" (the same without the prefetch) (--bodies: a subset), us per call as above, a
relative-error check of the fastest variant's output against the unfused one, into
bench_linear_small_m.csv; ``--small-m-sweep`` adds the streaming body's variants (stream_variants:
BLOCK_N x split-K, BLOCK_K / stages / warps, persistent grid) into bench_linear_small_m_sweep.csv
(rows 17 and 49 unless --rows); ``--small-m-grid`` times the cross product of BLOCK_N and the K-loop
settings instead (stream_grid), into the same file.

``--write-tiles PATH`` (with a sweep or grid) writes a tile table (kernels_triton/options.load_tiles; the
kernel option stream_tiles reads it): per shape, op and M, the fastest variant where it beats the default
by more than --tiles-min-gain (2%), for --tile-rows LO HI rows (default: the M measured).
``--tiles-from CSV --write-tiles PATH`` does the same from a sweep CSV written before (no GPU needed).

Run:  python experiments/kernels/bench_linear.py --out outputs/kernels [--sweep]
      python experiments/kernels/bench_linear.py --small-m --out $OUT
      python experiments/kernels/bench_linear.py --small-m-sweep --shapes llama8b --out $OUT   (one shape a run)
      python experiments/kernels/bench_linear.py --small-m-grid --shapes smollm2 --rows 17 --out $OUT
      python experiments/kernels/bench_linear.py --quick --out /tmp/bench   (CPU smoke run)
"""

import argparse
import csv
import itertools
import datetime
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first @triton.jit import

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from specdec.bench.console import print_table  # noqa: E402
from specdec.bench.provenance import device_name, git_commit  # noqa: E402
from specdec.bench.timing import copy_bandwidth_gbps, time_graph  # noqa: E402
from specdec.models import ops  # noqa: E402

from kernels_triton import linear as lin  # noqa: E402
from kernels_triton import options  # noqa: E402
from kernels_triton.rope import rope_tables  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SHAPES = {
    "smollm2": dict(H=576, F=1536, HQ=9, HKV=3, D=64, V=49152),
    "llama8b": dict(H=4096, F=14336, HQ=32, HKV=8, D=128, V=128256),
}
TINY = dict(H=64, F=96, HQ=4, HKV=2, D=32, V=300)


def write_csvs(out: Path, tables: dict) -> None:
    """Each non-empty list of row dicts into out/NAME as a CSV (header: the first row's keys)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, data in tables.items():
        if data:
            with open(out / name, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(data[0]))
                w.writeheader()
                w.writerows(data)


def fastest(rows: list, key_fields: tuple) -> dict:
    """The row with the smallest "us" (NaN: skipped) per value of key_fields."""
    best = {}
    for row in rows:
        key = tuple(row[k] for k in key_fields)
        if row["us"] == row["us"] and (key not in best or row["us"] < best[key]["us"]):
            best[key] = row
    return best


def make_ops(s, M, dtype, gen, lm_head=True, weights=None):
    """{op: (callable(config) -> None, weight bytes)} for one shape and row count (``lm_head`` False:
    without the LM head, whose weight is the largest to make; ``weights``: a dict that keeps the
    weights (and their rotating copies) of the first call for the next calls of the same shape)."""
    H, F, HQ, HKV, D, V = (s[k] for k in ("H", "F", "HQ", "HKV", "D", "V"))
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)  # noqa: E731
    x, r, nw = rnd(M, H), rnd(M, H), rnd(H)
    if weights:
        wqkv, wo, w13, w2, emb, nxt = weights["all"]
    else:
        wqkv, wo = rnd((HQ + 2 * HKV) * D, H, scale=H ** -0.5), rnd(H, HQ * D, scale=H ** -0.5)
        w13, w2 = rnd(2 * F, H, scale=H ** -0.5), rnd(H, F, scale=F ** -0.5)
        emb = rnd(V, H, scale=H ** -0.5) if lm_head else None
        nxt = {name: rotating(w) for name, w in dict(wqkv=wqkv, wo=wo, w13=w13, w2=w2, emb=emb).items()
               if w is not None}
        if weights is not None:
            weights["all"] = (wqkv, wo, w13, w2, emb, nxt)
    o, act = rnd(M, HQ * D), rnd(M, F)
    cos, sin = rope_tables(D, 4096, 10000.0, device=DEVICE)
    pos = torch.randint(0, 4096, (M,), generator=gen).to(DEVICE)
    PS, NP = 16, max(8, M)
    kc = torch.zeros(NP, PS, HKV, D, device=DEVICE, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(NP * PS, generator=gen)[:M].to(DEVICE)
    nbytes = lambda *ws: sum(w.numel() * w.element_size() for w in ws)  # noqa: E731
    out = {
        "qkv": (lambda: ops.norm_qkv_rope_write_kv_(x, r, nw, 1e-5, nxt["wqkv"](), HQ, HKV, pos, cos, sin, kc, vc,
                                                    slots),
                lambda cfg: lin.norm_qkv_rope_write_kv_(x, r, nw, 1e-5, nxt["wqkv"](), HQ, HKV, pos, cos, sin, kc, vc,
                                                        slots, config=cfg), nbytes(wqkv)),
        "wo": (lambda: ops.linear(o, nxt["wo"]()), lambda cfg: lin.linear(o, nxt["wo"](), config=cfg), nbytes(wo)),
        "mlp_in": (lambda: ops.norm_swiglu(x, r, nw, 1e-5, nxt["w13"]()),
                   lambda cfg: lin.norm_swiglu(x, r, nw, 1e-5, nxt["w13"](), config=cfg), nbytes(w13)),
        "w2": (lambda: ops.linear(act, nxt["w2"]()), lambda cfg: lin.linear(act, nxt["w2"](), config=cfg), nbytes(w2)),
    }
    if lm_head:
        out["lm_head"] = (lambda: ops.linear(x, nxt["emb"]()), lambda cfg: lin.linear(x, nxt["emb"](), config=cfg),
                          nbytes(emb))
    return out


ROTATE_BYTES = 256 << 20  # > the H200's 50 MB L2 several times over


def rotating(w):
    """A function returning the next of n copies of w (n * bytes >= ROTATE_BYTES, at most 8) in turn: the
    calls captured back to back in one graph each stream a weight that is not in L2, as in a real
    step (where every layer's weights are read once), instead of re-reading one L2-resident copy."""
    n = min(8, -(-ROTATE_BYTES // (w.numel() * w.element_size()))) if CUDA else 1
    copies = [w] + [w.clone() for _ in range(n - 1)]
    it = itertools.cycle(copies)
    return lambda: next(it)


def sweep_variants(op, s, quick, kinds=("stream", "gemv")):
    """(tile override, BLOCK_K, stages, warps) variants of one op's fused kernel at M = 1. A tile override
    sets BLOCK_N (qkv: programs per head ``parts``), optionally ``programs`` (a persistent grid of that
    many programs looping over the column blocks) and ``gemv`` (True: CUDA-core products, so BLOCK_N may
    go below 16; False: the streaming body's tensor-core tiles)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 4
    half = s["D"] // 2
    out = []
    if op == "lm_head":
        out = [(dict(gemv=False), bk, 3, 4) for bk in (64, 128, 256)] if "stream" in kinds else []
        if "gemv" in kinds:
            out += [(dict(gemv=True, block_n=bn), bk, 1, wp) for bn, bk in ((8, 512), (16, 256)) for wp in (4, 8)]
        return out
    if "stream" in kinds:  # the streaming body's tiles (16-row blocks)
        if op == "qkv":
            tiles = [dict(gemv=False, parts=p, programs=g) for p in (1, 2, 4) if half // p >= 16 for g in (None, 2 * sms)]
        else:
            tiles = [dict(gemv=False, block_n=bn, programs=g) for bn in (16, 32, 64) for g in (None, 2 * sms)]
        bks = (64, 128) if quick else (256, 512)
        sw = ((4, 4),) if quick else ((3, 4), (4, 4))
        out += [(t, bk, st, wp) for t in tiles for bk in bks for st, wp in sw]
    if "gemv" in kinds:  # GEMV tiles (BLOCK_N x BLOCK_K fp32 products per accumulator)
        shapes = ((8, 64), (16, 32)) if quick else ((4, 256), (8, 128), (8, 256), (8, 512), (16, 128), (16, 256))
        if not quick and s["H"] < 1024:  # short rows (SmolLM2): narrower chunks, more column blocks
            shapes = ((2, 256), (4, 128), (4, 256), (8, 64), (8, 128), (8, 256), (16, 64))
        grids = (None, 2) if quick else (None, 2 * sms, 4 * sms, 8 * sms)
        sw = ((1, 4),) if quick else ((1, 4), (1, 8))
        for bn, bk in shapes:
            for g in grids:
                t = dict(gemv=True, programs=g)
                t.update(parts=max(1, half // bn)) if op == "qkv" else t.update(block_n=bn)
                out += [(t, bk, st, wp) for st, wp in sw]
    return out


def stream_variants(op, s, quick):
    """Variants of the streaming body beside its defaults: BLOCK_N (qkv: programs per head ``parts``) x
    split-K (1, 2, 4), then (BLOCK_K, stages, warps) at the default tile, a persistent grid of one
    program per SM, and no L2 prefetch before the PDL wait."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 4
    half = s["D"] // 2
    if op == "qkv":
        tiles = [dict(parts=p) for p in (1, 2, 4) if half // p >= 16]
    else:
        tiles = [dict(block_n=bn) for bn in ((16, 32, 64) if op == "mlp_in" else (16, 64, 128))]
    splits = (1, 2) if quick else (1, 2, 4)
    out = [dict(t, split_k=sp) for t in tiles for sp in splits]
    sw = ((64, 2, 4),) if quick else ((64, 4, 4), (128, 4, 4), (256, 3, 4), (128, 5, 8))
    out += [dict(BLOCK_K=bk, num_stages=st, num_warps=wp) for bk, st, wp in sw]
    return out + [dict(programs=sms, split_k=1), dict(prefetch=0)]


def stream_grid(op, s):
    """--small-m-grid: the streaming body's tiles crossed with its K-loop settings: BLOCK_N (qkv: programs
    per head ``parts``) x (BLOCK_K, stages, warps) at the default split-K (the rule of _stream_split; for w2
    also 3 splits), each cell a variant (None: the launcher's default)."""
    half = s["D"] // 2
    if op == "qkv":
        tiles = [dict(parts=p) for p in (1, 2, 4) if half // p >= 16]
    else:
        tiles = [dict(block_n=bn) for bn in ((16, 32, 64) if op == "mlp_in" else (16, 32, 64, 128))]
    splits = (None, 3) if op == "w2" else (None,)
    loops = ((None, None, None), (64, 4, 4), (128, 3, 4), (256, 2, 4), (128, 4, 2))
    out = []
    for t in tiles:
        for sp in splits:
            for bk, st, wp in loops:
                v = dict(t)
                if sp is not None:
                    v["split_k"] = sp
                if bk is not None:
                    v.update(BLOCK_K=bk, num_stages=st, num_warps=wp)
                out.append(v)
    return out


TILE_FIELDS = ("block_n", "split_k", "BLOCK_K", "num_stages", "num_warps", "parts", "programs")


def weight_shape(op, s):
    """[n, k] of op's weight (what a tile-table entry is keyed by)."""
    H, F, HQ, HKV, D = (s[k] for k in ("H", "F", "HQ", "HKV", "D"))
    return {"qkv": ((HQ + 2 * HKV) * D, H), "wo": (H, HQ * D), "mlp_in": (2 * F, H), "w2": (H, F)}[op]


def tile_table(sweep, rows_range=None, min_gain=0.02, source=""):
    """A tile table (kernels_triton/options.load_tiles) from --small-m-sweep / --small-m-grid rows: per
    (shape, M, op) the fastest variant, where it beats the default by more than ``min_gain``."""
    devices = {str(r["device"]) for r in sweep}
    if len(devices) != 1:
        raise SystemExit(f"error: a tile table is for one device; the sweep holds {sorted(devices)}")
    entries = []
    for (shape, M, op), r in sorted(fastest(sweep, ("shape", "M", "op")).items()):
        us, default = float(r["us"]), float(r["default_us"])
        config = {k: int(r[k]) for k in TILE_FIELDS if str(r.get(k, "")) not in ("", "None")}
        if not config or not us < default * (1 - min_gain) or op not in ("qkv", "wo", "mlp_in", "w2"):
            continue
        n, k = weight_shape(op, SHAPES[shape])
        lo, hi = rows_range or (int(M), int(M))
        entries.append({"n": n, "k": k, "rows": [lo, hi], "config": config})  # (the measurements: the sweep CSV)
    return {"device": devices.pop(), "source": source, "entries": entries}


def write_tiles(path: Path, sweep, args, source) -> None:
    rows_range = tuple(args.tile_rows) if args.tile_rows else None
    table = tile_table(sweep, rows_range, args.tiles_min_gain, source)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    options.load_tiles(str(path))  # what the kernel option will read: checked here
    print(f"tile table: {len(table['entries'])} entries for {table['device']} in {path}")


def read_sweep_csv(path: Path) -> list:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["us"], r["default_us"] = float(r["us"]), float(r["default_us"])
    return rows


def rel_err(got, ref_fn) -> float:
    """max |got - ref| / max |ref| of an op's first output against the unfused path's (a correctness
    check of the kernels on this device: bf16 roundings differ, so ~1e-2 is expected)."""
    with options.use(fused_linear=False):
        ref = ref_fn()
    got, ref = (t[0] if isinstance(t, tuple) else t for t in (got, ref))
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))


BODIES = {"stream": {}, "no_prefetch": {"prefetch": 0}}  # --small-m: the streaming body with / without its prefetch


def small_m_main(args, shapes, dtype, copy_gbps, meta):
    """--small-m: unfused vs the streaming body per op and row count (module docstring)."""
    bodies = args.bodies
    rows_m = [2, 5] if args.quick else (args.rows or ([17, 49] if args.small_m_sweep or args.small_m_grid
                                                      else [8, 17, 33, 49]))
    op_names = args.ops or ["qkv", "wo", "mlp_in", "w2"]
    rows, sweep = [], []
    gen = torch.Generator().manual_seed(0)
    for sname, s in shapes.items():
        weights = {}  # one set of weights per shape
        for M in rows_m:
            for op, (call, call_cfg, wbytes) in make_ops(s, M, dtype, gen, lm_head="lm_head" in op_names,
                                                         weights=weights).items():
                if op not in op_names:
                    continue
                unfused_us = timed(call, False)
                us = {b: timed(lambda: call_cfg({**BODIES[b], "gemv": False}), True) for b in bodies}
                row = dict(meta, shape=sname, M=M, op=op, weight_mb=wbytes / 1e6, unfused_us=unfused_us,
                           **{f"{b}_us": t for b, t in us.items()})
                best = min(bodies, key=lambda b: us[b], default=None)
                if best is not None:  # the fastest streaming variant: its speed-up, bandwidth and error
                    gbps = wbytes / (us[best] * 1e-6) / 1e9
                    row.update(best_stream=best, best_vs_unfused=unfused_us / us[best], best_gbps=gbps,
                               pct_copy=100 * gbps / copy_gbps,
                               rel_err=rel_err(call_cfg({**BODIES[best], "gemv": False}), call))
                rows.append(row)
                stream_us = us.get("stream", float("nan"))
                if args.small_m_sweep or args.small_m_grid:
                    for v in (stream_grid(op, s) if args.small_m_grid else stream_variants(op, s, args.quick)):
                        cfg = dict({"gemv": False}, **v)
                        try:
                            us = timed(lambda: call_cfg(dict(cfg)), True)
                        except Exception as exc:  # e.g. out of shared memory for this tile
                            us = float("nan")
                            print(f"sweep {sname} M={M} {op} {v}: {type(exc).__name__}: {exc}"[:300], flush=True)
                        sweep.append(dict(meta, shape=sname, M=M, op=op,
                                          body="no_prefetch" if v.get("prefetch") == 0 else "stream",
                                          split_k=v.get("split_k", ""), block_n=v.get("block_n", ""),
                                          parts=v.get("parts", ""), programs=v.get("programs", ""),
                                          BLOCK_K=v.get("BLOCK_K", ""), num_stages=v.get("num_stages", ""),
                                          num_warps=v.get("num_warps", ""), us=us, default_us=stream_us,
                                          pct_copy=100 * wbytes / (us * 1e-6) / 1e9 / copy_gbps))
            print(f"done {sname} M={M}", flush=True)
    write_csvs(args.out, {"bench_linear_small_m.csv": rows, "bench_linear_small_m_sweep.csv": sweep})
    if args.write_tiles and sweep:
        write_tiles(args.write_tiles, sweep, args, f"bench_linear.py --small-m-{'grid' if args.small_m_grid else 'sweep'}"
                    f" on {meta['device']} (provenance: the sweep CSV and the ledger)")
    if sweep:
        best = fastest(sweep, ("shape", "M", "op"))
        print_table("best streaming-body variant per op (default tiles: stream us of the table below)",
                    ["shape", "M", "op", "body", "BLOCK_N", "parts", "split", "programs", "BLOCK_K", "stages", "warps",
                     "us", "default us", "%copy"],
                    [[r["shape"], str(r["M"]), r["op"], r["body"], str(r["block_n"]), str(r["parts"]),
                      str(r["split_k"]), str(r["programs"]),
                      str(r["BLOCK_K"]), str(r["num_stages"]), str(r["num_warps"]), f"{r['us']:.2f}",
                      f"{r['default_us']:.2f}", f"{r['pct_copy']:.0f}"] for r in best.values()])
    cols = [f"{b}_us" for b in bodies]
    print_table(f"multi-row bodies, us per call ({meta['device']}, {meta['commit']}, copy {copy_gbps:.0f} GB/s; "
                "best: the fastest streaming variant)",
                ["shape", "M", "op", "weight MB", "unfused"] + list(bodies) + ["best", "x unfused", "%copy", "rel err"],
                [[r["shape"], str(r["M"]), r["op"], f"{r['weight_mb']:.2f}", f"{r['unfused_us']:.2f}"]
                 + [f"{r[c]:.2f}" for c in cols]
                 + ([r["best_stream"], f"{r['best_vs_unfused']:.2f}", f"{r['pct_copy']:.0f}",
                     f"{r['rel_err']:.1e}"] if "best_stream" in r else ["-"] * 4) for r in rows])


def timed(fn, fused: bool) -> float:
    """us per call in a graph of back-to-back calls; ``fused=False`` switches the ops path to cuBLAS."""
    with options.use(fused_linear=fused):
        fn()  # compile outside the capture
        return time_graph(fn, calls=50 if CUDA else 1, replays=20 if CUDA else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "kernels")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--sweep", action="store_true", help="also time the variants of sweep_variants at M = 1")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None, help="subset of shapes")
    ap.add_argument("--rows", nargs="+", type=int, default=None, help="subset of row counts M")
    ap.add_argument("--ops", nargs="+", default=None, help="subset of ops")
    ap.add_argument("--kinds", nargs="+", choices=["stream", "gemv"], default=["stream", "gemv"],
                    help="--sweep: the streaming body's tiles at one row, GEMV tiles or both")
    ap.add_argument("--small-m", action="store_true",
                    help="unfused vs the streaming body at M in {8, 17, 33, 49} (or --rows)")
    ap.add_argument("--small-m-sweep", action="store_true", help="with --small-m: the streaming body's tile variants")
    ap.add_argument("--small-m-grid", action="store_true",
                    help="with --small-m: the streaming body's tiles x K-loop settings (stream_grid) instead")
    ap.add_argument("--bodies", nargs="+", choices=sorted(BODIES), default=list(BODIES),
                    help="--small-m: the streaming body with (stream) and without (no_prefetch) its L2 prefetch")
    ap.add_argument("--write-tiles", type=Path, default=None,
                    help="with --small-m-sweep / --small-m-grid / --tiles-from: write a tile table (JSON) here")
    ap.add_argument("--tiles-from", type=Path, default=None,
                    help="a bench_linear_small_m_sweep CSV to make the --write-tiles table from (nothing is timed)")
    ap.add_argument("--tile-rows", nargs=2, type=int, metavar=("LO", "HI"), default=None,
                    help="the rows the table's entries hold for (default: the M each was measured at)")
    ap.add_argument("--tiles-min-gain", type=float, default=0.02,
                    help="an entry only where the fastest variant beats the default by more than this fraction")
    args = ap.parse_args()
    if args.tiles_from:
        if not args.write_tiles:
            raise SystemExit("error: --tiles-from needs --write-tiles PATH")
        return write_tiles(args.write_tiles, read_sweep_csv(args.tiles_from), args, f"{args.tiles_from.name}")
    dtype = torch.bfloat16 if CUDA else torch.float32
    shapes = {"tiny": TINY} if args.quick else {k: v for k, v in SHAPES.items() if not args.shapes or k in args.shapes}
    copy_gbps = copy_bandwidth_gbps() if CUDA else float("nan")
    meta = dict(commit=git_commit(), device=device_name(), date=datetime.datetime.now().isoformat(timespec="seconds"))
    if args.small_m or args.small_m_sweep or args.small_m_grid:
        return small_m_main(args, shapes, dtype, copy_gbps, meta)
    rows_m = [1, 5] if args.quick else (args.rows or [1, 17, 64])
    rows, sweep = [], []
    gen = torch.Generator().manual_seed(0)
    for sname, s in shapes.items():
        for M in rows_m:
            for op, (call, call_cfg, wbytes) in make_ops(s, M, dtype, gen).items():
                if args.ops and op not in args.ops:
                    continue
                fused_us, unfused_us = timed(lambda: call_cfg(None), True), timed(call, False)
                # qkv: the default splits each head over several programs; one program per head beside it
                one_per_head_us = timed(lambda: call_cfg({"parts": 1}), True) if op == "qkv" else float("nan")
                gbps = wbytes / (fused_us * 1e-6) / 1e9
                rows.append(dict(meta, shape=sname, M=M, op=op, weight_mb=wbytes / 1e6, fused_us=fused_us,
                                 unfused_us=unfused_us, speedup=unfused_us / fused_us, fused_gbps=gbps,
                                 pct_copy=100 * gbps / copy_gbps, qkv_one_program_per_head_us=one_per_head_us))
                if args.sweep and M == 1:
                    for tile, bk, stages, warps in sweep_variants(op, s, args.quick, args.kinds):
                        cfg = dict(tile, BLOCK_K=bk, num_stages=stages, num_warps=warps)
                        try:
                            us = timed(lambda: call_cfg(cfg), True)
                        except Exception as exc:  # e.g. out of shared memory for this tile
                            us = float("nan")
                            print(f"sweep {sname} M={M} {op} {cfg}: {type(exc).__name__}", flush=True)
                        sweep.append(dict(meta, shape=sname, M=M, op=op, gemv=bool(tile.get("gemv")),
                                          block_n=tile.get("block_n", ""), parts=tile.get("parts", ""),
                                          programs=tile.get("programs") or "", BLOCK_K=bk, num_stages=stages,
                                          num_warps=warps, us=us,
                                          pct_copy=100 * wbytes / (us * 1e-6) / 1e9 / copy_gbps))
            print(f"done {sname} M={M}", flush=True)
    write_csvs(args.out, {"bench_linear.csv": rows, "bench_linear_sweep.csv": sweep})
    if sweep:
        best = fastest(sweep, ("shape", "M", "op", "gemv"))
        print_table("best sweep config per op", ["shape", "M", "op", "gemv", "BLOCK_N", "parts", "programs",
                                                 "BLOCK_K", "stages", "warps", "us", "%copy"],
                    [[r["shape"], str(r["M"]), r["op"], str(r["gemv"]), str(r["block_n"]), str(r["parts"]),
                      str(r["programs"]), str(r["BLOCK_K"]), str(r["num_stages"]), str(r["num_warps"]),
                      f"{r['us']:.2f}", f"{r['pct_copy']:.0f}"] for r in best.values()])
    print_table(f"fused small-M layer kernels vs unfused ({meta['device']}, {meta['commit']}, copy {copy_gbps:.0f} GB/s)",
                ["shape", "M", "op", "weight MB", "fused us", "unfused us", "x", "GB/s", "%copy"],
                [[r["shape"], str(r["M"]), r["op"], f"{r['weight_mb']:.2f}", f"{r['fused_us']:.2f}",
                  f"{r['unfused_us']:.2f}", f"{r['speedup']:.2f}", f"{r['fused_gbps']:.0f}", f"{r['pct_copy']:.0f}"]
                 for r in rows])


if __name__ == "__main__":
    main()
