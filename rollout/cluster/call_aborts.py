"""`CallAborts`: how an actor aborts its calls by id, including calls that
have not started yet.

The driver's abort or cancel travels on the actor's control threads, the
call it names on its generate or session threads, so either can arrive
first. An abort for an id not yet registered is remembered (a bounded number
of ids, each for a bounded time); the call that registers the id later finds
it and aborts itself at once. Registering and looking for an earlier abort
happen under one lock, so no order of the two loses an abort.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

# Aborts that came before their call. A call waits for a free generate or
# session thread at most the driver's stall timeout before the driver gives up
# on it, so an hour outlives any call still to come; the count only stops ids
# of calls that never arrive (their actor was replaced) from piling up.
EARLY_ABORTS_REMEMBERED = 4096
EARLY_ABORT_TTL_S = 3600.0


class CallAborts:
    """Abort callbacks by call id, and the ids aborted before their call registered."""

    def __init__(
        self,
        limit: int = EARLY_ABORTS_REMEMBERED,
        ttl_s: float = EARLY_ABORT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limit, self._ttl_s, self._clock = limit, ttl_s, clock
        self._lock = threading.Lock()
        self._running: dict[str, Callable[[], None]] = {}  # call id -> how to abort it
        self._early: OrderedDict[str, float] = OrderedDict()  # call id -> when its abort came, oldest first
        self._ended: OrderedDict[str, None] = OrderedDict()  # calls ended lately: a late abort is not early

    def register(self, call_id: str, abort: Callable[[], None]) -> bool:
        """Record how to abort the call `call_id`. If its abort came first,
        call `abort()` now instead and return True: the call was aborted
        before it started."""
        with self._lock:
            self._forget_expired()
            early = self._early.pop(call_id, None) is not None
            if not early:
                self._running[call_id] = abort
        if early:
            abort()
        return early

    def take_early(self, call_id: str) -> bool:
        """Whether `call_id` was aborted before it came (forgetting that it
        was): a call may check before it costs anything, and still
        `register` after, for an abort that comes in between."""
        with self._lock:
            return self._early.pop(call_id, None) is not None

    def finish(self, call_id: str) -> None:
        """The call ended: later aborts of `call_id` have nothing to end."""
        with self._lock:
            self._running.pop(call_id, None)
            self._ended[call_id] = None
            if len(self._ended) > self._limit:
                self._ended.popitem(last=False)

    def abort(self, call_id: str) -> None:
        """Abort the call `call_id` now if it runs, else when it registers (a
        call that ended lately has nothing left to abort)."""
        with self._lock:
            abort = self._running.get(call_id)
            if abort is None and call_id not in self._ended:
                self._forget_expired()
                self._early[call_id] = self._clock()
                while len(self._early) > self._limit:
                    self._early.popitem(last=False)
        if abort is not None:
            abort()  # outside the lock: it may wait for the engine's step under way

    @property
    def num_early(self) -> int:
        """Aborts remembered for calls that have not started."""
        with self._lock:
            return len(self._early)

    def _forget_expired(self) -> None:
        oldest = self._clock() - self._ttl_s
        while self._early and next(iter(self._early.values())) < oldest:
            self._early.popitem(last=False)
