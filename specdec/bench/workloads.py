"""Workloads: lists of prompts from MT-bench, HumanEval, a JSONL file, or synthetic lengths.

A workload config has ``sources`` (each ``{kind, limit}``), ``chat`` (``auto``: wrap prompts in the
target's chat template when it has one, else send them raw; ``true``: the template, required;
``false``: raw) and, for ``kind: jsonl``, ``path``. Every prompt becomes a :class:`Prompt` with its token ids.
A jsonl line may carry its own sampling parameters, ``"sampling": {"temperature": 1.0, "top_p": 0.9}``
(any of specdec.spec.sampling.KEYS, over the run's ``sampling``); the engine checks them when the
request arrives, so a bad value fails that request alone, with an error naming the key.

``kind: synthetic`` makes ``num_prompts`` prompts of ``prompt_len`` random token ids (seeded), each
asking for exactly ``output_len`` tokens (set ``ignore_eos: true`` on the workload so EOS does not
end them early): fixed shapes for throughput studies, and the only workload a random-weight target
(no tokenizer) can run. ``num_prompts: null`` scales with the closed-loop concurrency C
(``requests_per_client`` x C, at least ``min_prompts``) so every C runs in steady state.
``kind: synthetic`` with ``lengths: FILE`` and ``set: NAME`` takes the prompt (and, unless
``output_len`` is set, output) lengths and the ids of a real prompt set from a lengths file
(``pkg://specdec/data/prompt_lengths_smollm2.json``, installed with the package: HumanEval and MT-bench as
SmolLM2's chat template tokenises them), with random ids of the target's vocabulary: real-length requests for
a random-weight target, whose ids match a replayed acceptance trace's per-request sequences.
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
    sampling: dict | None = None  # its own sampling parameters (a jsonl line's "sampling"), as written


def read_jsonl_prompts(path: str | Path) -> list[tuple[str, str | None, list[dict] | None, object]]:
    """Lines ``{"id", "prompt"}`` or ``{"id", "messages"}``, each with an optional ``"sampling"``
    -> (id, prompt, messages, sampling or None). The sampling value is kept as written: the engine
    validates it per request (a bad one fails its request alone)."""
    path = Path(path)
    if path.is_dir():
        raise WorkloadError(f"workload file {path} is a directory; workload.path must name a JSONL file")
    if not path.is_file():
        raise WorkloadError(f"workload file {path} does not exist")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise WorkloadError(f"{path}:{lineno}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                            f"{e.start}); workload files must be UTF-8 encoded JSONL") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
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
        prompt, messages, sampling = obj.get("prompt"), obj.get("messages"), obj.get("sampling")
        if isinstance(prompt, str) and messages is None:
            rows.append((pid, prompt, None, sampling))
        elif prompt is None and isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            rows.append((pid, None, messages, sampling))
        else:
            raise WorkloadError(f"{where}: needs exactly one of 'prompt' (a string) or 'messages' "
                                "(a list of {role, content} strings)")
    if not rows:
        raise WorkloadError(f"workload file {path} holds no prompts")
    return rows


def _source_rows(src: dict, workload_cfg) -> list[tuple[str, str | None, list[dict] | None, object]]:
    from ..assets import prompts_dir

    kind = src.get("kind")
    if kind == "mt_bench":
        lines = (prompts_dir() / "mt_bench.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        return [(r["id"], r["turns"][0], None, None) for r in rows]
    if kind == "humaneval":
        lines = (prompts_dir() / "humaneval.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        return [(r["id"], r["prompt"], None, None) for r in rows]
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


def length_prompts(src, vocab_size: int) -> list[Prompt]:
    """Synthetic prompts with a real prompt set's lengths and ids (``lengths: FILE``, ``set: NAME``;
    ``limit``; ``output_len``: null = the file's, else this for every prompt; ``seed``)."""
    import torch

    from ..data import resolve

    path = resolve(str(src["lengths"]))  # pkg://specdec/data/NAME: a file installed with the package
    if not path.is_file():
        raise WorkloadError(f"workload lengths file {src['lengths']} does not exist (write one with "
                            "`python -m specdec.acceptance lengths RUN_DIRS -o FILE`)")
    try:
        sets = json.loads(path.read_text())["sets"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise WorkloadError(f"{path}: not a lengths file ({e}); expected {{\"sets\": {{NAME: [{{id, prompt_len, "
                            "output_len}}, ...]}}}}") from None
    name = src.get("set")
    if name not in sets:
        raise WorkloadError(f"workload lengths set {name!r} is not in {path}; sets: {sorted(sets)}")
    rows = sets[name][: src.get("limit")] if src.get("limit") is not None else sets[name]
    low = SYNTHETIC_LOW_ID if vocab_size > 2 * SYNTHETIC_LOW_ID else 0
    gen = torch.Generator().manual_seed(int(src.get("seed") or 0))
    out_len = src.get("output_len")
    prompts = []
    for r in rows:
        n, m = int(r["prompt_len"]), int(out_len if out_len is not None else r.get("output_len") or 128)
        if n < 1 or m < 1:
            raise WorkloadError(f"{path}: set {name}, id {r.get('id')}: prompt_len and output_len must be >= 1")
        ids = torch.randint(low, vocab_size, (n,), generator=gen).tolist()
        prompts.append(Prompt(str(r["id"]), f"<{n} random tokens: the length of {r['id']}>", None, ids, m))
    return prompts


def _synthetic_count(src: dict, workload_cfg) -> int:
    n = src.get("num_prompts")
    if n is not None:
        return int(n)
    c = workload_cfg.get("concurrency")
    per_client = int(src.get("requests_per_client", 4))
    return max(int(src.get("min_prompts", 16)), per_client * int(c)) if c else int(src.get("min_prompts", 16))


CHAT_VALUES = ("auto", True, False)


def resolve_chat(workload_cfg, tokenizer) -> bool:
    """workload.chat (auto | true | false) -> whether text prompts are wrapped in the chat template."""
    chat = workload_cfg.get("chat", "auto")
    if isinstance(chat, str) and chat.lower() in ("true", "false"):
        chat = chat.lower() == "true"
    if chat not in CHAT_VALUES or isinstance(chat, int) and not isinstance(chat, bool):
        raise WorkloadError(f"workload.chat={chat!r}; valid: auto (the chat template when the tokenizer has "
                            "one, else raw prompts), true, false")
    if chat == "auto":
        return bool(getattr(tokenizer, "chat_template", None))
    return chat


def load_prompts(workload_cfg, tokenizer) -> list[Prompt]:
    chat = resolve_chat(workload_cfg, tokenizer)
    prompts = []
    for src in workload_cfg["sources"]:
        if src.get("kind") == "synthetic":
            vocab = getattr(tokenizer, "vocab_size", None)
            if vocab is None:
                raise WorkloadError("workload kind synthetic needs the target's vocabulary size")
            if src.get("lengths"):
                prompts += length_prompts(src, int(vocab))
                continue
            prompts += synthetic_prompts(_synthetic_count(src, workload_cfg), int(src["prompt_len"]),
                                         int(src["output_len"]), int(vocab), int(src.get("seed", 0)))
            continue
        if getattr(tokenizer, "is_ids_only", False):
            raise WorkloadError(f"workload source {src.get('kind')!r} needs a tokenizer, and this "
                                "target (random weights) has none; use workload=synthetic")
        rows = _source_rows(src, workload_cfg)
        limit = src.get("limit")
        for pid, text, messages, sampling in rows[:limit] if limit is not None else rows:
            if messages is None and chat:
                messages = [{"role": "user", "content": text}]
            if messages is not None:
                ids = tokenizer.encode_chat(messages)
                text = text if text is not None else messages[-1]["content"]
            else:
                ids = tokenizer.encode(text)
            prompts.append(Prompt(pid, text, messages, ids, sampling=sampling))
    seen, dups = set(), []
    for p in prompts:
        if p.id in seen and p.id not in dups:
            dups.append(p.id)
        seen.add(p.id)
    if dups:
        shown = ", ".join(repr(d) for d in dups[:10]) + (f" and {len(dups) - 10} more" if len(dups) > 10 else "")
        raise WorkloadError(f"duplicate prompt ids in the workload: {shown}; every request needs its own id "
                            "(records and aborts are keyed by it)")
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
