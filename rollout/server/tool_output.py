"""Tool calls in chat responses, as OpenAI's API carries them.

A whole response's message holds the text before the first call as
`content` (null when empty) and `tool_calls`, each `{"id", "type":
"function", "function": {"name", "arguments"}}` with the arguments a JSON
string, and the choice ends with `finish_reason: "tool_calls"`. A stream
sends the content as it comes, held back from where a call may begin
(`rollout.tool_calls.ToolCallStream`), and each call under its `index`: a
delta with the id, type and name (empty arguments) once the name is
written, then its arguments in pieces as they are written; then the last
chunk with the finish reason. The streamed arguments of a call concatenate
to the whole response's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..tool_calls import ToolCall, ToolParser

if TYPE_CHECKING:
    from .responses import Reply


def with_calls(choice: dict, text: str, finish_reason: str, parser: ToolParser) -> None:
    """A whole response's chat `choice` (its `message` built from `text`) with the calls `parser` reads in it."""
    parsed = parser.parse(text)
    if not parsed.calls:
        return
    choice["message"]["content"] = parsed.content
    choice["message"]["tool_calls"] = [c.as_openai() for c in parsed.calls]
    choice["finish_reason"] = finished(finish_reason, parsed.calls)


def finished(finish_reason: str, calls: tuple[ToolCall, ...]) -> str:
    """ "tool_calls" for a sample that ended on its own with calls; a cut one keeps its reason."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def call_chunks(reply: Reply, index: int, deltas: list[dict]) -> list[dict]:
    """The stream chunks of choice `index`'s call deltas (`ToolCallStream.take_deltas`), one each."""
    chunks = []
    for delta in deltas:
        chunk = reply.chunk(index, "")
        chunk["choices"][0]["delta"] = {"tool_calls": [delta]}
        chunks.append(chunk)
    return chunks
