"""Schemathesis, an outside OpenAPI fuzzer, against the server's own
`/openapi.json`, in process (ASGI, no socket) over the package's tiny engine:
for every operation a bounded, derandomised set of generated requests, valid
and invalid by the schema. None may be a 5xx, and every 4xx must be the
OpenAI error body (`errors.py`), which the document's `4XX` response also
declares (schemathesis' own conformance check validates it).

Requests stay cheap through the server's own limits, which the document
states: `n` <= 2 and `max_tokens` <= 4 are the schema's bounds (`openapi.py`
puts `ServerConfig`'s there), so generated valid requests stay inside them,
and an invalid one past them is a 400 before any work."""

from __future__ import annotations

import pytest
import schemathesis
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, settings
from schemathesis.transport.asgi import ASGI_TRANSPORT

from rollout.server.app import create_app
from rollout.server.backend import EngineBackend
from rollout.server.config import ServerConfig
from rollout.server.openapi import openapi
from tests.rollout.server.conftest import API_KEY

CONFIG = ServerConfig("tiny", max_n=2, max_tokens=4, api_key=API_KEY, max_prompts=4, max_request_tokens=4096)
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


# The cases are drawn from the document `openapi(CONFIG)`; `test_served_document` checks that the
# app serves exactly it (schemathesis' lazy fixture-loaded schemas do not run under this pytest).
schema = schemathesis.openapi.from_dict(openapi(CONFIG))


@pytest.fixture(scope="module")
def app(tiny_engine):
    # Bound as for other machines (a key, no loopback `Host` check, which test_security.py covers), so that
    # schemathesis' own requests to the ASGI app, sent as `Host: testserver`, reach the routes.
    return create_app(EngineBackend(tiny_engine), CONFIG, host="0.0.0.0")


def test_served_document(app):
    served = schemathesis.openapi.from_asgi("/openapi.json", app, headers=HEADERS)
    assert served.raw_schema == openapi(CONFIG)
    routes = {route.path for route in app.routes if isinstance(route, APIRoute)} - {"/openapi.json"}
    assert set(served.raw_schema["paths"]) == routes  # every route the app serves, and no other
    schemas = served.raw_schema["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatRequest"]["properties"]
    assert {"type": "integer", "minimum": 0, "maximum": 4} in completion["max_tokens"]["anyOf"]  # 0: echo only
    assert {"type": "integer", "minimum": 1, "maximum": 4} in chat["max_tokens"]["anyOf"]
    assert completion["n"] == {"default": 1, "title": "N", "type": "integer", "minimum": 1, "maximum": 2}


@schemathesis.check
def openai_error_shape(ctx, response, case) -> None:
    """No 5xx; a 4xx is `{"error": {"message": str, "type": str, "param": str|None, "code": str|None}}`."""
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
        assert error["type"] in ("invalid_request_error", "authentication_error"), error
        assert all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")), error


@schema.parametrize()
@settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error_and_openai_errors(case, app):
    case.operation.app = case.operation.schema.app = app  # the checks' own requests (another method, no key) too
    response = ASGI_TRANSPORT.send(case, app=app, headers=HEADERS)
    # positive_data_acceptance is left out: the document states types and bounds, not the cross-field
    # rules a 400 names (exactly one of prompt and messages, a message's content, top_logprobs needs logprobs).
    excluded = [schemathesis.checks.positive_data_acceptance]
    case.validate_response(response, additional_checks=[openai_error_shape], excluded_checks=excluded)
