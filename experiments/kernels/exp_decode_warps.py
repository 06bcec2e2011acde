"""EXPERIMENT: launch shape of the mma.sync attention tiles (BLOCK_M <= 32: decode, short chains):
num_warps 1 / 2 / 8 vs 4, and BLOCK_N / num_stages around the default (kernels_triton/attention.py
launch_config), with the default split count and L2D.

Question: each decode program is bound by its own dependent chain (Nsight Compute: 5-7 cycles per
issued instruction), and with 4 warps a score tile's columns are spread over the warps, so the row
max and the P operand cross warps through shared memory on every tile. Do fewer warps per program
(fewer cross-warp steps, more programs) or other tiles shorten it?

Timing: bench_attention's rotating timing (us per call); the first and last columns are the default.

Run (H200, ~1 min):  python experiments/kernels/exp_decode_warps.py | tee OUT.txt
"""
import sys
from pathlib import Path
import torch
REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments" / "kernels")]
from bench_attention import Pool, n_pools, time_rotating  # noqa: E402
import kernels_triton.attention as attn  # noqa: E402
import kernels_triton.attention_launch as launch  # noqa: E402
from specdec.bench.timing import copy_bandwidth_gbps  # noqa: E402
if not torch.cuda.is_available():
    sys.exit("exp_decode_warps.py times CUDA kernels: no GPU here")
dtype = torch.bfloat16
copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s")
orig = launch.launch_config
def patched(over):
    def lc(max_q_len, G, D, dtype=torch.bfloat16):
        c = orig(max_q_len, G, D, dtype)
        if c["BLOCK_M"] <= 32:
            c.update(over)
        return c
    return lc
shapes = [((9, 3, 64), 8, 4096, 1), ((9, 3, 64), 8, 16384, 1), ((9, 3, 64), 64, 4096, 1), ((9, 3, 64), 1, 4096, 1),
          ((32, 8, 128), 1, 512, 1), ((32, 8, 128), 8, 4096, 1), ((32, 8, 128), 64, 1024, 1), ((9, 3, 64), 1, 1024, 8)]
V = {64: [("base", {}), ("w2", dict(num_warps=2)), ("w1 st3", dict(num_warps=1, num_stages=3)), ("w1 BN32 st4", dict(num_warps=1, num_stages=4, BLOCK_N=32)),
          ("w8", dict(num_warps=8)), ("BN128 st3", dict(BLOCK_N=128, num_stages=3)), ("w2 BN32", dict(num_warps=2, BLOCK_N=32, num_stages=5))],
     128: [("base", {}), ("w2", dict(num_warps=2)), ("w1 st3", dict(num_warps=1, num_stages=3)), ("w1 BN16 st4", dict(num_warps=1, num_stages=4, BLOCK_N=16)),
           ("w8", dict(num_warps=8)), ("BN64 st3", dict(BLOCK_N=64, num_stages=3)), ("w2 BN16", dict(num_warps=2, BLOCK_N=16, num_stages=5))]}
for (HQ, HKV, D), B, prefix, T in shapes:
    kv_bytes = B * (prefix + T) * HKV * D * 2 * dtype.itemsize
    pools = [Pool(B, prefix, (HQ, HKV, D), dtype, T, seed=i) for i in range(n_pools(kv_bytes))]
    batches = [p.batch(T, seed=1) for p in pools]
    ref = attn.paged_attention_ref(**batches[0]).float()
    line = f"{HQ}q/{HKV}kv d{D} B={B:3d} p={prefix:5d} T={T}:"
    for label, over in V[D] + [V[D][0]]:
        launch.launch_config = patched(over)
        try:
            err = (attn.paged_attention(**batches[0], max_q_len=T).float() - ref).abs().max().item()
            us = time_rotating([lambda b=b: attn.paged_attention(**b, max_q_len=T) for b in batches])
            line += f" | {label} {us:.2f}{' ERR' if err > 0.02 else ''}"
        except Exception as e:
            line += f" | {label} {type(e).__name__}"
        finally:
            launch.launch_config = orig
    print(line, flush=True)
