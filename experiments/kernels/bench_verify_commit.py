"""Benchmark: verify_accept (greedy / stochastic tree verification) and kv_sync_ (the commit), Triton
vs the plain-torch references the tests use.

Question: what do verification and commit cost per step, next to a ~1.2 ms (SmolLM2) / ~5 ms
(Llama-8B) decode step, and how close does verify_accept get to reading the path's logits rows at
copy bandwidth?

verify_accept: B in {1, 8, 64}, T in {1, 8, 16, 64} tree nodes, V = 49152, bf16 logits. Trees are
EAGLE-like (each node hangs off one of the 4 previous nodes); a spine of depth min(4, T - 1) at
random node positions carries planted tokens whose logit is 14 (p ~ 0.94 at temperature 1 against
49152 N(0, 1) logits), so greedy accepts 4 and stochastic ~3.5 on average. Modes: greedy;
sample = temperature 1, deterministic drafts (the EAGLE top-k case); sample_q = temperature 1 with
draft_probs (residual materialised in the workspace on each rejection).
warp_logits (the sampling warpers): V = 49152 and 151936, B x T in {1 x 1, 1 x 17, 64 x 1} rows of bf16
N(0, 4) logits, top-p 0.95 / top-k 50 + top-p 0.9 / min-p 0.05, kernel option warp_tiles off and on;
accept = tokens a row keeps, mismatch = rows whose kept set differs from the reference's.
kv_sync_: SmolLM2-135M pool (30 layers, 3 KV heads, d64), Llama-3.1-8B pool (32 layers, 8 KV heads,
d128) and Llama target + 1-layer draft pool in one call; B in {1, 64}, T = 16, 4 accepted nodes
at random tree positions; prefix ~512, page size 16, shuffled pages.

Columns:
  accept     mean accepted length of the kernel's output (verify) / rows moved per request (sync)
  us         triton.testing.do_bench median (L2 flushed before each call)
  GB/s       verify: logits rows on the path (B x (accept + 1) x V x 2 bytes) / time;
             sync: K/V bytes read + written / time
  %copy      GB/s as a fraction of the device copy bandwidth measured in this run
  ref us     the plain-torch reference (eager; kv_sync_ref_ syncs on a nonzero())
  graph us   per call, replaying a CUDA graph of 20 back-to-back calls (no launch overhead)
  mismatch   requests whose output differs from the reference (stochastic: only ulp-level ties
             between the kernel's and torch's exp/cumsum can cause this; the tests bound it)

Run:  python experiments/kernels/bench_verify_commit.py --out outputs/kernels
      python experiments/kernels/bench_verify_commit.py --quick --out /tmp/bench   (CPU smoke run;
      under TRITON_INTERPRET=1 when there is no GPU, timings meaningless)
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

from kernels_triton import options  # noqa: E402
from kernels_triton.kv_sync import kv_sync_, kv_sync_ref_  # noqa: E402
from kernels_triton.sampling import warp_logits, warp_logits_ref  # noqa: E402
from kernels_triton.verify_accept import verify_accept, verify_accept_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GRAPH_CALLS = 20
PLANTED_LOGIT = 14.0
ACCEPT_DEPTH = 4


# ------------------------------------------------------------------------------------- timers


def time_graph(fn):
    return _time_graph(fn, calls=GRAPH_CALLS, replays=10)


def time_bench(fn):
    """Device time per call in us (median; L2 flushed before each call on the GPU)."""
    if CUDA:
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6






# ------------------------------------------------------------------------------------- cases


def verify_inputs(B, T, V, mode, dtype, seed):
    """Logits / tokens / parents / uniforms / draft_probs. Each tree hangs every node off one of the 4
    previous nodes, except a spine of min(4, T - 1) random nodes (each the child of the previous
    spine node) whose tokens get logit PLANTED_LOGIT at their parent's row."""
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(DEVICE).manual_seed(seed)
    parents = torch.full((B, T), -1, dtype=torch.int32)
    for i in range(1, T):
        parents[:, i] = torch.randint(max(0, i - 4), i, (B,), generator=gen).to(torch.int32)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    depth = min(ACCEPT_DEPTH, T - 1)
    plant_b, plant_row, plant_tok = [], [], []
    for b in range(B):
        spine = torch.randperm(T - 1, generator=gen)[:depth].add(1).sort().values.tolist()
        for prev, node in zip([0] + spine, spine):
            parents[b, node] = prev
            plant_b.append(b)
            plant_row.append(prev)
            plant_tok.append(int(tokens[b, node]))
    logits = torch.randn(B, T, V, device=DEVICE, generator=dgen)
    if plant_b:
        logits[torch.tensor(plant_b), torch.tensor(plant_row), torch.tensor(plant_tok)] = PLANTED_LOGIT
    uniforms = torch.rand(B, T, 2, generator=gen).to(DEVICE)
    draft_probs = None
    if mode == "sample_q":
        # A draft close to the target: softmax of the target logits plus noise (fp32, [B, T, V]).
        noise = torch.randn(B, T, V, device=DEVICE, generator=dgen)
        draft_probs = torch.softmax(logits + 0.5 * noise, -1)
        del noise
    temperature = 0.0 if mode == "greedy" else 1.0
    return logits.to(dtype), tokens.to(DEVICE), parents.to(DEVICE), temperature, uniforms, draft_probs


def verify_case(B, T, V, mode, dtype):
    args = verify_inputs(B, T, V, mode, dtype, seed=B * 100 + T)
    got = verify_accept(*args)
    want = verify_accept_ref(*args)
    mismatch = int(((got[2] != want[2]).any(-1) | (got[0] != want[0])).sum())
    accept = got[0].float().mean().item()
    nbytes = B * (accept + 1) * V * args[0].element_size()
    return dict(
        op="verify_accept", mode=mode, shape=f"V={V}", B=B, T=T, accept=accept, bytes=nbytes, mismatch=mismatch,
        kernel=lambda: verify_accept(*args), ref=lambda: verify_accept_ref(*args),
    )


# The warpers a sampled step runs (temperature, top-k, top-p, min-p per request), by mode name.
WARP_MODES = {"top_p": [1.0, 0, 0.95, 0.0], "top_k+top_p": [1.0, 50, 0.9, 0.0], "min_p": [1.0, 0, 1.0, 0.05]}


def warp_case(B, T, V, mode, tiles, dtype):
    """warp_logits over B x T rows of N(0, 4) logits, one warper setting for every request, with kernel
    option warp_tiles = ``tiles``; accept = the mean tokens a row keeps."""
    gen = torch.Generator(DEVICE).manual_seed(B * 1000 + T)
    logits = (torch.randn(B, T, V, device=DEVICE, generator=gen) * 2.0).to(dtype)
    params = torch.tensor([WARP_MODES[mode]] * B, dtype=torch.float32, device=DEVICE)

    def kernel():
        with options.use(warp_tiles=tiles):
            return warp_logits(logits, params)

    got, want = kernel(), warp_logits_ref(logits, params)
    kept = got > float("-inf")
    mismatch = int((kept != (want > float("-inf"))).any(-1).sum())  # rows whose kept set differs
    return dict(
        op="warp_logits", mode=f"{mode} tiles={'on' if tiles else 'off'}", shape=f"V={V}", B=B, T=T,
        accept=kept.sum(-1).float().mean().item(), bytes=B * T * V * logits.element_size(), mismatch=mismatch,
        kernel=kernel, ref=lambda: warp_logits_ref(logits, params),
    )


def kv_pools(specs, P, PS, dtype):
    shapes = [(L, P, PS, HKV, D) for L, HKV, D in specs]
    return [(torch.empty(s, device=DEVICE, dtype=dtype), torch.empty(s, device=DEVICE, dtype=dtype)) for s in shapes]


def sync_case(name, specs, B, T, dtype, prefix=512, PS=16):
    gen = torch.Generator().manual_seed(B + T)
    MP = (prefix + 2 * T) // PS + 1
    P = B * MP
    pools = kv_pools(specs, P, PS, dtype)
    for k, v in pools:  # random bits (a pure copy: values do not matter, but keep them finite)
        k.normal_()
        v.normal_()
    page_table = torch.randperm(P, generator=gen)[: B * MP].view(B, MP).to(torch.int32)
    seq_lens = torch.randint(prefix // 2, prefix + 1, (B,), generator=gen).to(torch.int32)
    nodes = torch.full((B, T), -1, dtype=torch.int32)
    nodes[:, 0] = 0
    for b in range(B):
        nodes[b, 1 : ACCEPT_DEPTH + 1] = torch.randperm(T - 1, generator=gen)[:ACCEPT_DEPTH].add(1).sort().values
    accept_len = torch.full((B,), ACCEPT_DEPTH, dtype=torch.int32)
    out_tokens = torch.randint(0, 49152, (B, T), generator=gen)
    state = [t.to(DEVICE) for t in (page_table, seq_lens, nodes, accept_len, out_tokens)]
    moved = int((nodes[:, 1:] != torch.arange(1, T)).logical_and(nodes[:, 1:] >= 0).sum()) / B
    row_bytes = sum(L * HKV * D for L, HKV, D in specs) * 2 * torch.tensor([], dtype=dtype).element_size()
    nbytes = 2 * B * moved * row_bytes  # read + write, K and V
    # Correctness on copies of the pools.
    got = [(k.clone(), v.clone()) for k, v in pools]
    want = [(k.clone(), v.clone()) for k, v in pools]
    r_got = kv_sync_(got, *state)
    r_want = kv_sync_ref_(want, *state)
    same = all(torch.equal(a, b) for pg, pw in zip(got, want) for a, b in zip(pg, pw))
    same = same and all(torch.equal(a, b) for a, b in zip(r_got, r_want))
    del got, want
    return dict(
        op="kv_sync_", mode=name, shape="+".join(f"{L}x{HKV}x{D}" for L, HKV, D in specs), B=B, T=T, accept=moved,
        bytes=nbytes, mismatch=0 if same else B,
        kernel=lambda: kv_sync_(pools, *state), ref=lambda: kv_sync_ref_(pools, *state),
    )


def measure(case, copy_gbps, graph):
    row = {key: case[key] for key in ("op", "mode", "shape", "B", "T", "accept", "bytes", "mismatch")}
    t_us = time_bench(case["kernel"])
    r_us = time_bench(case["ref"])
    row.update(
        triton_us=t_us,
        gbps=case["bytes"] / (t_us * 1e-6) / 1e9,
        ref_us=r_us,
        speedup=r_us / t_us,
        graph_us=time_graph(case["kernel"]) if graph else float("nan"),
    )
    row["pct_copy"] = 100 * row["gbps"] / copy_gbps
    return row


# ------------------------------------------------------------------------------------- output


TABLE_COLS = [  # (csv key, header, format)
    ("op", "op", "{}"), ("mode", "mode", "{}"), ("shape", "shape", "{}"), ("B", "B", "{}"), ("T", "T", "{}"),
    ("accept", "accept", "{:.2f}"), ("triton_us", "us", "{:.1f}"), ("gbps", "GB/s", "{:.0f}"),
    ("pct_copy", "%copy", "{:.0f}"), ("ref_us", "ref us", "{:.1f}"), ("speedup", "x ref", "{:.1f}"),
    ("graph_us", "graph us", "{:.1f}"), ("mismatch", "mismatch", "{}"),
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

    smollm2, llama, eagle = (30, 3, 64), (32, 8, 128), (1, 8, 128)
    if args.quick:
        dtype = torch.bfloat16 if CUDA else torch.float32
        V, bs, ts, modes = 1000, [1, 3], [1, 8], ["greedy", "sample", "sample_q"]
        sync_specs = [("smollm2", [(2, 3, 64)]), ("target+draft", [(2, 3, 64), (1, 3, 64)])]
        sync_bs, sync_t = [1, 3], 8
        warp_vs, warp_rows = [1000], [(1, 1), (1, 3)]
    else:
        dtype = torch.bfloat16
        V, bs, ts, modes = 49152, [1, 8, 64], [1, 8, 16, 64], ["greedy", "sample", "sample_q"]
        sync_specs = [("smollm2", [smollm2]), ("llama8b", [llama]), ("llama8b+draft", [llama, eagle])]
        sync_bs, sync_t = [1, 64], 16
        warp_vs, warp_rows = [49152, 151936], [(1, 1), (1, 17), (64, 1)]
    device_name = torch.cuda.get_device_name() if CUDA else "cpu (TRITON_INTERPRET=1)"
    t_start = time.perf_counter()
    copy_gbps = copy_bandwidth_gbps()

    rows = []
    for mode in modes:
        for B in bs:
            for T in ts:
                case = verify_case(B, T, V, mode, dtype)
                rows.append(measure(case, copy_gbps, graph=True))
                del case
                print(f"  measured verify_accept {mode} B={B} T={T}", file=sys.stderr)
    # The sampling warp at the vocabularies of SmolLM2 and Qwen3: one row (plain decoding at batch 1),
    # a tree of 17 rows, 64 rows; kernel option warp_tiles off and on (kernels_triton/options.py).
    for Vw in warp_vs:
        for B, T in warp_rows:
            for mode in WARP_MODES:
                for tiles in (False, True):
                    case = warp_case(B, T, Vw, mode, tiles, dtype)
                    rows.append(measure(case, copy_gbps, graph=True))
                    del case
            print(f"  measured warp_logits V={Vw} B={B} T={T}", file=sys.stderr)
    for name, specs in sync_specs:
        for B in sync_bs:
            case = sync_case(name, specs, B, sync_t, dtype)
            rows.append(measure(case, copy_gbps, graph=True))
            del case
            if CUDA:
                torch.cuda.empty_cache()
            print(f"  measured kv_sync_ {name} B={B}", file=sys.stderr)

    commit = git_commit()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_verify_commit_{datetime.datetime.now():%Y%m%d-%H%M%S}.csv"
    extra = dict(commit=commit, device=device_name, date=date, copy_gbps=copy_gbps,
                 dtype=str(dtype).replace("torch.", ""))
    fields = list(extra) + ["op", "mode", "shape", "B", "T", "accept", "bytes"] + [k for k, _, _ in TABLE_COLS[6:]]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({**extra, **{k: row[k] for k in fields if k in row}})

    print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")
    print(f"device {device_name}, commit {commit}, {date}, logits/KV dtype {extra['dtype']}")
    print(f"copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    print_table(rows, "verify_accept / warp_logits / kv_sync_: Triton vs torch eager reference")


if __name__ == "__main__":
    main()
