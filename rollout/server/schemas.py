"""Request bodies of `/v1/completions` and `/v1/chat/completions` (pydantic v2).

Strict: a JSON string is never a number, a float never an int, a bool never
either. Fields this server does not implement are refused with a 400 naming
them (`extra="forbid"`), since silently ignoring one would change what the
client gets; the few ignored ones (`user`, `metadata`, `store`,
`service_tier`) change nothing a client could see from a single model
(`parallel_tool_calls` acts only on a forced call, `structured.py`). OpenAI fields whose only supported value is their
default (chat's `echo`, `best_of`, ...) are accepted at that value and refused
otherwise (`unsupported`). Responses are plain dicts built in
`responses.py`: a chunk is serialised per token, and a dict is the cheapest."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import MAX_TOP_LOGPROBS


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False  # a last chunk with `usage` and no choices


class CommonRequest(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None  # None: the served model
    n: int = 1
    temperature: float | None = None  # default 1.0
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    # Extensions (vLLM's names).
    top_k: int | None = None  # 0 or None: off
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False  # prompt and completion token ids in the response
    return_routed_experts: bool = False  # mixture-of-experts models: the experts each position went to
    logprobs_mode: str | None = None  # the engine's: "processed" (default), "raw" or "scaled"
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs and this many alternatives (vLLM's)
    repetition_penalty: float | None = None  # (0, 2], 1 or None: off
    # Penalties and biases (`SamplingParams`); logit_bias keys are token ids as strings, as OpenAI's.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI fields ignored: nothing a client sees depends on them here.
    user: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first field set to a value this server cannot honour."""
        for key in self.logit_bias or ():
            if not key.isdigit():
                return "logit_bias", f"logit_bias keys must be token ids (digit strings), got {key!r}"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            k = self.prompt_logprobs
            return "prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}] or null, got {k}"
        return None


class CompletionRequest(CommonRequest):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # the sampled tokens' logprobs and this many top alternatives
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens=0 needs echo=true (the prompt and its logprobs, nothing generated)"
        if self.best_of not in (None, self.n):
            return "best_of", "best_of is not supported (only equal to n)"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            return "logprobs", f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] or null, got {self.logprobs}"
        return super().unsupported()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; fields besides these (`name`, `tool_calls`, `tool_call_id`,
    `reasoning_content`, ...) go to the chat template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as the template reads it: text parts joined with newlines."""
        message = self.model_dump(exclude_none=True, exclude={"content"})
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"messages[{index}].content: only text parts are supported, got {part.type!r}")
            message["content"] = "\n".join(part.text for part in self.content)
        elif self.content is not None:
            message["content"] = self.content
        if "tool_calls" in message:
            message["tool_calls"] = template_tool_calls(message["tool_calls"], index)
        return message


def template_tool_calls(calls, index: int) -> list:
    """An assistant message's `tool_calls` as templates read them: each call's
    `function.arguments`, a JSON string in OpenAI's API, parsed into the object
    that templates write back out (`| tojson`), as vLLM hands them over."""
    if not isinstance(calls, list):
        raise ValueError(f"messages[{index}].tool_calls must be a list of calls")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': str, 'arguments': str}}}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ValueError(f"{where}.function.arguments must be a JSON object, got {arguments!r}") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


class ChatRequest(CommonRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # passed to the chat template
    tool_choice: str | dict[str, Any] | None = None  # "auto", "none", "required" or a function (`structured.py`)
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (`structured.py`)
    echo: bool = False  # refused: prompt logprobs come from /v1/completions (echo) or prompt_logprobs
    parallel_tool_calls: bool | None = None  # false: a forced call is one call (`structured.py`); else ignored
    # Ignored: nothing a client sees depends on them here.
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported on chat completions: use /v1/completions or prompt_logprobs"
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs", "prompt_logprobs with stream=true is supported on /v1/completions only"
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            return "top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] or null, got {self.top_logprobs}"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        return super().unsupported()
