"""Provenance stamped on every run's metrics.json and every benchmark row: commit, date, device,
library versions, kernel options.

The commit comes from ``$SPECDEC_COMMIT`` when set (set it when a copy of the tree runs on another
machine, whose ``.git`` may be missing or stale), else from ``git`` ("-dirty" with uncommitted
changes), else "unknown".
"""

from __future__ import annotations

import datetime
import os
import platform
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


def cpu_name() -> str:
    """The CPU model (/proc/cpuinfo on Linux, else platform.processor()), or "cpu" when unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_name(device: str | None = None) -> str:
    """The accelerator's name (e.g. "NVIDIA H200") for a CUDA device, else the CPU model. ``device``
    None: the CUDA device when one is visible."""
    cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    return torch.cuda.get_device_name(device if device not in (None, "cuda") else None) if cuda else cpu_name()


def now_iso() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def utc_now_iso() -> str:
    """UTC date and time, e.g. 2026-12-01T14:35:07Z."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def provenance(device: str | None = None) -> dict:
    """What produced a result: commit, UTC date/time, device name, torch / triton / python versions
    and the kernel options in force (kernels_triton/options.py)."""
    import triton

    from kernels_triton import options

    return {"commit": git_commit(), "date_utc": utc_now_iso(), "device_name": device_name(device),
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "kernel_options": options.get().as_dict()}
