"""EAGLE-3 drafting: the draft head grows an EAGLE-2 tree from the target's features over its own
paged KV cache."""

from __future__ import annotations

import torch

from ..engine.state import upload
from ..errors import ConfigError
from ..models.ops import AttentionMeta
from . import tree_ops as ops  # the draft tree's kernels
from .tree import DraftTree, bit, grow_tree


def _tree_tuple(shape) -> tuple:
    """(topk, steps, num_draft_tokens) from a tuple or a mapping (a draft config's ``trees`` entry)."""
    if hasattr(shape, "get"):
        missing = [k for k in ("topk", "steps", "num_draft_tokens") if shape.get(k) is None]
        if missing:
            raise ConfigError(f"draft.trees entry {dict(shape)} lacks {missing}; each entry needs topk, steps "
                              "and num_draft_tokens")
        return shape["topk"], shape["steps"], shape["num_draft_tokens"]
    if len(shape) != 3:
        raise ConfigError(f"draft tree {shape!r}: need (topk, steps, num_draft_tokens)")
    return tuple(shape)


class Eagle3Drafter:
    """EAGLE-3 drafting: trees grown by the draft head over its own paged KV cache.

    Draft row j pairs the target's feature at position j with the token at j + 1 and sits in draft
    KV slot j (the target's page table addresses both pools). Invariant when a step drafts (after
    the engine's catch-up, the default; with ``sync_while_off`` after every commit): the draft KV
    covers slots 0 .. seq_len - 1 like the target's and ``root_hidden`` holds the output of row
    seq_len - 1. Its best ``topk`` children (``root_top``/``root_ids``: log-probs, draft ids), which
    predict the token after the pending one (the first tree level), are computed when a step
    drafts, at the start of ``propose``: a k = 0 step (speculation off) runs no draft work at all
    (catch-up) or only extends the draft KV (sync_while_off), never the draft lm_head. Only the best children of a node can enter a tree, so no step
    materialises a full draft distribution: the lm_head runs on the frontier rows only and one
    top-k kernel returns their log-probs.

    Tree growth: round r runs only the frontier (topk nodes at depth r + 1) at draft scratch slots
    seq_len + r * topk + i; the nodes of earlier rounds already hold their draft KV, and the
    attention's tree window (all scratch slots so far) with an ancestor mask lets each node see its
    own ancestors and nothing else of the tree.
    """

    name = "eagle3"
    needs_context = False
    capturable = True

    def __init__(self, head, target, *, trees=None, topk: int | None = None, steps: int | None = None,
                 num_draft_tokens: int | None = None, sync_while_off: bool = False, catch_up: bool = True):
        # The tree shapes a policy may pick from, each (topk, steps, num_draft_tokens); its size k is
        # num_draft_tokens (verify width k + 1). One place configures them (the draft config's
        # ``trees``); the single-shape keywords are the one-tree shorthand.
        if trees is None:
            if None in (topk, steps, num_draft_tokens):
                raise ConfigError("Eagle3Drafter needs trees=[(topk, steps, num_draft_tokens), ...] or all of "
                                  "topk, steps and num_draft_tokens")
            trees = [(topk, steps, num_draft_tokens)]
        self.trees: dict[int, tuple[int, int, int]] = {}
        for shape in trees:
            t, s, n = (int(x) for x in _tree_tuple(shape))
            if t < 1 or s < 1 or n < 1:
                raise ConfigError(f"draft tree topk={t}, steps={s}, num_draft_tokens={n}: all must be >= 1")
            if s * t > 63:
                raise ConfigError(f"draft tree topk={t}, steps={s}: {s * t} scratch nodes; at most 63")
            most = t + (s - 1) * t * t  # candidates a growth of this shape produces
            if n > most or n + 1 > 64:
                raise ConfigError(f"draft tree topk={t}, steps={s}, num_draft_tokens={n}: the growth yields "
                                  f"{most} candidates and a tree holds at most 63 drafts; lower num_draft_tokens")
            if n in self.trees:
                raise ConfigError(f"draft.trees lists two shapes of {n} draft tokens ({self.trees[n]} and "
                                  f"{(t, s, n)}): a policy picks a tree by its size, so sizes must differ")
            self.trees[n] = (t, s, n)
        if not self.trees:
            raise ConfigError("draft.trees is empty: list at least one (topk, steps, num_draft_tokens) shape")
        self.sizes = tuple(sorted(self.trees))
        self.head, self.target = head, target
        # Draft positions reach the target's limit, whatever the head's max_position_embeddings says.
        head.ensure_rope_(target.config.max_position_embeddings)
        self.topk = max(t for t, _, _ in self.trees.values())  # root children kept (the widest tree's)
        # While speculation is off (k = 0 steps), one of three behaviours:
        #   sync_while_off  every k = 0 step runs the draft layer over the committed token (extend), so
        #                   the draft KV is always in sync; costs a draft layer per off step;
        #   catch_up        (default) k = 0 steps run no draft work at all (the step is plain decoding's);
        #                   before the first drafting step after an off period the engine recomputes the
        #                   target's features over each row's backlog and extends the draft KV over it
        #                   in chunked forwards (specdec.engine.step.catch_up_body_), so the tree is
        #                   drafted from in-sync state;
        #   neither         left behind: the draft KV keeps holes over the tokens committed while off and
        #                   the root state goes stale (experiment=switch_acceptance measures it).
        self.sync_while_off = bool(sync_while_off)
        self.catches_up = bool(catch_up) and not self.sync_while_off
        self.capture_layers = tuple(head.config.target_layers)
        self.k_cache = self.v_cache = None
        self.root_hidden = self.root_top = self.root_ids = None
        # Tree sizes k whose trees carry their candidates and candidate ids (DraftTree.cand / cand_ids)
        # for the counterfactual acceptance of the smaller configured trees (``counterfactual_commits_``);
        # set by the engine when its policy asks for it, empty otherwise (the trees are what they were).
        self.counterfactual_sizes: set[int] = set()
        # Profiling only (specdec.engine.profiling.graphed_phases): called as ``propose``'s root children
        # and each growth round end, so a step's draft splits into phases; None when serving.
        self.phase_marks = None

    @property
    def extends_at_k0(self) -> bool:
        """True if a k = 0 step runs this drafter's extend (sync_while_off); else it runs no draft work."""
        return self.sync_while_off

    # -- sizes ---------------------------------------------------------------------------------
    def shape_for(self, k: int) -> tuple[int, int, int]:
        """(topk, steps, kept draft nodes) of the configured tree of k draft tokens."""
        shape = self.trees.get(int(k))
        if shape is None:
            raise ConfigError(f"k={k} is not a configured EAGLE-3 tree size; configured sizes (draft.trees "
                              f"num_draft_tokens): {list(self.sizes)}")
        return shape

    def num_nodes(self, k: int) -> int:
        return 1 + self.shape_for(k)[2]

    def max_path_nodes(self, T: int) -> int:
        """Nodes on the longest root-to-leaf path of the T-node trees ``propose`` builds (root + one
        per draft round): the most rows a step can commit, so the rows ``extend_`` runs."""
        return 1 if T <= 1 else min(T, self.shape_for(T - 1)[1] + 1)

    # -- counterfactual acceptance ---------------------------------------------------------------
    def counterfactual_label(self, small: int, large: int) -> str:
        """How the counterfactual commits of the tree of ``small`` draft tokens, read off the verified
        path of the tree of ``large`` (kernels_triton/counterfactual.py), relate to what drafting and
        verifying the small tree commits: "exact" (same growth, or a chain under a chain that holds
        it), "lower_bound" (a chain under a wider tree: exact membership, the chain's continuation
        past the large tree's leaf is missing) or "approximate" (other growths)."""
        (k1, s1, n1), (k2, s2, n2) = self.shape_for(small), self.shape_for(large)
        if n1 >= n2:
            raise ConfigError(f"counterfactual acceptance of k={small} under k={large}: needs a smaller tree")
        if (k1, s1) == (k2, s2):
            return "exact"
        if k1 == 1:
            return "exact" if k2 == 1 and min(s2, n2) >= min(s1, n1) else "lower_bound"
        return "approximate"

    def counterfactual_commits_(self, tree: DraftTree, nodes, accept_len, shapes, out, *, shapes_host=None,
                                max_steps=None) -> None:
        """Write into ``out`` [B, M] the tokens each of the smaller tree shapes ``shapes`` ([M, 3]
        int32 (topk, steps, num_draft_tokens), ``shapes_host`` the same as a host list) would have
        committed per row, from the verified path (``nodes`` / ``accept_len``) of ``tree`` (drafted
        with its candidate ids: its size in ``counterfactual_sizes``); device work only."""
        if tree.cand_ids is None:
            raise ValueError("counterfactual_commits_: the tree was drafted without candidate ids (add its size "
                             "to counterfactual_sizes before drafting it)")
        ops.counterfactual_commits(tree.cand, tree.cand_ids, tree.parents, nodes, accept_len, shapes, tree.topk, out,
                                   shapes_host=shapes_host, max_steps=max_steps, backend=self.head.backend)

    # -- state ---------------------------------------------------------------------------------
    def bind_(self, state, num_pages: int, page_size: int) -> None:
        self.k_cache, self.v_cache = self.head.new_kv_cache(num_pages, page_size)
        H = self.head.config.hidden_size
        # The root state follows its row; with catch-up only while the row is in sync (a row behind
        # is restaged by the catch-up before it drafts, so compactions while off move nothing). Its
        # children are recomputed from it at every propose: scratch, never moved.
        self.root_hidden = state.add_row_buffer("eagle3_root_hidden", (H,), self.head.dtype,
                                                follows="synced_rows" if self.catches_up else "rows")
        self.root_top = state.add_row_buffer("eagle3_root_top", (self.topk,), torch.float32, follows="none")
        self.root_ids = state.add_row_buffer("eagle3_root_ids", (self.topk,), torch.int64, follows="none")

    def _run(self, token_ids, hidden, positions, meta):
        """Draft layer over rows: token_ids [N] or [G, W] (target ids; < 0 reads id 0), hidden [N, H] ->
        (hidden [N, H], its rows' sums of squares or None: Eagle3Head.layer). The embedding rows are read
        by the layer's qkv kernel where it can (the fused path), not gathered by a launch of
        their own."""
        table = self.head.embedding_table(self.target)
        if self.head.gathers_rows(table, token_ids.numel()):
            ids = token_ids if token_ids.dim() == 2 else token_ids[None]  # [G, W]
            return self.head.layer(None, hidden, positions, meta, self.k_cache, self.v_cache, token_rows=(table, ids))
        emb = self.head.embed(token_ids.reshape(-1), self.target).to(self.head.dtype)
        return self.head.layer(emb, hidden, positions, meta, self.k_cache, self.v_cache)

    def _children(self, h, k: int, sumsq=None):
        """Best k children of draft hidden rows h [..., H] (``sumsq``: their sums of squares from _run):
        (log-probs fp32, draft ids) [..., k]."""
        lead = h.shape[:-1]
        v, i = ops.topk_logprobs(self.head.logits(h.reshape(-1, h.shape[-1]), sumsq), k, backend=self.head.backend)
        return v.view(*lead, k), i.view(*lead, k)

    def prefill_(self, ids, pos, meta: AttentionMeta, captured, next_ids):
        """Draft rows over prefill chunks (same slots/positions as the target's); returns the last
        row of each chunk, hidden [C, H] (its children are computed when a step drafts)."""
        h = self._run(next_ids, self.head.fuse(captured.to(self.head.dtype)), pos, meta)[0]
        return h[(meta.cu_q_lens[1:] - 1).long()]

    def stage_rows_(self, roots, chunk_idx: list[int], rows: list[int]) -> None:
        """Copy each chunk's root hidden into its decode row (-1: no prefill row, e.g. a 1-token
        prompt: zero state, so that row's drafts are arbitrary until its first step commits)."""
        # Two launches whatever the number of rows (a zero fill and one indexed copy), not one per row;
        # the indices are queued uploads (torch.tensor(..., device=cuda) would wait for the GPU).
        if not rows:
            return
        dev = self.root_hidden.device
        have = [(c, r) for c, r in zip(chunk_idx, rows) if roots is not None and c >= 0]
        none = [r for c, r in zip(chunk_idx, rows) if roots is None or c < 0]
        if none:
            self.root_hidden.index_fill_(0, upload(none, torch.int64, dev), 0)
        if have:
            src, dst = upload([c for c, _ in have], torch.int64, dev), upload([r for _, r in have], torch.int64, dev)
            self.root_hidden.index_copy_(0, dst, roots.index_select(0, src).to(self.root_hidden.dtype))

    # -- per step --------------------------------------------------------------------------------
    def _root_children_(self, B: int) -> None:
        """root_top / root_ids of rows 0 .. B-1 from root_hidden (the first tree level)."""
        ops.topk_logprobs(self.head.logits(self.root_hidden[:B]), self.topk, backend=self.head.backend,
                          out=(self.root_top[:B], self.root_ids[:B]))

    def propose(self, state, B: int, T: int, valid, context=None) -> DraftTree:
        """Grow the tree: one draft forward per round over that round's K new frontier nodes, each
        round's bookkeeping (child scores, next frontier, next rows) in one ``ops.tree_expand`` and the
        final selection in one ``ops.tree_select`` (kernels_triton/tree_grow.py on the Triton backend).
        Builds the same tree as :meth:`propose_reference` (``grow_tree`` over torch ops)."""
        topk, steps, kept = self.shape_for(T - 1)
        be = self.head.backend
        self._root_children_(B)
        marks = self.phase_marks
        if marks:
            marks("draft_root")
        seq = state.seq_lens[:B]
        dev, H = seq.device, self.head.config.hidden_size
        K = topk
        cand = ops.new_tree_candidates(B, K + (steps - 1) * K * K, dev)
        d2t = self.head.draft_to_target_table()
        score, fcid, rows = ops.tree_expand(cand, 0, 1, self.root_top[:B, None, :K], self.root_ids[:B, None, :K], d2t,
                                            rows=(None, 0) if steps > 1 else None, h_front=self.root_hidden[:B, None],
                                            valid=valid, seq=seq, backend=be)
        for r in range(steps - 1):  # round r runs the K frontier nodes of depth r + 1: scratch rows rK .. rK + K - 1
            n = r * K
            tok, pos, mask, hid = rows
            meta, _ = state.block_meta(B, seq, K, valid, mask.reshape(-1), offset=n, tree_window=n + K)
            h, sumsq = self._run(tok.reshape(-1), hid.reshape(B * K, H), pos.reshape(-1), meta)
            h = h.view(B, K, H)
            lp, ids = self._children(h, K, sumsq)  # [B, K, K] each
            more = r < steps - 2
            score, fcid, rows = ops.tree_expand(cand, K + r * K * K, r + 2, lp, ids, d2t, score, fcid,
                                                (mask, n + K) if more else None, h, valid, seq, backend=be)
            if marks:
                marks(f"draft_round{r + 1}")
        if T - 1 not in self.counterfactual_sizes:
            return DraftTree(*ops.tree_select(state.pending[:B], cand, kept, steps, backend=be))
        *tree, cid = ops.tree_select(state.pending[:B], cand, kept, steps, backend=be, cand_ids=True)
        return DraftTree(*tree, cand=cand, cand_ids=cid, topk=K)

    def propose_reference(self, state, B: int, T: int, valid, context=None) -> DraftTree:
        """The same tree through ``grow_tree`` and torch ops (a readable reference for tests).

        Round r runs the frontier (topk nodes at depth r + 1) at draft scratch slots seq_len + rK + i;
        the nodes of earlier rounds are already in the draft cache, and the ancestor mask over the
        window of the (r + 1) K scratch slots lets each node see only its own ancestors."""
        topk, steps, kept = self.shape_for(T - 1)
        self._root_children_(B)
        seq = state.seq_lens[:B]
        outs = {}
        node_bits = bit(torch.arange(steps * topk, device=seq.device))  # scratch node j -> 1 << j

        def expand(r: int, tokens, parent_slot):
            # tokens [B, topk] of depth r + 1; parents are round r - 1's frontier (or the root).
            if r == 0:
                hid = self.root_hidden[:B, None, :].expand(B, topk, -1)
                par_mask = torch.zeros(B, topk, dtype=torch.int64, device=seq.device)
            else:
                prev_h, prev_mask = outs[r - 1]
                idx = parent_slot.long()
                hid = prev_h.gather(1, idx[:, :, None].expand(-1, -1, prev_h.shape[-1]))
                par_mask = prev_mask.gather(1, idx)
            mask = par_mask | node_bits[None, r * topk:(r + 1) * topk]  # the new nodes' own bits
            n = r * topk
            meta, _ = state.block_meta(B, seq, topk, valid, mask.reshape(-1), offset=n, tree_window=n + topk)
            ids = torch.where(valid[:, None], tokens, 0).reshape(-1)
            pos = (seq.long() + r)[:, None].expand(B, topk).reshape(-1)  # depth r+1 node -> position s + r
            h, sumsq = self._run(ids, hid.reshape(B * topk, -1), pos, meta)
            h = h.view(B, topk, -1)
            outs[r] = (h, mask)
            return self._children(h, topk, sumsq)  # [B, topk, topk] each

        return grow_tree(state.pending[:B], (self.root_top[:B], self.root_ids[:B]), expand, topk=topk,
                         steps=steps, num_draft_tokens=kept, to_target=self.head.to_target_ids,
                         cand_ids=T - 1 in self.counterfactual_sizes)

    @torch.no_grad()  # inference only; the gather below writes straight into the root buffer
    def extend_(self, state, B: int, T: int, valid, seq_old, captured, nodes, out_tokens, accept_len,
                verify=None) -> None:
        """Draft rows seq_old + i (i < T) pairing the feature of accepted path node i with the
        committed token after it; rows past accept_len are scratch (overwritten later), so the
        shapes stay static. Leaves root_hidden = output of row seq_old + accept_len (its children
        are computed by the next propose).

        A k = 0 step (T = 1, speculation off) extends by one row per request, the one the target
        just ran: its feature is the step's only captured row, its token the new pending one, and
        its slot and position are the target's (``verify``: the target's meta and positions), so
        that step runs the draft layer with no gather, clamp or second block-meta launch."""
        if T == 1 and not self.sync_while_off:
            return  # the step body skips the drafter at k = 0 then; kept for direct callers
        if T == 1 and verify is not None:
            meta, pos = verify
            # After the commit, pending = the committed token of every live row (padding rows keep an
            # earlier, valid id: they run on garbage that nothing reads, like every padding row).
            h = self._run(state.pending[:B], self.head.fuse(captured.to(self.head.dtype)), pos, meta)[0]
            self.root_hidden[:B].copy_(h)
            return
        # Only an accepted path's rows can be committed: a 49-node tree extends over 8 rows, not 49.
        Te = self.max_path_nodes(T)
        # Row b * Te + i: the feature of accepted node nodes[b, i] (row b * T + node of captured) and the
        # committed token out_tokens[b, i]; -1 past the path reads node / token 0 (a scratch row). Both
        # are gathered (and clamped) inside the fc and qkv kernels on the Triton backend.
        meta, slot_l = state.block_meta(B, seq_old, Te, valid)  # causal rows seq_old .. seq_old + Te - 1
        if self.head.gathers_rows(self.head.embedding_table(self.target), B * Te, captured):
            h = self._run(out_tokens[:, :Te], self.head.fuse_rows(captured, nodes[:, :Te], T), slot_l.reshape(-1),
                          meta)[0]
        else:  # the same rows by torch ops: 4 launches more (unfused path: many rows, CPU)
            H3 = captured.shape[-1]
            path = nodes[:, :Te].clamp(min=0).long()  # [B, Te]
            feat = captured.view(B, T, H3).gather(1, path[:, :, None].expand(-1, -1, H3))  # [B, Te, H3]
            tok = out_tokens[:, :Te].clamp(min=0)  # [B, Te]; -1 (past the path) -> 0, a scratch row
            h = self._run(tok.reshape(-1), self.head.fuse(feat.reshape(B * Te, H3).to(self.head.dtype)),
                          slot_l.reshape(-1), meta)[0]
        last = accept_len.long()[:, None, None].expand(-1, 1, h.shape[-1])  # [B, 1, H]
        # Padding rows (>= num_active) take garbage here too: their root state is never read, and a
        # row becomes live only through stage_rows_ (which writes it) or keep_rows_ (a live row's).
        torch.gather(h.view(B, Te, -1), 1, last, out=self.root_hidden[:B, None])  # root = row accept_len
