"""Benchmark: paged attention (decode and tree verify) vs torch SDPA and flex_attention.

Question: is paged_attention bandwidth-bound on decode / tree-verify shapes (KV bytes read per second
as a fraction of the device copy bandwidth), and how much faster is it than the stock alternatives?
Sweep: configs 9q/3kv d64 (SmolLM2) and 32q/8kv d128 (Llama-3.1-8B), B in {1, 8, 64},
prefix in {512, 1024, 4096, 16384}, T in {1, 8, 16, 64} new tokens per request (T = 1: decode,
causal; T > 1: a random tree with an ancestor bitmask per node), bf16, page size 16, pages shuffled.

Timing: "rotating" = one CUDA graph of back-to-back calls over R copies of the inputs (R KV pools of
one shape, R * KV bytes >= 256 MB, so no call finds its KV in the 50 MB L2), time per call; the
steady state of a step that runs the kernel among others. "flush" = one call replayed from a graph
after do_bench's L2 flush, a memset that leaves the L2 full of dirty lines whose write-back the
timed call then pays (H200, headline shape: 30.9 us flush vs 24.1 rotating, and a same-size copy
17.7 vs 14.1 us).

Columns (per shape):
  us            paged_attention, rotating timing (includes the split merge).
  us flush      the same, flush timing (the table's earlier method).
  GB/s, %copy   KV bytes read (B * kv_len * HKV * D * 2 bytes * 2 for K and V) / time, and that as a
                fraction of the device copy bandwidth measured in this run (1 GiB copy_, read + write).
  copy us, x copy   a device copy moving the same bytes (KV bytes / 2 read + written), rotating
                timing; x copy = copy us / us (1.0: as fast as a copy of the same size, which pays
                the same launch, ramp and tail; at 50 MB the copy itself reaches ~86% of the 1 GiB rate).
  sdpa us       torch SDPA (rotating timing), boolean mask [B, 1, T, L] (none for T = 1), K/V already gathered from the
                pages into contiguous [B, HQ, L, D] with GQA expanded OUTSIDE the timed region.
  flex us       torch.compile(flex_attention) (rotating timing), K/V gathered into [B, HKV, L, D] (enable_gqa) and the
                tree block mask built outside the timed region. Compiles are slow, so flex runs only
                at prefix 1024 and 16384, in sweep order (headline shape first), until it has used
                --flex-budget-s; other shapes show "skip (subset)" / "skip (budget)".
                Every baseline output is checked against paged_attention's (notes column).
  x sdpa/x flex baseline time / paged_attention time.

Run:  python experiments/kernels/bench_attention.py --out outputs/kernels   (~3-4 min)
      python experiments/kernels/bench_attention.py --tune --out DIR   (launch-config sweep on key shapes)
      python experiments/kernels/bench_attention.py --tune --tune-shapes 64,1024,16 --out DIR   (one of them)
      python experiments/kernels/bench_attention.py --quick --out /tmp/bench   (two tiny shapes; CPU
      smoke run under TRITON_INTERPRET=1 when there is no GPU, timings meaningless)
"""

import argparse
import csv
import datetime
import math
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
from specdec.bench.timing import copy_bandwidth_gbps, time_graph  # noqa: E402

import triton  # noqa: E402

import kernels_triton.attention_launch as launch  # noqa: E402
from kernels_triton.attention import paged_attention, paged_attention_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DEVICE_OBJ = torch.device(DEVICE)
PS = 16
CONFIGS = {"9q/3kv d64": (9, 3, 64), "32q/8kv d128": (32, 8, 128)}
HEADLINE = ("9q/3kv d64", 64, 1024, 16)  # the tree-verify target: >= 70% copy BW, >= 5x SDPA
ROTATE_BYTES = 256 << 20  # rotating timing: distinct KV bytes cycled through (the H200 L2 is 50 MB)
MAX_POOLS = 64  # at most this many input copies; tiny shapes then rotate less (noted)
L2_BYTES = 50 << 20  # H200
FLEX_PREFIXES = (1024, 16384)  # flex compiles per shape (~5-20 s each): a subset, within --flex-budget-s


# ------------------------------------------------------------------------------------- timers


def time_us(fn):
    """Median device time per call in us: fn captured once in a CUDA graph (falls back to eager when
    capture fails), replayed under do_bench with the L2 flushed before each replay. Returns
    (us, how) with how in {"graph", "eager"}."""
    if not CUDA:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6, "cpu"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, allocator) outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    run, how = fn, "eager"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        run, how = graph.replay, "graph"
    except Exception:  # e.g. a compiled baseline that refuses capture: time it eagerly
        torch.cuda.synchronize()
    return triton.testing.do_bench(run, warmup=5, rep=25, return_mode="median") * 1e3, how


def time_rotating(fns):
    """Device us per call of a CUDA graph running fns (one per input copy) back to back, twice; the
    mean over 20 replays. CPU: one eager pass (timings meaningless)."""
    if not CUDA:
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - t0) * 1e6 / len(fns)
    return time_graph(lambda: [fn() for fn in fns], calls=2) / len(fns)


def n_pools(kv_bytes):
    return min(MAX_POOLS, max(1, math.ceil(ROTATE_BYTES / kv_bytes))) if CUDA else 1




# ------------------------------------------------------------------------------------- inputs


def tree_masks(T, gen):
    """Random tree of T nodes (node 0 the root, parent[i] < i): ancestor bitmask incl. self (int64)."""
    masks = []
    for i in range(T):
        parent = int(torch.randint(0, i, (1,), generator=gen)) if i > 0 else -1
        masks.append((1 << i) | (masks[parent] if parent >= 0 else 0))
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]


class Pool:
    """One layer's page pool for B requests of capacity prefix + max_T slots; pages shuffled."""

    def __init__(self, B, prefix, heads, dtype, max_T, seed=0):
        HQ, HKV, D = heads
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        pages_per_req = math.ceil((prefix + max_T) / PS)
        P = B * pages_per_req + 1
        perm = torch.randperm(P, device=DEVICE, generator=gen)
        self.page_table = perm[: B * pages_per_req].view(B, pages_per_req).to(torch.int32)
        self.k_cache = torch.randn(P, PS, HKV, D, device=DEVICE, dtype=dtype, generator=gen)
        self.v_cache = torch.randn(P, PS, HKV, D, device=DEVICE, dtype=dtype, generator=gen)
        self.B, self.prefix, self.heads, self.dtype = B, prefix, heads, dtype

    def batch(self, T, seed=0):
        """Kernel inputs for T new tokens per request (kv_len = prefix + T) and the tree mask."""
        HQ, HKV, D = self.heads
        B = self.B
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(B * T, HQ, D, generator=gen).to(DEVICE, self.dtype)
        cu = torch.arange(B + 1, dtype=torch.int32, device=DEVICE) * T
        kv_lens = torch.full((B,), self.prefix + T, dtype=torch.int32, device=DEVICE)
        tm = None
        if T > 1:
            tm = torch.tensor([m for _ in range(B) for m in tree_masks(T, gen)], dtype=torch.int64, device=DEVICE)
        args = dict(q=q, k_cache=self.k_cache, v_cache=self.v_cache, page_table=self.page_table,
                    cu_q_lens=cu, kv_lens=kv_lens, tree_mask=tm)  # fmt: skip
        return args

    def gathered(self, T):
        """K, V as contiguous [B, HKV, L, D] (L = prefix + T), read through the page table."""
        L = self.prefix + T
        slots = torch.arange(L, device=DEVICE)
        pages = self.page_table[:, slots // PS].long()  # [B, L]
        k = self.k_cache[pages, slots % PS].permute(0, 2, 1, 3).contiguous()  # [B, HKV, L, D]
        v = self.v_cache[pages, slots % PS].permute(0, 2, 1, 3).contiguous()  # [B, HKV, L, D]
        return k, v


def dense_mask(tree_mask, B, T, prefix):
    """Boolean [B, 1, T, prefix + T] visibility: whole prefix, then the tree's ancestor bits."""
    L = prefix + T
    mask = torch.ones(B, 1, T, L, dtype=torch.bool, device=DEVICE)
    j = torch.arange(T, device=DEVICE)
    bits = (tree_mask.view(B, T, 1) >> j) & 1  # [B, T, T]
    mask[:, 0, :, prefix:] = bits.bool()
    return mask


# ------------------------------------------------------------------------------------- baselines


_FLEX = None


def flex_fn():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        # Every shape / prefix recompiles; past dynamo's default limit (8) flex would silently fall
        # back to its eager path (which materializes the scores) and time that instead.
        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 256)
        _FLEX = torch.compile(flex_attention)
    return _FLEX


def flex_case(tree_mask, q4, k, v, B, T, prefix):
    """A callable running compiled flex_attention on gathered K/V with the tree as a block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = None
    if tree_mask is not None:
        tm = tree_mask.view(B, T)

        def mask_mod(b, h, q_idx, kv_idx):
            j = kv_idx - prefix
            bit = (tm[b, q_idx] >> torch.clamp(j, min=0)) & 1
            return (j < 0) | (bit == 1)

        block_mask = create_block_mask(mask_mod, B, None, T, prefix + T, device=DEVICE)
    fn = flex_fn()
    return lambda: fn(q4, k, v, block_mask=block_mask, enable_gqa=True)


# ------------------------------------------------------------------------------------- cases


def check_correctness(dtype):
    """paged_attention vs the reference on small decode and tree shapes of both configs (assert)."""
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    for name, heads in CONFIGS.items():
        for T in (1, 5):
            pool = Pool(B=3, prefix=77, heads=heads, dtype=dtype, max_T=T, seed=1)
            args = pool.batch(T, seed=1)
            for ns in (1, 3):
                out = paged_attention(**args, max_q_len=T, num_splits=ns)
                ref = paged_attention_ref(**args)
                err = (out.float() - ref.float()).abs().max().item()
                assert err < tol, f"{name} T={T} num_splits={ns}: max abs error {err:.3e} >= {tol}"
    print(f"correctness vs paged_attention_ref: ok ({str(dtype).replace('torch.', '')}, tol {tol})", file=sys.stderr)


def measure(name, heads, pools, T, copy_gbps, flex_state, dtype):
    HQ, HKV, D = heads
    pool = pools[0]
    B, prefix = pool.B, pool.prefix
    L = prefix + T
    all_args = [p.batch(T, seed=B + prefix + T) for p in pools]
    args = all_args[0]
    cfg = launch.launch_config(T, HQ // HKV, D, dtype)
    n_qblocks = triton.cdiv(T, cfg["BLOCK_T"])
    splits, _ = launch.default_split_count(B, HKV, D, n_qblocks, pool.page_table.shape[1] * PS, cfg, DEVICE_OBJ,
                                         pool.dtype)
    kv_bytes = B * L * HKV * D * 2 * pool.k_cache.element_size()
    row = dict(config=name, B=B, prefix=prefix, T=T, mode="decode" if T == 1 else "tree", splits=splits,
               block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"], kv_bytes=kv_bytes, copies=len(pools))  # fmt: skip
    notes = []
    rotated = len(pools) * kv_bytes
    if CUDA and rotated < ROTATE_BYTES:  # MAX_POOLS copies of a tiny shape: 50 MB or less fits the L2
        notes.append(f"{'L2-warm, ' if rotated <= L2_BYTES else ''}{rotated / 2**20:.0f} MB rotated")

    ours = [lambda a=a: paged_attention(**a, max_q_len=T) for a in all_args]
    out = ours[0]()
    us = time_rotating(ours)
    row.update(us=us, timing="rotating" if CUDA else "cpu", gbps=kv_bytes / (us * 1e-6) / 1e9)
    row["pct_copy"] = 100 * row["gbps"] / copy_gbps
    row["us_flush"], _ = time_us(ours[0])
    half = kv_bytes // 2 // 2  # bf16 / fp16 elements read (and written) by the same-size copy
    srcs = [torch.randn(half, device=DEVICE).to(pool.k_cache.dtype) for _ in pools]
    dsts = [torch.empty_like(x) for x in srcs]
    row["copy_us"] = time_rotating([lambda x=x, y=y: y.copy_(x) for x, y in zip(srcs, dsts)])
    row["x_copy"] = row["copy_us"] / us
    del srcs, dsts

    # Baselines on gathered, contiguous K/V (gather and mask building not timed).
    q4s = [a["q"].view(B, T, HQ, D).transpose(1, 2) for a in all_args]  # [B, HQ, T, D]
    want = out.view(B, T, HQ, D).transpose(1, 2).float()
    G = HQ // HKV
    sdpa_in = []
    for p, a in zip(pools, all_args):
        k, v = p.gathered(T)  # [B, HKV, L, D]
        mask = dense_mask(a["tree_mask"], B, T, prefix) if T > 1 else None
        sdpa_in.append((k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), mask))  # [B, HQ, L, D]
        del k, v
    sdpa = [lambda q4=q4, x=x: torch.nn.functional.scaled_dot_product_attention(q4, x[0], x[1], attn_mask=x[2])
            for q4, x in zip(q4s, sdpa_in)]  # fmt: skip
    err = (sdpa[0]().float() - want).abs().max().item()
    if err > 3e-2:
        notes.append(f"sdpa mismatch {err:.1e}")
    row["sdpa_us"] = time_rotating(sdpa)
    row["x_sdpa"] = row["sdpa_us"] / us
    del sdpa, sdpa_in

    row["flex_us"] = row["x_flex"] = float("nan")
    t_flex = time.perf_counter()
    if not CUDA:
        row["flex"] = "skip (cpu)"
    elif prefix not in FLEX_PREFIXES:
        row["flex"] = "skip (subset)"
    elif flex_state["spent_s"] > flex_state["budget_s"]:
        row["flex"] = "skip (budget)"
    else:
        try:
            flex = []
            for p, a, q4 in zip(pools, all_args, q4s):
                k, v = p.gathered(T)
                flex.append(flex_case(a["tree_mask"], q4, k, v, B, T, prefix))
            err = (flex[0]().float() - want).abs().max().item()
            if err > 3e-2:
                notes.append(f"flex mismatch {err:.1e}")
            row["flex_us"] = time_rotating(flex)
            row["x_flex"] = row["flex_us"] / us
            row["flex"] = "rotating"
            del flex
        except Exception as e:  # report, keep sweeping
            row["flex"] = "error"
            notes.append(f"flex {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
        flex_state["spent_s"] += time.perf_counter() - t_flex
    row["notes"] = "; ".join(notes)
    return row


def sweep(quick):
    if quick:
        return [("9q/3kv d64", 2, 64, 1), ("9q/3kv d64", 2, 64, 8)]
    shapes = [(n, B, p, T) for n in CONFIGS for B in (1, 8, 64)
              for p in (512, 1024, 4096, 16384) for T in (1, 8, 16, 64)]  # fmt: skip
    shapes.remove(HEADLINE)
    return [HEADLINE] + shapes  # headline first: flex's budget is spent on it for sure


def run_sweep(args, copy_gbps, dtype):
    rows = []
    pools = {}
    flex_state = dict(spent_s=0.0, budget_s=args.flex_budget_s)
    shapes = sweep(args.quick)
    for name, B, prefix, T in shapes:
        heads = CONFIGS[name]
        key = (name, B, prefix)
        if key not in pools:
            pools.clear()  # one pool alive at a time (up to 4.3 GB of KV at B=64, 16k, d128)
            if CUDA:
                torch.cuda.empty_cache()
            max_T = max(t for n, b, p, t in shapes if (n, b, p) == key)
            HQ, HKV, D = heads
            kv_max = B * (prefix + max_T) * HKV * D * 4
            pools[key] = [Pool(B, prefix, heads, dtype, max_T=max_T, seed=i) for i in range(n_pools(kv_max))]
        rows.append(measure(name, heads, pools[key], T, copy_gbps, flex_state, dtype))
        r = rows[-1]
        print(f"  {name} B={B} prefix={prefix} T={T}: {r['us']:.1f} us ({r['pct_copy']:.0f}% copy), "
              f"sdpa {r['sdpa_us']:.1f} us, flex {r['flex_us']:.1f} us {r['notes']}", file=sys.stderr)  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------- tuning


def run_tune(copy_gbps, dtype, quick, only=None):
    """Time candidate launch configs (BLOCK_N, num_warps, num_stages) and split counts on key shapes
    by swapping launch.launch_config; prints the best per shape. Uses no baseline."""
    rows = []
    default_cfg_fn = launch.launch_config
    key_shapes = ((1, 16384, 1), (8, 4096, 1), (64, 4096, 1), (64, 1024, 16))  # (B, prefix, T)
    shapes = [(n, B, p, T) for n in CONFIGS for (B, p, T) in key_shapes if not only or (B, p, T) in only]
    grid = dict(block_n=(32, 64, 128), warps=(4, 8), stages=(3, 5))  # ~100 compiles, ~3 min on an H200 host
    if quick:
        shapes, grid = [("9q/3kv d64", 2, 64, 8)], dict(block_n=(32, 64), warps=(4,), stages=(2,))
    for name, B, prefix, T in shapes:
        heads = CONFIGS[name]
        HQ, HKV, D = heads
        pool = Pool(B, prefix, heads, dtype, max_T=T)
        args = pool.batch(T)
        base = default_cfg_fn(T, HQ // HKV, D, dtype)
        n_qblocks = triton.cdiv(T, base["BLOCK_T"])
        kv_bytes = B * (prefix + T) * HKV * D * 2 * pool.k_cache.element_size()
        ref = paged_attention(**args, max_q_len=T).float()
        best = None
        candidates = [base] + [dict(base, BLOCK_N=bn, num_warps=w, num_stages=st)
                               for bn in grid["block_n"] for w in grid["warps"] for st in grid["stages"]]  # fmt: skip
        candidates = [c for i, c in enumerate(candidates) if c not in candidates[:i]]
        d_fused = launch.default_fused_merge(base, T, HQ // HKV, D)
        for cfg in candidates:
            d_splits = launch.default_num_splits(B, HKV, D, n_qblocks, pool.page_table.shape[1] * PS, cfg, DEVICE_OBJ)
            split_counts = sorted({max(1, d_splits // 2), d_splits, min(launch.MAX_SPLITS, d_splits * 2)})
            for splits, fused in [(s, f) for s in split_counts for f in ((False, True) if s > 1 else (d_fused,))]:
                fn = lambda: paged_attention(**args, max_q_len=T, num_splits=splits, fused_merge=fused)  # noqa: E731
                launch.launch_config = lambda *a, cfg=cfg: cfg  # noqa: E731
                try:
                    err = (fn().float() - ref).abs().max().item()
                    us, _ = time_us(fn)
                except Exception as e:  # e.g. out of shared memory or registers
                    print(f"    {cfg} splits={splits}: {type(e).__name__}", file=sys.stderr)
                    continue
                finally:
                    launch.launch_config = default_cfg_fn
                is_default = (cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"], splits, fused) == (
                    base["BLOCK_N"], base["num_warps"], base["num_stages"], d_splits, d_fused)  # fmt: skip
                row = dict(config=name, B=B, prefix=prefix, T=T, block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"],
                           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], splits=splits,
                           fused_merge=fused and splits > 1, us=us,
                           pct_copy=100 * kv_bytes / (us * 1e-6) / 1e9 / copy_gbps, max_err=err,
                           default=is_default)  # fmt: skip
                rows.append(row)
                if best is None or us < best["us"]:
                    best = row
        dflt = [r for r in rows if r["default"] and (r["config"], r["B"], r["prefix"], r["T"]) == (name, B, prefix, T)]
        print(f"  {name} B={B} prefix={prefix} T={T}: default {dflt[0]['us'] if dflt else float('nan'):.1f} us, "
              f"best {best['us']:.1f} us ({best['pct_copy']:.0f}% copy) with BLOCK_N={best['block_n']} "
              f"warps={best['num_warps']} stages={best['num_stages']} splits={best['splits']} "
              f"fused merge={best['fused_merge']}",
              file=sys.stderr)  # fmt: skip
        del pool, args
        if CUDA:
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- output


TABLE_COLS = [  # (csv key, header, format)
    ("config", "config", "{}"), ("B", "B", "{}"), ("prefix", "prefix", "{}"), ("T", "T", "{}"),
    ("splits", "splits", "{}"), ("us", "us", "{:.1f}"), ("gbps", "GB/s", "{:.0f}"), ("pct_copy", "%copy", "{:.0f}"),
    ("us_flush", "us flush", "{:.1f}"), ("copy_us", "copy us", "{:.1f}"), ("x_copy", "x copy", "{:.2f}"),
    ("sdpa_us", "sdpa us", "{:.1f}"), ("x_sdpa", "x sdpa", "{:.1f}"),
    ("flex_us", "flex us", "{:.1f}"), ("x_flex", "x flex", "{:.1f}"), ("flex", "flex", "{}"), ("notes", "notes", "{}"),
]  # fmt: skip
TUNE_COLS = [
    ("config", "config", "{}"), ("B", "B", "{}"), ("prefix", "prefix", "{}"), ("T", "T", "{}"),
    ("block_m", "BM", "{}"), ("block_n", "BN", "{}"), ("num_warps", "warps", "{}"), ("num_stages", "stages", "{}"),
    ("splits", "splits", "{}"), ("fused_merge", "fused", "{}"), ("us", "us", "{:.1f}"), ("pct_copy", "%copy", "{:.0f}"),
    ("default", "default", "{}"),
]  # fmt: skip


def print_table(rows, cols, title):
    def cell(row, key, fmt):
        val = row.get(key, "")
        try:
            return fmt.format(val) if not (isinstance(val, float) and math.isnan(val)) else "-"
        except (ValueError, TypeError):
            return str(val)

    cells = [[cell(row, key, fmt) for key, _, fmt in cols] for row in rows]
    headers = [header for _, header, _ in cols]
    console_table(title, headers, cells)


def write_csv(rows, path, extra):
    fields = list(extra) + list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({**extra, **row})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "kernels",
                        help="directory for the CSV")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="two tiny shapes (CPU smoke run); with --tune one")
    parser.add_argument("--tune", action="store_true", help="sweep launch configs on key shapes instead")
    parser.add_argument("--tune-shapes", nargs="+", default=None, metavar="B,PREFIX,T",
                        help="with --tune: only these of the key shapes, e.g. 64,1024,16 (the tree headline)")
    parser.add_argument("--flex-budget-s", type=float, default=90.0,
                        help="wall seconds flex_attention (compiles included) may use before it is skipped",
                        )  # fmt: skip
    args = parser.parse_args()

    dtype = torch.bfloat16 if CUDA else torch.float32  # the interpreter's bf16 tl.dot is broken
    device_name = torch.cuda.get_device_name() if CUDA else "cpu (TRITON_INTERPRET=1)"
    t_start = time.perf_counter()
    check_correctness(dtype)
    copy_gbps = copy_bandwidth_gbps()
    only = None
    if args.tune_shapes:
        try:
            only = {tuple(int(v) for v in spec.split(",")) for spec in args.tune_shapes}
        except ValueError:
            parser.error(f"--tune-shapes takes B,PREFIX,T triples of ints, got {args.tune_shapes}")
        if any(len(t) != 3 for t in only):
            parser.error(f"--tune-shapes takes B,PREFIX,T triples, got {args.tune_shapes}")
    rows = run_tune(copy_gbps, dtype, args.quick, only) if args.tune else run_sweep(args, copy_gbps, dtype)

    commit = git_commit()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_attention_tune" if args.tune else "bench_attention"
    path = args.out / f"{stem}_{datetime.datetime.now():%Y%m%d-%H%M%S}.csv"
    extra = dict(commit=commit, device=device_name, date=date, dtype=str(dtype).replace("torch.", ""),
                 page_size=PS, copy_gbps=copy_gbps)  # fmt: skip
    write_csv(rows, path, extra)

    print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")
    print(f"device {device_name}, commit {commit}, {date}, {extra['dtype']}, page size {PS}, "
          f"copy bandwidth {copy_gbps:.0f} GB/s (read + write)")  # fmt: skip
    if args.tune:
        best = {}
        for r in rows:
            key = (r["config"], r["B"], r["prefix"], r["T"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
        shown = [r for r in rows if r["default"]] + list(best.values())
        print_table(shown, TUNE_COLS, "paged_attention launch configs: defaults, then the best per shape")
    else:
        print("sdpa: K/V pre-gathered to contiguous [B, HQ, L, D] (GQA expanded) and the bool mask built "
              "outside the timed region; flex: K/V pre-gathered to [B, HKV, L, D], block mask prebuilt")  # fmt: skip
        print_table(rows, TABLE_COLS, "paged_attention (paged, tree mask) vs SDPA / flex_attention")


if __name__ == "__main__":
    main()
