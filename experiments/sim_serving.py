"""Offline serving simulation: a closed loop with chunked prefill, a decode batch that fills and drains, the
draft's catch-up, and a policy object choosing k, over replayed acceptance and measured step times; no model.

Question: at high concurrency, does a policy lose to never because of what happens around its decode steps
(the ramp-up, prefill forwards, requests finishing out of step) rather than because of the k it holds? The
H200 crossover at 8B shapes (c33d9cd, C = 256) had goodput at k = 0 on 96% of its steps yet 0.94x of never,
with prefill forwards of 1032 tokens against never's 1871. This replays that setting with the engine's
iteration structure:
- C clients, each sending its next request (a HumanEval prompt length, 128 new tokens) as the last one
  finishes; every request is admitted at once (max_batch_size = C);
- each iteration prefills up to ``--chunk`` prompt tokens first come, first served (a prompt may span
  iterations), cut to the bucket below where that forward plus one over the rest costs less than padding
  up (the engine's prefill fit), then runs one decode step at the policy's k over every row whose prompt
  is done; a request's draft is behind by what it committed at k = 0 and by a prompt prefilled while off,
  and a switch back on first runs that backlog through catch-up forwards;
- costs: the decode step at (k, batch bucket) from a step-time table (default: the H200 goodput start-up
  table of crossover_8b at c33d9cd, 8B shapes), a prefill / catch-up forward over a token bucket N at
  ``a + b N`` ms; host time is not modelled (the 8B iterations are device-bound);
- acceptance: specdec's ReplayAcceptance draws per row (the committed SmolLM2 trace), the smaller sizes'
  counterfactual samples coupled by quantile, as an engine with replayed acceptance feeds them.

Policies: never, always at each size, goodput as configured by default (counterfactual), and goodput with
``defer_first_tries`` (no first try while the requests still prefilling outnumber the decode rows). Reported: committed tokens per simulated second from ``--warmup`` s to the end, and the
prefill forwards' mean tokens, per policy and C, averaged over seeds.

    python experiments/sim_serving.py --concurrency 64,128,256 --out $OUT
    python experiments/sim_serving.py --stagger ...    # a staggered closed loop (workload.stagger)
    python experiments/sim_serving.py --quick --out /tmp/sim_serving    # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.acceptance import AcceptanceTrace, ReplayAcceptance, parametric_trace  # noqa: E402
from specdec.engine.graphs import bucket_for, fit_tokens, forwards_ms  # noqa: E402
from specdec.policy import Always, Goodput, Never  # noqa: E402
from specdec.policy.base import BatchView, StepStats  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_policy import _Rows  # noqa: E402  (the state / drafter shim ReplayAcceptance binds to)

TRACE = ROOT / "experiments/results/acceptance/smollm2_eagle3_humaneval_41d1e6b.json"
LENGTHS = ROOT / "experiments/results/acceptance/prompt_lengths_smollm2.json"
TABLE = ROOT / "experiments/results/scale/crossover_8b_c33d9cd/b/26/metrics.json"  # goodput, C = 256
DEPTHS = {3: 3, 16: 5, 48: 7}  # eagle3_random's chain 3 / tree16 (topk 4, 5 steps) / tree48 (topk 8, 7 steps)
PREFILL_BUCKETS = (128, 256, 512, 1024, 2048)


def step_table(path: Path) -> dict[int, dict[int, float]]:
    """{k: {batch bucket: ms}} from a goodput run's metrics.json (its start-up table)."""
    state = json.loads(path.read_text())["policy_state"]["step_ms"]
    return {int(k.split("=")[1]): {int(b): float(ms) for b, ms in row.items()} for k, row in state.items()}


def simulate(make_policy, table, lengths, *, C: int, seconds: float, warmup: float, seed: int, chunk: int,
             fwd_a: float, fwd_b: float, max_new: int = 128, stagger: bool = False, jitter: float = 0.0,
             spikes: tuple[float, float, float] = (0.0, 1.0, 1.0), host_ms: float = 1.0) -> dict:
    rng = random.Random(seed)
    noise_rng = random.Random(seed + 7919)  # the iterations' wall-time noise (--jitter / --spikes)

    def noise() -> float:
        """An iteration's wall time over its device time: lognormal jitter, now and then a host spike."""
        f = noise_rng.lognormvariate(0.0, jitter) if jitter else 1.0
        if spikes[0] and noise_rng.random() < spikes[0]:
            f *= noise_rng.uniform(spikes[1], spikes[2])
        return f

    trace = simulate.trace
    replay = ReplayAcceptance(trace, seed=seed, per_request=False, missing="nearest")
    ks = sorted(DEPTHS)
    shim = _Rows(DEPTHS)
    replay.bind_(shim, shim, ks)
    replay.counterfactual_({k: tuple(j for j in ks if j < k) for k in ks})
    policy = make_policy()
    buckets = sorted(table[0])
    if hasattr(policy, "set_table"):
        policy.set_table({k: table[k] for k in policy.ks})
    if hasattr(policy, "counterfactual_") and getattr(policy, "wants_counterfactual", False):
        policy.counterfactual_({(j, k): "replayed" for k in ks for j in ks if j < k})
    # the engine's prefill buckets: those below the chunk, and the chunk itself (its largest forward)
    fwd = {n: fwd_a + fwd_b * n for n in (*(b for b in PREFILL_BUCKETS if b < chunk), chunk)}
    if hasattr(policy, "catch_up_table_"):
        policy.catch_up_table_(fwd)

    rid = 0

    def new():
        nonlocal rid
        rid += 1
        return {"id": f"r{rid}", "prompt_left": rng.choice(lengths), "left": max_new, "backlog": 0}

    prefilling = [new() for _ in range(C)]
    if stagger:  # workload.stagger: client i's first request stops after ceil((i + 1) / C) of its tokens
        for i, r in enumerate(prefilling):
            r["left"] = max(1, -(-max_new * (i + 1) // C))
    decoding: list[dict] = []
    t, last_k, tokens, forwards, fwd_tokens = 0.0, None, 0, 0, 0
    while t < seconds * 1e3:
        ms = 0.0
        # prefill: first come, first served, up to chunk tokens, fitted to the buckets
        budget, plan = chunk, []
        for r in prefilling:
            if budget == 0:
                break
            n = min(r["prompt_left"], budget)
            plan.append([r, n])
            budget -= n
        if plan:
            total = fit_tokens(fwd, sum(n for _, n in plan))
            left = total
            for p in plan:
                p[1] = min(p[1], left)
                left -= p[1]
            plan = [p for p in plan if p[1] > 0]
            ms += forwards_ms(fwd, total)  # one forward: total <= chunk
            forwards += 1
            fwd_tokens += total
            # a prompt prefilled while off: the draft catches it up later (unless the policy asks for drafted
            # prefills: goodput's ramp_hold while a k is untried; the engine's rule)
            off = last_k == 0 and not (hasattr(policy, "drafts_prefill") and policy.drafts_prefill())
            for r, n in plan:
                r["prompt_left"] -= n
                if off:
                    r["backlog"] += n
            done = [r for r, _ in plan if r["prompt_left"] == 0]
            prefilling = [r for r in prefilling if r["prompt_left"] > 0]
            decoding += done
        B = len(decoding)
        if B:
            ids = tuple(r["id"] for r in decoding)
            backlog = sum(r["backlog"] for r in decoding)
            k = policy.choose(BatchView(num_decode=B, num_waiting=0, rows=ids, backlog=lambda: backlog,
                                        num_prefilling=len(prefilling)))
            if k > 0 and backlog:  # catch-up forwards over the backlog, chunk tokens each
                ms += forwards_ms(fwd, backlog)
                for r in decoding:
                    r["backlog"] = 0
            cf = None
            if k == 0:
                committed = [1] * B
            else:
                committed = [1 + a for a in replay.draw(k, ids)]
                cf = replay.last_cf
            committed = [min(c, r["left"]) for c, r in zip(committed, decoding)]
            step = table[k][bucket_for(buckets, B) if B <= buckets[-1] else buckets[-1]]
            ms += step
            policy.update(StepStats(k=k, num_decode=B, committed=committed, rows=list(ids), step_ms=step,
                                    counterfactual=cf))
            if jitter or spikes[0]:
                # the engine's iteration report: wall ms start to start (noisy), the host's share; iterations that
                # prefilled or caught the draft up are mixed (left out of goodput's iteration estimates)
                f = noise()
                if hasattr(policy, "iteration_"):
                    policy.iteration_(k, B, ms * f, host_ms * f, mixed=bool(plan) or (k > 0 and backlog > 0),
                                      switched=k > 0 and backlog > 0)
                ms *= f
            for c, r in zip(committed, decoding):
                r["left"] -= c
                if k == 0:
                    r["backlog"] += c
            if t >= warmup * 1e3:
                tokens += sum(committed)
            last_k = k
            finished = [r for r in decoding if r["left"] <= 0]
            decoding = [r for r in decoding if r["left"] > 0]
            prefilling += [new() for _ in finished]  # each client sends its next request at once
        t += ms if ms > 0 else 0.1
    return {"tok_s": tokens / (t - warmup * 1e3) * 1e3, "tokens_per_forward": fwd_tokens / max(1, forwards)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(TRACE), help="acceptance trace JSON (specdec.acceptance build-trace)")
    ap.add_argument("--table", default=str(TABLE), help="a goodput run's metrics.json: its step-time table")
    ap.add_argument("--parametric", type=float, default=None, metavar="MEAN",
                    help="the parametric trace instead of --trace: geometric per-depth acceptance with this mean "
                         "accepted length at depth 7 (crossover_8b's acceptance.parametric.mean=6)")
    ap.add_argument("--lengths", default=str(LENGTHS), help="prompt lengths JSON (sets.humaneval)")
    ap.add_argument("--concurrency", default="16,64,128,256")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0, help="simulated seconds per run")
    ap.add_argument("--warmup", type=float, default=1.0, help="tok/s counts from here (s)")
    ap.add_argument("--chunk", type=int, default=2048, help="prompt tokens per prefill forward")
    ap.add_argument("--fwd-ms", default="3.5,0.0198", help="a,b: a prefill forward over a bucket of N tokens costs "
                    "a + b N ms (default: 44 ms at 2048 tokens, the H200's 0.0237 ms a prompt token in never's "
                    "1871-token forwards at C = 256, c33d9cd; the 3.5 ms intercept, about one read of the 8B "
                    "weights, is assumed)")
    ap.add_argument("--out", default=None, help="folder for sim_serving.md")
    ap.add_argument("--stagger", action="store_true", help="a staggered closed loop (workload.stagger)")
    ap.add_argument("--explore-budget", type=float, default=0.05,
                    help="goodput's explore_budget (conf/policy/goodput.yaml: 0.05): the share of the time spent off a "
                         "re-try's catch-up may cost")
    ap.add_argument("--ramp-hold", action="store_true", help="also goodput with ramp_hold (k = 0 while the requests "
                    "prefilling outnumber the decode rows; prompts drafted while a k is untried)")
    ap.add_argument("--host-model", action="store_true", help="also goodput with host_model (every k priced from its "
                    "device step and one fitted host line, not from its own served iterations)")
    ap.add_argument("--jitter", type=float, default=0.0, metavar="SIGMA",
                    help="iteration wall time = device time x lognormal(0, SIGMA), reported to the policy's "
                         "iteration_ like the engine's (0: no noise, no iteration reports)")
    ap.add_argument("--spikes", default="0,1,1", metavar="P,LO,HI",
                    help="with probability P an iteration's wall time is also multiplied by U(LO, HI) (a host stall)")
    ap.add_argument("--host-ms", type=float, default=1.0, help="host ms per iteration reported with --jitter / --spikes")
    ap.add_argument("--quick", action="store_true", help="one seed, short runs (smoke run)")
    a = ap.parse_args(argv)
    if a.quick:
        a.concurrency, a.seeds, a.seconds, a.warmup = "4,32", 1, 1.5, 0.5
    if a.parametric is not None:
        simulate.trace = parametric_trace(a.parametric, 7)
    else:
        simulate.trace = AcceptanceTrace.from_json(json.loads(Path(a.trace).read_text()), a.trace)
    table = step_table(Path(a.table))
    lengths = [int(e["prompt_len"]) for e in json.loads(Path(a.lengths).read_text())["sets"]["humaneval"]]
    fwd_a, fwd_b = (float(x) for x in a.fwd_ms.split(","))
    ks = sorted(DEPTHS)

    def goodput(defer=False, hold=False, host=False):
        return lambda: Goodput(ks, ema=0.1, prior_ema=0.01, margin=0.03, probe_rows=4, probe_cost=4,
                               explore_every=32, explore_backoff=2.0, explore_max=1024, switch_horizon=32,
                               explore_budget=a.explore_budget, counterfactual=True, defer_first_tries=defer,
                               ramp_hold=hold, host_model=host, probe_requests=16)

    arms = [("never", Never)] + [(f"always{k}", (lambda k=k: Always(k))) for k in ks]
    arms += [("goodput", goodput()), ("goodput defer_first_tries", goodput(True))]
    if a.ramp_hold:
        arms.append(("goodput ramp_hold", goodput(hold=True)))
    if a.host_model:
        arms.append(("goodput host_model", goodput(host=True)))
    spikes = tuple(float(x) for x in a.spikes.split(","))
    n_gp = arms.index(next(x for x in arms if x[0] == "goodput"))
    source = f"parametric mean {a.parametric:g} at depth 7" if a.parametric is not None else Path(a.trace).name
    lines = [f"# sim_serving: {source}, step table {Path(a.table).parent.name} of {Path(a.table).parents[1].name}, "
             f"prefill forward {fwd_a:g} + {fwd_b:g} N ms, chunk {a.chunk}, {a.seconds:g} simulated s x {a.seeds} "
             f"seeds, tok/s from {a.warmup:g} s, explore_budget {a.explore_budget:g}"
             + (", staggered loop" if a.stagger else "")
             + (f", iteration noise: lognormal sigma {a.jitter:g}, spikes {a.spikes}, host {a.host_ms:g} ms"
                if a.jitter or spikes[0] else ""), "",
             "| C | " + " | ".join(name for name, _ in arms) + " | best always | "
             + " | ".join(f"{name} / envelope" for name, _ in arms[n_gp:])
             + " | prompt tokens per forward (never / " + " / ".join(name for name, _ in arms[n_gp:]) + ") |",
             "| ---: |" + " ---: |" * (2 * len(arms) - n_gp + 2)]
    for C in (int(x) for x in a.concurrency.split(",")):
        res = []
        for _, make in arms:
            runs = [simulate(make, table, lengths, C=C, seconds=a.seconds, warmup=a.warmup, seed=s, chunk=a.chunk,
                             fwd_a=fwd_a, fwd_b=fwd_b, stagger=a.stagger, jitter=a.jitter, spikes=spikes,
                             host_ms=a.host_ms) for s in range(a.seeds)]
            res.append({key: statistics.mean(r[key] for r in runs) for key in runs[0]})
        tps = [r["tok_s"] for r in res]
        env = max(tps[: 1 + len(ks)])
        best = max(range(1, 1 + len(ks)), key=lambda i: tps[i])
        lines.append(f"| {C} | " + " | ".join(f"{v:.0f}" for v in tps) + f" | {arms[best][0]} | "
                     + " | ".join(f"{tps[i] / env:.3f}" for i in range(n_gp, len(arms))) + " | "
                     + " / ".join(f"{res[i]['tokens_per_forward']:.0f}" for i in (0, *range(n_gp, len(arms))))
                     + " |")
        print(lines[-1], flush=True)
    lines += ["", "tok/s: committed tokens per simulated second from the warm-up on; the envelope is max(never, "
              "every always). " + ("Iteration wall times noisy as above (the policy sees them as the engine reports them)."
                                   if a.jitter or spikes[0] else
                                   "No host time, no timing noise: what the iteration structure alone does.")]
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sim_serving.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
