"""Graphed decode steps (k = 0: plain decoding) at several batch sizes, once per value of kernel options.

Question: what does a routing change of the fused small-M kernels (kernel option small_m, routing in
specdec/models/ops.py) do to batched plain decoding, where 2-24 rows reach the same layers a tree
verify or a draft round does? Device ms per step (``Engine.profile_decode_step``: back-to-back graph
replays, best of three), random weights of a target's shapes (the step time does not depend on the
values), context ``--context`` tokens per row.

Run (one GPU, no model files):
    python experiments/decode_batches.py --shape llama8b --batches 1 2 4 8 16 24 32 --ab small_m=dot,auto
Off CUDA: tiny shapes, one iteration (a smoke run).
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "experiments")]
from profile_step import SMOLLM2, TINY, llama8b_shape, parse_ab  # noqa: E402
from kernels_triton import options  # noqa: E402
from specdec.bench.provenance import device_name, provenance  # noqa: E402
from specdec.bench.targets import llama_config_from_dict  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["smollm2", "llama8b"], default="llama8b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 24, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--ab", metavar="OPTION=V1,V2", action="append", required=True,
                    help="kernel option values to compare (repeatable: every combination)")
    ap.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = llama8b_shape(cuda) if args.shape == "llama8b" else (SMOLLM2 if cuda else TINY)
    model = LlamaModel.random(llama_config_from_dict(shape), device=dev, dtype=dtype)
    ab = [parse_ab(a) for a in args.ab]
    batches = sorted(set(args.batches))
    res = {**provenance(dev), "device": device_name(dev), "date": time.strftime("%Y-%m-%d"), "shape": args.shape,
           "context": args.context, "ms": {}}
    it = dict(iters=50) if cuda else dict(iters=1, warmup=1)
    for combo in itertools.product(*[[(n, v) for v in vals] for n, vals in ab]):
        label = ",".join(f"{n}={v}" for n, v in combo)
        with options.use(**dict(combo)):
            cfg = EngineConfig(max_batch_size=max(batches), graph_buckets=batches, prefill_buckets=(),
                               kv_cache_tokens=max(batches) * (args.context + 64), max_seq_len=args.context + 64)
            eng = Engine(model, cfg, eos_ids=[])
            res["ms"][label] = {B: min(eng.profile_decode_step(B, args.context, **it) for _ in range(3)) for B in batches}
            del eng
            if cuda:
                torch.cuda.empty_cache()
        print(label, " ".join(f"B={B}:{ms:.4f}" for B, ms in res["ms"][label].items()), flush=True)
    labels = list(res["ms"])
    print(f"\ngraphed plain decode step ms ({args.shape}, context {args.context}; ratio to {labels[0]})")
    print("  B    " + "".join(f"{lab:>36s}" for lab in labels))
    for B in batches:
        base = res["ms"][labels[0]][B]
        print(f"  {B:<5d}" + "".join(f"{res['ms'][lab][B]:>28.4f} ({res['ms'][lab][B] / base:.3f}x)" for lab in labels))
    print(f"commit {res.get('commit')}, {res['device']}, {res['date']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
