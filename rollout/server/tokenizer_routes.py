"""The tokenizer routes, in vLLM's shapes, so a client needs no local copy of
the tokenizer (lm-evaluation-harness' `tokenizer_backend=remote` uses them):

    POST /tokenize         {"prompt": str | "messages": [...], "add_special_tokens",
                            "add_generation_prompt", "return_token_strs"}
                           -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize       {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info   the tokenizer's special tokens, chat template and context length

Tokenizing runs in a thread, as a prompt's does. A checkpoint without a
tokenizer answers 400s naming it; bad fields 400s naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from ..engine.requests import render_chat
from ..tokenizer import TextCodec
from .backend import Backend
from .config import ServerConfig
from .errors import APIError
from .schemas import ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # text: as the tokenizer adds them (chat: the rendering holds them)
    add_generation_prompt: bool = True  # chat: end with the assistant's turn opening
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


def install_tokenizer_routes(
    app: FastAPI,
    backend: Backend,
    config: ServerConfig,
    auth: Callable[[Request], None],
    parse: Callable[[Request, type[BaseModel], int], Awaitable[BaseModel]],
) -> None:
    """Add the routes to `app`; `auth` checks a request's key, `parse` reads its body as a schema."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        auth(request)
        body = await parse(request, TokenizeRequest, config.max_body_bytes)
        codec = _codec(backend, body.model, config)
        tokens = await asyncio.to_thread(_tokens, codec, body)
        strs = [codec.decode([t]) for t in tokens] if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": backend.max_seq_len, "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        auth(request)
        body = await parse(request, DetokenizeRequest, config.max_body_bytes)
        codec = _codec(backend, body.model, config)
        for t in body.tokens:
            if not 0 <= t < codec.vocab_size:
                raise APIError(400, f"tokens has {t}, outside the vocabulary [0, {codec.vocab_size})", "tokens")
        return {"prompt": await asyncio.to_thread(codec.decode, body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict:
        auth(request)
        return info(_codec(backend, None, config), backend.max_seq_len)


def info(codec: TextCodec, max_seq_len: int) -> dict[str, Any]:
    """What vLLM's `/tokenizer_info` holds that a client reads: the special tokens
    (the checkpoint's tokenizer_config.json entries; eos from its eos id when
    that names none), the default chat template and the context length."""
    special = dict(codec.chat.special_tokens) if codec.chat is not None else {}
    if "eos_token" not in special and codec.eos_token_ids:
        special["eos_token"] = codec.token_text(codec.eos_token_ids[0])
    template = codec.chat.templates.get("default") if codec.chat is not None else None
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": special.get("eos_token"),
        "bos_token": special.get("bos_token"),
        "pad_token": special.get("pad_token"),
        "unk_token": special.get("unk_token"),
        "chat_template": template,
        "model_max_length": max_seq_len,
        "vocab_size": codec.vocab_size,
    }


def _codec(backend: Backend, model: str | None, config: ServerConfig) -> TextCodec:
    if model is not None and model != config.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {config.model_name!r}", "model")
    if backend.codec is None:
        raise APIError(400, "this model has no tokenizer (tokenizer.json): send and read token ids", "model")
    return backend.codec


def _tokens(codec: TextCodec, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt (text) and messages (chat)", "prompt")
    if body.prompt is not None:
        return codec.encode_unlocked(body.prompt, add_special_tokens=body.add_special_tokens)
    messages = []
    try:
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        if body.add_generation_prompt:
            text = render_chat("messages", messages, codec)
        elif codec.chat is None:
            raise ValueError("messages need a chat template, and the checkpoint has none")
        else:
            text = codec.chat.render(messages, add_generation_prompt=False)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), "messages") from None
    return codec.encode_unlocked(text, add_special_tokens=False)
