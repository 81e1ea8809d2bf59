"""A server per test package: `rollout serve` as a subprocess on a free
loopback port, waited for through `/health` with a deadline and killed at
the end; clients are the real `openai` package and plain httpx."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_engine
from tests.factories import make_checkpoint

ROOT = Path(__file__).resolve().parents[3]
API_KEY = "test-key-0123"
# ChatML's shape in characters the tests' character-level tokenizer has ("|" is not among them).
CHATML = (
    "{% for m in messages %}<im_start>{{ m['role'] }} {{ m['content'] }}<im_end> {% endfor %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools> {% endif %}"
    "{% if add_generation_prompt %}<im_start>assistant {% endif %}"
)
# The engine sizes of every server here and of the in-process reference engines.
SIZES = {"max_batch_size": 32, "max_seq_len": 1024, "kv_cache_tokens": 16384}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `rollout serve` process."""

    def __init__(self, url: str, process: subprocess.Popen, api_key: str | None) -> None:
        self.url, self.process, self.api_key = url, process, api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60.0, **kwargs)

    def async_http(self, **kwargs) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=120.0, **kwargs)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0)

    def metrics(self) -> dict[str, float]:
        """`/metrics` parsed: `name{labels}` -> value, each family declared by # TYPE first."""
        with self.http() as c:
            response = c.get("/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        return parse_prometheus(response.text)


def parse_prometheus(text: str) -> dict[str, float]:
    declared, samples = set(), {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge")
            declared.add(name)
        elif line and not line.startswith("#"):
            match = re.fullmatch(r'([a-z_]+)(\{(?:[a-z_]+="[^"]*",?)*\})? (-?[0-9.e+]+)', line)
            assert match, line
            assert match.group(1) in declared, line
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


@contextmanager
def serve(
    model: Path,
    *args: str,
    logs: Path,
    api_key: str | None = None,
    entry: tuple[str, ...] = ("-m", "rollout.cli", "serve"),
    deadline_s: float = 90.0,
) -> Iterator[Server]:
    """`python <entry> --model model args...` until the block ends. Its stderr
    (uvicorn's log) goes to a file in `logs`, shown when it fails to start;
    stdin and stdout are pipes (`Server.process`)."""
    port = free_port()
    cmd = [sys.executable, *entry, "--model", str(model), "--port", str(port), "--log-level", "warning", *args]
    env = {**os.environ, "ROLLOUT_API_KEY": api_key or ""}
    log = open(logs / f"server-{port}.log", "w+")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
    )
    server = Server(f"http://127.0.0.1:{port}", process, api_key)
    try:
        _wait_healthy(server, log, deadline_s)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        log.close()


def _wait_healthy(server: Server, log, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        try:
            if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    log.seek(0)
    pytest.fail(f"server did not become healthy (exit code {server.process.poll()}):\n{log.read()[-4000:]}")


def write_chat_checkpoint(path: Path) -> Path:
    """The tests' qwen2 with the character tokenizer, a 1024-token context and a ChatML-shaped template."""
    make_checkpoint(path, "qwen2", seed=11, tokenizer=True, max_position_embeddings=SIZES["max_seq_len"])
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    return path


def size_args(**overrides) -> list[str]:
    sizes = {**SIZES, **overrides}
    return [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]


@pytest.fixture(scope="package")
def tiny_path(tmp_path_factory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("serve_tiny") / "tiny")


@pytest.fixture(scope="package")
def tiny_server(tiny_path) -> Iterator[Server]:
    """The tiny model's server, with an API key (every client here sends it)."""
    with serve(tiny_path, *size_args(), logs=tiny_path.parent, api_key=API_KEY) as server:
        yield server


@pytest.fixture(scope="package")
def tiny_engine(tiny_path):
    """The in-process reference: an `Engine` of the same checkpoint and sizes."""
    engine = make_engine(tiny_path, **SIZES)
    yield engine
    engine.close()
