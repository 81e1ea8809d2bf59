"""Running a `Job` on the backend: one `TokenStream` per prompt, read in the
event loop; whatever way a request ends (finished, failed, client gone),
its streams are cancelled, so an abandoned request frees its KV."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from ..engine.engine import ClosedError
from ..engine.streams import SampleDelta, TokenStream
from ..outputs import RolloutOutput
from .backend import Backend
from .errors import APIError, from_engine
from .translate import Job

Item = SampleDelta | RolloutOutput
_END = object()


class ClientGone(Exception):
    """The client closed its connection before its response was ready."""


def start(job: Job, backend: Backend) -> list[TokenStream]:
    """Start every prompt of `job`; a prompt the engine refuses cancels those started and raises a 400."""
    streams: list[TokenStream] = []
    try:
        for prompt in job.prompts:
            streams.append(backend.stream(prompt, job.params))
    except ClosedError as e:  # a ValueError too: check it first
        cancel(streams)
        raise APIError(503, f"the server is shutting down: {e}", kind="server_error") from None
    except (ValueError, TypeError) as e:
        cancel(streams)
        raise from_engine(e, job.prompt_field) from None
    except BaseException:
        cancel(streams)
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
