"""Abort on the in-process engine: `generate_iter(...).abort()` and
`Session.abort()` end unfinished samples at once with finish_reason "abort",
keeping exactly the tokens sampled so far (logprobs checked against
transformers), freeing their KV, and leaving other callers' requests alone."""

from __future__ import annotations

import threading

import torch

from rollout import SamplingParams
from tests.conftest import make_engine
from tests.factories import hf_logprobs

PROMPTS = [list(range(3, 20)), list(range(30, 41))]
LONG = SamplingParams(n=2, max_tokens=200, ignore_eos=True, seed=3, logprobs_mode="raw")


class AfterSteps:
    """A step callback that sets `reached` once `steps` steps ran after `armed`."""

    def __init__(self, steps: int) -> None:
        self.steps, self.count, self.armed, self.reached = steps, 0, False, threading.Event()
        self.resume = threading.Event()

    def __call__(self, info) -> None:
        if self.armed:
            self.count += 1
            if self.count == self.steps:
                self.reached.set()
                assert self.resume.wait(60)  # hold the stepping thread until the test aborted


def _assert_exact(hf, out) -> None:
    for s in out.samples:
        ref = hf_logprobs(hf, out.prompt_token_ids, s.token_ids)
        assert torch.allclose(torch.tensor(s.logprobs, dtype=torch.float64), ref, atol=1e-4)


def test_generation_abort_keeps_what_was_sampled_and_spares_other_callers(qwen2):
    gate = AfterSteps(5)
    engine = make_engine(qwen2.path, step_callback=gate)
    other: dict = {}
    gate.armed = True
    generation = engine.generate_iter(PROMPTS, LONG)
    first = threading.Thread(target=lambda: other.setdefault("iter", list(generation)))
    first.start()
    assert gate.reached.wait(60)
    generation.abort()  # from another thread, while the stepping thread waits in its callback
    gate.resume.set()
    first.join(60)
    outs = [out for _, out in sorted(other["iter"], key=lambda p: p[0])]
    for out in outs:
        assert all(s.finish_reason == "abort" and 0 < len(s.token_ids) < 200 for s in out.samples)
        assert all(len(s.token_ids) == len(s.logprobs) == len(s.versions) for s in out.samples)
        _assert_exact(qwen2.hf, out)
    assert engine.stats()["kv_pages_used"] == 0
    # The engine goes on: a later call runs to its end.
    gate.armed = False
    (later,) = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert later.samples[0].finish_reason == "length"


def test_abort_before_the_first_next_ends_every_sample_empty(qwen2):
    engine = make_engine(qwen2.path)
    generation = engine.generate_iter(PROMPTS, LONG)
    generation.abort()
    outs = dict(generation)
    assert all(s.finish_reason == "abort" and s.token_ids == [] for o in outs.values() for s in o.samples)
    assert engine.stats()["computed_tokens"] == 0


def test_session_abort_ends_the_turn_and_the_session_goes_on(qwen2):
    gate = AfterSteps(4)
    engine = make_engine(qwen2.path, step_callback=gate)
    sess = engine.session(PROMPTS[0])
    result: dict = {}
    gate.armed = True
    worker = threading.Thread(
        target=lambda: result.setdefault("turn", sess.generate(SamplingParams(max_tokens=200, ignore_eos=True)))
    )
    worker.start()
    assert gate.reached.wait(60)
    sess.abort()
    gate.resume.set()
    worker.join(60)
    gate.armed = False
    turn = result["turn"]
    assert turn.finish_reason == "abort" and 0 < len(turn.token_ids) < 200
    assert sess.token_ids == PROMPTS[0] + turn.token_ids and sum(sess.loss_mask) == len(turn.token_ids)
    sess.append([5, 6])
    nxt = sess.generate(SamplingParams(max_tokens=3, ignore_eos=True, logprobs_mode="raw"))
    assert nxt.finish_reason == "length"
    sess.abort()  # between turns: nothing to end
    sess.close()
    assert engine.stats()["kv_pages_used"] == 0


def test_a_session_abort_while_the_turn_is_being_started_ends_that_turn(qwen2, monkeypatch):
    """An abort that lands before the engine has made the turn's request (here:
    while its request is built) is kept and ends the turn once it exists."""
    engine = make_engine(qwen2.path)
    sess = engine.session(PROMPTS[0])
    first = sess.generate(SamplingParams(max_tokens=2, ignore_eos=True))
    make = engine._requests

    def abort_then_make(*args, **kwargs):
        sess.abort()
        return make(*args, **kwargs)

    monkeypatch.setattr(engine, "_requests", abort_then_make)
    turn = sess.generate(SamplingParams(max_tokens=200, ignore_eos=True))
    monkeypatch.undo()
    assert first.finish_reason == "length"
    assert turn.finish_reason == "abort" and len(turn.token_ids) < 200
    later = sess.generate(SamplingParams(max_tokens=3, ignore_eos=True))  # the abort is spent: later turns run
    assert later.finish_reason == "length" and len(later.token_ids) == 3
    sess.close()
