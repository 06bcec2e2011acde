"""The entry under failure: interrupted runs keep what finished, every bad input is named.

A tiny random-weight target (Llama shapes shrunk to 2 layers of 64) with a synthetic workload keeps
each run to a few seconds on the CPU.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.bench.workloads import WorkloadError, load_prompts, read_jsonl_prompts
from specdec.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

TINY = ["target=llama31_8b_random", "target.config.hidden_size=64", "target.config.intermediate_size=96",
        "target.config.num_hidden_layers=2", "target.config.num_attention_heads=4",
        "target.config.num_key_value_heads=2", "target.config.head_dim=16", "target.config.vocab_size=512",
        "target.config.max_position_embeddings=512", "target.config.rope_scaling=null", "workload=synthetic",
        "device=cpu", "logger=none", "engine.kv_cache_tokens=1024", "engine.profile_iters=1",
        "engine.kernels=torch"]


def workload(n, out_len, concurrency=2):
    return [f"workload.concurrency={concurrency}", f"workload.sources.0.num_prompts={n}",
            "workload.sources.0.prompt_len=8", f"workload.sources.0.output_len={out_len}"]


def cli(*overrides, tmp_path, popen=False):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "specdec.run", *overrides, f"hydra.run.dir={tmp_path}/run"]
    if popen:
        # SIGINT at its default in the child: a shell's background job (`cmd &`) starts with it ignored,
        # and Python then keeps ignoring it, so the signal tests would test the caller's shell
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def compose_cfg(overrides, run_dir):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*overrides, f"run_dir={run_dir}"])


def read_records(run_dir):
    return [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]


# -- bad input named, non-zero exit ---------------------------------------------------------------

@pytest.mark.parametrize("override,needles", [
    ("engine.page_size=0", ["engine.page_size=0", "integer >= 1"]),
    ("engine.prefill_chunk=0", ["engine.prefill_chunk=0", "integer >= 1"]),
    ("workload.concurrency=0", ["workload.concurrency=0", "integer >= 1"]),
    ("workload.rate=0", ["workload.rate=0", "> 0"]),
    ("workload.rate=-2.5", ["workload.rate=-2.5", "> 0"]),
    ("engine.max_new_tokens=abc", ["engine.max_new_tokens='abc'", "integer >= 1"]),
    ("engine.max_new_tokens=0", ["engine.max_new_tokens=0", "integer >= 1"]),
    ("engine.max_new_tokens=-1", ["engine.max_new_tokens=-1", "integer >= 1"]),
    ("+engine.max_new_token=8", ["unknown config key engine.max_new_token", "max_new_tokens", "page_size"]),
    ("+workload.concurency=3", ["unknown config key workload.concurency", "concurrency"]),
    ("+sedd=3", ["unknown config key 'sedd'", "seed"]),
])
def test_bad_config_values_named_with_nonzero_exit(tmp_path, override, needles):
    proc = cli(*TINY, *workload(2, 4), override, tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for n in needles:
        assert n in proc.stderr, proc.stderr[-3000:]


def test_every_project_config_passes_the_key_check(tmp_path):
    """No experiment, method or group option is refused by the unknown-key check."""
    from specdec.run import check_config_keys

    combos = [[f"+experiment={p.stem}"] for p in (CONF / "experiment").glob("*.yaml")]
    combos += [[f"+method={p.stem}"] for p in (CONF / "method").glob("*.yaml")]
    for g in ("target", "draft", "policy", "workload", "logger"):
        combos += [[f"{g}={p.stem}"] for p in (CONF / g).glob("*.yaml")]
    for overrides in combos:
        check_config_keys(compose_cfg(overrides, tmp_path))
    with pytest.raises(ConfigError, match="unknown config key engine.bogus"):
        check_config_keys(compose_cfg(["+engine.bogus=1"], tmp_path))


class _Tok:
    is_ids_only = False

    def encode(self, text):
        return [1, 2, 3]

    def encode_chat(self, messages):
        return [1, 2, 3]


def _jsonl_cfg(path):
    return {"sources": [{"kind": "jsonl", "limit": None}], "path": str(path), "chat": False}


def test_non_utf8_prompt_file_named(tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    with pytest.raises(WorkloadError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9"):
        read_jsonl_prompts(f)


def test_directory_as_workload_path_named(tmp_path):
    with pytest.raises(WorkloadError, match="is a directory"):
        read_jsonl_prompts(tmp_path)


def test_duplicate_prompt_ids_named(tmp_path):
    f = tmp_path / "dup.jsonl"
    f.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n')
    with pytest.raises(WorkloadError, match="duplicate prompt ids in the workload: 'a'"):
        load_prompts(_jsonl_cfg(f), _Tok())


def test_bad_workload_file_exits_nonzero_with_name(tmp_path):
    """Through the CLI (the SmolLM2 tokenizer reads the file): a non-UTF-8 file, a directory."""
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"id": "a", "prompt": "\xff"}\n')
    for path, needle in ((f, "bad.jsonl:1: not UTF-8"), (tmp_path, "is a directory")):
        proc = cli("workload=jsonl", f"workload.path={path}", "logger=none", "device=cpu", tmp_path=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert needle in proc.stderr, proc.stderr[-3000:]


# -- interruption and engine failure ----------------------------------------------------------------

def _serve_until(monkeypatch, tmp_path, exc, after_finished):
    """run() with Engine.step raising ``exc`` once ``after_finished`` requests have finished."""
    from specdec.engine import engine as engine_mod
    from specdec.run import run

    real = engine_mod.Engine.step
    done = [0]

    def step(self, k=None):
        if done[0] >= after_finished:
            raise exc
        out = real(self, k)
        done[0] += len(out)
        return out

    monkeypatch.setattr(engine_mod.Engine, "step", step)
    cfg = compose_cfg([*TINY, *workload(8, 6)], tmp_path / "run")
    return run, cfg


@pytest.mark.parametrize("exc,why", [(KeyboardInterrupt(), "SIGINT"),
                                     (RuntimeError("device lost"), "RuntimeError: device lost")])
def test_interrupted_or_failed_run_keeps_finished_records(monkeypatch, tmp_path, exc, why):
    run, cfg = _serve_until(monkeypatch, tmp_path, exc, after_finished=3)
    with pytest.raises(type(exc)):
        run(cfg)
    run_dir = tmp_path / "run"
    records = read_records(run_dir)
    assert len(records) >= 3 and all(r["output_tokens"] == 6 for r in records)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["partial"] is True and metrics["stopped_by"] == why
    assert metrics["requests"] == len(records) and metrics["prompts"] == 8
    assert (run_dir / "steps.jsonl").read_text().strip()


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_mid_run_exits_with_its_code_and_keeps_records(tmp_path, sig, code):
    proc = cli(*TINY, *workload(40, 30, concurrency=1), tmp_path=tmp_path, popen=True)
    req_file = tmp_path / "run" / "requests.jsonl"
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            if req_file.exists() and len(req_file.read_text().splitlines()) >= 2:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-3000:]
    records = read_records(tmp_path / "run")
    assert 2 <= len(records) < 40 and all(r["output_tokens"] == 30 for r in records)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["partial"] is True and metrics["stopped_by"] == signal.Signals(sig).name
    assert metrics["requests"] == len(records)


def test_steps_jsonl_flushed_while_running(tmp_path):
    """steps.jsonl reaches the disk as the run goes (at most FLUSH_S late), not only at close."""
    from specdec.bench.metrics import StepTrace

    trace = StepTrace(tmp_path / "steps.jsonl")
    trace.FLUSH_S = 0.0
    rec = dict(step=0, decode_bs=1, bucket=1, k=0, prefill_tokens=0, prefill_reqs=0, decode_ms=1.0,
               prefill_ms=0.0, step_ms=1.0, committed=1)
    trace(rec)
    trace(dict(rec, step=1))
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    trace.close()


# -- failed requests, profiling after serving ---------------------------------------------------------

def test_fail_on_error_exits_nonzero_when_a_request_failed(tmp_path):
    """A request too long for the KV cache fails alone (recorded, the run exits 0 by default);
    run.fail_on_error=true turns it into exit 3 naming the count; a bad value is named."""
    too_long = [*TINY, "workload.concurrency=1", "workload.sources.0.num_prompts=2", "workload.sources.0.prompt_len=200",
                "workload.sources.0.output_len=2", "engine.kv_cache_tokens=128"]
    proc = cli(*too_long, tmp_path=tmp_path / "a")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "a" / "run" / "metrics.json").read_text())
    assert metrics["failed_requests"] == 2
    assert "workload.sources.0.prompt_len=200" in metrics["overrides"]  # the Hydra overrides, for the ledger
    proc = cli(*too_long, "run.fail_on_error=true", tmp_path=tmp_path / "b")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "2 request(s) failed (run.fail_on_error=true)" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli(*too_long, "run.fail_on_error=maybe", tmp_path=tmp_path / "c")
    assert proc.returncode == 2 and "run.fail_on_error='maybe'" in proc.stderr, proc.stderr[-3000:]
    proc = cli(*too_long, "+run.fail_on_errors=true", tmp_path=tmp_path / "d")
    assert proc.returncode == 2 and "unknown config key run.fail_on_errors" in proc.stderr, proc.stderr[-3000:]


def test_profiling_stopped_after_serving_keeps_whole_serving_metrics(monkeypatch, tmp_path):
    """Serving and the profiling after it are apart: a stop during profiling leaves metrics.json whole
    (partial false, every request) with profile_stopped_by saying why, and the run still stops."""
    from specdec import run as run_mod

    def stop(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "profile_after_serving", stop)
    cfg = compose_cfg([*TINY, *workload(3, 4)], tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        run_mod.run(cfg)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["partial"] is False and metrics["requests"] == 3 and metrics["profile_stopped_by"] == "SIGINT"
    assert len(read_records(tmp_path / "run")) == 3


def test_piped_run_prints_titled_tables_and_no_progress(tmp_path):
    """stdout not a terminal: no progress display or spinner, the tables with titles and headers."""
    proc = cli(*TINY, *workload(3, 4), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "Requests:" in proc.stdout and "prompt tok" in proc.stdout
    assert "tok/s  batch" not in out and "starting the engine" not in out and "\x1b[" not in out
