"""Client mistakes get OpenAI-shaped 4xx bodies, never a 500; the API key
guards every route but `/health`."""

from __future__ import annotations

import openai
import pytest

from tests.rollout.server.conftest import API_KEY

USER = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 1.0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x" * 1500}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 10**6}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "seed": -3}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [500]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs_mode": "logits"}, 400, "logprobs_mode"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0.0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1.0}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1.0}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "stream": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": USER, "tools": "add"}, 400, "tools"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 10**9}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": -2}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_error_bodies(tiny_server, route, body, status, param):
    with tiny_server.http() as http:
        response = http.post(route, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert isinstance(error["message"], str) and error["message"]


def test_malformed_oversized_and_unrouted_requests(tiny_server):
    with tiny_server.http() as http:
        for content, status in [(b"{", 400), (b"", 400), (b'"a string"', 400), (b"x" * ((1 << 20) + 1), 413)]:
            response = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
            assert response.status_code == status and "error" in response.json()
        for method, route, status in [("GET", "/v2/anything", 404), ("GET", "/v1/completions", 405)]:
            response = http.request(method, route)
            assert response.status_code == status and response.json()["error"]["message"]
        assert response.headers["allow"] == "POST"  # a 405 names the allowed methods (RFC 9110)
        assert http.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 2}).status_code == 200


def test_the_api_key_guards_everything_but_health(tiny_server):
    client = tiny_server.openai()
    assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices
    wrong = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY + "x", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="a", max_tokens=2)
    with tiny_server.http() as http:
        bare = {"Authorization": ""}
        for route in ["/v1/models", "/metrics", "/openapi.json"]:
            assert http.get(route, headers=bare).status_code == 401
        for headers in [bare, {"Authorization": f"Basic {API_KEY}"}, {"Authorization": "Bearer"}]:
            response = http.post("/v1/chat/completions", json={"messages": USER}, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/health", headers=bare).json()["status"] == "ok"
