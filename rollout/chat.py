"""Chat messages to prompt text and token ids with the checkpoint's own chat
template, rendered by jinja2 exactly as transformers' `apply_chat_template`
renders it (`transformers/utils/chat_template_utils.py`), without importing
transformers.

Multi-turn sessions never re-render what the model sampled: `followup_ids`
gives only the tokens to append after the model's last turn (see there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .checks import check_positive
from .tokenizer import TextCodec

# Names a message's reasoning may come under; transformers copies the first one
# set to `reasoning_content` (what templates read) and `thinking` (gpt-oss).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# The placeholder turn `followup_ids` renders; plain text no template rewrites.
_SENTINEL = "ROLLOUT-FOLLOWUP-SENTINEL-7c1e"
_PLACEHOLDER = ({"role": "user", "content": "ROLLOUT-FOLLOWUP-USER"}, {"role": "assistant", "content": _SENTINEL})
# How long one rendering may run: real templates take milliseconds, and one
# from an untrusted checkpoint must not hold a server's thread for minutes.
TEMPLATE_TIME_LIMIT_S = 2.0


def is_chat(prompt: object) -> bool:
    """Whether a prompt is chat messages (a list whose first item is a dict)
    rather than text or token ids; `ChatTemplate` checks the rest."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict)


class ChatTemplate:
    """A checkpoint's chat template with the special-token strings it reads.

    `templates` maps names to jinja sources: "default", plus e.g. "tool_use",
    which transformers picks when tools are given. `codec` tokenizes renderings.
    A rendering that runs past `time_limit_s` seconds is stopped (a `ValueError`).
    """

    def __init__(
        self,
        templates: dict[str, str],
        special_tokens: dict[str, str],
        codec: TextCodec | None = None,
        time_limit_s: float = TEMPLATE_TIME_LIMIT_S,
    ) -> None:
        self.time_limit_s = check_positive("time_limit_s", time_limit_s)  # seconds
        self.templates = templates
        self.special_tokens = special_tokens
        self.codec = codec

    @classmethod
    def from_dir(cls, path: str | Path, codec: TextCodec | None = None) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none.

        As transformers loads it: `chat_template.jinja` (and any
        `additional_chat_templates/*.jinja`) when present, else `chat_template`
        in tokenizer_config.json, a string or a list of `{"name", "template"}`.
        Without `codec`, the checkpoint's `tokenizer.json` is loaded for `encode`.
        """
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        templates = _template_files(path) or _config_templates(config, path)
        if not templates:
            return None
        return cls(templates, _special_tokens(config), codec or TextCodec.from_dir(path, ()))

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text of `messages`. `tools` (JSON schemas) and keyword
        variables (e.g. `enable_thinking=False`) reach the template as they are.
        Raises `TypeError`/`ValueError` naming the message index and field for
        malformed messages, and a `ChatTemplateError` (both jinja2's
        `TemplateError` and a `ValueError`) naming the template when it fails:
        it refuses the messages (e.g. roles that do not alternate), has a
        syntax error, reads what is undefined, or runs past `time_limit_s`."""
        check_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise TypeError(f"tools must be None or a list of dicts (JSON schemas), got {tools!r}")
        # Templates read a missing key more safely than None (transformers drops them too).
        chat = _alias_reasoning([{k: _plain(v) for k, v in m.items() if v is not None} for m in messages])
        variables = {**self.special_tokens, "documents": None, **_plain(kwargs)}
        from .chat_jinja import render_bounded  # jinja2 loads with the first rendering, not with rollout

        name = self._name(tools)
        variables.update(messages=chat, tools=_plain(tools), add_generation_prompt=add_generation_prompt)
        return render_bounded(self.templates[name], name, self.time_limit_s, variables)

    def encode(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of `render(...)`, no special tokens added on top (the
        rendering holds them), as `apply_chat_template(tokenize=True)` gives."""
        return self._encode(self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs))

    def followup_ids(
        self,
        messages: list[dict[str, Any]],
        *,
        last_token_id: int | None,
        tools: list[dict[str, Any]] | None = None,
        system: str | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Tokens to append after a conversation whose last assistant turn the
        model sampled (the session keeps those tokens and never re-renders
        them): the turn's closing, the new `messages` and the next prompt.

        A placeholder conversation (the `system` message if given, a user turn,
        an assistant turn holding a sentinel) is rendered alone and with
        `messages` appended (`add_generation_prompt=True`); the follow-up is
        what comes after the sentinel in the second rendering, e.g. for ChatML
        `<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`.
        Its first token is dropped when it is `last_token_id` (the end-of-turn
        token the model sampled) and kept otherwise (a turn cut by max_tokens).
        It is tokenized on its own: exact when it starts with a special token
        (ChatML, Llama 3, Gemma, Mistral's `</s>`); plain text at its start
        could merge differently with the sampled tokens before it.

        This assumes the template renders earlier turns the same whatever
        follows them. Templates that rewrite history break that (Qwen3's drops
        the think block of assistant turns before the last user turn; Mistral
        v0.3's moves tools and the system message to the last user turn):
        `ValueError` when the placeholder's prompt does not start its rendering
        up to the sentinel, or that does not start the rendering with
        `messages`. Pass the conversation's `system` and `tools` so such moves show.
        """
        if last_token_id is not None and (not isinstance(last_token_id, int) or isinstance(last_token_id, bool)):
            raise TypeError(f"last_token_id must be an int or None, got {type(last_token_id).__name__}")
        check_messages(messages)
        placeholder = [{"role": "system", "content": system}] if system is not None else []
        placeholder += _PLACEHOLDER
        text = self._followup_text(placeholder, messages, tools, kwargs)
        ids = self._encode(text)
        return ids[1:] if ids and ids[0] == last_token_id else ids

    def _followup_text(
        self, placeholder: list[dict], messages: list[dict], tools: list[dict] | None, kwargs: dict[str, Any]
    ) -> str:
        prompt = self.render(placeholder[:-1], add_generation_prompt=True, tools=tools, **kwargs)
        before = self.render(placeholder, add_generation_prompt=False, tools=tools, **kwargs)
        after = self.render([*placeholder, *messages], add_generation_prompt=True, tools=tools, **kwargs)
        end = before.find(_SENTINEL) + len(_SENTINEL)
        head = before[:end]
        if end < len(_SENTINEL) or not head.startswith(prompt) or not after.startswith(head):
            raise ValueError(
                "this chat template renders earlier turns differently once later messages follow them, "
                "so a follow-up cannot be appended to the sampled tokens (see ChatTemplate.followup_ids)"
            )
        return after[end:]

    def _name(self, tools: list[dict] | None) -> str:
        # transformers' choice among named templates (get_chat_template).
        if tools is not None and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        raise ValueError(f"the checkpoint has chat templates {sorted(self.templates)} and none named 'default'")

    def _encode(self, text: str) -> list[int]:
        if self.codec is None:
            raise ValueError("the checkpoint has a chat template but no tokenizer.json to encode its text")
        return self.codec.encode(text, add_special_tokens=False)


def check_messages(messages: object) -> None:
    """Raise `TypeError` (wrong kind) or `ValueError` (missing, empty) naming the
    message index and field unless `messages` is a non-empty list of OpenAI-style
    messages: a str `role`; `content` a str, None or a list of content parts
    (dicts), absent only beside `tool_calls` (a list of dicts)."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must hold at least one message, got an empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no 'role'")
        if not isinstance(m["role"], str):
            raise TypeError(f"messages[{i}].role must be a str, got {type(m['role']).__name__}")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise TypeError(f"messages[{i}].tool_calls must be a list of dicts, got {calls!r}")
        if "content" not in m:
            if calls is None:
                raise ValueError(f"messages[{i}] has no 'content' (only a message with tool_calls may omit it)")
            continue
        content = m["content"]
        parts = isinstance(content, list) and all(isinstance(p, dict) for p in content)
        if not (content is None or isinstance(content, str) or parts):
            raise TypeError(
                f"messages[{i}].content must be a str, None or a list of content parts (dicts), "
                f"got {type(content).__name__}"
            )


def _plain(value: Any) -> Any:
    """A copy of JSON-like data, so a template never sees the caller's objects."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in chat:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def _read_json(file: Path) -> dict[str, Any]:
    raw = json.loads(file.read_text()) if file.is_file() else {}  # bad JSON: json's ValueError names the spot
    return raw if isinstance(raw, dict) else {}


def _template_files(path: Path) -> dict[str, str]:
    found = {}
    if (path / "chat_template.jinja").is_file():
        found["default"] = (path / "chat_template.jinja").read_text()
    for file in sorted((path / "additional_chat_templates").glob("*.jinja")):
        found[file.name.removesuffix(".jinja")] = file.read_text()
    return found


def _config_templates(config: dict[str, Any], path: Path) -> dict[str, str]:
    raw = config.get("chat_template")
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in raw):
        return {t["name"]: t["template"] for t in raw}
    raise ValueError(
        f"tokenizer_config.json in {str(path)!r}: chat_template must be a string or a list of "
        f"{{'name', 'template'}} dicts"
    )


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The `*_token` strings of tokenizer_config.json (bos_token, eos_token, ...,
    and model-specific ones such as image_token), which transformers passes to
    the template; an entry may be a string or an AddedToken dict with "content"."""
    named = {k: v for k, v in config.items() if k.endswith("_token")}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):  # named model-specific tokens (transformers >= 5)
        named.update(extra)
    out = {}
    for key, value in named.items():
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out
