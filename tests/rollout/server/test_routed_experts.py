"""`return_routed_experts` through the OpenAI-compatible server (a server on a
thread over a mixture-of-experts engine): the arrays decoded from base64
equal the engine's, whole and streamed; a dense model answers 400."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np

from rollout import SamplingParams
from rollout.server import EngineBackend, ServerConfig, start_server
from tests.conftest import make_engine

BODY = {"prompt": [1, 40, 41, 42], "max_tokens": 6, "temperature": 0.0, "return_routed_experts": True}


def decode(field: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(field["data"]), dtype=field["dtype"]).reshape(field["shape"])


def test_completions_return_routed_experts_whole_and_streamed(moe_checkpoints):
    engine = make_engine(moe_checkpoints["mixtral"].path)
    (ref,) = engine.generate(
        [BODY["prompt"]], SamplingParams(max_tokens=6, temperature=0.0, return_routed_experts=True)
    )
    server = start_server(EngineBackend(engine), ServerConfig("moe", max_n=4, max_tokens=64), port=0)
    try:
        whole = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30).json()["choices"][0]
        with httpx.stream("POST", server.url + "/v1/completions", json={**BODY, "stream": True}, timeout=30) as r:
            lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    finally:
        server.stop()
    for choice in (whole, lines[-1]["choices"][0]):
        np.testing.assert_array_equal(decode(choice["routed_experts"]), ref.samples[0].routed_experts)
        np.testing.assert_array_equal(decode(choice["prompt_routed_experts"]), ref.prompt_routed_experts)


def test_a_dense_model_answers_400(tiny_engine):
    server = start_server(EngineBackend(tiny_engine), ServerConfig("tiny", max_n=4, max_tokens=64), port=0)
    try:
        response = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30)
    finally:
        server.stop()
    assert response.status_code == 400
    assert "needs a mixture-of-experts model" in response.json()["error"]["message"]
