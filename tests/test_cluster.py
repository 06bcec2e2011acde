"""Cluster sweeps through Hydra's submitit launcher (the optional ``[cluster]`` extra): the project's
launcher configs compose, and a two-job multirun runs through ``hydra/launcher=local`` (submitit's
local executor: each job its own process) on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
TINY = ("target.config={hidden_size:64,intermediate_size:128,num_hidden_layers:2,num_attention_heads:4,"
        "num_key_value_heads:2,head_dim:16,vocab_size:512,max_position_embeddings:1024,rms_norm_eps:1e-5,"
        "rope_theta:10000.0,tie_word_embeddings:false,bos_token_id:1,eos_token_id:2}")

submitit_plugin = pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                                      reason="pip install -e '.[cluster]' (hydra-submitit-launcher)")


@pytest.mark.parametrize("launcher,target", [("slurm", "SlurmLauncher"), ("local", "LocalLauncher")])
def test_launcher_configs_compose(launcher, target):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith(target)
    if launcher == "slurm":
        assert cfg.hydra.launcher.gpus_per_node == 1 and cfg.hydra.launcher.tasks_per_node == 1


@pytest.mark.slow
def test_two_job_multirun_through_submitit_local(tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled")
    env.pop("TRITON_INTERPRET", None)
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.run", "--multirun", "hydra/launcher=local", "target=llama31_8b_random", TINY,
         "workload=synthetic", "workload.sources.0.num_prompts=2", "workload.sources.0.prompt_len=8",
         "workload.sources.0.output_len=4", "workload.concurrency=2", "engine.max_new_tokens=4", "logger=none",
         "seed=0,1", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Submitit 'local' sweep" in proc.stdout + proc.stderr
    seeds = set()
    for job in ("0", "1"):
        m = json.loads((sweep / job / "metrics.json").read_text())
        assert m["requests"] == 2 and m["failed_requests"] == 0 and m["output_tokens"] == 8
        seeds.add(json.loads((sweep / job / "config.json").read_text())["seed"])
    assert seeds == {0, 1}
    assert list((sweep / ".submitit").iterdir())  # the jobs ran as submitit jobs (their logs and pickles)
