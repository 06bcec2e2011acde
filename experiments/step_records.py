"""Shared by the scripts that read ``specdec.run``'s per-step records (iter_noise, calibration_bias, replay_choices,
run_order): their command line (folders, or --quick for a committed one; --out), the records of a run directory, and
a markdown report printed and optionally written."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def parse_args(doc: str, quick: Path, argv=None, *, what: str = "run directories", extra=None) -> argparse.Namespace:
    """The scripts' command line: ``paths`` (``what``, with per-step records), ``--out``, ``--quick`` (no paths: the
    committed ``quick`` one), plus what ``extra(parser)`` adds."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", help=f"{what} with per-step records")
    ap.add_argument("--out", default=None, help="also write the tables to this markdown file")
    ap.add_argument("--quick", action="store_true", help=f"without {what}: a committed one ({quick.name})")
    if extra is not None:
        extra(ap)
    a = ap.parse_args(argv)
    if not a.paths:
        if not a.quick:
            ap.error(f"give {what} (or --quick)")
        a.paths = [str(quick)]
    return a


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
