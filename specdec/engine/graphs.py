"""CUDA graphs for the step, one per (batch-size bucket, tree size), captured once at start-up.

A decode of n rows replays the graph of the smallest bucket B >= n. The graph reads the
DecodeState's persistent buffers (pending, seq_lens, page_table, num_active, uniform) and writes
``sampled`` and the commit in place, so a replay needs no input copies: rows n .. B-1 are padding
(T_b = 0, kv_len 0, slot -1), selected on the device by ``row_ids < num_active``.

Why graphs: SmolLM2-135M's step is ~350 small kernels (30 layers x ~11); launched eagerly the host
cannot keep up (Hugging Face eager runs ~75 ms a step, FACTS), replayed as one graph the GPU
runs them back to back. All buckets share one memory pool, captured largest first so the smaller
ones reuse its blocks. Every tree size a policy may choose (T = 1 for k = 0, T = num_nodes(k) for
each configured k) has its graphs captured up front: switching k selects another graph, never a
recapture or a slower mode.

Numerics: a replay runs the same kernels as an eager run of the same bucket, so their tokens are
identical. Eager at exactly n rows may differ from the bucket in the last bits (cuBLAS picks its
kernel by M), which in bf16 can flip a near-tie in greedy decoding; tests compare in fp32.

On the CPU (or with the torch kernel references, whose host-side loops cannot be captured) the
same body runs eagerly; ``EagerDecode(pad_to=buckets)`` replays the padded shapes eagerly so tests
can check padding on the CPU.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Callable

import numpy as np
import torch

from ..errors import ConfigError

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Eager runs of a shape before its capture: the first compiles its Triton kernels, lets cuBLAS pick
# its kernel and allocates the kernels' workspaces (arrival counters), none of which may happen
# inside a capture. A second run (the default before) cost a third of every capture's time (at 8B
# shapes a 2048-token prefill forward is tens of ms of device time per run).
WARMUP_RUNS = 1


def make_buckets(max_batch_size: int, buckets=None) -> list[int]:
    """Sorted buckets <= max_batch_size, always ending with max_batch_size itself."""
    if max_batch_size < 1:
        raise ConfigError(f"engine.max_batch_size must be >= 1, got {max_batch_size}")
    chosen = DEFAULT_BUCKETS if buckets is None else tuple(int(b) for b in buckets)
    if any(b < 1 for b in chosen):
        raise ConfigError(f"engine.graph_buckets must be positive batch sizes, got {list(chosen)}")
    return sorted({b for b in chosen if b < max_batch_size} | {max_batch_size})


def prefill_request_buckets(requests, max_batch_size: int) -> list[int]:
    """The prefill request buckets a forward can use when at most ``max_batch_size`` requests are in
    flight: those below it and the smallest one at or above it (a prefill or catch-up forward
    holds one chunk per request, so no forward has more). Each bucket is captured once per token
    bucket and prefill runner (an EAGLE-3 engine has three), so at C = 1 the default (1, 8, 64)
    captures a third of the shapes."""
    chosen = sorted({int(r) for r in requests} | {1})
    above = [r for r in chosen if r >= max_batch_size]
    return [r for r in chosen if r < max_batch_size] + above[:1]


def pack_chunks_(tokens, ints, chunks, page_size: int, N: int, R: int, kv0: int, pt0: int, max_pages: int,
                 next_ids=None) -> int:
    """Write prefill chunks into PaddedPrefill's host buffers (numpy views): ``tokens`` [4, >= N]
    rows ids / positions / slots / next ids over the first N columns (padding: id 0, position 0,
    slot -1, next id 0), ``ints`` cu_q_lens [R + 1] at 0, kv_lens at kv0, the [r_max, max_pages] page
    table at pt0 (zeros elsewhere); returns the chunks' token count. A few array operations
    whatever the number of chunks: a Python loop of torch calls per chunk took 581 us for 12 chunks on
    a 2-core CPU, this 104 us (host work between steps, which bounds a host-bound batch)."""
    C = len(chunks)
    lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, C)
    starts = np.fromiter((c.start for c in chunks), np.int64, C)
    npages = np.fromiter((len(c.pages) for c in chunks), np.int64, C)
    off, n_pages = int(lens.sum()), int(npages.sum())
    cu = np.cumsum(lens)
    pos = np.arange(off) - np.repeat(cu - lens - starts, lens)  # each chunk's slots start .. start + n - 1
    pages = np.fromiter(itertools.chain.from_iterable(c.pages for c in chunks), np.int64, n_pages)
    first_page = np.cumsum(npages) - npages  # where each chunk's pages start in ``pages``
    tokens[:, :N] = 0
    tokens[2, :N] = -1
    tokens[0, :off] = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, off)
    tokens[1, :off] = pos
    tokens[2, :off] = pages[np.repeat(first_page, lens) + pos // page_size] * page_size + pos % page_size
    if next_ids is not None:  # None: no drafter reads them (row 3 stays zero)
        tokens[3, :off] = next_ids
    ints[:] = 0
    ints[1:C + 1] = cu  # cu_q_lens
    ints[C + 1:R + 1] = off  # empty requests: T_b = 0
    ints[kv0:kv0 + C] = starts + lens  # kv_lens
    table = ints[pt0:].reshape(-1, max_pages)
    table[np.repeat(np.arange(C), npages), np.arange(n_pages) - np.repeat(first_page, npages)] = pages
    return off


def bucket_for(buckets: list[int], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise RuntimeError(f"decode batch of {n} rows exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def fit_tokens(forward_ms: dict[int, float], n: int) -> int:
    """n, or the token bucket just below n when a forward there plus a later one over the rest (alone,
    at its own bucket) costs less than padding n up to the bucket above, by ``forward_ms`` {token
    bucket: ms of one padded forward} (n without timings, or from the largest bucket up)."""
    if not forward_ms or n in forward_ms:
        return n
    buckets = sorted(forward_ms)
    below = [b for b in buckets if b < n]
    if n >= buckets[-1] or not below:
        return n
    down, up = below[-1], bucket_for(buckets, n)
    t = forward_ms
    return down if t[down] + t[bucket_for(buckets, n - down)] < t[up] else n


class EagerDecode:
    """Runs ``body(B, T, context)`` eagerly: B = n (default), or the bucket of n with ``pad_to``."""

    graphed = False

    def __init__(self, body: Callable, pad_to: list[int] | None = None):
        self.body = body
        self.buckets = sorted(pad_to) if pad_to else None

    def run_(self, n: int, T: int = 1, context=None) -> int:
        B = bucket_for(self.buckets, n) if self.buckets else n
        self.body(B, T, context)
        return B


class GraphedDecode:
    """One CUDA graph of ``body(B, T)`` per bucket B and tree size T in ``tree_sizes``.

    ``run_(n, T)`` replays graph (bucket_for(n), T). Tree sizes whose drafter needs host input
    (``eager_tree_sizes``, e.g. the n-gram drafter's prompt lookup) run eagerly at the bucket shape.
    """

    graphed = True

    def __init__(self, body: Callable, state, buckets: list[int], tree_sizes=(1,), eager_tree_sizes=()):
        if state.device.type != "cuda":
            raise ConfigError("CUDA graphs need a CUDA device; use engine.cuda_graphs=false on the CPU")
        self.body = body
        self.buckets = sorted(buckets)
        self.eager_tree_sizes = frozenset(eager_tree_sizes)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.captures = 0  # graphs captured, ever (a run reports those after start-up: always 0)
        pool = torch.cuda.graph_pool_handle()
        cur = torch.cuda.current_stream()
        # num_active = 0 makes every row padding: warm-up and capture write no KV and commit nothing.
        state.num_active.fill_(0)
        for T in sorted(set(tree_sizes) - self.eager_tree_sizes, reverse=True):
            for B in reversed(self.buckets):
                side = torch.cuda.Stream()
                side.wait_stream(cur)
                with torch.cuda.stream(side):  # one run first (WARMUP_RUNS): compiles, cuBLAS, workspaces
                    for _ in range(WARMUP_RUNS):
                        body(B, T, None)
                cur.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    body(B, T, None)
                self.graphs[(B, T)] = graph
                self.captures += 1
        torch.cuda.synchronize()

    def run_(self, n: int, T: int = 1, context=None) -> int:
        B = bucket_for(self.buckets, n)
        if T in self.eager_tree_sizes:
            self.body(B, T, context)
            return B
        graph = self.graphs.get((B, T))
        if graph is None:
            raise RuntimeError(f"no CUDA graph for {B} rows x {T} tree nodes; captured tree sizes: "
                               f"{sorted({t for _, t in self.graphs})}")
        graph.replay()
        return B


class PaddedPrefill:
    """Prefill at padded shapes from static input buffers: one CUDA graph per (token bucket,
    request bucket) (``graphed``), or the same padded shapes eagerly (CPU tests of the padding).

    ``forward(ids [N], pos [N], meta, next_ids [N]) -> outputs`` is the prefill body (target forward
    plus the drafter's prefill). A forward of C chunks with n tokens in all runs in the smallest
    request bucket R >= C and the smallest token bucket N >= max(n, R): the chunks are packed in
    order into tokens 0 .. n-1; tokens n .. N-1 are padding (token 0, position 0, slot -1: no KV
    write) and requests C .. R-1 are empty (T_b = 0, kv_len 0: their attention programs return at
    once), so no attention row owns a padding token and nothing reads its output. Attention is
    launched with max_q_len = N, the bound any packed chunk satisfies. Why: an eager prefill of
    SmolLM2 is ~300 launches whose host cost (~15 ms) dwarfs the GPU's (~2 ms); replayed, the GPU
    sets the pace. That holds for batched prefills too (several requests admitted in one
    iteration, every iteration under load), which is why they are graphed as well. Forwards with
    more chunks than the largest request bucket, or more tokens than the largest token bucket,
    run eagerly. Outputs of a replay live in the graph's memory until the next replay of the same
    shape.
    """

    def __init__(self, forward: Callable, device, buckets, max_pages: int, *, graphed: bool,
                 request_buckets=(1,), timed: bool = False):
        self.forward = forward
        self.buckets = sorted({int(b) for b in buckets})
        self.request_buckets = sorted({int(r) for r in request_buckets} | {1})
        if self.buckets[0] < 1 or any(r < 1 for r in self.request_buckets):
            raise ConfigError(f"prefill graph buckets must be positive: tokens {self.buckets}, "
                              f"requests {self.request_buckets}")
        self.graphed = graphed
        self.max_pages = max_pages
        n_max, dev = self.buckets[-1], torch.device(device)
        # Shapes: a request bucket above the token bucket cannot occur (every chunk has a token).
        self.shapes = [(N, R) for N in self.buckets for R in self.request_buckets if R <= N]
        self.r_max = r_max = max(R for _, R in self.shapes)
        self.tokens = torch.zeros(4, n_max, dtype=torch.int64, device=dev)  # ids, pos, slot, next id
        # int32 metadata: cu_q_lens [r_max + 1] | kv_lens [r_max] | page table [r_max, max_pages]
        self._kv0, self._pt0 = r_max + 1, 2 * r_max + 1
        n_ints = self._pt0 + r_max * max_pages
        self.ints = torch.zeros(n_ints, dtype=torch.int32, device=dev)
        self._host_tokens = torch.zeros(4, n_max, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._host_ints = torch.zeros(n_ints, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], object] = {}
        self.captures = 0  # graphs captured, ever
        self._copied = None  # event after the last upload: the pinned host buffers are free again
        # token bucket -> device ms of its graph at one request (``timed``, graphed): what fit_tokens prices
        self.forward_ms: dict[int, float] = {}
        if graphed:
            if dev.type != "cuda":
                raise ConfigError("CUDA graphs need a CUDA device; use engine.cuda_graphs=false on the CPU")
            pool = torch.cuda.graph_pool_handle()
            cur = torch.cuda.current_stream()
            self.tokens[2].fill_(-1)  # warm-up and capture own no rows and write no KV
            self.ints.zero_()
            for shape in sorted(self.shapes, reverse=True):  # largest first: the others reuse its blocks
                side = torch.cuda.Stream()
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        self._body(*shape)
                cur.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[shape] = self._body(*shape)
                self.graphs[shape] = graph
                self.captures += 1
            torch.cuda.synchronize()
            if timed:
                self.forward_ms = self._time_buckets()

    def _time_buckets(self) -> dict[int, float]:
        """Device ms of each token bucket's graph at one request (a replay after a first one; the
        warm-up / capture state writes no KV), for fit_tokens."""
        times = {}
        for N in self.buckets:
            graph = self.graphs[(N, 1)]
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[N] = start.elapsed_time(end)
        return times

    def fit_tokens(self, n: int) -> int:
        """How many of the n prompt tokens planned for one forward to prefill now, by the timed
        buckets (:func:`fit_tokens`; n without timings). The rest stays queued: at load it joins the
        next forward's chunks. A compute-bound forward pays for its padding (8B shapes: a forward of
        1035 tokens runs in the 2048-token bucket); a launch- or weight-bound one does not, and keeps n."""
        return fit_tokens(self.forward_ms, n)

    def _body(self, N: int, R: int):
        from ..models.ops import AttentionMeta

        t, i = self.tokens, self.ints
        table = i[self._pt0:].view(self.r_max, self.max_pages)[:R]
        meta = AttentionMeta(cu_q_lens=i[: R + 1], kv_lens=i[self._kv0:self._kv0 + R], page_table=table,
                             slot_mapping=t[2, :N], max_q_len=N)
        return self.forward(t[0, :N], t[1, :N], meta, t[3, :N])

    def shape_for(self, chunks) -> tuple[int, int] | None:
        """(token bucket, request bucket) a forward over these chunks runs in, or None (eager)."""
        C, n = len(chunks), sum(len(c.token_ids) for c in chunks)
        if C == 0 or C > self.r_max or n > self.buckets[-1]:
            return None
        R = bucket_for(self.request_buckets, C)  # <= r_max, and some token bucket holds R tokens
        return bucket_for(self.buckets, max(n, R)), R

    def fits(self, chunks) -> bool:
        return self.shape_for(chunks) is not None

    def run_(self, chunks, page_size: int, next_ids: list[int] | None):
        """Pack the chunks into the static buffers and run (replay) their shape; returns the
        forward's outputs (in the graph's memory when replayed)."""
        N, R = self.shape_for(chunks)
        ht, hi = self._host_tokens, self._host_ints
        if self._copied is not None:
            self._copied.synchronize()
        pack_chunks_(ht.numpy(), hi.numpy(), chunks, page_size, N, R, self._kv0, self._pt0, self.max_pages, next_ids)
        self.tokens[:, :N].copy_(ht[:, :N], non_blocking=True)
        self.ints.copy_(hi, non_blocking=True)
        if self.tokens.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if not self.graphed:
            return self._body(N, R)
        self.graphs[(N, R)].replay()
        return self.outputs[(N, R)]
