"""The paged KV cache: one pool of pages for all layers, a free-list allocator, per-request page lists.

Memory: the model's K and V pools, each [L, P, PS, HKV, D]; page p holds slots p*PS .. p*PS+PS-1 of
every layer. A request owns an ordered list of pages (its page table: logical slot s lives in page
``pages[s // PS]`` at offset ``s % PS``). Pages are handed out and taken back only between steps,
by the scheduler; a step never allocates (see ``reserve_``).

Accounting invariant, checked by :meth:`KVCache.check`: every page is either on the free list or in
exactly one request's list, never both and never twice. Everything here is host-side bookkeeping;
the device copy of the page tables lives in :class:`~specdec.engine.state.DecodeState`.
"""

from __future__ import annotations

import torch

from ..errors import SpecdecError


class OutOfPages(SpecdecError):
    """The pool has fewer free pages than asked for (the scheduler preempts and retries)."""


def pages_for(num_slots: int, page_size: int) -> int:
    """Pages needed to hold ``num_slots`` slots."""
    return -(-num_slots // page_size)


class KVCache:
    """K/V page pools of a model plus the allocator over their pages.

    Args:
        model: a :class:`~specdec.models.llama.LlamaModel` (its ``new_kv_cache`` sizes the pools).
        num_pages: P, pages in the pool.
        page_size: PS, token slots per page.
    """

    def __init__(self, model, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise SpecdecError(f"KV cache needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.k, self.v = model.new_kv_cache(num_pages, page_size)  # [L, P, PS, HKV, D] each
        # A stack: the most recently freed page is reused first (still warm in L2 on the GPU).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owned: dict[object, list[int]] = {}

    # -- queries ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages(self, owner) -> list[int]:
        """The page list of ``owner`` (empty if it holds none). Do not mutate the returned list."""
        return self._owned.get(owner, [])

    def slots_held(self, owner) -> int:
        return len(self.pages(owner)) * self.page_size

    def pages_needed(self, owner, num_slots: int) -> int:
        """Extra pages ``owner`` needs so that its pages cover ``num_slots`` slots."""
        return max(0, pages_for(num_slots, self.page_size) - len(self.pages(owner)))

    # -- mutation ---------------------------------------------------------------------------------
    def reserve_(self, owner, num_slots: int) -> list[int]:
        """Grow ``owner``'s pages to cover ``num_slots`` slots; returns the newly added pages.

        All or nothing: raises :class:`OutOfPages` (changing nothing) if the pool is short.
        """
        need = self.pages_needed(owner, num_slots)
        if need == 0:
            return []
        if need > len(self._free):
            raise OutOfPages(f"need {need} pages, {len(self._free)} free of {self.num_pages}")
        new = [self._free.pop() for _ in range(need)]
        self._owned.setdefault(owner, []).extend(new)
        return new

    def release_(self, owner) -> int:
        """Return all of ``owner``'s pages to the free list; returns how many (0 if it held none)."""
        pages = self._owned.pop(owner, [])
        self._free.extend(reversed(pages))
        return len(pages)

    # -- checks -----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError unless every page is free or owned, exactly once (tests call this)."""
        seen = list(self._free)
        for pages in self._owned.values():
            seen.extend(pages)
        assert len(seen) == self.num_pages and len(set(seen)) == self.num_pages, (
            f"page accounting broken: {len(self._free)} free + "
            f"{sum(len(p) for p in self._owned.values())} owned != {self.num_pages} pages, "
            f"or a page is listed twice")
        assert all(0 <= p < self.num_pages for p in seen), "page id out of range"


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K plus V for one token over all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elem


def available_device_bytes(device) -> int:
    """Bytes a new allocation on CUDA ``device`` can get now: what the driver reports free plus what
    this process's caching allocator holds reserved but unallocated (blocks freed by an earlier
    engine, a finished job of a ``--multirun``, that torch keeps cached instead of returning them to
    the driver). ``torch.cuda.mem_get_info`` alone misses the second part, so a pool sized from it
    shrank by whatever the previous run's pool left in the cache (consecutive jobs of one process got pools
    differing by 2x).
    Only live tensors count as used."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def size_pool(model, *, page_size: int, kv_cache_tokens: int | None, kv_memory_fraction: float,
              cpu_default_tokens: int = 8192) -> int:
    """Number of pages for the pool.

    ``kv_cache_tokens`` wins when set (studies that compare engines set it, so every arm gets the
    same pool). Otherwise on the GPU: ``kv_memory_fraction`` of the memory available after the
    weights are loaded (:func:`available_device_bytes`: free plus the allocator's cached blocks, so
    what earlier engines of this process freed counts as available; the rest stays for activations,
    CUDA graphs and the logits); on the CPU: ``cpu_default_tokens`` slots (SmolLM2 fp32: 46 KB per
    token, 8192 tokens = 377 MB).
    """
    if kv_cache_tokens is not None:
        tokens = int(kv_cache_tokens)
    elif model.device.type == "cuda":
        free = available_device_bytes(model.device)
        tokens = int(free * float(kv_memory_fraction)) // kv_bytes_per_token(model.config, model.dtype)
    else:
        tokens = cpu_default_tokens
    pages = tokens // page_size
    if pages < 1:
        raise SpecdecError(f"KV pool of {tokens} tokens holds no page of {page_size} slots; "
                           "raise engine.kv_cache_tokens or engine.kv_memory_fraction")
    return pages
