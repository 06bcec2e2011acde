"""The policy envelope study through the front door: `specdec.run --multirun +experiment=
policy_envelope_smoke` (the full study's sweep in miniature, on the CPU) and `specdec.report` over its
run directories, which must hold the envelope table with every policy at every C."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import specdec  # noqa: F401  (registers the config resolvers)
from specdec.policy import build_policy

ROOT = Path(__file__).resolve().parents[1]


def test_full_study_composes_to_the_sweep_it_promises():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=policy_envelope", "policy=always"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params["draft"] == "eagle3_smollm2_trees,ngram_chains"
    assert params["workload"] == "humaneval,mt_bench"
    assert params["policy"] == "never,always,goodput"
    assert params["workload.concurrency"] == "1,2,4,8,16,32,64,128,256"
    # every policy of one C back to back: the first param varies slowest, so concurrency comes before policy
    keys = list(params)
    assert keys.index("workload.concurrency") < keys.index("policy")
    assert [t["num_draft_tokens"] for t in cfg.draft.trees] == [3, 8, 16, 32]
    assert cfg.policy.k is None and cfg.workload.requests_per_client == 3
    assert cfg.workload.duration_s == 5 and cfg.workload.warmup_s == 1  # timed points, steady window
    assert cfg.engine.max_batch_size == 256  # no concurrency: every bucket; with one, the buckets up to it
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=policy_envelope", "workload.concurrency=8"])
    assert cfg.engine.max_batch_size == 8
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=policy_envelope", "policy=goodput", "draft=ngram_chains",
                                           "workload=mt_bench"])
    cfg.policy.profile_context = 512  # auto: resolved by specdec.run from the prompts
    pol = build_policy(cfg.policy, sizes=tuple(cfg.draft.chains))
    assert list(cfg.draft.chains) == [2, 4, 8] and pol.shadow_evals == 2 and pol.profile_iters == 8
    assert cfg.engine.profile_iters == 1


@pytest.mark.slow
def test_policy_envelope_smoke_runs_and_reports(tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled")
    env.pop("TRITON_INTERPRET", None)  # the entry uses the torch references on CPU
    sweep = tmp_path / "multirun"
    proc = subprocess.run([sys.executable, "-m", "specdec.run", "--multirun", "+experiment=policy_envelope_smoke",
                           f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p.parent for p in sweep.rglob("metrics.json"))
    assert len(runs) == 6  # never / always / goodput x C = 1, 2
    for r in runs:
        m = json.loads((r / "metrics.json").read_text())
        assert m["failed_requests"] == 0 and "steady_k" in m
        assert m["duration_s"] == 0.5 and m["steady_warmup_s"] == 0.1 and "steady_tok_per_s" in m
    proc = subprocess.run([sys.executable, "-m", "specdec.report", str(sweep), "--out", str(tmp_path / "rep")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "rep" / "report.md").read_text()
    section = md.split("## Policy envelope", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ")]
    assert [c.strip() for c in rows[0].split("|")[1:4]] == ["Policy", "C=1", "C=2"]
    names = [ln.split("|")[1].strip().split()[0] for ln in rows[2:]]
    assert names == ["never", "always", "goodput", "envelope"]
