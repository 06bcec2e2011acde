"""The drafter protocol: propose a tree of draft tokens per row; the target verifies it in one forward.

One interface (used by :func:`specdec.engine.step.step_body_`):

    capture_layers          target layers whose input residual stream the drafter reads (or ())
    needs_context           True if prepare_() wants each row's committed tokens (host lists; the
                            engine passes a RowTokens, which also names each row's request)
    capturable              True if propose() is pure device work (CUDA-graph capturable)
    prepare_(state, n, T, context)
                            host-side work before the step (outside any graph), e.g. uploading
                            looked-up drafts into static buffers that propose() then reads
    num_nodes(k)            tree nodes per row for k draft tokens (root included)
    bind_(state, P, PS)     allocate per-engine state (draft KV mirroring the target's pages)
    prefill_(...)           extend draft state over prefill chunks; returns per-chunk root state
    stage_rows_(...)        hand that root state to the decode rows the chunks became
    propose(state, B, T, valid, context) -> DraftTree
    extend_(state, B, T, valid, seq_old, captured, nodes, out_tokens, accept_len, verify)
                            after every drafting step (and every k = 0 step if extends_at_k0):
                            extend over the committed tokens; verify = the target's
                            (AttentionMeta, positions) of the step's tree
    sizes                   the draft lengths k it is configured for (EAGLE-3: its trees'
                            num_draft_tokens; n-gram: its chain lengths), or None (any k)
    extends_at_k0           True: k = 0 steps run extend_ (and capture target features); False:
                            a k = 0 step runs exactly plain decoding's step body (default True)
    catches_up              True: the engine calls catch-up (target features recomputed over the
                            tokens committed while off, the drafter's prefill_ over them; without
                            capture_layers the prefill_ alone) before the first drafting step after
                            k = 0 steps (default False)
    prefills                False: prefill_ does nothing (the prefill forward skips it; default True)
"""

from __future__ import annotations

from collections.abc import Sequence

from typing import Protocol, runtime_checkable

from .tree import DraftTree


@runtime_checkable
class Drafter(Protocol):
    """What the step needs of a drafter (see the module docstring for each member)."""

    name: str
    capture_layers: tuple[int, ...]
    needs_context: bool
    capturable: bool

    def num_nodes(self, k: int) -> int: ...

    def bind_(self, state, num_pages: int, page_size: int) -> None: ...

    def prefill_(self, ids, pos, meta, captured, next_ids): ...

    def stage_rows_(self, roots, chunk_idx: list[int], rows: list[int]) -> None: ...

    def propose(self, state, B: int, T: int, valid, context=None) -> DraftTree: ...

    def extend_(self, *args) -> None: ...


def needs_context(drafter) -> bool:
    """True if the drafter drafts from the host's committed tokens (its prepare_ gets them)."""
    return bool(getattr(drafter, "needs_context", False))


def capturable(drafter) -> bool:
    """True if propose() is pure device work (CUDA-graph capturable)."""
    return bool(getattr(drafter, "capturable", True))


def preparer(drafter):
    """The drafter's host-side prepare_ hook, or None."""
    return getattr(drafter, "prepare_", None)


def sizes(drafter) -> tuple[int, ...] | None:
    """The draft lengths k the drafter is configured for (None: any k, or no drafter)."""
    return None if drafter is None else getattr(drafter, "sizes", None)


def extends_at_k0(drafter) -> bool:
    """True if a k = 0 step must run the drafter (extend_ over the committed token)."""
    return drafter is not None and bool(getattr(drafter, "extends_at_k0", True))


def catches_up(drafter) -> bool:
    """True if the engine must catch the drafter up over the tokens committed while k = 0."""
    return drafter is not None and bool(getattr(drafter, "catches_up", False))


def prefills(drafter) -> bool:
    """True if the prefill forward must run the drafter's prefill_ (and capture target features)."""
    return drafter is not None and bool(getattr(drafter, "prefills", True))


class RowTokens(Sequence):
    """Each decode row's committed tokens (a sequence of token lists, what ``prepare_`` reads) that
    also names its rows: ``keys[i]`` identifies row i's request, so a drafter may keep per-request
    state across steps (the n-gram index); drafters that ignore it read it as a list of lists.

    Built from the token lists (``rows``) or lazily from ``parts``: per row its request's (prompt,
    output) lists, whose concatenation a row's tokens are, made only for the rows read (the engine
    passes parts: a drafter that keeps per-request state reads only the output tokens committed
    since it last looked, and the output list's identity tells a new request under an old id)."""

    def __init__(self, rows=None, keys=(), parts=None):
        if (rows is None) == (parts is None):
            raise ValueError("RowTokens: give rows or parts")
        self._rows, self.parts, self.keys = rows, parts, list(keys)

    def __len__(self) -> int:
        return len(self._rows if self._rows is not None else self.parts)

    def __getitem__(self, i):
        if self._rows is not None:
            return self._rows[i]
        if isinstance(i, slice):
            return [p + o for p, o in self.parts[i]]
        p, o = self.parts[i]
        return p + o
