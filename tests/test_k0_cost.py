"""Speculation-off cost, measured so that runs do not depend on their predecessors: the KV pool is
sized the same whatever an earlier engine of the process left in torch's caching allocator, each
run frees what earlier ones left and serves with the heap frozen, experiment=k0_cost interleaves
draft=none around the drafters per C, and the
report divides each drafter run by its adjacent draft=none runs."""

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from specdec import report, run as run_mod
from specdec.engine import kv_cache
from specdec.engine.kv_cache import kv_bytes_per_token, size_pool

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


class FakeCudaMemory:
    """A device of ``total`` bytes and a caching allocator over it: ``alloc`` takes from the cache
    first, then from the driver; ``free`` keeps the bytes cached (reserved), as torch does until
    empty_cache."""

    def __init__(self, monkeypatch, total: int, context: int = GiB // 2):
        self.total, self.context, self.allocated, self.reserved = total, context, 0, 0
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.driver_free, self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)

    @property
    def driver_free(self) -> int:
        return self.total - self.context - self.reserved

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n


def fake_cuda_model():
    config = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)  # SmolLM2-135M
    return SimpleNamespace(device=torch.device("cuda", 0), config=config, dtype=torch.bfloat16)


def pool(model) -> int:
    return size_pool(model, page_size=16, kv_cache_tokens=None, kv_memory_fraction=0.5)


def test_pool_size_does_not_shrink_by_what_an_earlier_engine_left_cached(monkeypatch):
    mem = FakeCudaMemory(monkeypatch, total=140 * GiB)
    model = fake_cuda_model()
    weights = 300 << 20
    mem.alloc(weights)
    first = pool(model)
    pool_bytes = first * 16 * kv_bytes_per_token(model.config, model.dtype)
    assert pool_bytes == pytest.approx(0.5 * (140 * GiB - mem.context - weights), rel=1e-4)
    for _ in range(3):  # engines built in a row, each freeing its pool into the cache
        mem.alloc(pool_bytes)
        mem.free(pool_bytes)
        assert mem.driver_free < 140 * GiB - mem.context - weights - pool_bytes // 2  # the cache holds it
        assert pool(model) == first
    # the driver's free memory alone (the old sizing) would have halved it
    old = int(mem.driver_free * 0.5) // kv_bytes_per_token(model.config, model.dtype) // 16
    assert old < 0.55 * first
    # memory still held by live tensors is not available
    mem.alloc(20 * GiB)
    assert pool(model) < first


def test_configured_pool_ignores_device_memory(monkeypatch):
    mem = FakeCudaMemory(monkeypatch, total=140 * GiB)
    model = fake_cuda_model()
    mem.alloc(100 * GiB)
    assert size_pool(model, page_size=16, kv_cache_tokens=524288, kv_memory_fraction=0.5) == 32768


def test_available_bytes_adds_the_cached_blocks(monkeypatch):
    mem = FakeCudaMemory(monkeypatch, total=10 * GiB, context=0)
    mem.alloc(4 * GiB)
    mem.free(3 * GiB)
    assert mem.driver_free == 6 * GiB
    assert kv_cache.available_device_bytes(torch.device("cuda", 0)) == 9 * GiB


def test_release_device_memory_collects_cycles_and_empties_the_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))

    class Held:  # stands for an engine whose closures form a cycle
        pass

    def leave_cycle():
        a = Held()
        a.self = a
        return weakref.ref(a)

    was = gc.isenabled()
    gc.disable()  # only the explicit collection may free it
    try:
        ref = leave_cycle()
        assert ref() is not None
        run_mod.release_device_memory("cpu")
        assert ref() is None and calls == []
        run_mod.release_device_memory("cuda")
        assert calls == ["sync", "empty"]
    finally:
        if was:
            gc.enable()


def test_frozen_heap_freezes_what_lives_before_serving_and_counts_collections():
    assert gc.get_freeze_count() == 0
    keep = [{"i": i} for i in range(1000)]
    with run_mod.FrozenHeap() as heap:
        assert gc.get_freeze_count() >= len(keep)
        for _ in range(20000):  # allocations that trigger young collections
            x = []
            x.append(x)
    assert gc.get_freeze_count() == 0
    assert len(heap.collections) == 3 and heap.collections[0] > 0


# --------------------------------------------------------------------- the sweep and its arm list
def sweep_jobs(overrides: list[str]) -> list[dict]:
    """The jobs (in launch order) that `specdec.run --multirun +experiment=k0_cost OVERRIDES` runs,
    as Hydra's basic sweeper orders them: the experiment's swept keys first, in its order."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=k0_cost"], return_hydra_config=True)
    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
    parsed = OverridesParser.create().parse_overrides(params + overrides)
    (batch,) = BasicSweeper.split_arguments(parsed, None)
    return [dict(o.split("=", 1) for o in job) for job in batch]


def test_k0_cost_sweeps_c_outermost_and_the_arms_in_order():
    jobs = sweep_jobs([])
    arms = "none,ngram_chains,eagle3_smollm2_trees,none,eagle3_smollm2_trees,ngram_chains,none".split(",")
    assert [j["workload.concurrency"] for j in jobs] == ["16"] * 7 + ["64"] * 7 + ["256"] * 7
    assert [j["draft"] for j in jobs] == arms * 3
    # a command line's values replace the experiment's and keep their order
    jobs = sweep_jobs(["draft=none,ngram_chains,eagle3_smollm2_trees,none", "workload.concurrency=64,256"])
    assert [(j["workload.concurrency"], j["draft"]) for j in jobs] == [
        (c, d) for c in ("64", "256") for d in ("none", "ngram_chains", "eagle3_smollm2_trees", "none")]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=k0_cost", "draft=eagle3_smollm2_trees",
                                           "workload.concurrency=256"])
    assert cfg.policy.name == "never" and cfg.workload.name == "humaneval" and cfg.sampling.temperature == 0
    assert cfg.engine.max_new_tokens == 128 and cfg.engine.kv_cache_tokens == 524288
    assert cfg.workload.requests_per_client == 16 and cfg.workload.mode == "closed"


# ------------------------------------------------------------------------------- the paired table
def make_run(path: Path, *, draft: str, c: int, tok_s: float, decode_ms: float, date: str,
             kv_pages: int = 32768, steady: float | None = None, **cfg_engine) -> Path:
    config = {"target": {"name": "smollm2-135m-instruct", "path": None}, "draft": {"name": draft},
              "policy": {"name": "never"}, "tp": {"size": 1},
              "workload": {"name": "humaneval", "mode": "closed", "concurrency": c},
              "engine": {"max_new_tokens": 128, **cfg_engine}, "sampling": {"temperature": 0.0},
              "logger": {"name": "none"}, "name": "k0_cost", "run_dir": str(path), "seed": 0}
    metrics = {"requests": 4 * c, "failed_requests": 0, "output_tokens": 10000, "output_tok_per_s": tok_s,
               "decode_ms_total": decode_ms, "prefill_ms_total": 500.0, "kv_pages": kv_pages, "preemptions": 0,
               "speculating_step_fraction": 0.0, "device": "cuda", "dtype": "torch.bfloat16",
               "date_utc": date, "target": "smollm2-135m-instruct", "workload": "humaneval"}
    if steady is not None:
        metrics.update(steady_tok_per_s=steady, steady_warmup_s=1.0)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "metrics.json").write_text(json.dumps(metrics))
    return path


def table(md: str, title: str) -> list[list[str]]:
    section = md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in ln.strip("|").split(" | ")] for ln in section.splitlines() if ln.startswith("|")]
    return [rows[0]] + rows[2:]


# C = 4: none, ngram, eagle3, none, eagle3, ngram, none (tok/s and decode ms of each run)
SEQ = [("none", 100.0, 200.0), ("ngram", 99.0, 200.0), ("eagle3", 104.0, 202.0), ("none", 110.0, 200.0),
       ("eagle3", 113.0, 198.0), ("ngram", 117.0, 200.0), ("none", 120.0, 204.0)]


def write_sweep(root: Path, seq=SEQ, c: int = 4, start: int = 0) -> None:
    for i, (d, tok, dec) in enumerate(seq):
        make_run(root / str(start + i), draft=d, c=c, tok_s=tok, decode_ms=dec,
                 date=f"2026-12-01T22:{start + i:02d}:00Z")


def test_paired_ratios_use_the_adjacent_none_runs(tmp_path):
    write_sweep(tmp_path / "sweep")
    (point,) = report.paired_off_cost(report.load_runs([tmp_path / "sweep"]))
    assert point["C"] == 4 and point["none"]["tok_s"] == [100.0, 110.0, 120.0]
    runs = point["runs"]
    assert [r["draft"] for r in runs] == [d for d, _, _ in SEQ]
    assert [r["neighbours"] for r in runs] == [[], [0, 3], [0, 3], [], [3, 6], [3, 6], []]
    want = [None, 99 / 105, 104 / 105, None, 113 / 115, 117 / 115, None]
    assert [r["ratio"] for r in runs] == [pytest.approx(w) if w else None for w in want]
    dec = lambda ms: 10000 / (ms / 1e3)  # noqa: E731
    assert runs[2]["decode_tok_s"] == pytest.approx(dec(202.0))
    assert runs[2]["decode_ratio"] == pytest.approx(dec(202.0) / ((dec(200.0) + dec(200.0)) / 2))
    assert runs[4]["decode_ratio"] == pytest.approx(dec(198.0) / ((dec(200.0) + dec(204.0)) / 2))

    md, _ = report.build_report(report.load_runs([tmp_path / "sweep"]), tmp_path / "out")
    title = next(ln[3:] for ln in md.splitlines() if ln.startswith("## Speculation off: "))
    rows = table(md, title)
    assert rows[0][:7] == ["C", "Drafter", "runs", "tok/s", "/ none", "range", "decode / none"]
    by = {r[1]: r for r in rows[1:]}
    assert set(by) == {"ngram", "eagle3"}
    ng = by["ngram"]
    assert ng[0] == "4" and ng[2] == "2"
    assert float(ng[4]) == pytest.approx((99 / 105 + 117 / 115) / 2, abs=1e-4)
    assert ng[5] == f"{99 / 105:.4f} .. {117 / 115:.4f}"
    assert float(ng[7]) == pytest.approx(110.0)  # none tok/s: the mean of the three
    assert ng[8] == "3" and ng[9] == f"{100 * 20 / 110:.1f}%"  # spread (max - min) / mean
    assert ng[11] == "-" and ng[-1] == "32768"  # no steady window in these runs
    order = table(md, next(ln[3:] for ln in md.splitlines() if ln.startswith("## Speculation off, run order")))
    assert [r[2] for r in order[1:]] == [d for d, _, _ in SEQ]
    assert order[2][-1] == "#1, #4" and order[5][-1] == "#4, #7" and order[1][-1] == "-"


def test_run_order_is_start_time_not_path(tmp_path):
    # the directory names sort the other way round from when the runs started
    make_run(tmp_path / "s" / "b", draft="none", c=8, tok_s=100.0, decode_ms=1.0, date="2026-12-01T10:00:00Z")
    make_run(tmp_path / "s" / "a", draft="ngram", c=8, tok_s=90.0, decode_ms=1.0, date="2026-12-01T10:00:10Z")
    make_run(tmp_path / "s" / "0", draft="none", c=8, tok_s=80.0, decode_ms=1.0, date="2026-12-01T10:00:20Z",
             kv_pages=99329)
    make_run(tmp_path / "s" / "1", draft="ngram", c=8, tok_s=40.0, decode_ms=1.0, date="2026-12-01T10:00:30Z")
    (point,) = report.paired_off_cost(report.load_runs([tmp_path / "s"]))
    assert [r["tok_s"] for r in point["runs"]] == [100.0, 90.0, 80.0, 40.0]
    assert point["runs"][1]["ratio"] == pytest.approx(1.0)  # 90 / mean(100, 80)
    assert point["runs"][3]["ratio"] == pytest.approx(0.5)  # only a none before it: 40 / 80
    md, _ = report.build_report(report.load_runs([tmp_path / "s"]), tmp_path / "out")
    rows = table(md, next(ln[3:] for ln in md.splitlines() if ln.startswith("## Speculation off: ")))
    assert rows[1][-1] == "32768 / 99329 (differ)"


def test_points_need_a_none_and_a_drafter_at_the_same_c(tmp_path):
    write_sweep(tmp_path / "s", seq=[("none", 100.0, 1.0), ("ngram", 99.0, 1.0)], c=16)
    write_sweep(tmp_path / "s", seq=[("ngram", 90.0, 1.0), ("eagle3", 95.0, 1.0)], c=64, start=10)
    write_sweep(tmp_path / "s", seq=[("none", 90.0, 1.0), ("none", 95.0, 1.0)], c=256, start=20)
    points = report.paired_off_cost(report.load_runs([tmp_path / "s"]))
    assert [p["C"] for p in points] == [16]


def test_settings_that_differ_split_studies(tmp_path):
    """A none run with another pool size is not a neighbour of a drafter run with this one."""
    make_run(tmp_path / "s" / "0", draft="none", c=4, tok_s=100.0, decode_ms=1.0, date="2026-12-01T10:00:00Z",
             kv_cache_tokens=1024)
    make_run(tmp_path / "s" / "1", draft="ngram", c=4, tok_s=99.0, decode_ms=1.0, date="2026-12-01T10:00:10Z",
             kv_cache_tokens=2048)
    make_run(tmp_path / "s" / "2", draft="none", c=4, tok_s=50.0, decode_ms=1.0, date="2026-12-01T10:00:20Z",
             kv_cache_tokens=2048)
    (point,) = report.paired_off_cost(report.load_runs([tmp_path / "s"]))
    assert "engine.kv_cache_tokens=2048" in point["study"]
    assert [r["tok_s"] for r in point["runs"]] == [99.0, 50.0] and point["runs"][0]["ratio"] == pytest.approx(1.98)


# --------------------------------------------------------------------------- the stage, on the CPU
@pytest.mark.slow
def test_k0_cost_stage_smoke_on_cpu(tmp_path, smollm2_path, prompts_path):
    """What `+experiment=k0_cost` runs, shrunk: the k0_cost sweep with each arm at C = 1, 2 (one
    HumanEval prompt, 4 new tokens) and the report's paired table over it."""
    env = dict(os.environ, WANDB_MODE="disabled")
    env.pop("TRITON_INTERPRET", None)
    sweep = tmp_path / "k0_cost"
    proc = subprocess.run([sys.executable, "-m", "specdec.run", "--multirun", "+experiment=k0_cost",
                           "draft=none,ngram_chains,eagle3_smollm2_trees,none", "workload.concurrency=1,2",
                           "workload.sources.0.limit=1",
                           "workload.requests_per_client=1", "workload.min_requests=2", "engine.max_new_tokens=4",
                           "engine.kv_cache_tokens=4096", "device=cpu", f"hydra.sweep.dir={sweep}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    runs = sorted((p.parent for p in sweep.rglob("metrics.json")), key=lambda p: int(p.name))
    assert len(runs) == 8
    cfgs = [json.loads((r / "config.json").read_text()) for r in runs]
    assert [(c["workload"]["concurrency"], c["draft"]["name"]) for c in cfgs] == [
        (c, d) for c in (1, 2) for d in ("none", "ngram", "eagle3", "none")]
    mets = [json.loads((r / "metrics.json").read_text()) for r in runs]
    assert {m["kv_pages"] for m in mets} == {256} and all(m["failed_requests"] == 0 for m in mets)
    assert all(len(m["serve_gc_collections"]) == 3 for m in mets)
    outputs = {}
    for r, c in zip(runs, cfgs):  # greedy: every arm serves the same tokens
        for rec in map(json.loads, (r / "requests.jsonl").read_text().splitlines()):
            outputs.setdefault((c["workload"]["concurrency"], rec["id"]), set()).add(tuple(rec["output_ids"]))
    assert all(len(v) == 1 for v in outputs.values())
    rep = subprocess.run([sys.executable, "-m", "specdec.report", str(sweep), "--out", str(sweep / "report")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert rep.returncode == 0, rep.stderr[-3000:]
    rows = table(rep.stdout, next(ln[3:] for ln in rep.stdout.splitlines() if ln.startswith("## Speculation off: ")))
    assert sorted((r[0], r[1], r[2]) for r in rows[1:]) == [
        ("1", "eagle3", "1"), ("1", "ngram", "1"), ("2", "eagle3", "1"), ("2", "ngram", "1")]


def test_paired_steady_window_ratio(tmp_path):
    """With steady-window tok/s (workload.warmup_s), each drafter run is also divided by its adjacent
    draft=none runs' steady tok/s; a neighbour without one leaves the ratio out."""
    steady = [100.0, 99.0, 101.0, 100.0, 100.5, 99.5, 102.0]
    for i, ((d, tok, dec), st) in enumerate(zip(SEQ, steady)):
        make_run(tmp_path / "s" / str(i), draft=d, c=4, tok_s=tok, decode_ms=dec, steady=st,
                 date=f"2026-12-01T22:{i:02d}:00Z")
    (point,) = report.paired_off_cost(report.load_runs([tmp_path / "s"]))
    got = [r["steady_ratio"] for r in point["runs"]]
    want = [None, 99 / 100, 101 / 100, None, 100.5 / 101, 99.5 / 101, None]
    assert got == [pytest.approx(w) if w else None for w in want]
    md, _ = report.build_report(report.load_runs([tmp_path / "s"]), tmp_path / "out")
    rows = table(md, next(ln[3:] for ln in md.splitlines() if ln.startswith("## Speculation off: ")))
    col = rows[0].index("steady / none")
    by = {r[1]: r for r in rows[1:]}
    assert float(by["ngram"][col]) == pytest.approx((0.99 + 99.5 / 101) / 2, abs=1e-4)
    assert by["ngram"][col + 1] == f"{100 * 2 / (304 / 3):.1f}%"  # none steady spread
    m = tmp_path / "s" / "6" / "metrics.json"  # the last none run without a window
    m.write_text(json.dumps({k: v for k, v in json.loads(m.read_text()).items() if k != "steady_tok_per_s"}))
    (point,) = report.paired_off_cost(report.load_runs([tmp_path / "s"]))
    assert [r["steady_ratio"] is None for r in point["runs"]] == [True, False, False, True, True, True, True]
