"""Diagnosis: what does attention cost inside the graphed batch-1 decode step at Llama-3.1-8B shapes?

The step (random bf16 weights, context 512, the engine of bench_serving.py part b) is timed
(1) as is, (2) with attention replaced by the identity (the layer's o = q: no attention kernel, the
same GEMVs), and (3) with the split-KV factor forced to 1, 2, 4, 8, 16, each with the fused merge
(the last split merges) and the merge kernel. (2) bounds what any attention change can save; (3)
shows how the split count trades programs against the merge.

Run (one GPU, ~2 min, no model files):  python experiments/diag_attention_cost.py --out $OUT
CPU smoke run (tiny shapes, numbers meaningless):  python experiments/diag_attention_cost.py --quick --out /tmp/diag
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first @triton.jit import

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from kernels_triton import options  # noqa: E402
import kernels_triton.attention_launch as launch  # noqa: E402
import specdec.models.ops as ops  # noqa: E402
from specdec.bench.console import print_table  # noqa: E402
from specdec.bench.provenance import device_name, git_commit  # noqa: E402
from specdec.bench.targets import llama_config_from_dict, load_target_yaml  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    options.add_flags(ap)  # --pdl, --fused-linear, ... (kernels_triton/options.py)
    args = ap.parse_args()
    options.set_from_flags_(args)
    cuda = torch.cuda.is_available() and not args.quick
    shape = dict(load_target_yaml(REPO / "conf" / "target" / "llama31_8b_random.yaml")["config"])
    ctx, iters, repeats = 512, 100, 3
    if not cuda:  # same structure, tiny sizes
        shape.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=4096)
        ctx, iters, repeats = 32, 2, 1
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = LlamaModel.random(llama_config_from_dict(shape), device=dev, dtype=dtype, seed=0)
    meta = dict(commit=git_commit(), device=device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%S"), context=ctx)
    rows = []

    def run(name: str) -> None:
        eng = Engine(model, EngineConfig(max_batch_size=1, graph_buckets=(1,), kv_cache_tokens=8192, max_seq_len=4096,
                                         page_size=16))
        ms = [eng.profile_decode_step(1, ctx, iters=iters) for _ in range(repeats)]
        rows.append(dict(meta, variant=name, step_ms=min(ms), all_ms=" ".join(f"{m:.4f}" for m in ms)))
        print(f"{name:26s} step {min(ms):.4f} ms {[round(m, 4) for m in ms]}", flush=True)
        del eng
        if cuda:
            torch.cuda.empty_cache()

    paged_attention, default_splits = ops.paged_attention, launch.default_num_splits
    try:
        run("default")
        ops.paged_attention = lambda q, *a, **k: q  # o = q: every kernel but attention's
        run("no attention")
        ops.paged_attention = paged_attention
        for splits in (1, 2, 4, 8, 16):
            launch.default_num_splits = lambda *a, s=splits, **k: s
            for fm in (True, False):
                options.set_(fused_merge=fm)
                run(f"splits {splits} {'fused merge' if fm else 'merge kernel'}")
        launch.default_num_splits = default_splits
        options.set_(fused_merge=None)
        run("default again")
    finally:
        ops.paged_attention, launch.default_num_splits = paged_attention, default_splits
        options.set_(fused_merge=None)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "diag_attention_cost.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print_table(f"8B-shape graphed step, context {ctx} ({meta['device']}, {meta['commit']})", ["variant", "step ms"],
                [[r["variant"], f"{r['step_ms']:.4f}"] for r in rows])


if __name__ == "__main__":
    main()
