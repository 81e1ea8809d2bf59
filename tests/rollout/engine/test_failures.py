"""Failures inside generate surface to the caller with their cause and leave
the engine consistent: nothing half-applied, later calls serve exactly."""

from __future__ import annotations

import threading

import pytest

from rollout import SamplingParams
from rollout.engine import stepper as stepper_module
from tests.conftest import make_engine
from tests.factories import fail_launch

PROMPTS = [list(range(3, 30)), [5, 6, 7]]
PARAMS = SamplingParams(n=3, max_tokens=16, ignore_eos=True, seed=8)


def _snapshot(outs):
    return [[(s.token_ids, s.logprobs, s.finish_reason) for s in o.samples] for o in outs]


def _assert_same(got, expected):
    """Same tokens and finish reasons; logprobs equal up to recompute noise."""
    assert [[(t, r) for t, _, r in o] for o in got] == [[(t, r) for t, _, r in o] for o in expected]
    for o, e in zip(got, expected, strict=True):
        for (_, lp, _), (_, elp, _) in zip(o, e, strict=True):
            assert max(abs(a - b) for a, b in zip(lp, elp, strict=True)) < 1e-5


def test_failing_step_surfaces_and_engine_recovers(qwen2, monkeypatch):
    engine = make_engine(qwen2.path)
    expected = _snapshot(engine.generate(PROMPTS, PARAMS))
    fail_launch(engine, monkeypatch, at=3)
    with pytest.raises(RuntimeError, match="device fell over"):
        engine.generate(PROMPTS, PARAMS)
    assert engine.stats()["kv_pages_used"] == 0 and not engine.scheduler.requests
    assert _snapshot(engine.generate(PROMPTS, PARAMS)) == expected


def test_a_step_every_request_fails_alone_is_the_steps_error_not_theirs(qwen2, monkeypatch):
    """A device that fails whatever it runs: each request's share fails alone
    too, but no request is to blame, so the step's own error propagates."""
    engine = make_engine(qwen2.path)
    calls = {"n": 0}

    def broken(plan, staged=False):
        calls["n"] += 1
        raise RuntimeError(f"device fell over (step call {calls['n']})")

    monkeypatch.setattr(engine.stepper, "launch", broken)
    with pytest.raises(RuntimeError, match=r"\(step call 1\)"):
        engine.generate(PROMPTS, PARAMS)
    assert calls["n"] == 3  # the step, then each of the two requests' shares alone
    assert not engine._failures._errors and not engine.scheduler.requests  # nothing pinned on a request
    monkeypatch.undo()
    assert engine.stats()["kv_pages_used"] == 0


def test_failure_of_one_caller_leaves_the_other_callers_exact(qwen2, monkeypatch):
    engine = make_engine(qwen2.path)
    expected = _snapshot(engine.generate(PROMPTS, PARAMS))
    real_step = engine.stepper.launch
    other_started, fail_now = threading.Event(), threading.Event()
    results = {}

    def step(plan, staged=False):
        if fail_now.is_set() and threading.current_thread().name == "failing":
            fail_now.clear()
            raise RuntimeError("injected")
        return real_step(plan, staged)

    monkeypatch.setattr(engine.stepper, "launch", step)

    def failing():
        other_started.wait(30)
        fail_now.set()
        with pytest.raises(RuntimeError, match="injected"):
            engine.generate([[9, 9, 9, 9, 9]], SamplingParams(n=4, max_tokens=40, ignore_eos=True))
        results["failed"] = True

    def healthy():
        results["out"] = engine.generate(PROMPTS, PARAMS)

    engine._step_callback = lambda info: other_started.set()
    threads = [threading.Thread(target=failing, name="failing"), threading.Thread(target=healthy, name="healthy")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["failed"]
    _assert_same(_snapshot(results["out"]), expected)  # recomputed where the failed step had touched KV
    assert engine.stats()["kv_pages_used"] == 0


POISON_SEED = 666  # a request with this seed makes any step holding its rows raise
POISONED = SamplingParams(max_tokens=4, seed=POISON_SEED)
REJECTED = r"top_p\[\d+\] = 0 must be in \(0, 1\]"


def _poison_rows(monkeypatch, failing: threading.Event | None = None) -> list[list[int]]:
    """Make the sampler reject any batch holding a row of seed POISON_SEED, as the
    compiled sampler rejects a row's bad value (setting `failing`); returns the
    seeds of each batch it failed."""
    real, failed = stepper_module.sample, []

    def sample(logits, batch, *args, **kwargs):
        seeds = batch.seed.tolist()
        if POISON_SEED in seeds:
            failed.append(seeds)
            if failing is not None:
                failing.set()
            raise RuntimeError(f"top_p[{seeds.index(POISON_SEED)}] = 0 must be in (0, 1]")
        return real(logits, batch, *args, **kwargs)

    monkeypatch.setattr(stepper_module, "sample", sample)
    return failed


def test_rows_that_fail_a_step_fail_only_their_request(qwen2, monkeypatch):
    """The healthy caller's thread runs the step the poisoned rows fail: its requests
    go on exactly as alone; only the poisoned caller hears of the error."""
    engine = make_engine(qwen2.path)
    alone = _snapshot(engine.generate(PROMPTS, PARAMS))
    joined, step_failed, results = threading.Event(), threading.Event(), {}
    failed = _poison_rows(monkeypatch, step_failed)
    real_open = engine._iterators.open

    def open_then_wait(requests):  # the poisoned caller's requests are in; it waits to step
        if threading.current_thread().name == "poisoned":
            joined.set()
            step_failed.wait(30)
        return real_open(requests)

    def after_first_step(info):  # the healthy caller's next step will hold the poisoned rows
        engine._step_callback = None
        joined.wait(30)

    monkeypatch.setattr(engine._iterators, "open", open_then_wait)
    engine._step_callback = after_first_step

    def poisoned():
        with pytest.raises(RuntimeError, match=REJECTED):
            engine.generate([[9, 9, 9, 9, 9]], POISONED)
        results["failed"] = True

    def healthy():
        results["out"] = engine.generate(PROMPTS, PARAMS)

    threads = [threading.Thread(target=healthy, name="healthy"), threading.Thread(target=poisoned, name="poisoned")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert any(PARAMS.seed in seeds for seeds in failed), "the failing step held the healthy rows too"
    assert results["failed"]
    _assert_same(_snapshot(results["out"]), alone)
    assert not engine.scheduler.requests and engine.stats()["kv_pages_used"] == 0


def test_background_driver_fails_only_the_request_whose_rows_fail_the_step(qwen2, monkeypatch):
    engine = make_engine(qwen2.path)
    (alone,) = _snapshot(engine.generate(PROMPTS[:1], PARAMS))
    failed = _poison_rows(monkeypatch)
    submitted = threading.Event()

    def after_first_step(info):  # the driver's next step holds both requests' rows
        engine._step_callback = None
        submitted.wait(30)

    engine._step_callback = after_first_step
    healthy = engine.stream(PROMPTS[0], PARAMS)
    poisoned = engine.stream([9, 9, 9, 9, 9], POISONED)
    submitted.set()
    with pytest.raises(RuntimeError, match=REJECTED):
        list(poisoned)
    list(healthy)
    assert any(PARAMS.seed in seeds for seeds in failed), "the failing step held the healthy rows too"
    _assert_same(_snapshot([healthy.output]), [alone])
    assert not engine.scheduler.requests and engine.stats()["kv_pages_used"] == 0
    _assert_same(_snapshot(engine.generate(PROMPTS[:1], PARAMS)), [alone])  # nothing the failed step touched lingers


def test_callback_error_aborts_only_that_call(qwen2):
    state = {"raise": True}

    def callback(info):
        if state["raise"]:
            state["raise"] = False
            raise KeyError("from the callback")

    engine = make_engine(qwen2.path, step_callback=callback)
    with pytest.raises(KeyError, match="from the callback"):
        engine.generate(PROMPTS, PARAMS)
    assert not engine.scheduler.requests and engine.stats()["kv_pages_used"] == 0
    assert _snapshot(engine.generate(PROMPTS, PARAMS)) == _snapshot(make_engine(qwen2.path).generate(PROMPTS, PARAMS))


def test_closed_engine_refuses_calls(qwen2):
    engine = make_engine(qwen2.path)
    engine.close()
    with pytest.raises(ValueError, match="closed"):
        engine.generate(PROMPTS, PARAMS)
    with pytest.raises(ValueError, match="closed"):
        engine.update_weights(qwen2.hf.state_dict())
    with pytest.raises(RuntimeError, match="closed"):  # also a RuntimeError
        engine.prepare_weights(qwen2.hf.state_dict())
