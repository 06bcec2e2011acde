"""Shadow acceptance: what speculation at each k would have committed, at no device cost.

A drafter whose draft is a function of the committed tokens alone (n-gram: a lookup over them) can
score a draft after the fact: ``drafter.shadow_commits(history, start, k)`` is what a step with k
draft tokens at ``start`` would have committed under greedy verification, read off the tokens the
steps committed since. Walking each (request, k) the way an always-k run would step (start +=
committed) gives samples from the same distribution a policy sees when it speculates at k (per step,
not per token: a long accepted run counts once), so an adaptive policy can keep a(k) of every k
current while it runs k = 0, without re-trying speculation. The engine scores on every step,
speculative ones too (there only the ks above the step's own: its commits are exact samples of its k
and, with chains that nest, of every smaller one): scored on k = 0 steps only, the samples come from
the stretches a policy left speculation off in, which goodput picks where a request's text stops
repeating (H200 envelope at a93dbd1, n-gram on HumanEval, C = 1: prior a(8) 1.44 where always chain
8 accepted 2.15; experiments/sim_shadow_bias.py over greedy SmolLM2 answers: shadow mean of chain 8
1.26 scored at k = 0 only, 2.01 on every step, 2.10 for the always-8 walk over the same text).

Host work is bounded: at most ``evals_per_step`` lookups per step, round-robin over the rows and the
ks (a (request, k) walk that falls behind stays exact; it samples older text, unless ``max_lag``
restarts it at the newest position). The n-gram drafter finds each suffix with ``bytes.rfind`` over
the packed tokens (``NgramDrafter.follow_at``): on this CPU two lookups in 300-token histories cost
~20 us a step against ~200 us for the Python scan, which under goodput at k = 0 (scoring every step
once its drafting was priced by the index) was 7-10% of a SmolLM2 iteration at C = 64 (H200 at
ca37d2e, staggered: goodput at k = 0 on 99-100% of its steps served 0.90x of never with random
weights, 0.91x on MT-bench; spec/policy_ca37d2e). H200 policy envelope at 41d1e6b: n-gram goodput
ran 98% of its C = 1 steps at k = 0 where chain 8 won 1.18x, because its few re-tries (22 steps)
could not estimate an acceptance whose mean rests on rare long runs (597 of 893 steps accept
nothing, 70 accept all 8)."""

from __future__ import annotations

import time
from typing import Callable


class ShadowAcceptance:
    """Samples (k, request id, committed) of the always-k walk over rows' committed tokens."""

    def __init__(self, drafter, ks, evals_per_step: int = 2, max_lag: int | None = None):
        self.score = drafter.shadow_commits
        self.ks = tuple(k for k in sorted(ks) if k > 0)
        self.evals_per_step = int(evals_per_step)
        # A walk more than this many tokens behind the newest position it can score restarts there
        # (None: walks never skip)
        self.max_lag = None if max_lag is None else int(max_lag)
        self.restarts = 0
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
            elif self.max_lag is not None and len(hist) - k - start > self.max_lag:
                start = len(hist) - k  # fallen behind: score the recent text
                self.restarts += 1
            if start < 1 or start + k > len(hist):
                continue
            c = self.score(hist, start, k)
            self.next_start[(rid, k)] = start + c
            out.append((k, rid, c))
        self.lookups += len(out)
        self.lookup_s += time.perf_counter() - t0
        return out
