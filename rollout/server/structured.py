"""Chat's `response_format` and `tool_choice` as the engine's
`StructuredOutputs` (docs/serving.md#structured-outputs).

    response_format {"type": "text"} or null     free text
                    {"type": "json_object"}      any JSON object
                    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                 a JSON object valid for the schema
    tool_choice     "auto" or null               the model decides (calls parsed, not forced)
                    "none"                       the template is not told of the tools
                    "required"                   one or more calls of the request's tools
                    {"type": "function", "function": {"name": ...}}
                                                 one or more calls of that function
    parallel_tool_calls false                    a forced response holds one call

A forced call is constrained to the format of the server's tool-call parser
(`rollout.tool_constraints.call_constraint`), its arguments to the function's
parameters schema. Each shape a client can get wrong is a 400 naming the
field; a schema the grammar library refuses is one too, from the engine
(`schema_error`).
"""

from __future__ import annotations

from ..structured import StructuredOutputs
from ..tool_calls import ToolParser
from ..tool_constraints import call_constraint
from .errors import APIError


def response_format(value: dict | None) -> StructuredOutputs | None:
    """`response_format` as a constraint; None for text."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type")
    if kind == "json_object" and set(value) == {"type"}:
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(
                400,
                "response_format.json_schema must be {'name': str, 'schema': a JSON schema object, 'strict': bool}",
                "response_format",
            )
        return StructuredOutputs(json=spec.get("schema") or {"type": "object"})
    raise APIError(
        400,
        "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
        f"{{'type': 'json_schema', 'json_schema': {{...}}}}, got {value!r}",
        "response_format",
    )


def forced_calls(
    tool_choice, tools: list | None, parser: ToolParser | None, parallel: bool = True
) -> StructuredOutputs | None:
    """The constraint of `tool_choice` "required" or a named function (one call when not
    `parallel`: `parallel_tool_calls=false`); None for "auto", "none" or null."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice != "required" and not _is_named(tool_choice):
        raise APIError(
            400,
            "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': str}}, "
            f"got {tool_choice!r}",
            "tool_choice",
        )
    if not tools:
        raise APIError(400, "tool_choice forces a call, and the request has no tools", "tool_choice")
    if parser is None:
        raise APIError(
            400,
            "tool_choice forces a call, and this server reads no tool-call format: start it with "
            "--tool-call-parser hermes, llama3_json or mistral",
            "tool_choice",
        )
    functions = [_function(i, t) for i, t in enumerate(tools)]
    if tool_choice != "required":
        name = tool_choice["function"]["name"]
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among tools", "tool_choice")
    return StructuredOutputs(structural_tag=call_constraint(parser, functions, parallel))


def _is_named(choice) -> bool:
    return (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    )


def _function(i: int, tool) -> dict:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return function


# What the engine's messages name, as the request's fields name it.
_RENAMES = {
    "structured_outputs.json": "response_format.json_schema.schema",
    "structured_outputs.json_object": "response_format",
    "structured_outputs.structural_tag": "tools",  # the tag is built from the tools' parameter schemas
}


def schema_error(message: str) -> APIError | None:
    """A 400 naming the request's field for an engine error about its constraint; None for any other error."""
    for engine_name, field in _RENAMES.items():
        if message.startswith(engine_name + " "):
            message = field + message[len(engine_name) :]
            return APIError(400, message, field.split(".")[0])
    if message.startswith("structured_outputs"):
        return APIError(400, message, "response_format")
    return None
