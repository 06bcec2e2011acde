"""The drafter protocol: propose a tree of draft tokens per row; the target verifies it in one forward.

One interface (used by :func:`specdec.engine.step.step_body_`):

    capture_layers          target layers whose input residual stream the drafter reads (or ())
    needs_context           True if prepare_() wants each row's committed tokens (host lists)
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
                            after EVERY step (also k = 0): extend over the committed tokens;
                            verify = the target's (AttentionMeta, positions) of the step's tree
"""

from __future__ import annotations

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
