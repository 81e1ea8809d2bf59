"""Running a `Job` on the backend: one `TokenStream` per prompt, read in the
event loop; whatever way a request ends (finished, failed, client gone),
its streams are cancelled, so an abandoned request frees its KV. A job is
started only while the work the server has accepted and not answered stays
within its bound (`InFlight`), so a flood of requests gets 429s, not memory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from ..engine.errors import UnavailableError
from ..engine.streams import SampleDelta, TokenStream
from ..outputs import RolloutOutput
from .backend import Backend
from .errors import RETRY_AFTER_S, RetryLater, from_engine
from .translate import Job

Item = SampleDelta | RolloutOutput
_END = object()


class ServerBusy(RetryLater):
    """A 429: the server holds as much work as it may; retry after `RETRY_AFTER_S`."""

    def __init__(self, message: str) -> None:
        super().__init__(429, message, code="server_busy")


class InFlight:
    """The work (`Job.work` tokens) of the jobs started and not yet answered,
    bounded by `limit`. Only the event loop's thread calls it: no lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.tokens = 0

    def take(self, job: Job) -> None:
        """Count `job` in, or raise `ServerBusy` (nothing counted) past the limit."""
        if self.tokens + job.work > self.limit:
            raise ServerBusy(
                f"the server is at its bound of work in flight ({self.tokens} of {self.limit} tokens taken; "
                f"this request needs {job.work}, see max_inflight_tokens): retry after {RETRY_AFTER_S} s"
            )
        self.tokens += job.work

    def release(self, job: Job) -> None:
        self.tokens -= job.work


class ClientGone(Exception):
    """The client closed its connection before its response was ready."""


def start(job: Job, backend: Backend, inflight: InFlight) -> list[TokenStream]:
    """Start every prompt of `job`, counted in `inflight` (the caller releases it
    when the response ends; a 429 when it is full); a prompt the engine refuses
    cancels those started, releases the job and raises a 400."""
    inflight.take(job)
    streams: list[TokenStream] = []
    try:
        for prompt in job.prompts:
            streams.append(backend.stream(prompt, job.params))
    except BaseException as e:
        inflight.release(job)
        cancel(streams)
        if isinstance(e, UnavailableError):  # a closed engine's is a ValueError too: a 503 (`errors.py`), not a 400
            raise
        if isinstance(e, (ValueError, TypeError)):
            raise from_engine(e, job.prompt_field) from None
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
