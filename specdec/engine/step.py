"""The step: one forward over the decode batch, sampling, and commit; plus the KV extend (prefill).

``Stepper.decode_step_(k)`` is the only place tokens are sampled and ``seq_lens`` advance. At k = 0
request r feeds its pending token (T_r = 1) at position seq_lens[r] into slot seq_lens[r], samples
the next token, and commits it: seq_lens[r] += 1, pending[r] = the sampled token. Speculation
generalises this same step: the pending token becomes the root of a tree of T_r nodes in scratch
slots seq_lens[r] .. seq_lens[r] + T_r - 1, and commit advances by accepted length + 1.

``Stepper.prefill_(chunks)`` extends KV over committed tokens that have none yet (a prompt, or prompt
plus generated tokens after a preemption), chunk by chunk, always leaving the last committed token
pending. So a request's first output token comes from the decode step like every other token, and
prefill computes no logits at all.

Neither function knows about requests: inputs are :class:`DecodeState` rows and plain
:class:`PrefillChunk` lists. The decode step reads back one small tensor (the committed tokens);
nothing else on this path waits for the GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import SpecdecError
from ..models.ops import AttentionMeta
from .kv_cache import KVCache
from .state import DecodeState


class SpeculationUnavailable(SpecdecError, NotImplementedError):
    """The step was asked for k > 0 before speculative decoding exists in this build."""


def check_k(k: int) -> None:
    """Raise unless this build supports a step with k draft tokens (only k = 0 so far)."""
    if k != 0:
        raise SpeculationUnavailable(
            f"step with k={k} draft tokens: speculative decoding is not built yet; only k=0 "
            "(plain decode) is supported")


def sample_from_uniform(logits: torch.Tensor, temperature: float, u: torch.Tensor) -> torch.Tensor:
    """[B, V] logits, [B] uniforms in [0, 1) -> [B] int64 tokens; capturable in a CUDA graph.

    Temperature 0 is argmax (per row, so batching never changes the choice for a given row of
    logits). Otherwise an exact draw from softmax(logits / T) by inverting the CDF at u: one uniform
    per row, drawn outside the graph from the engine's seeded generator.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)  # [B]
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    cdf = probs.cumsum(dim=-1)  # [B, V]
    # First index whose CDF exceeds u * total: zero-probability tokens (flat CDF) are never hit.
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]  # [B]
    return tok.clamp_(max=logits.shape[-1] - 1)


def decode_body_(model, state: DecodeState, kv: KVCache, B: int, temperature: float) -> None:
    """The k = 0 step over state rows 0 .. B-1; rows >= state.num_active are padding.

    Padding rows get T_b = 0 (cu_q_lens repeats), kv_len 0 and slot -1, so they read and write no
    KV; their stale pending / seq_lens values are never read (append_rows_ overwrites a row before
    it is used again). Writes state.sampled[:B] and commits in place (pending, seq_lens).
    Everything is a device op on static buffers, so a CUDA graph can capture it per bucket B; the
    ~15 small ops here cost a few microseconds each inside a graph.
    """
    PS = kv.page_size
    valid = state.row_ids[:B] < state.num_active  # [B] bool
    pos = torch.where(valid, state.seq_lens[:B], 0)  # [B] int32; padding reads table column 0
    pos64 = pos.long()
    page = state.page_table[:B].gather(1, (pos64 // PS)[:, None])[:, 0]  # [B] int32
    slot = torch.where(valid, page * PS + pos64 % PS, -1)  # [B] int64
    cu = torch.zeros(B + 1, dtype=torch.int32, device=pos.device)  # [B+1]
    cu[1:] = torch.cumsum(valid, 0, dtype=torch.int32)
    meta = AttentionMeta(
        cu_q_lens=cu,
        kv_lens=pos + valid,  # [B] int32: prefix + the pending token; 0 for padding
        page_table=state.page_table[:B],  # [B, MP]
        slot_mapping=slot,
        max_q_len=1,
    )
    hidden = model(state.pending[:B], pos, meta, kv.k, kv.v).hidden  # [B, H]
    tok = sample_from_uniform(model.logits(hidden), temperature, state.uniform[:B])  # [B]
    # commit (k = 0: accepted length 0 + 1 token); padding rows' values are don't-care
    state.sampled[:B].copy_(tok)
    state.pending[:B].copy_(tok)
    state.seq_lens[:B].add_(valid)


@dataclass
class PrefillChunk:
    """Tokens at logical slots start .. start + len(token_ids) - 1 of one request."""

    token_ids: list[int]
    start: int  # = the request's seq_len before the chunk (its KV prefix)
    pages: list[int]  # the request's page list; must cover start + len(token_ids) slots


def prefill_inputs(chunks: list[PrefillChunk], page_size: int, device):
    """Host-built (input_ids [N], positions [N], AttentionMeta) for a batch of prefill chunks."""
    ids, pos, slots, cu, kv_lens = [], [], [], [0], []
    width = max(len(c.pages) for c in chunks)
    table = torch.zeros(len(chunks), width, dtype=torch.int32)  # [Bp, MPp] host
    for b, c in enumerate(chunks):
        n = len(c.token_ids)
        ids.extend(c.token_ids)
        pos.extend(range(c.start, c.start + n))
        slots.extend(c.pages[s // page_size] * page_size + s % page_size for s in range(c.start, c.start + n))
        cu.append(cu[-1] + n)
        kv_lens.append(c.start + n)
        table[b, : len(c.pages)] = torch.tensor(c.pages, dtype=torch.int32)

    def up(x, dtype):
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    meta = AttentionMeta(cu_q_lens=up(cu, torch.int32), kv_lens=up(kv_lens, torch.int32),
                         page_table=table.to(device, non_blocking=True), slot_mapping=up(slots, torch.int64),
                         max_q_len=max(len(c.token_ids) for c in chunks))
    return up(ids, torch.int64), up(pos, torch.int64), meta


class Stepper:
    """Runs prefill and decode steps over one model, KV cache and DecodeState.

    ``runner`` executes :func:`decode_body_` for n rows: eagerly, or by replaying the CUDA graph of
    the smallest bucket >= n (see :mod:`specdec.engine.graphs`).
    """

    def __init__(self, model, kv: KVCache, state: DecodeState, runner, *, temperature: float):
        if temperature < 0:
            raise SpecdecError(f"sampling.temperature must be >= 0, got {temperature}")
        self.model, self.kv, self.state, self.runner = model, kv, state, runner
        self.temperature = float(temperature)

    def prefill_(self, chunks: list[PrefillChunk]) -> None:
        """Write KV for every chunk in one forward (no logits). Mutates the KV cache only."""
        if not chunks:
            return
        ids, pos, meta = prefill_inputs(chunks, self.kv.page_size, self.kv.k.device)
        self.model(ids, pos, meta, self.kv.k, self.kv.v)

    def decode_step_(self, k: int = 0, launched=None) -> list[list[int]]:
        """One step over all state rows; returns the committed tokens of each row (k = 0: one each).

        Mutates KV slots seq_lens[r] (.. + T_r - 1), state.pending, state.seq_lens and the host
        mirror. The only GPU -> CPU transfer is the [num_rows] tensor of committed tokens.
        ``launched()``, if given, is called once the step's GPU work is queued, before that
        transfer waits for it (the engine records its timing event there).
        """
        check_k(k)
        st = self.state
        n = st.num_rows
        if n == 0:
            return []
        st.num_active.fill_(n)  # a kernel, not a sync
        if self.temperature > 0:
            st.uniform[:n].uniform_(generator=st.generator)
        self.runner.run_(n)
        if launched is not None:
            launched()
        tokens = st.sampled[:n].tolist()  # the one GPU -> CPU copy of the step
        st.commit_host_([1] * n)
        return [[t] for t in tokens]


class PhaseTimer:
    """Times prefill / decode phases without adding syncs: CUDA events read once they completed.

    ``start(step, name)`` / ``stop(step, name)`` bracket a phase of step ``step``. ``collect()``
    returns {step: {name: ms}} for steps whose events have all completed (after the decode step's
    token copy, every earlier event has). On the CPU the work is synchronous and wall time exact.
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._open: dict[tuple[int, str], object] = {}
        self._done: list[tuple[int, str, object, object]] = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self, step: int, name: str) -> None:
        self._open[(step, name)] = self._mark()

    def stop(self, step: int, name: str) -> None:
        self._done.append((step, name, self._open.pop((step, name)), self._mark()))

    def collect(self, wait: bool = False) -> dict[int, dict[str, float]]:
        """{step: {phase: ms}} of completed steps, oldest first (wait=True syncs: only at the end)."""
        out: dict[int, dict[str, float]] = {}
        pending: set[int] = set()
        for step, _, _, b in self._done:
            if self.cuda and not wait and not b.query():
                pending.add(step)
        keep = []
        for step, name, a, b in self._done:
            if step in pending:
                keep.append((step, name, a, b))
                continue
            if self.cuda:
                b.synchronize()  # no-op unless wait=True
                ms = a.elapsed_time(b)
            else:
                ms = (b - a) * 1e3
            out.setdefault(step, {})[name] = ms
        self._done = keep
        return out
