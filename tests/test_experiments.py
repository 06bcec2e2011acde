"""Every study runs: each conf/experiment file through its entry (``specdec.run --multirun`` or
``specdec.train``) in a tiny smoke mode, and each experiments/ script's ``--quick`` mode (``--help`` where it
has none), on CPU.

Slow (minutes each on 2 cores): ``python -m pytest -q -m slow tests/test_experiments.py``.
Smoke mode keeps the experiment's own settings and sweep structure and shrinks only the size: a
handful of prompts and tokens, each swept key pinned to one value (its first, or the one in PICK),
random-weight targets at tiny shapes, training experiments through their ``_smoke`` variant.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import specdec  # noqa: F401  (registers the ${specdec.repo:...} resolver the configs use)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "experiments").rglob("*.py") if "results" not in p.parts)
SHELL_SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "experiments").glob("*.sh"))

# The swept value a smoke run takes where the first one would cover less (a drafter over plain).
PICK = {"policy_sweep": {"policy": "goodput"}, "eagle3_table": {"+method": "eagle3_tree16"},
        "eagle3_humaneval_full": {"+method": "eagle3_tree16"},
        "switch_acceptance": {"policy.off_steps": "2", "draft.sync_while_off": "false"},
        "step_moe": {"target": "qwen3_30b_a3b_random_zipf"},  # the MoE target with its routing steered
        "crossover_moe": {"target": "qwen3_30b_a3b_random_zipf", "policy": "goodput"}}
# Llama-3.1-8B structure at tiny sizes (random-weight targets).
TINY_SHAPES = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 4096}
# ... and of an MoE target's experts
TINY_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _env():
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("TRITON_INTERPRET", None)  # entries and scripts set it themselves where they need it
    return env


def _sweep(name: str) -> dict:
    exp = yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text())
    return ((exp.get("hydra") or {}).get("sweeper") or {}).get("params") or {}


def smoke_overrides(name: str) -> list[str]:
    """Overrides that make experiment ``name`` tiny: one value per swept key, few prompts/tokens."""
    pinned = {k: PICK.get(name, {}).get(k, str(v).split(",")[0].strip()) for k, v in _sweep(name).items()}
    out = [f"{k}={v}" for k, v in pinned.items()]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={name}"] + out)
    for i, src in enumerate(cfg.workload.sources):
        if src.kind == "synthetic" and src.get("lengths"):  # a real prompt set's lengths
            out += [f"workload.sources.{i}.limit=2", f"workload.sources.{i}.output_len=4"]
        elif src.kind == "synthetic":
            out += [f"workload.sources.{i}.num_prompts=2", f"workload.sources.{i}.prompt_len=8",
                    f"workload.sources.{i}.output_len=4"]
        else:
            out.append(f"workload.sources.{i}.limit=1")
    if cfg.target.get("random_weights"):
        out += [f"target.config.{k}={v}" for k, v in TINY_SHAPES.items()] + ["engine.dtype=float32"]
        if cfg.target.config.get("num_experts"):
            out += [f"target.config.{k}={v}" for k, v in TINY_EXPERTS.items()]
    out += ["engine.max_new_tokens=4", "engine.profile_iters=1", "engine.profile_steps_iters=2",
            "engine.profile_steps_context=32", "device=cpu"]
    if cfg.engine.get("profile_steps"):
        out.append("engine.profile_steps=[1]")
    if cfg.engine.get("profile_spec_steps"):
        out.append("engine.profile_spec_steps=[1]")
    if cfg.engine.get("kv_cache_tokens") is None or cfg.engine.kv_cache_tokens > 8192:
        out.append("engine.kv_cache_tokens=4096")
    if cfg.policy.name == "goodput":
        out.append("policy.profile_context=32")
    if cfg.workload.get("duration_s") is not None:  # a timed closed loop: briefly
        out += ["workload.duration_s=0.5", "workload.warmup_s=0.1"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_smoke(name, tmp_path, smollm2_path, prompts_path):
    if name.startswith("train_"):
        smoke = name if name.endswith("_smoke") else f"{name}_smoke"
        assert (CONF / "experiment" / f"{smoke}.yaml").is_file(), f"{name} needs a {smoke} variant"
        cmd = ["-m", "specdec.train", f"+experiment={smoke}", "logger=none", "device=cpu",
               f"hydra.run.dir={tmp_path}/run"]
    else:
        cmd = ["-m", "specdec.run", "--multirun", f"+experiment={name}", *smoke_overrides(name),
               "logger=none", f"hydra.sweep.dir={tmp_path}/sweep"]
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    if name.startswith("train_"):
        assert list((tmp_path / "run").rglob("metrics.json"))
        return
    runs = sorted((tmp_path / "sweep").rglob("metrics.json"))
    assert runs, f"{name}: no run wrote metrics.json"
    for m in runs:
        metrics = json.loads(m.read_text())
        assert metrics["failed_requests"] == 0 and metrics["output_tokens"] > 0, m
    cfg = OmegaConf.load(next((tmp_path / "sweep").rglob("config.json")))
    if cfg.get("compare_plain"):  # the study's comparison reached metrics.json
        spec = [json.loads(m.read_text()) for m in runs if m.parent.name != "plain"]
        assert all("speedup_over_plain" in s and s["outputs_identical_to_plain"] == 1.0 for s in spec)
    if cfg.engine.get("profile_steps"):
        assert all("step_floor" in json.loads(m.read_text()) for m in runs if m.parent.name != "plain")
    # ... and the report renders the sweep
    rep = subprocess.run([sys.executable, "-m", "specdec.report", str(tmp_path / "sweep"), "--out",
                          str(tmp_path / "report")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert rep.returncode == 0, rep.stderr[-3000:]


def _script_args(script: str, tmp_path: Path, smollm2_path: Path, prompts_path: Path) -> list[str]:
    src = (ROOT / script).read_text()
    if "--quick" not in src:  # no CPU smoke mode (it times CUDA kernels): its arguments parse and it imports
        return ["--help"]
    args = ["--quick"]
    if re.search(r"""add_argument\(\s*["']--out["']""", src):
        args += ["--out", str(tmp_path / "out")]
    if re.search(r"""["']--smollm2["'], required=True""", src):
        args += ["--smollm2", str(smollm2_path)]
    if re.search(r"""["']--prompts["'], required=True""", src):
        args += ["--prompts", str(prompts_path / "humaneval.jsonl")]
    return args


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_quick(script, tmp_path, smollm2_path, prompts_path):
    args = _script_args(script, tmp_path, smollm2_path, prompts_path)
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_every_experiment_has_a_smoke_mode():
    """Fast check (default selection): each experiment composes with its smoke overrides, and every
    training experiment has a _smoke variant."""
    for name in EXPERIMENTS:
        if name.startswith("train_"):
            assert name.endswith("_smoke") or f"{name}_smoke" in EXPERIMENTS, name
            continue
        overrides = smoke_overrides(name)
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[f"+experiment={name}"] + overrides)
        assert cfg.engine.max_new_tokens == 4
        for key in _sweep(name):  # every swept key pinned to one value
            assert any(o.startswith(f"{key}=") and "," not in o for o in overrides), (name, key)


def test_smollm2_random_target_has_the_converted_checkpoint_shapes():
    """target=smollm2_random: SmolLM2-135M-Instruct's config (the converted checkpoint's fields, FACTS.md),
    random weights, and a label that says so, for runs where the checkpoint is not staged."""
    from specdec.bench.targets import llama_config_from_dict

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["target=smollm2_random", "workload=humaneval_lengths"])
    assert cfg.target.random_weights is True and cfg.target.path is None
    c = llama_config_from_dict(OmegaConf.to_container(cfg.target.config))
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.vocab_size) == (576, 1536, 30, 9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.max_position_embeddings == 8192 and "random weights" in cfg.target.name


def test_profile_serving_phases_splits_host_time_by_iteration(tmp_path):
    """profile_serving.py --phases (CPU smoke): host ms per engine phase, per iteration that prefilled or
    not, from the wrapped engine / scheduler / stepper / policy methods, which are restored afterwards."""
    out = tmp_path / "ps"
    proc = subprocess.run([sys.executable, "experiments/profile_serving.py", "--quick", "--phases", "--skip", "1",
                           "--out", str(out), "--", "draft=ngram_chains", "policy=goodput"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ph = json.loads((out / "profile_serving.json").read_text())["phases"]
    plain = ph["plain"]
    assert plain["iterations"] > 0 and plain["wall_ms_start_to_start"] > 0
    steps = plain["phase_ms_per_iteration"]
    assert steps["Engine.step"] >= steps["Stepper.launch_"] > 0 and "Goodput.choose" in steps
    assert ph["calls"]["Engine._commit_oldest_"] > 0


def test_lent_gpu_setup_gathers_a_carried_head_and_the_parts(tmp_path):
    """experiments/lent_gpu_setup.sh in a copy of the tree whose .stage holds two GGUF parts and a head
    split over the parts' head/ subfolders: the parts and the head land in the stage folder, and with
    no wheels (and not every part) nothing is converted."""
    import shutil
    import subprocess

    tree = tmp_path / "tree"
    (tree / "experiments").mkdir(parents=True)
    shutil.copy(ROOT / "experiments" / "lent_gpu_setup.sh", tree / "experiments")
    for q, files in (("q1", {"config.json": "{}", "model-00001-of-00002.safetensors": "a"}),
                     ("q2", {"model-00002-of-00002.safetensors": "b"})):
        (tree / ".stage" / q / "head").mkdir(parents=True)
        (tree / ".stage" / q / f"gguf.part0{q[1]}").write_text(q)
        for name, text in files.items():
            (tree / ".stage" / q / "head" / name).write_text(text)
    (tree / ".stage" / "q1" / "gguf.size").write_text("99\n")
    stage = tmp_path / "stage"
    out = subprocess.run(["bash", "-c", "source experiments/lent_gpu_setup.sh >/dev/null 2>&1; echo $SPECDEC_CACHE"],
                         cwd=tree, env={**os.environ, "SPECDEC_STAGE": str(stage)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(stage / "cache")
    assert sorted(p.name for p in (stage / "head").iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert (stage / "gguf.part02").read_text() == "q2" and (stage / "gguf.size").is_file()
    assert not (stage / "smol.gguf").exists()  # 2 of 99 bytes staged: no join, no conversion


def test_crossover_serves_longer_at_high_concurrency():
    """crossover_8b: 5 s points below C = 128, 15 s from there (lockstep waves of 128-token requests need a
    window over several of them); the ${specdec.at_least:...} resolver it uses picks by a number, null: the else."""
    def duration(c):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=["+experiment=crossover_8b", f"workload.concurrency={c}",
                                               "policy=never"])
        return cfg.workload.duration_s
    assert [duration(c) for c in (1, 64, 127, 128, 256)] == [5, 5, 5, 15, 15]
    cfg = OmegaConf.create({"x": None, "y": "${specdec.at_least:${x},2,a,b}"})
    assert cfg.y == "b"
    cfg.x = 2.0
    assert cfg.y == "a"
    cfg.x = "many"
    with pytest.raises(Exception, match="must be numbers"):
        _ = cfg.y


def _sweep_jobs(name: str, cmdline: list[str]) -> list[dict]:
    """The jobs of ``--multirun +experiment=NAME *cmdline`` in the order the experiment's sweeper (its
    hydra.sweeper._target_, else Hydra's basic sweeper) runs them."""
    import importlib

    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    exp = yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text())
    target = ((exp.get("hydra") or {}).get("sweeper") or {}).get("_target_")
    sweeper = BasicSweeper
    if target:
        module, cls = target.rsplit(".", 1)
        sweeper = getattr(importlib.import_module(module), cls)
    params = [f"{k}={'null' if v is None else v}" for k, v in _sweep(name).items()]
    jobs = sweeper.split_arguments(OverridesParser.create().parse_overrides(params + cmdline), None)[0]
    return [dict(o.split("=", 1) for o in job) for job in jobs]


@pytest.mark.parametrize("name,policies", [("policy_envelope", "never,always,goodput"),
                                           ("crossover_8b", "never,always3,goodput"),
                                           ("policy_sweep", "never,always,goodput")])
def test_repeats_run_a_points_policies_back_to_back(name, policies):
    """seed=0,1,2 on the command line interleaves: every consecutive group of len(policies) jobs is one
    (concurrency, seed) with each policy once, so host drift between runs hits a point's policies alike; the
    policies' order rotates from group to group (RotatingSweeper), so over a point's three seeds every policy
    runs once in every place."""
    pol = policies.split(",")
    jobs = _sweep_jobs(name, ["seed=0,1,2", f"policy={policies}", "workload.concurrency=128,256"])
    assert len(jobs) % (3 * len(pol)) == 0 and len(jobs) >= 6 * len(pol)
    places: dict = {}
    for i in range(0, len(jobs), len(pol)):
        group = jobs[i:i + len(pol)]
        assert sorted(j["policy"] for j in group) == sorted(pol)
        assert len({(j["workload.concurrency"], j["seed"]) for j in group}) == 1
        for place, j in enumerate(group):
            point = tuple(sorted((k, v) for k, v in j.items() if k not in ("seed", "policy")))
            places.setdefault((point, j["policy"]), set()).add(place)
    assert [j["seed"] for j in jobs[::len(pol)]][:3] == ["0", "1", "2"]
    assert [j["policy"] for j in jobs[:len(pol)]] == pol  # the first group in the listed order
    assert all(v == set(range(len(pol))) for v in places.values()), places


def test_rotating_sweeper_counterbalances_the_innermost_key():
    """rotate_jobs: the basic sweeper's jobs, each group of the innermost swept key rotated by its index (group g
    starts at value g mod n); nothing swept or one job: unchanged. Hydra loads the sweeper from an experiment."""
    from specdec.sweeper import rotate_jobs

    jobs = [[f"c={c}", f"seed={s}", f"policy={p}"] for c in (1, 2) for s in (0, 1, 2) for p in "abc"]
    out = rotate_jobs(jobs)
    assert sorted(out) == sorted(jobs) and len(out) == len(jobs)
    firsts = [g[2] for g in out[::3]]
    assert firsts == ["policy=a", "policy=b", "policy=c"] * 2
    for g in range(0, len(out), 3):
        assert len({tuple(j[:2]) for j in out[g:g + 3]}) == 1
    assert rotate_jobs(jobs[:1]) == jobs[:1] and rotate_jobs([["a=1"], ["a=1"]]) == [["a=1"], ["a=1"]]
    # the last key fixed, the one before it swept: that one rotates
    two = [[f"s={s}", f"p={p}", "x=1"] for s in (0, 1) for p in (0, 1)]
    assert [j[1] for j in rotate_jobs(two)] == ["p=0", "p=1", "p=1", "p=0"]
    from hydra_plugins.specdec_sweeper.rotating_sweeper import RotatingSweeper

    for name in ("policy_envelope", "crossover_8b", "policy_sweep"):
        exp = yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text())
        assert exp["hydra"]["sweeper"]["_target_"].endswith(RotatingSweeper.__name__)


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gpu_round_has_the_readme_stages_and_refuses_others(tmp_path):
    """experiments/gpu_round.sh: at most 10 stages, among them those the README's tables name; an unknown stage
    exits 64 before any setup and lists the valid ones."""
    src = (ROOT / "experiments" / "gpu_round.sh").read_text()
    stages = re.search(r'^STAGES="([^"]+)"', src, re.M).group(1).split()
    assert len(stages) <= 10
    assert {"gputests", "batch1", "envelope", "crossover8b", "step8b", "sweep", "moe"} <= set(stages)
    for st in stages:  # every listed stage has its case branch
        assert re.search(rf"^{st}\)", src, re.M), st
    proc = subprocess.run(["bash", "experiments/gpu_round.sh", "nope"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 64 and "batch1" in proc.stderr


def test_train_head_gpu_refuses_bad_modes_and_a_machine_without_the_model(tmp_path):
    """experiments/train_head_gpu.sh in a copy of the tree: an unknown mode exits 64; `train` on a machine where
    SmolLM2 is not converted exits 3 and names the setup calls."""
    import shutil

    tree = tmp_path / "tree"
    (tree / "experiments").mkdir(parents=True)
    for name in ("train_head_gpu.sh", "lent_gpu_setup.sh"):
        shutil.copy(ROOT / "experiments" / name, tree / "experiments")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SPECDEC_STAGE": str(tmp_path / "stage")}
    bad = subprocess.run(["bash", "experiments/train_head_gpu.sh", "nope"], cwd=tree, env=env, capture_output=True,
                         text=True)
    assert bad.returncode == 64 and "data|train|all|trees" in bad.stderr
    bare = subprocess.run(["bash", "experiments/train_head_gpu.sh", "train"], cwd=tree, env=env, capture_output=True,
                          text=True)
    assert bare.returncode == 3 and "gpu_machines.md" in bare.stderr
