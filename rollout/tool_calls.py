"""Tool calls in a model's text, in the formats the common chat templates ask for.

    hermes       Hermes, Qwen 2.5/3:  text <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    llama3_json  Llama 3.x:           [<|python_tag|>]{"name": ..., "parameters": {...}}; {...}
    mistral      Mistral:             text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

`parse(text)` gives the text before the first call (its trailing whitespace
cut; None when nothing is left) and
the calls, each with its arguments as a JSON string, as OpenAI's API
carries them. A call whose JSON does not parse, or lacks a name, leaves
the whole text as content and no calls: a model that half-wrote a call
said something, and a client reads it as text rather than an error.
`ToolCallStream` releases a streamed sample's content as it comes, holding
back from where a call may begin, and gives the calls once the sample
ends, so a stream carries exactly what the whole response does.

The server picks a parser with `rollout serve --tool-call-parser`;
`parser_for("auto", templates)` recognises a template by the markers it
renders. Without a server, `parse_tool_calls(sample.text, "hermes")` reads
a `Session` turn's calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

PARSER_NAMES = ("auto", "hermes", "llama3_json", "mistral", "none")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call, as `message.tool_calls[i]` carries it."""

    name: str  # the function's name
    arguments: str  # its arguments, a JSON object as a string
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedText:
    """A sample's text split into what it says and what it calls."""

    content: str | None  # the text before the first call, trailing whitespace cut; None when empty
    calls: tuple[ToolCall, ...]  # empty: no call, or one that did not parse (then `content` is the whole text)


class ToolParser:
    """One format. `start` is where a call may begin (a marker); subclasses read the calls."""

    name = ""
    start = ""
    leading = False  # calls may only open the text: once text has gone out, none can follow

    def parse(self, text: str) -> ParsedText:
        at = self.call_start(text)
        if at is None:
            return ParsedText(text, ())
        calls = self.read_calls(text[at:])
        if not calls:
            return ParsedText(text, ())
        return ParsedText(text[:at].rstrip() or None, calls)

    def call_start(self, text: str, since: int = 0) -> int | None:
        """Where the first call begins in `text`, or None; `text[:since]` is known
        to hold no whole marker (a stream searches only what is new)."""
        at = text.find(self.start, max(0, since - len(self.start) + 1))
        return at if at >= 0 else None

    def may_start(self, text: str) -> int:
        """How many trailing characters of `text` (no call found in it) must be
        held back, as a call's marker may be completing there."""
        at = text.find(self.start[0], max(0, len(text) - len(self.start) + 1))
        while at >= 0:  # the earliest place in the tail where the marker may be starting
            if self.start.startswith(text[at:]):
                return len(text) - at
            at = text.find(self.start[0], at + 1)
        return 0

    def read_calls(self, text: str) -> tuple[ToolCall, ...]:
        """The calls of `text` (starting at the first call); () when any does not parse."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name, start = "hermes", "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def read_calls(self, text: str) -> tuple[ToolCall, ...]:
        bodies = self._CALL.findall(text)
        calls = [_call(body) for body in bodies]
        return () if not calls or None in calls else tuple(calls)  # type: ignore[arg-type]


class Llama3JsonParser(ToolParser):
    """Calls are the whole message: JSON objects separated by `;`, maybe after `<|python_tag|>`."""

    name, start, leading = "llama3_json", "<|python_tag|>", True

    def call_start(self, text: str, since: int = 0) -> int | None:
        stripped = len(text) - len(text.lstrip())
        if text.startswith(self.start, stripped) or text.startswith("{", stripped):
            return stripped
        return None

    def may_start(self, text: str) -> int:
        # Nothing but whitespace may come before a call: hold all of that, or nothing.
        rest = text.lstrip()
        return len(text) if not rest or self.start.startswith(rest) else 0

    def read_calls(self, text: str) -> tuple[ToolCall, ...]:
        text = text.removeprefix(self.start).strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(text):
            try:
                obj, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return ()
            call = _call_object(obj, ("parameters", "arguments"))
            if call is None:
                return ()
            calls.append(call)
            at = _skip(text, at, ";")
        return tuple(calls)


class MistralParser(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"

    def read_calls(self, text: str) -> tuple[ToolCall, ...]:
        text = text.removeprefix(self.start).strip()
        try:
            obj, end = json.JSONDecoder().raw_decode(text)
        except json.JSONDecodeError:
            return ()
        if text[end:].strip() or not isinstance(obj, list) or not obj:
            return ()
        calls = [_call_object(item, ("arguments",)) for item in obj]
        return () if None in calls else tuple(calls)  # type: ignore[arg-type]


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for(name: str, templates: dict[str, str] | None) -> ToolParser | None:
    """The parser `name` (one of `PARSER_NAMES`); "auto" picks by the markers
    the chat `templates` (their jinja sources) render, None when none is
    recognised; "none": None. Raises `ValueError` naming the allowed values."""
    if name not in PARSER_NAMES:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSER_NAMES)}, got {name!r}")
    if name == "none":
        return None
    if name != "auto":
        return PARSERS[name]()
    source = "\n".join((templates or {}).values())
    for marker, parser in (("<tool_call>", HermesParser), ("[TOOL_CALLS]", MistralParser)):
        if marker in source:
            return parser()
    if "<|python_tag|>" in source or "ipython" in source:
        return Llama3JsonParser()
    return None


def parse_tool_calls(text: str, parser: str | ToolParser) -> ParsedText:
    """`text`'s content and calls in the format `parser` names (see `PARSERS`)."""
    if isinstance(parser, str):
        if parser not in PARSERS:
            raise ValueError(f"parser must be one of {', '.join(PARSERS)}, got {parser!r}")
        parser = PARSERS[parser]()
    return parser.parse(text)


class ToolCallStream:
    """One streamed sample: `feed` the text as it is released, get the content
    that may go out now; `finish` once it ends, get the rest of the content
    and the calls. The concatenated content and the calls equal `parse` of
    the whole text: calls are given only at the end, as a later call that does
    not parse turns the whole text back into content."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""  # everything fed
        self.sent = 0  # characters of it released as content
        self.in_call = False  # a call has begun: nothing more is released until the end

    def feed(self, text: str) -> str:
        searched = len(self.text)
        self.text += text
        if self.in_call or not text:
            return ""
        if self.parser.leading and self.sent:  # text went out already: no call can follow
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        at = self.parser.call_start(self.text, searched)
        if at is not None:
            self.in_call = True
            end = at
        else:
            end = len(self.text) - self.parser.may_start(self.text)
        while end > self.sent and self.text[end - 1].isspace():  # cut from the content if a call follows
            end -= 1
        out = self.text[self.sent : max(end, self.sent)]
        self.sent += len(out)
        return out

    def finish(self, text: str = "") -> tuple[str, tuple[ToolCall, ...]]:
        """The sample's remaining text in; (content still to send, calls) out."""
        self.text += text
        parsed = self.parser.parse(self.text)
        content = self.text if not parsed.calls else (parsed.content or "")
        out = content[self.sent :]
        self.sent = len(content)
        return out, parsed.calls


def call_constraint(parser: ToolParser, functions: list[dict], parallel: bool = True) -> dict:
    """An xgrammar structural tag (`StructuredOutputs(structural_tag=...)`) that admits one or more
    calls (one when not `parallel`) in `parser`'s format, each of one of `functions` (OpenAI's
    `{"name", "parameters"}`) with arguments valid for its parameters' JSON schema, and nothing
    else: what `tool_choice` "required" or a named function asks for. `parser.parse` reads
    every text it admits."""
    key = "parameters" if parser.name == "llama3_json" else "arguments"
    tags = [
        {
            "type": "tag",
            "begin": f'{{"name": {json.dumps(f["name"], ensure_ascii=False)}, "{key}": ',
            "content": {
                "type": "json_schema",
                "json_schema": f.get("parameters") or {"type": "object"},
                "max_whitespace_cnt": 1,  # a weak model's runs of spaces never end a call
            },
            "end": "}",
        }
        for f in functions
    ]
    if parser.name == "hermes":
        for tag in tags:
            tag["begin"], tag["end"] = "<tool_call>\n" + tag["begin"], tag["end"] + "\n</tool_call>"
    separator = {"hermes": "\n", "llama3_json": "; ", "mistral": ", "}[parser.name]
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    if parser.name == "mistral":
        calls = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "[TOOL_CALLS]["},
                calls,
                {"type": "const_string", "value": "]"},
            ],
        }
    return {"type": "structural_tag", "format": calls}


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_object(obj, ("arguments", "parameters"))


def _call_object(obj, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from `{"name": str, <argument key>: object}`, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _skip(text: str, at: int, separator: str) -> int:
    """Past whitespace and one `separator` (and whitespace again) from `at`."""
    while at < len(text) and text[at].isspace():
        at += 1
    if at < len(text) and text[at] == separator:
        at += 1
    while at < len(text) and text[at].isspace():
        at += 1
    return at
