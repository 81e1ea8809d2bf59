"""KV kept between the turns of a session.

When a session's turn finishes, its sequence's pages are not freed: they
move into a `KVLease` that the session holds, so its next turn computes only
the tokens added since (the observation, and the last sampled token, whose
KV no step computed), not the whole context again. The prefix cache alone
would lose up to a page of tokens per turn (it keeps only full pages) and
every page it evicts in between.

Leases are a cache, never a reservation: when admission or a running
sequence needs pages, the least recently used leases are released first
(before any running sequence is preempted), their full pages falling back
to the prefix cache. A forgotten session therefore costs nothing but
pages nobody else needed. A weight commit releases every lease unless
its in-flight mode is "keep", under which a lease, like a running
sequence, goes on with its old KV (marked as mixing versions).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from workspace import PageAllocator

from .sequence import Request, Sequence


@dataclass(eq=False, slots=True)
class KVLease:
    """The pages of a finished turn: they hold the KV of `token_ids[:num_computed]`."""

    token_ids: list[int]  # the turn's whole sequence: prompt and sampled tokens
    block_table: list[int]
    page_keys: list[bytes]
    num_computed: int
    cacheable: bool  # False when the KV mixes policy versions ("keep" commits)


@dataclass(eq=False, slots=True)
class LeaseSlot:
    """What a session hands the engine with each turn: where its lease lives between turns."""

    lease: KVLease | None = None
    closed: bool = False  # the session ended: a turn finishing now frees its pages instead
    high_water: int = 0  # positions the session's KV ever covered: computing them again is a recompute
    request: Request | None = None  # the session's latest turn (Session.abort ends it)


@dataclass(eq=False)
class LeaseTable:
    """Every live lease, least recently used first."""

    allocator: PageAllocator
    _slots: OrderedDict[int, LeaseSlot] = field(default_factory=OrderedDict)

    @property
    def num_leases(self) -> int:
        return len(self._slots)

    @property
    def num_pages(self) -> int:
        return sum(len(slot.lease.block_table) for slot in self._slots.values())

    def keep(self, seq: Sequence, slot: LeaseSlot) -> None:
        """Move a finished sequence's pages into `slot` (the sequence is left with
        none); a closed slot's turn gives them back to the pool instead."""
        self.release(slot)
        slot.high_water = max(slot.high_water, seq.kv_high_water)
        if slot.closed:
            for page in seq.block_table:
                self.allocator.decref(page)
            seq.block_table, seq.page_keys, seq.num_computed_tokens = [], [], 0
            return
        slot.lease = KVLease(
            list(seq.token_ids), seq.block_table, seq.page_keys, seq.num_computed_tokens, seq.cacheable
        )
        seq.block_table, seq.page_keys, seq.num_computed_tokens = [], [], 0
        self._slots[id(slot)] = slot

    def adopt(self, seq: Sequence, slot: LeaseSlot) -> int:
        """Give a new turn's sequence its session's pages; returns the tokens they cover (0: none).

        The lease counts only when the new sequence starts with all its token
        ids (a session only appends; a lease that does not lead them is
        released, never attached); at least the last token is left to compute.
        """
        seq.kv_high_water = max(seq.kv_high_water, slot.high_water)
        lease = slot.lease
        if lease is None:
            return 0
        covered = min(lease.num_computed, seq.num_tokens - 1)
        if seq.block_table or covered <= 0 or seq.token_ids[: len(lease.token_ids)] != lease.token_ids:
            self.release(slot)
            return 0
        self.take(slot)
        seq.block_table, seq.page_keys = lease.block_table, lease.page_keys
        seq.num_computed_tokens = covered
        seq.cacheable = lease.cacheable
        return seq.num_computed_tokens

    def take(self, slot: LeaseSlot) -> KVLease | None:
        """Remove `slot`'s lease from the table, its pages still referenced, and return it."""
        lease, slot.lease = slot.lease, None
        self._slots.pop(id(slot), None)
        return lease

    def release(self, slot: LeaseSlot) -> None:
        """Drop `slot`'s lease, if any: its pages go back to the pool (full ones stay cached)."""
        lease = self.take(slot)
        if lease is not None:
            for page in lease.block_table:
                self.allocator.decref(page)

    def close(self, slot: LeaseSlot) -> None:
        """The session is over: release its lease, and any turn still running
        frees its pages when it finishes."""
        slot.closed = True
        self.release(slot)

    def release_oldest(self) -> bool:
        """Release the least recently used lease; False when there is none."""
        if not self._slots:
            return False
        _, slot = next(iter(self._slots.items()))
        self.release(slot)
        return True

    def on_weights_committed(self, inflight: str) -> None:
        """Under "keep" leases go on with their KV, now mixing versions; else all are released."""
        if inflight == "keep":
            for slot in self._slots.values():
                slot.lease.cacheable = False
        else:
            for slot in list(self._slots.values()):
                self.release(slot)
