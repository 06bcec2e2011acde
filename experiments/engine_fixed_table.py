"""Does a policy's choice come from its acceptance estimates or from its timings? Runs ``specdec.run`` with the
policy's step-time table taken from an earlier run (its metrics.json ``policy_state.step_ms``, e.g. one served on
the H200) instead of profiled here, and with ``policy.time_ema=0`` served steps and iterations do not move it: the
engine and the acceptance replay run as usual, so what the policy does follows from its a(k) estimates and that
fixed table alone. Then counts the k of every decode step per batch size and the switches (the run's steps.jsonl).

H200 crossover_8b at 6d0055c, parametric trace, C = 4: goodput switched 31 times between tree16 and tree48 and held
tree48 on 22% of the full-batch steps (0.967 of the envelope). That run's table on the CPU, a tiny random target on
the same code path (``--quick`` runs this with 8 requests; results/README.md has the committed run's overrides):

    python experiments/engine_fixed_table.py \
        --table experiments/results/scale/crossover_8b_parametric_6d0055c/b/8/metrics.json --out DIR -- \
        +experiment=crossover_8b acceptance.parametric.mean=6 policy=goodput workload.concurrency=4 \
        workload.duration_s=null workload.requests_per_client=24 workload.min_requests=96 engine.dtype=float32 \
        engine.kv_cache_tokens=16384 device=cpu target.config.hidden_size=64 ...   (the TINY shapes below)

Writes DIR/fixed_table.md (k per decode batch, switches) beside the run directory DIR/run.
"""

from __future__ import annotations

import argparse
import collections
import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUICK_TABLE = ROOT / "experiments/results/scale/crossover_8b_parametric_6d0055c/b/8/metrics.json"
TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 4096}
QUICK = ["+experiment=crossover_8b", "acceptance.parametric.mean=6", "policy=goodput", "workload.concurrency=4",
         "workload.duration_s=null", "workload.requests_per_client=2", "workload.min_requests=8",
         "engine.dtype=float32", "engine.kv_cache_tokens=16384", "device=cpu",
         *(f"target.config.{k}={v}" for k, v in TINY.items())]


def load_table(path: Path) -> dict[int, dict[int, float]]:
    """{k: {batch: ms}} of a run's metrics.json (policy_state.step_ms, keys "k=K")."""
    try:
        state = json.loads(path.read_text())["policy_state"]["step_ms"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"engine_fixed_table: {path} has no policy_state.step_ms (a goodput run's metrics.json): {e}")
    return {int(k.split("=", 1)[1]): {int(b): float(ms) for b, ms in row.items()} for k, row in state.items()}


def summarize(run_dir: Path, table_path: Path) -> str:
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    by_batch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in steps:
        by_batch[int(r["decode_bs"])][int(r["k"])] += 1
    switches = sum(a["k"] != b["k"] for a, b in zip(steps, steps[1:]))
    lines = [f"# engine_fixed_table: step table of {table_path}", "",
             f"{len(steps)} decode steps, {switches} switches of k; policy time_ema 0 (the table alone prices k)", "",
             "| decode batch | steps | k: steps |", "| ---: | ---: | --- |"]
    for b in sorted(by_batch):
        c = by_batch[b]
        lines.append(f"| {b} | {sum(c.values())} | " + ", ".join(f"{k}: {n}" for k, n in sorted(c.items())) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", default=None, help="an earlier run's metrics.json (a goodput run's)")
    ap.add_argument("--out", required=True, help="folder: the run directory run/ and fixed_table.md")
    ap.add_argument("--quick", action="store_true", help="the docstring's C = 4 point, 8 requests, tiny target (CPU)")
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if a.quick:
        a.table = a.table or str(QUICK_TABLE)
        overrides = overrides or QUICK
    if a.table is None or not overrides:
        ap.error("give --table and the run's overrides after --, or --quick")
    table = load_table(Path(a.table))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from specdec.engine import profiling

    def fixed(engine) -> None:
        missing = [k for k in engine.policy.ks if k not in table]
        if missing:
            raise SystemExit(f"engine_fixed_table: {a.table} has no step times for k in {missing}")
        engine.policy.set_table({k: table[k] for k in engine.policy.ks})

    profiling.calibrate_policy_ = fixed  # the engine looks it up at start-up
    sys.argv = ["specdec.run", *overrides, "policy.time_ema=0", "logger=none", f"hydra.run.dir={out / 'run'}"]
    try:
        runpy.run_module("specdec.run", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    text = summarize(out / "run", Path(a.table))
    (out / "fixed_table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
