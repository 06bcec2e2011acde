"""EXPERIMENT: softmax running sums per element of the score tile (paged_attention(l2d=True): one FMA
per score, one row reduction after the loop) vs a row sum per tile (l2d=False).

Question: Nsight Compute on the H200 shows every attention program bound by its own dependent chain
(tree headline: 1.5 warps per scheduler, 3.9 cycles per issued instruction; decode: 5-7). On the
mma.sync tiles (BLOCK_M <= 32: decode, short chains) a row sum is a cross-warp reduction through
shared memory with a barrier on each tile's chain. Does taking it off the chain help, and what does
it cost on the wgmma tiles (BLOCK_M = 64), where it takes 32 more registers?

Shapes: T=16 trees (wgmma tiles) and decode / T=8 chains (mma.sync tiles); each variant twice,
alternating. Timing: bench_attention's rotating timing (a CUDA graph of back-to-back calls over
>= 256 MB of distinct KV); max |err| against the torch reference.

Part 2: graphed batch-1 decode steps (random bf16 weights, context 512, profile_decode_step) with
the default rule (default_l2d) vs row sums everywhere, alternating in one process.

Run (H200, ~2 min):  python experiments/kernels/exp_attention_l2d.py | tee OUT.txt
      python experiments/kernels/exp_attention_l2d.py --quick   (CPU smoke run, timings meaningless)
"""

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first @triton.jit

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments"), str(REPO / "experiments" / "kernels")]
from bench_attention import Pool, n_pools, time_rotating  # noqa: E402

import kernels_triton.attention as attn  # noqa: E402
import kernels_triton.attention_launch as launch  # noqa: E402
from specdec.bench.timing import copy_bandwidth_gbps  # noqa: E402

SHAPES = [((9, 3, 64), 64, 1024, 16), ((9, 3, 64), 32, 1024, 16), ((9, 3, 64), 128, 1024, 16),
          ((9, 3, 64), 64, 4096, 16), ((9, 3, 64), 8, 16384, 16), ((32, 8, 128), 64, 1024, 16),
          ((32, 8, 128), 8, 4096, 16), ((9, 3, 64), 8, 4096, 1), ((9, 3, 64), 64, 4096, 1),
          ((9, 3, 64), 8, 16384, 1), ((32, 8, 128), 1, 512, 1), ((32, 8, 128), 8, 4096, 1),
          ((9, 3, 64), 1, 1024, 8), ((32, 8, 128), 8, 1024, 8)]


def part1(quick, copy):
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float16
    shapes = SHAPES if not quick else [((9, 3, 64), 2, 100, 16), ((9, 3, 64), 2, 100, 1)]
    for (HQ, HKV, D), B, prefix, T in shapes:
        kv_bytes = B * (prefix + T) * HKV * D * 2 * dtype.itemsize
        pools = [Pool(B, prefix, (HQ, HKV, D), dtype, T, seed=i) for i in range(n_pools(kv_bytes))]
        batches = [p.batch(T, seed=1) for p in pools]
        ref = attn.paged_attention_ref(**batches[0]).float()
        cfg = launch.launch_config(T, HQ // HKV, D, dtype)
        line = f"{HQ}q/{HKV}kv d{D} B={B:3d} p={prefix:5d} T={T:2d} BLOCK_M={cfg['BLOCK_M']:3d}:"
        for label, l2d in (("rows", False), ("l2d", True), ("rows", False), ("l2d", True)):
            out = attn.paged_attention(**batches[0], max_q_len=T, l2d=l2d).float()
            err = (out - ref).abs().max().item()
            us = time_rotating([lambda b=b: attn.paged_attention(**b, max_q_len=T, l2d=l2d) for b in batches])
            line += f" | {label} {us:6.2f} ({100 * kv_bytes / (us * 1e-6) / 1e9 / copy:3.0f}%) err {err:.4f}"
        print(line, flush=True)


def part2(quick):
    from profile_step import SMOLLM2
    from specdec.bench.targets import llama_config_from_dict, load_target_yaml
    from specdec.models.llama import LlamaModel
    from specdec.engine.engine import Engine, EngineConfig

    orig = launch.default_l2d
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for shape in ("llama8b", "smollm2"):
        cfg = (dict(load_target_yaml(REPO / "conf/target/llama31_8b_random.yaml")["config"]) if shape == "llama8b"
               else SMOLLM2)
        if quick:
            cfg = {**cfg, "num_hidden_layers": 1}
        model = LlamaModel.random(llama_config_from_dict(cfg), device=dev,
                              dtype=torch.bfloat16 if dev == "cuda" else torch.float32, seed=0)
        for label in ("rows", "default", "rows", "default")[: 2 if quick else 4]:
            launch.default_l2d = orig if label == "default" else (lambda cfg: False)
            try:
                eng = Engine(model, EngineConfig(max_batch_size=1, graph_buckets=(1,), kv_cache_tokens=8192,
                                                 max_seq_len=4096, page_size=16))
                ms = [eng.profile_decode_step(1, 64 if quick else 512, iters=5 if quick else 200) for _ in range(3)]
                print(f"step {shape:8s} {label:8s} {min(ms):.4f} ms {[round(m, 4) for m in ms]}", flush=True)
                del eng
            finally:
                launch.default_l2d = orig
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--parts", default="12")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.quick:
        sys.exit("exp_attention_l2d.py times CUDA kernels: no GPU here (--quick runs a CPU smoke test)")
    copy = copy_bandwidth_gbps() if torch.cuda.is_available() else float("nan")
    print(f"copy bandwidth {copy:.0f} GB/s")
    if "1" in args.parts:
        part1(args.quick, copy)
    if "2" in args.parts:
        part2(args.quick)


if __name__ == "__main__":
    main()
