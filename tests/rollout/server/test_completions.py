"""`/v1/completions` and `/v1/chat/completions` on the tiny model against
the in-process `Engine.generate`: the same tokens for the same seed (greedy
and sampled), the same logprobs, token ids and texts; streams concatenate
to the non-streamed response; `n > 1`, several prompts, stop strings."""

from __future__ import annotations

import json

import pytest

from rollout import SamplingParams
from rollout.engine.requests import render_chat

PROMPT = "hello world"
CASES = [
    pytest.param(dict(temperature=0.0), id="greedy"),
    pytest.param(dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, seed=7, n=3), id="seeded"),
]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+3?"}]


def engine_params(body: dict) -> SamplingParams:
    keys = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "ignore_eos")
    return SamplingParams(**{k: body[k] for k in keys if k in body})


def assert_matches(choices: list[dict], outputs, chat: bool = False) -> None:
    """Response choices (prompt-major) against `Engine.generate`'s outputs."""
    samples = [s for out in outputs for s in out.samples]
    assert [c["index"] for c in choices] == list(range(len(samples)))
    for c, s in zip(choices, samples, strict=True):
        assert c["token_ids"] == s.token_ids
        assert (c["message"]["content"] if chat else c["text"]) == s.text
        assert c["finish_reason"] == s.finish_reason
        assert c["policy_versions"] == s.versions == [0] * len(s.token_ids)
        got = [t["logprob"] for t in c["logprobs"]["content"]] if chat else c["logprobs"]["token_logprobs"]
        assert got == pytest.approx(s.logprobs, abs=1e-4)


@pytest.mark.parametrize("sampling", CASES)
def test_completions_equal_engine_generate(tiny_server, tiny_engine, sampling):
    body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, **sampling}
    client = tiny_server.openai()
    extra = {k: body[k] for k in ("top_k", "min_p", "ignore_eos") if k in body} | {"return_token_ids": True}
    std = {k: v for k, v in body.items() if k not in extra}
    response = client.completions.create(model="tiny", logprobs=0, extra_body=extra, **std).model_dump()
    (reference,) = tiny_engine.generate([PROMPT], engine_params(body))
    assert_matches(response["choices"], [reference])
    assert response["choices"][0]["prompt_token_ids"] == reference.prompt_token_ids
    assert response["policy_version"] == 0 and response["model"] == "tiny"
    n = body.get("n", 1)
    usage = response["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(reference.prompt_token_ids), 24 * n)


def test_several_token_id_prompts(tiny_server, tiny_engine):
    prompts = [[1, 40, 41, 42], [1, 60, 61]]
    body = {"prompt": prompts, "n": 2, "max_tokens": 12, "temperature": 1.0, "seed": 3, "logprobs": 0}
    with tiny_server.http() as http:
        response = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    reference = tiny_engine.generate(prompts, engine_params(body))
    assert_matches(response["choices"], reference)
    assert [c["prompt_token_ids"] for c in response["choices"]] == [prompts[0]] * 2 + [prompts[1]] * 2


def test_chat_equals_engine_generate_and_tools_reach_the_template(tiny_server, tiny_engine):
    body = {"messages": MESSAGES, "max_tokens": 20, "temperature": 0.7, "seed": 11, "n": 2, "logprobs": True}
    with tiny_server.http() as http:
        response = http.post("/v1/chat/completions", json={**body, "return_token_ids": True}).json()
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
        with_tools = http.post("/v1/chat/completions", json={**body, "tools": tools, "return_token_ids": True}).json()
    (reference,) = tiny_engine.generate([MESSAGES], engine_params(body))
    assert_matches(response["choices"], [reference], chat=True)
    assert response["object"] == "chat.completion" and response["choices"][0]["message"]["role"] == "assistant"
    assert response["prompt_token_ids"] == reference.prompt_token_ids
    codec = tiny_engine.tokenizer
    rendered = codec.encode(render_chat("messages", MESSAGES, codec, tools), add_special_tokens=False)
    assert with_tools["prompt_token_ids"] == rendered != reference.prompt_token_ids
    (tool_reference,) = tiny_engine.generate([rendered], engine_params(body))
    assert_matches(with_tools["choices"], [tool_reference], chat=True)


def stop_string_of(tiny_engine, prompt, body: dict) -> str:
    """A two-character stop string the unstopped sample 0 holds past its tenth character."""
    (free,) = tiny_engine.generate([prompt], engine_params({**body, "stop": None}))
    return free.samples[0].text[10:12]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streams_concatenate_to_the_whole_response(tiny_server, tiny_engine, chat):
    body = {"max_tokens": 40, "temperature": 1.0, "seed": 5, "n": 2, "ignore_eos": True}
    prompt = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    body["stop"] = [stop_string_of(tiny_engine, MESSAGES if chat else PROMPT, body), "~~~"]
    body |= prompt
    route = "/v1/chat/completions" if chat else "/v1/completions"
    extra = {"return_token_ids": True, "logprobs": True if chat else 0}
    with tiny_server.http() as http:
        whole = http.post(route, json={**body, **extra}).json()
        chunks = _stream(http, route, {**body, **extra, "stream": True, "stream_options": {"include_usage": True}})
    texts, tokens, logprobs, versions, finish = {}, {}, {}, {}, {}
    for chunk in chunks[:-1]:
        (c,) = chunk["choices"]
        i = c["index"]
        texts[i] = texts.get(i, "") + (c["delta"].get("content", "") if chat else c["text"])
        tokens[i] = tokens.get(i, []) + c.get("token_ids", [])
        versions[i] = versions.get(i, []) + c["policy_versions"]
        if c["logprobs"] is not None:
            new = [t["logprob"] for t in c["logprobs"]["content"]] if chat else c["logprobs"]["token_logprobs"]
            logprobs[i] = logprobs.get(i, []) + new
        if c["finish_reason"] is not None:
            finish[i] = c["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    for c in whole["choices"]:
        i = c["index"]
        assert texts[i] == (c["message"]["content"] if chat else c["text"])
        assert tokens[i] == c["token_ids"] and versions[i] == c["policy_versions"]
        assert logprobs[i] == pytest.approx(
            [t["logprob"] for t in c["logprobs"]["content"]] if chat else c["logprobs"]["token_logprobs"]
        )
        assert finish[i] == c["finish_reason"]
    stopped = whole["choices"][0]
    assert stopped["finish_reason"] == "stop" and len(stopped["token_ids"]) < 40  # the stop string ended it
    assert body["stop"][0] not in (stopped["message"]["content"] if chat else stopped["text"])


def _stream(http, route: str, body: dict) -> list[dict]:
    chunks = []
    with http.stream("POST", route, json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


def test_the_openai_client_streams_chat(tiny_server, tiny_engine):
    client = tiny_server.openai()
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0.0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    (reference,) = tiny_engine.generate([MESSAGES], SamplingParams(temperature=0.0, max_tokens=16))
    assert text == reference.samples[0].text
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def _alternatives(codec, top) -> list[list[tuple[str, float]]]:
    """The engine's top logprobs as the server names them: token text, -inf as -9999."""
    return [[(codec.decode([t]), max(lp, -9999.0)) for t, lp in position] for position in top]


def test_chat_top_logprobs_equal_the_engines(tiny_server, tiny_engine):
    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0.8, "top_k": 3, "seed": 4, "n": 2}
    client = tiny_server.openai()
    response = client.chat.completions.create(
        model="tiny",
        logprobs=True,
        top_logprobs=5,
        extra_body={"top_k": 3, "return_token_ids": True},
        **{k: v for k, v in body.items() if k != "top_k"},
    ).model_dump()
    (reference,) = tiny_engine.generate([MESSAGES], _with_top(engine_params(body), 5))
    assert_matches(response["choices"], [reference], chat=True)
    codec = tiny_engine.tokenizer
    for c, s in zip(response["choices"], reference.samples, strict=True):
        got = [[(a["token"], a["logprob"]) for a in t["top_logprobs"]] for t in c["logprobs"]["content"]]
        want = _alternatives(codec, s.top_logprobs)
        assert [[t for t, _ in p] for p in got] == [[t for t, _ in p] for p in want]
        assert [lp for p in got for _, lp in p] == pytest.approx([lp for p in want for _, lp in p], abs=1e-4)
        assert all(p[3][1] == p[4][1] == -9999.0 for p in got)  # top_k=3 keeps three


def _with_top(params: SamplingParams, k: int) -> SamplingParams:
    params.top_logprobs = k
    return params


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_top_logprobs_hold_the_alternatives_and_the_sampled_token(tiny_server, tiny_engine, stream):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 9, "ignore_eos": True, "logprobs": 3}
    with tiny_server.http() as http:
        if stream:
            chunks = _stream(http, "/v1/completions", {**body, "stream": True})
            tops = [
                t
                for chunk in chunks
                for t in chunk["choices"][0]["logprobs"]["top_logprobs"]
                if chunk["choices"][0]["logprobs"] is not None
            ]
        else:
            tops = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["top_logprobs"]
    (reference,) = tiny_engine.generate([PROMPT], _with_top(engine_params(body), 3))
    s = reference.samples[0]
    codec = tiny_engine.tokenizer
    assert len(tops) == len(s.token_ids) == 12
    alternatives_per_token = _alternatives(codec, s.top_logprobs)
    for got, token, lp, alternatives in zip(tops, s.token_ids, s.logprobs, alternatives_per_token, strict=True):
        want = dict(alternatives) | {codec.decode([token]): lp}
        assert got.keys() == want.keys()
        assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
