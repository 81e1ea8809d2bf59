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
from typing import TYPE_CHECKING

from ..outputs import RolloutOutput
from .sequence import Request

if TYPE_CHECKING:
    from .engine import Engine


def _whole(output: RolloutOutput) -> RolloutOutput:
    return output


class BackgroundDriver:
    """Steps `engine` on a thread of its own while submitted requests are unfinished."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Request, Future, Callable]] = {}  # request id -> its future, pick
        self._thread: threading.Thread | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The stepping thread while it runs (a drain from it would wait on itself)."""
        return self._thread

    def submit(self, requests: list[Request], pick: Callable[[RolloutOutput], object] = _whole) -> list[Future]:
        """Add `requests` to the engine and return one future per request, each
        resolving to `pick(its RolloutOutput)` (or the error that ended it)."""
        engine = self._engine
        futures = [Future() for _ in requests]
        with engine._guard.ahead_of_steps():  # an asyncio caller waits for one step at most
            engine._check_open()
            for r in requests:
                engine.scheduler.add(r)
        with self._lock:
            for r, f in zip(requests, futures, strict=True):
                self._pending[r.request_id] = (r, f, pick)
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
            cancelled = [rid for rid, entry in self._pending.items() if entry[1].cancelled()]
            dropped = [self._pending.pop(rid)[0] for rid in cancelled]
            if not self._pending and not dropped:
                self._thread = None
                return False
            pending = {rid: entry[0] for rid, entry in self._pending.items()}
        if dropped:  # a cancelled turn (an asyncio task cancelled mid-await) is aborted, its KV freed
            with engine._guard.held():
                if not engine._closed:
                    engine.scheduler.abort(dropped)
                engine._guard.notify()
        if not pending:
            return True
        try:
            info, finished = engine._one_step(pending)
        except BaseException as e:  # a failed step or a close: every waiter hears of it
            self._fail_all(e)
            return True
        decode = engine.codec.decode if engine.codec is not None else None
        for rid, result in finished:
            with self._lock:
                _, future, pick = self._pending.pop(rid)
            _resolve(future, lambda result=result, pick=pick: pick(result.to_output(decode)))
        try:
            engine._after_step(info)
        except BaseException as e:  # a step callback's error ends what this thread drives
            self._fail_all(e)
        return True

    def _fail_all(self, error: BaseException) -> None:
        engine = self._engine
        with self._lock:
            entries, self._pending = list(self._pending.values()), {}
        with engine._guard.held():
            if not engine._closed:
                engine.scheduler.abort([entry[0] for entry in entries])
            engine._guard.notify()  # a pending drain may be waiting on these
        for entry in entries:
            _settle(entry[1].set_exception, error)


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
