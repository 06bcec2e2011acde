"""How noisy are a run's iteration wall times, and how long does its policy hold each k? Reads run directories'
per-step records (steps.jsonl or steps.jsonl.gz, as ``specdec.run`` writes them) and prints, per run and k, the
unmixed iterations at the run's most common decode batch (neither the step nor the one before it prefilled; the
wall time of an iteration is the gap between two steps' t_s): their count, p10 / p50 / p90 ms and the standard
deviation of log(wall ms); the tokens committed per row on those steps; the runs of consecutive steps at one k
(how many, the longest); and the mixed iterations at that batch (the step or the one before it prefilled): their
count and mean ms, what a policy that prices k from unmixed iterations does not see.

A policy that prices each k from an average of its own served iterations keeps a k's average where its last
iterations left it while another k runs: with wall-time noise of this size a switch can come from the noise of the
k running, and the way back waits for the other's frozen value to be undercut (goodput's ``host_model`` prices
every k from its device step and one host line instead).

    python experiments/iter_noise.py RUN_DIR [RUN_DIR ...] [--out FILE]
    python experiments/iter_noise.py --quick [--out FILE]    # a committed goodput run (QUICK_RUN)
"""

from __future__ import annotations

import collections
import json
import math
import statistics as st
import sys
from pathlib import Path

from step_records import emit, parse_args, read_steps  # noqa: E402 (experiments/, the script's own folder)

QUICK_RUN = Path(__file__).resolve().parent / "results/spec/policy_e5229cc/eagle3_humaneval_stagger/8"




def summarize(run: Path) -> list[str]:
    rows = read_steps(run, "iter_noise")
    if len(rows) < 2:
        return [f"{run}: fewer than two steps"]
    batch = collections.Counter(r["decode_bs"] for r in rows).most_common(1)[0][0]
    walls: dict[int, list[float]] = collections.defaultdict(list)
    mixed: dict[int, list[float]] = collections.defaultdict(list)
    commits: dict[int, list[float]] = collections.defaultdict(list)
    for a, b in zip(rows, rows[1:]):
        if b["decode_bs"] != batch:
            continue
        if not a["prefill_tokens"] and not b["prefill_tokens"]:
            walls[b["k"]].append((b["t_s"] - a["t_s"]) * 1e3)
            commits[b["k"]].append(b["committed"] / batch)
        else:
            mixed[b["k"]].append((b["t_s"] - a["t_s"]) * 1e3)
    held: dict[int, list[int]] = collections.defaultdict(list)
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i]["k"] != rows[start]["k"]:
            held[rows[start]["k"]].append(i - start)
            start = i
    switches = sum(len(v) for v in held.values()) - 1
    cfg = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
    policy = (cfg.get("policy") or {}).get("name", "?")
    conc = (cfg.get("workload") or {}).get("concurrency", "?")
    out = [f"## {run} ({policy}, C = {conc}): {len(rows)} steps, {switches} switches, decode batch {batch}", "",
           "| k | unmixed iterations | p10 / p50 / p90 ms | sd of log | tokens per row | runs at k | longest | mixed: n / mean ms |",
           "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for k in sorted(set(walls) | set(held)):
        w = sorted(x for x in walls.get(k, []) if x > 0)
        q = " / ".join(f"{w[int(p * (len(w) - 1))]:.2f}" for p in (0.1, 0.5, 0.9)) if w else "-"
        sd = f"{st.pstdev([math.log(x) for x in w]):.3f}" if len(w) > 1 else "-"
        tok = f"{st.mean(commits[k]):.2f}" if commits.get(k) else "-"
        h = held.get(k, [])
        m = mixed.get(k, [])
        mx = f"{len(m)} / {st.mean(m):.2f}" if m else "-"
        out.append(f"| {k} | {len(w)} | {q} | {sd} | {tok} | {len(h)} | {max(h) if h else '-'} | {mx} |")
    return out + [""]


def main(argv=None) -> int:
    a = parse_args(__doc__, QUICK_RUN, argv)
    lines = ["# iter_noise: iteration wall times and held k per run", ""]
    for r in a.paths:
        lines += summarize(Path(r))
    return emit(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
