"""Running a `Job` on the backend: one `TokenStream` per prompt, read in the
event loop; whatever way a request ends (finished, failed, client gone),
its streams are cancelled, so an abandoned request frees its KV. A request
is admitted only while the requests the server has accepted and not answered
stay within their bounds, in count and in work (`InFlight`), so a flood of
requests, large or tiny, gets 429s, not memory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from ..engine.errors import UnavailableError
from ..engine.streams import SampleDelta, TokenStream
from ..outputs import RolloutOutput
from .backend import Backend
from .errors import RETRY_AFTER_S, RetryLater, from_engine
from .structured import schema_error
from .translate import Job

Item = SampleDelta | RolloutOutput
_END = object()


class ServerBusy(RetryLater):
    """A 429: the server holds as much work as it may; retry after `RETRY_AFTER_S`."""

    def __init__(self, message: str) -> None:
        super().__init__(429, message, code="server_busy")


class InFlight:
    """The requests admitted and not yet answered, bounded in count
    (`max_requests`: each holds a connection, a task, its body and streams,
    however little it asks for) and in work (`max_tokens` of `Job.work`).
    Only the event loop's thread calls it: no lock."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = 0
        self.tokens = 0

    def admit(self) -> Ticket:
        """Count one more request in before its body is read, or raise `ServerBusy` (nothing counted)."""
        if self.requests >= self.max_requests:
            raise ServerBusy(
                f"the server is at its bound of requests in flight ({self.max_requests}, see "
                f"max_inflight_requests): retry after {RETRY_AFTER_S} s"
            )
        self.requests += 1
        return Ticket(self)


class Ticket:
    """One admitted request's share of `InFlight`; `release()` gives it all back, once."""

    def __init__(self, inflight: InFlight) -> None:
        self.inflight = inflight
        self.tokens = 0  # the work taken (`take`)
        self.released = False

    def take(self, job: Job) -> None:
        """Count `job`'s work in, or raise `ServerBusy` (no work counted) past the bound."""
        inflight = self.inflight
        if inflight.tokens + job.work > inflight.max_tokens:
            raise ServerBusy(
                f"the server is at its bound of work in flight ({inflight.tokens} of {inflight.max_tokens} tokens "
                f"taken; this request needs {job.work}, see max_inflight_tokens): retry after {RETRY_AFTER_S} s"
            )
        inflight.tokens += job.work
        self.tokens += job.work

    def release(self) -> None:
        """The request is answered (or failed, or its client left); a second call does nothing."""
        if not self.released:
            self.released = True
            self.inflight.requests -= 1
            self.inflight.tokens -= self.tokens
            self.tokens = 0


class ClientGone(Exception):
    """The client closed its connection before its response was ready."""


def start(job: Job, backend: Backend, ticket: Ticket) -> list[TokenStream]:
    """Start every prompt of `job`, its work counted on `ticket` (a 429 past the
    bound; the caller releases the ticket when the response ends); a prompt the
    engine refuses cancels those started and raises a 400."""
    ticket.take(job)
    streams: list[TokenStream] = []
    try:
        for prompt in job.prompts:
            streams.append(backend.stream(prompt, job.params))
    except BaseException as e:
        cancel(streams)
        if isinstance(e, UnavailableError):  # a closed engine's is a ValueError too: a 503 (`errors.py`), not a 400
            raise
        if isinstance(e, (ValueError, TypeError)):
            raise schema_error(str(e)) or from_engine(e, job.prompt_field) from None
        raise
    return streams


def cancel(streams: list[TokenStream]) -> None:
    """Abort what is unfinished (a no-op for finished streams)."""
    for s in streams:
        s.cancel()


async def items(streams: list[TokenStream]) -> AsyncIterator[tuple[int, Item]]:
    """`(prompt index, item)` from all streams as they come; a stream's error is raised."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: TokenStream) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, _END))
        except (Exception, asyncio.CancelledError) as e:  # handed to the reader, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def outputs(streams: list[TokenStream], disconnected: Callable[[], Awaitable[None]]) -> list[RolloutOutput]:
    """Every prompt's `RolloutOutput`, in prompt order; raises `ClientGone`
    (the streams cancelled) if `disconnected()` returns first."""

    async def gather() -> list[RolloutOutput]:
        done: list[RolloutOutput | None] = [None] * len(streams)
        async for i, item in items(streams):
            if isinstance(item, RolloutOutput):
                done[i] = item
        return done  # type: ignore[return-value]

    work = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone()
    finally:
        watch.cancel()
        work.cancel()
        cancel(streams)


async def wait_for_disconnect(receive) -> None:
    """Return once the ASGI server reports the client gone (the body is read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
