"""The Hydra entry: every config composes, the quickstart runs (plain vs EAGLE-3 + goodput, compared),
run options (compare_plain, engine.profile_steps) reach metrics.json, bad input fails cleanly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


def run_cli(*overrides, tmp_path, timeout=600, env=None):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", **(env or {}))
    env.pop("TRITON_INTERPRET", None)  # the entry uses the torch references on CPU
    return subprocess.run(
        [sys.executable, "-m", "specdec.run", *overrides, f"hydra.run.dir={tmp_path}/run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_config_groups_exist():
    assert {"target", "draft", "tp", "policy", "workload", "engine", "kernels", "logger", "experiment"} <= set(GROUPS)


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))])
def test_every_config_composes(group, option):
    plus = group in ("experiment", "method")  # @package _global_ groups chosen with +group=option
    key = f"+{group}={option}" if plus else f"{group}={option}"
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[key])
    for g in ("target", "draft", "tp", "policy", "workload", "engine", "logger"):
        assert OmegaConf.select(cfg, f"{g}.name" if g not in ("tp", "engine") else g) is not None
    if not plus:  # the chosen option is the one composed
        want = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"))
        want.pop("defaults", None)  # Hydra's defaults list (policy/bandit: goodput's keys, then its own)
        assert OmegaConf.to_container(cfg[group]).keys() >= want.keys()


def test_quickstart_writes_real_outputs(tmp_path):
    proc = run_cli("+experiment=quickstart", "engine.max_new_tokens=12", "logger=wandb", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    records = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert metrics["requests"] == len(records) == 4 and metrics["failed_requests"] == 0
    ids = {r["id"] for r in records}
    assert any(i.startswith("mt_bench/") for i in ids) and any(i.startswith("HumanEval/") for i in ids)
    for r in records:
        assert 0 < r["output_tokens"] <= 12 and len(r["output_ids"]) == r["output_tokens"]
        assert r["output"].strip() and r["ttft_s"] > 0
    # Real text, not noise: the MT-bench answers are mostly alphabetic English words.
    text = " ".join(r["output"] for r in records if r["id"].startswith("mt_bench/"))
    words = text.split()
    assert sum(w.strip(".,!?:;\"'()").isalpha() for w in words) >= 0.7 * len(words)
    assert json.loads((run_dir / "config.json").read_text())["engine"]["max_new_tokens"] == 12
    assert list((run_dir / "wandb").glob("offline-run-*"))  # W&B wrote its offline run
    # The mission in one table: plain decoding and EAGLE-3 + a dynamic policy on the same prompts.
    plain = json.loads((run_dir / "plain" / "metrics.json").read_text())
    assert plain["requests"] == 4 and plain["speculating_step_fraction"] == 0.0
    assert metrics["outputs_identical_to_plain"] == 1.0  # greedy: speculation changes no token
    assert metrics["speedup_over_plain"] == pytest.approx(metrics["output_tok_per_s"] / plain["output_tok_per_s"])
    assert metrics["tokens_per_row_step"] >= 1.0  # how much it speculates depends on this CPU's step times
    assert "Plain decoding vs eagle3 + policy goodput" in proc.stdout and "4/4" in proc.stdout
    # ... and says what the policy decided, from its own estimates (which way depends on this CPU's timings)
    text = " ".join(proc.stdout.split())  # rich wraps lines at the console's width
    assert "the goodput policy" in text and "16-token draft step at batch" in text
    assert "Requests: smollm2-135m-instruct" in proc.stdout  # the per-request table has its title
    assert metrics["overrides"] == ["+experiment=quickstart", "engine.max_new_tokens=12", "logger=wandb"]
    assert plain["overrides"] == ["+experiment=quickstart", "engine.max_new_tokens=12", "logger=wandb",
                                  "draft=none", "policy=never"]
    assert "wandb:" not in proc.stdout + proc.stderr  # W&B's console lines stay out of the terminal


def test_run_records_provenance_and_kernel_options(tmp_path):
    """A real tiny run: metrics.json (and the W&B run) carry the commit ($SPECDEC_COMMIT here, as on a
    machine without .git), the UTC date, device name, library versions and the kernel options set by
    `kernels.*` overrides; config.json holds the kernels group."""
    import datetime
    import platform

    import torch
    import triton

    from specdec.bench.provenance import device_name

    stamp = "stamp-1234abc"
    start = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    proc = run_cli("+experiment=quickstart", "engine.max_new_tokens=2", "logger=wandb", "device=cpu",
                   "kernels.pdl=off", "kernels.fused_linear=false", "kernels.fused_rows=8",
                   tmp_path=tmp_path, env={"SPECDEC_COMMIT": stamp})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    m = json.loads((run_dir / "metrics.json").read_text())
    assert m["commit"] == stamp
    when = datetime.datetime.strptime(m["date_utc"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    assert start <= when <= datetime.datetime.now(datetime.timezone.utc)
    assert m["device"] == "cpu" and m["device_name"] == device_name("cpu") and m["device_name"]
    assert (m["torch"], m["triton"], m["python"]) == (torch.__version__, triton.__version__,
                                                        platform.python_version())
    from kernels_triton import options

    want = dict(pdl=False, fused_linear=False, fused_rows=8)  # as set; every other option at its default
    assert m["kernel_options"] == dict(options.KernelOptions().as_dict(), **want)
    cfg = json.loads((run_dir / "config.json").read_text())
    assert {k: cfg["kernels"][k] for k in want} == dict(want, pdl="off")  # as given; the options object normalises it
    wandb_log = next((run_dir / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    assert wandb_log.count(stamp.encode()) >= 2  # run config and summary
    assert wandb_log.count(b"kernel_options") >= 2 and b"date_utc" in wandb_log


def test_git_commit_without_stamp(monkeypatch):
    from specdec.bench import provenance

    monkeypatch.delenv("SPECDEC_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("no git checkout")
    assert provenance.git_commit().split("-")[0] == head.stdout.strip()
    monkeypatch.setenv("SPECDEC_COMMIT", "abc123")
    assert provenance.git_commit() == "abc123"


@pytest.mark.parametrize("override,needles", [
    ("kernels.pdl=sometimes", ("pdl='sometimes'", "true, false")),
    ("kernels.fused_linear=maybe", ("fused_linear='maybe'", "true, false")),
    ("+kernels.warp_specialize=true", ("unknown config key", "warp_specialize", "fused_linear")),
])
def test_bad_kernel_option_fails_cleanly(tmp_path, override, needles):
    _assert_clean_error(run_cli(override, "logger=none", "device=cpu", tmp_path=tmp_path, timeout=120), *needles)


def test_jsonl_workload_and_overrides(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"id": "a", "prompt": "Say hello."}\n'
                 '{"id": "b", "messages": [{"role": "user", "content": "Count to three."}]}\n')
    proc = run_cli("workload=jsonl", f"workload.path={f}", "engine.max_new_tokens=6",
                   "sampling.temperature=0.7", "device=cpu", "logger=none", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b"]
    assert all(0 < r["output_tokens"] <= 6 for r in records)
    assert not (tmp_path / "run" / "wandb").exists()  # logger=none writes local files only


def _assert_clean_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for n in needles:
        assert n in proc.stderr, proc.stderr[-3000:]


def test_unknown_experiment_fails_cleanly(tmp_path):
    _assert_clean_error(run_cli("+experiment=does_not_exist", tmp_path=tmp_path), "does_not_exist")


def test_missing_target_path_fails_cleanly(tmp_path):
    _assert_clean_error(run_cli("target=hf", f"target.path={tmp_path}/nope", "logger=none",
                                tmp_path=tmp_path), "nope", "does not exist")


def test_non_llama_target_fails_cleanly(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    _assert_clean_error(run_cli("target=hf", f"target.path={d}", "logger=none", tmp_path=tmp_path),
                        "gpt2", "not a supported architecture")


def test_malformed_jsonl_line_fails_cleanly(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"id": "ok", "prompt": "hi"}\n{"id": "broken", "prompt": \n')
    _assert_clean_error(run_cli("workload=jsonl", f"workload.path={f}", "logger=none", tmp_path=tmp_path),
                        "bad.jsonl:2")


def test_missing_required_path_fails_cleanly(tmp_path):
    _assert_clean_error(run_cli("workload=jsonl", "logger=none", tmp_path=tmp_path), "workload.path")


# Llama-3.1-8B structure at tiny sizes: the random-weight target path without 16 GB of weights.
TINY_RANDOM = ["target=llama31_8b_random", "target.config.hidden_size=64", "target.config.intermediate_size=96",
               "target.config.num_hidden_layers=2", "target.config.num_attention_heads=4",
               "target.config.num_key_value_heads=2", "target.config.head_dim=16", "target.config.vocab_size=512",
               "target.config.max_position_embeddings=512", "engine.dtype=float32"]


def test_compare_plain_and_profile_steps(tmp_path):
    """compare_plain serves the prompts with plain decoding first, into RUN_DIR/plain (a run
    directory the report matches as the baseline); engine.profile_steps records the graphed step
    beside the weight-bandwidth floor of the target's actual parameter bytes."""
    from specdec.run import run

    overrides = TINY_RANDOM + [
        "workload=synthetic", "workload.concurrency=2", "workload.sources.0.num_prompts=3",
        "workload.sources.0.prompt_len=12", "workload.sources.0.output_len=6", "engine.kv_cache_tokens=1024",
        "logger=none", "draft=ngram", "policy=always", "compare_plain=true", "engine.profile_steps=[1,2]",
        "engine.profile_steps_context=32", "engine.profile_steps_iters=2", f"run_dir={tmp_path}/run"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    m = run(cfg)
    run_dir = tmp_path / "run"
    plain_cfg = json.loads((run_dir / "plain" / "config.json").read_text())
    assert plain_cfg["draft"] == {"name": "none"} and plain_cfg["policy"] == {"name": "never"}
    assert plain_cfg["workload"] == json.loads((run_dir / "config.json").read_text())["workload"]
    plain = json.loads((run_dir / "plain" / "metrics.json").read_text())
    assert plain["speculating_step_fraction"] == 0.0 and plain["tokens_per_row_step"] == 1.0
    assert m["outputs_identical_to_plain"] == 1.0 and m["outputs_identical_count"] == 3
    assert m["speedup_over_plain"] == pytest.approx(m["output_tok_per_s"] / plain["output_tok_per_s"])
    assert m["plain_output_tok_per_s"] == plain["output_tok_per_s"]
    assert json.loads((run_dir / "metrics.json").read_text())["speedup_over_plain"] == m["speedup_over_plain"]
    sf = m["step_floor"]
    H, I, L, V, hd = 64, 96, 2, 512, 16
    layer = H * 4 * hd + 2 * H * 2 * hd + 4 * hd * H + 3 * H * I + 2 * H  # q, k + v, o, MLP, two norms
    params = 2 * V * H + L * layer + H  # untied embedding + lm_head, final norm
    assert sf["weight_bytes"] == 4 * params and sf["weight_bytes_read"] == 4 * (params - V * H)
    assert sf["floor_ms_all"] == pytest.approx(sf["weight_bytes"] / (sf["copy_gbps"] * 1e9) * 1e3)
    assert set(sf["step_ms"]) == {"1", "2"} and all(ms > 0 for ms in sf["step_ms"].values())
    assert sf["floor_fraction_all"]["2"] == pytest.approx(sf["floor_ms_all"] / sf["step_ms"]["2"])

    from specdec import report

    md, _ = report.build_report(report.load_runs([run_dir]), tmp_path / "report")
    assert "## Speculation" in md and "## Step time vs weight-bandwidth floor" in md
    spec_row = next(ln for ln in md.split("## Speculation\n", 1)[1].splitlines() if "ngram" in ln)
    assert f"{m['speedup_over_plain']:.2f}×" in spec_row  # the plain sub-run is the matched baseline


def test_compare_plain_needs_a_drafter(tmp_path):
    _assert_clean_error(run_cli("compare_plain=true", "logger=none", tmp_path=tmp_path), "compare_plain", "draft=none")


def test_explain_policy_from_the_switch_log_and_from_the_table():
    """The quickstart's last lines: what goodput decided and why, from its own state in metrics.json."""
    from specdec.run import explain_policy

    log = [{"batch": 4, "from": 0, "to": 16, "why": "first_try",
            "k": {"0": {"a": 1.0, "iter_ms": 100.0}, "16": {"a": None, "iter_ms": 250.0}}},
           {"batch": 4, "from": 16, "to": 0, "why": "estimates",
            "k": {"0": {"a": 1.0, "iter_ms": 100.0}, "16": {"a": 2.2, "iter_ms": 250.0}}}]
    m = {"device": "cpu", "speculating_step_fraction": 0.02, "policy_state": {"switch_log": log}}
    lines = explain_policy("goodput", m)
    assert lines[0] == ("Why: on this CPU a 16-token draft step at batch 4 costs 2.5 plain steps and commits 2.2 "
                        "tokens per request: the goodput policy kept speculation off after 1 probe (2% of decode "
                        "steps speculated).")
    assert len(lines) == 2 and "memory-bound" in lines[1]
    # no switch log: the start-up table at the run's batch and the a(k) prior
    m = {"device": "cuda", "device_name": "NVIDIA H100", "speculating_step_fraction": 0.97, "mean_batch_size": 3.2,
         "policy_state": {"step_ms": {"k=0": {"1": 10.0, "4": 12.0}, "k=8": {"1": 11.0, "4": 14.4}},
                          "accept": {"k=8": 3.5}}}
    assert explain_policy("goodput", m) == [
        "Why: on NVIDIA H100 a 8-token draft step at batch 4 costs 1.2 plain steps and commits 3.5 tokens per "
        "request: the goodput policy speculated on 97% of decode steps."]
    # a policy without estimates: the served steps
    m = {"device": "cpu", "speculating_step_fraction": 1.0, "mean_spec_step_ms": 30.0, "mean_plain_step_ms": 10.0,
         "mean_accepted_length": 2.0}
    assert explain_policy("always", m) == [
        "Why: on this CPU a speculative step took 3.0 plain steps and committed 2.0 tokens per request; the always "
        "policy speculated on 100% of decode steps."]
    assert explain_policy("never", {"speculating_step_fraction": 0.0}) == []
    # a k never tried (its step too dear for a first try): its cost alone
    m = {"device": "cpu", "speculating_step_fraction": 0.0, "mean_batch_size": 4.0,
         "policy_state": {"step_ms": {"k=0": {"4": 100.0}, "k=16": {"4": 450.0}}, "accept": {"k=16": None}}}
    assert explain_policy("goodput", m) == [
        "Why: on this CPU a 16-token draft step at batch 4 costs 4.5 plain steps, too dear for the goodput policy "
        "to try: it kept speculation off (0% of decode steps speculated)."]
    # n-gram: no probe (drafts scored on the side); the rows' own a(k) and served iterations; the estimates
    # after serving point the other way than the choice made: stated, no cause claimed
    m = {"device": "cpu", "speculating_step_fraction": 0.0, "mean_batch_size": 4.0,
         "policy_state": {"step_ms": {"k=0": {"4": 100.0}, "k=4": {"4": 150.0}}, "served_iter_ms": {"k=0": {"4": 120.0}},
                          "accept": {"k=4": 3.0}, "accept_rows": {"k=4": {"a": 1.0, "b": 1.2}}, "shadow_samples": 50}}
    assert explain_policy("goodput", m)[0] == (
        "Why: on this CPU a 4-token draft step at batch 4 costs 1.2 plain steps and commits 1.1 tokens per request: "
        "the goodput policy kept speculation off, from 50 drafts it scored on the side (0% of decode steps speculated).")
    m["policy_state"]["accept_rows"] = {"k=4": {"a": 2.0, "b": 2.0}}
    assert explain_policy("goodput", m) == [
        "On this CPU the goodput policy kept speculation off, from 50 drafts it scored on the side (0% of decode steps "
        "speculated); after serving, its estimates rate a 4-token draft step at batch 4 at 1.2 plain steps for 2.0 "
        "tokens per request (metrics.json policy_state has the rest)."]


def test_serve_progress_counts_and_stays_off_without_a_terminal():
    from specdec.bench.console import ServeProgress

    with ServeProgress(3, "serving", enabled=False) as p:
        p.on_step({"committed": 4, "decode_bs": 2})
        p.on_request({})
    assert p.tokens == 4 and p.done == 1 and p._progress is None
    with ServeProgress(None, "serving", duration_s=5.0, enabled=True, refresh_s=0.0) as p:
        p.on_step({"committed": 2, "decode_bs": 1})
        assert "/5 s, 0 requests" in p._count()
    assert p.tok_per_s() > 0


def test_sweep_position_outside_hydra_is_empty():
    from specdec.run import hydra_overrides, sweep_position

    assert sweep_position() == "" and hydra_overrides() is None
