"""Single-request reference decoding: the simplest correct loop, the ground truth for tests.

Every optimised path (batched engine, speculative decoding at any k) must reproduce its greedy
output token for token. It uses one request, pages 0..n-1 in order and no CUDA graphs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..models.llama import LlamaModel
from ..models.ops import AttentionMeta
from ..spec.sampling import sample


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "eos" | "length"
    ttft_s: float
    token_times_s: list[float] = field(default_factory=list)  # wall time of each output token


def _meta(start: int, n: int, page_table: torch.Tensor, page_size: int) -> AttentionMeta:
    dev = page_table.device
    slots = torch.arange(start, start + n, device=dev)
    phys = page_table[0, slots // page_size].long() * page_size + slots % page_size
    return AttentionMeta(
        cu_q_lens=torch.tensor([0, n], dtype=torch.int32, device=dev),
        kv_lens=torch.tensor([start + n], dtype=torch.int32, device=dev),
        page_table=page_table, slot_mapping=phys, max_q_len=n)


@torch.no_grad()
def generate_reference(model: LlamaModel, prompt_ids: list[int], max_new_tokens: int, *,
                       eos_ids=(), temperature: float = 0.0, generator=None,
                       page_size: int = 16) -> Generation:
    dev = model.device
    total = len(prompt_ids) + max_new_tokens
    pages = -(-total // page_size)
    k_cache, v_cache = model.new_kv_cache(pages, page_size)
    page_table = torch.arange(pages, dtype=torch.int32, device=dev)[None]  # [1, pages]
    t0 = time.perf_counter()
    ids = torch.tensor(prompt_ids, device=dev)
    pos = torch.arange(len(prompt_ids), device=dev)
    out = model(ids, pos, _meta(0, len(prompt_ids), page_table, page_size), k_cache, v_cache)
    logits = model.logits(out.hidden[-1:])
    tokens: list[int] = []
    times: list[float] = []
    eos = set(eos_ids)
    finish = "length"
    while True:
        tok = int(sample(logits, temperature, generator)[0])
        tokens.append(tok)
        times.append(time.perf_counter() - t0)
        if tok in eos:
            finish = "eos"
            break
        if len(tokens) >= max_new_tokens:
            break
        n = len(prompt_ids) + len(tokens) - 1  # position of the new token
        out = model(torch.tensor([tok], device=dev), torch.tensor([n], device=dev),
                    _meta(n, 1, page_table, page_size), k_cache, v_cache)
        logits = model.logits(out.hidden)
    return Generation(tokens, finish, times[0], times)
