"""Structured outputs through the server, with the real `openai` client and
the openai-agents SDK, on a random tiny model (the session's ASCII
checkpoint) that writes JSON only because the mask makes it:
`response_format` json_schema and json_object, `tool_choice` "required"
and a named function (Hermes calls), and 400s naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import pytest

from rollout.server import EngineBackend, ServerConfig, start_server
from rollout.tool_calls import parse_tool_calls

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "warm": {"type": "boolean"}},
    "required": ["city", "warm"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": SCHEMA}},
]
MESSAGES = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def server(ascii_engine):
    config = ServerConfig("ascii", max_n=4, max_tokens=128, tool_call_parser="hermes")
    server = start_server(EngineBackend(ascii_engine), config, port=0)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_and_object(client, stream):
    schema_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    for response_format, check in (
        (schema_format, lambda v: jsonschema.validate(v, SCHEMA)),
        ({"type": "json_object"}, None),
    ):
        kwargs = dict(model="ascii", messages=MESSAGES, n=2, seed=4, max_tokens=64, response_format=response_format)
        if stream:
            texts = ["", ""]
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
        else:
            texts = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
        for text in texts:
            value = json.loads(text)
            assert isinstance(value, dict)
            if check is not None:
                check(value)


def test_forced_calls_are_valid_calls_of_the_chosen_tools(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in (("required", {"get_weather", "get_time"}), (named, {"get_time"})):
        answer = client.chat.completions.create(
            model="ascii",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,  # one call each: a random model would go on calling until max_tokens
            n=3,
            seed=2,
            max_tokens=128,
        )
        for c in answer.choices:
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message.content
            for call in c.message.tool_calls:
                assert call.function.name in names
                schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
                jsonschema.validate(json.loads(call.function.arguments), schema)
    plain = client.chat.completions.create(model="ascii", messages=MESSAGES, tools=TOOLS, seed=2, max_tokens=24)
    assert not parse_tool_calls(plain.choices[0].message.content or "", "hermes").calls  # unforced, no call


def test_bad_constraints_are_400s_naming_the_field(client):
    import openai

    bad_schema = {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object", "minProperties": "x"}},
    }
    cases = [
        ({"response_format": bad_schema}, "response_format", "response_format.json_schema.schema is not a valid"),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tool_choice": "required"}, "tool_choice", "no tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ]
    for extra, param, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as raised:
            client.chat.completions.create(model="ascii", messages=MESSAGES, max_tokens=8, **extra)
        assert raised.value.body["param"] == param


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_with_tool_choice_required_calls_its_tool_then_answers(server, streamed):
    """The openai-agents SDK with `tool_choice="required"`: the first turn is forced
    to a valid call, the SDK runs the tool, resets tool_choice and the model answers."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"clear in {city}"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model="ascii", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=0.0),
    )

    async def run():
        if not streamed:
            return await Runner.run(agent, "Weather in Paris?", max_turns=3)
        result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert seen in (["Paris"], ["Oslo"])  # the forced call, run by the SDK
    assert len(result.raw_responses) == 2 and isinstance(result.final_output, str)  # then an answer
