"""n-gram drafting (prompt lookup, no weights): find the latest earlier occurrence of the row's
last n tokens (n = max_ngram .. min_ngram) in its own history and propose what followed."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .tree import DraftTree, bit


class NgramDrafter:
    """Prompt-lookup drafting: a chain of up to k tokens copied from the row's own history.

    The lookup runs on the host (over the committed tokens the scheduler already has) in
    ``prepare_``, which uploads the chains into static device buffers with one copy; ``propose``
    only reads those buffers, so the verify step stays a CUDA graph.
    """

    name = "ngram"
    capture_layers: tuple[int, ...] = ()
    needs_context = True
    capturable = True
    extends_at_k0 = False  # no draft state: a k = 0 step is plain decoding's step
    prefills = False  # no draft state over the prompt either: prefill is the target's alone

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

    def prefill_(self, ids, pos, meta, captured, next_ids):
        return None

    def prepare_(self, state, n: int, T: int, context) -> None:
        """Look up each row's chain on the host and upload it (one copy, before the graph runs)."""
        host = self._host
        host[:n, :T].fill_(-1)
        for r, hist in enumerate((context or [])[:n]):
            follow = self.lookup(hist, T - 1)
            if follow:
                host[r, 1:len(follow) + 1] = torch.tensor(follow, dtype=torch.int64)
        self.buf[:n, :T].copy_(host[:n, :T], non_blocking=True)

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

    def shadow_commits(self, history: list[int], start: int, k: int) -> int:
        """Tokens a greedy step with a k-token chain would have committed at ``start`` (the row's
        committed tokens were history[:start]), read off the tokens committed since: the chain is
        this lookup over history[:start], and greedy verification accepts its longest prefix that
        equals what the target committed, plus the bonus token. Needs start + k <= len(history).
        Exact for greedy decoding (the same lookup ``prepare_`` runs); lets a policy measure the
        acceptance of every chain length while speculation is off, with no device work."""
        if not 0 < start <= len(history) - k:
            raise ValueError(f"shadow_commits: start={start}, k={k} needs 0 < start <= {len(history) - k}")
        follow = self.lookup(history[:start], k)
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
