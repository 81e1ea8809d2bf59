"""Chat templates: `ChatTemplate` renders and encodes token for token as
transformers' `apply_chat_template` (the independent reference) for SmolLM2's
own template and for verbatim Qwen2.5, Llama 3.1, Mistral and Gemma templates;
a multi-turn trajectory built from sampled tokens and `followup_ids` equals the
whole conversation's tokens; bad messages are refused naming the field."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import jinja2
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from rollout import SamplingParams
from rollout.chat import ChatTemplate, is_chat
from tests.chat_templates import FORMATS, ChatFormat

transformers = pytest.importorskip("transformers")

USER1 = {"role": "user", "content": "What is the capital of France?"}
REPLY1 = {"role": "assistant", "content": "The capital of France is Paris."}
USER2 = {"role": "user", "content": "And of Italy?"}
REPLY2 = {"role": "assistant", "content": "Rome is the capital of Italy."}
USER3 = {"role": "user", "content": "Thanks! Which is larger?"}
SYSTEM = {"role": "system", "content": "You answer in one sentence."}
CONVERSATION = [USER1, REPLY1, USER2, REPLY2, USER3]
# Conversations ending on either side, with and without a system message (which Gemma's template refuses).
CHATS = [[USER1], [USER1, REPLY1], [USER1, REPLY1, USER2], [SYSTEM, USER1], [SYSTEM, USER1, REPLY1, USER2]]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": 'e.g. <Paris> & "Rome"'}},
                "required": ["city"],
            },
        },
    }
]

# The Llama 3 / Qwen2 split pattern: runs of newlines stay one piece whatever follows.
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CORPUS = [m["content"] for m in (*CONVERSATION, SYSTEM)] * 20 + ["system user assistant model tool weather city"] * 20


def _tiny_tokenizer(fmt: ChatFormat) -> Tokenizer:
    """A byte-level BPE trained on the test sentences, holding the format's
    control tokens, with a post-processor that adds BOS when it has one: the
    encodings must not add it a second time."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_CORPUS, trainer)
    specials = [t for t in fmt.special_tokens.values() if t] + list(fmt.control_tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(specials)])
    if bos := fmt.special_tokens.get("bos_token"):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


def _save(path: Path, tok: Tokenizer, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    return path


@pytest.fixture(scope="module")
def format_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_formats")
    return {
        name: _save(root / name, _tiny_tokenizer(fmt), {**fmt.special_tokens, "chat_template": fmt.template})
        for name, fmt in FORMATS.items()
    }


@functools.cache
def _reference(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _assert_same(path: Path, messages: list[dict], **kwargs) -> None:
    """Text and ids of `ChatTemplate` equal transformers', or both refuse with the same message."""
    hf, ours = _reference(path), ChatTemplate.from_dir(path)
    try:
        text = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    except jinja2.TemplateError as e:
        with pytest.raises(jinja2.TemplateError, match=re.escape(str(e))):
            ours.render(messages, **kwargs)
        return
    assert ours.render(messages, **kwargs) == text
    assert ours.encode(messages, **kwargs) == hf.apply_chat_template(
        messages, tokenize=True, return_dict=False, **kwargs
    )


@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("messages", CHATS, ids=lambda c: "-".join(m["role"] for m in c))
def test_smollm2_template_matches_transformers(smollm2_path, messages, generation):
    _assert_same(smollm2_path, messages, add_generation_prompt=generation)


@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("messages", CHATS, ids=lambda c: "-".join(m["role"] for m in c))
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_real_templates_match_transformers(format_dirs, name, messages, generation):
    """Gemma's refusal of a system message comes out the same too."""
    _assert_same(format_dirs[name], messages, add_generation_prompt=generation)


def test_template_errors_are_raised(format_dirs):
    with pytest.raises(jinja2.TemplateError, match="System role not supported"):
        ChatTemplate.from_dir(format_dirs["gemma"]).render([SYSTEM, USER1])


TOOL_CALL = {
    "role": "assistant",
    "content": None,
    # Mistral's template wants 9-character ids; the others ignore them.
    "tool_calls": [
        {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ],
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call00001", "content": '{"celsius": 21}'}


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1", "mistral-v0.3", "qwen3"])
@pytest.mark.parametrize(
    "messages", [[USER1], [SYSTEM, USER1], [USER1, TOOL_CALL, TOOL_RESULT]], ids=["user", "system", "tool-call"]
)
def test_tools_pass_through(format_dirs, name, messages):
    """Tool schemas reach the template as they are (tojson without HTML escaping, non-ASCII kept)."""
    _assert_same(format_dirs[name], messages, add_generation_prompt=True, tools=TOOLS)
    assert "°C" in ChatTemplate.from_dir(format_dirs[name]).render(messages, tools=TOOLS)


def test_keyword_variables_reach_the_template(format_dirs):
    _assert_same(format_dirs["llama3.1"], [USER1], add_generation_prompt=True, date_string="01 Jan 2030")
    _assert_same(format_dirs["qwen3"], [USER1], add_generation_prompt=True, enable_thinking=False)


def _token_id(chat: ChatTemplate, text: str) -> int:
    (token,) = chat.codec.encode(text, add_special_tokens=False)
    return token


def _trajectory(chat: ChatTemplate, fmt: ChatFormat, conversation: list[dict]) -> list[int]:
    """A session's tokens, turn by turn: the first prompt, then for each model
    turn its sampled tokens (its content and end-of-turn token, as a model
    samples them) and the follow-up for the messages after it."""
    codec, eot = chat.codec, _token_id(chat, fmt.end_of_turn)
    replies = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    ids = chat.encode(conversation[: replies[0]])
    for k, i in enumerate(replies):
        ids += codec.encode(fmt.reply_prefix + conversation[i]["content"], add_special_tokens=False) + [eot]
        upto = replies[k + 1] if k + 1 < len(replies) else len(conversation)
        ids += chat.followup_ids(conversation[i + 1 : upto], last_token_id=eot)
    return ids


def test_smollm2_followups_rebuild_the_conversation(smollm2_path):
    """[user, assistant, user, assistant, user] built from sampled tokens equals the template's own tokens."""
    chat = ChatTemplate.from_dir(smollm2_path)
    fmt = ChatFormat(chat.templates["default"], {}, (), end_of_turn="<|im_end|>")
    expected = _reference(smollm2_path).apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert _trajectory(chat, fmt, CONVERSATION) == expected
    assert chat.codec.decode(chat.followup_ids([USER2], last_token_id=2)).startswith("\n")  # `<|im_end|>` dropped


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1", "mistral-v0.3", "gemma", "gemma3"])
def test_followups_rebuild_the_conversation(format_dirs, name):
    fmt, chat = FORMATS[name], ChatTemplate.from_dir(format_dirs[name])
    expected = _reference(format_dirs[name]).apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert _trajectory(chat, fmt, CONVERSATION) == expected


def test_followup_after_a_cut_turn_keeps_the_closing(smollm2_path):
    """A turn cut by max_tokens did not sample `<|im_end|>`: the follow-up brings it, and
    the trajectory equals the conversation whose reply is the cut text."""
    chat = ChatTemplate.from_dir(smollm2_path)
    cut = chat.codec.encode("The capital of", add_special_tokens=False)
    ids = chat.encode([USER1]) + cut + chat.followup_ids([USER2], last_token_id=cut[-1])
    expected = _reference(smollm2_path).apply_chat_template(
        [USER1, {"role": "assistant", "content": "The capital of"}, USER2],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert ids == expected
    assert chat.followup_ids([USER2], last_token_id=None)[0] == _token_id(chat, "<|im_end|>")


def test_followup_refuses_templates_that_rewrite_history(format_dirs):
    """Qwen3 renders the last assistant turn with an empty think block and earlier ones without;
    Mistral moves tools (and the system message) to the last user turn."""
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        ChatTemplate.from_dir(format_dirs["qwen3"]).followup_ids([USER2], last_token_id=None)
    mistral = ChatTemplate.from_dir(format_dirs["mistral-v0.3"])
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        mistral.followup_ids([USER2], last_token_id=None, tools=TOOLS)
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        mistral.followup_ids([USER2], last_token_id=None, system=SYSTEM["content"])
    assert mistral.followup_ids([USER2], last_token_id=None)  # without either, turns stay put


def test_followup_with_a_system_message(format_dirs):
    """With the conversation's system message passed, Llama 3.1 and Gemma 3 follow-ups still rebuild it."""
    for name in ("llama3.1", "gemma3", "qwen2.5"):
        fmt, chat = FORMATS[name], ChatTemplate.from_dir(format_dirs[name])
        conversation = [SYSTEM, *CONVERSATION]
        eot = _token_id(chat, fmt.end_of_turn)
        ids = chat.encode(conversation[:2])
        ids += chat.codec.encode(REPLY1["content"], add_special_tokens=False) + [eot]
        ids += chat.followup_ids([USER2], last_token_id=eot, system=SYSTEM["content"])
        expected = _reference(format_dirs[name]).apply_chat_template(
            conversation[:4], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ids == expected, name


# --- loading ----------------------------------------------------------------------------------------------


def test_template_sources_load_as_transformers_loads_them(format_dirs, tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; a list of named templates uses
    "default", and "tool_use" when tools are given; no template at all gives None."""
    tok = Tokenizer.from_file(str(format_dirs["qwen2.5"] / "tokenizer.json"))
    named = [{"name": "default", "template": "{{ 'D:' + messages[0].content }}"}]
    named.append({"name": "tool_use", "template": "{{ 'T:' + (tools | length | string) }}"})
    listed = _save(tmp_path / "listed", tok, {"chat_template": named})
    for tools in (None, TOOLS):
        _assert_same(listed, [USER1], add_generation_prompt=False, tools=tools)
    assert ChatTemplate.from_dir(listed).render([USER1], tools=TOOLS) == "T:1"

    jinja = _save(tmp_path / "jinja", tok, {"chat_template": "from the config"})
    (jinja / "chat_template.jinja").write_text("{{ 'from the file' }}")
    _assert_same(jinja, [USER1], add_generation_prompt=False)
    assert ChatTemplate.from_dir(jinja).render([USER1]) == "from the file"

    assert ChatTemplate.from_dir(_save(tmp_path / "none", tok, {})) is None


def test_special_tokens_reach_the_template(format_dirs, tmp_path):
    """Every `*_token` string of tokenizer_config.json, an AddedToken dict's content included."""
    tok = Tokenizer.from_file(str(format_dirs["qwen2.5"] / "tokenizer.json"))
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "image_token": "<|endoftext|>",
        "chat_template": "{{ bos_token }}|{{ eos_token }}|{{ image_token }}|{{ pad_token is defined }}",
    }
    path = _save(tmp_path / "tokens", tok, config)
    _assert_same(path, [USER1], add_generation_prompt=False)
    assert ChatTemplate.from_dir(path).render([USER1]) == "<|im_start|>|<|im_end|>|<|endoftext|>|False"


def test_encode_adds_no_special_tokens_but_the_codec_still_does(format_dirs):
    chat = ChatTemplate.from_dir(format_dirs["llama3.1"])
    bos = _token_id(chat, "<|begin_of_text|>")
    assert chat.codec.encode("Paris")[0] == bos  # TextCodec.encode keeps its default
    assert chat.codec.encode("Paris", add_special_tokens=False)[0] != bos
    assert chat.encode([USER1]).count(bos) == 1  # the template's own BOS only


# --- checks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ("hello", TypeError, "messages must be a list of dicts, got str"),
        ([], ValueError, "at least one message"),
        ([USER1, "hi"], TypeError, r"messages\[1\] must be a dict, got str"),
        ([{"content": "hi"}], ValueError, r"messages\[0\] has no 'role'"),
        ([USER1, {"role": 3, "content": "hi"}], TypeError, r"messages\[1\]\.role must be a str, got int"),
        ([{"role": "user"}], ValueError, r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": 5}], TypeError, r"messages\[0\]\.content must be a str, None or a list"),
        ([{"role": "user", "content": ["hi"]}], TypeError, r"messages\[0\]\.content must be a str"),
        ([USER1, {"role": "assistant", "tool_calls": "x"}], TypeError, r"messages\[1\]\.tool_calls must be a list"),
    ],
)
def test_bad_messages_are_refused_naming_the_field(format_dirs, messages, error, match):
    chat = ChatTemplate.from_dir(format_dirs["qwen2.5"])
    with pytest.raises(error, match=match):
        chat.render(messages)
    with pytest.raises(error, match=match):
        chat.followup_ids(messages, last_token_id=None)


def test_openai_shaped_messages_are_accepted(format_dirs):
    """Content parts, None content and content left out beside tool_calls are what the OpenAI schema allows."""
    chat = ChatTemplate.from_dir(format_dirs["qwen2.5"])
    parts = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    chat.render([USER1, {k: v for k, v in TOOL_CALL.items() if k != "content"}, TOOL_RESULT])
    chat.render([USER1, TOOL_CALL, TOOL_RESULT])
    ChatTemplate.from_dir(format_dirs["gemma3"]).render([parts])


@pytest.mark.parametrize("tools", ["x", [TOOLS[0], "y"], {"a": 1}])
def test_bad_tools_are_refused(format_dirs, tools):
    with pytest.raises(TypeError, match="tools"):
        ChatTemplate.from_dir(format_dirs["qwen2.5"]).render([USER1], tools=tools)


def test_is_chat():
    assert is_chat([USER1]) and is_chat((USER1, REPLY1))
    assert not any(is_chat(p) for p in ("hi", [], [1, 2, 3], None, {"role": "user"}))


def test_a_codec_sent_to_the_driver_renders_as_the_checkpoints(smollm2_path):
    """Actors send the tokenizer and the chat templates; the driver's codec encodes chat prompts the same."""
    from rollout.tokenizer import TextCodec

    local = TextCodec.from_dir(smollm2_path, (2,))
    sent = TextCodec.from_json(local.to_json(), local.eos_token_ids, local.chat_parts())
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert sent.chat.encode(conversation) == local.chat.encode(conversation)
    assert sent.chat.followup_ids(conversation[1:], last_token_id=2) == local.chat.followup_ids(
        conversation[1:], last_token_id=2
    )


def test_engine_takes_chat_messages_as_prompts_and_sessions(smollm2_path):
    from tests.conftest import make_engine

    engine = make_engine(smollm2_path, max_batch_size=2, max_seq_len=128, kv_cache_tokens=512)
    conversation = [{"role": "user", "content": "Say hi."}]
    reference = transformers.AutoTokenizer.from_pretrained(str(smollm2_path)).apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    (out,) = engine.generate([conversation], SamplingParams(max_tokens=1))
    assert out.prompt_token_ids == reference and out.prompt == engine.tokenizer.chat.render(conversation)
    with pytest.raises(TypeError, match=r"one list of chat messages"):
        engine.generate(conversation, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        engine.generate([[{"role": "user"}]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="tools"):
        engine.session([1, 2, 3], tools=TOOLS)
    with engine.session(conversation) as sess:
        assert sess.token_ids == reference
        with pytest.raises(ValueError, match="right after a sampled turn"):
            sess.append([{"role": "user", "content": "again"}])
