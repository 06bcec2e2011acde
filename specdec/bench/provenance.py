"""Provenance stamped on every benchmark row: commit, device, date.

The commit comes from ``$SPECDEC_COMMIT`` when set (set it when a copy of the tree runs on another
machine, whose ``.git`` may be missing or stale), else from ``git`` ("-dirty" with uncommitted
changes), else "unknown".
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    if os.environ.get("SPECDEC_COMMIT"):  # set explicitly: wins over a copied (possibly stale) .git
        return os.environ["SPECDEC_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("SPECDEC_COMMIT", "unknown")


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def now_iso() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")
