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
back from where a call may begin, and each call's name once written and its
arguments in pieces as they are written (`scan_calls`), so a stream carries
what the whole response does: a call's arguments are the text as the model
wrote it whenever that is how `parse` reads them.
`rollout.tool_constraints.call_constraint` constrains a sample to calls.

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


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call, as `message.tool_calls[i]` carries it."""

    name: str  # the function's name
    arguments: str  # its arguments, a JSON object as a string
    id: str = field(default_factory=lambda: new_call_id())

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
        return ParsedText(text[:at].rstrip() or None, _as_written(text[at:], calls))

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
    that may go out now; `take_deltas` then gives the calls' stream deltas so
    far: a call's id and name once its name is written, and its arguments in
    pieces as they are written. `finish` once it ends gives the rest of the
    content and the calls (and `take_deltas` their remaining pieces). The
    concatenated content and each call's argument pieces equal `parse` of the
    whole text, unless a call went out and a later one does not parse (the whole
    text is then content, and what went out of the calls stays sent)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""  # everything fed
        self.sent = 0  # characters of it released as content
        self.in_call = False  # a call has begun: no more content is released until the end
        self.scanner: CallScanner | None = None  # reads the calls as they are written, once in_call
        self.streamed: list[tuple[str, str]] = []  # per call begun: its id, its arguments sent so far
        self.deltas: list[dict] = []  # not yet taken

    def feed(self, text: str) -> str:
        searched = len(self.text)
        self.text += text
        if self.in_call:
            self._stream_calls(self.scanner.scan(self.text))
            return ""
        if not text:
            return ""
        if self.parser.leading and self.sent:  # text went out already: no call can follow
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        at = self.parser.call_start(self.text, searched)
        if at is not None:
            self.in_call, self.scanner = True, CallScanner(at)
            end = at
        else:
            end = len(self.text) - self.parser.may_start(self.text)
        while end > self.sent and self.text[end - 1].isspace():  # cut from the content if a call follows
            end -= 1
        out = self.text[self.sent : max(end, self.sent)]
        self.sent += len(out)
        if self.in_call:
            self._stream_calls(self.scanner.scan(self.text))
        return out

    def finish(self, text: str = "") -> tuple[str, tuple[ToolCall, ...]]:
        """The sample's remaining text in; (content still to send, calls) out."""
        self.text += text
        parsed = self.parser.parse(self.text)
        content = self.text if not parsed.calls else (parsed.content or "")
        out = content[self.sent :]
        self.sent = len(content)
        self._stream_calls([ScannedCall(c.name, c.arguments, True) for c in parsed.calls])
        return out, parsed.calls

    def take_deltas(self) -> list[dict]:
        """The calls' stream deltas since the last take, as OpenAI's `delta.tool_calls[0]`."""
        out, self.deltas = self.deltas, []
        return out

    def _stream_calls(self, calls: list[ScannedCall]) -> None:
        for i in range(max(0, len(self.streamed) - 1), len(calls)):  # the calls done went out whole already
            call = calls[i]
            if i == len(self.streamed):
                call_id = new_call_id()
                self.deltas.append(
                    {"index": i, "id": call_id, "type": "function", "function": {"name": call.name, "arguments": ""}}
                )
                self.streamed.append((call_id, ""))
            call_id, sent = self.streamed[i]
            if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                self.deltas.append({"index": i, "function": {"arguments": call.arguments[len(sent) :]}})
                self.streamed[i] = (call_id, call.arguments)


@dataclass(frozen=True, slots=True)
class ScannedCall:
    """A call as far as its text goes: its name and its arguments' text so far."""

    name: str
    arguments: str
    complete: bool  # the arguments' object is closed


# A call object's start up to its arguments' object: {"name": "...", "arguments" (or "parameters"): {
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def scan_calls(text: str, at: int = 0) -> list[ScannedCall]:
    """The calls written in `text` from `at` on, the last maybe unfinished: each call
    object whose name comes before its arguments (an object), in order. The arguments
    are the text as written, which `parse` also gives when it reads the same calls."""
    return CallScanner(at).scan(text)


class CallScanner:
    """`scan_calls` over a growing text, reading each character once: `scan(text)`
    after each piece (the text so far) gives the calls so far."""

    LOOKBACK = 512  # characters a call's head may span while it is written

    def __init__(self, at: int = 0) -> None:
        self.at = at  # where the next call's head is searched from
        self.calls: list[ScannedCall] = []
        self.start = 0  # the open call's arguments begin here
        self.pos = -1  # scanned up to here in the open call's arguments; -1: no call open
        self.depth, self.in_string, self.escaped = 0, False, False

    def scan(self, text: str) -> list[ScannedCall]:
        while True:
            if self.pos < 0:
                head = _CALL_HEAD.search(text, self.at)
                if head is None:
                    self.at = max(self.at, len(text) - self.LOOKBACK)
                    return self.calls
                self.start = self.pos = head.end()
                self.depth, self.in_string, self.escaped = 0, False, False
                self.calls.append(ScannedCall(json.loads(head.group(1)), "", False))
            end = self._advance(text)
            name = self.calls[-1].name
            self.calls[-1] = ScannedCall(name, text[self.start : end or len(text)], end is not None)
            if end is None:
                return self.calls
            self.pos, self.at = -1, end

    def _advance(self, text: str) -> int | None:
        """Scan the open call's arguments on: past their object's end, or None if `text` ends inside it."""
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        for i in range(self.pos, len(text)):
            ch = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
        self.pos, self.depth, self.in_string, self.escaped = len(text), depth, in_string, escaped
        return None


def _as_written(text: str, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
    """`calls` read from `text`, each with its arguments as the text writes them when
    `scan_calls` finds the same calls (the same names and the same objects): what a
    stream sends piece by piece. Otherwise as read (re-serialised)."""
    scanned = scan_calls(text)
    if len(scanned) != len(calls):
        return calls
    out = []
    for call, seen in zip(calls, scanned, strict=True):
        try:
            same = seen.complete and seen.name == call.name and json.loads(seen.arguments) == json.loads(call.arguments)
        except json.JSONDecodeError:
            same = False
        if not same:
            return calls
        out.append(ToolCall(call.name, seen.arguments, call.id))
    return tuple(out)


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
