"""Load generators, metrics, synthetic workloads, serving configs and run.py's engine wiring."""

import json
from pathlib import Path

import pytest
import torch

from specdec.bench.clients import closed_loop, open_loop, poisson_arrivals
from specdec.bench.metrics import StepTrace, percentile, request_record, summarize_requests
from specdec.bench.targets import IdsOnlyTokenizer, llama_config_from_dict
from specdec.models.llama import LlamaModel
from specdec.bench.workloads import WorkloadError, load_prompts, synthetic_prompts
from specdec.engine.engine import Engine, EngineConfig
from test_engine import rand_prompts, reference, tiny_model

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=3)


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=overrides, return_hydra_config=False)


def test_closed_loop_keeps_concurrency(tiny):
    prompts = rand_prompts([4, 9, 2, 15, 7, 3, 11, 6, 8, 5], seed=1)
    trace = StepTrace()
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=1024, max_batch_size=16), trace=trace)
    in_flight, peak = [0], [0]

    def submit(p, arrival):
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        return engine.add_request(p, 6)

    def done(req):
        in_flight[0] -= 1

    finished = closed_loop(engine, prompts, 3, submit, done)
    assert len(finished) == len(prompts) and peak[0] == 3
    assert max(s["running"] for s in trace.records) == 3
    got = {tuple(r.prompt_ids): r.output_ids for r in finished}
    for p in prompts[:3]:
        assert got[tuple(p)] == reference(tiny, p, 6)
    summary = trace.summary()
    assert summary["decode_steps"] > 0 and 1 <= summary["mean_batch_size"] <= 3


def test_open_loop_poisson(tiny):
    arr = poisson_arrivals(200, rate=50.0, seed=3)
    assert arr == poisson_arrivals(200, rate=50.0, seed=3) and arr == sorted(arr)
    assert 2.5 < arr[-1] < 6.0  # 200 arrivals at 50/s: ~4 s
    assert poisson_arrivals(3, None) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, -1.0)
    prompts = rand_prompts([5, 7, 3, 9], seed=2)
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=512))
    sent = []
    finished = open_loop(engine, prompts, 200.0,
                         lambda p, t: sent.append(t) or engine.add_request(p, 4, arrival_s=t), seed=1)
    assert len(finished) == 4 and sent == sorted(sent)
    assert all(r.first_token_s >= r.arrival_s for r in finished)


def test_percentile_and_summary():
    assert percentile([3, 1, 2], 50) == 2 and percentile([], 50) is None
    assert percentile([0, 10], 99) == pytest.approx(9.9)
    recs = [{"id": "a", "output_tokens": 3, "ttft_s": 0.1, "tpot_s": 0.01, "itl_s": [0.01, 0.02],
             "latency_s": 0.13, "finish_reason": "length"},
            {"id": "b", "error": "too long", "prompt_tokens": 9}]
    m = summarize_requests(recs, 2.0)
    assert m["requests"] == 2 and m["failed_requests"] == 1 and m["output_tokens"] == 3
    assert m["output_tok_per_s"] == 1.5 and m["p50_itl_s"] == pytest.approx(0.015)


def test_request_record_fields(tiny):
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=256))
    r = engine.add_request([1, 2, 3], 5)
    engine.run_until_done()
    rec = request_record(r, "p", "text")
    assert rec["output_tokens"] == 5 and len(rec["itl_s"]) == 4
    assert rec["ttft_s"] > 0 and rec["latency_s"] >= rec["ttft_s"] and rec["tpot_s"] > 0
    json.dumps(rec)


def test_synthetic_workload():
    ps = synthetic_prompts(5, 12, 7, vocab_size=49152, seed=1)
    assert len(ps) == 5 and all(len(p.prompt_ids) == 12 and p.max_new_tokens == 7 for p in ps)
    assert all(256 <= t < 49152 for p in ps for t in p.prompt_ids)
    assert [p.prompt_ids for p in ps] == [p.prompt_ids for p in synthetic_prompts(5, 12, 7, 49152, seed=1)]
    cfg = compose(["workload=synthetic", "workload.concurrency=32"])
    prompts = load_prompts(cfg.workload, IdsOnlyTokenizer(1000))
    assert len(prompts) == 4 * 32 and len(prompts[0].prompt_ids) == 256
    with pytest.raises(WorkloadError, match="synthetic"):
        load_prompts(compose(["workload=mt_bench"]).workload, IdsOnlyTokenizer(1000))


def test_configs_compose():
    cfg = compose(["+experiment=baseline_concurrency"])
    assert cfg.workload.name == "synthetic" and cfg.logger.name == "none"
    for key in ("max_batch_size", "kv_cache_tokens", "prefill_chunk", "cuda_graphs", "graph_buckets"):
        assert key in cfg.engine
    cfg = compose(["target=llama31_8b_random", "workload=synthetic"])
    c = llama_config_from_dict(dict(cfg.target.config))
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (32, 4096, 14336)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (32, 8, 128, 128256)
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_theta == 500000.0
    L, H, F, V = 32, 4096, 14336, 128256
    params = 2 * V * H + H + L * (2 * H + H * (32 + 16) * 128 + H * 32 * 128 + 3 * H * F)
    assert params == pytest.approx(8.03e9, rel=2e-3)  # Llama-3.1-8B
    assert "random weights" in cfg.target.name


def test_baseline_sweep_values():
    import yaml

    exp = yaml.safe_load((CONF / "experiment" / "baseline_concurrency.yaml").read_text())
    values = exp["hydra"]["sweeper"]["params"]["workload.concurrency"]
    assert [int(v) for v in str(values).split(",")] == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_random_target_tiny():
    cfg = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 64}
    m = LlamaModel.random(llama_config_from_dict(cfg), dtype="float32", backend="torch")
    assert m.dtype == torch.float32 and m.embed.shape == (512, 32)
    engine = Engine(m, EngineConfig(kv_cache_tokens=128))
    r = engine.add_request([300, 301], 3, ignore_eos=True)
    engine.run_until_done()
    assert len(r.output_ids) == 3


def test_generate_all_through_engine(smollm2, smollm2_tokenizer, tmp_path):
    from specdec.run import generate_all, summarize

    cfg = compose(["workload=synthetic", "workload.concurrency=2", "workload.sources.0.num_prompts=3",
                   "workload.warmup_requests=2",
                   "workload.sources.0.prompt_len=6", "workload.sources.0.output_len=3",
                   "engine.kv_cache_tokens=512", f"run_dir={tmp_path}"])
    prompts = load_prompts(cfg.workload, smollm2_tokenizer)
    trace = StepTrace(tmp_path / "steps.jsonl")
    records = generate_all(smollm2, smollm2_tokenizer, prompts, cfg, trace=trace)
    trace.close()
    assert [r["id"] for r in records] == [p.id for p in prompts]
    assert all(r["output_tokens"] == 3 and r["finish_reason"] == "length" for r in records)
    m = summarize(records, 1.0, trace)
    assert m["output_tokens"] == 9 and m["mean_batch_size"] <= 2 and m["cuda_graphs"] is False
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert len(lines) == m["steps"] and "decode_ms" in json.loads(lines[0])


def test_timed_closed_loop_cycles_prompts_and_records_its_window(tiny, monkeypatch):
    """workload.duration_s: the clients keep sending (the prompts again under ids ID@round) until the
    duration has passed, then drain; the window runs from the first send to the last, and the steady
    window counts exactly the tokens committed inside it. A fake clock: 10 ms per engine step."""
    import specdec.bench.clients as clients
    from specdec.bench.workloads import Prompt

    clock = [100.0]
    monkeypatch.setattr(clients.time, "perf_counter", lambda: clock[0])
    prompts = [Prompt(f"p{i}", f"text {i}", None, p, None)
               for i, p in enumerate(rand_prompts([4, 9, 2, 7], seed=5))]
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=1024, max_batch_size=8))
    real_step = engine.step

    def step(k=None):
        clock[0] += 0.01
        return real_step(k)

    engine.step = step
    ids, sent_at = [], []

    def submit(p, arrival):
        ids.append(p.id)
        sent_at.append(clock[0])
        return engine.add_request(p.prompt_ids, 5, request_id=p.id)

    window = {}
    done = clients.closed_loop(engine, prompts, 2, submit, duration_s=0.4, window=window)
    assert len(done) == len(ids) > len(prompts)  # every request sent finished: the drain ran
    assert len(set(ids)) == len(ids) and ids[:6] == ["p0", "p1", "p2", "p3", "p0@1", "p1@1"]
    assert window["t0"] == 100.0 and window["t_stop"] == max(sent_at) and window["rounds"] >= 2
    assert max(sent_at) < 100.0 + 0.4 + 1e-9  # nothing sent after the duration
    by_id = {r.id: r for r in done}
    for i in ids:  # each cycled request is its prompt's continuation, whatever its id
        assert by_id[i].output_ids == reference(tiny, prompts[int(i.split("@")[0][1:])].prompt_ids, 5)
    times = [r.token_times for r in done]
    n, span = clients.steady_window(times, 100.1, window["t_stop"])
    assert span == pytest.approx(window["t_stop"] - 100.1)
    assert n == sum(100.1 <= t < window["t_stop"] for ts in times for t in ts) and 0 < n < sum(map(len, times))
    assert clients.steady_window(times, 5.0, 5.0) == (0, 0.0)
    # Without a duration the window ends at the last send made as a request finished.
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=1024, max_batch_size=8))
    engine.step, real_step = step, engine.step
    ids.clear(), sent_at.clear()
    window = {}
    clients.closed_loop(engine, prompts, 2, submit, window=window)
    assert ids == ["p0", "p1", "p2", "p3"] and window["t_stop"] == sent_at[-1] and window["rounds"] == 1


@pytest.mark.parametrize("bad, match", [
    ({"duration_s": -1}, "duration_s=-1"), ({"duration_s": "5"}, "duration_s='5'"),
    ({"duration_s": 0}, "must be > 0"), ({"duration_s": 2, "warmup_s": 2}, "warmup_s=2 must be below"),
    ({"duration_s": 2, "mode": "open", "rate": 5.0}, "needs a closed loop"),
    ({"duration_s": 2, "concurrency": None}, "needs a closed loop"), ({"warmup_s": True}, "warmup_s=True"),
])
def test_timed_loop_settings_are_checked(bad, match):
    from specdec.errors import ConfigError
    from specdec.run import steady_settings

    wl = {"mode": "closed", "concurrency": 4, **bad}
    with pytest.raises(ConfigError, match=match):
        steady_settings(wl)
    assert steady_settings({"mode": "closed", "concurrency": 4, "duration_s": 5, "warmup_s": 1}) == (5.0, 1.0)
    assert steady_settings({"mode": "open"}) == (None, None)


@pytest.mark.parametrize("bad, match", [
    ({"stagger": "yes"}, "stagger='yes': must be true or false"),
    ({"stagger": True, "duration_s": None}, "needs a timed closed loop"),
    ({"stagger": True, "mode": "open", "rate": 2.0}, "needs a timed closed loop"),
])
def test_stagger_is_checked(bad, match):
    from specdec.errors import ConfigError
    from specdec.run import stagger_rows

    wl = {"mode": "closed", "concurrency": 4, "duration_s": 1.0, **bad}
    with pytest.raises(ConfigError, match=match):
        stagger_rows(wl)
    assert stagger_rows({"mode": "closed", "concurrency": 4, "duration_s": 1.0, "stagger": True}) == 4
    assert stagger_rows({"mode": "closed", "concurrency": 4, "duration_s": 1.0}) == 0


def test_staggered_closed_loop_spreads_the_first_round(tmp_path):
    """workload.stagger: client i's first request (of C) stops after ceil((i + 1) / C) of its output tokens,
    the later rounds run to the full length (a tiny random target on the CPU, through specdec.run)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from specdec import run as run_mod

    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=128, max_position_embeddings=512)
    overrides = ["target=llama31_8b_random", "workload=synthetic", "workload.concurrency=4",
                 "workload.sources.0.num_prompts=4", "workload.sources.0.prompt_len=6",
                 "workload.sources.0.output_len=8", "workload.duration_s=0.2", "workload.stagger=true",
                 "engine.dtype=float32", "engine.kv_cache_tokens=1024", "engine.profile_iters=0", "device=cpu",
                 "logger=none", *(f"target.config.{k}={v}" for k, v in tiny.items())]
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with open_dict(cfg):
        cfg.run_dir = str(tmp_path / "run")
    metrics = run_mod.run(cfg)
    recs = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    first = {r["id"]: r["output_tokens"] for r in recs if "@" not in r["id"]}
    assert sorted(first.values()) == [2, 4, 6, 8]
    later = [r["output_tokens"] for r in recs if "@" in r["id"]]
    assert later and all(n == 8 for n in later)
    assert metrics["staggered_requests"] == 4


def test_warmup_requests_run_before_and_leave_no_trace(tiny):
    """workload.warmup_requests: that many requests (the first prompts, cycled, at most
    warmup_new_tokens each) run to the end before the measured run; the trace records none of their
    steps, the KV pool is whole again, and the measured requests decode as they would have."""
    from specdec.bench.workloads import Prompt
    from specdec.errors import ConfigError
    from specdec.run import serve_warmup

    prompts = [Prompt(f"p{i}", f"text {i}", None, p, None) for i, p in enumerate(rand_prompts([4, 9], seed=7))]
    trace = StepTrace()
    engine = Engine(tiny, EngineConfig(kv_cache_tokens=1024, max_batch_size=8), trace=trace)
    free = engine.kv.num_free
    seen = []
    real_add = engine.add_request
    engine.add_request = lambda ids, n, **kw: seen.append((kw["request_id"], n)) or real_add(ids, n, **kw)
    assert serve_warmup(engine, prompts, {"warmup_requests": 3, "warmup_new_tokens": 2}, 5, trace) == 3
    assert seen == [("p0@warmup0", 2), ("p1@warmup1", 2), ("p0@warmup2", 2)]
    assert trace.records == [] and not engine.has_work() and engine.kv.num_free == free
    r = real_add(prompts[1].prompt_ids, 5, request_id="p1")
    engine.run_until_done()
    assert list(r.output_ids) == reference(tiny, prompts[1].prompt_ids, 5) and len(trace.records) > 0
    assert serve_warmup(engine, prompts, {}, 5, trace) == 0  # off by default
    for bad in ({"warmup_requests": -1}, {"warmup_requests": True}, {"warmup_requests": 1, "warmup_new_tokens": 0}):
        with pytest.raises(ConfigError, match="workload.warmup_"):
            serve_warmup(engine, prompts, bad, 5, trace)
