"""`PolicyVersionGuard`: the policy version counter and the one mutex that
separates generation steps from weight commits.

Every Stepper call runs holding the guard; a weight commit takes it between
two steps. Validation and staging happen before the guard is taken, so a
commit holds it only for the final copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..checks import next_version


class PolicyVersionGuard:
    def __init__(self, version: int = 0) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._version = version
        # Commits (and closes) waiting for the guard. A step yields to them
        # first: Python locks do not hand off, so a stepping loop that releases
        # and re-takes the guard could otherwise starve a commit for many steps.
        self._pending = 0
        self._pending_lock = threading.Lock()

    @property
    def version(self) -> int:
        """The policy version of the live weights (monotonic)."""
        return self._version

    def check_next(self, requested: int | None) -> int:
        """The version a commit would install: `requested`, or current + 1.

        Raises `TypeError`/`ValueError` unless `requested` is None or an int
        greater than the current version.
        """
        return next_version(self._version, requested)

    @contextmanager
    def step(self) -> Iterator[int]:
        """Hold the guard for one step; yields the version the step runs under."""
        with self._cond:
            while self._pending:
                self._cond.wait()
            try:
                yield self._version
            finally:
                self._cond.notify_all()  # a failed step changes state too (recovery, aborts)

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._cond:
            yield

    @contextmanager
    def ahead_of_steps(self) -> Iterator[None]:
        """Hold the guard next, before any step that is waiting for it (commits, close)."""
        with self._pending_lock:
            self._pending += 1
        try:
            with self._cond:
                yield
        finally:
            with self._pending_lock:
                self._pending -= 1
            with self._cond:
                self._cond.notify_all()

    def commit(self, requested: int | None, apply: Callable[[int], None]) -> int:
        """Under the guard: re-check the version order, run `apply(version)`
        (the weight copy and in-flight handling), then publish the version."""
        with self.ahead_of_steps():
            version = self.check_next(requested)
            apply(version)
            self._version = version
            return version

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Release the guard until `predicate()` holds (checked under it) or `timeout` s pass."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()
