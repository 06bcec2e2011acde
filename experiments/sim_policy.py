"""Offline policy simulation: a policy's choices against the alwayses, over replayed acceptance.

A closed loop of C requests (128 new tokens each) runs through a policy object alone, with no model:
each step at k commits, per row, the accepted length that specdec's replay draws for k
(``ReplayAcceptance``, the committed SmolLM2 trace by default; counterfactual samples of the smaller
sizes coupled by quantile, as an engine with replayed acceptance feeds them), and costs the step time
given for k (``--step-ms``, ms at batch 1, times 1 + ``--per-row`` per extra row; default: the
Llama-3.1-8B-shape graphed steps of crossover_8b's goodput table at 533a1d2, H200). Tokens per
simulated second of each policy, over the best always, averaged over seeds: what a policy's estimator
makes of the acceptance noise, separately from the engine's timing noise.

``--between S`` gives each request its own acceptance level (a request-level shift of S standard
deviations in the quantile of every draw; SmolLM2 + committed head on HumanEval, tree 8: the requests'
means varied by 0.36 against 1.92 within one request, S ~ 0.44); 0 draws every step alike (a replay
trace without per-request sequences).

    python experiments/sim_policy.py --concurrency 1,2,8 --between 0,0.44 --out $OUT
    python experiments/sim_policy.py --quick --out /tmp/sim    # CPU smoke run
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.acceptance import AcceptanceTrace, ReplayAcceptance  # noqa: E402
from specdec.policy import Always, Goodput  # noqa: E402
from specdec.policy.base import BatchView, StepStats  # noqa: E402

TRACE = ROOT / "experiments/results/acceptance/smollm2_eagle3_humaneval_41d1e6b.json"
STEP_MS = "0:4.31,3:5.47,16:6.16,48:6.95"  # crossover_8b_533a1d2 goodput C = 1: its start-up table
DEPTHS = "3:3,16:5,48:7"  # eagle3_random's chain 3 / tree16 (topk 4, 5 steps) / tree48 (topk 8, 7 steps)


def _pairs(text: str, kind=float) -> dict[int, float]:
    return {int(a): kind(b) for a, b in (item.split(":") for item in text.split(","))}


class _Rows:
    """What ReplayAcceptance.bind_ asks of an engine's state and drafter."""

    def __init__(self, depths: dict[int, int]):
        self.depths = depths

    def add_row_buffer(self, name, shape, dtype, follows="rows"):
        return torch.zeros(1, dtype=dtype)

    def num_nodes(self, k: int) -> int:
        return k + 1

    def max_path_nodes(self, T: int) -> int:
        return self.depths[T - 1] + 1


def simulate(make_policy, trace, depths, step_ms, *, C: int, between: float, seconds: float, seed: int,
             counterfactual: bool, per_row: float, max_new: int = 128) -> float:
    """Committed tokens per simulated second of one policy."""
    rng = random.Random(seed)
    replay = ReplayAcceptance(trace, seed=seed, per_request=False, missing="nearest")
    ks = sorted(depths)
    shim = _Rows(depths)
    replay.bind_(shim, shim, ks)
    replay.counterfactual_({k: tuple(j for j in ks if j < k) for k in ks})
    policy = make_policy()
    scale = 1.0 + per_row * (C - 1)
    if hasattr(policy, "set_table"):
        policy.set_table({k: {C: ms * scale} for k, ms in step_ms.items()})
    if counterfactual and hasattr(policy, "counterfactual_"):
        policy.counterfactual_({(j, k): "replayed" for k in ks for j in ks if j < k})
    rid, t, tokens = 0, 0.0, 0

    def new():
        nonlocal rid
        rid += 1
        return {"id": f"r{rid}", "shift": rng.gauss(0.0, between), "left": max_new}

    live = [new() for _ in range(C)]
    while t < seconds * 1e3:
        ids = tuple(r["id"] for r in live)
        k = policy.choose(BatchView(num_decode=C, num_waiting=0, rows=ids))
        cf = None
        if k == 0:
            committed = [1] * C
        else:
            # The replay's own draw, then each request's shift on the quantile scale (S = 0: unchanged)
            replay.rng = _Shifted(rng, [r["shift"] for r in live], between)
            committed = [1 + a for a in replay.draw(k, ids)]
            cf = replay.last_cf if counterfactual else None
        committed = [min(c, r["left"]) for c, r in zip(committed, live)]
        for c, r in zip(committed, live):
            r["left"] -= c
        ms = step_ms[k] * scale
        policy.update(StepStats(k=k, num_decode=C, committed=committed, rows=list(ids), step_ms=ms,
                                counterfactual=cf))
        if hasattr(policy, "iteration_"):
            policy.iteration_(k, C, ms, 0.5)
        t += ms
        tokens += sum(committed)
        live = [r if r["left"] > 0 else new() for r in live]
    return tokens / t * 1e3


class _Shifted:
    """A ``random()`` source for ReplayAcceptance.draw: row i's uniform is Phi((z + shift_i) / sd)
    with z standard normal, so each row keeps a uniform marginal when shifts are N(0, S^2)."""

    def __init__(self, rng: random.Random, shifts: list[float], between: float):
        self.rng, self.shifts, self.i = rng, shifts, 0
        self.sd = math.sqrt(1.0 + between * between)

    def random(self) -> float:
        shift = self.shifts[self.i % len(self.shifts)]
        self.i += 1
        return 0.5 * (1.0 + math.erf((self.rng.gauss(0.0, 1.0) + shift) / self.sd / math.sqrt(2.0)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(TRACE), help="acceptance trace JSON (specdec.acceptance build-trace)")
    ap.add_argument("--step-ms", default=STEP_MS, help="k:ms at batch 1, comma-separated (k = 0 included)")
    ap.add_argument("--depths", default=DEPTHS, help="k:tree depth of each speculative size")
    ap.add_argument("--per-row", type=float, default=0.05, help="step time growth per extra row (relative)")
    ap.add_argument("--concurrency", default="1,2,8,32")
    ap.add_argument("--between", default="0,0.44", help="request-level spreads S to simulate")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=60.0, help="simulated seconds per run")
    ap.add_argument("--out", default=None, help="folder for sim_policy.md")
    ap.add_argument("--quick", action="store_true", help="a few simulated seconds (smoke run)")
    a = ap.parse_args(argv)
    if a.quick:
        a.concurrency, a.between, a.seeds, a.seconds = "1,4", "0,0.44", 1, 2.0
    import json

    trace = AcceptanceTrace.from_json(json.loads(Path(a.trace).read_text()), a.trace)
    step_ms, depths = _pairs(a.step_ms), _pairs(a.depths, int)
    ks = sorted(depths)

    def goodput():
        return Goodput(ks, ema=0.1, prior_ema=0.01, margin=0.03, probe_rows=4, probe_cost=4, explore_every=32,
                       explore_backoff=2.0, explore_max=1024, switch_horizon=32, explore_budget=0.05,
                       counterfactual=True)

    arms = [(f"always{k}", (lambda k=k: Always(k)), False) for k in ks]
    arms += [("goodput, no counterfactual", goodput, False), ("goodput, replayed counterfactual", goodput, True)]
    lines = [f"# sim_policy: {Path(a.trace).name}, step ms {a.step_ms} (+{a.per_row:g} per row), "
             f"{a.seconds:g} simulated s x {a.seeds} seeds", "",
             "| S | C | " + " | ".join(name for name, _, _ in arms) + " |",
             "| ---: | ---: |" + " ---: |" * len(arms)]
    for between in (float(x) for x in a.between.split(",")):
        for C in (int(x) for x in a.concurrency.split(",")):
            tps = [statistics.mean(simulate(f, trace, depths, step_ms, C=C, between=between, seconds=a.seconds,
                                            seed=s, counterfactual=cf, per_row=a.per_row) for s in range(a.seeds))
                   for _, f, cf in arms]
            best = max(tps[: len(ks)])
            lines.append(f"| {between:g} | {C} | " + " | ".join(f"{v / best:.3f}" for v in tps) + " |")
            print(lines[-1], flush=True)
    lines += ["", "Each policy's tokens per simulated second over the best always at that C and S."]
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sim_policy.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
