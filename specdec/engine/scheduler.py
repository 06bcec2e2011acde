"""Continuous batching: requests, admission, chunked prefill, preemption, finishing.

The scheduler owns every :class:`Request` and is the only code that changes one. Per engine
iteration (see :meth:`specdec.engine.engine.Engine.step`):

1. ``ensure_decode_capacity_(ahead)``: every decode row gets pages for seq_len + ahead slots (what
   this iteration's step and a step still in flight can write: 1 per step at k = 0, the tree at
   k > 0), so the step itself never allocates. If the pool runs dry, the most recently admitted request is
   preempted: its pages are freed, and it waits at the head of the queue to be recomputed later
   (re-prefill of prompt + generated tokens; its output so far is kept). The oldest request is
   never preempted for a newer one, so the batch always makes progress.
2. ``admit_``: first come, first served: the head of the waiting queue is admitted while there is a
   free row (admitted < max_batch_size) and pages for its whole prefill plus its first step.
3. ``plan_prefill``: up to ``prefill_chunk`` prompt tokens per iteration, oldest request first
   (a long prompt spans several iterations; decodes of others keep running in between).
4. The engine runs the prefill forward, then ``finish_prefill_`` moves requests whose KV now covers
   all committed tokens but the last into decode rows of the DecodeState.
5. The engine runs the decode step, then ``commit_tokens_`` appends the committed tokens and
   finishes requests on EOS, max_new_tokens or a stop string; their rows leave the batch and their
   pages return to the pool. With overlapped decoding the engine queues the step and commits the
   previous one, and max_tree_tokens covers two steps. The commit is all or nothing: every row's
   outcome is worked out before any request changes, so an exception leaves every request as it
   was (the engine commits the same step again); a request whose own stop-string check raises
   fails alone (finish_reason "error"), the others commit.

A request is checked once, when it arrives (``rejection``): its prompt must be integer token ids
of the target's vocabulary (and the drafter's, where it has its own), its id unique among the
requests queued or running. A rejected request finishes at once with ``error`` naming the bad
input, and never reaches a forward.

Prefill and decode run as two forwards per iteration (prefill eager over the packed chunks, decode
through the CUDA graph of its batch bucket) rather than one mixed forward: the decode stays a fixed
shape that graphs can capture, and prefill needs no logits. A request whose prefill completes in an
iteration decodes its first token in that same iteration.
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..errors import ConfigError
from .kv_cache import KVCache, OutOfPages, pages_for
from .state import DecodeState
from .step import PrefillChunk


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and waiting for recompute)
    PREFILL = "prefill"  # admitted, KV being written chunk by chunk
    DECODE = "decode"  # in a DecodeState row
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: a request is a KV page owner and a dict key
class Request:
    id: str
    prompt_ids: list[int]
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate exactly max_new_tokens (synthetic benchmarks)
    arrival_s: float = 0.0  # time.perf_counter() when added
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    seq_len: int = 0  # committed tokens whose KV is written (host truth)
    draft_len: int = 0  # of those, the prefix whose draft KV is written too (prefill; then its row's
    # draft_lens_host): behind seq_len after prefill chunks run while speculation was off
    finish_reason: str | None = None  # eos | length | stop | abort | error
    error: str | None = None
    admitted_s: float | None = None  # first admission
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # perf_counter of each output token
    num_preemptions: int = 0
    row_epoch: int = 0  # bumped each time the request gets a decode row (overlapped decoding)
    sampling: tuple | None = None  # its own (temperature, top_k, top_p, min_p) row; None: the engine's
    # Acceptance statistics of each speculative step it committed in ([drafted depth, draft nodes,
    # accepted sibling rank at depth 1, ...]; kernels_triton/accept_stats.py), summed when it finishes
    accept_stats: list = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """All committed tokens: prompt then output."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


class Scheduler:
    """Queues and batch membership; see the module docstring for the per-iteration protocol.

    Args:
        kv: the page pool (requests are its page owners).
        state: the device batch; row r holds ``self.rows[r]``.
        max_batch_size: most admitted requests (prefilling + decoding) at once.
        prefill_chunk: prompt tokens per prefill forward.
        max_seq_len: longest prompt + output a request may have (position bound).
        max_tree_tokens: the most slots a decode row may hold past its committed tokens: the
            largest step (k = 0: 1, the pending token), twice that with overlapped decoding (a step
            in flight); bounds what a request needs (``rejection``). Rows hold only what the
            current steps need (``ensure_decode_capacity_``'s ``ahead``), so speculation that is
            configured but off holds no extra pages.
        detokenize: ids -> text, needed only for stop strings.
        vocab_size: prompt ids must lie in 0 .. vocab_size - 1 (None: unchecked).
        vocab_name: what that vocabulary is, for the error message.
    """

    def __init__(self, kv: KVCache, state: DecodeState, *, max_batch_size: int, prefill_chunk: int,
                 max_seq_len: int, max_tree_tokens: int = 1,
                 detokenize: Callable[[list[int]], str] | None = None,
                 vocab_size: int | None = None, vocab_name: str = "the target's"):
        if prefill_chunk < 1:
            raise ConfigError(f"engine.prefill_chunk={prefill_chunk}: must be an integer >= 1 "
                              "(prompt tokens per prefill forward)")
        self.kv, self.state = kv, state
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.max_seq_len = max_seq_len
        self.max_tree_tokens = max_tree_tokens
        self.detokenize = detokenize
        self.waiting: deque[Request] = deque()
        self.admitted: list[Request] = []  # PREFILL and DECODE, in admission order
        self.rows: list[Request] = []  # rows[r] is in DecodeState row r
        self.finished: list[Request] = []  # finished since the engine last collected them
        self.num_preemptions = 0
        self.undrafted_prefill_tokens = 0  # prompt tokens of prefill forwards that skipped the draft
        self._ids = itertools.count()
        self.vocab_size, self.vocab_name = vocab_size, vocab_name
        self._live: dict[str, Request] = {}  # id -> request, queued or running (ids are unique here)

    # -- requests in and out ----------------------------------------------------------------------
    def check_ids(self, prompt_ids) -> tuple[list[int], str | None]:
        """(the prompt as a list of ints, why it is invalid or None). Integers only: a float, bool
        or string id is refused, not truncated; each must lie in 0 .. vocab_size - 1 (a negative id
        would silently read another embedding row, one past the end fails every later forward)."""
        try:
            raw = list(prompt_ids)
        except TypeError:
            return [], f"prompt_ids must be a list of integer token ids, got {type(prompt_ids).__name__}"
        V = self.vocab_size
        # Fast path (C-level loops; the Python loop below took 53 us per 130-token prompt on a 2-core
        # CPU, 5 us this way, paid between steps): plain ints within the vocabulary. Anything else
        # takes the loop that names the bad token.
        if raw and set(map(type, raw)) == {int} and min(raw) >= 0 and (V is None or max(raw) < V):
            return raw, None
        ids = []
        for pos, t in enumerate(raw):
            try:
                if isinstance(t, bool):
                    raise TypeError
                v = operator.index(t)  # ints, numpy / torch integers; not floats, not strings
            except TypeError:
                return raw, (f"prompt token at position {pos} is {t!r} ({type(t).__name__}): token ids "
                             "must be integers")
            if v < 0 or (V is not None and v >= V):
                valid = "0 or more" if V is None else f"0 .. {V - 1}"
                return raw, (f"prompt token id {v} at position {pos} is outside {self.vocab_name} "
                             f"vocabulary of {V} ids (valid: {valid})")
            ids.append(v)
        return ids, None

    def rejection(self, prompt_ids: list[int], max_new_tokens: int, stop) -> str | None:
        """Why a request can never run, or None. Checked once, when it arrives."""
        n = len(prompt_ids)
        if n == 0:
            return "empty prompt: a request needs at least one prompt token"
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            return f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1"
        if max_new_tokens < 1:
            return f"max_new_tokens={max_new_tokens}: must be >= 1"
        if n + max_new_tokens > self.max_seq_len:
            return (f"prompt of {n} tokens + max_new_tokens {max_new_tokens} exceeds the maximum "
                    f"sequence length of {self.max_seq_len} positions")
        # At its last step a request holds KV for n + max_new - 2 committed tokens + the step's slots.
        need = pages_for(n + max_new_tokens - 1 + self.max_tree_tokens, self.kv.page_size)
        if need > self.kv.num_pages:
            return (f"prompt of {n} tokens + max_new_tokens {max_new_tokens} needs {need} KV pages, "
                    f"more than the whole cache ({self.kv.num_pages} pages of {self.kv.page_size} "
                    f"slots); raise engine.kv_cache_tokens or shorten the request")
        if stop and self.detokenize is None:
            return "stop strings need a tokenizer to detokenize the output; this engine has none"
        return None

    def add_(self, req: Request, error: str | None = None) -> None:
        """Queue ``req``; a request that can never run (bad token ids, a duplicate id, too long, or
        ``error``: what the engine found wrong with it, e.g. its sampling parameters) finishes at once
        with ``error`` set."""
        req.prompt_ids, why = self.check_ids(req.prompt_ids)
        if why is None:
            why = error
        if why is None and req.id in self._live:
            why = (f"duplicate request id {req.id!r}: a request with this id is already queued or "
                   "running (ids must be unique)")
        if why is None:
            why = self.rejection(req.prompt_ids, req.max_new_tokens, req.stop)
        if why is not None:
            req.error = why
            req.status = Status.FINISHED
            req.finish_reason, req.finish_s = "error", req.arrival_s
            self.finished.append(req)
            return
        self._live[req.id] = req
        self.waiting.append(req)

    def abort_(self, request_id: str, now: float) -> bool:
        """Finish request ``request_id`` with reason "abort", freeing its pages; False if unknown."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                self._finish_(req, "abort", now)
                return True
        for req in self.admitted:
            if req.id == request_id:
                self._leave_batch_([req])
                self._finish_(req, "abort", now)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.admitted)

    def pop_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    # -- per-iteration protocol -------------------------------------------------------------------
    def ensure_decode_capacity_(self, ahead: int | None = None) -> int:
        """Give every decode row pages for ``ahead`` slots past its committed tokens (default
        max_tree_tokens), preempting if needed; returns preemptions."""
        preempted = 0
        ps, t = self.kv.page_size, self.max_tree_tokens if ahead is None else int(ahead)
        while True:
            rows, cols, pages = [], [], []
            short = False
            for r, req in enumerate(self.rows):
                held = len(self.kv.pages(req))
                if req.seq_len + t <= held * ps:
                    continue  # the common case: a page boundary is crossed once every ps tokens
                try:
                    new = self.kv.reserve_(req, req.seq_len + t)
                except OutOfPages:
                    short = True
                    break
                rows += [r] * len(new)
                cols += range(held, held + len(new))
                pages += new
            self.state.set_pages_(rows, cols, pages)  # before any preemption renumbers rows
            if not short:
                return preempted
            if len(self.admitted) == 1:  # unreachable: rejection() guarantees one request fits alone
                raise RuntimeError(f"request {self.admitted[0].id} alone does not fit the KV cache")
            self._preempt_(self.admitted[-1])
            preempted += 1

    def admit_(self, now: float) -> int:
        """Admit waiting requests FCFS while a row and their pages are free; returns how many."""
        n = 0
        while self.waiting and len(self.admitted) < self.max_batch_size:
            req = self.waiting[0]
            # Pages for every committed token but the pending one, plus a k = 0 step's slot (a
            # speculative step tops it up: ensure_decode_capacity_ before it launches).
            slots = req.num_tokens - 1 + 1
            if self.kv.pages_needed(req, slots) > self.kv.num_free:
                break  # FCFS: later requests do not overtake the head
            self.kv.reserve_(req, slots)
            self.waiting.popleft()
            req.status = Status.PREFILL
            if req.admitted_s is None:
                req.admitted_s = now
            self.admitted.append(req)
            n += 1
        return n

    def plan_prefill(self, fit=None) -> list[tuple[Request, int]]:
        """(request, chunk length) pairs for this iteration, oldest first, within prefill_chunk.
        ``fit(n) -> m <= n``: prefill only the first m of the n planned tokens (the newest chunks
        shortened or left out; their requests stay in prefill), e.g. a padded runner's fit_tokens."""
        budget = self.prefill_chunk
        plan = []
        for req in self.admitted:
            if budget == 0:
                break
            if req.status is not Status.PREFILL:
                continue
            remaining = req.num_tokens - 1 - req.seq_len  # the last committed token stays pending
            if remaining > 0:
                c = min(remaining, budget)
                plan.append((req, c))
                budget -= c
        if fit is not None and plan:
            left = fit(sum(c for _, c in plan))
            kept = []
            for req, c in plan:
                if left <= 0:
                    break
                kept.append((req, min(c, left)))
                left -= c
            plan = kept
        return plan

    def prefill_chunks(self, plan: list[tuple[Request, int]]) -> list[PrefillChunk]:
        chunks = []
        for req, c in plan:
            toks = req.tokens[req.seq_len : req.seq_len + c]
            # Only the pages the chunk's attention reads (slots < seq_len + c): the page-table width
            # sets attention's split count, so the prefill's arithmetic must not depend on how far
            # ahead the request holds pages (e.g. two steps with overlapped decoding).
            pages = self.kv.pages(req)[: pages_for(req.seq_len + c, self.kv.page_size)]
            chunks.append(PrefillChunk(toks, req.seq_len, list(pages), next_token=req.tokens[req.seq_len + c]))
        return chunks

    def finish_prefill_(self, plan: list[tuple[Request, int]], drafted: bool = True) -> list[tuple[Request, int]]:
        """Account the prefill forward and move fully prefilled requests into decode rows.

        ``drafted``: the forward ran the drafter's prefill too; a chunk's draft KV counts only if
        it continues the request's draft prefix (a chunk after one that skipped the draft wrote
        draft KV over missing history: the catch-up rewrites it). Returns (request, row) for each
        request that became decode-ready; its row's draft length is the request's draft_len."""
        for req, c in plan:
            if not drafted:
                self.undrafted_prefill_tokens += c
            elif req.draft_len == req.seq_len:
                req.draft_len += c
            req.seq_len += c
        ready = [r for r in self.admitted
                 if r.status is Status.PREFILL and r.seq_len == r.num_tokens - 1]
        rows: list[int] = []
        if ready:
            rows = self.state.append_rows_([r.tokens[-1] for r in ready], [r.seq_len for r in ready],
                                           [list(self.kv.pages(r)) for r in ready],
                                           draft_lens=[r.draft_len for r in ready],
                                           sampling=[r.sampling for r in ready])
            for r in ready:
                r.status = Status.DECODE
                r.row_epoch += 1
            self.rows.extend(ready)
        return list(zip(ready, rows))

    def commit_tokens_(self, launched_rows: list[tuple[Request, int]], tokens: list[list[int]],
                       now: float, drafted: bool = True, stats: list | None = None) -> list[list[int]]:
        """Commit the tokens of a step launched over ``launched_rows`` ((request, row_epoch) per
        row at launch): append them, finish and evict done requests, advance the host mirror of
        seq_lens. With overlapped decoding the batch may have changed since the launch: tokens of
        a request that finished, was aborted or preempted (or re-admitted: a new epoch) since are
        dropped; that step's work for it was wasted, and stayed within its pages (the scheduler
        reserves two steps ahead). Returns the token lists it committed (rows still in the batch).

        All or nothing: each row's outcome (tokens kept, finish reason) is worked out first and
        only then applied, so an exception leaves every request unchanged and the same step can be
        committed again. A request whose stop-string check raises (its detokenizer failing on its
        tokens) is the exception: it alone finishes with reason "error". ``drafted``: the step extended
        the draft KV over its tokens (a drafting step, or any step of a drafter that syncs while off),
        so each row's draft length follows its seq_len; else (a k = 0 step of a drafter that catches
        up) it stays behind. ``stats``: a speculative step's acceptance statistics per launched row,
        kept by each request that commits (``accept_stats``)."""
        row_of = {id(r): i for i, r in enumerate(self.rows)}
        plan = []  # (row, request, tokens, tokens kept, finish reason or None, error or None, statistics)
        outcome = self._outcome
        for j, ((req, epoch), toks) in enumerate(zip(launched_rows, tokens)):
            i = row_of.get(id(req))
            if i is None or req.row_epoch != epoch:
                continue
            plan.append((i, req, toks, *outcome(req, toks), None if stats is None else stats[j]))
        done, kept = [], []
        seq_lens, draft_lens = self.state.seq_lens_host, self.state.draft_lens_host
        for i, req, toks, take, reason, error, st in plan:  # nothing below raises
            if st is not None:
                req.accept_stats.append(st)
            n = len(toks)
            seq_lens[i] += n
            if drafted:
                draft_lens[i] = seq_lens[i]
            kept.append(toks)
            req.seq_len += n
            req.output_ids += toks if take == n else toks[:take]
            if take == 1:
                req.token_times.append(now)
            elif take:
                req.token_times += [now] * take
            if req.first_token_s is None and take:
                req.first_token_s = now
            if reason is not None:
                req.finish_reason, req.error = reason, error
                done.append(req)
        self._evict_done_(done, now)
        return kept

    def _outcome(self, req: Request, toks: list[int]) -> tuple[int, str | None, str | None]:
        """(tokens of ``toks`` to append, finish reason or None, error or None) for one row; reads
        ``req`` only. Tokens committed after EOS / a stop in the same step are dropped."""
        n_out = len(req.output_ids)
        if not req.stop:  # _finish_reason without stop strings, inline (every row, every step)
            # Most rows of most steps: below max_new_tokens and no EOS among the tokens, decided at once
            if len(toks) < req.max_new_tokens - n_out and (req.ignore_eos or req.eos_ids.isdisjoint(toks)):
                return len(toks), None, None
            eos = () if req.ignore_eos else req.eos_ids
            for j, t in enumerate(toks):
                if t in eos:
                    return j + 1, "eos", None
                if n_out + j + 1 >= req.max_new_tokens:
                    return j + 1, "length", None
            return len(toks), None, None
        # Only the output's tail matters (stop strings): no copy of the whole output per step.
        width = max(len(s) for s in req.stop) + 4  # tokens: each decodes to >= 1 char
        tail = req.output_ids[-width:]
        for j, t in enumerate(toks):
            tail.append(t)
            try:
                reason = self._finish_reason(req, tail[-width:], n_out + j + 1, t)
            except Exception as e:  # noqa: BLE001 - this request's stop check: it alone fails
                return j, "error", (f"stop-string check failed on output token {n_out + j} "
                                    f"(id {t}): {type(e).__name__}: {e}")
            if reason is not None:
                return j + 1, reason, None
        return len(toks), None, None

    def _evict_done_(self, done: list[Request], now: float) -> list[Request]:
        if done:
            self._leave_batch_(done)
            for req in done:
                self._finish_(req, req.finish_reason, now)
        return done

    # -- internals --------------------------------------------------------------------------------
    def _finish_reason(self, req: Request, tail: list[int], n_out: int, tok: int) -> str | None:
        """Why ``req`` finishes once its output has ``n_out`` tokens, the last ``tok`` and the
        last few ``tail`` (enough for its stop strings), or None."""
        if tok in req.eos_ids and not req.ignore_eos:
            return "eos"
        if req.stop and any(s in self.detokenize(tail) for s in req.stop):
            return "stop"
        if n_out >= req.max_new_tokens:
            return "length"
        return None

    def _leave_batch_(self, reqs: list[Request]) -> None:
        """Take ``reqs`` out of the admitted set and the decode rows, and free their pages."""
        gone = set(map(id, reqs))
        if any(r.status is Status.DECODE for r in reqs):
            keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
            self.state.keep_rows_(keep)
            self.rows = [self.rows[i] for i in keep]
        self.admitted = [r for r in self.admitted if id(r) not in gone]
        for r in reqs:
            self.kv.release_(r)

    def _preempt_(self, req: Request) -> None:
        """Free ``req``'s pages and queue it first for recompute (its output so far is kept)."""
        self._leave_batch_([req])
        req.status = Status.WAITING
        req.seq_len = req.draft_len = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish_(self, req: Request, reason: str, now: float) -> None:
        if self._live.get(req.id) is req:
            del self._live[req.id]
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_s = now
        self.finished.append(req)
