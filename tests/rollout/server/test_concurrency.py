"""Many clients at once, clients that leave, and what `/metrics` counts."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from openai import AsyncOpenAI

from rollout import SamplingParams


def test_32_concurrent_clients_are_all_answered_as_alone(tiny_server, tiny_engine):
    """Seeded requests give the tokens `generate` gives them, whatever they are batched with."""
    prompts = [f"prompt number {i}" for i in range(32)]
    before = tiny_server.metrics()

    async def main():
        client = AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key=tiny_server.api_key, max_retries=0)

        async def one(i: int):
            args = dict(model="tiny", prompt=prompts[i], max_tokens=16, seed=i, temperature=1.0)
            extra = {"return_token_ids": True, "ignore_eos": True}
            if i % 2:  # half of them stream
                stream = await client.completions.create(stream=True, extra_body=extra, **args)
                tokens = []
                async for chunk in stream:
                    tokens += chunk.choices[0].model_extra.get("token_ids", [])
                return tokens
            response = await client.completions.create(extra_body=extra, **args)
            return response.choices[0].model_extra["token_ids"]

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    got = asyncio.run(main())
    for i, tokens in enumerate(got):
        (reference,) = tiny_engine.generate([prompts[i]], SamplingParams(max_tokens=16, seed=i, ignore_eos=True))
        assert tokens == reference.samples[0].token_ids
    after = tiny_server.metrics()
    key = 'rollout_requests_total{endpoint="/v1/completions",status="200"}'
    assert after[key] - before.get(key, 0) == 32
    assert after["rollout_completion_tokens_total"] - before["rollout_completion_tokens_total"] == 32 * 16


def wait_until_idle(server, deadline_s: float = 10.0) -> dict[str, float]:
    """Poll `/metrics` until no request runs and no KV page is used; the last reading."""
    deadline = time.monotonic() + deadline_s
    while True:
        metrics = server.metrics()
        if metrics["rollout_kv_pages_used"] == 0 and metrics["rollout_requests_running"] == 0:
            return metrics
        if time.monotonic() > deadline:
            pytest.fail(f"still busy after {deadline_s} s: {metrics}")
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "waiting"])
def test_a_client_that_leaves_frees_its_kv(tiny_server, stream):
    """n=8 samples of 1000 tokens each take seconds; the client leaves at once."""
    body = {"prompt": "a long one", "n": 8, "max_tokens": 1000, "ignore_eos": True, "stream": stream}
    before = wait_until_idle(tiny_server)
    with tiny_server.http() as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                assert tiny_server.metrics()["rollout_kv_pages_used"] > 0
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=body, timeout=0.3)
    after = wait_until_idle(tiny_server)
    computed = after["rollout_computed_tokens_total"] - before["rollout_computed_tokens_total"]
    assert computed < 8 * 1000 / 2  # aborted well before the end
    if not stream:
        key = 'rollout_requests_total{endpoint="/v1/completions",status="499"}'
        assert after[key] - before.get(key, 0) == 1


def test_metrics_count_requests_tokens_and_versions(tiny_server):
    before = tiny_server.metrics()
    with tiny_server.http() as http:
        usages = [
            http.post("/v1/completions", json={"prompt": "count me", "max_tokens": 5, "n": 2}).json()["usage"]
            for _ in range(3)
        ]
        assert http.post("/v1/completions", json={"prompt": 3}).status_code == 400
    after = tiny_server.metrics()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert delta('rollout_requests_total{endpoint="/v1/completions",status="200"}') == 3
    assert delta('rollout_requests_total{endpoint="/v1/completions",status="400"}') == 1
    assert delta("rollout_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("rollout_completion_tokens_total") == sum(u["completion_tokens"] for u in usages) == 30
    assert after["rollout_policy_version"] == 0 and after["rollout_kv_pages_total"] > 0
    assert not [name for name in after if name.startswith("rollout_actor_")]  # an engine has no actors to replace
