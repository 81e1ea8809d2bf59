"""The server at overload: an engine that batches 4 sequences behind 40
concurrent streaming clients, a client that stops reading, one that leaves
mid-stream, and `/health` throughout. Deterministic: while requests arrive
a step callback (`Gate`) holds the engine, so which are admitted never
depends on timing, and every other wait is an event or a bounded poll.

The server runs with 4 KiB socket buffers (its listening socket's, which
each connection inherits), so a client that stops reading fills them after
a few chunks and the server's back-pressure shows within a short stream."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from rollout import SamplingParams
from rollout.cli import parser
from rollout.server import EngineBackend, ServerConfig
from rollout.server.app import create_app
from rollout.server.run import server_config
from tests.conftest import make_engine
from tests.rollout.server.conftest import SIZES, parse_prometheus
from tests.rollout.server.test_request_limits import Gate

BATCH = 4  # sequences the engine steps at once
CLIENTS = 10 * BATCH
MAX_REQUESTS = 5 * BATCH  # max_inflight_requests: half the clients are admitted
MAX_TOKENS = 4096  # max_inflight_tokens: far above the work of MAX_REQUESTS small requests
LENGTH = 64  # tokens each admitted client samples
SLOW_TOKENS = 600  # the slow reader's: with logprobs, far more bytes than the sockets' buffers hold
HEALTH_S = 2.0  # what `/health` may take while the engine is saturated
WAIT_S = 60.0  # bound on every wait: a hang fails, never blocks the run


@dataclass
class Served:
    url: str
    gate: Gate
    engine: object


@pytest.fixture(scope="module")
def served(tiny_path) -> Iterator[Served]:
    gate = Gate()
    engine = make_engine(tiny_path, **{**SIZES, "max_batch_size": BATCH}, step_callback=gate)
    config = ServerConfig(
        "tiny",
        max_n=4,
        max_tokens=1024,
        max_request_tokens=MAX_TOKENS,
        max_inflight_tokens=MAX_TOKENS,
        max_inflight_requests=MAX_REQUESTS,
    )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(EngineBackend(engine), config), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", gate, engine)
    finally:
        gate.is_open.set()
        server.should_exit = True
        thread.join(WAIT_S)
        engine.close()


def metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url + "/metrics", timeout=WAIT_S).text)


def wait_for(url: str, done, what: str) -> dict[str, float]:
    """Poll `/metrics` until `done(reading)`, within `WAIT_S`; the last reading."""
    deadline = time.monotonic() + WAIT_S
    while not done(reading := metrics(url)):
        assert time.monotonic() < deadline, f"{what}: not reached in {WAIT_S} s: {reading}"
        time.sleep(0.02)
    return reading


def idle(reading: dict[str, float]) -> bool:
    return reading["rollout_requests_running"] == 0 and reading["rollout_inflight_tokens"] == 0


def tokens_of(body: bytes) -> list[int]:
    """The sampled token ids of a streamed completion (one choice), checked to end with `[DONE]`."""
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    ids = []
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            ids += chunk["choices"][0]["token_ids"] if chunk["choices"] else []
    return ids


def alone(served: Served, prompt: str, max_tokens: int, seed: int) -> list[int]:
    """What the engine samples for this request by itself (a stream iterated here: the driver's thread steps it)."""
    stream = served.engine.stream(prompt, SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True))
    for _ in stream:
        pass
    return list(stream.output.samples[0].token_ids)


def request(prompt: str, max_tokens: int, seed: int, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "temperature": 1.0, "ignore_eos": True}
    return {**body, "stream": True, "return_token_ids": True, **extra}


class Watch:
    """Polls `/health` and `/metrics` on a thread of its own until stopped:
    the slowest `/health` and the highest in-flight gauges seen."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.health_s, self.running, self.tokens, self.polls = 0.0, 0.0, 0.0, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=WAIT_S) as http:
            while not self.stop.is_set():
                start = time.monotonic()
                assert http.get("/health").json()["status"] == "ok"
                self.health_s = max(self.health_s, time.monotonic() - start)
                reading = parse_prometheus(http.get("/metrics").text)
                self.running = max(self.running, reading["rollout_requests_running"])
                self.tokens = max(self.tokens, reading["rollout_inflight_tokens"])
                self.polls += 1
                self.stop.wait(0.05)

    def end(self) -> Watch:
        self.stop.set()
        self.thread.join(WAIT_S)
        return self


def test_ten_times_the_batch_streaming_at_once(served):
    """40 streaming clients on an engine that batches 4: the first 20 are
    admitted and each gets its seeded tokens exactly, the other 20 a 429 with
    `Retry-After` that holds nothing; `/health` answers within 2 s and the
    in-flight gauges stay within their bounds throughout."""
    url, gate = served.url, served.gate
    prompts = [f"prompt number {i}" for i in range(CLIENTS)]
    before = wait_for(url, idle, "idle before")
    watch = Watch(url)

    async def main() -> list[tuple[int, dict, bytes]]:
        limits = httpx.Limits(max_connections=2 * CLIENTS)
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S, limits=limits) as client:
            sent = [
                client.build_request("POST", "/v1/completions", json=request(p, LENGTH, i))
                for i, p in enumerate(prompts)
            ]
            # The engine is held after its first step: no admitted request can end before all have their answer.
            responses = await asyncio.gather(*(client.send(r, stream=True) for r in sent))
            assert [r.status_code for r in responses].count(200) == MAX_REQUESTS
            start = time.monotonic()  # a full batch running, 16 requests queued behind it, 20 refused
            assert (await client.get("/health")).status_code == 200
            assert time.monotonic() - start < HEALTH_S
            gate.is_open.set()
            bodies = await asyncio.gather(*(r.aread() for r in responses))
            return [(r.status_code, dict(r.headers), b) for r, b in zip(responses, bodies, strict=True)]

    gate.stepped.clear()
    gate.is_open.clear()
    try:
        answers = asyncio.run(main())
    finally:
        gate.is_open.set()
    watch.end()
    after = wait_for(url, idle, "idle after")
    admitted = [i for i, (status, _, _) in enumerate(answers) if status == 200]
    for i, (status, headers, body) in enumerate(answers):
        if status == 200:
            assert tokens_of(body) == alone(served, prompts[i], LENGTH, i), i
        else:
            assert status == 429 and headers["retry-after"] == "1", body
            error = json.loads(body)["error"]
            assert error["code"] == "server_busy" and "max_inflight_requests" in error["message"]
    assert len(admitted) == MAX_REQUESTS
    key = 'rollout_requests_total{endpoint="/v1/completions",status="%d"}'
    for status, count in ((200, MAX_REQUESTS), (429, CLIENTS - MAX_REQUESTS)):
        assert after[key % status] - before.get(key % status, 0) == count
    sent = after["rollout_completion_tokens_total"] - before["rollout_completion_tokens_total"]
    assert sent == LENGTH * MAX_REQUESTS  # the refused computed and sent nothing
    assert after["rollout_kv_pages_used"] == 0
    assert watch.polls >= 3 and watch.health_s < HEALTH_S, watch.health_s
    assert watch.running <= MAX_REQUESTS and watch.tokens <= MAX_TOKENS


class SlowReader:
    """A streaming request over a raw socket with a 4 KiB receive buffer,
    which reads its response's status line and then nothing until `read_all`."""

    def __init__(self, url: str, body: dict) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(WAIT_S)
        self.sock.connect((host, int(port)))
        data = json.dumps(body).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        self.sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        self.received = self.sock.recv(64)
        assert self.received.startswith(b"HTTP/1.1 200"), self.received

    def read_all(self) -> bytes:
        """The rest of the response, de-chunked: the event stream's bytes."""
        while not self.received.endswith(b"0\r\n\r\n"):
            part = self.sock.recv(1 << 16)
            assert part, "the server closed the stream early"
            self.received += part
        self.sock.close()
        head, _, chunked = self.received.partition(b"\r\n\r\n")
        body = b""
        while True:
            size, _, rest = chunked.partition(b"\r\n")
            if int(size, 16) == 0:
                return body
            body, chunked = body + rest[: int(size, 16)], rest[int(size, 16) + 2 :]


def test_a_client_that_stops_reading_stalls_no_one(served):
    """A streaming client reads nothing more after its status line. The other
    streams finish meanwhile; the engine finishes its request too (its KV
    freed), but the server sends it only what its socket takes: the rest
    waits in its stream, bounded by the request's own work, which stays
    counted in flight until the client reads it all, every token there."""
    url = served.url
    before = wait_for(url, idle, "idle before")
    slow = SlowReader(url, request("a slow reader", SLOW_TOKENS, 7, logprobs=5))

    async def others() -> list[bytes]:
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:

            async def one(i: int) -> bytes:
                async with client.stream("POST", "/v1/completions", json=request(f"other {i}", LENGTH, i)) as r:
                    assert r.status_code == 200
                    return await r.aread()

            return await asyncio.gather(*(one(i) for i in range(2 * BATCH)))

    bodies = asyncio.run(others())
    assert [len(tokens_of(b)) for b in bodies] == [LENGTH] * 2 * BATCH
    # The slow request ends in the engine (no KV held), not on the wire: most of its tokens wait unsent.
    stalled = wait_for(url, lambda m: m["rollout_kv_pages_used"] == 0, "the engine done with every request")
    unsent = before["rollout_completion_tokens_total"] + 2 * BATCH * LENGTH + SLOW_TOKENS
    unsent -= stalled["rollout_completion_tokens_total"]
    assert unsent > SLOW_TOKENS / 2, unsent
    assert stalled["rollout_requests_running"] == 1 and stalled["rollout_inflight_tokens"] > SLOW_TOKENS
    tokens = tokens_of(slow.read_all())
    assert tokens == alone(served, "a slow reader", SLOW_TOKENS, 7)
    wait_for(url, idle, "the slow reader's place released")


def test_a_client_that_leaves_mid_stream_frees_its_place(served):
    """A client that closes its connection after its first chunks: its request
    is aborted (its KV freed well before its end) and its place and work in
    flight released, while a stream beside it finishes whole."""
    url = served.url
    before = wait_for(url, idle, "idle before")

    async def main() -> bytes:
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
            beside = asyncio.ensure_future(client.post("/v1/completions", json=request("beside", LENGTH, 3)))
            async with client.stream("POST", "/v1/completions", json=request("leaving", 1000, 5)) as r:
                lines = r.aiter_lines()
                assert (await anext(lines)).startswith("data: {")
            return (await beside).content

    assert len(tokens_of(asyncio.run(main()))) == LENGTH
    after = wait_for(url, lambda m: idle(m) and m["rollout_kv_pages_used"] == 0, "the leaver's work released")
    assert after["rollout_computed_tokens_total"] - before["rollout_computed_tokens_total"] < 1000 / 2


class Sizes:
    """What `server_config` reads of a backend: its engine's sizes."""

    max_batch_size, max_seq_len = 512, 4096


@pytest.mark.parametrize("flags,requests", [([], 2048), (["--max-inflight-requests", "64"], 64)])
def test_serve_bounds_the_requests_in_flight(flags, requests):
    """By default four full batches of one-prompt requests (at least 1024); a bound below 1 is refused."""
    assert (
        server_config(parser().parse_args(["serve", "--model", "m", *flags]), Sizes(), None).max_inflight_requests
        == requests
    )
    with pytest.raises(ValueError, match="max_inflight_requests must be an int >= 1"):
        server_config(parser().parse_args(["serve", "--model", "m", "--max-inflight-requests", "0"]), Sizes(), None)
