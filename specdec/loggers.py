"""Run loggers: Weights & Biases (offline unless WANDB_MODE says otherwise) or local files only.

Local files (config, metrics.json, requests.jsonl) are written by the run itself whatever the
logger; a logger only mirrors config and metrics to an experiment tracker.

W&B runs quietly: its own console lines (the offline preamble, "sync with wandb sync ...", the run
summary) stay out of the terminal, and it does not capture the terminal's output (console="off"),
so the run's progress display and tables are the console. Its files (``RUN_DIR/wandb/``) are
written as before. ``WANDB_SILENT=false`` brings its console lines back.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError


class NullLogger:
    def log_config(self, config: dict) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        pass

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        pass

    def log_summary(self, values: dict) -> None:
        """Run-level facts (e.g. provenance) that are not a time series."""

    def finish(self) -> None:
        pass


class WandbLogger(NullLogger):
    def __init__(self, project: str, run_dir: Path, name: str, mode: str = "offline", config=None):
        import wandb

        self._wandb = wandb
        # The user's WANDB_MODE wins; otherwise the config's mode (offline by default: no network).
        mode = os.environ.get("WANDB_MODE", mode)
        silent = os.environ.get("WANDB_SILENT", "true").strip().lower() not in ("false", "0", "no")
        settings = wandb.Settings(silent=True, quiet=True, show_info=False, show_warnings=False,
                                  console="off") if silent else None
        self.run = wandb.init(project=project, dir=str(run_dir), name=name, mode=mode,
                              config=config, reinit="finish_previous", settings=settings)

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self._wandb.Table(columns=columns, data=rows)})

    def log_summary(self, values: dict) -> None:
        self.run.summary.update(values)

    def finish(self) -> None:
        self.run.finish()


def make_logger(cfg, run_dir: Path, name: str, config: dict | None = None):
    kind = cfg.get("name", "none")
    if kind == "none":
        return NullLogger()
    if kind == "wandb":
        return WandbLogger(cfg.get("project", "specdec"), run_dir, name, cfg.get("mode", "offline"), config)
    raise ConfigError(f"unknown logger {kind!r}; valid: wandb, none")
