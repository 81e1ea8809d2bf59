"""A streamed response: the server-sent events of one `Job`.

One chunk per sample per engine step (the sample's new tokens, their
logprobs and versions, and the text they release; see `streaming.py`),
then each sample's last chunk (the rest of its text and its
`finish_reason`) when its prompt's `RolloutOutput` arrives, an optional
usage chunk, and `data: [DONE]`. A chat stream opens with a chunk per
choice that carries the assistant role. An error after the stream began
is sent as an `{"error": ...}` event before `[DONE]`, since the status
line has gone out already."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ..engine.errors import UnavailableError
from ..engine.streams import SampleDelta, TokenStream
from ..outputs import RolloutOutput
from .errors import internal_error, unavailable
from .generation import cancel, items
from .metrics import Metrics
from .responses import Reply
from .streaming import SSE_DONE, SampleText, sse


async def events(reply: Reply, streams: list[TokenStream], metrics: Metrics) -> AsyncIterator[bytes]:
    job, n = reply.job, reply.job.params.n
    decode = reply.codec.decode if reply.codec is not None else None
    texts = [SampleText(decode, job.params.stop) for _ in range(len(streams) * n)]
    outputs: list[RolloutOutput | None] = [None] * len(streams)
    try:
        if reply.chat:
            for c in range(len(texts)):
                yield sse(reply.chunk(c, "", first=True))
        async for p, item in items(streams):
            if isinstance(item, SampleDelta):
                c = p * n + item.index
                last = item.finish_reason is not None
                sample = texts[c]
                text = sample.restart(item.token_ids, last) if item.restarted else sample.add(item.token_ids, last)
                chunk = reply.chunk(
                    c,
                    text,
                    item.token_ids,
                    item.logprobs,
                    item.versions,
                    top=item.top_logprobs,
                    restarted=item.restarted,
                )
                metrics.completion_tokens += len(item.token_ids)
                yield sse(chunk)
            else:
                outputs[p] = item
                metrics.prompt_tokens += len(item.prompt_token_ids)
                for k, s in enumerate(item.samples):
                    yield sse(reply.last_chunk(p * n + k, texts[p * n + k].finish(s.text), s.finish_reason, item))
        if job.include_usage:
            yield sse(reply.usage_chunk(outputs))
    except UnavailableError as e:  # no actor came back, or a shutdown, while it waited: a 503's body
        yield sse(unavailable(e).body())
    except Exception as e:  # noqa: BLE001 (the client hears of it; the status line has gone out)
        yield sse(internal_error(e))
    finally:
        cancel(streams)
    yield SSE_DONE
