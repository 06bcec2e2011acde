"""EXPERIMENT: overlapped decoding (engine.overlap) vs the synchronous step, same process, same model.

Question: the engine's time per output token exceeded the graphed device step by 80-150 us at
Llama-3.1-8B shapes (host work after each step's token read-back: commit, finishes, scheduling,
the next launch, while the GPU idles). With overlap, each iteration queues its decode step before
reading back the previous one. How much of the gap does that close, at batch 1 and at batch 8?

Per shape (random bf16 weights, context ~512, greedy, ignore_eos), alternating off / on / off / on
in fresh engines: the engine's time per output token (token timestamps of one request, steady
state), output tokens per second for the batch, and the graphed device step for reference.

Run (H200, ~2 min):  python experiments/exp_overlap.py [--shapes smollm2,llama8b] | tee OUT.txt
      python experiments/exp_overlap.py --quick   (CPU smoke run: eager engine, timings meaningless)
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "experiments")]
from profile_step import SMOLLM2  # noqa: E402
from kernels_triton import options  # noqa: E402
from specdec.bench.targets import llama_config_from_dict, load_target_yaml  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402


def run(model, overlap, batch, n_new, prompt_len, graphs):
    eng = Engine(model, EngineConfig(max_batch_size=batch, graph_buckets=(batch,), kv_cache_tokens=8192 * batch,
                                     max_seq_len=4096, cuda_graphs=graphs, overlap=overlap))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    reqs = [eng.add_request(p, n_new, ignore_eos=True) for p in prompts]
    t0 = time.perf_counter()
    eng.run_until_done()
    wall = time.perf_counter() - t0
    tpot = statistics.median((r.token_times[-1] - r.token_times[1]) / (n_new - 2) * 1e3 for r in reqs)
    step = eng.profile_decode_step(batch, prompt_len + n_new // 2, iters=50) if graphs else float("nan")
    return eng.overlap, tpot, batch * n_new / wall, step, [r.output_ids for r in reqs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--quick", action="store_true")
    options.add_flags(ap)  # --pdl, --fused-linear, ... (kernels_triton/options.py)
    args = ap.parse_args()
    options.set_from_flags_(args)
    cuda = torch.cuda.is_available() and not args.quick
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    for shape in args.shapes.split(","):
        cfg = dict(load_target_yaml(REPO / "conf/target/llama31_8b_random.yaml")["config"]) if shape == "llama8b" else SMOLLM2
        if args.quick:
            cfg = dict(cfg, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, head_dim=16)
        model = LlamaModel.random(llama_config_from_dict(cfg), device=dev, dtype=dtype, seed=0)
        n_new, plen = (128, 512) if cuda else (6, 20)
        for batch in (1, 8):
            outs = {}
            for ov in (False, True, False, True):
                try:
                    on, tpot, tps, step, out = run(model, ov, batch, n_new, plen, cuda)
                except Exception as e:  # report and go on with the other variants
                    print(f"{shape:8s} batch {batch}: overlap {ov}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                outs.setdefault(on, out)
                print(f"{shape:8s} batch {batch}: overlap {on!s:5s} TPOT {tpot:.4f} ms  {tps:8.1f} tok/s  "
                      f"graphed step {step:.4f} ms", flush=True)
            if len(outs) == 2:
                print(f"{shape:8s} batch {batch}: same tokens with and without overlap: {outs[True] == outs[False]}")
        del model
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
