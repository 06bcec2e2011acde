"""Resumable training-data stages and online feature capture, for heads trained on far more data
than one run's memory or time budget holds.

A staged data directory (``train.data.dir``) holds

    prompts.jsonl          stage 1: the decontaminated prompts (written once; asserted disjoint from
                           HumanEval and MT-bench again on every load), prompt_stats.json beside it
    answers/shard-NNNNN.jsonl   stage 2: the target's answers, appended in shards as requests finish;
                           each record is one (prompt, sample) item: sample 0 the greedy answer
                           (``answer_temperature``), samples 1 .. ``samples`` sampled at
                           ``sample_temperature`` (different continuations of the same prompt)

Stage 2 resumes: items already in a shard are skipped, so rerunning the same command continues
where the last one stopped (its time budget, a lost machine). Items run greedy first for every
prompt, then sample 1 for every prompt, and so on, so a stopped run still covers the prompts
evenly. A request unfinished when the budget runs out is dropped (not written) and redone next time.

Training reads every shard. Features are captured *online* (:class:`OnlineFeatures`): each batch's
sequences run through the target right before the optimizer step (one forward of ~16K tokens, a few
ms on an H200 beside a ~100 ms step), so no [N, 3H] feature store is held: 24M tokens of SmolLM2
features would take ~110 GB. The held-out split is by prompt (all samples of a prompt on one side),
so held-out acceptance is measured on prompts the head never saw.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from .data import Sequence, capture, gather_batch
from .prompts import EvalIndex, TrainingDataError, TrainPrompt, assert_no_overlap


def log(msg: str) -> None:
    print(f"[train] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Stage 1: prompts
# ----------------------------------------------------------------------------------------------

def prompts_path(data_dir: Path) -> Path:
    return Path(data_dir) / "prompts.jsonl"


def save_prompts(data_dir: Path, prompts: list[TrainPrompt], stats: dict) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = prompts_path(data_dir).with_suffix(".tmp")
    with open(tmp, "w") as f:
        for p in prompts:
            f.write(json.dumps(dataclasses.asdict(p)) + "\n")
    os.replace(tmp, prompts_path(data_dir))  # a stage either wrote its file or did not
    (data_dir / "prompt_stats.json").write_text(json.dumps(stats, indent=2))


def load_prompts(data_dir: Path, index: EvalIndex) -> tuple[list[TrainPrompt], dict]:
    """Stage 1's prompts, checked against the eval sets again (the guarantee is re-asserted, not trusted)."""
    path = prompts_path(data_dir)
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                d = json.loads(line)
                out.append(TrainPrompt(str(d["id"]), str(d["text"]), str(d["source"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise TrainingDataError(f"{path}:{n}: not a prompt record ({e})") from e
    if not out:
        raise TrainingDataError(f"{path} holds no prompts; delete it to build them again")
    assert_no_overlap(out, index)
    stats_path = data_dir / "prompt_stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    return out, {**stats, "prompts": len(out)}


# ----------------------------------------------------------------------------------------------
# Stage 2: answers in shards
# ----------------------------------------------------------------------------------------------

def item_id(prompt_id: str, sample: int) -> str:
    return f"{prompt_id}#{sample}"


def split_id(seq_id: str) -> tuple[str, int | None]:
    """(prompt id, sample) of a sequence id: ``item_id``'s inverse; an id without a sample suffix is
    its own prompt, sample None."""
    head, sep, tail = seq_id.rpartition("#")
    return (head, int(tail)) if sep and tail.isdigit() else (seq_id, None)


def prompt_of(seq_id: str) -> str:
    """The prompt id of a sequence id."""
    return split_id(seq_id)[0]


def greedy_only(ids: list[str], held: list[int]) -> list[int]:
    """The held-out indices whose sequence is a prompt's greedy answer (sample 0, or an id without a
    sample suffix): a held-out score over the target's own greedy text, comparable between heads
    trained with and without sampled answers. The sampled answers of held-out prompts are left out of
    both sides (their prompts stay unseen in training)."""
    return [i for i in held if split_id(ids[i])[1] in (None, 0)]


def shard_paths(data_dir: Path) -> list[Path]:
    return sorted((Path(data_dir) / "answers").glob("shard-*.jsonl"))


def read_shards(data_dir: Path) -> tuple[list[Sequence], set[str], dict]:
    """(sequences with an answer, every item id written (errors included), counts per sample)."""
    seqs, done, per_sample = [], set(), {}
    for path in shard_paths(data_dir):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                sid = str(d["id"])
                out_ids = [int(t) for t in d["output_ids"]]
                prompt_ids = [int(t) for t in d["prompt_ids"]]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise TrainingDataError(f"{path}:{n}: not an answer record ({e}); delete the shard to redo it") from e
            done.add(sid)
            if out_ids:
                seqs.append(Sequence(sid, str(d.get("source", "?")), prompt_ids, out_ids))
                s = str(d.get("sample", 0))
                per_sample[s] = per_sample.get(s, 0) + 1
    return seqs, done, per_sample


class ShardWriter:
    """Appends finished answers to new shard files of at most ``per_shard`` records (each file
    written whole and renamed into place, so a lost machine leaves no half-written shard)."""

    def __init__(self, data_dir: Path, per_shard: int):
        self.dir = Path(data_dir) / "answers"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.per_shard = max(1, int(per_shard))
        self.buf: list[dict] = []
        self.written = 0
        existing = shard_paths(data_dir)
        self.next_no = 1 + max((int(p.stem.split("-")[1]) for p in existing), default=-1)

    def add(self, rec: dict) -> None:
        self.buf.append(rec)
        if len(self.buf) >= self.per_shard:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        path = self.dir / f"shard-{self.next_no:05d}.jsonl"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for rec in self.buf:
                f.write(json.dumps(rec) + "\n")
        os.replace(tmp, path)
        self.next_no += 1
        self.written += len(self.buf)
        self.buf = []


def answer_stage(model, tokenizer, prompts: list[TrainPrompt], data_dir: Path, *, samples: int,
                 answer_temperature: float, sample_temperature: float, max_new_tokens: int, max_seq_len: int,
                 engine_config, eos_ids, budget_s: float | None, per_shard: int, seed: int,
                 min_left_s: float = 10.0) -> dict:
    """Answer every (prompt, sample) item not yet in a shard, one engine per temperature, within
    ``budget_s`` seconds in all (None: no limit; no new engine starts with less than ``min_left_s``
    left: its start-up would use it); returns what this call did."""
    from ..bench.metrics import LiveProgress
    from ..engine.engine import Engine

    _, done, _ = read_shards(data_dir)
    enc = {}
    t0 = time.perf_counter()
    writer = ShardWriter(data_dir, per_shard)
    stats = {"items_before": len(done), "stopped_by_budget": False, "engines": []}
    # Two engines (one temperature each): the greedy answers, then every sampled one, sample-major
    # (sample 1 of every prompt queued before sample 2 of any), so a stopped run covers prompts evenly.
    groups = [(answer_temperature, [0])] + ([(sample_temperature, list(range(1, samples + 1)))] if samples else [])
    for g, (temp, group) in enumerate(groups):
        todo = [(p, j) for j in group for p in prompts if item_id(p.id, j) not in done]
        if not todo:
            continue
        left = None if budget_s is None else budget_s - (time.perf_counter() - t0)
        if left is not None and left < min_left_s:
            stats["stopped_by_budget"] = True
            break
        ids = []
        for p, _ in todo:
            if p.id not in enc:
                enc[p.id] = tokenizer.encode_chat([{"role": "user", "content": p.text}])
            ids.append(enc[p.id])
        keep = [i for i, x in enumerate(ids) if len(x) + 2 <= max_seq_len]
        for i in sorted(set(range(len(todo))) - set(keep)):  # too long for a sequence: marked done, no answer
            writer.add(_record(*todo[i], temp, ids[i], []))
        cfg = dataclasses.replace(engine_config, temperature=float(temp), seed=int(seed) + 1009 * g)
        if cfg.kv_cache_tokens is None:
            longest = max((len(ids[i]) for i in keep), default=1) + max_new_tokens + 16
            cfg = dataclasses.replace(cfg, kv_cache_tokens=min(len(keep), cfg.max_batch_size) * longest)
        t_eng = time.perf_counter()
        finished = tokens = 0
        label = "greedy answers" if group == [0] else f"sampled answers {group[0]}-{group[-1]}"
        with LiveProgress(len(keep), f"{label} (T={temp})") as live:
            engine = Engine(model, cfg, eos_ids=eos_ids, trace=live.on_step)
            reqs = {engine.add_request(ids[i], max_new_tokens).id: i for i in keep}
            while engine.has_work():
                for r in engine.step():
                    live.on_request(None)
                    i = reqs[r.id]
                    out = [] if r.error else list(r.output_ids)[: max_seq_len - len(ids[i])]
                    writer.add(_record(*todo[i], temp, ids[i], out))
                    finished += 1
                    tokens += len(out)
                if budget_s is not None and time.perf_counter() - t0 > budget_s:
                    stats["stopped_by_budget"] = True
                    break
        writer.flush()
        del engine
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
        dt = time.perf_counter() - t_eng
        stats["engines"].append({"samples": group, "temperature": temp, "requests": len(keep), "finished": finished,
                                 "answer_tokens": tokens, "s": round(dt, 1), "tok_per_s": round(tokens / max(dt, 1e-9))})
        log(f"{label} (T={temp}): {finished} of {len(keep)} answered, {tokens} tokens in {dt:.0f} s")
        if stats["stopped_by_budget"]:
            break
    writer.flush()
    stats.update(items_written=writer.written, answer_s=round(time.perf_counter() - t0, 1))
    return stats


def _record(p: TrainPrompt, sample: int, temp: float, prompt_ids: list[int], out: list[int]) -> dict:
    return {"id": item_id(p.id, sample), "source": p.source, "sample": sample, "temperature": temp,
            "prompt_ids": prompt_ids, "output_ids": out}


def load_staged(data_dir: Path) -> tuple[list[Sequence], dict]:
    """Every answered sequence of a staged data directory, with its stats; a clear error when stage
    2 has not run (e.g. the machine that ran it is gone)."""
    data_dir = Path(data_dir)
    if not prompts_path(data_dir).is_file():
        raise TrainingDataError(f"train.data.dir={data_dir} has no prompts.jsonl: run the data stage first "
                                "(train.data.only=true with the same train.data.dir; experiments/train_head_gpu.sh data)")
    seqs, done, per_sample = read_shards(data_dir)
    if not seqs:
        raise TrainingDataError(f"train.data.dir={data_dir} has no answers in answers/shard-*.jsonl: run the "
                                "data stage first (experiments/train_head_gpu.sh data)")
    stats_path = data_dir / "prompt_stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    stats.update(staged_dir=str(data_dir), shards=len(shard_paths(data_dir)), items=len(done),
                 sequences_per_sample=dict(sorted(per_sample.items(), key=lambda kv: int(kv[0]))))
    return seqs, stats


def split_by_prompt(ids: list[str], fraction: float, rng, max_heldout: int | None = None) -> tuple[list[int], list[int]]:
    """(held-out, train) sequence indices, every sample of a prompt on the same side; about
    ``fraction`` of the prompts held out (at least one, never all), at most ``max_heldout`` sequences."""
    groups: dict[str, list[int]] = {}
    for i, sid in enumerate(ids):
        groups.setdefault(prompt_of(sid), []).append(i)
    keys = sorted(groups)
    rng.shuffle(keys)
    if len(keys) < 2:
        raise TrainingDataError(f"{len(keys)} prompt(s) answered: need at least 2 (one to train on, one held out)")
    n_held = min(max(1, round(fraction * len(keys))), len(keys) - 1)
    held: list[int] = []
    for k in keys[:n_held]:
        if max_heldout is not None and held and len(held) + len(groups[k]) > max_heldout:
            break
        held.extend(groups[k])
    held_set = set(held)
    return sorted(held), [i for i in range(len(ids)) if i not in held_set]


# ----------------------------------------------------------------------------------------------
# Online features
# ----------------------------------------------------------------------------------------------

class OnlineFeatures:
    """Sequences whose target features are captured per batch (``batch``), not stored: the same
    rows :func:`capture` would store, computed right before each optimizer step."""

    def __init__(self, model, seqs: list[list[int]], prompt_lens: list[int], layers, page_size: int = 16):
        self.model, self.seqs, self.prompt_lens, self.layers = model, seqs, prompt_lens, tuple(layers)
        self.lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        self.page_size = page_size

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def answer_tokens(self) -> int:
        return int(sum(len(s) - p for s, p in zip(self.seqs, self.prompt_lens)))

    def batch(self, idx: list[int], device):
        """The training Batch of sequences ``idx``: one target forward over them, then padding."""
        seqs = [self.seqs[i] for i in idx]
        store = capture(self.model, seqs, [self.prompt_lens[i] for i in idx], self.layers,
                        chunk_tokens=max(1, sum(map(len, seqs))), page_size=self.page_size)
        return gather_batch(store, list(range(len(idx))), device)


# ----------------------------------------------------------------------------------------------
# Training state (resume)
# ----------------------------------------------------------------------------------------------

def save_train_state(path: Path, head, opt, progress: dict, vocab_ids: torch.Tensor) -> None:
    """Weights (fp32 masters), optimizer moments, schedule position and draft vocabulary: what a
    later call needs to continue the same run (``train.resume``). Written whole, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"head": {k: v.detach().cpu() for k, v in head.state_dict().items()},
                "opt": opt.state_dict(), "progress": dict(progress), "vocab_ids": vocab_ids.cpu()}, tmp)
    os.replace(tmp, path)


def load_train_state(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise TrainingDataError(f"train.resume: no training state at {path} (train.state_path); the run that "
                                "wrote it saves one at its time budget, every train.save_every steps and at the end")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a truncated file
        raise TrainingDataError(f"train.resume: {path} is not a readable training state ({e})") from e
