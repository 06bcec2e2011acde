"""The step: draft, verify, accept and commit for every k; plus the KV extend (prefill).

``Stepper.launch_(k)`` is the only place tokens are sampled and ``seq_lens`` advance; it runs
:func:`step_body_`. The pending token (committed, KV not yet written) is the root of a tree of T
nodes in scratch slots seq_lens[r] .. seq_lens[r] + T - 1; the target verifies every node in one
forward, and commit advances seq_lens by the accepted length + 1. At k = 0 the tree is the root
alone (T = 1): plain decoding, through the same function, the same kernels and a CUDA graph of its
own.

``Stepper.prefill_(chunks)`` extends KV over committed tokens that have none yet (a prompt, or prompt
plus generated tokens after a preemption), chunk by chunk, always leaving the last committed token
pending. So a request's first output token comes from the decode step like every other token, and
prefill computes no logits at all.

Neither function knows about requests: inputs are :class:`DecodeState` rows and plain
:class:`PrefillChunk` lists. The decode step reads back one small tensor (the committed tokens);
nothing else on this path waits for the GPU.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from ..errors import SpecdecError
from ..models.ops import AttentionMeta
from ..spec.base import extends_at_k0, preparer, prefills
from ..spec.tree import DraftTree, single_node_tree
from . import step_ops
from .kv_cache import KVCache
from .state import DecodeState, upload


def tree_inputs(state: DecodeState, kv: KVCache, tree: DraftTree, B: int, valid: torch.Tensor):
    """Target inputs for verifying ``tree`` (T nodes per row) over state rows 0 .. B-1.

    Node i of row b reads/writes logical slot seq_lens[b] + i (scratch until commit) at RoPE
    position seq_lens[b] + depth[i]; padding rows (valid False) get T_b = 0 and slot -1.
    Returns (input_ids [B*T], positions [B*T], AttentionMeta); device ops only (graph-capturable).
    """
    T = tree.num_nodes
    seq = state.seq_lens[:B]  # [B] int32
    # T = 1: causal is the single node, no mask needed. One launch on the GPU (paging.tree_meta).
    meta, ids, pos = state.tree_meta(B, seq, valid, tree.tokens.contiguous(), tree.depth.contiguous(),
                                     None if T == 1 else tree.mask.reshape(-1))
    return ids, pos, meta


@dataclass
class Counterfactual:
    """The smaller tree sizes a T-node step scores counterfactually (their commits on its path):
    ``ks`` in column order, their shapes [M, 3] int32 on the device and as a host list, and the
    largest steps among them (the kernel's static depth bound)."""

    ks: tuple[int, ...]
    shapes: torch.Tensor
    shapes_host: list

    @property
    def max_steps(self) -> int:
        return max(s for _, s, _ in self.shapes_host)


def step_body_(model, state: DecodeState, kv: KVCache, B: int, T: int, temperature: float | None,
               drafter=None, context=None, marks=None, acceptance=None, counterfactual=None) -> None:
    """One step over state rows 0 .. B-1 with trees of T nodes (T = 1: plain decoding, k = 0).

    draft -> verify -> accept -> commit, all on the device:
      tree    root = pending token, plus T - 1 draft nodes from ``drafter`` (none when T = 1)
      verify  one target forward over every node, KV written to scratch slots seq_lens + i
      warp    ``temperature`` None (per-row sampling): every node's logits warped under its row's
              state.sampling (temperature, top-k, top-p, min-p; kernels_triton/sampling.py), which
              verification then accepts against at temperature 1; a number: one temperature for
              every row, no warpers (0 = greedy)
      accept  verify_accept: accepted path + bonus token per row (greedy or exact sampling), and
              for T > 1 the path's statistics (drafted depth, accepted sibling ranks) into
              state.stats_out(T), read back with the tokens
      commit  kv_sync_: accepted KV moved into place, seq_lens += accepted + 1, pending = bonus;
              then the drafter extends its own KV over the committed tokens (at T = 1 only if it
              ``extends_at_k0``; otherwise a T = 1 step is plain decoding's body, drafter or not)
    Rows >= state.num_active are padding: T_b = 0, no KV read or written, nothing committed.
    Writes state.sampled_for(T)[:B] (committed tokens then -1) and commits in place; no host sync,
    so a CUDA graph can capture it per (bucket B, tree size T). ``marks(phase)``, when given (eager
    profiling only), is called as the draft, verify_forward, verify (= accept), kv_sync and commit
    (= draft extend) phases end (specdec.engine.profiling.PHASES). ``acceptance`` (replayed
    acceptance, :mod:`specdec.acceptance`): the verdict is replaced by its forced one after
    verify_accept has run, so the step does the same work and commits the replayed path.
    ``counterfactual`` ({T: Counterfactual}, T > 1 only): after verification the drafter writes the
    tokens each smaller configured tree would have committed per row into the columns after the
    tokens (``state.cf_out(T)``), read back with them in the step's one copy; a T without an entry
    (and every k = 0 step) runs exactly what it runs without it.
    """
    if T == 1 and not extends_at_k0(drafter):
        # Speculation off: a drafter that does no work at k = 0 (n-gram; EAGLE-3 with catch-up) is
        # not even seen, so this step is exactly plain decoding's (no feature capture, no extend).
        drafter = None
    valid = state.row_ids[:B] < state.num_active  # [B] bool
    root = state.pending[:B]
    if T == 1:
        tree = single_node_tree(root, state.root_tree_consts)
    else:
        if drafter is None:
            raise SpecdecError(f"a step with {T - 1} draft tokens needs a drafter (draft=none)")
        tree = drafter.propose(state, B, T, valid, context)
    if marks:
        marks("draft")
    ids, pos, meta = tree_inputs(state, kv, tree, B, valid)
    capture = drafter.capture_layers if drafter is not None else ()
    out = model(ids, pos, meta, kv.k, kv.v, capture_layers=capture)
    logits = model.logits(out.hidden).view(B, T, -1)  # [B, T, V]
    if marks:
        marks("verify_forward")
    be = model.backend
    if temperature is None:
        # The same warped target for plain decoding (T = 1) and for every node of a tree: the exact
        # rejection rule accepts against p = softmax(warped logits), so speculative sampling keeps
        # the warped distribution. Drafts are deterministic (q = one-hot), so no draft warping.
        target, temperature = step_ops.warp_logits(logits, state.sampling[:B], backend=be), 1.0
    else:
        target = logits
    uniforms = state.uniform[:B, :T] if temperature > 0 else None
    accept_len, nodes, out_tokens = step_ops.verify_accept(target, tree.tokens, tree.parents, temperature,
                                                      uniforms, backend=be)
    if acceptance is not None and T > 1:
        # Replayed acceptance: each row accepts its drawn length along the drafted tree's path.
        accept_len, nodes, out_tokens = acceptance.verdict(tree, logits, B, T)
    cf = counterfactual.get(T) if counterfactual and T > 1 else None
    if cf is not None:
        drafter.counterfactual_commits_(tree, nodes, accept_len, cf.shapes, state.cf_out(T)[:B],
                                        shapes_host=cf.shapes_host, max_steps=cf.max_steps)
    if T > 1:  # acceptance per depth, read back with the tokens (no extra copy or sync)
        step_ops.accept_stats_(tree.parents, tree.depth, nodes, accept_len, state.stats_out(T)[:B], backend=be)
    if marks:
        marks("verify")
    seq_old = state.seq_lens[:B].clone()  # [B] the drafter's extend starts here
    # One launch: accepted KV moved into place, then seq_lens / pending / sampled written in place.
    # Padding rows of a bucket hold stale state (a finished request's page table, whose pages live
    # requests may own now) and garbage logits: whatever verify accepted there, ``valid`` makes them
    # commit nothing (sampled -1, seq_lens and pending unchanged).
    step_ops.kv_sync_([(kv.k, kv.v)], state.page_table[:B], seq_old, nodes, accept_len, out_tokens, valid,
                      (state.seq_lens[:B], state.pending[:B], state.sampled_for(T)[:B]), backend=be)
    if marks:
        marks("kv_sync")
    if drafter is not None:
        drafter.extend_(state, B, T, valid, seq_old, out.captured, nodes, out_tokens, accept_len, (meta, pos))
    if marks:
        marks("commit")


def prefill_body_(model, kv: KVCache, drafter, ids, pos, meta, next_ids):
    """Target forward over prefill tokens (KV written) + the drafter's prefill (its root state per
    chunk, or None without a drafter or with one that keeps no prompt state); device ops only."""
    if not prefills(drafter):
        drafter = None
    capture = drafter.capture_layers if drafter is not None else ()
    out = model(ids, pos, meta, kv.k, kv.v, capture_layers=capture)
    if drafter is None:
        return None
    return drafter.prefill_(ids, pos, meta, out.captured, next_ids)


def catch_up_body_(model, kv: KVCache, drafter, ids, pos, meta, next_ids):
    """Draft catch-up over tokens committed while speculation was off (the rows' backlog): the
    target forward over them recomputes the features the drafter pairs with each token, writing
    no target KV (slot -1: the k = 0 steps already wrote it, and rewriting it from a batched
    forward could change its last bits), then the drafter's prefill extends its KV over them at
    their real slots. Returns the drafter's root state per chunk; device ops only (the same padded
    shapes as prefill, so it replays as a CUDA graph where prefill does). A drafter that reads no
    target features (``capture_layers`` empty) gets its prefill alone: no target forward."""
    if not drafter.capture_layers:  # a drafter that reads no target features (n-gram on the device)
        return drafter.prefill_(ids, pos, meta, None, next_ids)
    no_write = dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))
    out = model(ids, pos, no_write, kv.k, kv.v, capture_layers=drafter.capture_layers)
    return drafter.prefill_(ids, pos, meta, out.captured, next_ids)


@dataclass
class PrefillChunk:
    """Tokens at logical slots start .. start + len(token_ids) - 1 of one request."""

    token_ids: list[int]
    start: int  # = the request's seq_len before the chunk (its KV prefix)
    pages: list[int]  # the request's page list; must cover start + len(token_ids) slots
    next_token: int = -1  # the committed token after the chunk (a drafter pairs row j with j + 1)


def prefill_inputs(chunks: list[PrefillChunk], page_size: int, device):
    """Host-built (input_ids [N], positions [N], AttentionMeta) for a batch of prefill chunks."""
    ids, pos, slots, cu, kv_lens = [], [], [], [0], []
    width = max(len(c.pages) for c in chunks)
    table = torch.zeros(len(chunks), width, dtype=torch.int32,  # [Bp, MPp] host (see host_tensor)
                        pin_memory=torch.device(device).type == "cuda")
    for b, c in enumerate(chunks):
        n = len(c.token_ids)
        ids.extend(c.token_ids)
        pos.extend(range(c.start, c.start + n))
        slots.extend(c.pages[s // page_size] * page_size + s % page_size for s in range(c.start, c.start + n))
        cu.append(cu[-1] + n)
        kv_lens.append(c.start + n)
        table[b, : len(c.pages)] = torch.tensor(c.pages, dtype=torch.int32)

    meta = AttentionMeta(cu_q_lens=upload(cu, torch.int32, device), kv_lens=upload(kv_lens, torch.int32, device),
                         page_table=table.to(device, non_blocking=True), slot_mapping=upload(slots, torch.int64, device),
                         max_q_len=max(len(c.token_ids) for c in chunks))
    return upload(ids, torch.int64, device), upload(pos, torch.int64, device), meta


class Stepper:
    """Runs prefill and decode steps over one model, KV cache, DecodeState and optional drafter.

    ``runner.run_(n, T)`` executes :func:`step_body_` for n rows with T-node trees: eagerly, or by
    replaying the CUDA graph of the smallest bucket >= n for that T (see :mod:`specdec.engine.graphs`).
    """

    def __init__(self, model, kv: KVCache, state: DecodeState, runner, *, temperature: float | None,
                 drafter=None, sampling: tuple | None = None):
        if temperature is not None and temperature < 0:
            raise SpecdecError(f"sampling.temperature must be >= 0, got {temperature}")
        self.model, self.kv, self.state, self.runner = model, kv, state, runner
        if sampling is not None:  # the parameters of rows whose request brings none
            state.default_sampling = tuple(float(v) for v in sampling)
        # None: each row samples with its own parameters (state.sampling); else one temperature for all
        self.temperature = None if temperature is None else float(temperature)
        self.sampled = temperature is None or temperature > 0  # steps draw uniforms
        self.drafter = drafter
        self._prefills = prefills(drafter)  # the drafter keeps prompt state (its prefill_ runs)
        self.prefill_runner = None  # PaddedPrefill, set by the engine when it pads / graphs prefill
        # The same without the drafter (no feature capture, no draft layer): prefill while speculation
        # is off, for a drafter that catches up (None: prefill_runner is already the target's alone)
        self.plain_prefill_runner = None
        self.catch_up_runner = None  # the same over catch_up_body_ (drafters that catch up)
        # Two pinned buffers for the steps' tokens: a launch never overwrites tokens not yet read.
        self._readback = ([torch.empty(state.step_out_capacity, dtype=torch.int64, pin_memory=True)
                           for _ in range(2)] if state.device.type == "cuda" else None)
        self._flip = 0

    def prefill_(self, chunks: list[PrefillChunk], draft: bool = True):
        """Write target (and draft) KV for every chunk in one forward each (no target logits).

        ``draft`` False: the target's forward alone (no feature capture, no draft layer), as without
        a drafter; the engine asks for it while speculation is off and the drafter catches up.
        Chunks that fit the prefill buckets (tokens and requests) run padded from static buffers (a
        CUDA graph replay when graphed, see :class:`specdec.engine.graphs.PaddedPrefill`); others
        run eagerly.
        Returns the drafter's root state per chunk (what its last row predicts), or None.
        """
        if not chunks:
            return None
        draft = draft and self._prefills
        runner = self._prefill_runner(draft)
        # The token after each prefill token: only a drafter with prompt state reads it (row j pairs
        # with token j + 1); n-gram does not, so its prefill builds no per-token list.
        next_ids = _next_ids(chunks) if draft else None
        if runner is not None and runner.fits(chunks):
            return runner.run_(chunks, self.kv.page_size, next_ids)
        ids, pos, meta = prefill_inputs(chunks, self.kv.page_size, self.kv.k.device)
        nxt = None if next_ids is None else upload(next_ids, torch.int64, ids.device)
        return self.prefill_body(ids, pos, meta, nxt, draft)

    def _prefill_runner(self, draft: bool):
        """The padded runner a prefill with (``draft``) or without the drafter's prefill uses, or None."""
        if self._prefills and not draft:
            return self.plain_prefill_runner
        return self.prefill_runner

    def prefill_fit(self, draft: bool = True):
        """The token fit (PaddedPrefill.fit_tokens) of the runner ``prefill_(draft=draft)`` uses, or
        None where it has no timings (eager, or not timed)."""
        runner = self._prefill_runner(draft)
        return runner.fit_tokens if runner is not None and runner.forward_ms else None

    def catch_up_(self, chunks: list[PrefillChunk]):
        """Extend the draft KV over backlog chunks (tokens whose target KV exists but whose draft KV
        does not: committed while speculation was off); returns the drafter's root state per chunk.
        Padded (graph-replayed where prefill is) through ``catch_up_runner`` when the chunks fit its
        shapes, else eager."""
        if not chunks:
            return None
        next_ids = _next_ids(chunks)
        runner = self.catch_up_runner
        if runner is not None and runner.fits(chunks):
            return runner.run_(chunks, self.kv.page_size, next_ids)
        ids, pos, meta = prefill_inputs(chunks, self.kv.page_size, self.kv.k.device)
        nxt = upload(next_ids, torch.int64, ids.device)
        return catch_up_body_(self.model, self.kv, self.drafter, ids, pos, meta, nxt)

    def prefill_body(self, ids, pos, meta, next_ids, draft: bool = True):
        """Target forward over prefill tokens (KV written) + the drafter's prefill (``draft``);
        device ops only."""
        return prefill_body_(self.model, self.kv, self.drafter if draft else None, ids, pos, meta, next_ids)

    def num_nodes(self, k: int) -> int:
        """Tree nodes per row of a step with k draft tokens (1 at k = 0)."""
        if k < 0:
            raise SpecdecError(f"k={k}: the number of draft tokens must be >= 0")
        if k == 0:
            return 1
        if self.drafter is None:
            raise SpecdecError(f"k={k} draft tokens need a drafter; this engine has draft=none")
        return self.drafter.num_nodes(k)

    def launch_(self, k: int = 0, launched=None, context=None, timed: bool = False) -> LaunchedStep | None:
        """Queue one step over all state rows and its token copy to the host, without waiting.

        k = 0 is plain decoding (one token per row); k > 0 drafts a tree of num_nodes(k) nodes and
        commits the accepted path plus a bonus token. Mutates KV, state.pending, state.seq_lens and
        the drafter's KV on the device. The only GPU -> CPU transfer is the [num_rows, T] tensor of
        committed tokens, read by :meth:`collect_` (at once, or after the next launch with
        overlapped decoding); the caller commits them (host mirror included). ``launched()``, if
        given, is called once the step's GPU work is queued. ``context``: per-row committed token
        lists, for drafters that need them (n-gram). ``timed``: the step carries its own duration
        (``step_ms`` once collected: device time on the GPU, wall time on the CPU).
        """
        T = self.num_nodes(k)
        st = self.state
        n = st.num_rows
        if n == 0:
            return None
        cuda = self._readback is not None
        t0 = (_record() if cuda else time.perf_counter()) if timed else None
        st.num_active.fill_(n)  # a kernel, not a sync
        if self.sampled:
            st.uniform[:n, :T].uniform_(generator=st.generator)
        prepare = preparer(self.drafter) if T > 1 else None
        if prepare is not None:
            prepare(st, n, T, context)  # host-side drafting, before the (graphed) step
        self.runner.run_(n, T, context)
        t1 = (_record() if cuda else time.perf_counter()) if timed else None
        if launched is not None:
            launched()
        src = st.step_out(T)[:n]  # contiguous: one copy (tokens, then counterfactual commits and statistics)
        m, sw = st.cf_widths.get(T, 0), st.stats_width(T)
        if not cuda:  # the step has already run
            return LaunchedStep(n, k, src.clone(), None, times=None if t0 is None else (t1 - t0) * 1e3, cf_width=m,
                                stats_width=sw)
        self._flip ^= 1
        w = src.shape[1]
        host = self._readback[self._flip][: n * w].view(n, w)
        host.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(n, k, host, done, times=None if t0 is None else (t0, t1), cf_width=m, stats_width=sw)

    @staticmethod
    def collect_(step: LaunchedStep) -> list[list[int]]:
        """Wait for a launched step's tokens; the committed tokens of each row at its launch (a step
        with counterfactual columns also sets ``step.cf``: each row's counterfactual commits; a
        speculative step ``step.stats``: each row's acceptance statistics, kernels_triton/accept_stats.py)."""
        if step.done is not None:
            step.done.synchronize()
        if not step.cf_width and not step.stats_width:
            return [[t for t in row if t >= 0] for row in step.host.tolist()]
        T = step.host.shape[1] - step.cf_width - step.stats_width
        rows = step.host.tolist()
        if step.cf_width:
            step.cf = [row[T:T + step.cf_width] for row in rows]
        if step.stats_width:
            step.stats = [row[T + step.cf_width:] for row in rows]
        return [[t for t in row[:T] if t >= 0] for row in rows]

    @staticmethod
    def step_ms(step: LaunchedStep) -> float | None:
        """A timed step's duration in ms once collected (None: launched untimed)."""
        if isinstance(step.times, tuple):
            return step.times[0].elapsed_time(step.times[1])
        return step.times


def _next_ids(chunks) -> list[int]:
    """The committed token after each chunk token (what a draft row pairs with its feature)."""
    return [t for c in chunks for t in c.token_ids[1:] + [c.next_token]]


def _record():
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


@dataclass
class LaunchedStep:
    """A decode step queued on the GPU whose tokens may not be read yet."""

    n: int  # rows
    k: int  # draft tokens
    host: torch.Tensor  # [n, T] committed tokens then -1, valid once ``done`` has completed
    done: object | None  # CUDA event after the device -> host copy (None: already complete)
    rows: list = None  # (request, row_epoch) per row at launch, filled in by the engine
    times: object = None  # timed launches: (start, end) CUDA events, or wall ms on the CPU
    tokens: list | None = None  # the committed tokens once read back (a retried commit reuses them)
    policy_fed: bool = False  # the policy has seen this step's stats (not fed twice on a retry)
    cf_width: int = 0  # counterfactual columns after the tokens in ``host``
    cf: list | None = None  # per row, the smaller trees' counterfactual commits (once collected)
    stats_width: int = 0  # acceptance-statistics columns after those (speculative steps)
    stats: list | None = None  # per row, [drafted depth, draft nodes, rank at depth 1, ...] (once collected)
    cf_by_k: dict | None = None  # replayed acceptance: {smaller k: commits per row}, known at launch


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
