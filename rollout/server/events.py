"""A streamed response: the server-sent events of one `Job`.

One chunk per sample per engine step (the sample's new tokens, their
logprobs and versions, and the text they release; see `streaming.py`),
then each sample's last chunk (the rest of its text and its
`finish_reason`) when its prompt's `RolloutOutput` arrives, an optional
usage chunk, and `data: [DONE]`. A chat stream opens with a chunk per
choice that carries the assistant role; a completions stream with echo or
`prompt_logprobs` has each choice's first chunk carry its prompt (`echo.py`). An error after the stream began
is sent as an `{"error": ...}` event before `[DONE]`, since the status
line has gone out already."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ..engine.errors import UnavailableError
from ..engine.streams import SampleDelta, TokenStream
from ..outputs import RolloutOutput
from ..tool_calls import ToolCallStream
from .echo import drop_delta, drop_samples, echo_chunk
from .errors import internal_error, unavailable
from .generation import cancel, items
from .metrics import Metrics
from .responses import Reply
from .streaming import SSE_DONE, SampleText, sse
from .tool_output import call_chunks, finished


async def events(reply: Reply, streams: list[TokenStream], metrics: Metrics) -> AsyncIterator[bytes]:
    job, n = reply.job, reply.job.params.n
    decode = reply.codec.decode if reply.codec is not None else None
    texts = [SampleText(decode, job.params.stop) for _ in range(len(streams) * n)]
    calls = [ToolCallStream(job.tool_parser) for _ in texts] if job.tool_parser is not None else None
    outputs: list[RolloutOutput | None] = [None] * len(streams)
    try:
        if reply.chat:
            for c in range(len(texts)):
                yield sse(reply.chunk(c, "", first=True))
        async for p, item in items(streams):
            if isinstance(item, SampleDelta):
                item = drop_delta(job.echo, item)
                c = p * n + item.index
                last = item.finish_reason is not None
                sample = texts[c]
                text = sample.restart(item.token_ids, last) if item.restarted else sample.add(item.token_ids, last)
                deltas = ()
                if calls is not None:
                    calls[c] = ToolCallStream(job.tool_parser) if item.restarted else calls[c]
                    text = calls[c].feed(text)
                    deltas = calls[c].take_deltas()
                chunk = reply.chunk(
                    c,
                    text,
                    item.token_ids,
                    item.logprobs,
                    item.versions,
                    top=item.top_logprobs,
                    restarted=item.restarted,
                )
                if not reply.chat:
                    echo_chunk(reply, chunk, p, item)
                metrics.completion_tokens += len(item.token_ids)
                yield sse(chunk)
                for chunk in call_chunks(reply, c, deltas):
                    yield sse(chunk)
            else:
                item = outputs[p] = drop_samples(job.echo, [item])[0]
                metrics.prompt_tokens += len(item.prompt_token_ids)
                for k, s in enumerate(item.samples):
                    c, reason = p * n + k, s.finish_reason
                    rest = texts[c].finish(s.text)
                    if calls is not None:
                        rest, found = calls[c].finish(rest)
                        if rest:
                            yield sse(reply.chunk(c, rest))
                        for chunk in call_chunks(reply, c, calls[c].take_deltas()):
                            yield sse(chunk)
                        rest, reason = "", finished(reason, found)
                    yield sse(reply.last_chunk(c, rest, reason, item))
        if job.include_usage:
            yield sse(reply.usage_chunk(outputs))
    except UnavailableError as e:  # no actor came back, or a shutdown, while it waited: a 503's body
        yield sse(unavailable(e).body())
    except Exception as e:  # noqa: BLE001 (the client hears of it; the status line has gone out)
        yield sse(internal_error(e))
    finally:
        cancel(streams)
    yield SSE_DONE
