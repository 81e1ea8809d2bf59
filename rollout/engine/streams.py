"""Results as they come: `TokenStream`, one prompt's samples token by token,
for servers and UIs (`Engine.stream`); and `Generation`, the iterator of
`Engine.generate_iter`, prompts as they finish, with `abort()`.

The engine's background driver (`engine/background.py`) steps the request;
after every step it hands the stream what each sample gained since the last
delta (copied under the guard, like every result). A stream made inside a
running event loop delivers into that loop (`async for`); one made elsewhere
into a thread-safe queue (`for`). Either way the last item is the finished
`RolloutOutput` (`stream.output` once iteration ends), whose `text` is cut
at a stop string as `generate`'s is; `cancel()` aborts the request and frees
its KV.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from ..outputs import RolloutOutput
from .sequence import Request

_END = object()


@dataclass(frozen=True, slots=True)
class SampleDelta:
    """What one sample gained in a step."""

    index: int  # which of the request's n samples
    token_ids: tuple[int, ...]  # tokens sampled since the last delta
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str | None  # set on the sample's last delta
    restarted: bool = False  # a `restart` commit dropped the sample's earlier tokens: these start over
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # per token, when the params ask
    # The prompt's logprobs when the params ask (`prompt_logprobs`): on a sample's first delta,
    # and again on a restarted one (computed anew under the new weights); None on the others.
    prompt: PromptDelta | None = None


@dataclass(frozen=True, slots=True)
class PromptDelta:
    """A prompt's tokens and their logprobs, as `RolloutOutput` gives them at the end."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]  # per position, the first None
    top_logprobs: tuple[dict[int, float] | None, ...] | None  # per position (the first None); None: not asked


class StreamCursor:
    """How much of each sample a stream has delivered; `deltas` runs under the guard."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.sent = [0] * len(request.samples)
        self.ended = [False] * len(request.samples)
        # A restart is read from the sample's counter, not its length: by the time the
        # stream looks, the sample may have sampled as many tokens again, or more.
        self.restarts = [s.num_restarts for s in request.samples]

    def deltas(self) -> list[SampleDelta]:
        out = []
        for k, s in enumerate(self.request.samples):
            if self.ended[k]:
                continue
            restarted = s.num_restarts != self.restarts[k] and self.sent[k] > 0  # else nothing to take back
            start, total = 0 if restarted else self.sent[k], s.num_output_tokens
            self.restarts[k] = s.num_restarts
            if total > start or s.is_finished or restarted:
                p, prompt = s.num_prompt_tokens, None
                scores = self.request.prompt_scores
                if scores is not None and scores.done and start == 0:
                    top = None if scores.top_logprobs is None else tuple(scores.top_logprobs)
                    prompt = PromptDelta(tuple(s.token_ids[:p]), tuple(scores.logprobs), top)
                out.append(
                    SampleDelta(
                        k,
                        tuple(s.token_ids[p + start :]),
                        tuple(s.logprobs[start:]),
                        tuple(s.versions[start:]),
                        s.finish_reason,
                        restarted,
                        tuple(s.top_logprobs[start:]),
                        prompt,
                    )
                )
                self.sent[k], self.ended[k] = total, s.is_finished
        return out


class TokenStream:
    """Deltas of one request as they come; see the module docstring."""

    def __init__(self) -> None:
        self._future: Future | None = None
        self.output: RolloutOutput | None = None
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._items: asyncio.Queue | queue.Queue = asyncio.Queue() if self._loop else queue.Queue()

    def attach(self, future: Future) -> None:
        """The request's future: its outcome ends the stream (deltas may come before it is attached)."""
        self._future = future
        future.add_done_callback(self._done)

    # -- the driver's side -------------------------------------------------------------
    def push(self, deltas: list[SampleDelta]) -> None:
        """Called on the driver thread after a step."""
        self._put(deltas)

    def _done(self, future: Future) -> None:
        if future.cancelled():
            self._put(asyncio.CancelledError())
        elif future.exception() is not None:
            self._put(future.exception())
        else:
            self._put(future.result())
        self._put(_END)

    def _put(self, item) -> None:
        if self._loop is None:
            self._items.put(item)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)

    # -- the consumer's side -----------------------------------------------------------
    def cancel(self) -> None:
        """Abort the request: its samples end, its KV is freed; iteration raises `CancelledError`."""
        self._future.cancel()

    def __iter__(self):
        if self._loop is not None:
            raise TypeError("this stream was made inside an event loop: iterate it with `async for`")
        while (item := self._items.get()) is not _END:
            for delta in self._take(item):  # noqa: UP028 (`yield from` a list breaks a caller's `send`)
                yield delta

    async def __aiter__(self):
        if self._loop is None:
            raise TypeError("this stream was made outside an event loop: iterate it with `for`")
        while (item := await self._items.get()) is not _END:
            for delta in self._take(item):
                yield delta

    def _take(self, item):
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, RolloutOutput):
            self.output = item
            return [item]
        return item


class Generation:
    """The iterator `Engine.generate_iter` returns: `(prompt index, output)`
    pairs as prompts finish, and `abort()`."""

    def __init__(self, outputs: Iterator[tuple[int, RolloutOutput]], abort: Callable[[], None]) -> None:
        self._outputs = outputs
        self._abort = abort

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> tuple[int, RolloutOutput]:
        return next(self._outputs)

    def close(self) -> None:
        """Stop early: unfinished prompts are aborted and not yielded."""
        self._outputs.close()

    def abort(self) -> None:
        """End every unfinished sample now (`finish_reason="abort"`, tokens so far
        kept, KV freed); iteration then yields them. Safe from any thread."""
        self._abort()
