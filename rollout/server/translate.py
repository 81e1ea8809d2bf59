"""A parsed request body -> a `Job`: the prompts and `SamplingParams` to start
on the backend and how to answer. Everything a client can get wrong is
refused here or by the engine's own checks (a `ValueError`/`TypeError`),
before anything starts. The app tokenizes a job's prompts off its event loop,
then bounds its work (`request_work`) before any prompt starts."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..engine.requests import check_request_tokens
from ..sampling_params import SamplingParams
from ..tool_calls import ToolParser, parser_for
from .backend import Backend
from .config import ServerConfig
from .echo import Echo
from .errors import APIError, from_engine
from .schemas import ChatRequest, CommonRequest, CompletionRequest
from .structured import forced_calls, response_format

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class Job:
    """A validated request."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    prompts: list  # one per prompt: text, token ids, or chat messages
    params: SamplingParams
    stream: bool
    include_usage: bool  # streaming: a last chunk with usage
    logprobs: bool  # the sampled tokens' logprobs (and params.top_logprobs alternatives) in the response
    return_token_ids: bool  # prompt and completion token ids in the response
    prompt_field: str  # "prompt" or "messages": where prompt errors point
    tools: list | None = None  # chat: JSON schemas the template renders with the messages
    tool_parser: ToolParser | None = None  # chat with tools: reads calls out of the output; None: text only
    work: int = 0  # prompts x n x (prompt tokens + max_tokens), once tokenized: what it holds in flight
    echo: Echo | None = None  # completions' echo and vLLM's prompt_logprobs (`echo.py`); None: neither


def completion_job(req: CompletionRequest, config: ServerConfig, backend: Backend) -> Job:
    _check_common(req, config)
    prompts = _prompt_list(req.prompt, config.max_prompts)
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    echo = Echo.of(req, prompts)
    # max_tokens=0 (echo only): one token is sampled from the prompt's last row, as any prefill does, and dropped.
    params = _sampling_params(req, max(1, min(max_tokens, config.max_tokens)), "prompt", req.logprobs or 0)
    if echo is not None:
        params = replace(params, prompt_logprobs=echo.prompt_logprobs)
    return replace(_job(req, False, prompts, params, req.logprobs is not None, "prompt"), echo=echo)


def chat_job(req: ChatRequest, config: ServerConfig, backend: Backend) -> Job:
    _check_common(req, config)
    if req.max_completion_tokens is not None:
        _check_max_tokens(req.max_completion_tokens, config, "max_completion_tokens", 1)
    messages = []
    for i, m in enumerate(req.messages):
        try:
            messages.append(m.for_template(i))
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = req.top_logprobs or 0
    params = _sampling_params(req, config.max_tokens if asked is None else asked, "messages", top)
    echo = Echo.of(req, [messages])
    if echo is not None:
        params = replace(params, prompt_logprobs=echo.prompt_logprobs)
    job = _job(req, True, [messages], params, req.logprobs, "messages")
    structured = response_format(req.response_format)
    if not req.tools or req.tool_choice == "none":  # "none": the template is not told of tools
        forced_calls(req.tool_choice, req.tools, None)  # a call forced without tools is refused all the same
        return replace(job, echo=echo, params=replace(params, structured_outputs=structured))
    codec = backend.codec
    parser = parser_for(config.tool_call_parser, codec.chat.templates if codec and codec.chat else None)
    forced = forced_calls(req.tool_choice, req.tools, parser, req.parallel_tool_calls is not False)
    if forced is not None and structured is not None:
        raise APIError(
            400, "response_format cannot constrain a response whose tool_choice forces a call", "tool_choice"
        )
    params = replace(params, structured_outputs=forced or structured)
    # the backend renders the tools with the messages (off the event loop)
    return replace(job, params=params, tools=req.tools, tool_parser=parser, echo=echo)


def _job(req: CommonRequest, chat: bool, prompts: list, params: SamplingParams, logprobs: bool, field: str) -> Job:
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return Job(chat, prompts, params, req.stream, include_usage, logprobs, req.return_token_ids, field)


def request_work(prompts: list[list[int]], params: SamplingParams, config: ServerConfig, backend: Backend) -> int:
    """The work of a request of tokenized `prompts`, as the engine counts it; a
    400 naming `max_tokens` past `config.max_request_tokens`."""
    lengths = [len(p) for p in prompts]
    try:
        return check_request_tokens(lengths, params, backend.max_seq_len, config.max_request_tokens)
    except ValueError as e:
        raise from_engine(e, "prompt") from None


def _check_common(req: CommonRequest, config: ServerConfig) -> None:
    if req.model is not None and req.model != config.model_name:
        raise APIError(
            404,
            f"model {req.model!r} does not exist; this server serves {config.model_name!r}",
            "model",
            "model_not_found",
        )
    refused = req.unsupported()
    if refused is not None:
        raise APIError(400, refused[1], refused[0])
    if req.n > config.max_n:
        raise APIError(400, f"n must be <= {config.max_n} on this server, got {req.n}", "n")
    if req.max_tokens is not None:
        _check_max_tokens(req.max_tokens, config, "max_tokens", MIN_MAX_TOKENS[type(req).__name__])


# The least `max_tokens` per request body (the OpenAPI document states the same bounds):
# 0 on completions, an echo of the prompt alone.
MIN_MAX_TOKENS = {"CompletionRequest": 0, "ChatRequest": 1}


def _check_max_tokens(value: int, config: ServerConfig, name: str, low: int) -> None:
    if not low <= value <= config.max_tokens:
        raise APIError(400, f"{name} must be in [{low}, {config.max_tokens}] on this server, got {value}", name)


def _sampling_params(req: CommonRequest, max_tokens: int, prompt_field: str, top_logprobs: int) -> SamplingParams:
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            min_p=req.min_p or 0.0,
            max_tokens=max_tokens,
            stop_token_ids=req.stop_token_ids,
            stop=req.stop or None,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            logprobs_mode=req.logprobs_mode or "processed",
            top_logprobs=top_logprobs,
            return_routed_experts=req.return_routed_experts,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        )
    except (ValueError, TypeError) as e:
        raise from_engine(e, prompt_field) from None


def _prompt_list(prompt, max_prompts: int) -> list:
    """One entry per prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
    if len(prompts) > max_prompts:
        raise APIError(
            400, f"prompt may hold at most {max_prompts} prompts on this server, got {len(prompts)}", "prompt"
        )
    return prompts
