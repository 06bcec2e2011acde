"""CUDA graphs for the step, one per (batch-size bucket, tree size), captured once at start-up.

A decode of n rows replays the graph of the smallest bucket B >= n. The graph reads the
DecodeState's persistent buffers (pending, seq_lens, page_table, num_active, uniform) and writes
``sampled`` and the commit in place, so a replay needs no input copies: rows n .. B-1 are padding
(T_b = 0, kv_len 0, slot -1), selected on the device by ``row_ids < num_active``.

Why graphs: SmolLM2-135M's step is ~350 small kernels (30 layers x ~11); launched eagerly the host
cannot keep up (Hugging Face eager: ~75 ms/step on the lent H200), replayed as one graph the GPU
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
from typing import Callable

import torch

from ..errors import ConfigError

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def make_buckets(max_batch_size: int, buckets=None) -> list[int]:
    """Sorted buckets <= max_batch_size, always ending with max_batch_size itself."""
    if max_batch_size < 1:
        raise ConfigError(f"engine.max_batch_size must be >= 1, got {max_batch_size}")
    chosen = DEFAULT_BUCKETS if buckets is None else tuple(int(b) for b in buckets)
    if any(b < 1 for b in chosen):
        raise ConfigError(f"engine.graph_buckets must be positive batch sizes, got {list(chosen)}")
    return sorted({b for b in chosen if b < max_batch_size} | {max_batch_size})


def bucket_for(buckets: list[int], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise RuntimeError(f"decode batch of {n} rows exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


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
        pool = torch.cuda.graph_pool_handle()
        cur = torch.cuda.current_stream()
        # num_active = 0 makes every row padding: warm-up and capture write no KV and commit nothing.
        state.num_active.fill_(0)
        for T in sorted(set(tree_sizes) - self.eager_tree_sizes, reverse=True):
            for B in reversed(self.buckets):
                side = torch.cuda.Stream()
                side.wait_stream(cur)
                with torch.cuda.stream(side):  # compile Triton kernels, warm cuBLAS outside the capture
                    for _ in range(2):
                        body(B, T, None)
                cur.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    body(B, T, None)
                self.graphs[(B, T)] = graph
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
    """Single-chunk prefill at padded token buckets, from static input buffers: one CUDA graph per
    bucket (``graphed``), or the same padded shapes eagerly (CPU tests of the padding).

    ``forward(ids [N], pos [N], meta, next_ids [N]) -> outputs`` is the prefill body (target forward
    plus the drafter's prefill). A chunk of n tokens runs in the smallest bucket N >= n: tokens
    n .. N-1 are padding (token 0, position 0, slot -1: no KV write; ``cu_q_lens`` = [0, n], so no
    attention row owns them and nothing reads their outputs). Why: an eager prefill of SmolLM2 is
    ~300 launches whose host cost (~15 ms) dwarfs the GPU's (~2 ms); replayed, the GPU sets the
    pace. Batched prefills (several chunks in one forward) and longer chunks stay eager.
    Outputs of a replay live in the graph's memory until the next replay of the same bucket.
    """

    def __init__(self, forward: Callable, device, buckets, max_pages: int, *, graphed: bool):
        self.forward = forward
        self.buckets = sorted(int(b) for b in buckets)
        self.graphed = graphed
        n_max, dev = self.buckets[-1], torch.device(device)
        self.tokens = torch.zeros(4, n_max, dtype=torch.int64, device=dev)  # ids, pos, slot, next id
        self.ints = torch.zeros(3 + max_pages, dtype=torch.int32, device=dev)  # cu[0:2], kv_len, pages
        self._host_tokens = torch.zeros(4, n_max, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._host_ints = torch.zeros(3 + max_pages, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, object] = {}
        self._copied = None  # event after the last upload: the pinned host buffers are free again
        if graphed:
            if dev.type != "cuda":
                raise ConfigError("CUDA graphs need a CUDA device; use engine.cuda_graphs=false on the CPU")
            pool = torch.cuda.graph_pool_handle()
            cur = torch.cuda.current_stream()
            self.tokens[2].fill_(-1)  # warm-up and capture own no rows and write no KV
            self.ints.zero_()
            for N in reversed(self.buckets):
                side = torch.cuda.Stream()
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._body(N)
                cur.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[N] = self._body(N)
                self.graphs[N] = graph
            torch.cuda.synchronize()

    def _body(self, N: int):
        from ..models.ops import AttentionMeta

        t, i = self.tokens, self.ints
        meta = AttentionMeta(cu_q_lens=i[0:2], kv_lens=i[2:3], page_table=i[3:].view(1, -1),
                             slot_mapping=t[2, :N], max_q_len=N)
        return self.forward(t[0, :N], t[1, :N], meta, t[3, :N])

    def fits(self, chunks) -> bool:
        return len(chunks) == 1 and len(chunks[0].token_ids) <= self.buckets[-1]

    def run_(self, chunk, page_size: int, next_ids: list[int] | None):
        n = len(chunk.token_ids)
        N = bucket_for(self.buckets, n)
        ht, hi = self._host_tokens, self._host_ints
        if self._copied is not None:
            self._copied.synchronize()
        s = torch.arange(chunk.start, chunk.start + n)
        pages = torch.tensor(chunk.pages, dtype=torch.int64)
        ht[:, :N].zero_()
        ht[0, :n] = torch.tensor(chunk.token_ids, dtype=torch.int64)
        ht[1, :n] = s
        ht[2, :N] = -1
        ht[2, :n] = pages[s // page_size] * page_size + s % page_size
        if next_ids is not None:  # None: no drafter reads them (row 3 stays zero)
            ht[3, :n] = torch.tensor(next_ids, dtype=torch.int64)
        hi.zero_()
        hi[1], hi[2] = n, chunk.start + n
        hi[3:3 + len(chunk.pages)] = pages.to(torch.int32)
        self.tokens[:, :N].copy_(ht[:, :N], non_blocking=True)
        self.ints.copy_(hi, non_blocking=True)
        if self.tokens.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if not self.graphed:
            return self._body(N)
        self.graphs[N].replay()
        return self.outputs[N]
