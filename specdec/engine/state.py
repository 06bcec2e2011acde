"""DecodeState: the batch as device tensors, one row per running (decode-ready) request.

Per row r < num_rows, for the request the scheduler keeps in row r:

    pending[r]     the last committed token; its KV is NOT written yet (the next step computes it)
    seq_lens[r]    tokens whose KV is written = committed tokens - 1
    page_table[r]  the request's pages (logical slot s -> page_table[r, s // PS], offset s % PS)

A step reads these, writes KV at slots seq_lens[r] .. seq_lens[r] + T_r - 1 (scratch: only commit
makes them count), samples, and commits: ``pending`` becomes the last committed token and
``seq_lens`` advances by the committed count. Slots at or past seq_lens are never trusted, so
rejected speculative KV needs no cleanup.

Rows past num_rows are stale and must be ignored: the step masks them with ``row_ids < num_active``
(a device scalar, so a CUDA graph captured for a bucket of B rows serves any num_rows <= B).

The host keeps a mirror (``seq_lens_host``) updated from the committed tokens it already reads each
step, so scheduling never reads device memory.

A step's output, read back in one copy (``step_out``), is per row: the committed tokens (T columns),
then any counterfactual commits (M), then for a speculative step (T > 1) its acceptance statistics
(T + 1 columns: the depth the row drafted, its draft nodes, then the sibling rank of the accepted
node at each depth; kernels_triton/accept_stats.py). With per-row sampling (``sampling`` given) each row also carries
its request's (temperature, top_k, top_p, min_p) in ``sampling`` [R, 4], which follows the rows.
"""

from __future__ import annotations

import operator

import torch


def host_tensor(values, dtype, device) -> torch.Tensor:
    """``values`` as a host tensor bound for ``device``: in pinned memory when that is a GPU, so a
    non_blocking copy from it is queued without waiting for the GPU work queued before it (from
    pageable memory the driver may synchronize with the stream to stage the copy: CUDA's "API
    synchronization behavior"; with overlapped decoding that would wait for the step in flight).
    Each call allocates afresh from torch's pinned-memory cache, which keeps a block until the copies
    queued from it have run, so nothing overwrites a buffer still being copied."""
    return torch.tensor(values, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


def upload(values, dtype, device) -> torch.Tensor:
    """Host list -> device tensor without waiting for queued GPU work (small transfers only)."""
    return host_tensor(values, dtype, device).to(device, non_blocking=True)


class DecodeState:
    def __init__(self, max_rows: int, max_pages_per_row: int, page_size: int, device, seed: int = 0,
                 max_tree_nodes: int = 1):
        dev = torch.device(device)
        self.device = dev
        self.max_rows = max_rows
        self.max_pages_per_row = max_pages_per_row
        self.page_size = page_size
        self.pending = torch.zeros(max_rows, dtype=torch.int64, device=dev)  # [R]
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=dev)  # [R]
        self.page_table = torch.zeros(max_rows, max_pages_per_row, dtype=torch.int32, device=dev)  # [R, MP]
        self.row_ids = torch.arange(max_rows, dtype=torch.int32, device=dev)  # [R] for the validity mask
        self.num_active = torch.zeros((), dtype=torch.int32, device=dev)  # num_rows as a graph input
        self.max_tree_nodes = max_tree_nodes  # T: tree nodes a step may verify per row (1 = k 0)
        # [R, T, 2] draws for verification: acceptance coin and bonus draw per node
        self.uniform = torch.zeros(max_rows, max_tree_nodes, 2, dtype=torch.float32, device=dev)
        # [R, T] step output: committed tokens of each row (accepted drafts + bonus), then -1
        self.sampled = torch.full((max_rows, max_tree_nodes), -1, dtype=torch.int64, device=dev)
        # The same storage as a contiguous [R, T] view per tree size T (``sampled_for``): a step's
        # output rows [:n] are one dense block, so the k = 0 read-back is a plain copy of n tokens
        # whatever the largest tree (a [:n, :1] column of [R, 17] is strided: another copy path).
        self._sampled_flat = self.sampled.view(-1)
        # Extra int64 columns after a T-node step's tokens (``step_out``): the counterfactual commits
        # of the smaller trees (set_cf_widths_, by an engine whose policy asks for them); none by default.
        self.cf_widths: dict[int, int] = {}
        self._grow_step_out_()
        # The k = 0 tree's constant parents / depth / mask per row (viewed, never written).
        self.root_tree_consts = (torch.full((max_rows, 1), -1, dtype=torch.int32, device=dev),
                                 torch.zeros(max_rows, 1, dtype=torch.int32, device=dev),
                                 torch.ones(max_rows, 1, dtype=torch.int64, device=dev))
        # Per-row tensors of other modules (a drafter's root state) that follow row compaction, and
        # those of them read only for rows whose draft is in sync (see add_row_buffer).
        self.row_buffers: dict[str, torch.Tensor] = {}
        self._synced_row_buffers: set[str] = set()
        # [R, 4] per-row sampling parameters (temperature, top_k, top_p, min_p), read by steps that sample
        # per row (each request may bring its own; rows appended without get ``default_sampling``,
        # which the stepper sets from the engine's config). 16 bytes a row: kept whatever the mode.
        self.default_sampling = (0.0, 0.0, 1.0, 0.0)  # greedy, warpers off
        self.sampling = self.add_row_buffer("sampling", (4,), torch.float32)
        # One generator per engine: seeded runs are reproducible; draws happen outside CUDA graphs.
        self.generator = torch.Generator(device=dev).manual_seed(int(seed))
        self.num_rows = 0
        self.seq_lens_host: list[int] = []  # mirror of seq_lens[:num_rows]
        # Per row, the tokens whose draft KV is written (drafters that catch up after k = 0 steps;
        # see Engine.step): equal to seq_lens_host while in sync, behind it by the backlog of tokens
        # committed while speculation was off. Maintained by the host only (no device copy).
        self.draft_lens_host: list[int] = []

    @staticmethod
    def stats_width(T: int) -> int:
        """Acceptance-statistics columns of a T-node step's output: T + 1 for a speculative step (drafted
        depth, draft nodes, then the accepted sibling rank at depths 1 .. T - 1), none at T = 1."""
        return T + 1 if T > 1 else 0

    def _width(self, T: int) -> int:
        return T + self.cf_widths.get(T, 0) + self.stats_width(T)

    def sampled_for(self, T: int) -> torch.Tensor:
        """[max_rows, T] view of the step-output buffer for steps of T-node trees (contiguous at T = 1;
        a speculative step's rows have stride T + M + S: its counterfactual and statistics columns follow)."""
        w = self._width(T)
        if w == T:
            return self._sampled_flat[: self.max_rows * T].view(self.max_rows, T)
        return self.step_out(T)[:, :T]

    def step_out(self, T: int) -> torch.Tensor:
        """[max_rows, T + M + S] contiguous view of a T-node step's whole output, the one tensor read
        back: committed tokens then -1 (T columns), the M counterfactual commits (M = 0 unless set),
        the S acceptance statistics (``stats_out``)."""
        w = self._width(T)
        return self._sampled_flat[: self.max_rows * w].view(self.max_rows, w)

    @property
    def step_out_capacity(self) -> int:
        """Elements of the step-output buffer (every T's ``step_out`` fits in it)."""
        return self._sampled_flat.numel()

    def cf_out(self, T: int) -> torch.Tensor:
        """[max_rows, M] (row stride T + M + S) the counterfactual columns of a T-node step's output."""
        return self.step_out(T)[:, T:T + self.cf_widths.get(T, 0)]

    def stats_out(self, T: int) -> torch.Tensor:
        """[max_rows, S] (row stride T + M + S) the acceptance-statistics columns of a T-node step's output."""
        return self.step_out(T)[:, T + self.cf_widths.get(T, 0):]

    def set_cf_widths_(self, widths: dict[int, int]) -> None:
        """Reserve M counterfactual columns after the tokens of T-node steps ({T: M}); before any
        step runs (graphs capture the buffer) and before the stepper sizes its read-back buffers."""
        self.cf_widths = {int(t): int(m) for t, m in widths.items() if int(m) > 0}
        self._grow_step_out_()

    def _grow_step_out_(self) -> None:
        """Size the step-output buffer for every tree size's output (the largest tree's, or a
        counterfactual size's); ``sampled`` stays the [R, max_tree_nodes] view of its start."""
        T = self.max_tree_nodes
        need = self.max_rows * max([self._width(T), *(self._width(t) for t in self.cf_widths)])
        if need > self._sampled_flat.numel():
            self._sampled_flat = torch.full((need,), -1, dtype=torch.int64, device=self.device)
            self.sampled = self._sampled_flat[: self.max_rows * T].view(self.max_rows, T)

    def append_rows_(self, pending: list[int], seq_lens: list[int], pages: list[list[int]],
                     draft_lens: list[int] | None = None, sampling: list | None = None) -> list[int]:
        """Append rows for requests that became decode-ready; returns their row indices.
        ``draft_lens``: tokens of each whose draft KV its prefill wrote (None: all of them).
        ``sampling``: each one's (temperature, top_k, top_p, min_p), or None for ``default_sampling``.

        Mutates rows num_rows .. num_rows + m - 1 and num_rows.
        """
        m = len(pending)
        if m == 0:
            return []
        r0 = self.num_rows
        if r0 + m > self.max_rows:
            raise RuntimeError(f"DecodeState: {r0} + {m} rows exceed max_rows={self.max_rows}")
        table = torch.zeros(m, self.max_pages_per_row, dtype=torch.int32,  # [m, MP] host (see host_tensor)
                            pin_memory=self.device.type == "cuda")
        for i, p in enumerate(pages):
            if len(p) > self.max_pages_per_row:
                raise RuntimeError(f"DecodeState: {len(p)} pages exceed max_pages_per_row={self.max_pages_per_row}")
            table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
        self.pending[r0 : r0 + m] = upload(pending, torch.int64, self.device)
        self.seq_lens[r0 : r0 + m] = upload(seq_lens, torch.int32, self.device)
        self.page_table[r0 : r0 + m] = table.to(self.device, non_blocking=True)
        rows = [self.default_sampling if p is None else p for p in (sampling or [None] * m)]
        self.sampling[r0 : r0 + m] = upload(rows, torch.float32, self.device)
        self.num_rows += m
        self.seq_lens_host.extend(seq_lens)
        # A prefill run while speculation was off skips the draft (catch-up covers it on resume).
        self.draft_lens_host.extend(seq_lens if draft_lens is None else draft_lens)
        return list(range(r0, r0 + m))

    def keep_rows_(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in that order), compacted to rows 0 .. len(keep) - 1.

        Mutates pending, seq_lens, page_table, num_rows and the host mirror. Only called when some
        request leaves the batch (finish, abort, preemption), not on every step.
        """
        if keep == list(range(self.num_rows)):
            return
        m = len(keep)
        self.seq_lens_host = [self.seq_lens_host[r] for r in keep]
        self.draft_lens_host = [self.draft_lens_host[r] for r in keep]
        if m:
            idx = upload(keep, torch.int64, self.device)  # [m]
            self.pending[:m] = self.pending[idx]
            self.seq_lens[:m] = self.seq_lens[idx]
            self.page_table[:m] = self.page_table[idx]
            # Buffers read only for in-sync rows stay put while no kept row is in sync (speculation
            # off: every row is behind, and the catch-up restages each one before it drafts).
            synced = bool(self._synced_row_buffers) and any(
                map(operator.eq, self.draft_lens_host, self.seq_lens_host))
            for name, buf in self.row_buffers.items():
                if synced or name not in self._synced_row_buffers:
                    buf[:m] = buf[idx]
        self.num_rows = m

    def set_pages_(self, rows: list[int], cols: list[int], pages: list[int]) -> None:
        """page_table[rows[i], cols[i]] = pages[i] (pages added to running requests); one upload."""
        if not rows:
            return
        rcp = upload([rows, cols, pages], torch.int64, self.device)  # one transfer of the three lists
        self.page_table.index_put_((rcp[0], rcp[1]), rcp[2].to(self.page_table.dtype))

    def add_row_buffer(self, name: str, shape: tuple[int, ...], dtype, *, follows: str = "rows") -> torch.Tensor:
        """A [max_rows, *shape] device tensor of per-row values. ``follows`` says what keep_rows_
        does with it: "rows" (default) compacts it along with the rows; "synced_rows" likewise, but
        only when some kept row's draft is in sync (draft_lens_host == seq_lens_host): its value is
        read for in-sync rows only, a row behind is rewritten before it is read (a drafter that
        catches up), so while speculation is off no compaction moves it; "none": rewritten for every
        row before each read (scratch), never moved."""
        if follows not in ("rows", "synced_rows", "none"):
            raise ValueError(f"add_row_buffer({name!r}): follows={follows!r}; valid: rows, synced_rows, none")
        buf = torch.zeros(self.max_rows, *shape, dtype=dtype, device=self.device)
        if follows != "none":
            self.row_buffers[name] = buf
        if follows == "synced_rows":
            self._synced_row_buffers.add(name)
        return buf

    def block_meta(self, B: int, start, n: int, valid, tree_mask=None, offset: int = 0, tree_window=None):
        """AttentionMeta for n new tokens per row at logical slots start[b] + offset .. start[b] +
        offset + n - 1 (rows 0 .. B-1; padding rows get T_b = 0 and slot -1), with an optional tree
        mask over a window of ``tree_window`` slots. One launch on the GPU (kernels_triton/paging.py);
        device ops only (capturable).

        Returns (meta, logical slots [B, n] int64) -- the logical slot is also the RoPE position of
        a causal block, so callers that need it don't recompute it.
        """
        from ..models.ops import AttentionMeta
        from .step_ops import block_meta

        slot, pos, cu, kv_lens = block_meta(start, valid, self.page_table[:B], n, self.page_size, offset)
        meta = AttentionMeta(cu_q_lens=cu, kv_lens=kv_lens, page_table=self.page_table[:B], slot_mapping=slot,
                             max_q_len=n, tree_mask=tree_mask, tree_window=tree_window)
        return meta, pos

    def tree_meta(self, B: int, start, valid, tokens, depth, tree_mask=None):
        """AttentionMeta plus target inputs for verifying trees of n = tokens.shape[1] nodes per row:
        node j at logical slot start[b] + j, RoPE position start[b] + depth[b, j]. One launch on the GPU.
        Returns (meta, input ids [B*n] int64, positions [B*n] int64); padding rows get ids/positions 0."""
        from ..models.ops import AttentionMeta
        from .step_ops import tree_meta

        slot, pos, ids, cu, kv_lens = tree_meta(start, valid, self.page_table[:B], tokens, depth, self.page_size)
        meta = AttentionMeta(cu_q_lens=cu, kv_lens=kv_lens, page_table=self.page_table[:B], slot_mapping=slot,
                             max_q_len=tokens.shape[1], tree_mask=tree_mask)
        return meta, ids, pos.reshape(-1)
