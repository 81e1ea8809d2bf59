"""Chat on a real chat model (SmolLM2-135M-Instruct, its own template and
byte-level BPE): the server's answers equal `Engine.generate`'s, streams
concatenate to them, and a conversation's next turn reuses its KV."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from rollout import Engine, SamplingParams
from tests.rollout.server.conftest import Server, serve, size_args

SIZES = {"max_batch_size": 8, "max_seq_len": 1024, "kv_cache_tokens": 8192}
MESSAGES = [{"role": "user", "content": "Name three colours, in French and with emoji."}]


@pytest.fixture(scope="module")
def smol_engine(smollm2_path) -> Iterator[Engine]:
    """The in-process reference, warmed up before the server starts (two engines warming at once
    on two cores take twice as long)."""
    engine = Engine(smollm2_path, device="cpu", **SIZES)
    engine.generate([MESSAGES], SamplingParams(max_tokens=2))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def smol_server(smollm2_path, smol_engine, tmp_path_factory) -> Iterator[Server]:
    with serve(smollm2_path, *size_args(**SIZES), logs=tmp_path_factory.mktemp("smol_logs")) as server:
        yield server


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=4, n=2)], ids=["greedy", "seeded"]
)
def test_chat_equals_engine_generate(smol_server, smol_engine, sampling):
    body = {"messages": MESSAGES, "max_tokens": 16, "logprobs": True, "return_token_ids": True, **sampling}
    with smol_server.http() as http:
        response = http.post("/v1/chat/completions", json=body).json()
    params = SamplingParams(max_tokens=16, **sampling)
    (reference,) = smol_engine.generate([MESSAGES], params)
    assert response["prompt_token_ids"] == reference.prompt_token_ids
    for c, s in zip(response["choices"], reference.samples, strict=True):
        assert c["token_ids"] == s.token_ids and c["message"]["content"] == s.text
        assert [t["logprob"] for t in c["logprobs"]["content"]] == pytest.approx(s.logprobs, abs=1e-4)
        assert c["policy_versions"] == [0] * len(s.token_ids) and c["finish_reason"] == s.finish_reason


def test_streamed_chat_equals_the_whole_answer(smol_server):
    """Hot sampling makes odd bytes: split characters must be held back, never sent broken."""
    body = {"messages": MESSAGES, "max_tokens": 24, "temperature": 1.3, "seed": 21, "n": 2, "stop": ["\n\n"]}
    with smol_server.http() as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        texts = {0: "", 1: ""}
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    (c,) = json.loads(line[6:])["choices"]
                    texts[c["index"]] += c["delta"].get("content") or ""
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]


def test_the_next_turn_of_a_conversation_reuses_its_kv(smol_server):
    """The prefix cache keeps full pages: a follow-up computes its new tokens plus at most a page or so."""
    first = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0.0}
    with smol_server.http() as http:
        reply = http.post("/v1/chat/completions", json=first).json()["choices"][0]["message"]["content"]
        turn = MESSAGES + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And in German?"}]
        before = smol_server.metrics()
        second = http.post("/v1/chat/completions", json={**first, "messages": turn, "max_tokens": 8}).json()
        after = smol_server.metrics()
    prompt = second["usage"]["prompt_tokens"]
    computed = after["rollout_computed_tokens_total"] - before["rollout_computed_tokens_total"]
    hits = after["rollout_prefix_hit_tokens_total"] - before["rollout_prefix_hit_tokens_total"]
    print(f"second turn: {prompt} prompt tokens, {hits:.0f} from the prefix cache, {computed:.0f} computed")
    assert hits > 0 and computed < prompt
