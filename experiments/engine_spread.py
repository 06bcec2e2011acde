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
import cProfile
import ctypes
import gc
import json
import os
import pstats
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
from specdec.spec import DeviceNgramDrafter, NgramDrafter  # noqa: E402


def sm_clock() -> float | None:
    """The GPU's current SM clock in MHz (NVML), or None."""
    try:
        return float(torch.cuda.clock_rate())
    except Exception:  # no NVML / no GPU
        return None


def cpu_probe() -> float:
    """ms of a fixed pure-Python workload (median of 15): the host CPU's speed right now."""
    ts = []
    for _ in range(15):
        t = time.perf_counter()
        x = 0
        for i in range(20000):
            x += i * i % 7
        ts.append((time.perf_counter() - t) * 1e3)
    return st.median(ts)


def current_cpu() -> int:
    """The CPU this thread runs on (glibc sched_getcpu), or -1."""
    try:
        return ctypes.CDLL(None).sched_getcpu()
    except (OSError, AttributeError):
        return -1


def one_engine(model, k: int, iters: int, warmup: int, overlap: bool, prof=None, lookup: str = "host") -> dict:
    recs: list[dict] = []
    drafter = DeviceNgramDrafter(chains=[2, 4, 8]) if lookup == "device" else NgramDrafter(chains=[2, 4, 8])
    eng = Engine(model, EngineConfig(max_batch_size=1, kv_cache_tokens=16384, max_seq_len=8192, overlap=overlap),
                 drafter=drafter, ks=(0, 2, 4, 8), trace=recs.append)
    g = torch.Generator().manual_seed(0)
    unit = torch.randint(0, model.config.vocab_size, (40,), generator=g).tolist()
    eng.add_request(unit * 8, iters + warmup + 64, ignore_eos=True)
    walls, hosts, cpus, clocks = [], [], set(), []
    t_prev = None
    probe0 = cpu_probe()
    while eng.has_work() and len(walls) < iters + warmup:
        if prof is not None and len(walls) == warmup:
            prof.enable()
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
    if prof is not None:
        prof.disable()
    probe = (probe0 + cpu_probe()) / 2
    eng.flush_trace()
    dev = [r["decode_ms"] for r in recs[warmup:] if r.get("decode_bs")]
    walls, hosts = walls[warmup:], hosts[warmup:]
    out = dict(wall=st.median(walls), wall_mean=st.mean(walls), host=st.median(hosts), device=st.median(dev),
               device_mean=st.mean(dev), cpus=sorted(cpus), clock=st.median(clocks) if clocks else None,
               captures=eng.graph_captures(), probe=probe)
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
    ap.add_argument("--lookup", choices=("host", "device"), default="host", help="the n-gram drafter's draft.lookup")
    ap.add_argument("--profile", type=int, default=0,
                    help="cProfile each engine's timed iterations; print the N functions whose own time differs "
                         "most between the slowest and the fastest engine")
    ap.add_argument("--sync-debug", action="store_true",
                    help="torch.cuda.set_sync_debug_mode('warn') for one engine first: every synchronising call")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (a CPU check of the script)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = LlamaModel.random(llama_config_from_dict(TINY if a.tiny else SMOLLM2), device=dev, dtype=dtype, seed=0)
    head = (f"# engine_spread.py at {git_commit()}, {device_name()}, SmolLM2-135M shapes (random), batch 1, k = {a.k}, "
            f"{a.engines} engines{' (freed between)' if a.free else ''}{' (synchronous)' if a.sync else ''}, "
            f"draft.lookup={a.lookup}")
    print(head)
    print("| engine | wall ms | wall mean | host ms | device ms | device mean | SM MHz | CPUs | build s | CPU probe ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    if a.sync_debug and dev == "cuda":
        import warnings
        seen = {}
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            one_engine(model, a.k, 60, 10, overlap=not a.sync, lookup=a.lookup)
        torch.cuda.set_sync_debug_mode(0)
        for w in ws:
            key = f"{Path(w.filename).name}:{w.lineno}"
            seen[key] = seen.get(key, 0) + 1
        print("synchronising calls (file:line: count over 70 iterations incl. build):",
              ", ".join(f"{k_}: {v}" for k_, v in sorted(seen.items(), key=lambda kv: -kv[1])[:20]))
    rows, profs = [], []
    for i in range(a.engines):
        if a.free:
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
        t0 = time.perf_counter()
        prof = cProfile.Profile() if a.profile else None
        r = one_engine(model, a.k, a.iters, a.warmup, overlap=not a.sync, prof=prof, lookup=a.lookup)
        profs.append(prof)
        r["seconds"] = time.perf_counter() - t0
        rows.append(r)
        print(f"| {i} | {r['wall']:.3f} | {r['wall_mean']:.3f} | {r['host']:.3f} | {r['device']:.3f} | "
              f"{r['device_mean']:.3f} | {r['clock'] or '-'} | {r['cpus']} | {r['seconds']:.1f} | {r['probe']:.3f} |", flush=True)
    if a.profile:
        order = sorted(range(len(rows)), key=lambda i: rows[i]["wall"])
        fast, slow = order[0], order[-1]

        def own(prof):  # function -> (calls, own seconds)
            return {f"{Path(k_[0]).name}:{k_[1]}({k_[2]})": (v[1], v[2]) for k_, v in pstats.Stats(prof).stats.items()}
        f_, s_ = own(profs[fast]), own(profs[slow])
        diff = sorted(set(f_) | set(s_), key=lambda n: -abs(s_.get(n, (0, 0))[1] - f_.get(n, (0, 0))[1]))
        print(f"\nown time per timed iteration (us), slowest engine {slow} against fastest {fast}:")
        print("| function | calls slow | calls fast | us slow | us fast |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for n in diff[:a.profile]:
            cs, ts = s_.get(n, (0, 0.0))
            cf, tf = f_.get(n, (0, 0.0))
            print(f"| {n} | {cs} | {cf} | {ts / a.iters * 1e6:.1f} | {tf / a.iters * 1e6:.1f} |")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        tag = f"k{a.k}_{a.lookup}{'_free' if a.free else ''}{'_sync' if a.sync else ''}"
        (Path(a.out) / f"engine_spread_{tag}.json").write_text(json.dumps(dict(title=head, rows=rows), indent=1))


if __name__ == "__main__":
    main()
