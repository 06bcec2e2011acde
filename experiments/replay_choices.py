"""What would a policy have chosen, and earned, on a served run's own acceptance? Replays the per-step records of a
run that served every step at the largest k of nested chains (``policy=always`` with ``draft=ngram_chains``: a chain
of k' < k accepts min(accepted, k') of the same text) through policy objects, step by step, on the CPU: at each step
the policy sees the run's decode rows, picks k, and is told what the rows would have committed at that k (min(c,
k + 1) of each row's c at the largest k), the counterfactual commits of the smaller ks, shadow samples of the larger
ones (two a step, round robin over rows and ks, as the engine's ShadowAcceptance scores them), and an iteration wall
time drawn from the iterations served at that k in the given H200 runs (``--iter-runs``: runs with per-step records
at each k, best one goodput run, whose ks ran on one host state), from the mixed ones (a prefill in the iteration)
where the recorded step's iteration was mixed, else from the clean ones; the policy is told which, as the engine
tells it. Its step-time table is a given run's
(``--table``: a goodput run's metrics.json). Rows, their order and when they come and go are the recorded run's
whatever the policy picks, so this measures choices on real acceptance dynamics (a request's acceptance growing along
its answer, churn) and real iteration-time noise, not the closed loop's feedback.

Prints tokens per ms of iteration time (the steps after WARMUP_S) for each fixed k, for each policy config
(``--policies``: conf/policy names, with overrides after a colon, e.g. goodput:calibrate=0.002), over ``--seeds`` draws
of the iteration times and shadow rows, each over the best fixed k of the same draw.

    python experiments/replay_choices.py --always RUN --table METRICS.json --iter-runs RUN [RUN ...] \
        [--policies goodput,goodput_calibrated] [--seeds 4] [--out FILE]
    python experiments/replay_choices.py --quick [--out FILE]    # a committed n-gram MT-bench point (QUICK_*)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics as st
import sys
from pathlib import Path

from step_records import emit, read_steps  # noqa: E402 (experiments/, the script's own folder)

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from specdec.policy import BatchView, StepStats, build_policy  # noqa: E402

WARMUP_S = 1.0
QUICK_DIR = ROOT / "results/spec/policy_fd4df8d/hostmodel_mt_bench"
QUICK_ALWAYS, QUICK_TABLE, QUICK_ITER = "9", "10", ("10",)  # C = 64, seed 2: always, goodput (its ks' iterations)




def mixed_flags(steps: list[dict]) -> list[bool]:
    """Per step: whether its iteration (to the next step's start) also prefilled (this step or the next did)."""
    return [bool(a["prefill_tokens"] or b["prefill_tokens"]) for a, b in zip(steps, steps[1:])] + [True]


def iteration_pools(runs: list[Path], batch: int) -> dict[tuple[int, bool], list[float]]:
    """Wall ms of iterations at decode batches within 10% of ``batch`` after WARMUP_S, per (k, mixed): mixed ones
    also prefilled (the step or the next one did), clean ones did not."""
    pools: dict[tuple[int, bool], list[float]] = {}
    for run in runs:
        steps = read_steps(run, "replay_choices")
        for a, b, mixed in zip(steps, steps[1:], mixed_flags(steps)):
            if a["t_s"] >= WARMUP_S and abs(a["decode_bs"] - batch) <= 0.1 * batch:
                pools.setdefault((a["k"], mixed), []).append((b["t_s"] - a["t_s"]) * 1e3)
    return pools


def step_table(metrics: Path) -> dict[int, dict[int, float]]:
    state = json.loads(metrics.read_text()).get("policy_state") or {}
    table = state.get("step_ms")
    if not table:
        raise SystemExit(f"replay_choices: {metrics} has no policy_state.step_ms (a goodput run's metrics.json)")
    return {int(k.split("=")[1]): {int(b): float(ms) for b, ms in row.items()} for k, row in table.items()}


def make_policy(spec: str, ks: list[int]):
    name, _, over = spec.partition(":")
    cfg = OmegaConf.load(ROOT.parent / "conf/policy" / f"{name}.yaml")
    for base in (cfg.get("defaults") or []):  # goodput_* configs: goodput.yaml under their own keys
        if isinstance(base, str) and base != "_self_":
            cfg = OmegaConf.merge(OmegaConf.load(ROOT.parent / "conf/policy" / f"{base}.yaml"), cfg)
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o for o in over.split(",") if o]))
    cfg.pop("defaults", None)
    if str(cfg.get("profile_context")) == "auto":
        cfg.profile_context = 512
    return build_policy(cfg, sizes=ks)


def replay(steps: list[dict], ks: list[int], pools: dict[int, list[float]], table, policy, seed: int) -> dict:
    """Tokens and decode iteration ms per fixed k and for ``policy`` (None: fixed ks only) over one draw."""
    rng = random.Random(seed)
    top = ks[-1]
    fixed = {k: [0.0, 0.0] for k in [0, *ks]}
    got, ms, chosen = 0.0, 0.0, {}
    if policy is not None:
        policy.set_table(table)
        policy.counterfactual_({(a, b): "exact" for b in ks for a in ks if a < b})
        if getattr(policy, "shadow_evals", 0):
            policy.shadowed_()
    cursor = 0
    for s, mixed in zip(steps, mixed_flags(steps)):
        rows, acc = s.get("accepted_ids"), s.get("accepted")
        if s.get("k") != top or not rows or acc is None or len(rows) != len(acc):
            continue
        c_top = [a + 1 for a in acc]
        B = len(rows)
        draws = {k: rng.choice(pools[(k, mixed)]) for k in fixed}
        if s["t_s"] >= WARMUP_S:
            for k, v in fixed.items():
                v[0] += B if k == 0 else sum(min(c, k + 1) for c in c_top)
                v[1] += draws[k]
        if policy is None:
            continue
        k = policy.choose(BatchView(num_decode=B, num_waiting=0, rows=tuple(rows)))
        committed = [1] * B if k == 0 else [min(c, k + 1) for c in c_top]
        cf = {j: [min(c, j + 1) for c in c_top] for j in ks if j < k} or None
        shadow = None
        if getattr(policy, "shadowed", False) and policy.shadow_due():
            above = [j for j in ks if j > k]
            shadow = []
            for _ in range(min(2, len(above) * B)):
                i, j = divmod(cursor % (len(above) * B), len(above))
                cursor += 1
                shadow.append((above[j], rows[i], min(c_top[i], above[j] + 1)))
        policy.update(StepStats(k=k, num_decode=B, committed=committed, rows=list(rows),
                                step_ms=policy.step_ms(k, B), counterfactual=cf, shadow=shadow or None))
        policy.iteration_(k, B, draws[k], 0.8 * draws[k], mixed=mixed)  # as the engine reports them
        if s["t_s"] >= WARMUP_S:
            got += sum(committed)
            ms += draws[k]
            chosen[k] = chosen.get(k, 0) + 1
    out = {f"k={k}": v[0] / v[1] for k, v in fixed.items()}
    if policy is not None:
        out["policy"] = got / ms
        out["chosen"] = chosen
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--always", help="a run at the largest k with per-row records (policy=always)")
    ap.add_argument("--table", help="a goodput run's metrics.json (its step-time table)")
    ap.add_argument("--iter-runs", nargs="*", default=[], help="runs whose clean iterations give each k's wall times")
    ap.add_argument("--policies", default="goodput,goodput_calibrated", help="conf/policy names[:overrides], comma-separated")
    ap.add_argument("--ks", default="2,4,8", help="the drafter's nested chain lengths")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="a committed n-gram MT-bench C = 64 point")
    a = ap.parse_args(argv)
    if a.quick and not a.always:
        a.always = str(QUICK_DIR / QUICK_ALWAYS)
        a.table = str(QUICK_DIR / QUICK_TABLE / "metrics.json")
        a.iter_runs = [str(QUICK_DIR / r) for r in QUICK_ITER]
        a.seeds = min(a.seeds, 2)
    if not (a.always and a.table and a.iter_runs):
        ap.error("give --always, --table and --iter-runs (or --quick)")
    ks = [int(k) for k in a.ks.split(",")]
    steps = read_steps(Path(a.always), "replay_choices")
    batch = round(st.median(s["decode_bs"] for s in steps if s["decode_bs"]))
    pools = iteration_pools([Path(r) for r in a.iter_runs], batch)
    missing = [key for key in ((k, m) for k in [0, *ks] for m in (False, True)) if len(pools.get(key, [])) < 5]
    if missing:
        raise SystemExit(f"replay_choices: fewer than 5 iterations at (k, mixed) in {missing} near batch {batch} in "
                         f"{a.iter_runs}")
    table = step_table(Path(a.table))
    lines = ["# replay_choices: policies on a served run's acceptance", "",
             f"Rows and acceptance from {a.always} (k = {ks[-1]}, decode batch ~{batch}); iteration ms drawn from the "
             f"iterations of {', '.join(a.iter_runs)}, clean or mixed as the recorded step's (k clean / mixed: count, mean "
             f"ms "
             + ", ".join(f"{k}: {len(pools[(k, False)])}, {st.mean(pools[(k, False)]):.2f} / {len(pools[(k, True)])}, "
                         f"{st.mean(pools[(k, True)]):.2f}" for k in [0, *ks]) + f"); step table of "
             f"{a.table}. Tokens per ms of iteration after {WARMUP_S:g} s, over the best fixed k of the same "
             f"draw; {a.seeds} draws.", "",
             "| policy | mean over best fixed k | min | max | steps per k (first draw) |", "| --- | ---: | ---: | ---: | --- |"]
    fixed_ratio: dict[str, list[float]] = {}
    for seed in range(a.seeds):
        base = replay(steps, ks, pools, table, None, seed)
        best = max(base.values())
        for k, v in base.items():
            fixed_ratio.setdefault(k, []).append(v / best)
    for k, v in fixed_ratio.items():
        lines.append(f"| always {k} | {st.mean(v):.3f} | {min(v):.3f} | {max(v):.3f} | |")
    for spec in a.policies.split(","):
        ratios, first = [], None
        for seed in range(a.seeds):
            out = replay(steps, ks, pools, table, make_policy(spec, ks), seed)
            best = max(v for k, v in out.items() if k.startswith("k="))
            ratios.append(out["policy"] / best)
            first = first or out["chosen"]
        lines.append(f"| {spec} | {st.mean(ratios):.3f} | {min(ratios):.3f} | {max(ratios):.3f} | "
                     + ", ".join(f"{k}: {n}" for k, n in sorted(first.items())) + " |")
    return emit(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
