"""Why do engines of one configuration differ in iteration time? (spec_iter_overhead.py at f8cc0a4 on
the H200: three engines of the same arm took 0.779 / 0.918 / 0.927 ms per chain-8 n-gram iteration at
batch 1.) Builds ``--engines`` engines one after another over one model (SmolLM2-135M shapes, RANDOM
bf16 weights, the n-gram drafter with chains 2 / 4 / 8, one request whose prompt repeats), runs
``--iters`` iterations of each at a fixed k, and splits each engine's iteration into

  wall     start to start of ``engine.step`` (median, ms)
  host     wall less the time blocked on the device (reading a step's tokens)
  device   the decode launch's GPU time (CUDA events of the engine's trace)

with the GPU's SM clock (NVML, when present) and the CPU the loop ran on, so a slow engine shows
whether the host or the device is slower, and whether the previous engine's leftovers matter
(``--free``: drop the previous engine, collect, empty the CUDA cache before building the next).

Run (one GPU, ~1 min):  python experiments/engine_spread.py [--k 8] [--free] [--out DIR]
"""

import argparse
import ctypes
import gc
import json
import os
import statistics as st
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "experiments")]
from profile_step import SMOLLM2, TINY  # noqa: E402
from specdec.bench.provenance import device_name, git_commit  # noqa: E402
from specdec.bench.targets import llama_config_from_dict  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402
from specdec.spec import NgramDrafter  # noqa: E402


def sm_clock() -> float | None:
    """The GPU's current SM clock in MHz (NVML), or None."""
    try:
        return float(torch.cuda.clock_rate())
    except Exception:  # no NVML / no GPU
        return None


def current_cpu() -> int:
    """The CPU this thread runs on (glibc sched_getcpu), or -1."""
    try:
        return ctypes.CDLL(None).sched_getcpu()
    except (OSError, AttributeError):
        return -1


def one_engine(model, k: int, iters: int, warmup: int, overlap: bool) -> dict:
    recs: list[dict] = []
    eng = Engine(model, EngineConfig(max_batch_size=1, kv_cache_tokens=16384, max_seq_len=8192, overlap=overlap),
                 drafter=NgramDrafter(chains=[2, 4, 8]), ks=(0, 2, 4, 8), trace=recs.append)
    g = torch.Generator().manual_seed(0)
    unit = torch.randint(0, model.config.vocab_size, (40,), generator=g).tolist()
    eng.add_request(unit * 8, iters + warmup + 64, ignore_eos=True)
    walls, hosts, cpus, clocks = [], [], set(), []
    t_prev = None
    while eng.has_work() and len(walls) < iters + warmup:
        t = time.perf_counter()
        if t_prev is not None:
            walls.append((t - t_prev) * 1e3)
            hosts.append(walls[-1] - waited * 1e3)
        eng.step(k)
        waited = eng._waited_s
        t_prev = t
        if len(walls) % 100 == 0:
            cpus.add(current_cpu())
            c = sm_clock()
            if c is not None:
                clocks.append(c)
    eng.flush_trace()
    dev = [r["decode_ms"] for r in recs[warmup:] if r.get("decode_bs")]
    walls, hosts = walls[warmup:], hosts[warmup:]
    out = dict(wall=st.median(walls), wall_mean=st.mean(walls), host=st.median(hosts), device=st.median(dev),
               device_mean=st.mean(dev), cpus=sorted(cpus), clock=st.median(clocks) if clocks else None,
               captures=eng.graph_captures())
    del eng
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--free", action="store_true", help="collect and empty the CUDA cache between engines")
    ap.add_argument("--sync", action="store_true", help="engine.overlap false")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (a CPU check of the script)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = LlamaModel.random(llama_config_from_dict(TINY if a.tiny else SMOLLM2), device=dev, dtype=dtype, seed=0)
    head = (f"# engine_spread.py at {git_commit()}, {device_name()}, SmolLM2-135M shapes (random), batch 1, k = {a.k}, "
            f"{a.engines} engines{' (freed between)' if a.free else ''}{' (synchronous)' if a.sync else ''}")
    print(head)
    print("| engine | wall ms | wall mean | host ms | device ms | device mean | SM MHz | CPUs | build s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    rows = []
    for i in range(a.engines):
        if a.free:
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
        t0 = time.perf_counter()
        r = one_engine(model, a.k, a.iters, a.warmup, overlap=not a.sync)
        r["seconds"] = time.perf_counter() - t0
        rows.append(r)
        print(f"| {i} | {r['wall']:.3f} | {r['wall_mean']:.3f} | {r['host']:.3f} | {r['device']:.3f} | "
              f"{r['device_mean']:.3f} | {r['clock'] or '-'} | {r['cpus']} | {r['seconds']:.1f} |", flush=True)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        tag = f"k{a.k}{'_free' if a.free else ''}{'_sync' if a.sync else ''}"
        (Path(a.out) / f"engine_spread_{tag}.json").write_text(json.dumps(dict(title=head, rows=rows), indent=1))


if __name__ == "__main__":
    main()
