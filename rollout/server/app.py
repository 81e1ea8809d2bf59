"""The ASGI app: routes, the API key, bounded JSON request bodies, the
loopback Host check (`security.py`).

    GET  /health                 open: liveness and the policy version
    GET  /v1/models              the one served model
    POST /v1/completions         text or token-id prompts; streaming or not
    POST /v1/chat/completions    chat messages, rendered by the checkpoint's own template
    GET  /metrics                Prometheus text
    GET  /openapi.json           every route and request body (`openapi.py`)
    /tokenize, /detokenize, /tokenizer_info (vLLM's shapes; `tokenizer_routes.py`)

Each prompt is one `TokenStream` on the backend, so concurrent requests
share the engine's steps, which its own thread runs. The event loop never
runs the engine, renders a chat template or tokenizes a prompt (a thread
does: a long prompt would stop every other request, `/health` included);
`Engine.stream` only queues a request, and a cluster's counters are read in
a thread. A generation request is admitted (`InFlight`: a 429 past its
bounds) before its body is read, and holds its place until its response
ends, however it ends (docs/serving.md#overload-and-slow-clients)."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from collections.abc import AsyncGenerator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from .backend import Backend
from .config import ServerConfig
from .echo import drop_samples
from .errors import APIError, from_validation, install_handlers
from .events import events
from .generation import ClientGone, InFlight, Ticket, cancel, outputs, start, wait_for_disconnect
from .metrics import CONTENT_TYPE, CountRequests, Metrics
from .openapi import openapi
from .responses import Reply, usage
from .schemas import ChatRequest, CompletionRequest
from .security import LoopbackHosts, check_bind, check_json, is_loopback
from .structured import schema_error
from .tokenizer_routes import install_tokenizer_routes
from .translate import Job, chat_job, completion_job, request_work


def create_app(backend: Backend, config: ServerConfig, host: str = "127.0.0.1") -> FastAPI:
    """An OpenAI-compatible app over `backend` for a server bound to `host`;
    the caller runs it (uvicorn) and closes the backend. A loopback `host`
    answers only loopback `Host` names; another one needs `config.api_key`
    (or `config.allow_no_key`), else `ValueError`."""
    check_bind(host, config.api_key, config.allow_no_key)
    app = FastAPI(title="rollout", docs_url=None, redoc_url=None, openapi_url=None)  # `openapi.py` below
    metrics = Metrics()
    inflight = InFlight(config.max_inflight_requests, config.max_inflight_tokens)  # what generation routes admit
    answers = Answers(backend, config, metrics, inflight)
    install_handlers(app)
    app.add_middleware(CountRequests, metrics=metrics)
    if is_loopback(host):
        app.add_middleware(LoopbackHosts)  # outermost: a refused request reaches nothing
    auth = BearerKey(config.api_key)  # called first in every route but /health (cheaper than a dependency)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "policy_version": backend.policy_version()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        auth.check(request)
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "rollout"}
        return {"object": "list", "data": [{**card, "max_model_len": backend.max_seq_len}]}

    @app.get("/metrics")
    async def metrics_text(request: Request) -> PlainTextResponse:
        auth.check(request)
        counters, faults = await asyncio.to_thread(backend.counters)
        text = metrics.render(backend.policy_version(), counters, inflight, faults)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        auth.check(request)
        return await answers.admit(request, CompletionRequest, completion_job)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        auth.check(request)
        return await answers.admit(request, ChatRequest, chat_job)

    install_tokenizer_routes(app, backend, config, auth.check, parse)  # /tokenize, /detokenize, /tokenizer_info
    document = openapi(config)

    @app.get("/openapi.json")
    async def openapi_json(request: Request) -> dict:
        auth.check(request)
        return document

    return app


class Answers:
    """Admits a generation request, runs its `Job` and answers it, streamed or
    not; whatever way the response ends, its streams are cancelled and its
    place in flight released."""

    def __init__(self, backend: Backend, config: ServerConfig, metrics: Metrics, inflight: InFlight) -> None:
        self.backend, self.config, self.metrics, self.inflight = backend, config, metrics, inflight

    async def admit(self, request: Request, schema: type[BaseModel], make_job: Callable[..., Job]) -> Response:
        """Count the request in before its body is read (a 429 past
        `max_inflight_requests`), then parse, prepare and answer it."""
        ticket = self.inflight.admit()
        try:
            body = await parse(request, schema, self.config.max_body_bytes)
            job = await asyncio.to_thread(prepare, make_job, body, self.config, self.backend)
            return await self.answer(request, job, ticket)
        except BaseException:  # a streamed answer releases it as its response ends; anything else, here
            ticket.release()
            raise

    async def answer(self, request: Request, job: Job, ticket: Ticket) -> Response:
        backend, metrics = self.backend, self.metrics
        reply = Reply(job, self.config.model_name, backend.codec, backend.policy_version())  # nothing to undo yet
        streams = start(job, backend, ticket)
        if job.stream:
            return EventStream(events(reply, streams, metrics), lambda: self._end(streams, ticket))
        try:
            done = await outputs(streams, lambda: wait_for_disconnect(request.receive))
        except ClientGone:
            raise APIError(499, "the client closed the request", code="client_closed_request") from None
        finally:
            self._end(streams, ticket)
        done = drop_samples(job.echo, done)
        counts = usage(done)
        metrics.prompt_tokens += counts["prompt_tokens"]
        metrics.completion_tokens += counts["completion_tokens"]
        return JSONResponse(reply.body(done))

    def _end(self, streams: list, ticket: Ticket) -> None:
        cancel(streams)  # a no-op for finished streams; an error leaves nothing running
        ticket.release()


class EventStream(StreamingResponse):
    """Server-sent events; `closed()` runs however the response ends, even
    when the client left before its first chunk (the chunks never started)."""

    def __init__(self, chunks: AsyncGenerator[bytes, None], closed: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(chunks, media_type="text/event-stream", headers=headers)
        self._chunks, self._closed = chunks, closed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._closed()
            await self._chunks.aclose()


class BearerKey:
    """`Authorization: Bearer <key>`, compared in constant time; no key, no check."""

    def __init__(self, key: str | None) -> None:
        self.key = key.encode() if key is not None else None

    def check(self, request: Request) -> None:
        if self.key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
            raise APIError(
                401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )


def prepare(make_job: Callable[..., Job], body: BaseModel, config: ServerConfig, backend: Backend) -> Job:
    """The request's `Job` with every prompt as checked token ids and its work
    bounded (run in a thread: templates and long prompts take time); a 400
    naming the prompt's field, or `max_tokens` past `max_request_tokens`."""
    job = make_job(body, config, backend)
    try:
        prompts = [backend.prompt_ids(p, job.prompt_field, job.tools) for p in job.prompts]
        if job.params.structured_outputs is not None and hasattr(backend, "warm_grammar"):
            backend.warm_grammar(job.params)  # here, not on the event loop, where the request starts
    except (ValueError, TypeError) as e:
        raise schema_error(str(e)) or APIError(400, str(e), job.prompt_field) from None
    return dataclasses.replace(job, prompts=prompts, work=request_work(prompts, job.params, config, backend))


async def parse(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    """The body as `model`: `application/json` (a 415 otherwise), read up to
    `limit` bytes (a 413 past it); a 400 naming what is wrong."""
    check_json(request.headers.get("content-type"))
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body is {length} bytes; this server takes at most {limit}", code="too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="too_large")
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as e:
        raise from_validation(e) from None
