"""Where does a speculative n-gram iteration under goodput spend the time that one under always does
not? (H200 envelope at 7ee0bb9, n-gram on HumanEval, C = 1: median chain-8 iteration 0.884 ms under
goodput against 0.789 ms under always.) One engine per arm, SmolLM2-135M shapes with RANDOM bf16
weights (no model files), the n-gram drafter with chains 2 / 4 / 8, one request whose prompt repeats
(so chains are drafted), overlapped decoding, every iteration at chain 8 (``engine.step(8)``, so every
arm runs the same steps), and the engine parts a policy switches on taken away one at a time:

  none           no policy (the always run's engine, without its choose)
  always         policy always(8): choose only
  goodput        goodput (k forced to 8 after its choose), its hooks as served: step timing events,
                 request ids, shadow scoring, nested-chain counterfactuals, iteration times
  -events        ... without the step timing events (wants_step_ms off)
  -shadow        ... without shadow scoring
  -update        ... with update / iteration_ no-ops (the engine still builds StepStats)

Per arm: median and mean wall ms per iteration over ``--iters`` iterations after ``--warmup``, best of
``--reps`` engines. Run (one GPU, ~1 min):  python experiments/spec_iter_overhead.py
"""

import argparse
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
from specdec.policy import Always, Goodput  # noqa: E402
from specdec.spec import NgramDrafter  # noqa: E402

ARMS = ("none", "always", "goodput", "-events", "-shadow", "-update", "-all")


def build(model, arm: str):
    pol = None
    if arm == "always":
        pol = Always(8)
    elif arm != "none":
        pol = Goodput([2, 4, 8], shadow_evals=2, counterfactual=True, probe_rows=4, probe_cost=4, shadow_min_rows=2,
                      probe_requests=16, explore_every=32, explore_backoff=2.0, profile_context=256, profile_iters=2)
    eng = Engine(model, EngineConfig(max_batch_size=1, kv_cache_tokens=16384, max_seq_len=8192, overlap=True),
                 drafter=NgramDrafter(chains=[2, 4, 8]), ks=(0, 2, 4, 8), policy=pol)
    if isinstance(pol, Goodput):
        choose = pol.choose
        pol.choose = lambda view: (choose(view), 8)[1]
        if arm in ("-events", "-all"):
            eng._policy_times = False
        if arm in ("-shadow", "-all"):
            eng._shadow = None
        if arm in ("-update", "-all"):
            pol.update = lambda stats: None
            eng._policy_iters = lambda *a, **kw: None
    return eng


def run(model, arm: str, iters: int, warmup: int) -> list[float]:
    eng = build(model, arm)
    g = torch.Generator().manual_seed(0)
    unit = torch.randint(0, model.config.vocab_size, (40,), generator=g).tolist()
    eng.add_request(unit * 8, iters + warmup + 64, ignore_eos=True)
    times = []
    while eng.has_work() and len(times) < iters + warmup:
        t = time.perf_counter()
        eng.step(None if arm != "none" else 8)
        times.append((time.perf_counter() - t) * 1e3)
    return times[warmup:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (a CPU check of the script)")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = LlamaModel.random(llama_config_from_dict(TINY if a.tiny else SMOLLM2), device=dev, dtype=dtype, seed=0)
    print(f"# spec_iter_overhead.py at {git_commit()}, {device_name()}, SmolLM2-135M shapes (random), batch 1, "
          f"chain 8 every iteration")
    print("| arm | median ms | mean ms | reps (median) |")
    print("| --- | ---: | ---: | --- |")
    for arm in ARMS:
        meds, means = [], []
        for _ in range(a.reps):
            ts = run(model, arm, a.iters, a.warmup)
            meds.append(st.median(ts))
            means.append(st.mean(ts))
        print(f"| {arm} | {min(meds):.3f} | {min(means):.3f} | {' / '.join(f'{m:.3f}' for m in meds)} |", flush=True)


if __name__ == "__main__":
    main()
