"""Several threads on one engine: a sample read by its caller while another
thread's step finishes it, `close` while others generate or drain, and a
drain asked for by a thread that holds an unfinished iterator.

Interleavings are forced with events, never with sleeps; every wait is
bounded, so a broken handshake or a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time

import pytest

from rollout import ClosedError, SamplingParams
from rollout.engine import engine as engine_module
from rollout.engine import requests as requests_module
from rollout.engine.sequence import SeqStatus, Sequence
from tests.conftest import make_engine

WAIT = 30  # seconds: far beyond any handshake here, short enough to fail a hang


def _in_thread(fn, name: str) -> tuple[threading.Thread, dict]:
    """Run `fn` in a daemon thread; its result or exception lands in the dict."""
    box: dict = {}

    def body():
        try:
            box["result"] = fn()
        except BaseException as e:  # whatever ended the call, pytest's failures included
            box["error"] = e

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread, box


def _finished_within(thread: threading.Thread, what: str) -> None:
    thread.join(WAIT)
    assert not thread.is_alive(), f"{what} did not finish within {WAIT} s (it waits forever)"


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


# -- a finish is published whole ---------------------------------------------------------
def test_a_sample_seen_finished_by_its_caller_is_complete(qwen2, monkeypatch):
    """The reader's sequence is finished by the other thread's step. That step
    pauses right after the first write of the finish, and the reader looks at
    its request meanwhile: it must see the sample either unfinished or whole."""
    engine = make_engine(qwen2.path)
    owners: dict[int, str] = {}  # seq_id -> name of the thread that asked for it
    reader_stepped, finish_paused, reader_moved = threading.Event(), threading.Event(), threading.Event()

    class WatchedSequence(Sequence):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            finishing = (name == "status" and value is SeqStatus.FINISHED) or (
                name == "finish_reason" and value is not None
            )
            if (
                finishing
                and owners.get(self.seq_id) == "reader"
                and threading.current_thread().name != "reader"
                and not finish_paused.is_set()
            ):
                finish_paused.set()  # mid-finish, in the other thread's step
                reader_moved.wait(WAIT)

    def make_seq(*args):
        seq = WatchedSequence(*args)
        owners[seq.seq_id] = threading.current_thread().name
        return seq

    monkeypatch.setattr(
        engine_module, "make_requests", functools.partial(requests_module.make_requests, make_seq=make_seq)
    )
    real_step = engine._guard.step

    @contextlib.contextmanager
    def step():
        reader = threading.current_thread().name == "reader"
        if reader and reader_stepped.is_set():
            reader_moved.set()  # back at the guard: it looks no further until the guard is free
        with real_step() as version:
            yield version
        if reader and not reader_stepped.is_set():
            reader_stepped.set()  # its first step is done; the finisher takes every step from here
            assert finish_paused.wait(WAIT)

    monkeypatch.setattr(engine._guard, "step", step)

    def read():
        try:
            return engine.generate([[5, 6, 7]], SamplingParams(n=1, max_tokens=3, ignore_eos=True, seed=1))
        finally:
            reader_moved.set()

    reader, read_box = _in_thread(read, "reader")
    assert reader_stepped.wait(WAIT)
    finisher, finish_box = _in_thread(
        lambda: engine.generate([[9, 8, 7, 6]], SamplingParams(n=2, max_tokens=12, ignore_eos=True, seed=2)),
        "finisher",
    )
    _finished_within(reader, "the reader")
    _finished_within(finisher, "the finisher")
    assert finish_paused.is_set()  # the window was open while the reader looked
    assert "error" not in read_box and "error" not in finish_box
    (sample,) = read_box["result"][0].samples
    assert sample.finish_reason == "length"
    assert len(sample.token_ids) == len(sample.logprobs) == len(sample.versions) == 3
    alone = make_engine(qwen2.path).generate([[5, 6, 7]], SamplingParams(n=1, max_tokens=3, ignore_eos=True, seed=1))
    assert sample.token_ids == alone[0].samples[0].token_ids


# -- close while others work -------------------------------------------------------------
PARAMS = SamplingParams(n=2, max_tokens=40, ignore_eos=True, seed=3)
PROMPTS = [[3, 4, 5, 6], [7, 8, 9]]


def test_close_while_another_thread_generates_and_another_drains(qwen2):
    in_callback, closed = threading.Event(), threading.Event()

    def callback(info):
        if threading.current_thread().name == "generating" and not in_callback.is_set():
            in_callback.set()  # between two steps of its generate
            assert closed.wait(WAIT)

    engine = make_engine(qwen2.path, step_callback=callback)
    state_dict = qwen2.hf.state_dict()
    generating, gen_box = _in_thread(lambda: engine.generate(PROMPTS, PARAMS), "generating")
    assert in_callback.wait(WAIT)
    draining, drain_box = _in_thread(lambda: engine.update_weights(state_dict, inflight="drain"), "draining")
    _until(lambda: engine.scheduler.draining, "the drain to wait for the requests in flight")
    closer, close_box = _in_thread(engine.close, "closing")
    _finished_within(closer, "close")
    closed.set()
    _finished_within(generating, "the generate in flight")
    _finished_within(draining, "the drain in flight")
    assert "error" not in close_box
    assert isinstance(gen_box.get("error"), ClosedError), gen_box
    assert isinstance(drain_box.get("error"), ClosedError), drain_box
    assert engine.policy_version == 0  # the drain applied nothing
    assert not engine.scheduler.requests  # the generate's unfinished requests were aborted
    engine.close()  # idempotent


def test_close_during_a_step_waits_for_it_then_the_caller_gets_closed_error(qwen2, monkeypatch):
    engine = make_engine(qwen2.path)
    real_step, in_step, release = engine.stepper.launch, threading.Event(), threading.Event()

    def step(plan, staged=False):
        if not in_step.is_set():
            in_step.set()
            assert release.wait(WAIT)
        return real_step(plan, staged)

    monkeypatch.setattr(engine.stepper, "launch", step)
    generating, gen_box = _in_thread(lambda: engine.generate(PROMPTS, PARAMS), "generating")
    assert in_step.wait(WAIT)
    closer, close_box = _in_thread(engine.close, "closing")
    _until(lambda: engine._guard._pending, "close to wait for the guard")
    release.set()  # the step ends; close goes before the next one
    _finished_within(closer, "close")
    _finished_within(generating, "the generate in flight")
    assert "error" not in close_box
    assert isinstance(gen_box.get("error"), ClosedError), gen_box
    assert not engine.scheduler.requests


def test_every_call_after_close_raises_closed_error(qwen2):
    engine = make_engine(qwen2.path, max_batch_size=3)
    staged = engine.prepare_weights(qwen2.hf.state_dict())
    held = engine.generate_iter(PROMPTS, PARAMS)
    # Two groups of 2 do not fit a batch of 3: the second is still to generate after the first `next`.
    started = engine.generate_iter([[3, 4, 5], [6, 7, 8]], SamplingParams(n=2, max_tokens=8, seed=5))
    next(started)
    engine.close()
    engine.close()  # idempotent
    for call in (
        lambda: next(held),
        lambda: next(started),
        lambda: engine.generate(PROMPTS, PARAMS),
        lambda: engine.generate_iter(PROMPTS, PARAMS),
        lambda: engine.update_weights(qwen2.hf.state_dict()),
        lambda: engine.prepare_weights(qwen2.hf.state_dict()),
        lambda: engine.commit_weights(staged),
        lambda: engine.stats(),
    ):
        with pytest.raises(ClosedError, match="closed"):
            call()
    engine.discard_weights(staged)  # releasing a prepared update still works
    assert engine.policy_version == 0
    assert not engine.scheduler.requests


# -- a drain asked for by the thread that holds an unfinished iterator -------------------
def test_drain_from_a_thread_holding_an_unfinished_iterator_is_refused(qwen2):
    """The thread's iterator is suspended with a request in flight; a nested
    generate on the same thread runs to its end meanwhile. A drain asked for
    next would wait for requests only this thread advances: refused."""
    engine = make_engine(qwen2.path, max_batch_size=3)
    state_dict = qwen2.hf.state_dict()
    held = {}

    def holder():
        # Two groups of 2 do not fit a batch of 3: the second starts when the first finishes.
        it = held["it"] = engine.generate_iter([[3, 4, 5], [6, 7, 8]], SamplingParams(n=2, max_tokens=8, seed=5))
        first, _ = next(it)
        engine.generate([[9, 9]], SamplingParams(n=1, max_tokens=1, ignore_eos=True))
        with pytest.raises(RuntimeError, match="generate_iter") as refused:
            engine.update_weights(state_dict, inflight="drain")
        assert engine.policy_version == 0 and not engine.scheduler.draining
        rest = list(it)  # finishing the iteration lifts the refusal
        version = engine.update_weights(state_dict, inflight="drain")
        return first, rest, version, str(refused.value)

    thread, box = _in_thread(holder, "holder")
    try:
        _finished_within(thread, "the holder's drain")
    finally:
        if thread.is_alive() and "it" in held:
            held["it"].close()  # aborts the requests the drain waits on, so the thread ends
            thread.join(WAIT)
    assert "error" not in box, box.get("error")
    first, rest, version, message = box["result"]
    assert sorted([first] + [i for i, _ in rest]) == [0, 1] and version == 1
    assert "close" in message and "inflight" in message  # names what to do instead


def test_drain_right_after_next_on_the_same_thread_is_refused_and_close_lifts_it(qwen2):
    engine = make_engine(qwen2.path, max_batch_size=3)
    state_dict = qwen2.hf.state_dict()

    def holder():
        it = engine.generate_iter([[3, 4, 5], [6, 7, 8]], SamplingParams(n=2, max_tokens=8, seed=5))
        next(it)
        with pytest.raises(RuntimeError, match="generate_iter"):
            engine.update_weights(state_dict, inflight="drain")
        it.close()  # aborts the unfinished prompt
        return engine.update_weights(state_dict, inflight="drain")

    thread, box = _in_thread(holder, "holder")
    _finished_within(thread, "the holder's drain")
    assert box.get("result") == 1, box.get("error")
    assert not engine.scheduler.requests


def test_an_iterator_never_advanced_holds_nothing(qwen2):
    """Its requests join the engine at the first `next`: until then another
    caller's steps never start them, and a drain never waits on them."""
    engine = make_engine(qwen2.path)
    state_dict = qwen2.hf.state_dict()

    def holder():
        it = engine.generate_iter(PROMPTS, PARAMS)
        engine.generate([[9, 9]], SamplingParams(n=1, max_tokens=2, ignore_eos=True))
        version = engine.update_weights(state_dict, inflight="drain")
        outs = dict(it)
        return version, outs

    thread, box = _in_thread(holder, "holder")
    _finished_within(thread, "the drain")
    version, outs = box["result"]
    assert version == 1 and sorted(outs) == [0, 1]
    assert all(s.versions == [1] * len(s.token_ids) for o in outs.values() for s in o.samples)
    dropped = engine.generate_iter(PROMPTS, PARAMS)
    del dropped
    assert not engine.scheduler.requests


def test_drain_from_another_thread_while_one_generates_still_works(qwen2):
    step_two = threading.Event()

    def callback(info):
        step_two.set()

    engine = make_engine(qwen2.path, step_callback=callback)
    state_dict = qwen2.hf.state_dict()
    generating, gen_box = _in_thread(lambda: engine.generate(PROMPTS, PARAMS), "generating")
    assert step_two.wait(WAIT)
    draining, drain_box = _in_thread(lambda: engine.update_weights(state_dict, inflight="drain"), "draining")
    _finished_within(generating, "the generate")
    _finished_within(draining, "the drain")
    assert drain_box.get("result") == 1, drain_box.get("error")
    assert all(s.versions == [0] * 40 for o in gen_box["result"] for s in o.samples)
