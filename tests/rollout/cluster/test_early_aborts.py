"""Aborts and cancels that reach an actor before the call they name: a
`RolloutWorker` without Ray, driven in every order. An early abort ends
exactly its call, which then computes nothing and still returns what the
contract says; any timing leaves each sample ended once and no work behind."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout import SamplingParams
from rollout.cluster.actor import RolloutWorker
from rollout.cluster.call_aborts import CallAborts
from rollout.engine.streams import SampleDelta
from rollout.outputs import RolloutOutput
from tests.factories import hf_logprobs
from tests.rollout.cluster.test_cluster import wait_until

ENGINE = dict(device="cpu", max_batch_size=8, max_seq_len=128, kv_cache_tokens=1024)
PROMPTS = [[3 + (7 * i) % 90 for i in range(11)], [5, 8, 13, 21, 34]]
LONG = SamplingParams(n=8, max_tokens=100, ignore_eos=True)


class StepGate:
    """A step callback that sets `reached` once the engine has run `target` steps."""

    def __init__(self) -> None:
        self.steps = 0
        self.target: int | None = None
        self.reached = threading.Event()

    def arm(self, after: int) -> None:
        self.reached.clear()
        self.target = self.steps + after
        if after == 0:
            self.reached.set()

    def __call__(self, info) -> None:
        self.steps += 1
        if self.target is not None and self.steps >= self.target:
            self.reached.set()


@pytest.fixture(scope="module")
def gate() -> StepGate:
    return StepGate()


@pytest.fixture(scope="module")
def worker(qwen2, gate) -> RolloutWorker:
    return RolloutWorker(qwen2.path, dict(ENGINE, step_callback=gate))


def _idle(worker: RolloutWorker) -> dict:
    """The worker's health once nothing runs or waits there (a bounded wait)."""
    wait_until(lambda: not worker.health()["running"] and not worker.health()["waiting"], 30)
    return worker.health()


def test_call_aborts_remember_early_aborts_bounded_and_for_a_while():
    now = [0.0]
    aborts = CallAborts(limit=2, ttl_s=10.0, clock=lambda: now[0])
    ended: list[str] = []
    aborts.abort("a")  # before its call: remembered
    assert aborts.register("a", lambda: ended.append("a")) and ended == ["a"]
    assert not aborts.register("b", lambda: ended.append("b"))  # no abort came: it runs
    aborts.abort("b")
    assert ended == ["a", "b"]
    aborts.finish("b")
    aborts.abort("b")  # late: its call ended, nothing is kept for it
    assert aborts.num_early == 0 and ended == ["a", "b"]
    for k in "cde":  # only the newest two are remembered
        aborts.abort(k)
    assert aborts.num_early == 2 and not aborts.take_early("c") and aborts.take_early("d")
    now[0] = 11.0  # "e" expired
    assert not aborts.register("e", lambda: ended.append("e")) and ended == ["a", "b"]


def test_a_generate_call_aborted_before_it_starts_computes_nothing(worker):
    before = _idle(worker)
    worker.abort_generation("early-generate")
    outs = list(worker.generate_stream([4, 9], PROMPTS, LONG, "early-generate"))
    assert sorted(o.index for o in outs) == [4, 9]
    for out in outs:
        assert [(s.finish_reason, s.token_ids, s.logprobs, s.versions) for s in out.samples] == [
            ("abort", [], [], [])
        ] * 8
    after = _idle(worker)
    assert after["computed_tokens"] == before["computed_tokens"] and after["kv_pages_used"] == before["kv_pages_used"]
    (later,) = worker.generate_stream([0], PROMPTS[:1], SamplingParams(max_tokens=3, ignore_eos=True), "later-generate")
    assert later.samples[0].finish_reason == "length"  # the abort ended its own call only


def test_a_stream_cancelled_before_it_starts_computes_nothing(worker):
    before = _idle(worker)
    worker.cancel_stream("early-stream")
    assert list(worker.stream_tokens("early-stream", PROMPTS[0], LONG)) == []
    after = _idle(worker)
    assert after["computed_tokens"] == before["computed_tokens"] and after["kv_pages_used"] == before["kv_pages_used"]
    *_, out = worker.stream_tokens("later-stream", PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    assert isinstance(out, RolloutOutput) and out.samples[0].finish_reason == "length"


def test_a_session_turn_aborted_before_it_starts_ends_that_turn_only(worker):
    before = _idle(worker)
    worker.session_abort("turn-1")
    first, routing = worker.session_turn("sess", PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True), "turn-1")
    assert routing is None  # not asked for (and nothing computed)
    assert (first.finish_reason, first.token_ids, first.logprobs, first.versions) == ("abort", [], [], [])
    assert _idle(worker)["computed_tokens"] == before["computed_tokens"]
    worker.session_abort("turn-1")  # late: its turn is over, and the next turn is not touched
    assert worker.health()["early_aborts"] == 0
    second, _ = worker.session_turn("sess", PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True), "turn-2")
    assert second.finish_reason == "length" and len(second.token_ids) == 5
    worker.session_close("sess")
    assert _idle(worker)["kv_pages_used"] == before["kv_pages_used"]


def test_a_session_abort_between_registering_and_starting_the_turn_ends_it(worker, monkeypatch):
    """The abort lands after the turn registered its id and before the engine
    holds its request: the turn ends "abort" all the same, far short of 100."""
    aborts = worker._sessions._aborts
    register = aborts.register

    def register_then_abort(call_id, abort):
        started = register(call_id, abort)
        aborts.abort(call_id)  # the control thread's abort, right after the id is known
        return started

    monkeypatch.setattr(aborts, "register", register_then_abort)
    turn, _ = worker.session_turn("racing", PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True), "turn-r")
    monkeypatch.undo()
    assert turn.finish_reason == "abort" and len(turn.token_ids) < 100
    worker.session_close("racing")
    _idle(worker)


def _run_generate(worker, call_id: str, params: SamplingParams) -> list[tuple[list[int], object]]:
    outs = list(worker.generate_stream([0, 1], PROMPTS, params, call_id))
    assert sorted(o.index for o in outs) == [0, 1]  # every prompt exactly once
    return [(PROMPTS[o.index], s) for o in outs for s in o.samples]


def _run_stream(worker, call_id: str, params: SamplingParams) -> list[tuple[list[int], object]]:
    got: dict[int, list[int]] = {k: [] for k in range(params.n)}
    ended: dict[int, str] = {}
    try:
        for item in worker.stream_tokens(call_id, PROMPTS[0], params):
            if isinstance(item, SampleDelta):
                assert item.index not in ended  # nothing after a sample's last delta
                got[item.index] += item.token_ids
                if item.finish_reason is not None:
                    ended[item.index] = item.finish_reason
            else:
                assert [s.token_ids for s in item.samples] == [got[k] for k in range(params.n)]
                assert [s.finish_reason for s in item.samples] == [ended[k] for k in range(params.n)]
                return [(PROMPTS[0], s) for s in item.samples]
    except asyncio.CancelledError:  # a cancelled stream's samples end unreported, as `Engine.stream`'s do
        pass
    return []


def _run_turn(worker, call_id: str, params: SamplingParams) -> list[tuple[list[int], object]]:
    sample, _ = worker.session_turn(call_id, PROMPTS[1], params, call_id)
    worker.session_close(call_id)
    return [(PROMPTS[1], sample)]


RUNS = {"generate": (_run_generate, "abort_generation"), "stream": (_run_stream, "cancel_stream")}
RUNS["session"] = (_run_turn, "session_abort")


@settings(max_examples=16, deadline=None)
@given(
    kind=st.sampled_from(sorted(RUNS)),
    when=st.one_of(st.just("before"), st.just("never"), st.integers(0, 8)),  # an int: after that many steps
    n=st.integers(1, 3),
    max_tokens=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_any_abort_timing_ends_each_sample_once_and_leaves_nothing_running(
    worker, gate, qwen2, kind, when, n, max_tokens, seed
):
    run, abort_name = RUNS[kind]
    call_id = f"{kind}-{when}-{n}-{max_tokens}-{seed}"
    n = 1 if kind == "session" else n  # a session turn samples one response
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, logprobs_mode="raw", seed=seed)
    before = _idle(worker)
    abort = getattr(worker, abort_name)
    aborter = None
    if when == "before":
        abort(call_id)
    elif when != "never":
        gate.arm(when)
        aborter = threading.Thread(target=lambda: gate.reached.wait(30) and abort(call_id))
        aborter.start()
    samples = run(worker, call_id, params)
    if aborter is not None:
        gate.reached.set()  # the call may have ended first: then the abort comes late
        aborter.join(30)
    for prompt, s in samples:
        assert s.finish_reason in ("length", "abort")
        assert len(s.token_ids) == len(s.logprobs) == len(s.versions)
        assert len(s.token_ids) == max_tokens if s.finish_reason == "length" else len(s.token_ids) < max_tokens
        if when == "before":
            assert s.finish_reason == "abort" and not s.token_ids
        if when == "never":
            assert s.finish_reason == "length"
        if s.token_ids:  # every token kept is exact (transformers on the same checkpoint)
            ref = hf_logprobs(qwen2.hf, prompt, s.token_ids)
            assert torch.allclose(torch.tensor(s.logprobs, dtype=torch.float64), ref, atol=1e-4)
    after = _idle(worker)
    wait_until(lambda: worker.health()["kv_pages_used"] == before["kv_pages_used"], 30)
    if when == "before":
        assert after["computed_tokens"] == before["computed_tokens"]
