"""Tool calls through the server, read by the real `openai` client: a backend
that answers every prompt with a scripted text (SmolLM2's tokenizer under
Qwen 2.5's tool-calling template, so the output is exactly what the test
says), whole and streamed; the history's tool messages and calls rendered
as transformers' `apply_chat_template` renders them."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout.engine.requests import PromptLimits
from rollout.engine.streams import SampleDelta
from rollout.outputs import RolloutOutput, Sample
from rollout.server import ServerConfig, start_server
from rollout.server.backend import prompt_ids
from rollout.tokenizer import TextCodec
from tests.chat_templates import QWEN2_5

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALLS = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 🌍"}}\n</tool_call>'
)


class ScriptedStream:
    """A `TokenStream` that yields `ids` a few tokens per delta, then the output."""

    def __init__(self, prompt: list[int], ids: list[int], text: str) -> None:
        self.prompt, self.ids, self.text = prompt, ids, text

    async def __aiter__(self):
        for at in range(0, len(self.ids), 3):
            piece = tuple(self.ids[at : at + 3])
            last = at + 3 >= len(self.ids)
            yield SampleDelta(0, piece, (-0.5,) * len(piece), (0,) * len(piece), "stop" if last else None)
            await asyncio.sleep(0)
        n = len(self.ids)
        yield RolloutOutput(self.prompt, [Sample(self.ids, [-0.5] * n, [0] * n, "stop", self.text)])

    def cancel(self) -> None:
        pass


class ScriptedBackend:
    """Renders and tokenizes prompts as a real backend does; answers each with
    `script`, or `script(prompt text)` when it is a function."""

    max_seq_len, max_batch_size = 4096, 4

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.script: str | Callable[[str], str] = ""
        self.prompts: list[list[int]] = []  # every prompt's token ids, as rendered

    def prompt_ids(self, prompt, field: str, tools: list | None = None) -> list[int]:
        limits = PromptLimits(self.codec.vocab_size, self.max_seq_len, self.max_batch_size, 16, 1024)
        ids = prompt_ids(prompt, field, tools, limits, self.codec)
        self.prompts.append(ids)
        return ids

    def stream(self, prompt, params) -> ScriptedStream:
        text = self.script(self.codec.decode(prompt)) if callable(self.script) else self.script
        ids = self.codec.encode(text, add_special_tokens=False)
        assert self.codec.decode(ids) == text
        return ScriptedStream(prompt, ids, text)

    def policy_version(self) -> int:
        return 0

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def qwen_style(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2's tokenizer (ChatML's special tokens) under Qwen 2.5's tool template."""
    path = tmp_path_factory.mktemp("qwen_style")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, path / name)
    (path / "chat_template.jinja").write_text(QWEN2_5)
    return path


@pytest.fixture(scope="module")
def scripted(qwen_style):
    backend = ScriptedBackend(TextCodec.from_dir(qwen_style, ()))
    server = start_server(backend, ServerConfig("qwen-style", max_n=4, max_tokens=256), port=0)
    yield backend, server
    server.stop()


@pytest.fixture(scope="module")
def client(scripted):
    import openai

    return openai.OpenAI(base_url=scripted[1].url + "/v1", api_key="none", max_retries=0)


def ask(client, **kwargs):
    messages = [{"role": "user", "content": "Weather in Paris and Zürich?"}]
    return client.chat.completions.create(model="qwen-style", messages=messages, tools=TOOLS, **kwargs)


def test_calls_come_as_openai_defines_them(scripted, client):
    scripted[0].script = CALLS
    choice = ask(client).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_weather", {"city": "Zürich 🌍"}),
    ]
    assert len({c.id for c in calls}) == 2


def test_streamed_deltas_add_up_to_the_whole_response(scripted, client):
    scripted[0].script = CALLS
    content, calls, reasons = "", {}, []
    for chunk in ask(client, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls  # the id and the name come once
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
        reasons.append(choice.finish_reason)
    assert content == "Let me look." and reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in (0, 1)] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Zürich 🌍"}),
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_call_or_tool_choice_none_is_text(scripted, client, stream):
    broken = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    for script, extra in ((broken, {}), (CALLS, {"tool_choice": "none"})):
        scripted[0].script = script
        if stream:
            chunks = list(ask(client, stream=True, **extra))
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
            if extra:  # tool_choice none: no call is read
                assert not deltas
            else:  # the call's name and arguments went out as written, before it broke; then all is content
                arguments = "".join(d.function.arguments or "" for d in deltas)
                assert deltas[0].function.name == "get_weather" and arguments.startswith('{"city": ')
                assert script.split('"arguments": ')[1].startswith(arguments)
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = ask(client, **extra).choices[0]
            content, reason = choice.message.content, choice.finish_reason
            assert choice.message.tool_calls is None
        assert content == script and reason == "stop"


def test_tool_choice_none_renders_no_tools_and_an_unknown_function_is_refused(scripted, client):
    import openai

    scripted[0].script = "Hi."
    ask(client, tool_choice="none")
    assert "# Tools" not in scripted[0].codec.decode(scripted[0].prompts[-1])
    with pytest.raises(openai.BadRequestError, match="'get_time', which is not among tools"):
        ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})


def test_history_with_calls_and_results_renders_as_transformers_renders_it(scripted, client, qwen_style):
    from transformers import PreTrainedTokenizerFast

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    scripted[0].script = "Clear skies."
    answer = client.chat.completions.create(model="qwen-style", messages=history, tools=TOOLS)
    assert answer.choices[0].message.content == "Clear skies." and answer.choices[0].finish_reason == "stop"
    # transformers is handed the arguments as the object a template expects (as vLLM hands them over).
    reference = [dict(m) for m in history]
    reference[1]["tool_calls"] = [{**call, "function": {**call["function"], "arguments": {"city": "Paris"}}}]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(qwen_style)
    text = tokenizer.apply_chat_template(reference, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert scripted[0].prompts[-1] == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_malformed_history_call_is_a_400_naming_it(client):
    import openai

    bad = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [bad]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        client.chat.completions.create(model="qwen-style", messages=history, tools=TOOLS)


@pytest.mark.parametrize("streamed", [False, True])
def test_an_openai_agents_sdk_agent_runs_its_tool_loop(scripted, streamed):
    """The openai-agents SDK's chat-completions model over our server: the agent
    calls the tool, the SDK runs it and sends its result back, the model answers."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"clear in {city}"

    def model(prompt: str) -> str:  # the tool's result in the prompt: answer with it, else call the tool
        if "<tool_response>\nclear in Paris\n</tool_response>" in prompt:
            return "It is clear in Paris."
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

    scripted[0].script = model
    client = AsyncOpenAI(base_url=scripted[1].url + "/v1", api_key="none", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model="qwen-style", openai_client=client),
    )

    async def run():
        if not streamed:
            return (await Runner.run(agent, "Weather in Paris?", max_turns=3)).final_output
        result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result.final_output

    assert asyncio.run(run()) == "It is clear in Paris." and seen == ["Paris"]
