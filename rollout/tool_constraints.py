"""A forced tool call as a grammar: the output constrained to one or more
calls of given functions in a tool-call parser's format (`tool_choice`
"required" or a named function), as an xgrammar structural tag for
`StructuredOutputs(structural_tag=...)`."""

from __future__ import annotations

import json

from .tool_calls import ToolParser


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
