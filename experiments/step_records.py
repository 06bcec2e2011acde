"""Shared by the scripts that read ``specdec.run``'s per-step records (iter_noise, calibration_bias, replay_choices,
run_order): the records of a run directory, and a markdown report printed and optionally written."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def read_steps(run: Path, required: str | None = None) -> list[dict] | None:
    """A run directory's steps.jsonl or steps.jsonl.gz, one dict per step; without either: None, or (``required``:
    the calling script's name) exit naming the run."""
    for name, opener in (("steps.jsonl", open), ("steps.jsonl.gz", gzip.open)):
        f = Path(run) / name
        if f.exists():
            with opener(f, "rt") as fh:
                return [json.loads(line) for line in fh if line.strip()]
    if required:
        raise SystemExit(f"{required}: {run} has no steps.jsonl(.gz) (runs record them with per-step logging on)")
    return None


def emit(lines: list[str], out: str | None) -> int:
    """Print the report's lines, write them to ``out`` too when given; the scripts' exit status (0)."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0
