"""Tool-call parsers on hand-written outputs of each format: several calls,
content before them, malformed calls left as text; streamed in random
pieces, the content and calls equal the whole text's."""

from __future__ import annotations

import json
import random

import pytest

from rollout.tool_calls import PARSERS, ToolCallStream, parse_tool_calls, parser_for
from tests.chat_templates import FORMATS

WEATHER = {"city": "Paris", "unit": "°C"}
HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
LLAMA = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}; '
    '{"name": "now", "parameters": {}}'
)
MISTRAL = (
    'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}, '
    '{"name": "now", "arguments": {}}]'
)
CASES = [("hermes", HERMES, "Let me check."), ("llama3_json", LLAMA, None), ("mistral", MISTRAL, "Let me check.")]


@pytest.mark.parametrize(("parser", "text", "content"), CASES)
def test_each_format_gives_its_calls_and_the_text_before_them(parser, text, content):
    parsed = parse_tool_calls(text, parser)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", WEATHER), ("now", {})]
    assert len({c.id for c in parsed.calls}) == 2 and all(c.id.startswith("call_") for c in parsed.calls)


def test_llama3_json_without_the_tag_and_a_plain_answer():
    parsed = parse_tool_calls(' {"name": "now", "arguments": {"tz": "UTC"}}', "llama3_json")
    assert parsed.content is None and [(c.name, c.arguments) for c in parsed.calls] == [("now", '{"tz": "UTC"}')]
    assert parse_tool_calls("It is sunny {really}.", "llama3_json").calls == ()


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", 'ok <tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "argu'),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("hermes", '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'),  # arguments not an object
        ("llama3_json", '{"name": "a", "parameters": {}}; {"name": '),
        ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}] trailing'),
        ("mistral", "[TOOL_CALLS]not json"),
    ],
)
def test_a_call_that_does_not_parse_leaves_the_whole_text_as_content(parser, text):
    parsed = parse_tool_calls(text, parser)
    assert parsed.content == text and parsed.calls == ()


def test_arguments_written_as_a_json_string_are_read_as_the_object():
    parsed = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', "hermes")
    assert parsed.calls[0].arguments == '{"x": 1}'


@pytest.mark.parametrize(
    ("family", "parser"),
    [("qwen2.5", "hermes"), ("qwen3", "hermes"), ("llama3.1", "llama3_json"), ("mistral-v0.3", "mistral")]
    + [("gemma3", None)],
)
def test_auto_picks_the_parser_of_each_real_template(family, parser):
    found = parser_for("auto", {"default": FORMATS[family].template})
    assert (found.name if found else None) == parser


def test_auto_picks_by_the_template_markers():
    assert parser_for("auto", {"default": "{{ '<tool_call>' }}"}).name == "hermes"
    assert parser_for("auto", {"default": "[TOOL_CALLS] {{ x }}"}).name == "mistral"
    assert parser_for("auto", {"default": "<|python_tag|>"}).name == "llama3_json"
    assert parser_for("auto", {"default": "{{ messages }}"}) is None and parser_for("auto", None) is None
    assert parser_for("none", {"default": "<tool_call>"}) is None
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, hermes"):
        parser_for("qwen", None)
    with pytest.raises(ValueError, match="parser must be one of hermes, llama3_json, mistral"):
        parse_tool_calls("", "auto")


TEXTS = [
    *(t for _, t, _ in CASES),
    "plain text with < and [ and { but no call",
    "almost <tool_cal",
    '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"bad',
    '   \n {"name": "now", "parameters": {}}',
]


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_streamed_in_pieces_the_content_and_calls_equal_the_whole_texts(parser):
    rng = random.Random(0)
    for text in TEXTS:
        whole = parse_tool_calls(text, parser)
        for _ in range(20):
            stream, sent, at = ToolCallStream(PARSERS[parser]()), [], 0
            while at < len(text):
                step = rng.randint(0, 5)
                piece = stream.feed(text[at : at + step])
                sent.append(piece)
                assert "".join(sent) == text[: len("".join(sent))]  # only the text's own prefix goes out
                at += step
            rest, calls = stream.finish()
            content = "".join(sent) + rest
            assert content == (whole.content or "") and [(c.name, c.arguments) for c in calls] == [
                (c.name, c.arguments) for c in whole.calls
            ]
            if whole.calls:  # nothing of a call went out as content
                assert stream.parser.start not in content and '"name"' not in content


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_arguments_stream_as_written_and_add_up_to_the_whole_calls(parser):
    """Each call's name goes out once it is written and its arguments in pieces as they are
    written, before the sample ends; the pieces concatenate to the whole text's arguments,
    which are the text as the model wrote it."""
    rng = random.Random(1)
    for text in (t for p, t, _ in CASES if p == parser):
        whole = parse_tool_calls(text, parser)
        assert whole.calls and all(c.arguments in text for c in whole.calls)  # as written, spacing and all
        stream, at, streamed, partial = ToolCallStream(PARSERS[parser]()), 0, {}, 0
        while at < len(text):
            step = rng.randint(1, 4)
            stream.feed(text[at : at + step])
            at += step
            for d in stream.take_deltas():
                if "id" in d:
                    streamed[d["index"]] = [d["function"]["name"], ""]
                streamed[d["index"]][1] += d["function"]["arguments"]
                partial += streamed[d["index"]][1] not in ("", whole.calls[d["index"]].arguments)
        assert [tuple(c) for c in streamed.values()] == [(c.name, c.arguments) for c in whole.calls]
        assert partial  # some pieces went out with their call's arguments still unfinished
        stream.finish()
        assert stream.take_deltas() == []
