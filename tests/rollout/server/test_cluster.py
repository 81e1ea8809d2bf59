"""A server over a 2-actor cluster while a trainer pushes weights to it:
responses carry the version of every token, before, across and after the push.
While no actor is alive, the server's event loop goes on: /health answers at
once, a request waits for a replacement and then completes, and one whose
client left meanwhile never starts."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.rollout.cluster.test_cluster import wait_until
from tests.rollout.server.conftest import serve, size_args


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    entry = ("-m", "tests.rollout.server.cluster_server")
    logs = tmp_path_factory.mktemp("cluster_server")
    with serve(tiny_path, "--actors", "2", *size_args(), logs=logs, entry=entry, deadline_s=120) as server:
        yield server


def test_a_weight_push_while_requests_run(server):
    asyncio.run(_push_while_streaming(server))
    assert server.metrics()["rollout_policy_version"] == 1


def _command(server, line: str, answer: str) -> None:
    """Send the trainer beside the server one command and wait for its answer."""
    server.process.stdin.write(line + "\n")
    server.process.stdin.flush()
    assert server.process.stdout.readline().strip() == answer


def test_no_live_actor_does_not_block_the_event_loop_and_a_waiting_request_then_completes(server):
    asyncio.run(_stream_across_a_respawn(server))


async def _stream_across_a_respawn(server) -> None:
    body = {"prompt": "respawn", "max_tokens": 6, "ignore_eos": True, "stream": True}
    await asyncio.to_thread(_command, server, "hold", "held")
    async with server.async_http() as http:
        # The headers come once the request waits for an actor: its handler returned.
        async with http.stream("POST", "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            health = await asyncio.wait_for(http.get("/health"), 10)  # the loop is free meanwhile
            assert health.status_code == 200 and health.json()["status"] == "ok"
            release = asyncio.ensure_future(asyncio.to_thread(_command, server, "release", "released"))
            chunks = [
                json.loads(line[6:]) for line in [x async for x in response.aiter_lines()] if line.startswith("data: {")
            ]
            await release
    texts = [c["choices"][0] for c in chunks]
    assert all("error" not in c for c in chunks) and texts[-1]["finish_reason"] == "length"
    assert sum(len(c["policy_versions"]) for c in texts) == 6


def test_a_client_that_leaves_while_its_request_waits_for_an_actor_cancels_it(server):
    asyncio.run(_leave_while_waiting(server))


async def _leave_while_waiting(server) -> None:
    body = {"prompt": "abandoned", "max_tokens": 400, "n": 2, "ignore_eos": True, "stream": True}
    await asyncio.to_thread(_command, server, "hold", "held")
    async with server.async_http() as http:
        async with http.stream("POST", "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200  # waiting for an actor; the client leaves now
    await asyncio.to_thread(wait_until, lambda: server.metrics()["rollout_requests_running"] == 0, 60)
    await asyncio.to_thread(_command, server, "release", "released")
    async with server.async_http() as http:
        short = {"prompt": "after", "max_tokens": 4, "ignore_eos": True}
        done = (await http.post("/v1/completions", json=short)).json()
    assert done["choices"][0]["finish_reason"] == "length"
    metrics = await asyncio.to_thread(server.metrics)
    # The replacements computed the short request alone: the abandoned one (800 tokens) never started.
    assert metrics["rollout_kv_pages_used"] == 0
    assert metrics["rollout_computed_tokens_total"] <= done["usage"]["prompt_tokens"] + 4


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
