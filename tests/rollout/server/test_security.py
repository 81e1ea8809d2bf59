"""What keeps the server safe at its edges: JSON-only bodies and loopback
`Host` names (a browser page cannot post to it or rebind a name onto it), no
open bind others can reach, the key kept out of the command line, 500s that
tell a client nothing but a request id, chat templates bounded in time, and
an event loop that renders and tokenizes nothing (so `/health` answers while
a prompt is tokenized). Servers run in this process (`start_server`) over the
package's tiny engine; clients are the real `openai` package and httpx."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.chat import ChatTemplate
from rollout.cli import main, parser
from rollout.engine.errors import ClosedError, NoActorInTimeError
from rollout.engine.streams import TokenStream
from rollout.server import EngineBackend, ServerConfig, start_server
from rollout.server.run import api_key, server_config
from rollout.server.security import host_name, is_loopback
from tests.rollout.server.conftest import API_KEY

USER = [{"role": "user", "content": "hi"}]
CONFIG = ServerConfig("tiny", max_n=4, max_tokens=64)


@contextmanager
def running(backend, config: ServerConfig = CONFIG, host: str = "127.0.0.1") -> Iterator[str]:
    """A server on a free port of `host`; yields its loopback URL."""
    server = start_server(backend, config, host=host, port=0)
    try:
        yield f"http://127.0.0.1:{server.url.rpartition(':')[2]}"
    finally:
        server.stop()


def client(url: str, key: str = "none", timeout: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def test_post_bodies_must_be_json_and_no_cors_is_offered(tiny_engine):
    body = b'{"prompt": [1, 40], "max_tokens": 2}'
    with running(EngineBackend(tiny_engine)) as url, httpx.Client(base_url=url, timeout=60) as http:
        for content_type in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]:
            headers = {} if content_type is None else {"Content-Type": content_type}
            response = http.post("/v1/completions", content=body, headers=headers)
            assert response.status_code == 415, (content_type, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_media_type"
            assert error["param"] == "Content-Type" and "application/json" in error["message"]
        ok = http.post("/v1/completions", content=body, headers={"Content-Type": "Application/JSON; charset=utf-8"})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) > 0
        preflight = {"Origin": "https://page.example", "Access-Control-Request-Method": "POST"}
        response = http.options("/v1/completions", headers=preflight)
        assert response.status_code == 405 and "access-control-allow-origin" not in response.headers
        assert client(url).completions.create(model="tiny", prompt=[1, 40], max_tokens=2).choices


def test_a_loopback_bind_answers_only_loopback_host_names(tiny_engine):
    with running(EngineBackend(tiny_engine)) as url, httpx.Client(base_url=url, timeout=60) as http:
        for host in ["localhost", "LOCALHOST:8000", "127.0.0.1", "127.0.0.1:1", "[::1]", "[::1]:8000"]:
            assert http.get("/health", headers={"Host": host}).status_code == 200, host
        for host in ["rebound.example", "rebound.example:8000", "127.0.0.1.nip.io", "[::2]:80", "0.0.0.0", ""]:
            for method, route in [("GET", "/health"), ("POST", "/v1/completions")]:
                response = http.request(method, route, headers={"Host": host}, json={"prompt": "a"})
                assert response.status_code == 421, (host, route, response.text)
                error = response.json()["error"]
                assert error["param"] == "Host" and error["code"] == "misdirected_request"


@settings(max_examples=200, deadline=None)
@given(ip=st.ip_addresses(), port=st.none() | st.integers(0, 65535))
def test_host_headers_of_ip_literals_are_loopback_exactly_when_their_address_is(ip, port):
    literal = f"[{ip}]" if ip.version == 6 else str(ip)
    header = literal if port is None else f"{literal}:{port}"
    assert is_loopback(host_name(header)) == ip.is_loopback


@settings(max_examples=200, deadline=None)
@given(name=st.from_regex(r"[a-z][a-z0-9-]{0,15}(\.[a-z0-9-]{1,10}){0,3}", fullmatch=True), port=st.integers(0, 65535))
def test_host_headers_of_names_are_loopback_only_for_localhost(name, port):
    assert is_loopback(host_name(f"{name}:{port}")) == (name == "localhost")
    assert host_name(f"{name}:{port}") == host_name(name) == name


def test_an_open_bind_needs_a_key_and_then_skips_the_host_check(tiny_engine):
    backend = EngineBackend(tiny_engine)
    for host in ["0.0.0.0", "::", "192.0.2.1", "my-host"]:
        with pytest.raises(ValueError, match="reachable from other machines and no API key is set"):
            start_server(backend, CONFIG, host=host, port=0)
    keyed = ServerConfig("tiny", max_n=4, max_tokens=64, api_key=API_KEY)
    with running(backend, keyed, host="0.0.0.0") as url:
        models = httpx.get(
            url + "/v1/models", headers={"Host": "rollout.lan:8000", "Authorization": f"Bearer {API_KEY}"}
        )
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    with running(backend, ServerConfig("tiny", max_n=4, max_tokens=64, allow_no_key=True), host="0.0.0.0") as url:
        assert httpx.get(url + "/v1/models", headers={"Host": "rollout.lan"}).status_code == 200
    with pytest.raises(TypeError, match="host must be a str"):
        start_server(backend, CONFIG, host=None, port=0)
    with pytest.raises(TypeError, match="allow_no_key must be a bool"):
        ServerConfig("tiny", max_n=4, max_tokens=64, allow_no_key="yes")


def test_rollout_serve_refuses_an_open_bind_without_a_key_before_loading(tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "no-such-checkpoint")  # reached only past the key check
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    assert main(["serve", "--model", missing, "--host", "0.0.0.0"]) == 2
    assert "host '0.0.0.0' is reachable from other machines and no API key is set" in capsys.readouterr().err
    for extra, env in [(["--allow-no-key"], None), ([], "k3y"), (["--api-key-file", str(tmp_path / "nope")], None)]:
        if env is not None:
            monkeypatch.setenv("ROLLOUT_API_KEY", env)
        assert main(["serve", "--model", missing, "--host", "0.0.0.0", *extra]) == 2
        err = capsys.readouterr().err
        assert "no API key" not in err and ("no-such-checkpoint" in err or "nope" in err), err
        monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)


class _Sizes:
    max_batch_size, max_seq_len = 8, 128


def test_the_key_comes_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("from-the-file\n")
    serve = ["serve", "--model", str(tmp_path)]

    def key(*flags: str) -> str | None:
        args = parser().parse_args([*serve, *flags])
        return server_config(args, _Sizes(), api_key(args)).api_key

    assert key() is None
    assert key("--api-key-file", str(key_file)) == "from-the-file"
    assert key("--api-key", "from-the-flag") == "from-the-flag"
    monkeypatch.setenv("ROLLOUT_API_KEY", "from-the-environment")
    assert key() == "from-the-environment"
    assert key("--api-key-file", str(key_file)) == "from-the-file"
    with pytest.raises(ValueError, match="give one of --api-key and --api-key-file"):
        key("--api-key", "a", "--api-key-file", str(key_file))
    key_file.write_text(" \n")
    with pytest.raises(ValueError, match="--api-key-file .* is empty"):
        key("--api-key-file", str(key_file))


SECRET = "/srv/secret/weights.bin (pid 4242)"  # what an exception may say and a client must never see


class _FailingBackend(EngineBackend):
    """Its streams fail with `error`: when started (`at_start`), or when read,
    as a stream whose engine or actor failed after the response began."""

    def __init__(self, engine, error: Exception, at_start: bool = False) -> None:
        super().__init__(engine)
        self.error, self.at_start = error, at_start

    def stream(self, prompt, params):
        if self.at_start:
            raise self.error
        stream, failed = TokenStream(), Future()  # made in the event loop, as the engine makes it
        failed.set_exception(self.error)
        stream.attach(failed)
        return stream


def _assert_only_a_request_id(error: dict, request_id: str, caplog) -> None:
    """The generic 500 body, and the detail logged under its request id."""
    assert len(request_id) == 32
    assert error == {
        "message": "internal error",
        "type": "server_error",
        "param": None,
        "code": None,
        "request_id": request_id,
    }
    (record,) = [r for r in caplog.records if r.name == "rollout.server" and request_id in r.getMessage()]
    assert record.levelno == logging.ERROR and SECRET in str(record.exc_info[1])


def test_a_500_tells_only_a_request_id_which_the_log_holds_with_the_detail(tiny_engine, caplog):
    caplog.set_level(logging.ERROR, logger="rollout.server")
    backend = _FailingBackend(tiny_engine, RuntimeError(f"cannot open {SECRET}"), at_start=True)
    with running(backend) as url, pytest.raises(openai.InternalServerError) as failed:
        client(url).completions.create(model="tiny", prompt=[1, 40], max_tokens=2)
    response = failed.value.response
    assert "/srv" not in response.text and "4242" not in response.text
    _assert_only_a_request_id(response.json()["error"], response.headers["x-request-id"], caplog)


def test_a_stream_that_fails_after_its_first_chunk_sends_only_a_request_id(tiny_engine, caplog):
    caplog.set_level(logging.ERROR, logger="rollout.server")
    backend = _FailingBackend(tiny_engine, RuntimeError(f"lost {SECRET}"))
    with running(backend) as url, pytest.raises(openai.APIError) as failed:
        for chunk in client(url).chat.completions.create(model="tiny", messages=USER, max_tokens=2, stream=True):
            assert chunk.choices[0].delta.role == "assistant"  # the opening chunk, before the failure
    _assert_only_a_request_id(failed.value.body, failed.value.body["request_id"], caplog)


def test_no_live_actor_is_a_503_to_retry_not_an_internal_error(tiny_engine):
    hung = NoActorInTimeError(f"no rollout actor came back within 8 s: actor 0 ({SECRET}) hung")
    with running(_FailingBackend(tiny_engine, hung)) as url:
        response = httpx.post(url + "/v1/completions", json={"prompt": [1, 40], "max_tokens": 2}, timeout=30)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "unavailable") and "4242" not in response.text
        assert error["message"] == "no rollout actor is available: retry after 1 s"
        with pytest.raises(openai.APIError) as failed:
            for _ in client(url).chat.completions.create(model="tiny", messages=USER, max_tokens=2, stream=True):
                pass
    assert failed.value.body["code"] == "unavailable" and "4242" not in str(failed.value.body)


def test_a_closed_engine_is_a_503_not_a_400(tiny_engine):
    """`ClosedError` is a ValueError too; it must not read as the client's mistake."""
    backend = _FailingBackend(tiny_engine, ClosedError(f"engine closed ({SECRET})"), at_start=True)
    with running(backend) as url:
        response = httpx.post(url + "/v1/completions", json={"prompt": [1, 40], "max_tokens": 2}, timeout=30)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["message"] == "the server is shutting down: retry after 1 s"


LOOPING = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (LOOPING, "the chat template 'default' ran past its time limit of 0.3 s"),
        ("{{ messages|length // 0 }}", "the chat template 'default' failed: ZeroDivisionError"),
        ("{% if %}", "the chat template 'default' cannot be compiled"),
    ],
)
def test_template_failures_are_400s_naming_the_template(tiny_engine, monkeypatch, source, message):
    codec = tiny_engine.tokenizer
    monkeypatch.setattr(codec, "chat", ChatTemplate({"default": source}, {}, codec, time_limit_s=0.3))
    with running(EngineBackend(tiny_engine)) as url, pytest.raises(openai.BadRequestError) as refused:
        start = time.monotonic()
        client(url, timeout=20).chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert time.monotonic() - start < 0.3 + 10  # the margin is for a loaded CI host; unbounded it never ends
    error = refused.value.response.json()["error"]
    assert error["param"] == "messages" and message in error["message"], error


def test_health_answers_while_a_prompt_is_tokenized(tiny_engine, monkeypatch):
    codec, entered, release = tiny_engine.tokenizer, threading.Event(), threading.Event()
    slow_text = "a prompt that takes long to tokenize"

    def slow(encode):
        def encode_slowly(text: str, *args, **kwargs) -> list[int]:
            if text == slow_text:
                entered.set()
                assert release.wait(30), "the test never released the tokenizer"
            return encode(text, *args, **kwargs)

        return encode_slowly

    for name in ("encode", "encode_unlocked"):  # whichever the server tokenizes with
        monkeypatch.setattr(codec, name, slow(getattr(codec, name, codec.encode)), raising=False)
    with running(EngineBackend(tiny_engine)) as url:
        answers: dict = {}
        post = threading.Thread(
            target=lambda: answers.update(
                r=client(url).completions.create(model="tiny", prompt=slow_text, max_tokens=2)
            )
        )
        post.start()
        try:
            assert entered.wait(30)
            health = httpx.get(url + "/health", timeout=10)
            assert health.status_code == 200 and health.json()["status"] == "ok"
        finally:
            release.set()
            post.join(60)
    assert answers["r"].usage.prompt_tokens == len(codec.encode(slow_text))
