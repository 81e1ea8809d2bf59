"""`start_server`: the server on a thread of the caller's process (a
trainer's), over a backend the caller keeps."""

from __future__ import annotations

import httpx

from rollout import SamplingParams
from rollout.server import EngineBackend, ServerConfig, start_server


def test_a_server_on_a_thread_answers_and_stops(tiny_engine):
    server = start_server(EngineBackend(tiny_engine), ServerConfig("tiny", max_n=4, max_tokens=64), port=0)
    try:
        body = {"prompt": [1, 40, 41], "max_tokens": 6, "temperature": 0.0, "return_token_ids": True}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    finally:
        server.stop()
    (reference,) = tiny_engine.generate([[1, 40, 41]], SamplingParams(max_tokens=6, temperature=0.0))
    assert response["choices"][0]["token_ids"] == reference.samples[0].token_ids
