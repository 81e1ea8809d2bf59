"""Handles of asynchronous cluster calls: `GenerationHandle` (results of a
`submit`, in prompt order or as they finish) and `PushHandle`."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from ..outputs import RolloutOutput


def next_from_queue(items: queue.Queue, timeout: float | None) -> RolloutOutput | None:
    """The next output put in `items`, None when none came within `timeout` s
    (0: do not wait); an exception put there is raised."""
    try:
        item = items.get(timeout=timeout) if timeout != 0 else items.get_nowait()
    except queue.Empty:
        return None
    if isinstance(item, BaseException):
        raise item
    return item


class GenerationHandle:
    """The pending results of one `submit` call.

    Every prompt's output is delivered exactly once, whatever actor produced
    it; a prompt lost with a dead actor is regenerated elsewhere before it is
    delivered.
    """

    def __init__(self, texts: list[str | None]) -> None:
        self._texts = texts
        self._results: list[RolloutOutput | None] = [None] * len(texts)
        self._remaining = len(texts)
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._queue: queue.Queue[RolloutOutput | BaseException] = queue.Queue()
        self._where: dict[int, str] = {}  # prompt index -> the actor working on it, for errors
        self.aborted = False
        self._taken = 0  # outputs handed out by next_output
        self._read_error = False  # next_output raised the generation's error: nothing more comes
        self._abort_hooks: list[Callable[[], None]] = []  # one per share in flight: ask its actor to abort

    def __len__(self) -> int:
        return len(self._results)

    # -- producer side (the cluster) ------------------------------------------------------
    def _assign(self, indices: list[int], actor: str) -> None:
        with self._cond:
            for i in indices:
                self._where[i] = actor

    def _deliver(self, out: RolloutOutput) -> bool:
        """Record one prompt's output; False (and ignored) if it was delivered already."""
        with self._cond:
            if self._results[out.index] is not None:
                return False
            if isinstance(out, RolloutOutput):
                out.prompt = self._texts[out.index]
            else:  # a ScoredSequence
                out.text = self._texts[out.index]
            self._results[out.index] = out
            self._remaining -= 1
            self._where.pop(out.index, None)
            self._cond.notify_all()
        self._queue.put(out)
        return True

    def _on_abort(self, hook: Callable[[], None]) -> None:
        """Register how to abort one share; run at once when the handle is aborted already."""
        with self._cond:
            if not self.aborted:
                self._abort_hooks.append(hook)
                return
        hook()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None and self._remaining:
                self._error = error
                self._cond.notify_all()
                self._queue.put(error)

    def _missing(self, indices) -> list[int]:
        with self._cond:
            return [i for i in indices if self._results[i] is None]

    # -- consumer side ---------------------------------------------------------------------
    def abort(self) -> None:
        """End every unfinished sample now: it is delivered with
        `finish_reason="abort"` and the tokens, logprobs and versions sampled so
        far; its KV is freed on its actor. Prompts already delivered are not
        touched; nothing is regenerated after an abort. Idempotent, thread-safe."""
        with self._cond:
            if self.aborted:
                return
            self.aborted = True
            hooks, self._abort_hooks = self._abort_hooks, []
        for hook in hooks:
            hook()

    @property
    def remaining(self) -> int:
        """Outputs `next_output` has yet to hand out: none once it raised the generation's error."""
        return 0 if self._read_error else len(self._results) - self._taken

    def next_output(self, timeout: float | None) -> RolloutOutput | None:
        """The next prompt to finish, or None when none did within `timeout` s
        (0: do not wait); raises the generation's error. Shares its order with
        `as_completed`: use one or the other."""
        try:
            item = next_from_queue(self._queue, timeout)
        except BaseException:
            self._read_error = True
            raise
        if item is not None:
            self._taken += 1
        return item

    def done(self) -> bool:
        """Whether every output arrived or the generation failed."""
        with self._cond:
            return self._remaining == 0 or self._error is not None

    def result(self, timeout: float | None = None) -> list[RolloutOutput]:
        """All outputs in prompt order; raises the generation's error, or
        `TimeoutError` naming the prompts still pending and their actors."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._remaining == 0 or self._error is not None, timeout):
                raise TimeoutError(f"generation not finished after {timeout} s; pending: {self._pending_text()}")
            if self._error is not None:
                raise self._error
            return list(self._results)

    def as_completed(self, timeout: float | None = None) -> Iterator[RolloutOutput]:
        """Each prompt's output as it finishes (`output.index` is its prompt
        position); `timeout` bounds the wait for each next output."""
        for _ in range(len(self._results)):
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no output within {timeout} s; pending: {self._pending_text()}") from None
            if isinstance(item, BaseException):
                raise item
            yield item

    def _pending_text(self) -> str:
        pending = [i for i, r in enumerate(self._results) if r is None]
        by_actor: dict[str, list[int]] = {}
        for i in pending:
            by_actor.setdefault(self._where.get(i, "not dispatched"), []).append(i)
        return "; ".join(
            f"{actor}: prompts {idx[:8]}{'...' if len(idx) > 8 else ''}" for actor, idx in by_actor.items()
        )


class PushHandle:
    """A weight push running in the background (`push_weights(wait=False)`)."""

    def __init__(self, run: Callable[[], int]) -> None:
        self._version: int | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(run,), name="rollout-push", daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[], int]) -> None:
        try:
            self._version = run()
        except BaseException as e:  # handed to the caller by result()
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        """Whether the push has committed or failed."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> int:
        """The committed version; raises the push's error, or `TimeoutError`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"weight push not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._version
