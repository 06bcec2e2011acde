"""Offline: goodput's choices in a host-bound loop whose host speed drifts, n-gram-like acceptance, no model.

Question: at SmolLM2 shapes with the n-gram drafter at C = 128 / 256 (H200, 484bb89, MT-bench, staggered) the
iterations are host-bound, never runs at 0.79 / 0.93 of always, every k > 0 makes about the same tok/s within one
goodput run, yet goodput cycles through k = 2, 4, 8 and k = 0 (episodes of 10-150 steps) and spends 10-16% of its
steps at k = 0; and same-point runs differ by up to 25% with the host's speed (three never runs in 17 s: 93932 /
78308 / 74925 tok/s). Does a host whose speed drifts, with goodput's served-iteration estimates refreshed only for
the k it serves, produce that cycling, and what does it cost against always at the same drift?

Model (every number a knob):
- B decode rows, each request 128 tokens, replaced as it finishes (a steady closed loop); a row is in a repeated
  stretch of text or not (a Markov chain per step; share ``--repeat``); in one a k-step accepts min(k, G) drafts
  (G geometric, P(G >= n) = q^n), out of one min(k, 1) with probability ``--stray``, else nothing;
- the engine's samples, as goodput gets them from n-gram: the served step's commits, the nested chains'
  counterfactual commits (min(committed, k' + 1)), two shadow-scored drafts per step at the ks above the step's;
- an iteration costs max(device step(k), host), host = H(t) (h0 + h1 x tokens committed per row) with lognormal
  noise and rare 2.5x spikes; ``--mixed`` of the iterations also prefill (+``--prefill-ms``, left out of goodput's
  estimates as the engine marks them); H(t) switches between 1 and ``--slow`` with exponential dwell times.
Every arm (never, always at each k, goodput) sees the same drift path and acceptance stream per seed: paired.

    python experiments/sim_host_drift.py --out $OUT
    python experiments/sim_host_drift.py --quick           # CPU smoke run
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from specdec.policy import Always, Never, build_policy  # noqa: E402
from specdec.policy.base import BatchView, StepStats  # noqa: E402

KS = (2, 4, 8)
DEVICE_MS = {0: 1.23, 2: 1.45, 4: 1.60, 8: 1.92}  # H200 decode steps at 128 rows (484bb89 abiter runs' means)


class Drift:
    """Host speed factor over simulated ms: 1 or ``slow``, switching after exponential dwell times."""

    def __init__(self, rng: random.Random, slow: float, dwell_ms: float):
        self.rng, self.slow, self.dwell = rng, slow, dwell_ms
        self.state, self.until = 1.0, rng.expovariate(1.0 / dwell_ms)

    def at(self, t_ms: float) -> float:
        while t_ms >= self.until:
            self.state = self.slow if self.state == 1.0 else 1.0
            self.until += self.rng.expovariate(1.0 / self.dwell)
        return self.state


def simulate(make_policy, a, seed: int) -> dict:
    acc_rng, host_rng, drift_rng = random.Random(seed), random.Random(seed + 1000), random.Random(seed + 2000)
    drift = Drift(drift_rng, a.slow, a.dwell_ms)
    policy = make_policy()
    if hasattr(policy, "set_table"):
        policy.set_table({k: {a.batch: DEVICE_MS[k]} for k in policy.ks})
        policy.shadowed_()
        policy.counterfactual_({(j, k): "exact" for k in KS for j in KS if j < k})
    stay = 1.0 - 1.0 / a.repeat_len  # a repeated stretch lasts repeat_len steps on average
    enter = (1.0 - stay) * a.repeat / (1.0 - a.repeat)
    nid = 0

    def new_row():
        nonlocal nid
        nid += 1
        return {"id": f"r{nid}", "left": 128, "rep": acc_rng.random() < a.repeat}

    rows = [new_row() for _ in range(a.batch)]
    for r in rows:  # a staggered loop: requests part-way through
        r["left"] = acc_rng.randint(1, 128)

    def draw(row, k):
        if row["rep"]:
            g = 0
            while g < k and acc_rng.random() < a.q:
                g += 1
            return g
        return min(k, 1) if acc_rng.random() < a.stray else 0

    t, tokens, counted_ms, choices = 0.0, 0, 0.0, []
    while t < a.seconds * 1e3:
        ids = tuple(r["id"] for r in rows)
        k = policy.choose(BatchView(num_decode=len(rows), num_waiting=0, num_prefilling=0, rows=ids))
        for r in rows:
            r["rep"] = acc_rng.random() < (stay if r["rep"] else enter)
        committed = [1 + draw(r, k) for r in rows] if k else [1] * len(rows)
        cf = {j: [min(c, j + 1) for c in committed] for j in KS if j < k} or None
        shadow = None
        if hasattr(policy, "shadow_due") and policy.shadow_due():
            above = [j for j in KS if j > k]
            shadow = []
            for _ in range(2 if above else 0):
                r = rows[acc_rng.randrange(len(rows))]
                j = above[acc_rng.randrange(len(above))]
                shadow.append((j, r["id"], 1 + draw(r, j)))
        policy.update(StepStats(k=k, num_decode=len(rows), committed=committed, rows=list(ids),
                                step_ms=DEVICE_MS[k], shadow=shadow, shadow_ms=0.0 if shadow else None,
                                counterfactual=cf))
        h = drift.at(t)
        per_row = sum(committed) / len(committed)
        host = h * (a.h0 + a.h1 * per_row) * math.exp(host_rng.gauss(0.0, a.noise))
        if host_rng.random() < 0.03:
            host *= 2.5
        mixed = host_rng.random() < a.mixed
        wall = max(DEVICE_MS[k], host) + (h * a.prefill_ms if mixed else 0.0)
        if hasattr(policy, "iteration_"):
            policy.iteration_(k, len(rows), wall, host + (h * a.prefill_ms if mixed else 0.0), mixed=mixed)
        if t >= a.warmup * 1e3:
            tokens += sum(committed)
            counted_ms += wall
            choices.append(k)
        t += wall
        for i, (r, c) in enumerate(zip(rows, committed)):
            r["left"] -= c
            if r["left"] <= 0:
                rows[i] = new_row()
    switches = sum(1 for x, y in zip(choices, choices[1:]) if x != y)
    return {"tok_s": tokens / counted_ms * 1e3, "k0": choices.count(0) / max(1, len(choices)),
            "switches": switches, "shares": {k: choices.count(k) / max(1, len(choices)) for k in (0, *KS)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--repeat", type=float, default=0.18, help="share of rows in a repeated stretch")
    ap.add_argument("--repeat-len", type=float, default=5.0, help="steps a repeated stretch lasts on average")
    ap.add_argument("--q", type=float, default=0.75, help="P(G >= n) = q^n in a repeated stretch")
    ap.add_argument("--stray", type=float, default=0.15, help="P(one draft accepted) out of one")
    ap.add_argument("--h0", type=float, default=1.5, help="host ms an iteration (fast host)")
    ap.add_argument("--h1", type=float, default=0.9, help="host ms per token committed per row")
    ap.add_argument("--noise", type=float, default=0.1, help="lognormal sigma of an iteration's host time")
    ap.add_argument("--mixed", type=float, default=0.7, help="share of iterations that also prefill")
    ap.add_argument("--prefill-ms", type=float, default=1.0)
    ap.add_argument("--slow", default="1.0,1.3", help="host slow-down factors to sweep (1.0: no drift)")
    ap.add_argument("--dwell-ms", type=float, default=2000.0, help="mean time between host speed switches")
    ap.add_argument("--variants", default="", help="goodput overrides to compare, ';'-separated, e.g. "
                    "'margin=0.1;iter_min_samples=16'")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if a.quick:
        a.seeds, a.seconds, a.warmup, a.slow = 1, 1.5, 0.5, "1.3"
    base = OmegaConf.load(ROOT / "conf/policy/goodput.yaml")
    base.ks, base.profile_context = list(KS), 64

    def goodput(extra: str):
        cfg = base.copy()
        for kv in filter(None, extra.split(",")):
            key, val = kv.split("=", 1)
            cfg[key.strip()] = OmegaConf.create({"v": val.strip()}).v if val.strip() not in ("true", "false") \
                else val.strip() == "true"
        return lambda: build_policy(cfg)

    arms = [("never", Never)] + [(f"always{k}", (lambda k=k: Always(k))) for k in KS] + [("goodput", goodput(""))]
    arms += [(f"goodput {v}", goodput(v.replace(" ", ","))) for v in a.variants.split(";") if v.strip()]
    lines = [f"# sim_host_drift: {a.batch} rows, {a.seconds:g} s x {a.seeds} seeds from {a.warmup:g} s; repeat "
             f"{a.repeat:g} (len {a.repeat_len:g}), q {a.q:g}, stray {a.stray:g}; host {a.h0:g} + {a.h1:g} ms/token, "
             f"noise {a.noise:g}, mixed {a.mixed:g} (+{a.prefill_ms:g} ms), dwell {a.dwell_ms:g} ms", "",
             "| host slow-down | " + " | ".join(n for n, _ in arms) + " | " +
             " | ".join(f"{n} / envelope" for n, _ in arms[1 + len(KS):]) + " | goodput k = 0 share | goodput switches |",
             "| ---: |" + " ---: |" * (len(arms) + len(arms) - len(KS) - 1 + 2)]
    for slow in (float(x) for x in a.slow.split(",")):
        a_slow = argparse.Namespace(**{**vars(a), "slow": slow})
        res = {n: [simulate(make, a_slow, s) for s in range(a.seeds)] for n, make in arms}
        tps = {n: statistics.mean(r["tok_s"] for r in rs) for n, rs in res.items()}
        env = max(tps[n] for n, _ in arms[: 1 + len(KS)])
        gp = res["goodput"]
        lines.append(f"| {slow:g} | " + " | ".join(f"{tps[n]:.0f}" for n, _ in arms) + " | "
                     + " | ".join(f"{tps[n] / env:.3f}" for n, _ in arms[1 + len(KS):])
                     + f" | {statistics.mean(r['k0'] for r in gp):.2f} | {statistics.mean(r['switches'] for r in gp):.0f} |")
        print(lines[-1], flush=True)
    lines += ["", "tok/s: tokens committed per simulated second; the envelope is max(never, every always); the same "
              "drift path and acceptance stream per seed for every arm."]
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sim_host_drift.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
