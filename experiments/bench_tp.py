"""Benchmark: the tensor-parallel layer boundary and the graphed TP step (the numbers issue #25 needs).

Questions: (1) at a layer boundary, how long does the one-shot fused all-reduce + residual add +
RMSNorm (kernels_triton/fused_norm_allreduce.py, symmetric-memory peer reads) take against NCCL's
all_reduce followed by the fused add + RMSNorm (kernels_triton/norm.py), per token count? (2) what
does a Llama-3.1-8B-shape graphed decode step cost at TP1 and TPn per all-reduce path, against the
weight-bandwidth floor of the weights each GPU streams?

Part ``boundary``: H in {4096, 8192}, N in {1, 8, 16, 64, 256} tokens, bf16. Each path is captured in a
CUDA graph of GRAPH_CALLS back-to-back calls and replayed a fixed number of times on every rank (no
do_bench around collectives: it picks a rank-dependent iteration count and hangs); the time per call is
the slowest rank's. At world size 1 "fused" is the kernel's no-communication path and "nccl" is
today's fused add + RMSNorm alone (what the single-GPU step runs). The NCCL path all-reduces its input
in place (values grow across calls; the timing does not depend on them); correctness is checked once
before timing against the fp32 distributed reference (max_err column).

Part ``step``: conf/target/llama31_8b_random.yaml shapes, random bf16 weights, graphed k = 0 step at
batch 1 and 64, 512 tokens of context (profiling.decode_step_ms: fixed iteration count on every rank).
Rows: TP1 today's model ("tp1"), TP1 through TPLlamaModel with the fused kernel's world-size-1 path
("tp1 fused-ws1"), and at world size n > 1 "tpn nccl" and "tpn fused". Floor: the weight bytes a step
reads on one GPU (its shard) at the copy bandwidth measured in this run.

Run (one H200):   python experiments/bench_tp.py --world-size 1 --out outputs/tp
Run (n GPUs):     python experiments/bench_tp.py --world-size 2 --out outputs/tp
                  (spawns its ranks; or torchrun --nproc-per-node 2 experiments/bench_tp.py --world-size 2)
Subset:           --part boundary --hidden 4096 --tokens 1 8
Quick:            python experiments/bench_tp.py --quick [--world-size 2] --out /tmp/bench  (CPU smoke run over
                  gloo, tiny shapes, eager timings: numbers meaningless; no fused rows at world size > 1)
Writes bench_tp_<commit>_ws<n>.csv (commit, device, date on every row) and prints a table last.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import sys
from pathlib import Path

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first @triton.jit (kernels_triton imports)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without `pip install -e .`

GRAPH_CALLS = 50  # boundary calls captured per graph
REPLAYS = 20  # graph replays timed per case
EPS = 1e-5
CUDA = torch.cuda.is_available()
# --quick on the CPU: Llama-3.1-8B structure at tiny sizes.
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=4096)


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")


def _time_us(fn):
    """Per call: CUDA-graph replay of GRAPH_CALLS calls on the GPU; a few eager calls on the CPU."""
    from specdec.bench.timing import time_graph

    if CUDA:
        return time_graph(fn, calls=GRAPH_CALLS, replays=REPLAYS)
    import time

    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e6


def _slowest(us: float, group) -> float:
    """The slowest rank's time (every rank returns the same number)."""
    if group is None or group.size == 1:
        return us
    import torch.distributed as dist

    t = torch.tensor([us], dtype=torch.float64, device=group.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.group)  # (NaN-free: timings are finite)
    return float(t.item())


def _barrier(group):
    if group is not None and group.size > 1:
        import torch.distributed as dist

        dist.barrier(group=group.group)
        if CUDA:
            torch.cuda.synchronize()


def bench_boundary(group, hidden, tokens, dtype=torch.bfloat16):
    from kernels_triton.fused_norm_allreduce import (SymmBuffer, fused_norm_allreduce,
                                                     fused_norm_allreduce_dist_ref)
    from kernels_triton.norm import rms_norm

    W = 1 if group is None else group.size
    dev = _device()
    fused_ok = CUDA or W == 1  # the one-shot kernel reads peer GPU memory; on the CPU only its W = 1 path
    rows = []
    for H in hidden:
        buf = SymmBuffer(max(tokens), H, dtype, dev, group.group if W > 1 and fused_ok else None)
        for N in tokens:
            rank = 0 if group is None else group.rank
            gen = torch.Generator(device=dev).manual_seed(1000 * N + H + rank)  # each rank its own partial sum
            x = torch.randn(N, H, device=dev, generator=gen).to(dtype)
            gen.manual_seed(N + H)  # residual and weight identical on every rank
            res = torch.randn(N, H, device=dev, generator=gen).to(dtype)
            w = (1 + 0.1 * torch.randn(H, device=dev, generator=gen)).to(dtype)
            err = float("nan")
            if fused_ok:
                out, s = fused_norm_allreduce(x, res, w, EPS, buf)
                if W > 1:
                    ref_out, ref_s = fused_norm_allreduce_dist_ref(x, res, w, EPS, group.group)
                else:
                    ref_out, ref_s = rms_norm(x, w, EPS, res)
                err = max((out.float() - ref_out.float()).abs().max().item(),
                          (s.float() - ref_s.float()).abs().max().item())
            xn = x.clone()

            def nccl():
                if W > 1:
                    group.all_reduce_(xn)
                rms_norm(xn, w, EPS, res)

            cases = [("fused", lambda: fused_norm_allreduce(x, res, w, EPS, buf))] if fused_ok else []
            for path, fn in cases + [("nccl", nccl)]:
                _barrier(group)
                us = _slowest(_time_us(fn), group)
                rows.append(dict(part="boundary", case=path, world=W, H=H, N=N, dtype=str(dtype).replace("torch.", ""),
                                 us=us, max_err=err if path == "fused" else float("nan")))
    return rows


def bench_step(group, batches, context, paths, quick=False):
    from specdec.bench.targets import llama_config_from_dict
    from specdec.bench.timing import copy_bandwidth_gbps
    from specdec.dist import TPGroup
    from specdec.engine.engine import Engine, EngineConfig
    from specdec.engine.profiling import decode_step_ms, weight_bytes
    from specdec.models.llama import LlamaModel
    from specdec.models.tp import TPLlamaModel
    from omegaconf import OmegaConf

    W = 1 if group is None else group.size
    dev = _device()
    spec = OmegaConf.load(REPO / "conf" / "target" / "llama31_8b_random.yaml")
    fields = OmegaConf.to_container(spec.config, resolve=True)
    config = llama_config_from_dict({**fields, **TINY} if quick else fields)
    gbps = copy_bandwidth_gbps(dev)
    full = LlamaModel.random(config, device=dev, dtype="bfloat16" if CUDA else "float32", seed=0)
    rows = []
    for path in paths:
        if path == "tp1":
            if W > 1:
                continue
            model = full
        else:
            g = group if W > 1 else TPGroup(rank=0, size=1, device=dev)
            model = TPLlamaModel(full, g, allreduce="fused" if path.endswith("fused") else "nccl")
        max_b = max(batches)
        ecfg = EngineConfig(max_batch_size=max_b, kv_cache_tokens=max_b * (context + 128), graph_buckets=tuple(batches),
                            prefill_buckets=(), max_seq_len=context + 128)
        engine = Engine(model, ecfg)
        read = weight_bytes(model)["read"]
        floor_ms = read / (gbps * 1e9) * 1e3
        for B in batches:
            _barrier(group)
            ms = _slowest(decode_step_ms(engine, B, context, iters=50, warmup=3), group)
            name = path if path == "tp1" else (f"tp{W} {path.split()[-1]}" if W > 1 else "tp1 fused-ws1")
            rows.append(dict(part="step", case=name, world=W, H=config.hidden_size, N=B, dtype=str(model.dtype)[6:],
                             us=ms * 1e3,
                             floor_us=floor_ms * 1e3, floor_fraction=floor_ms / ms, graphed=engine.graphed,
                             weight_gb_per_gpu=read / 1e9, copy_gbps=gbps))
        del engine
        if model is not full:
            del model
        if CUDA:
            torch.cuda.empty_cache()
    return rows


def main_rank(group, args):
    rows = []
    if args.part in ("boundary", "all"):
        rows += bench_boundary(group, args.hidden, args.tokens, torch.bfloat16 if CUDA else torch.float32)
    if args.part in ("step", "all"):
        W = 1 if group is None else group.size
        paths = ["tp1", "fused"] if W == 1 else ["nccl", "fused"]
        if not CUDA:
            paths = [p for p in paths if p != "fused"]  # fused model layers need CUDA
        rows += bench_step(group, args.batches, args.context, paths, quick=args.quick)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--part", choices=("boundary", "step", "all"), default="all")
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 64, 256])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", default="outputs/tp")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, few sizes")
    args = ap.parse_args(argv)
    if not CUDA and not args.quick:
        sys.exit("bench_tp.py needs CUDA (the fused kernel reads peer GPU memory); --quick is a CPU smoke run")
    if args.quick:
        args.hidden, args.tokens, args.batches, args.context = [64], [1, 8], [1, 4], 32
    from specdec.bench.console import print_table
    from specdec.bench.provenance import git_commit

    if args.world_size == 1:
        rows = main_rank(None, args)
    else:
        from specdec.dist.launch import launch

        rows = launch(main_rank, args.world_size, "cuda" if CUDA else "cpu", args)
        if rows is None:  # a torchrun rank other than 0
            return
    commit, device = git_commit(), torch.cuda.get_device_name() if CUDA else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_tp_{commit}_ws{args.world_size}.csv"
    keys = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=["commit", "device", "date", *keys])
        wr.writeheader()
        for r in rows:
            wr.writerow({"commit": commit, "device": device, "date": date, **r})
    fmt = lambda v, p=1: "-" if v is None or v != v else f"{v:.{p}f}"  # noqa: E731
    cells = [[r["part"], r["case"], str(r["world"]), str(r["H"]), str(r["N"]), fmt(r["us"]),
              fmt(r.get("floor_us")), fmt(r.get("floor_fraction"), 2), fmt(r.get("max_err"), 4)] for r in rows]
    print(f"wrote {path}")
    print_table(f"TP boundary and step, world size {args.world_size}, {device}, {commit}",
                ["part", "case", "W", "H", "N / batch", "us", "floor us", "floor frac", "max err"], cells)


if __name__ == "__main__":
    main()
