"""Workloads: lists of prompts from MT-bench, HumanEval, a JSONL file, or synthetic lengths.

A workload config has ``sources`` (each ``{kind, limit}``), ``chat`` (wrap in the chat template)
and, for ``kind: jsonl``, ``path``. Every prompt becomes a :class:`Prompt` with its token ids.

``kind: synthetic`` makes ``num_prompts`` prompts of ``prompt_len`` random token ids (seeded), each
asking for exactly ``output_len`` tokens (set ``ignore_eos: true`` on the workload so EOS does not
end them early): fixed shapes for throughput studies, and the only workload a random-weight target
(no tokenizer) can run. ``num_prompts: null`` scales with the closed-loop concurrency C
(``requests_per_client`` x C, at least ``min_prompts``) so every C runs in steady state.
"""

from __future__ import annotations

import dataclasses

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecdecError


class WorkloadError(SpecdecError, ValueError):
    """A workload file or config is malformed (the message names the file and line)."""


@dataclass
class Prompt:
    id: str
    text: str  # what the user wrote (first turn for multi-turn sets)
    messages: list[dict] | None  # chat messages, or None for a raw completion prompt
    prompt_ids: list[int]
    max_new_tokens: int | None = None  # None: the engine's max_new_tokens


def read_jsonl_prompts(path: str | Path) -> list[tuple[str, str | None, list[dict] | None]]:
    """Lines ``{"id", "prompt"}`` or ``{"id", "messages"}`` -> (id, prompt, messages)."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"workload file {path} does not exist")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise WorkloadError(f"{where}: expected a JSON object with 'id' and 'prompt' or 'messages'")
        pid = str(obj.get("id", f"{path.stem}/{lineno}"))
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if isinstance(prompt, str) and messages is None:
            rows.append((pid, prompt, None))
        elif prompt is None and isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            rows.append((pid, None, messages))
        else:
            raise WorkloadError(f"{where}: needs exactly one of 'prompt' (a string) or 'messages' "
                                "(a list of {role, content} strings)")
    if not rows:
        raise WorkloadError(f"workload file {path} holds no prompts")
    return rows


def _source_rows(src: dict, workload_cfg) -> list[tuple[str, str | None, list[dict] | None]]:
    from ..assets import prompts_dir

    kind = src.get("kind")
    if kind == "mt_bench":
        lines = (prompts_dir() / "mt_bench.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        return [(r["id"], r["turns"][0], None) for r in rows]
    if kind == "humaneval":
        lines = (prompts_dir() / "humaneval.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        return [(r["id"], r["prompt"], None) for r in rows]
    if kind == "jsonl":
        path = src.get("path") or workload_cfg.get("path")
        if not path:
            raise WorkloadError("workload=jsonl needs workload.path=FILE")
        return read_jsonl_prompts(path)
    raise WorkloadError(f"unknown workload source kind {kind!r}; valid: mt_bench, humaneval, jsonl, "
                        "synthetic")


# Synthetic ids start here: ids below 256 are control and byte tokens in common vocabularies
# (SmolLM2: 0..16 are control tokens), which a random prompt should not be made of.
SYNTHETIC_LOW_ID = 256


def synthetic_prompts(num_prompts: int, prompt_len: int, output_len: int, vocab_size: int,
                      seed: int = 0, prefix: str = "synthetic") -> list[Prompt]:
    """``num_prompts`` prompts of ``prompt_len`` random ids in [256, vocab) (seeded), ``output_len`` each."""
    import torch

    if num_prompts < 1 or prompt_len < 1 or output_len < 1:
        raise WorkloadError(f"synthetic workload needs num_prompts, prompt_len, output_len >= 1, got "
                            f"{num_prompts}, {prompt_len}, {output_len}")
    low = SYNTHETIC_LOW_ID if vocab_size > 2 * SYNTHETIC_LOW_ID else 0
    gen = torch.Generator().manual_seed(int(seed))
    ids = torch.randint(low, vocab_size, (num_prompts, prompt_len), generator=gen)  # [num, len]
    return [Prompt(f"{prefix}/{i}", f"<{prompt_len} random tokens>", None, row.tolist(), output_len)
            for i, row in enumerate(ids)]


def _synthetic_count(src: dict, workload_cfg) -> int:
    n = src.get("num_prompts")
    if n is not None:
        return int(n)
    c = workload_cfg.get("concurrency")
    per_client = int(src.get("requests_per_client", 4))
    return max(int(src.get("min_prompts", 16)), per_client * int(c)) if c else int(src.get("min_prompts", 16))


def load_prompts(workload_cfg, tokenizer) -> list[Prompt]:
    chat = bool(workload_cfg.get("chat", True))
    prompts = []
    for src in workload_cfg["sources"]:
        if src.get("kind") == "synthetic":
            vocab = getattr(tokenizer, "vocab_size", None)
            if vocab is None:
                raise WorkloadError("workload kind synthetic needs the target's vocabulary size")
            prompts += synthetic_prompts(_synthetic_count(src, workload_cfg), int(src["prompt_len"]),
                                         int(src["output_len"]), int(vocab), int(src.get("seed", 0)))
            continue
        if getattr(tokenizer, "is_ids_only", False):
            raise WorkloadError(f"workload source {src.get('kind')!r} needs a tokenizer, and this "
                                "target (random weights) has none; use workload=synthetic")
        rows = _source_rows(src, workload_cfg)
        limit = src.get("limit")
        for pid, text, messages in rows[:limit] if limit is not None else rows:
            if messages is None and chat:
                messages = [{"role": "user", "content": text}]
            if messages is not None:
                ids = tokenizer.encode_chat(messages)
                text = text if text is not None else messages[-1]["content"]
            else:
                ids = tokenizer.encode(text)
            prompts.append(Prompt(pid, text, messages, ids))
    return _per_client(prompts, workload_cfg)


def _per_client(prompts: list[Prompt], workload_cfg) -> list[Prompt]:
    """``requests_per_client`` (closed loop): serve max(min_requests, requests_per_client x C)
    requests, cycling through the prompts (repeats get ids ``ID#1``, ``ID#2``, ...), so that every
    concurrency reaches steady state whatever the prompt set's size (80 MT-bench prompts at C = 256)."""
    rpc, c = workload_cfg.get("requests_per_client"), workload_cfg.get("concurrency")
    if not rpc or not c or not prompts or workload_cfg.get("mode", "closed") != "closed":
        return prompts
    n = max(int(workload_cfg.get("min_requests") or 0), int(rpc) * int(c))
    return [dataclasses.replace(prompts[i % len(prompts)], id=prompts[i % len(prompts)].id
                                + (f"#{i // len(prompts)}" if i >= len(prompts) else ""))
            for i in range(n)]
