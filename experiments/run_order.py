"""Does a run's place in its sweep group change what it measures? Reads one or more multirun folders (run directories
numbered in the order they ran, each with config.json and per-step records: steps.jsonl or steps.jsonl.gz), groups
consecutive runs that share every setting but the policy (a point and seed, as ``seed=0,1,2 policy=...`` sweeps them),
and measures per run the host-side cost of its prefills: the median of prefill_ms per 100 prefilled tokens over its
steps that prefilled at least MIN_TOKENS tokens after WARMUP_S (the prefill forward's device work is the same for
every policy of a point, so its wall time tells how fast the host ran). Each run's cost is divided by its group's
geometric mean (over its runs with records); the table gives the mean of log(ratio) by place in the group and by policy, and how often a place was
costlier than the group's mean.

With a fixed order (Hydra's basic sweeper) place and policy coincide and cannot be told apart; with the policy
studies' RotatingSweeper (specdec/sweeper.py) every policy runs in every place over a point's seeds, and the two
tables separate them.

    python experiments/run_order.py SWEEP_DIR [SWEEP_DIR ...] [--out FILE]
    python experiments/run_order.py --quick [--out FILE]    # a committed sweep (QUICK_SWEEP)
"""

from __future__ import annotations

import json
import math
import statistics as st
import sys
from pathlib import Path

from step_records import emit, parse_args, read_steps  # noqa: E402 (experiments/, the script's own folder)

QUICK_SWEEP = Path(__file__).resolve().parent / "results/spec/policy_969e48b/calib_he"
MIN_TOKENS = 64
WARMUP_S = 1.0




def policy_label(cfg: dict) -> str:
    pol = cfg.get("policy") or {}
    label = str(pol.get("name", "?"))
    for key in ("k", "host_model", "calibrate", "ramp_hold"):
        v = pol.get(key)
        if key == "k" and v is not None and label == "always":
            label += str(v)
        elif key != "k" and v:
            label += f"+{key}"
    return label


def prefill_cost(steps: list[dict]) -> float | None:
    per = [r["prefill_ms"] / r["prefill_tokens"] * 100.0 for r in steps
           if r.get("prefill_tokens", 0) >= MIN_TOKENS and r.get("prefill_ms") and r.get("t_s", 0.0) >= WARMUP_S]
    return st.median(per) if per else None


def groups(sweep: Path) -> list[list[tuple[str, float]]]:
    """Consecutive runs of one point and seed: [(policy, prefill cost)] in run order (runs without records skipped)."""
    runs = sorted((d for d in sweep.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
    out, key_prev, cur = [], None, []
    for d in runs:
        cfg = json.loads((d / "config.json").read_text())
        steps = read_steps(d)
        cost = prefill_cost(steps) if steps else None
        point = json.dumps({k: v for k, v in cfg.items() if k not in ("policy", "commit", "date_utc", "run_dir")},
                           sort_keys=True, default=str)
        if point != key_prev and cur:
            out.append(cur)
            cur = []
        key_prev = point
        cur.append((policy_label(cfg), cost))
    if cur:
        out.append(cur)
    return out


def collect(sweeps) -> tuple[dict, dict, int]:
    """log(run's prefill cost / its group's geometric mean), by place in the group and by policy; the groups used."""
    by_place: dict[int, list[float]] = {}
    by_policy: dict[str, list[float]] = {}
    n_groups = 0
    for s in sweeps:
        for g in groups(Path(s)):
            known = [(place, p, c) for place, (p, c) in enumerate(g, 1) if c]  # places count every run
            if len(known) < 2:
                continue
            n_groups += 1
            mean = math.exp(st.mean(math.log(c) for _, _, c in known))
            for place, p, c in known:
                by_place.setdefault(place, []).append(math.log(c / mean))
                by_policy.setdefault(p, []).append(math.log(c / mean))
    return by_place, by_policy, n_groups


def main(argv=None) -> int:
    a = parse_args(__doc__, QUICK_SWEEP, argv, what="multirun folders (numbered run directories)")
    by_place, by_policy, n_groups = collect(a.paths)
    lines = ["# run_order: prefill wall time per token by place in a sweep group and by policy", "",
             f"{n_groups} groups (runs of one point and seed; runs without per-step records left out, their places "
             f"counted) from: "
             + ", ".join(a.paths) + f". Median prefill_ms per 100 tokens of steps prefilling >= {MIN_TOKENS} tokens "
             f"after {WARMUP_S:g} s, over the group's geometric mean.", "",
             "| place | runs | mean log ratio | costlier than the group |", "| ---: | ---: | ---: | ---: |"]
    for place, v in sorted(by_place.items()):
        lines.append(f"| {place} | {len(v)} | {st.mean(v):+.3f} | {sum(x > 0 for x in v) / len(v):.2f} |")
    lines += ["", "| policy | runs | mean log ratio | costlier than the group |", "| --- | ---: | ---: | ---: |"]
    for p, v in sorted(by_policy.items()):
        lines.append(f"| {p} | {len(v)} | {st.mean(v):+.3f} | {sum(x > 0 for x in v) / len(v):.2f} |")
    return emit(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
