"""Which `generate_iter` iterators are open, and which thread holds each.

A drain waits until every request in flight has finished; a request of an
iterator advances only when its holder calls `next`. So a drain requested by
a thread that holds an unfinished iterator (inside `generate` included)
would wait on itself: the engine refuses it, naming what to do instead.
"""

from __future__ import annotations

import threading

from .sequence import Request


class OpenIterator:
    """The requests of one `generate_iter` iterator from its first `next` until
    it ends or is closed, and the thread that advanced it last: only that
    thread's steps are sure to finish them."""

    __slots__ = ("requests", "thread")

    def __init__(self, requests: list[Request]) -> None:
        self.requests = requests
        self.thread = threading.current_thread()  # an object, not an id: ids of ended threads are reused

    @property
    def unfinished(self) -> bool:
        return not all(r.is_finished for r in self.requests)


class OpenIterators:
    """The open iterators of one engine. Opening and closing happen on the
    iterating threads; `check_drain` reads a snapshot, which is enough: a
    thread's own iterators cannot change while it is busy asking for a drain."""

    def __init__(self) -> None:
        self._open: set[OpenIterator] = set()

    def open(self, requests: list[Request]) -> OpenIterator:
        opened = OpenIterator(requests)
        self._open.add(opened)
        return opened

    def close(self, opened: OpenIterator) -> None:
        self._open.discard(opened)

    def check_drain(self) -> None:
        """Raise `RuntimeError` if the calling thread holds an unfinished iterator."""
        me = threading.current_thread()
        if any(it.thread is me and it.unfinished for it in tuple(self._open)):
            raise RuntimeError(
                "update_weights(inflight='drain') from a thread that holds an unfinished generate_iter "
                "iterator (or from inside generate) would wait on itself: the drain waits for requests "
                "that only this thread advances. Finish or close the iterator first, drain from another "
                "thread, or use inflight='recompute', 'keep' or 'restart'"
            )
