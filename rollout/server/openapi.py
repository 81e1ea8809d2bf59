"""The server's OpenAPI 3.1 document (`GET /openapi.json`): every route, the
request bodies as the pydantic schemas the routes parse them with (so the
document cannot drift from what is accepted), the server's own bounds on `n`
and `max_tokens`, and the OpenAI error body every 4xx and 5xx has. The
routes read their bodies themselves (`app.parse`: the size bound and the
400s naming a field), so FastAPI's generated document would show none of
them; this one is built here instead."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .config import ServerConfig
from .schemas import ChatRequest, CompletionRequest
from .tokenizer_routes import DetokenizeRequest, TokenizeRequest
from .translate import MIN_MAX_TOKENS

_REF = "#/components/schemas/{model}"
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
_GETS = {
    "/health": "liveness and the policy version (no key)",
    "/v1/models": "the one served model",
    "/metrics": "Prometheus text",
    "/tokenizer_info": "the tokenizer's special tokens, chat template and context length",
}


def openapi(config: ServerConfig) -> dict[str, Any]:
    """The document for a server with `config`'s limits."""
    _, schemas = models_json_schema([(m, "validation") for m in _BODIES.values()], ref_template=_REF)
    components = {**schemas.get("$defs", {}), "Error": _ERROR}
    for name in ("CompletionRequest", "ChatRequest"):
        fields = components[name]["properties"]
        _bound(fields["n"], 1, config.max_n)
        _bound(fields["max_tokens"], MIN_MAX_TOKENS[name], config.max_tokens)
    _bound(components["ChatRequest"]["properties"]["max_completion_tokens"], 1, config.max_tokens)
    paths: dict[str, Any] = {}
    for path, what in _GETS.items():
        paths[path] = {"get": _operation(what, path != "/health")}
    for path, model in _BODIES.items():
        body = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
        }
        paths[path] = {"post": {**_operation((model.__doc__ or path).strip(), True), "requestBody": body}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "rollout", "version": "1"},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _operation(summary: str, keyed: bool) -> dict[str, Any]:
    error = {
        "description": "an OpenAI error",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    operation = {"summary": summary, "responses": {"200": {"description": "OK"}, "4XX": error, "5XX": error}}
    return {**operation, "security": [{"bearer": []}]} if keyed else {**operation, "security": []}


def _bound(field: dict[str, Any], low: int, high: int) -> None:
    """Put [low, high] on the integer form of `field` (plain, or one of its `anyOf`)."""
    for form in field.get("anyOf", [field]):
        if form.get("type") == "integer":
            form["minimum"], form["maximum"] = low, high
