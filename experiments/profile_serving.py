"""Profile: where does a served iteration's wall time go? One closed-loop run through specdec.run, with
torch.profiler (host and device) around a window of engine iterations in its steady state.

An iteration of the overlapped engine queues step N and then waits for step N - 1, so its wall time
should be the device's step time whenever the host's own work is shorter. This script prints, for the
profiled window: wall ms per iteration (median, mean), the CUDA runtime calls that block the host
(cudaStreamSynchronize, cudaEventSynchronize, cudaMemcpyAsync, ...) by total time, and the host ops
that took the most time, so a hidden wait on queued GPU work shows up by name. It also times one
small host -> device upload of a pageable tensor (what ``specdec.engine.state.upload`` does) while
the GPU is busy, and the same from a pinned tensor.

    python experiments/profile_serving.py --out $OUT -- +experiment=crossover_8b policy=never \
        workload.concurrency=64 workload.duration_s=3 acceptance.parametric.mean=6
(overrides after ``--`` are specdec.run's; the run directory goes under --out).
CPU smoke run (a tiny random target, numbers meaningless):
    python experiments/profile_serving.py --quick --out /tmp/profile_serving
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def upload_probe() -> dict:
    """Host ms of a 64-value pageable / pinned upload queued behind ~20 ms of GPU work."""
    out = {}
    for name, pinned in (("pageable", False), ("pinned", True)):
        ms = []
        for _ in range(5):
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)  # ~10-20 ms of spinning on the current stream
            x = torch.arange(64, dtype=torch.int32)
            if pinned:
                x = x.pin_memory()
            t0 = time.perf_counter()
            x.to("cuda", non_blocking=True)
            ms.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        out[name] = round(statistics.median(ms), 3)
    return out


# (class path, method) pairs timed by --phases: inclusive host ms per call (nested ones overlap:
# _commit_oldest_ holds collect_, the policy's update and commit_tokens_).
PHASE_METHODS = (
    ("specdec.engine.engine:Engine", ("_commit_oldest_", "_emit_trace", "_catch_up_")),
    ("specdec.engine.step:Stepper", ("prefill_", "launch_", "collect_")),
    ("specdec.engine.graphs:PaddedPrefill", ("run_",)),
    ("specdec.engine.graphs:GraphedDecode", ("run_",)),
    ("specdec.engine.scheduler:Scheduler", ("ensure_decode_capacity_", "admit_", "plan_prefill", "prefill_chunks",
                                            "finish_prefill_", "commit_tokens_", "pop_finished", "add_")),
    ("specdec.engine.state:DecodeState", ("append_rows_", "keep_rows_", "set_pages_")),
    ("specdec.policy.goodput:Goodput", ("choose", "update", "iteration_")),
    ("specdec.policy.batch_threshold:BatchThreshold", ("choose", "update")),
    ("specdec.policy.never:Never", ("choose", "update")),
)


class PhaseClock:
    """Host ms per engine phase, per iteration class (prefilling or not), after ``skip`` iterations:
    each listed method wrapped with perf_counter (class-level, restored by ``remove``), plus each
    iteration's wall time start to start and the time outside Engine.step (the client's)."""

    def __init__(self, skip: int):
        import importlib
        self.skip, self.n = skip, 0
        self.cur: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.iters = {"prefill": [], "plain": []}  # per iteration: (wall ms, outside-step ms, {phase: ms})
        self._orig = []
        for path, names in PHASE_METHODS:
            mod, cls = path.split(":")
            klass = getattr(importlib.import_module(mod), cls)
            for name in names:
                raw = klass.__dict__.get(name)
                if raw is None:
                    continue
                self._orig.append((klass, name, raw))
                setattr(klass, name, self._wrap(f"{cls}.{name}", raw))
        self._t_prev = self._t_end = None

    def _wrap(self, key, raw):
        static = isinstance(raw, staticmethod)
        fn = raw.__func__ if static else raw
        clock = self

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock.cur[key] = clock.cur.get(key, 0.0) + (time.perf_counter() - t0) * 1e3
                clock.calls[key] = clock.calls.get(key, 0) + 1

        return staticmethod(timed) if static else timed

    def wrap_step(self, step):
        clock = self

        def phased_step(engine, *a, **kw):
            t0 = time.perf_counter()
            outside = None if clock._t_end is None else (t0 - clock._t_end) * 1e3
            wall = None if clock._t_prev is None else (t0 - clock._t_prev) * 1e3
            clock._t_prev = t0
            clock.cur = {}
            out = step(engine, *a, **kw)
            t1 = clock._t_end = time.perf_counter()
            clock.cur["Engine.step"] = (t1 - t0) * 1e3
            clock.n += 1
            if clock.n > clock.skip and wall is not None:
                kind = "prefill" if "Scheduler.prefill_chunks" in clock.cur else "plain"
                clock.iters[kind].append((wall, outside, clock.cur))
            return out

        return phased_step

    def remove(self):
        for klass, name, raw in self._orig:
            setattr(klass, name, raw)

    def report(self) -> dict:
        out = {}
        for kind, rows in self.iters.items():
            if not rows:
                continue
            n = len(rows)
            keys = sorted({k for _, _, cur in rows for k in cur})
            out[kind] = {"iterations": n,
                         "wall_ms_start_to_start": round(statistics.mean(w for w, _, _ in rows), 4),
                         "outside_step_ms": round(statistics.mean(o for _, o, _ in rows if o is not None), 4),
                         "phase_ms_per_iteration": {k: round(sum(c.get(k, 0.0) for _, _, c in rows) / n, 4)
                                                    for k in keys}}
        out["calls"] = dict(sorted(self.calls.items()))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--skip", type=int, default=150, help="iterations before the profiled window")
    ap.add_argument("--iters", type=int, default=60, help="iterations profiled")
    ap.add_argument("--quick", action="store_true", help="tiny random target on the CPU (smoke run)")
    ap.add_argument("--phases", action="store_true",
                    help="no torch profiler: host ms per engine phase (perf_counter around the engine's, "
                         "scheduler's, stepper's and policy's methods) over the whole steady window, split "
                         "by iterations that prefill and those that do not")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.quick:
        tiny = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096)
        a.overrides = ["target=llama31_8b_random", "workload=synthetic", "workload.concurrency=2",
                       "workload.sources.0.num_prompts=3", "workload.sources.0.prompt_len=8",
                       "workload.sources.0.output_len=6", "engine.dtype=float32", "engine.kv_cache_tokens=1024",
                       "engine.profile_iters=1", "device=cpu", "logger=none",
                       *(f"target.config.{k}={v}" for k, v in tiny.items()), *a.overrides]
        a.skip, a.iters = 2, 3
    a.out.mkdir(parents=True, exist_ok=True)
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from specdec import run as run_mod
    from specdec.engine.engine import Engine

    cuda = torch.cuda.is_available()
    result = {"upload_host_ms_behind_busy_gpu": upload_probe() if cuda else None}
    print("upload probe (host ms):", result["upload_host_ms_behind_busy_gpu"], flush=True)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(a.overrides))
    with open_dict(cfg):
        cfg.run_dir = str(a.out / "run")

    walls: list[float] = []
    state = {"n": 0, "prof": None, "t": None}
    step = Engine.step

    def timed_step(self, *args, **kw):
        n = state["n"]
        state["n"] += 1
        now = time.perf_counter()
        if state["t"] is not None and a.skip <= n <= a.skip + a.iters:
            walls.append((now - state["t"]) * 1e3)
        state["t"] = now
        if n == a.skip:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            state["prof"] = torch.profiler.profile(activities=acts)
            state["prof"].start()
        out = step(self, *args, **kw)
        if n == a.skip + a.iters and state["prof"] is not None:
            if cuda:
                torch.cuda.synchronize()
            state["prof"].stop()
        return out

    phases = PhaseClock(a.skip) if a.phases else None
    if phases is not None:
        a.iters = 10**9  # the whole run from --skip on, no torch profiler
    Engine.step = timed_step if phases is None else phases.wrap_step(step)
    try:
        metrics = run_mod.run(cfg)
    finally:
        Engine.step = step
        if phases is not None:
            phases.remove()
    if phases is not None:
        result["phases"] = phases.report()
        result["metrics"] = {k: metrics.get(k) for k in ("output_tok_per_s", "steady_tok_per_s", "mean_batch_size")}
        (a.out / "profile_serving.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return
    prof = state["prof"]
    result["iterations_profiled"] = len(walls)
    if walls:
        result["iter_wall_ms"] = {"median": round(statistics.median(walls), 3), "mean": round(statistics.mean(walls), 3),
                                  "max": round(max(walls), 3)}
    result["metrics"] = {k: metrics.get(k) for k in ("output_tok_per_s", "steady_tok_per_s", "mean_batch_size",
                                                    "p50_decode_step_ms", "decode_steps", "prefill_steps")}
    if prof is not None:
        ev = prof.key_averages()
        rows = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:30]
        result["host_top"] = [(e.key[:70], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in rows]
        runtime = [e for e in ev if e.key.startswith("cuda") or e.key.startswith("cu")]
        runtime.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        result["cuda_runtime"] = [(e.key[:60], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in runtime[:15]]
        (a.out / "host_table.txt").write_text(ev.table(sort_by="self_cpu_time_total", row_limit=40))
    (a.out / "profile_serving.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "host_top"}, indent=1))
    for row in result.get("host_top", [])[:20]:
        print(row)


if __name__ == "__main__":
    main()
