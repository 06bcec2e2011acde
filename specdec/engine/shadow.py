"""Shadow acceptance: what speculation at each k would have committed, at no device cost.

A drafter whose draft is a function of the committed tokens alone (n-gram: a lookup over them) can
score a draft after the fact: ``drafter.shadow_commits(history, start, k)`` is what a step with k
draft tokens at ``start`` would have committed under greedy verification, read off the tokens the
steps committed since. Walking each (request, k) the way an always-k run would step (start +=
committed) gives samples from the same distribution a policy sees when it speculates at k (per step,
not per token: a long accepted run counts once), so an adaptive policy can keep a(k) of every k
current while it runs k = 0, without re-trying speculation: re-tries cannot estimate an acceptance
whose mean rests on rare long runs (most n-gram drafts accept nothing, a few accept every token).

The engine scores on every step, speculative ones too (there only the ks above the step's own: its
commits are exact samples of its k and, with chains that nest, of every smaller one). Scored on
k = 0 steps only, the samples would come from the stretches a policy left speculation off in, which
it picks where a request's text stops repeating: a prior biased low.

Host work is bounded: at most ``evals_per_step`` lookups per step, round-robin over the rows and the
ks (a (request, k) walk that falls behind stays exact; it samples older text). The n-gram drafter
finds each suffix with ``bytes.rfind`` over the packed tokens (``NgramDrafter.follow_at``), an order
of magnitude cheaper than a Python scan: the lookups run between steps, on the host's time."""

from __future__ import annotations

import time
from typing import Callable


class ShadowAcceptance:
    """Samples (k, request id, committed) of the always-k walk over rows' committed tokens."""

    def __init__(self, drafter, ks, evals_per_step: int = 2):
        self.score = drafter.shadow_commits
        self.ks = tuple(k for k in sorted(ks) if k > 0)
        self.evals_per_step = int(evals_per_step)
        self.next_start: dict[tuple[str, int], int] = {}  # (request id, k) -> the walk's next start
        self._cursor = 0  # round-robin position over rows x ks
        self.lookups = 0
        self.lookup_s = 0.0  # host seconds spent scoring (the drafter's own lookups)

    def samples_(self, ids: list[str], history: Callable[[int], list[int]],
                 above: int = 0) -> list[tuple[int, str, int]]:
        """Score up to evals_per_step drafts over rows ``ids`` (``history(i)``: row i's committed
        tokens, called only for the rows scored) at the ks above ``above`` (a speculative step's own
        k and the chains nested in it have exact samples already); mutates the walks and the cursor."""
        ks = self.ks if above <= 0 else tuple(k for k in self.ks if k > above)
        pairs = len(ids) * len(ks)
        if not pairs or self.evals_per_step <= 0:
            return []
        if len(self.next_start) > 4 * pairs:  # requests that left the batch
            live = set(ids)
            self.next_start = {key: s for key, s in self.next_start.items() if key[0] in live}
        out: list[tuple[int, str, int]] = []
        seen: dict[int, list[int]] = {}
        t0 = time.perf_counter()
        for _ in range(min(self.evals_per_step, pairs)):
            j = self._cursor % pairs
            self._cursor = j + 1
            i, k = divmod(j, len(ks))
            k = ks[k]
            rid = ids[i]
            hist = seen.get(i)
            if hist is None:
                hist = seen[i] = history(i)
            start = self.next_start.get((rid, k))
            if start is None:  # a new walk starts at the newest draft the tokens can score
                start = len(hist) - k
            if start < 1 or start + k > len(hist):
                continue
            c = self.score(hist, start, k)
            self.next_start[(rid, k)] = start + c
            out.append((k, rid, c))
        self.lookups += len(out)
        self.lookup_s += time.perf_counter() - t0
        return out
