"""`ServerConfig`: what the HTTP server allows and who may call it."""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_int
from ..tool_calls import PARSER_NAMES

DEFAULT_MAX_BODY_BYTES = 1 << 20
# A request's work is its prompts x n x (prompt tokens + max_tokens). The
# defaults admit 256 samples of 4096 tokens in one request and four such at
# once; `serve` raises them to the engine's full batch at full length.
DEFAULT_MAX_REQUEST_TOKENS = 1 << 20
DEFAULT_MAX_INFLIGHT_TOKENS = 1 << 22
# Requests admitted and not yet answered, however small: each holds a
# connection, a task, up to `max_body_bytes` of body and its streams.
DEFAULT_MAX_INFLIGHT_REQUESTS = 1024


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Limits and identity of one server; bad values raise naming the field.

    `max_n` and `max_tokens` bound a request before it reaches the engine
    (which caps `max_tokens` by the context and refuses what cannot fit in its
    KV); `serve` defaults them to the engine's `max_batch_size` and
    `max_seq_len`. `max_request_tokens` bounds one request's work (a 400
    past it), `max_inflight_tokens` the work of every request accepted and
    not yet answered and `max_inflight_requests` their count (a 429 with
    `Retry-After` past either); see docs/serving.md."""

    model_name: str  # the one name `/v1/models` lists and requests must use (or omit)
    max_n: int  # samples per prompt
    max_tokens: int  # tokens per sample a request may ask for
    api_key: str | None = None  # None: no key asked for
    allow_no_key: bool = False  # serve without a key on an address other machines can reach
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get a 413
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS  # one request's prompts x n x (prompt + max_tokens)
    max_inflight_tokens: int = DEFAULT_MAX_INFLIGHT_TOKENS  # the same, summed over requests not yet answered
    max_inflight_requests: int = DEFAULT_MAX_INFLIGHT_REQUESTS  # requests admitted and not yet answered
    tool_call_parser: str = "auto"  # rollout.tool_calls.PARSER_NAMES: how chat output's tool calls are read

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")
        check_int("max_n", self.max_n, 1)
        check_int("max_tokens", self.max_tokens, 1)
        check_int("max_body_bytes", self.max_body_bytes, 1024)
        check_int("max_prompts", self.max_prompts, 1)
        check_int("max_request_tokens", self.max_request_tokens, 2)  # one prompt token and one to sample
        check_int(
            "max_inflight_tokens", self.max_inflight_tokens, self.max_request_tokens, "(at least max_request_tokens)"
        )
        check_int("max_inflight_requests", self.max_inflight_requests, 1)
        if self.tool_call_parser not in PARSER_NAMES:
            allowed = ", ".join(PARSER_NAMES)
            raise ValueError(f"tool_call_parser must be one of {allowed}, got {self.tool_call_parser!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if not isinstance(self.allow_no_key, bool):
            raise TypeError(f"allow_no_key must be a bool, got {type(self.allow_no_key).__name__}")
