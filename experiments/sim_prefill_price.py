"""Does pricing the prefill forwards' fixed cost close goodput's gap at C = 256? An offline check in
experiments/sim_serving.py's closed loop (no model, no host time).

At 8B shapes and C = 256 a closed loop prefills in nearly every iteration; each prefill forward pays a
fixed cost (the forward's intercept, ~one read of the weights, plus the padding up to its token bucket)
whatever k the decode step ran at, and a k that commits more tokens per iteration spreads it over more
tokens. goodput prices decode steps only. This variant ("goodput+prefill") adds to an iteration at k the
expected fixed cost: (EMA of the fixed ms per prefill forward) x min(1, forwards per iteration so far x
tokens at k / tokens per iteration so far), the forwards scaling with the requests that finish (a closed
loop). Reported: tok/s of never / always / goodput / goodput+prefill and each goodput over the envelope.

    python experiments/sim_prefill_price.py          # env: CS=4,16,64,128,256 SEEDS=3 STAGGER=1 TRACE=replay|param
    python experiments/sim_prefill_price.py --quick  # CPU smoke run
"""
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
QUICK = "--quick" in sys.argv  # CPU smoke run: two concurrencies, one seed, short runs
import sim_serving as S  # noqa: E402
from specdec.acceptance import AcceptanceTrace, parametric_trace  # noqa: E402
from specdec.policy import Goodput  # noqa: E402

class PP(Goodput):
    """goodput + per-iteration prefill overhead pricing"""
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.ov_per_fwd = None   # EMA overhead ms per prefill forward
        self.fwd_per_it = None   # EMA forwards per iteration
        self.tok_per_it = None   # EMA tokens committed per iteration (at current k)
        self._pending = (0, 0.0)
    def prefill_(self, forwards, overhead_ms):
        f, o = self._pending
        self._pending = (f + forwards, o + overhead_ms)
    def update(self, stats):
        super().update(stats)
        f, o = self._pending; self._pending = (0, 0.0)
        w = 0.05
        if f:
            per = o / f
            self.ov_per_fwd = per if self.ov_per_fwd is None else (1 - w) * self.ov_per_fwd + w * per
        self.fwd_per_it = f if self.fwd_per_it is None else (1 - w) * self.fwd_per_it + w * f
        t = sum(stats.committed)
        self.tok_per_it = t if self.tok_per_it is None else (1 - w) * self.tok_per_it + w * t
    def rate(self, k, batch, rows=None):
        a = self.expected(k, batch, rows)
        if a is None:
            return None
        ms = self.iter_ms(k, batch)
        if self.ov_per_fwd is not None and self.tok_per_it:
            f = min(1.0, self.fwd_per_it * a / self.tok_per_it)
            ms += f * self.ov_per_fwd
        return a / batch / ms

def run(C, make, seed, stagger, seconds, warmup, fwd_a=3.5, fwd_b=0.0198, patch=False):
    # patch forwards accounting into the policy
    holder = {}
    def mk():
        p = make(); holder["p"] = p; return p
    if patch:
        orig = S.forwards_ms
        def fw(fwd, total):
            ms = orig(fwd, total)
            p = holder.get("p")
            if p is not None and hasattr(p, "prefill_"):
                # forwards: count by chunk; overhead = ms - b * real tokens
                n = -(-total // 2048)
                p.prefill_(n, ms - fwd_b * total)
            return ms
        S.forwards_ms = fw
    try:
        return S.simulate(mk, table, lengths, C=C, seconds=seconds, warmup=warmup, seed=seed, chunk=2048,
                          fwd_a=fwd_a, fwd_b=fwd_b, stagger=stagger)["tok_s"]
    finally:
        if patch: S.forwards_ms = orig

table = S.step_table(Path(S.TABLE))
lengths = [int(e["prompt_len"]) for e in json.loads(Path(S.LENGTHS).read_text())["sets"]["humaneval"]]
ks = sorted(S.DEPTHS)
kw = dict(ema=0.1, prior_ema=0.01, margin=0.03, probe_rows=4, probe_cost=4, explore_every=32, explore_backoff=2.0,
          explore_max=1024, switch_horizon=32, explore_budget=0.05, counterfactual=True)
trace_kind = os.environ.get("TRACE", "replay")
S.simulate.trace = parametric_trace(6, 7) if trace_kind == "param" else AcceptanceTrace.from_json(json.loads(Path(S.TRACE).read_text()), str(S.TRACE))
stagger = os.environ.get("STAGGER", "1") == "1"
seconds, warmup = (8, 2.5) if stagger else (5, 1.0)
Cs = [int(x) for x in os.environ.get("CS", "4,16,64,128,256").split(",")]
seeds = int(os.environ.get("SEEDS", "3"))
if QUICK:
    Cs, seeds, seconds, warmup = [4, 32], 1, 1.5, 0.5
print(f"trace {trace_kind} stagger {stagger} {seconds}s")
for C in Cs:
    res = {}
    arms = [("never", S.Never, False)] + [(f"always{k}", (lambda k=k: S.Always(k)), False) for k in ks] + \
           [("goodput", lambda: Goodput(ks, **kw), False), ("goodput+prefill", lambda: PP(ks, **kw), True)]
    for name, make, patch in arms:
        res[name] = statistics.mean(run(C, make, s, stagger, seconds, warmup, patch=patch) for s in range(seeds))
    env = max(v for n, v in res.items() if not n.startswith("goodput"))
    print(C, {n: round(v) for n, v in res.items()}, "goodput/env %.3f  +prefill/env %.3f" % (res["goodput"] / env, res["goodput+prefill"] / env), flush=True)
