"""n-gram drafting (prompt lookup, no weights): find the latest earlier occurrence of the row's
last n tokens (n = max_ngram .. min_ngram) in its own history and propose what followed."""

from __future__ import annotations

import random
import time
from array import array

import torch

from ..errors import ConfigError
from .tree import DraftTree, bit


class NgramDrafter:
    """Prompt-lookup drafting: a chain of up to k tokens copied from the row's own history.

    Here the lookup runs on the host (``draft.lookup=host``; ``DeviceNgramDrafter`` below runs it on the device, the
    default) over the committed tokens the scheduler already has, in ``prepare_``, which uploads the chains into
    static device buffers with one copy; ``propose`` only reads those buffers, so the verify step stays a CUDA
    graph. Under the engine each request's n-grams are indexed as its tokens are committed (``_GramIndex``: a dict
    probe per n instead of a scan of the history; CPU, 300-token histories: 2.3 us a row against 74 us for a scan
    without a match, 70 us to index a request on its first drafting step). A whole ``prepare_`` at 64 rows of
    300-token prompts that grow a token a step, the engine's context included: 3.8 us a row on this CPU (16 us with
    a tensor per row, the n-gram slices zipped for every new token and each row's prompt + output copied and
    compared every step; a GPU machine's host measured 15-64 us a row).
    """

    name = "ngram"
    capture_layers: tuple[int, ...] = ()
    needs_context = True
    capturable = True
    extends_at_k0 = False  # no draft state: a k = 0 step is plain decoding's step
    prefills = False  # no draft state over the prompt either: prefill is the target's alone
    # A chain of k' < k tokens is the first k' tokens of the chain of k (one match, whatever k: the
    # lookup picks the n-gram's latest occurrence, then slices), so a step at k also tells what k'
    # would have committed at the same position: min(committed, k' + 1) (the engine's host
    # counterfactual samples; exact under greedy verification)
    nested_chains = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, chains=None):
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"draft.min_ngram={min_ngram}, draft.max_ngram={max_ngram}: need "
                              "1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # The chain lengths a policy may pick from (draft.chains); None: any k (direct construction).
        if chains is not None:
            chains = sorted({int(c) for c in chains})
            if not chains or chains[0] < 1 or chains[-1] > 63:
                raise ConfigError(f"draft.chains={chains}: list chain lengths in 1..63")
        self.sizes = None if chains is None else tuple(chains)
        self._index: dict = {}  # request id -> _GramIndex of its committed tokens (prepare_ with RowTokens)
        # Host ms per row of prepare_'s indexed drafting (EMA over drafting steps; bind_ starts it from a
        # timed synthetic row): what a policy prices a speculative step's host work with (ShadowAcceptance)
        self.host_ms_per_row: float | None = None

    def num_nodes(self, k: int) -> int:
        if self.sizes is not None and k not in self.sizes:
            raise ConfigError(f"k={k} is not a configured n-gram chain length; configured (draft.chains): "
                              f"{list(self.sizes)}")
        return k + 1

    def bind_(self, state, num_pages: int, page_size: int) -> None:
        R, T = state.max_rows, state.max_tree_nodes
        # [R, T] draft tokens (-1 = no draft: a padding node) as one static buffer; the tree's
        # parents/depth/mask follow from how many leading nodes are real, computed on the device.
        self.buf = torch.full((R, T), -1, dtype=torch.int64, device=state.pending.device)
        self._host = torch.full((R, T), -1, dtype=torch.int64,
                                pin_memory=state.pending.device.type == "cuda")
        self.host_ms_per_row = self._time_index_row()

    def _time_index_row(self) -> float:
        """Host ms of one indexed drafting of a row (a 256-token history, a token committed per step)."""
        rng = random.Random(0)
        hist = [rng.randrange(32000) for _ in range(256)]
        ix = _GramIndex(self.min_ngram, self.max_ngram).extend_(hist)
        t0 = time.perf_counter()
        for i in range(64):
            hist.append(i)
            if ix.continues(hist):
                ix.extend_(hist).lookup(8)
        return (time.perf_counter() - t0) * 1e3 / 64

    def prefill_(self, ids, pos, meta, captured, next_ids):
        return None

    def prepare_(self, state, n: int, T: int, context) -> None:
        """Look up each row's chain on the host and upload it (one copy, before the graph runs).
        A context that names its rows (``RowTokens.keys``: request ids, as the engine passes it) is
        looked up through a per-request n-gram index grown with the committed tokens (the same chain
        as ``lookup``, in time independent of the history's length); a plain list of histories by
        ``lookup``'s scan."""
        t0 = time.perf_counter()
        host = self._host
        context = context or []
        keys = getattr(context, "keys", None)
        if keys is not None and len(self._index) > 2 * max(n, 1) + 64:  # requests that left the batch
            live = set(keys[:n])
            self._index = {key: ix for key, ix in self._index.items() if key in live}
        # The [n, T] chains as one Python list (-1: no draft), made a tensor once: a tensor per row cost
        # ~10 us a row on the host (a GPU machine's host: 15-64 us a row drafted, by host_ms_per_row)
        flat = [-1] * (n * T)
        parts = getattr(context, "parts", None)
        for r in range(min(n, len(context))):
            if keys is None:
                follow = self.lookup(context[r], T - 1)
            else:
                # the engine's rows come as (prompt, output) lists: only new output tokens are read, and the
                # output list's identity names the request; a row given whole is checked token by token
                prompt, output = parts[r] if parts is not None else (context[r], None)
                ix = self._index.get(keys[r])
                if ix is None or (ix.output is not output if output is not None else not ix.continues(prompt)):
                    ix = self._index[keys[r]] = _GramIndex(self.min_ngram, self.max_ngram)
                    ix.output = output
                follow = ix.extend_parts_(prompt, output or ()).lookup(T - 1)
            if follow:
                flat[r * T + 1:r * T + 1 + len(follow)] = follow
        host[:n, :T].copy_(torch.tensor(flat, dtype=torch.int64).view(n, T))
        self.buf[:n, :T].copy_(host[:n, :T], non_blocking=True)
        if keys is not None and n:
            ms = (time.perf_counter() - t0) * 1e3 / n
            old = self.host_ms_per_row
            self.host_ms_per_row = ms if old is None else 0.9 * old + 0.1 * ms

    def stage_rows_(self, roots, chunk_idx, rows) -> None:
        pass

    def extend_(self, *args) -> None:
        pass

    def lookup(self, history: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of history's suffix."""
        n_hist = len(history)
        for n in range(min(self.max_ngram, n_hist - 1), self.min_ngram - 1, -1):
            suffix = history[n_hist - n:]
            # Scan right to left: the most recent match predicts best and ends the search early.
            for start in range(n_hist - n - 1, -1, -1):
                if history[start:start + n] == suffix:
                    follow = history[start + n:start + n + k]
                    if follow:
                        return follow
        return []

    def follow_at(self, history: list[int], end: int, k: int) -> list[int]:
        """``lookup(history[:end], k)`` with the search in C: the tokens packed 4 bytes each and each n's
        suffix found by ``bytes.rfind`` (a match off a 4-byte boundary is skipped), instead of a
        slice compare per earlier position in Python. ~4 us against ~72 us for the scan of a 300-token
        history without a match (this CPU): what goodput's shadow scoring pays per draft while
        speculation is off."""
        try:
            packed = array("I", history[:end]).tobytes()
        except (OverflowError, TypeError):  # not 32-bit token ids: the scan
            return self.lookup(history[:end], k)
        hi = 4 * (end - 1)  # an occurrence must end before the suffix's last token (a follower in history[:end])
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            sub = packed[4 * (end - n):4 * end]
            top = hi
            while True:
                p = packed.rfind(sub, 0, top)
                if p < 0:
                    break
                if p % 4 == 0:
                    e = p // 4 + n
                    return history[e:min(e + k, end)]
                top = p + len(sub) - 1  # a match across token boundaries: look further left
        return []

    def shadow_commits(self, history: list[int], start: int, k: int) -> int:
        """Tokens a greedy step with a k-token chain would have committed at ``start`` (the row's
        committed tokens were history[:start]), read off the tokens committed since: the chain is
        this lookup over history[:start], and greedy verification accepts its longest prefix that
        equals what the target committed, plus the bonus token. Needs start + k <= len(history).
        Exact for greedy decoding (the same lookup ``prepare_`` runs); lets a policy measure the
        acceptance of every chain length while speculation is off, with no device work."""
        if not 0 < start <= len(history) - k:
            raise ValueError(f"shadow_commits: start={start}, k={k} needs 0 < start <= {len(history) - k}")
        follow = self.follow_at(history, start, k)
        m = 0
        while m < len(follow) and follow[m] == history[start + m]:
            m += 1
        return m + 1

    def propose(self, state, B: int, T: int, valid, context=None) -> DraftTree:
        """The chains prepared for rows 0 .. B-1 as trees (device ops only)."""
        drafts = self.buf[:B, :T]  # [B, T]; column 0 unused (the root is the pending token)
        node = torch.arange(T, device=drafts.device)
        real = (drafts >= 0) | (node == 0)[None, :]  # [B, T]; a chain's real nodes lead
        tokens = torch.where(node[None, :] == 0, state.pending[:B, None], drafts.clamp(min=0))
        parents = torch.where(real, node - 1, -1).to(torch.int32).expand(B, T)
        depth = torch.where(real, node, 0).to(torch.int32).expand(B, T)
        chain = bit(node + 1) - 1  # node i sees nodes 0..i
        mask = torch.where(real, chain[None, :], bit(node)[None, :])  # padding: prefix + itself
        return DraftTree(tokens, parents.contiguous(), depth.contiguous(), mask)


class _GramIndex:
    """The latest occurrence of every n-gram (n = min_ngram .. max_ngram) of one request's committed
    tokens that has a token after it, grown as tokens are committed: ``lookup`` returns what
    ``NgramDrafter.lookup``'s right-to-left scan returns, from one dict probe per n."""

    __slots__ = ("ns", "tokens", "last", "indexed", "output")

    def __init__(self, min_ngram: int, max_ngram: int):
        self.ns = range(max_ngram, min_ngram - 1, -1)
        self.tokens: list[int] = []
        self.last = {n: {} for n in self.ns}  # n -> {n-gram: end (exclusive) of its latest occurrence}
        self.indexed = 0  # n-grams ending (exclusive) at j <= indexed are in ``last``
        self.output = None  # the request's output list (extend_parts_): its identity names the request

    def continues(self, history) -> bool:
        """Whether ``history`` extends the tokens indexed so far (the same request, more tokens)."""
        n = len(self.tokens)
        return len(history) >= n and history[:n] == self.tokens

    def extend_(self, history) -> "_GramIndex":
        """Index ``history`` (which ``continues`` the tokens seen): every n-gram followed by a token."""
        self.tokens.extend(history[len(self.tokens):])
        return self._index_new_()

    def extend_parts_(self, prompt, output) -> "_GramIndex":
        """``extend_(prompt + output)`` reading only the tokens not seen yet (the same request: its
        prompt, then its output growing)."""
        toks = self.tokens
        n, P = len(toks), len(prompt)
        if n < P:
            toks.extend(prompt[n:])
        toks.extend(output[max(0, n - P):])
        return self._index_new_()

    def _index_new_(self) -> "_GramIndex":
        toks = self.tokens
        L = len(toks)
        # The n-grams toks[j - n:j] for j = indexed + 1 .. L - 1 (each has a follower), oldest first so a
        # later occurrence overwrites an earlier one; built by zip over n shifted slices (C loops).
        new = L - 1 - self.indexed
        if 0 < new <= 4:  # a step's few tokens: a tuple per n-gram directly (no slices to zip)
            for n, last in self.last.items():
                for j in range(max(self.indexed + 1, n), L):
                    last[tuple(toks[j - n:j])] = j
        elif new > 0:
            for n, last in self.last.items():
                lo = max(self.indexed + 1, n)
                if lo < L:
                    last.update(zip(zip(*(toks[lo - n + i:L - n + i] for i in range(n))), range(lo, L)))
        self.indexed = max(self.indexed, L - 1)
        return self

    def lookup(self, k: int) -> list[int]:
        toks = self.tokens
        L = len(toks)
        for n in self.ns:
            if n > L - 1:
                continue
            j = self.last[n].get(tuple(toks[L - n:]))
            if j is not None:
                return toks[j:j + k]
        return []


class DeviceNgramDrafter(NgramDrafter):
    """``NgramDrafter``'s lookup on the device (``draft.lookup=device``): the same chains, drafted by a
    kernel over each row's committed tokens kept in a paged token cache beside the KV
    (kernels_triton/ngram.py), so a drafting step does no host work and needs no host context: it
    runs overlapped with the step before it, as a plain step does, instead of waiting for its tokens.

    The cache is filled by the drafter's prefill (prompt tokens at their slots), by each drafting step
    (the pending token at the root's slot, the accepted tokens where the commit put them) and, for
    tokens committed by k = 0 steps (which do not see the drafter: plain decoding's step), by the
    engine's catch-up before the first drafting step after them (the backlog's tokens written at their
    slots; no target forward, the drafter reads no features). Host-side helpers (``lookup``,
    ``shadow_commits`` for a policy's shadow scoring while off) are the host drafter's."""

    needs_context = False
    catches_up = True
    prefills = True
    prepare_ = None  # nothing on the host before the step

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, chains=None, *, backend: str = "auto"):
        super().__init__(max_ngram, min_ngram, chains)
        self.backend = backend
        self.host_ms_per_row = 0.0  # a drafting step's host work per row (policies price it)

    def bind_(self, state, num_pages: int, page_size: int) -> None:
        R, T = state.max_rows, state.max_tree_nodes
        dev = state.pending.device
        self.buf = torch.full((R, T), -1, dtype=torch.int64, device=dev)
        # One token per KV slot, plus a last entry that padding (slot -1) writes land in.
        self.tok = torch.full((num_pages * page_size + 1,), -1, dtype=torch.int32, device=dev)
        self.page_size = page_size

    def _kernels(self, t):
        from kernels_triton import ngram as kn

        from .tree_ops import use_step_kernels

        return (kn.ngram_propose_, kn.ngram_record_) if use_step_kernels(self.backend, t) else \
            (kn.ngram_propose_ref_, kn.ngram_record_ref_)

    def prefill_(self, ids, pos, meta, captured, next_ids):
        """The prefill (or catch-up) tokens into the token cache at their slots (padding: slot -1)."""
        self.tok[meta.slot_mapping.long()] = ids.to(torch.int32)
        return None

    def propose(self, state, B: int, T: int, valid, context=None) -> DraftTree:
        propose, _ = self._kernels(self.tok)
        propose(self.tok, state.page_table[:B], state.seq_lens[:B], state.pending[:B], valid, self.buf[:B, :T],
                self.page_size, self.min_ngram, self.max_ngram)
        return super().propose(state, B, T, valid, context)

    def extend_(self, state, B: int, T: int, valid, seq_old, captured, nodes, out_tokens, accept_len,
                verify=None) -> None:
        _, record = self._kernels(self.tok)
        record(self.tok, state.page_table[:B], seq_old, out_tokens, accept_len, valid, self.page_size)
