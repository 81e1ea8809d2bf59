"""Requests driven by one background thread, for callers that wait without
stepping: asyncio code (`Session.generate_async`) and threads that only
block on a result (an actor's session turns).

`generate` makes its calling thread step the engine, which is right for a few
callers. Hundreds of waiting callers would each contend for the guard to run
steps that any one of them could run; here one thread steps while any
submitted request is unfinished and resolves each request's future as it
finishes, so callers cost a future, not a stepping thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..outputs import RolloutOutput
from .sequence import Request
from .streams import SampleDelta, StreamCursor

if TYPE_CHECKING:
    from .engine import Engine


def _whole(output: RolloutOutput) -> RolloutOutput:
    return output


@dataclass(slots=True)
class _Entry:
    """A submitted request and who waits on it."""

    request: Request
    future: Future
    pick: Callable[[RolloutOutput], object]
    cursor: StreamCursor | None  # what a stream has been sent (streams only)
    watch: Callable[[list[SampleDelta]], None] | None


class BackgroundDriver:
    """Steps `engine` on a thread of its own while submitted requests are unfinished."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._pending: dict[int, _Entry] = {}  # request id -> what waits on it
        self._incoming: list[_Entry] = []  # submitted, added to the scheduler by the driver's next step
        self._thread: threading.Thread | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The stepping thread while it runs (a drain from it would wait on itself)."""
        return self._thread

    def submit(
        self,
        requests: list[Request],
        pick: Callable[[RolloutOutput], object] = _whole,
        streams: list[Callable[[list[SampleDelta]], None]] | None = None,
    ) -> list[Future]:
        """Add `requests` to the engine and return one future per request, each
        resolving to `pick(its RolloutOutput)` (or the error that ended it).
        `streams[i]`, when given, gets request i's new tokens after every step
        (on this driver's thread, before its future resolves)."""
        self._engine._check_open()
        futures = [Future() for _ in requests]
        with self._lock:  # never the guard: an event loop calling this must not wait for a step
            for i, (r, f) in enumerate(zip(requests, futures, strict=True)):
                watch = streams[i] if streams is not None else None
                self._incoming.append(_Entry(r, f, pick, StreamCursor(r) if watch else None, watch))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rollout-background-steps", daemon=True)
                self._thread.start()
        return futures

    def _run(self) -> None:
        try:
            while self._step_once():
                pass
        except BaseException as e:  # never leave waiters hanging on a dead thread
            self._fail_all(e)
            with self._lock:
                self._thread = None

    def _step_once(self) -> bool:
        """One step for the pending requests; False once none is left (the thread ends)."""
        engine = self._engine
        with self._lock:
            incoming, self._incoming = self._incoming, []
        if incoming:  # the submitters did not wait for the guard: the driver adds their requests
            with self._lock:  # pending first: if the engine closed meanwhile, _run fails them all
                self._pending.update((entry.request.request_id, entry) for entry in incoming)
            with engine._guard.held():
                engine._check_open()
                for entry in incoming:
                    if not entry.request.is_finished:  # aborted before it joined
                        engine.scheduler.add(entry.request)
        with self._lock:
            cancelled = [rid for rid, entry in self._pending.items() if entry.future.cancelled()]
            dropped = [self._pending.pop(rid).request for rid in cancelled]
            if not self._pending and not dropped and not self._incoming:
                self._thread = None
                return False
            pending = {rid: entry.request for rid, entry in self._pending.items()}
            watched = [entry for entry in self._pending.values() if entry.cursor is not None]
        if dropped:  # a cancelled turn (an asyncio task cancelled mid-await) is aborted, its KV freed
            with engine._guard.held():
                if not engine._closed:
                    engine.scheduler.abort(dropped)
                engine._failures.forget(dropped)
                engine._guard.notify()
        if not pending:
            return True
        deltas: list[tuple[_Entry, list[SampleDelta]]] = []

        def observe() -> None:  # under the guard, after the step
            deltas.extend((entry, d) for entry in watched if (d := entry.cursor.deltas()))

        try:
            info, finished, failed, _ = engine._one_step(pending, observe if watched else None)
        except BaseException as e:  # a failed step no request was singled out for, or a close: every waiter hears
            self._fail_all(e)
            return True
        for entry, d in deltas:
            entry.watch(d)
        with self._lock:
            for rid, error in failed:  # their rows made a step fail: only their waiters hear of it
                _settle(self._pending.pop(rid).future.set_exception, error)
        decode = engine.codec.decode if engine.codec is not None else None
        for rid, result in finished:
            with self._lock:
                entry = self._pending.pop(rid)
            _resolve(entry.future, lambda result=result, pick=entry.pick: pick(result.to_output(decode)))
        try:
            engine._after_step(info)
        except BaseException as e:  # a step callback's error ends what this thread drives
            self._fail_all(e)
        return True

    def _fail_all(self, error: BaseException) -> None:
        engine = self._engine
        with self._lock:
            entries, self._pending = list(self._pending.values()) + self._incoming, {}
            self._incoming = []
        with engine._guard.held():
            if not engine._closed:
                engine.scheduler.abort([entry.request for entry in entries])
            engine._failures.forget(entry.request for entry in entries)
            engine._guard.notify()  # a pending drain may be waiting on these
        for entry in entries:
            _settle(entry.future.set_exception, error)


def _resolve(future: Future, make: Callable[[], object]) -> None:
    try:
        output = make()
    except BaseException as e:  # decoding failed: the caller hears of it, the driver goes on
        _settle(future.set_exception, e)
    else:
        _settle(future.set_result, output)


def _settle(method: Callable[[object], None], value: object) -> None:
    """Set a future's outcome unless its waiter cancelled it meanwhile."""
    with contextlib.suppress(InvalidStateError):
        method(value)
