"""Run one paged_attention shape a few times, for Nsight Compute (a profiling target, no timing).

    ncu --clock-control none --kernel-name regex:_paged_attention_fwd --launch-skip 3 --launch-count 1 \
        --set full -o REPORT python experiments/kernels/ncu_attention.py HQ HKV D B PREFIX T [kw=val ...]
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python experiments/kernels/ncu_stalls.py sass.csv

kw=val pairs go to paged_attention (e.g. num_splits=32 fused_merge=True). Inputs as bench_attention's
(one layer's pool, pages shuffled, random trees for T > 1)."""
import sys
from pathlib import Path
import torch
REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments" / "kernels")]
from bench_attention import Pool  # noqa: E402
import kernels_triton.attention as attn  # noqa: E402

HQ, HKV, D, B, prefix, T = map(int, sys.argv[1:7])
kw = {}
for a in sys.argv[7:]:
    k, v = a.split("=")
    kw[k] = int(v) if v.lstrip("-").isdigit() else (v == "True" if v in ("True", "False") else v)
pool = Pool(B, prefix, (HQ, HKV, D), torch.bfloat16, T, seed=0)
b = pool.batch(T, seed=1)
for _ in range(4):
    attn.paged_attention(**b, max_q_len=T, **kw)
torch.cuda.synchronize()
print("done", HQ, HKV, D, B, prefix, T, kw)
