"""Training data for the draft head: the target's own answers, its features, the draft vocabulary.

- :func:`generate`: answers (or self-instruct tasks) written by the target through the serving
  engine, batched; a prompt the engine rejects (too long) comes back empty.
- :func:`capture`: one no-grad target forward per chunk of whole sequences (packed as a varlen
  prefill over a private paged KV cache) keeps, per token, the residual stream entering the draft's
  three target layers [3H], the final-normed hidden state [H] (teacher logits over the draft
  vocabulary are recomputed from it exactly, so no [N, vocab] tensor is ever stored) and the
  target's argmax. Storage: bf16 on the GPU (4.6 KB per token for SmolLM2), fp32 on the CPU.
- :func:`draft_vocab`: the most frequent answer tokens (plus special tokens), as target ids.
- :func:`length_batches` / :func:`gather_batch`: padded batches of similar-length sequences.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.ops import AttentionMeta
from .prompts import TrainingDataError


@dataclass
class Sequence:
    id: str
    source: str  # where the prompt came from: stdlib | self_instruct | seed | ...
    prompt_ids: list[int]  # the chat-templated prompt
    output_ids: list[int]  # the target's answer (EOS included when it stopped there)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def save_sequences(path: str | Path, seqs: list[Sequence]) -> None:
    with open(path, "w") as f:
        for s in seqs:
            f.write(json.dumps(dataclasses.asdict(s)) + "\n")


def load_sequences(path: str | Path) -> list[Sequence]:
    path = Path(path)
    if not path.is_file():
        raise TrainingDataError(f"train.data.reuse={path}: no such file (a sequences.jsonl written by "
                                "an earlier `python -m specdec.train` run)")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(Sequence(str(d["id"]), str(d["source"]), [int(t) for t in d["prompt_ids"]],
                                [int(t) for t in d["output_ids"]]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise TrainingDataError(f"{path}:{n}: not a sequence record ({e})") from e
    if not out:
        raise TrainingDataError(f"{path} holds no sequences")
    return out


# ----------------------------------------------------------------------------------------------
# Generation through the engine
# ----------------------------------------------------------------------------------------------

def generate(model, prompts: list[list[int]], max_new_tokens: int, *, engine_config, eos_ids,
             time_budget_s: float | None = None, title: str = "generating") -> list[list[int]]:
    """Output ids per prompt (in order) from one engine run over all prompts.

    ``engine_config``: an EngineConfig (its temperature and seed decide the sampling). The KV
    pool, unless set, is sized for max_batch_size requests of the longest prompt + max_new_tokens,
    not a fraction of free GPU memory: the captured features need that memory afterwards.
    ``time_budget_s``: stop stepping after this long; requests in flight keep the tokens they
    have (a prefix of the target's answer is still the target's text), queued ones come back empty.
    """
    from ..bench.metrics import LiveProgress
    from ..engine.engine import Engine

    cfg = engine_config
    if cfg.kv_cache_tokens is None:
        longest = max((len(p) for p in prompts), default=1) + max_new_tokens + 16
        cfg = dataclasses.replace(cfg, kv_cache_tokens=min(len(prompts), cfg.max_batch_size) * longest)
    t0 = time.perf_counter()
    with LiveProgress(len(prompts), title) as live:
        engine = Engine(model, cfg, eos_ids=eos_ids, trace=live.on_step)
        reqs = [engine.add_request(p, max_new_tokens) for p in prompts]
        while engine.has_work():
            for _ in engine.step():
                live.on_request(None)
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                unfinished = sum(not r.finished for r in reqs)
                print(f"[train] {title}: time budget {time_budget_s:.0f} s reached, {unfinished} of "
                      f"{len(reqs)} requests unfinished (partial answers kept)", file=sys.stderr)
                break
    out = [[] if r.error else list(r.output_ids) for r in reqs]
    del engine
    if model.device.type == "cuda":
        torch.cuda.empty_cache()  # hand the KV pool back before the features are stored
    return out


# ----------------------------------------------------------------------------------------------
# Feature capture
# ----------------------------------------------------------------------------------------------

@dataclass
class FeatureStore:
    """All sequences concatenated; sequence s is rows starts[s] : starts[s] + lengths[s]."""

    tokens: torch.Tensor  # [N] int64
    features: torch.Tensor  # [N, 3H] residual stream entering the captured target layers
    final_hidden: torch.Tensor  # [N, H] target's final-normed hidden (teacher = this @ W_vocab^T)
    argmax: torch.Tensor  # [N] int64, the target's greedy next token at each position
    starts: torch.Tensor  # [S] int64
    lengths: torch.Tensor  # [S] int64
    prompt_lens: torch.Tensor  # [S] int64

    @property
    def num_seqs(self) -> int:
        return self.lengths.numel()

    def subset(self, idx: list[int]) -> "FeatureStore":
        """A view over some sequences (rows are shared, not copied)."""
        sel = torch.as_tensor(idx, dtype=torch.long)
        return dataclasses.replace(self, starts=self.starts[sel], lengths=self.lengths[sel],
                                   prompt_lens=self.prompt_lens[sel])

    def answer_tokens(self) -> int:
        return int((self.lengths - self.prompt_lens).sum())


def _pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive sequence indices grouped so each group holds at most ``budget`` tokens (a
    longer sequence gets a group of its own)."""
    groups, cur, n = [], [], 0
    for i, length in enumerate(lengths):
        if cur and n + length > budget:
            groups.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += length
    if cur:
        groups.append(cur)
    return groups


@torch.no_grad()
def capture(model, seqs: list[list[int]], prompt_lens: list[int], layers, *, chunk_tokens: int = 16384,
            store_device=None, store_dtype=None, page_size: int = 16, progress=None) -> FeatureStore:
    """Run the target over every sequence and keep what training needs (see the module docstring).

    ``progress(n_tokens)`` is called after each chunk.
    """
    dev = model.device
    store_device = dev if store_device is None else torch.device(store_device)
    store_dtype = model.dtype if store_dtype is None else store_dtype
    lengths = [len(s) for s in seqs]
    N = sum(lengths)
    H = model.config.hidden_size
    features = torch.empty(N, len(layers) * H, dtype=store_dtype, device=store_device)
    final_hidden = torch.empty(N, H, dtype=store_dtype, device=store_device)
    argmax = torch.empty(N, dtype=torch.long, device=store_device)
    tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=store_device)
    starts = torch.zeros(len(seqs), dtype=torch.long)
    starts[1:] = torch.tensor(lengths[:-1], dtype=torch.long).cumsum(0)
    groups = _pack(lengths, chunk_tokens)
    most = max(sum(lengths[i] for i in g) for g in groups)
    pages = most // page_size + max(len(g) for g in groups)  # each sequence starts on a fresh page
    k_cache, v_cache = model.new_kv_cache(pages, page_size)
    for g in groups:
        lens = [lengths[i] for i in g]
        n_pages = [-(-n // page_size) for n in lens]
        first = torch.tensor([0] + n_pages[:-1]).cumsum(0)  # first page of each sequence
        width = max(n_pages)
        # [B, width]; entries past a sequence's own pages are never read, clamped to stay in range
        table = (first[:, None] + torch.arange(width)[None, :]).clamp(max=pages - 1).to(torch.int32)
        pos = torch.cat([torch.arange(n) for n in lens])  # [n] position within its sequence
        seq_of = torch.repeat_interleave(torch.arange(len(g)), torch.tensor(lens))  # [n]
        slots = (first[seq_of] * page_size + pos).long()  # pages are consecutive per sequence
        cu = torch.zeros(len(g) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lens).cumsum(0)
        meta = AttentionMeta(cu_q_lens=cu.to(dev), kv_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                             page_table=table.to(dev), slot_mapping=slots.to(dev), max_q_len=max(lens))
        lo, hi = int(starts[g[0]]), int(starts[g[-1]]) + lens[-1]
        out = model(tokens[lo:hi].to(dev), pos.to(dev), meta, k_cache, v_cache, capture_layers=tuple(layers))
        features[lo:hi] = out.captured.to(store_device, store_dtype)
        final_hidden[lo:hi] = out.hidden.to(store_device, store_dtype)
        for a in range(lo, hi, 4096):  # [4096, vocab] logits at a time
            b = min(a + 4096, hi)
            argmax[a:b] = model.logits(out.hidden[a - lo:b - lo]).argmax(-1).to(store_device)
        if progress is not None:
            progress(hi - lo)
    del k_cache, v_cache
    return FeatureStore(tokens, features, final_hidden, argmax, starts,
                        torch.tensor(lengths, dtype=torch.long), torch.tensor(prompt_lens, dtype=torch.long))


# ----------------------------------------------------------------------------------------------
# Draft vocabulary
# ----------------------------------------------------------------------------------------------

def draft_vocab(seqs: list[list[int]], prompt_lens: list[int], size: int, vocab_size: int,
                always=()) -> tuple[torch.Tensor, float]:
    """(target ids of the draft vocabulary, sorted ascending [size]; share of answer tokens it covers).

    Ranking: ``always`` ids first (special / EOS tokens), then by frequency among answer tokens,
    ties broken by frequency in prompts, then by id; ids never seen fill the rest in id order.
    """
    if not 0 < size <= vocab_size:
        raise TrainingDataError(f"train.draft_vocab_size={size}: must be in 1..{vocab_size} (the target's vocabulary)")
    # One bincount over all answer (prompt) tokens, not one per sequence: 70K sequences take seconds less.
    ans = torch.bincount(torch.tensor([t for s, p in zip(seqs, prompt_lens) for t in s[p:]], dtype=torch.long),
                         minlength=vocab_size)[:vocab_size]
    prm = torch.bincount(torch.tensor([t for s, p in zip(seqs, prompt_lens) for t in s[:p]], dtype=torch.long),
                         minlength=vocab_size)[:vocab_size]
    forced = torch.zeros(vocab_size, dtype=torch.bool)
    forced[[int(a) for a in always if 0 <= int(a) < vocab_size]] = True
    # Lexicographic (forced, answer count, prompt count, -id) via stable sorts, least key first.
    order = torch.arange(vocab_size)
    for key in (prm, ans, forced.long()):
        order = order[torch.sort(key[order], descending=True, stable=True).indices]
    ids = order[:size].sort().values
    total = int(ans.sum())
    coverage = float(ans[ids].sum()) / total if total else 0.0
    return ids, coverage


# ----------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------

def length_batches(lengths: list[int], batch_tokens: int, rng: random.Random, pool: int = 64) -> list[list[int]]:
    """Sequence indices in batches of similar length, each with batch size x longest length <=
    ``batch_tokens`` (a longer sequence alone). Shuffled, then sorted by length within pools of
    ``pool`` x the typical batch, so padding stays small and batches differ across epochs."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    mean = max(1, sum(lengths) // max(1, len(lengths)))
    chunk = max(1, pool * max(1, batch_tokens // mean))
    batches = []
    for c in range(0, len(order), chunk):
        part = sorted(order[c:c + chunk], key=lambda i: lengths[i])
        cur: list[int] = []
        for i in part:
            if cur and (len(cur) + 1) * max(lengths[i], lengths[cur[-1]]) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] int64 (0 past each length)
    features: torch.Tensor  # [B, T, 3H]
    teacher_hidden: torch.Tensor  # [B, T, H]
    argmax: torch.Tensor  # [B, T]
    lengths: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def gather_batch(store: FeatureStore, idx: list[int], device) -> Batch:
    """Sequences ``idx`` of ``store`` padded to the longest, on ``device``."""
    sel = torch.as_tensor(idx, dtype=torch.long)
    lengths, starts, plens = store.lengths[sel], store.starts[sel], store.prompt_lens[sel]
    T = int(lengths.max())
    j = torch.arange(T)[None, :]  # [1, T]
    rows = (starts[:, None] + torch.minimum(j, lengths[:, None] - 1)).to(store.tokens.device)  # [B, T]
    pad = (j >= lengths[:, None]).to(store.tokens.device)
    return Batch(tokens=store.tokens[rows].masked_fill(pad, 0).to(device),
                 features=store.features[rows].to(device, non_blocking=True),
                 teacher_hidden=store.final_hidden[rows].to(device, non_blocking=True),
                 argmax=store.argmax[rows].to(device),
                 lengths=lengths.to(device), prompt_lens=plens.to(device))
