"""Page bookkeeping for the paged KV pool: reference counts, a free list and a
prefix cache of full pages keyed by content hash.

Pure Python, no tensors: the pool's memory lives in `KVPool`; this class only
decides which page ids are in use. A page whose reference count drops to zero
keeps its cached content (and its prefix-cache entry) until the allocator
needs it for something else, so a preempted or repeated prefix can be reused
for free when memory allows.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def page_hash(parent: bytes, version: int, tokens: Sequence[int]) -> bytes:
    """Content key of one full page: the chain of all earlier pages (`parent`),
    the policy version whose weights computed it, and the page's token ids.

    128-bit BLAKE2b, so distinct prefixes do not collide in practice; the
    version is part of the key so KV computed by old weights never serves a
    request under new ones.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(version.to_bytes(8, "little", signed=False))
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PageAllocator:
    """Reference-counted pages `0 .. num_pages-1` with an LRU prefix cache."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcount = [0] * num_pages
        # Free pages with no cached content, used first.
        self._free_plain: list[int] = list(range(num_pages - 1, -1, -1))
        # Free pages that still hold a cached prefix, least recently freed first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_of_page: dict[int, bytes] = {}
        self._page_of_hash: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Pages that `allocate` can hand out now (cached-but-unused ones included)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    @property
    def refcounts(self) -> list[int]:
        """Every page's reference count, indexed by page id (the live list: read it, never write it)."""
        return self._refcount

    def allocate(self) -> int:
        """A fresh page with reference count 1; evicts the oldest cached page
        when no plain free page is left. Raises `MemoryError` when none is free."""
        if self._free_plain:
            page = self._free_plain.pop()
        elif self._free_cached:
            page, _ = self._free_cached.popitem(last=False)
            self._forget(page)
        else:
            raise MemoryError("KV page pool exhausted")
        self._refcount[page] = 1
        return page

    def incref(self, page: int) -> None:
        if self._refcount[page] <= 0:
            raise RuntimeError(f"incref of free page {page}")
        self._refcount[page] += 1

    def decref(self, page: int) -> None:
        count = self._refcount[page] - 1
        if count < 0:
            raise RuntimeError(f"decref of free page {page}")
        self._refcount[page] = count
        if count == 0:
            if page in self._hash_of_page:
                self._free_cached[page] = None
            else:
                self._free_plain.append(page)

    def lookup(self, key: bytes) -> int | None:
        """The cached page holding `key`, with one more reference taken, or None."""
        page = self._page_of_hash.get(key)
        if page is None:
            return None
        if self._refcount[page] == 0:
            del self._free_cached[page]
        self._refcount[page] += 1
        return page

    def register(self, page: int, key: bytes) -> None:
        """Record that `page` (in use, full, computed) holds the prefix `key`."""
        if key in self._page_of_hash or page in self._hash_of_page:
            return
        self._page_of_hash[key] = page
        self._hash_of_page[page] = key

    def clear_cache(self) -> None:
        """Forget every cached prefix (after a weight update); pages in use stay."""
        for page in list(self._free_cached):
            self._free_plain.append(page)
        self._free_cached.clear()
        self._hash_of_page.clear()
        self._page_of_hash.clear()

    @property
    def num_cached(self) -> int:
        return len(self._page_of_hash)

    def _forget(self, page: int) -> None:
        key = self._hash_of_page.pop(page, None)
        if key is not None:
            del self._page_of_hash[key]
