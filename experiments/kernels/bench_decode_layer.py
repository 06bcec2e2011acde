"""Benchmark: one SmolLM2-135M decoder layer's decode step, previous vs fused kernel composition.

Question: how much of the batch-1 decode step (1.117 ms for 30 layers on the H200, target 0.62 ms)
do the launch-cutting fusions recover, and what does split-KV attention cost when a short request
sits in a page table sized for 8192 slots?

Both compositions run the real model's layer on random bf16 weights (hidden 576, 9 q / 3 kv heads
of d64, FFN 1536), T = 1 token per request, the page table as wide as the engine's (--capacity
slots per request, pages shuffled), 30 layers with their own weights and caches (270 MB of weights
per step, as in the model, so L2 does not hold them):
  old  rms_norm(+res), qkv GEMM, rope, write_kv_, paged_attention (split count from the previous
       rule: >= 2 tiles of capacity per split) [+ merge], o GEMM, rms_norm(+res), w13 GEMM,
       torch silu(gate) * up (2 kernels), w2 GEMM
  new  rms_norm(+res), qkv GEMM, rope_write_kv_, paged_attention (default split count: >= 4 tiles
       of capacity per split; empty splits exit at once) [+ merge], o GEMM, rms_norm(+res), w13 GEMM,
       silu_mul, w2 GEMM

Columns:
  old / new us     per layer: one CUDA graph holding the 30-layer step, replayed, step time / 30
  saved us         old - new, per layer (x 30 for the step)
  kern old / new   device kernels per layer (torch.profiler over one eager step, / 30)
  rope+kv, silu    the pieces alone, 30 calls (one per layer) in a graph: old -> new us per call
  attn old / new   paged_attention alone per call, split count of each rule (in brackets)
  attn best        the fastest split count of the sweep {1, 2, 4, ..., 64} and its us per call
The attention sweep (every split count) is printed before the summary and written to the CSV.

Run:  python experiments/kernels/bench_decode_layer.py --out outputs/kernels   (~2-3 min)
      python experiments/kernels/bench_decode_layer.py --quick --out /tmp/bench   (CPU smoke run
      under TRITON_INTERPRET=1 when there is no GPU: 2 layers, fp32, timings meaningless)
"""

import argparse
import contextlib
import csv
import datetime
import math
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Must precede the first @triton.jit (kernels_triton import below).
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without `pip install -e .`
from specdec.bench.provenance import git_commit  # noqa: E402
from specdec.bench.timing import copy_bandwidth_gbps  # noqa: E402
from specdec.bench.timing import time_graph as _time_graph  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels_triton.attention_launch as launch  # noqa: E402
from kernels_triton.activation import silu_mul, silu_mul_ref  # noqa: E402
from kernels_triton.attention import paged_attention, write_kv_  # noqa: E402
from kernels_triton.norm import rms_norm  # noqa: E402
from kernels_triton.rope import rope, rope_tables, rope_write_kv_  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
H, F, HQ, HKV, D = 576, 1536, 9, 3, 64  # SmolLM2-135M
EPS = 1e-5
PS = 16
ROPE_BASE, ROPE_ROWS = 100000.0, 8192
OLD_MIN_SPLIT_TILES = 2  # the split rule before MIN_SPLIT_TILES (>= 2 tiles of capacity per split)


def time_graph(fn):
    return _time_graph(fn, calls=1, replays=50)


@triton.jit
def empty_kernel(x_ptr):
    pass


# ------------------------------------------------------------------------------------- timers




def count_kernels(fn):
    """Device kernels (and memsets / copies) one eager fn() launches, from torch.profiler; NaN on CPU."""
    if not CUDA:
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as exc:  # profiler unavailable: report, keep benchmarking
        print(f"  kernel count failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return float("nan")




@contextlib.contextmanager
def min_split_tiles(n):
    """Temporarily set the split rule's per-split minimum (to reproduce the previous rule)."""
    saved = launch.MIN_SPLIT_TILES
    launch.MIN_SPLIT_TILES = n
    try:
        yield
    finally:
        launch.MIN_SPLIT_TILES = saved


def default_splits(B, capacity, min_tiles, dtype):
    cfg = launch.launch_config(1, HQ // HKV, D, dtype)
    with min_split_tiles(min_tiles):
        return launch.default_num_splits(B, HKV, D, 1, capacity, cfg, torch.device(DEVICE))


# ------------------------------------------------------------------------------------- the layer


class Stack:
    """n_layers SmolLM2 layers (own weights and KV pools) and a decode batch: B requests with kv_len
    = ctx (ctx - 1 cached slots plus the new token), page tables capacity / PS pages wide."""

    def __init__(self, n_layers, B, ctx, capacity, dtype, seed=0):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)

        def rand(*shape, std=0.02):
            return (torch.randn(*shape, device=DEVICE, generator=gen) * std).to(dtype)

        self.layers = []
        pages_per_req = math.ceil(ctx / PS)
        P = B * pages_per_req + 1  # + a spare page that unused table entries point at
        for _ in range(n_layers):
            self.layers.append(dict(
                attn_norm=1 + rand(H), mlp_norm=1 + rand(H),
                wqkv=rand((HQ + 2 * HKV) * D, H), wo=rand(H, HQ * D), w13=rand(2 * F, H), w2=rand(H, F),
                k_cache=rand(P, PS, HKV, D, std=1.0), v_cache=rand(P, PS, HKV, D, std=1.0),
            ))  # fmt: skip
        perm = torch.randperm(P, device=DEVICE, generator=gen).to(torch.int32)
        MP = capacity // PS
        self.page_table = perm[-1:].repeat(B, MP).contiguous()  # [B, MP] spare page everywhere...
        self.page_table[:, :pages_per_req] = perm[: B * pages_per_req].view(B, pages_per_req)  # ...but the used ones
        self.cu_q_lens = torch.arange(B + 1, dtype=torch.int32, device=DEVICE)
        self.kv_lens = torch.full((B,), ctx, dtype=torch.int32, device=DEVICE)
        last = ctx - 1  # the new token's logical slot
        self.positions = torch.full((B,), last, dtype=torch.int32, device=DEVICE)
        self.slot_mapping = self.page_table[:, last // PS].long() * PS + last % PS  # [B]
        self.cos, self.sin = rope_tables(D, ROPE_ROWS, ROPE_BASE, device=DEVICE)
        self.h0 = rand(B, H, std=1.0)
        self.res0 = rand(B, H, std=1.0)
        self.B = B
        self.weight_bytes = sum(
            t.numel() * t.element_size() for t in self.layers[0].values() if t.dim() == 2
        )  # per layer

    def attention(self, L, q, num_splits):
        return paged_attention(q, L["k_cache"], L["v_cache"], self.page_table, self.cu_q_lens, self.kv_lens,
                               max_q_len=1, num_splits=num_splits)

    def layer_old(self, L, h, res, num_splits):
        B = self.B
        x, res = rms_norm(h, L["attn_norm"], EPS, res)
        q, k, v = (x @ L["wqkv"].t()).split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, k = rope(q.view(B, HQ, D), k.view(B, HKV, D), self.positions, self.cos, self.sin)
        write_kv_(L["k_cache"], L["v_cache"], k, v.reshape(B, HKV, D), self.slot_mapping)
        o = self.attention(L, q, num_splits)
        h = o.reshape(B, HQ * D) @ L["wo"].t()
        x, res = rms_norm(h, L["mlp_norm"], EPS, res)
        gate, up = (x @ L["w13"].t()).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ L["w2"].t(), res

    def layer_new(self, L, h, res, num_splits=None):
        B = self.B
        x, res = rms_norm(h, L["attn_norm"], EPS, res)
        q, k, v = (x @ L["wqkv"].t()).split([HQ * D, HKV * D, HKV * D], dim=-1)
        q = rope_write_kv_(q.view(B, HQ, D), k.view(B, HKV, D), v.view(B, HKV, D), self.positions, self.cos,
                           self.sin, L["k_cache"], L["v_cache"], self.slot_mapping)
        o = self.attention(L, q, num_splits)
        h = o.reshape(B, HQ * D) @ L["wo"].t()
        x, res = rms_norm(h, L["mlp_norm"], EPS, res)
        return silu_mul(x @ L["w13"].t()) @ L["w2"].t(), res

    def step(self, layer_fn, **kw):
        h, res = self.h0, self.res0
        for L in self.layers:
            h, res = layer_fn(L, h, res, **kw)
        return h, res

    # Pieces alone, once per layer (so each call touches its own layer's cache and weights).
    def pieces(self, dtype):
        B = self.B
        qkv = torch.randn(B, (HQ + 2 * HKV) * D, device=DEVICE).to(dtype)
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, k, v = q.view(B, HQ, D), k.view(B, HKV, D), v.view(B, HKV, D)
        gu = torch.randn(B, 2 * F, device=DEVICE).to(dtype)

        def rope_kv_old():
            for L in self.layers:
                qr, kr = rope(q, k, self.positions, self.cos, self.sin)
                write_kv_(L["k_cache"], L["v_cache"], kr, v, self.slot_mapping)

        def rope_kv_new():
            for L in self.layers:
                rope_write_kv_(q, k, v, self.positions, self.cos, self.sin, L["k_cache"], L["v_cache"],
                               self.slot_mapping)

        def silu_old():
            for _ in self.layers:
                gate, up = gu.chunk(2, dim=-1)
                torch.nn.functional.silu(gate) * up

        def silu_new():
            for _ in self.layers:
                silu_mul(gu)

        def attn_with(num_splits):
            def run():
                for L in self.layers:
                    self.attention(L, q, num_splits)
            return run

        # Correctness of the pieces against their references (the tests' references).
        err = (silu_mul(gu).float() - silu_mul_ref(gu).float()).abs().max().item()
        return dict(rope_kv_old=rope_kv_old, rope_kv_new=rope_kv_new, silu_old=silu_old, silu_new=silu_new,
                    attn_with=attn_with, silu_err=err)


# ------------------------------------------------------------------------------------- run


def run_case(B, ctx, capacity, n_layers, dtype, split_sweep):
    stack = Stack(n_layers, B, ctx, capacity, dtype, seed=B * 100003 + ctx)
    old_splits = default_splits(B, capacity, OLD_MIN_SPLIT_TILES, dtype)
    new_splits = default_splits(B, capacity, launch.MIN_SPLIT_TILES, dtype)
    step_old = lambda: stack.step(stack.layer_old, num_splits=old_splits)  # noqa: E731
    step_new = lambda: stack.step(stack.layer_new)  # noqa: E731

    # Same inputs, same caches: outputs agree up to silu_mul's single rounding (bf16) per layer.
    h_old, _ = step_old()
    h_new, _ = step_new()
    rel_err = ((h_new.float() - h_old.float()).abs().max() / h_old.float().abs().max().clamp_min(1e-30)).item()

    row = dict(B=B, ctx=ctx, capacity=capacity, layers=n_layers, splits_old=old_splits, splits_new=new_splits,
               max_rel_err=rel_err)  # fmt: skip
    row["old_us"] = time_graph(step_old) / n_layers
    row["new_us"] = time_graph(step_new) / n_layers
    row["saved_us"] = row["old_us"] - row["new_us"]
    row["kern_old"] = count_kernels(step_old) / n_layers
    row["kern_new"] = count_kernels(step_new) / n_layers
    row["weight_gbps_new"] = stack.weight_bytes / (row["new_us"] * 1e-6) / 1e9

    p = stack.pieces(dtype)
    row["silu_err"] = p["silu_err"]
    for key in ("rope_kv_old", "rope_kv_new", "silu_old", "silu_new"):
        row[key + "_us"] = time_graph(p[key]) / n_layers
    sweep = []
    for ns in sorted(set(split_sweep) | {old_splits, new_splits}):
        us = time_graph(p["attn_with"](ns)) / n_layers
        sweep.append(dict(B=B, ctx=ctx, capacity=capacity, splits=ns, attn_us=us,
                          rule=",".join(name for name, s in (("old", old_splits), ("new", new_splits)) if s == ns)))
    by_splits = {r["splits"]: r["attn_us"] for r in sweep}
    row["attn_old_us"] = by_splits[old_splits]
    row["attn_new_us"] = by_splits[new_splits]
    best = min(sweep, key=lambda r: r["attn_us"])
    row["attn_best_splits"], row["attn_best_us"] = best["splits"], best["attn_us"]
    del stack, p
    if CUDA:
        torch.cuda.empty_cache()
    return row, sweep


SUMMARY_COLS = [  # (key, header, format)
    ("B", "B", "{}"), ("ctx", "ctx", "{}"),
    ("old_us", "old us", "{:.2f}"), ("new_us", "new us", "{:.2f}"), ("saved_us", "saved us", "{:.2f}"),
    ("kern_old", "kern old", "{:.0f}"), ("kern_new", "kern new", "{:.0f}"),
    ("rope_kv", "rope+kv old->new", "{}"), ("silu", "silu old->new", "{}"),
    ("attn_old", "attn old [splits]", "{}"), ("attn_new", "attn new [splits]", "{}"),
    ("attn_best", "attn best [splits]", "{}"), ("max_rel_err", "rel err", "{:.1e}"),
]


def print_table(title, headers, cells):
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        print(title)
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        for c in cells:
            print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right")
    for c in cells:
        table.add_row(*c)
    Console(width=220).print(table)


def summary_cells(row):
    view = dict(row)
    view["rope_kv"] = f"{row['rope_kv_old_us']:.2f} -> {row['rope_kv_new_us']:.2f}"
    view["silu"] = f"{row['silu_old_us']:.2f} -> {row['silu_new_us']:.2f}"
    view["attn_old"] = f"{row['attn_old_us']:.2f} [{row['splits_old']}]"
    view["attn_new"] = f"{row['attn_new_us']:.2f} [{row['splits_new']}]"
    view["attn_best"] = f"{row['attn_best_us']:.2f} [{row['attn_best_splits']}]"
    return [fmt.format(view[key]) for key, _, fmt in SUMMARY_COLS]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "kernels",
                        help="directory for the CSVs")
    parser.add_argument("--quick", action="store_true", help="tiny subset (CPU smoke run)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 1000, 8000],
                        help="kv_len per request (incl. the new token)")
    parser.add_argument("--capacity", type=int, default=8192,
                        help="page-table width in slots (the engine's max_seq_len, SmolLM2: 8192)")
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()

    split_sweep = [1, 2, 4, 8, 16, 32, 64]
    if args.quick:
        args.batches, args.contexts, args.capacity, args.layers = [1], [20], 128, 2
        split_sweep = [1, 2]
    dtype = torch.bfloat16 if CUDA else torch.float32  # the interpreter's bf16 tl.dot is broken
    if max(args.contexts) > args.capacity:
        parser.error(f"--contexts must be <= --capacity ({args.capacity})")
    device_name = torch.cuda.get_device_name() if CUDA else "cpu (TRITON_INTERPRET=1)"

    copy_gbps = copy_bandwidth_gbps()
    dummy = torch.empty(1, device=DEVICE)
    empty_graph_us = time_graph(lambda: empty_kernel[(1,)](dummy))

    rows, sweeps = [], []
    for B in args.batches:
        for ctx in args.contexts:
            row, sweep = run_case(B, ctx, args.capacity, args.layers, dtype, split_sweep)
            rows.append(row)
            sweeps += sweep
            print(f"  measured B={B} ctx={ctx}: old {row['old_us']:.2f} us/layer, new {row['new_us']:.2f}",
                  file=sys.stderr)

    commit = git_commit()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    args.out.mkdir(parents=True, exist_ok=True)
    extra = dict(commit=commit, device=device_name, date=date, dtype=str(dtype).replace("torch.", ""),
                 copy_gbps=copy_gbps, empty_kernel_graph_us=empty_graph_us)
    paths = []
    for name, data in (("bench_decode_layer", rows), ("bench_decode_layer_splits", sweeps)):
        path = args.out / f"{name}_{stamp}.csv"
        fields = list(extra) + list(data[0])
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            for r in data:
                writer.writerow({**extra, **r})
        paths.append(path)

    for path in paths:
        print(f"wrote {path}")
    print(f"device {device_name}, commit {commit}, {date}, dtype {extra['dtype']}, {args.layers} layers, "
          f"page table {args.capacity} slots / request")
    layer_mb = H * ((HQ + 2 * HKV) * D + HQ * D + 3 * F) * torch.finfo(dtype).bits / 8 / 1e6
    print(f"copy bandwidth {copy_gbps:.0f} GB/s (read + write); empty Triton kernel in a graph "
          f"{empty_graph_us:.2f} us; {layer_mb:.1f} MB of weights per layer "
          f"({layer_mb * 1e3 / copy_gbps:.1f} us to read at copy bandwidth)")
    sweep_cells = [[str(r["B"]), str(r["ctx"]), str(r["splits"]), f"{r['attn_us']:.2f}", r["rule"]] for r in sweeps]
    print_table("paged_attention us per call, by split count",
                ["B", "ctx", "splits", "us", "rule"], sweep_cells)
    print_table(f"Decode layer, per layer (x {rows[0]['layers']} = step): previous vs fused composition",
                [h for _, h, _ in SUMMARY_COLS], [summary_cells(r) for r in rows])


if __name__ == "__main__":
    main()
