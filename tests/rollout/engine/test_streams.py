"""`Engine.stream`: a prompt's samples token by token, in sync and async
code; the deltas concatenate to what `generate` returns for the same seed;
cancel aborts and frees the KV."""

from __future__ import annotations

import asyncio

import pytest

from rollout import RolloutOutput, SamplingParams
from rollout.engine.streams import SampleDelta
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
