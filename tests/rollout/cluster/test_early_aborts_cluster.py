"""Early aborts through Ray: on an actor that runs one generate call and one
session call at a time, a call queued behind a held one is aborted before it
starts there (the repros: `submit(...).abort()`, `stream(...).cancel()`,
`session.abort()` right after the call). It ends with every sample aborted
and nothing computed, and the actor is left with nothing running and its KV
back."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout import RolloutCluster, SamplingParams
from rollout.cluster import streams
from tests.rollout.cluster.test_cluster import wait_until
from tests.rollout.cluster.test_sessions import PROMPT, _pause_while

LONG = SamplingParams(n=8, max_tokens=100, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def hold(tmp_path_factory):
    return tmp_path_factory.mktemp("early") / "hold"


@pytest.fixture(scope="module")
def narrow(ray_session, qwen2, hold):
    c = RolloutCluster(
        qwen2.path,
        num_actors=1,
        num_cpus_per_actor=1,
        generate_concurrency=1,
        session_concurrency=1,
        max_seq_len=256,
        kv_cache_tokens=4096,
        max_batch_size=16,
        timeout_s=120,
        stall_timeout_s=120,
        step_callback=_pause_while(str(hold)),
    )
    yield c
    c.shutdown()


def _health(cluster) -> dict:
    (h,) = cluster.health()
    return h


def _idle(cluster) -> dict:
    wait_until(lambda: not _health(cluster)["running"] and not _health(cluster)["waiting"], 60)
    return _health(cluster)


class Held:
    """A short call that holds the actor's only thread of its kind while `hold` exists."""

    def __init__(self, cluster, hold, start) -> None:
        self.hold, self.result = hold, {}
        hold.touch()
        self.thread = threading.Thread(target=lambda: self.result.setdefault("out", start()))
        self.thread.start()
        wait_until(lambda: _health(cluster)["running"] == 1, 60)

    def release(self):
        self.hold.unlink(missing_ok=True)
        self.thread.join(60)
        return self.result["out"]


def _assert_nothing_sampled(samples) -> None:
    for s in samples:
        assert (s.finish_reason, s.token_ids, s.logprobs, s.versions) == ("abort", [], [], [])


def test_a_submit_aborted_before_its_call_starts_on_the_actor(narrow, hold):
    before = _idle(narrow)
    held = Held(narrow, hold, lambda: narrow.generate([PROMPT], SHORT))
    try:
        handle = narrow.submit([PROMPT, PROMPT[:5]], LONG)  # queued on the actor behind the held call
        handle.abort()
        wait_until(lambda: _health(narrow)["early_aborts"] == 1, 60)  # the abort got there first
    finally:
        (first,) = held.release()
    outs = handle.result(60)
    _assert_nothing_sampled([s for out in outs for s in out.samples])
    after = _idle(narrow)
    assert first.samples[0].finish_reason == "length"
    assert after["computed_tokens"] - before["computed_tokens"] <= len(PROMPT) + 1  # the held call's only
    assert after["kv_pages_used"] == before["kv_pages_used"] and after["early_aborts"] == 0


def test_a_stream_cancelled_before_its_call_starts_on_the_actor(narrow, hold, monkeypatch):
    sent = threading.Event()  # the driver made the actor call (it then waits behind the held one)
    start = streams._Reader._start

    def start_then_tell(reader):
        started = start(reader)
        sent.set()
        return started

    monkeypatch.setattr(streams._Reader, "_start", start_then_tell)
    sess = narrow.session(PROMPT)
    before = _idle(narrow)
    held = Held(narrow, hold, lambda: sess.generate(SHORT))  # streams share the session threads
    try:
        stream = narrow.stream(PROMPT, LONG)
        assert sent.wait(60)
        stream.cancel()
        wait_until(lambda: _health(narrow)["early_aborts"] == 1, 60)  # the cancel got there first
    finally:
        held.release()
    with pytest.raises(asyncio.CancelledError):
        list(stream)
    after = _idle(narrow)
    assert after["computed_tokens"] - before["computed_tokens"] <= len(PROMPT) + 1  # the held turn's only
    sess.close()
    wait_until(lambda: _health(narrow)["kv_pages_used"] == before["kv_pages_used"] == 0, 60)
    assert _health(narrow)["early_aborts"] == 0


def test_a_session_turn_aborted_before_it_starts_on_the_actor(narrow, hold):
    sess = narrow.session(PROMPT[:5])
    before = _idle(narrow)
    # A stream holds the actor's session thread; the driver's one session thread stays free to send the turn.
    held = Held(narrow, hold, lambda: list(narrow.stream(PROMPT, SHORT)))
    result: dict = {}
    try:
        turn = threading.Thread(
            target=lambda: result.setdefault("turn", sess.generate(SamplingParams(max_tokens=100, ignore_eos=True)))
        )
        turn.start()
        # The turn was sent to the actor, where it waits behind the held one.
        wait_until(lambda: sess._backend._current is not None and sess._backend._current._slot is not None, 60)
        sess.abort()
        wait_until(lambda: _health(narrow)["early_aborts"] == 1, 60)  # the abort got there first
    finally:
        held.release()
    turn.join(60)
    _assert_nothing_sampled([result["turn"]])
    assert sess.token_ids == PROMPT[:5] and sess.num_turns == 1
    after = _idle(narrow)
    assert after["computed_tokens"] - before["computed_tokens"] <= len(PROMPT) + 1  # the held stream's only
    assert sess.generate(SHORT).finish_reason == "length"  # the abort ended that turn, not the next
    sess.close()
    wait_until(lambda: _health(narrow)["kv_pages_used"] == 0 and _health(narrow)["early_aborts"] == 0, 60)
