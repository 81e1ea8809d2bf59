"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Client mistakes are 4xx with `invalid_request_error` (or `authentication_error`);
nothing a client sends may turn into a 500. Engine `ValueError`/`TypeError`
(they name the field) become 400s through `from_engine`. A 500 says only
"internal error" and a request id: exception text can hold paths and pids,
so the detail goes to the server's log under that id."""

from __future__ import annotations

import logging
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..engine.errors import ClosedError, UnavailableError

log = logging.getLogger("rollout.server")

# Request fields an engine message may start with, as the OpenAI request calls them.
_ENGINE_FIELDS = {
    "n": "n",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_tokens": "max_tokens",
    "stop_token_ids": "stop_token_ids",
    "stop": "stop",
    "seed": "seed",
    "tools": "tools",
    "logprobs_mode": "logprobs_mode",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
}


class APIError(Exception):
    """An error answered as an OpenAI error body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_engine(error: ValueError | TypeError, prompt_field: str) -> APIError:
    """A 400 for what the engine refused; `param` guessed from the field its message names."""
    message = str(error)
    first = re.match(r"[a-z_]+", message)
    if first and first.group() in _ENGINE_FIELDS:
        param = _ENGINE_FIELDS[first.group()]
    elif message.startswith(("prompts", "prompt")):
        param = prompt_field
    else:
        param = None
    return APIError(400, message, param)


def internal_error(error: BaseException) -> dict:
    """The body of an unexpected failure, with a new request id; the traceback is logged under that id."""
    request_id = uuid.uuid4().hex
    log.error("internal error (request id %s)", request_id, exc_info=error)
    body = {"message": "internal error", "type": "server_error", "param": None, "code": None}
    return {"error": {**body, "request_id": request_id}}


RETRY_AFTER_S = 1  # what a 429 or 503 tells the client to wait: requests end at token pace, so soon


class RetryLater(APIError):
    """An error whose request may succeed later: a `Retry-After` header says when."""

    def response(self) -> JSONResponse:
        response = super().response()
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response


def unavailable(error: UnavailableError) -> RetryLater:
    """A 503 for a request nothing can serve now (a shutdown, no live actor);
    the detail, which names actors and their errors, goes to the log only."""
    reason = "the server is shutting down" if isinstance(error, ClosedError) else "no rollout actor is available"
    log.warning("503 (%s): %s", reason, error)
    return RetryLater(503, f"{reason}: retry after {RETRY_AFTER_S} s", code="unavailable", kind="server_error")


def from_validation(error: ValidationError) -> APIError:
    """A 400 naming the first field pydantic refused (for a field of several
    allowed types, the types: pydantic reports one error per type)."""
    errors = error.errors(include_url=False)
    first = errors[0]
    path, tagged = _field_path(first["loc"])
    if first["type"] == "extra_forbidden":
        message = f"unknown field {path!r}: this server refuses fields it does not implement"
    elif tagged:
        kinds = [str(e["loc"][len(path.split("."))]) for e in errors if _field_path(e["loc"])[0] == path]
        message = f"{path}: must be one of {', '.join(dict.fromkeys(kinds))}"
    else:
        message = f"{path}: {first['msg']}" if path else first["msg"]
    return APIError(400, message, path or None)


def _field_path(loc: tuple) -> tuple[str, bool]:
    """The field's dotted path up to the first union-member tag (such as
    `list[int]`), and whether there was one."""
    parts = []
    for part in loc:
        if isinstance(part, str) and not part.isidentifier() or part in _TYPE_TAGS:
            return ".".join(parts), True
        parts.append(str(part))
    return ".".join(parts), False


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def install_handlers(app: FastAPI) -> None:
    """Every error the app answers has the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        response = APIError(error.status_code, str(error.detail), code=code).response()
        response.headers.update(error.headers or {})  # a 405's `Allow`
        return response

    @app.exception_handler(UnavailableError)
    async def _unavailable(request: Request, error: UnavailableError) -> JSONResponse:
        return unavailable(error).response()

    @app.exception_handler(Exception)
    async def _server_error(request: Request, error: Exception) -> JSONResponse:
        body = internal_error(error)
        return JSONResponse(body, status_code=500, headers={"X-Request-Id": body["error"]["request_id"]})
