"""`Engine.stream`: a prompt's samples token by token, in sync and async
code; the deltas concatenate to what `generate` returns for the same seed,
and, honouring `restarted`, to the final output across `restart` commits;
cancel aborts and frees the KV."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout import RolloutOutput, SamplingParams
from rollout.engine.streams import SampleDelta, StreamCursor
from tests.conftest import make_engine

PARAMS = SamplingParams(n=3, max_tokens=12, ignore_eos=True, seed=5)
PROMPT = list(range(3, 20))


def _collect(items) -> tuple[dict, list, RolloutOutput]:
    tokens: dict[int, list] = {0: [], 1: [], 2: []}
    ends, output = [], None
    for item in items:
        if isinstance(item, SampleDelta):
            assert not item.restarted and len(item.token_ids) == len(item.logprobs) == len(item.versions)
            tokens[item.index] += item.token_ids
            if item.finish_reason is not None:
                ends.append(item.index)
        else:
            output = item
    return tokens, ends, output


def test_stream_deltas_concatenate_to_the_generated_samples(qwen2):
    engine = make_engine(qwen2.path)
    (reference,) = engine.generate([PROMPT], PARAMS)
    stream = engine.stream(PROMPT, PARAMS)
    items = list(stream)
    tokens, ends, output = _collect(items)
    assert sorted(ends) == [0, 1, 2] and stream.output is output
    assert [tokens[k] for k in range(3)] == [s.token_ids for s in reference.samples]
    for got, ref in zip(output.samples, reference.samples, strict=True):  # packed and plain weights: float rounding
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    # Token by token: a delta per sample per decode step, not one at the end.
    assert sum(isinstance(i, SampleDelta) for i in items) >= 3 * 10


def test_async_stream_and_cancel(qwen2):
    engine = make_engine(qwen2.path)
    (reference,) = engine.generate([PROMPT], PARAMS)

    async def main():
        items = [item async for item in engine.stream(PROMPT, PARAMS)]
        stream = engine.stream(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True))
        async for item in stream:
            assert isinstance(item, SampleDelta)
            stream.cancel()
            break
        with pytest.raises(asyncio.CancelledError):
            async for _ in stream:
                pass
        return items

    tokens, _, _ = _collect(asyncio.run(main()))
    assert [tokens[k] for k in range(3)] == [s.token_ids for s in reference.samples]
    for _ in range(100):  # the driver aborts a cancelled request at its next step
        if engine.stats()["kv_pages_used"] == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert engine.stats()["kv_pages_used"] == 0


def test_a_stream_checks_its_arguments(qwen2):
    engine = make_engine(qwen2.path)
    with pytest.raises(TypeError, match="params"):
        engine.stream(PROMPT, {"n": 2})
    with pytest.raises(ValueError, match="vocabulary"):
        engine.stream([1, 2, 10**6], PARAMS)
    with pytest.raises(TypeError, match="async for"):
        asyncio.run(_iterate_sync(engine))


async def _iterate_sync(engine):
    stream = engine.stream(PROMPT, PARAMS)
    try:
        list(stream)
    finally:
        stream.cancel()


# -- restart commits ---------------------------------------------------------------------
# The background driver's two halves, stepping and reading a stream's cursor, run
# here by hand in a chosen order, with `restart` commits between them: a stream
# read after every step of its own may still see another caller's steps first.

RESTART_PARAMS = SamplingParams(n=2, max_tokens=5, ignore_eos=True, seed=5)


class _Stepped:
    """One request stepped by hand; its cursor's deltas are read when the test says,
    and applied as a client would: a `restarted` delta replaces what came before."""

    def __init__(self, engine, checkpoint) -> None:
        self.engine, self.norm = engine, checkpoint.hf.state_dict()["model.norm.weight"]
        (self.request,) = engine._requests([PROMPT], RESTART_PARAMS)
        with engine._guard.held():
            engine.scheduler.add(self.request)
        self.cursor = StreamCursor(self.request)
        self.received = [([], [], []) for _ in range(RESTART_PARAMS.n)]

    def step(self) -> None:
        if not self.request.is_finished:
            self.engine._one_step({0: self.request})

    def observe(self) -> None:
        with self.engine._guard.held():
            deltas = self.cursor.deltas()
        for d in deltas:
            for got, new in zip(self.received[d.index], (d.token_ids, d.logprobs, d.versions), strict=True):
                if d.restarted:
                    got.clear()
                got += new

    def restart(self) -> None:
        """Commit other weights (each push scales the final norm anew), starting in-flight samples over."""
        scale = 1.0 + 0.5 * (self.engine.policy_version + 1)
        self.engine.update_weights({"model.norm.weight": self.norm * scale}, inflight="restart")

    def finish_and_check(self) -> None:
        while not self.request.is_finished:
            self.step()
            self.observe()
        self.observe()
        final = self.request.result().samples
        assert self.received == [(list(s.token_ids), list(s.logprobs), list(s.versions)) for s in final]
        assert all(len(s.token_ids) == RESTART_PARAMS.max_tokens for s in final)


@pytest.fixture(scope="module")
def restart_engine(qwen2):
    engine = make_engine(qwen2.path)
    yield engine
    engine.close()


def test_a_restart_right_after_the_first_token_is_flagged(qwen2, restart_engine):
    run = _Stepped(restart_engine, qwen2)
    run.step()
    run.observe()
    assert [len(ids) for ids, _, _ in run.received] == [1, 1]
    run.restart()
    run.step()  # the re-prefill samples one token again: as many as were sent
    run.observe()
    assert [v for _, _, v in run.received] == [[restart_engine.policy_version]] * 2  # the stale token retracted
    run.finish_and_check()


def test_a_restart_seen_only_after_further_steps_is_flagged(qwen2, restart_engine):
    run = _Stepped(restart_engine, qwen2)
    for _ in range(3):
        run.step()
    run.observe()
    run.restart()
    for _ in range(4):  # other callers' steps: the new output outgrows what was sent before it is read
        run.step()
    run.observe()
    assert all(v == [restart_engine.policy_version] * 4 for _, _, v in run.received)
    run.finish_and_check()


# A round: some steps, then maybe a read of the stream, then maybe a restart commit.
_ROUNDS = st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), min_size=1, max_size=5)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(_ROUNDS)
def test_deltas_concatenate_to_the_output_across_any_interleaving_of_restarts(qwen2, restart_engine, rounds):
    run = _Stepped(restart_engine, qwen2)
    for steps, observe, restart in rounds:
        for _ in range(steps):
            run.step()
        if observe:
            run.observe()
        if restart:
            run.restart()
    run.finish_and_check()
