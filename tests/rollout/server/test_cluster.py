"""A server over a 2-actor cluster while a trainer pushes weights to it:
responses carry the version of every token, before, across and after the push."""

from __future__ import annotations

import asyncio
import json

from tests.rollout.server.conftest import serve, size_args


def test_a_weight_push_while_requests_run(tiny_path, tmp_path):
    entry = ("-m", "tests.rollout.server.cluster_server")
    with serve(tiny_path, "--actors", "2", *size_args(), logs=tmp_path, entry=entry, deadline_s=120) as server:
        asyncio.run(_push_while_streaming(server))
        assert server.metrics()["rollout_policy_version"] == 1


async def _push_while_streaming(server) -> None:
    body = {"prompt": "versions", "max_tokens": 8, "ignore_eos": True, "logprobs": 2}
    async with server.async_http() as http:
        before = (await http.post("/v1/completions", json=body)).json()
        assert before["choices"][0]["policy_versions"] == [0] * 8 and before["policy_version"] == 0
        tops = before["choices"][0]["logprobs"]["top_logprobs"]  # two alternatives plus the sampled token
        assert len(tops) == 8 and all(2 <= len(t) <= 3 for t in tops)
        first_chunk = asyncio.Event()
        long = asyncio.ensure_future(_stream_versions(http, {**body, "max_tokens": 400, "n": 2}, first_chunk))
        await first_chunk.wait()
        server.process.stdin.write("push\n")
        server.process.stdin.flush()
        pushed = await asyncio.wait_for(asyncio.to_thread(server.process.stdout.readline), 60)
        assert pushed.strip() == "pushed 1"
        running_at_push = not long.done()
        after = (await http.post("/v1/completions", json=body)).json()
        assert after["choices"][0]["policy_versions"] == [1] * 8 and after["policy_version"] == 1
        assert (await http.get("/health")).json()["policy_version"] == 1
        versions, top = await long
    for sample in versions.values():  # recompute mode: older tokens keep their version, newer ones are v1
        assert len(sample) == 400 and sample == sorted(sample) and sample[0] == 0
    if running_at_push:
        assert top == 1 and any(sample[-1] == 1 for sample in versions.values())


async def _stream_versions(http, body: dict, first_chunk: asyncio.Event) -> tuple[dict[int, list[int]], int]:
    versions: dict[int, list[int]] = {}
    top = -1
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                (c,) = chunk["choices"]
                versions.setdefault(c["index"], []).extend(c["policy_versions"])
                assert c["logprobs"] is None or len(c["logprobs"]["top_logprobs"]) == len(c["logprobs"]["tokens"])
                top = chunk["policy_version"]
                first_chunk.set()
    return versions, top
