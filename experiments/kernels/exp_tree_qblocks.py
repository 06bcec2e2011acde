"""EXPERIMENT (run at 1aebf23; results/kernels/exp_tree_qblocks_1aebf23.txt): does a tree of T=16
verify faster as several small query blocks (BLOCK_M 16 / 32, mma.sync tiles, 4-6 programs per SM,
each re-reading its KV head's tiles, mostly from L2) than as one BLOCK_M = 64 wgmma block?

Answer (H200, bf16): no. Tree headline (9q/3kv d64, B=64, prefix 1024): 23.9 us as one block vs
36.7-37.9 us as 32- or 16-row blocks; at 32q/8kv B=64 prefix 1024: 86.2 vs 163.1 us. Only T=8
(already 32-row tiles) is unchanged. Variants replace launch_config (BLOCK_M, BLOCK_T, BLOCK_N,
warps, stages) for the call.

Run (H200, ~1 min):  python experiments/kernels/exp_tree_qblocks.py
      python experiments/kernels/exp_tree_qblocks.py --quick   (CPU smoke run)
"""
import os, sys, contextlib
from pathlib import Path
import torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments" / "kernels")]
from bench_attention import Pool, n_pools, time_rotating
import kernels_triton.attention as attn
import kernels_triton.attention_launch as launch
from specdec.bench.timing import copy_bandwidth_gbps
orig = launch.launch_config

@contextlib.contextmanager
def cfg(over):
    def lc(max_q_len, G, D, dtype=torch.bfloat16):
        c = orig(max_q_len, G, D, dtype)
        c.update(over)
        return c
    launch.launch_config = lc
    try:
        yield
    finally:
        launch.launch_config = orig

def V(bm, bt, bn=64, w=4, st=5):
    return dict(BLOCK_M=bm, BLOCK_T=bt, BLOCK_N=bn, num_warps=w, num_stages=st)

quick = "--quick" in sys.argv
cuda = torch.cuda.is_available()
dtype = torch.bfloat16 if cuda else torch.float32
copy = copy_bandwidth_gbps() if cuda else float("nan")
print(f"copy {copy:.0f} GB/s")
SH = [((9, 3, 64), 64, 1024, 16), ((9, 3, 64), 64, 4096, 16), ((9, 3, 64), 8, 4096, 16),
      ((32, 8, 128), 64, 1024, 16), ((9, 3, 64), 64, 1024, 8), ((9, 3, 64), 8, 4096, 64)]
if quick:
    SH = [((9, 3, 64), 2, 100, 16)]
for heads, B, prefix, T in SH:
    HQ, HKV, D = heads
    G = HQ // HKV
    kvb = B * (prefix + T) * HKV * D * 2 * 2
    pools = [Pool(B, prefix, heads, dtype, T, seed=i) for i in range(n_pools(kvb))]
    bs = [p.batch(T, seed=1) for p in pools]
    ref = attn.paged_attention(**bs[0], max_q_len=T).float()
    print(f"\n{HQ}q/{HKV}kv d{D} B={B} prefix={prefix} T={T}", flush=True)
    bn2 = 64 if D <= 64 else 32
    vars_ = [("default", {}, {})]
    for bm in (16, 32):
        for bt in sorted({bm // G, max(1, 2 ** ((bm // G).bit_length() - 1))}):
            for w in (4, 2) if bm == 16 else (4,):
                vars_.append((f"BM{bm} BT{bt} BN{bn2} w{w}", V(bm, bt, bn2, w), {}))
    vars_ += [(f"BM32 BT{32 // G} BN{bn2} w4 sp2", V(32, 32 // G, bn2), dict(num_splits=2)),
              (f"BM32 BT{32 // G} BN{bn2 // 2} w4", V(32, 32 // G, bn2 // 2), {}),
              (f"BM32 BT{32 // G} BN{bn2} w4 st3", V(32, 32 // G, bn2, 4, 3), {}),
              (f"BM64 BT{64 // G} sp1 2loops", {}, dict(num_splits=1, one_loop=False))]
    if quick:
        vars_ = vars_[:3]
    for label, over, kw in vars_:
        try:
            with cfg(over):
                out = attn.paged_attention(**bs[0], max_q_len=T, **kw).float()
                err = (out - ref).abs().max().item()
                us = time_rotating([lambda b=b: attn.paged_attention(**b, max_q_len=T, **kw) for b in bs])
        except Exception as e:
            print(f"  {label:28s} {type(e).__name__}: {str(e)[:90]}", flush=True)
            continue
        print(f"  {label:28s} {us:8.2f} us {100 * kvb / (us * 1e-6) / 1e9 / copy:5.1f}% copy err {err:.2g}", flush=True)
    del pools, bs
    if cuda:
        torch.cuda.empty_cache()
