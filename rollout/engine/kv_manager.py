"""Sequence-level KV page management on top of the page allocator: growing
a sequence's block table, copy-on-write of shared pages, forking a group,
prefix-cache lookups and registration, and the leases that keep a session's
KV between its turns."""

from __future__ import annotations

from workspace import PageAllocator, page_hash

from .leases import LeaseTable
from .routing import RoutingReader
from .sequence import Sequence


class KVManager:
    def __init__(self, allocator: PageAllocator, routing: RoutingReader | None = None) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.leases = LeaseTable(allocator)  # sessions' KV between turns
        self.routing = routing  # copies routed experts off pages before they go (mixture-of-experts models)

    def save_routing(self, seq: Sequence) -> None:
        """Copy `seq`'s routed experts to the host when its request asks (see `routing.py`)."""
        if self.routing is not None:
            self.routing.save(seq)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def reserve(self, seq: Sequence, num_new: int, copies: list[tuple[int, int]]) -> bool:
        """Make room for positions `[num_computed, num_computed + num_new)`.

        Appends fresh pages, and copies the page about to be written when
        another sequence shares it (recording `(src, dst)` in `copies`).
        Returns False, changing nothing, when the pool cannot supply enough.
        """
        start = seq.num_computed_tokens
        table = seq.block_table
        first = start // self.page_size
        grow = self.pages_for(start + num_new) - len(table)
        if grow <= 0 and self.allocator.refcount(table[first]) == 1:
            return True  # a decode within its own last page: most rows of most steps
        cow = first < len(table) and self.allocator.refcount(table[first]) > 1
        if grow + cow > self.allocator.num_free:
            return False
        if cow:
            old = seq.block_table[first]
            new = self.allocator.allocate()
            copies.append((old, new))
            self.allocator.decref(old)
            seq.block_table[first] = new
        for _ in range(grow):
            seq.block_table.append(self.allocator.allocate())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every page of `parent` (copy-on-write later)."""
        for page in parent.block_table:
            self.allocator.incref(page)
        child.block_table = list(parent.block_table)
        child.page_keys = list(parent.page_keys)
        child.num_computed_tokens = parent.num_computed_tokens
        child.kv_high_water = max(child.kv_high_water, parent.num_computed_tokens)
        child.cacheable = parent.cacheable

    def free(self, seq: Sequence) -> None:
        self.save_routing(seq)
        for page in seq.block_table:
            self.allocator.decref(page)
        seq.block_table.clear()
        seq.page_keys.clear()
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the KV of `seq`'s first `num_tokens` positions only, freeing pages past them."""
        keep = self.pages_for(num_tokens)
        for page in seq.block_table[keep:]:
            self.allocator.decref(page)
        del seq.block_table[keep:]
        del seq.page_keys[num_tokens // self.page_size :]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def match_prefix(self, seq: Sequence, version: int, limit: int | None = None) -> int:
        """Attach cached pages for the longest cached prefix of a sequence with
        no KV, covering at most `limit` tokens (default: all but the last, so
        at least one token is computed and sampled from); returns the tokens covered."""
        assert not seq.block_table
        parent = b""
        ps = self.page_size
        limit = seq.num_tokens - 1 if limit is None else limit
        while (len(seq.block_table) + 1) * ps <= limit:
            i = len(seq.block_table)
            key = page_hash(parent, version, seq.token_ids[i * ps : (i + 1) * ps])
            page = self.allocator.lookup(key)
            if page is None:
                break
            seq.block_table.append(page)
            seq.page_keys.append(key)
            parent = key
        seq.num_computed_tokens = len(seq.block_table) * ps
        return seq.num_computed_tokens

    def register(self, seq: Sequence, version: int, num_tokens: int) -> None:
        """Publish the full pages among the sequence's first `num_tokens` positions to the prefix cache.

        Called when a step is scheduled, for the positions it will compute: a
        sequence admitted later in the same step can share them, because every
        layer writes the whole step's keys and values before any token of the
        step attends (a recomputed group computes its prompt once, not n times).
        """
        if not seq.cacheable:
            return
        ps = self.page_size
        full = min(num_tokens, seq.num_tokens) // ps  # a page whose last token is still on the device waits
        for i in range(len(seq.page_keys), full):
            parent = seq.page_keys[-1] if seq.page_keys else b""
            key = page_hash(parent, version, seq.token_ids[i * ps : (i + 1) * ps])
            seq.page_keys.append(key)
            self.allocator.register(seq.block_table[i], key)

    def clear_prefix_cache(self) -> None:
        self.allocator.clear_cache()
