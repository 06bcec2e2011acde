"""How well do goodput's per-request acceptance estimates predict the next step's commits? Reads run directories'
per-step records (steps.jsonl or steps.jsonl.gz with per-row ``accepted`` / ``accepted_ids``, as ``specdec.run``
writes them) and replays the steps served at the run's most common k > 0 through ``Goodput`` itself (its own a(k)
per request and prior, ``ema``, or ``shadow_ema`` for a drafter that scores shadow drafts, n-gram), once without and
once with ``calibrate``. Before each step it asks the policy what the step's rows will commit (``expected``) and
compares with what they did commit: the pooled ratio (tokens committed / tokens predicted over the steps; 1.0 is
unbiased) and the mean absolute relative error per step, over the steps after the first second.

Only the served steps at one k feed the replay (no shadow or counterfactual samples, no other k), so it measures
the estimator, not a run's choices.

    python experiments/calibration_bias.py RUN_DIR [RUN_DIR ...] [--calibrate 0.002] [--out FILE]
    python experiments/calibration_bias.py --quick [--out FILE]    # a committed goodput run (QUICK_RUN)
"""

from __future__ import annotations

import collections
import json
import statistics as st
import sys
from pathlib import Path

from step_records import emit, parse_args, read_steps  # noqa: E402 (experiments/, the script's own folder)

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from specdec.policy import Goodput, StepStats  # noqa: E402

QUICK_RUN = ROOT / "results/spec/policy_e5229cc/ngram_mt_high_c_repeats/6"
WARMUP_S = 1.0  # steps before this many seconds (the ramp-up) feed the estimates but are left out of the summary




def replay(steps: list[dict], k: int, *, ema: float, shadowed: bool, calibrate: float) -> dict:
    """Feed the steps served at k (with per-row records) to a fresh Goodput; per summarized step the ratio of what
    its rows committed to what the policy expected of them just before."""
    pol = Goodput([k], ema=ema, shadow_ema=ema, calibrate=calibrate)
    pol.shadowed = shadowed  # only picks shadow_ema for the own estimates here: no shadow samples are fed
    ratios, got, wanted = [], 0.0, 0.0
    for s in steps:
        rows, acc = s.get("accepted_ids"), s.get("accepted")
        if s.get("k") != k or not rows or acc is None or len(rows) != len(acc):
            continue
        committed = [a + 1 for a in acc]
        want = pol.expected(k, len(rows), rows)
        if want and s.get("t_s", 0.0) >= WARMUP_S:
            ratios.append(sum(committed) / want)
            got, wanted = got + sum(committed), wanted + want
        pol.update(StepStats(k=k, num_decode=len(rows), committed=committed, rows=list(rows)))
    if not ratios:
        return {"steps": 0, "ratio": float("nan"), "abs_err": float("nan"), "factor": pol.calibration(k)}
    return {"steps": len(ratios), "ratio": got / wanted, "abs_err": st.mean(abs(r - 1.0) for r in ratios),
            "factor": pol.calibration(k)}


def summarize(run: Path, calibrate: float) -> str:
    steps = read_steps(run, "calibration_bias")
    cfg = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
    pol_cfg = cfg.get("policy") or {}
    drafter = (cfg.get("draft") or {}).get("name", "?")
    shadowed = drafter == "ngram"
    ema = float(pol_cfg.get("shadow_ema", 0.03) if shadowed else pol_cfg.get("ema", 0.1))
    counts = collections.Counter(s["k"] for s in steps if s.get("k"))
    if not counts:
        return f"| {run} | - | no speculative steps | | | | |"
    k = counts.most_common(1)[0][0]
    off = replay(steps, k, ema=ema, shadowed=shadowed, calibrate=0.0)
    on = replay(steps, k, ema=ema, shadowed=shadowed, calibrate=calibrate)
    conc = (cfg.get("workload") or {}).get("concurrency", "?")
    return (f"| {run} | {drafter} | {pol_cfg.get('name', '?')}, C = {conc} | {k} | {off['steps']} | "
            f"{off['ratio']:.3f} / {off['abs_err']:.3f} | {on['ratio']:.3f} / {on['abs_err']:.3f} (x{on['factor']:.3f}) |")


def main(argv=None) -> int:
    a = parse_args(__doc__, QUICK_RUN, argv, extra=lambda ap: ap.add_argument(
        "--calibrate", type=float, default=0.002, help="goodput's calibrate weight per row (the 'on' arm)"))
    lines = ["# calibration_bias: committed / predicted per step, goodput's own a(k) replayed", "",
             f"Steps at the run's most common k > 0 after {WARMUP_S:g} s; tokens committed / predicted over them / mean "
             f"absolute relative error per step, without and with calibrate = {a.calibrate:g} (its final factor).", "",
             "| run | drafter | policy | k | steps | off: ratio / error | on: ratio / error |",
             "| --- | --- | --- | ---: | ---: | --- | --- |"]
    lines += [summarize(Path(r), a.calibrate) for r in a.paths]
    return emit(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
