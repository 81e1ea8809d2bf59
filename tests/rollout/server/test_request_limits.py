"""A request's work is bounded on the server: stop strings and
`max_request_tokens` answer 400s naming the field, each at its edge, and the
work in flight answers 429 with `Retry-After` past `max_inflight_tokens`,
on every route, streaming or not. Each request here costs
prompts x n x (prompt tokens + max_tokens), hand-computed."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from rollout.cli import parser
from rollout.engine.step_stats import StepInfo
from rollout.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from rollout.server import EngineBackend, ServerConfig, start_server
from rollout.server.run import server_config
from tests.conftest import make_engine
from tests.rollout.cluster.test_cluster import wait_until
from tests.rollout.server.conftest import SIZES

LIMIT = 60  # max_request_tokens and max_inflight_tokens of the server here
# The tests' chat template around one user message "hi", one token per character.
CHAT_PROMPT = "<im_start>user hi<im_end> <im_start>assistant "
WAIT_S = 60  # bound on every wait: a hang fails, never blocks the run


class Gate:
    """A step callback that, while closed, holds the engine's thread after a
    step that leaves a sequence running (the last step of an earlier request,
    whose callback may come after its answer, leaves none)."""

    def __init__(self) -> None:
        self.is_open = threading.Event()
        self.is_open.set()
        self.stepped = threading.Event()

    def __call__(self, info: StepInfo) -> None:
        if info.num_running:
            self.stepped.set()
            self.is_open.wait(WAIT_S)


@pytest.fixture(scope="module")
def gated(tiny_path) -> Iterator[tuple[str, Gate]]:
    gate = Gate()
    engine = make_engine(tiny_path, **SIZES, step_callback=gate)
    config = ServerConfig("tiny", max_n=4, max_tokens=64, max_request_tokens=LIMIT, max_inflight_tokens=LIMIT)
    server = start_server(EngineBackend(engine), config, port=0)
    try:
        yield server.url, gate
    finally:
        gate.is_open.set()
        server.stop()
        engine.close()


def completion(url: str, **body) -> httpx.Response:
    body = {"prompt": [1, 40, 41], "max_tokens": 2, "ignore_eos": True, **body}
    return httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S)


def chat(url: str, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True, **body}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=WAIT_S)


def assert_400(response: httpx.Response, param: str, needle: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert needle in error["message"], error["message"]


@pytest.mark.parametrize("route", [completion, chat])
def test_stop_strings_at_their_bounds(gated, route):
    url, _ = gated
    assert route(url, stop=["~"] * MAX_STOP_STRINGS).status_code == 200
    assert_400(route(url, stop=["~"] * (MAX_STOP_STRINGS + 1)), "stop", f"at most {MAX_STOP_STRINGS} strings")
    assert route(url, stop=["~" * MAX_STOP_LENGTH]).status_code == 200
    assert_400(route(url, stop=["~" * (MAX_STOP_LENGTH + 1)]), "stop", f"1 to {MAX_STOP_LENGTH} characters")


def test_request_tokens_at_their_bound(gated):
    url, _ = gated
    # Token ids: 2 prompts x n=2 x (3 + 12) = 60; one more output token is 64.
    ids = {"prompt": [[1, 40, 41], [1, 42, 43]], "n": 2}
    assert completion(url, **ids, max_tokens=12).status_code == 200
    assert_400(completion(url, **ids, max_tokens=13), "max_tokens", "come to 64 tokens")
    # Text, tokenized by the server: "<s>abc" is 4 tokens, + 56 = 60.
    assert completion(url, prompt="abc", max_tokens=56).status_code == 200
    assert_400(completion(url, prompt="abcd", max_tokens=56), "max_tokens", "come to 61 tokens")
    # Chat: the rendered template's 46 tokens, + 14 = 60.
    left = LIMIT - len(CHAT_PROMPT)
    assert left == 14
    assert chat(url, max_tokens=left).status_code == 200
    assert_400(chat(url, max_tokens=left + 1), "max_tokens", f"over max_request_tokens ({LIMIT})")


def test_work_in_flight_past_its_bound_gets_429_on_every_route(gated):
    url, gate = gated
    gate.is_open.clear()
    gate.stepped.clear()
    held: list[httpx.Response] = []
    first = threading.Thread(target=lambda: held.append(completion(url, max_tokens=27)))  # 3 + 27 = 30
    first.start()
    try:
        assert gate.stepped.wait(WAIT_S)  # the first request is in the engine, its 30 tokens counted
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json={"prompt": [1, 44, 45], "max_tokens": 27, "stream": True},
            timeout=WAIT_S,
        ) as second:
            assert second.status_code == 200  # 30 + 30: exactly at the bound
            assert "\nrollout_inflight_tokens 60\n" in httpx.get(url + "/metrics", timeout=WAIT_S).text
            busy = [
                completion(url, prompt=[1], max_tokens=1),  # 2 more tokens
                completion(url, prompt=[1], max_tokens=1, stream=True),
                chat(url, max_tokens=1),
                chat(url, max_tokens=1, stream=True),
            ]
            gate.is_open.set()
            body = second.read()
    finally:
        gate.is_open.set()
        first.join(WAIT_S)
    for response in busy:
        assert response.status_code == 429 and response.headers["retry-after"] == "1", response.text
        assert response.json()["error"]["code"] == "server_busy"
    assert body.endswith(b"data: [DONE]\n\n") and held[0].status_code == 200
    # A stream gives its work back once its last chunk went out, after the client read it: wait for that.
    wait_until(lambda: "\nrollout_inflight_tokens 0\n" in httpx.get(url + "/metrics", timeout=WAIT_S).text)
    assert completion(url, max_tokens=57).status_code == 200  # 3 + 57: both released all they held
    assert "\nrollout_inflight_tokens 0\n" in httpx.get(url + "/metrics", timeout=WAIT_S).text


def test_a_request_the_engine_refuses_holds_nothing(gated):
    url, _ = gated
    # 1 + 56 = 57 taken, then the engine refuses the stop id as the stream starts: a 400, and the 57 are given back.
    refused = completion(url, prompt=[1], max_tokens=56, stop_token_ids=[9999])
    assert_400(refused, "stop_token_ids", "outside the vocabulary")
    assert completion(url, max_tokens=57).status_code == 200  # 3 + 57: the whole bound is free


class Sizes:
    """What `server_config` reads of a backend: its engine's sizes."""

    max_batch_size, max_seq_len = 512, 4096


@pytest.mark.parametrize(
    "flags,request_tokens,inflight_tokens",
    [
        ([], 512 * 4096, 4 * 512 * 4096),  # the engine's batch at full length, four in flight
        (["--max-request-tokens", "100"], 100, 400),
        (["--max-request-tokens", "100", "--max-inflight-tokens", "100"], 100, 100),
        (["--max-inflight-tokens", "1000000"], 1000000, 1000000),  # alone, it caps a request's work too
    ],
)
def test_serve_flags_set_the_limits(flags, request_tokens, inflight_tokens):
    args = parser().parse_args(["serve", "--model", "m", *flags])
    config = server_config(args, Sizes(), None)
    assert (config.max_request_tokens, config.max_inflight_tokens) == (request_tokens, inflight_tokens)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--max-request-tokens", "1"], "max_request_tokens must be an int >= 2"),
        (["--max-request-tokens", "100", "--max-inflight-tokens", "99"], r"max_inflight_tokens must be an int >= 100"),
    ],
)
def test_serve_refuses_limits_that_admit_nothing(flags, needle):
    args = parser().parse_args(["serve", "--model", "m", *flags])
    with pytest.raises(ValueError, match=needle):
        server_config(args, Sizes(), None)
