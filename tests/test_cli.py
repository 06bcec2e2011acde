"""The `specdec` command: run, report, help and bad commands, through `python -m specdec.cli`
(the same function the installed `specdec` script calls)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, timeout=300):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_and_unknown_command():
    proc = cli("--help")
    assert proc.returncode == 0 and all(c in proc.stdout for c in ("run", "train", "report", "fetch"))
    proc = cli("serve")
    assert proc.returncode == 2 and "unknown command 'serve'" in proc.stderr


def test_run_then_report(tmp_path, smollm2):
    run_dir = tmp_path / "run"
    proc = cli("run", "+experiment=quickstart", "engine.max_new_tokens=3", "logger=none", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / "metrics.json").is_file()
    proc = cli("report", str(run_dir), "--out", str(tmp_path / "rep"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "2 runs from" in text and str(run_dir) in text  # the quickstart and its plain baseline (run/plain)


def test_unknown_experiment_fails_naming_it():
    proc = cli("run", "+experiment=no_such_study")
    assert proc.returncode != 0 and "no_such_study" in proc.stderr
