"""Run loggers: W&B writes its offline run files and keeps its own lines out of the console."""

import pytest

from specdec.loggers import NullLogger, make_logger


def test_wandb_offline_is_quiet_and_writes_its_files(tmp_path, monkeypatch, capfd):
    pytest.importorskip("wandb")
    from omegaconf import OmegaConf

    monkeypatch.delenv("WANDB_SILENT", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    log = make_logger(OmegaConf.create({"name": "wandb", "project": "t"}), tmp_path, "quiet", {"seed": 0})
    log.log_metrics({"output_tok_per_s": 1.5})
    log.log_summary({"commit": "x"})
    log.log_table("requests", ["id"], [["a"]])
    print("the run's own line")
    log.finish()
    out, err = capfd.readouterr()
    assert out == "the run's own line\n"  # no preamble, no "wandb sync" hint, no summary
    assert "wandb" not in err.lower()
    run = next((tmp_path / "wandb").glob("offline-run-*"))
    assert list(run.glob("run-*.wandb")) and list(run.glob("files/media/table/*.table.json"))


def test_null_logger():
    assert isinstance(make_logger({"name": "none"}, None, "x"), NullLogger)
