"""Sampling parameters at their extremes, against the step: each value is refused
with a `ValueError`/`TypeError` at construction or submission, or sampled as its
meaning says, and never fails the step of another request batched with it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from rollout import SamplingParams
from rollout.sampling_params import LOGPROBS_MODES, MAX_SEED, MAX_TOP_LOGPROBS
from tests.conftest import make_engine

MAX_TEMPERATURE = float(np.finfo(np.float32).max)  # the largest temperature float32 holds
MIN_TOP_P = float(np.finfo(np.float32).smallest_subnormal)  # the least top_p float32 holds above 0

VOCAB = 96  # the test-tiny preset's
PROMPT = [5, 6, 7, 8]
MAX_SEQ_LEN = 12  # bounds every fuzzed generate to 8 tokens a sample
BATCH = 8
VALID = SamplingParams(n=2, temperature=0.8, top_k=20, max_tokens=5, seed=5, ignore_eos=True)


def _trace(output):
    return [(s.token_ids, s.logprobs, s.finish_reason) for s in output.samples]


def _engine(path, kernels="auto"):
    return make_engine(path, max_seq_len=MAX_SEQ_LEN, max_batch_size=BATCH, kv_cache_tokens=1024, kernels=kernels)


@pytest.fixture(scope="module")
def engine(qwen2):
    return _engine(qwen2.path)


@pytest.fixture(scope="module", params=["auto", "torch"])
def each_path_engine(request, qwen2, engine):
    """The engine on each sampler path: the compiled kernels where they build, and torch ops."""
    return engine if request.param == "auto" else _engine(qwen2.path, request.param)


def test_top_k_past_the_vocabulary_samples_as_off(each_path_engine):
    engine = each_path_engine
    off = SamplingParams(n=2, max_tokens=6, seed=4, ignore_eos=True)
    (expected,) = engine.generate([PROMPT], off)
    for top_k in (VOCAB, 2**63 - 1, 2**63, 10**30, np.uint64(2**64 - 1)):
        params = SamplingParams(n=2, max_tokens=6, seed=4, ignore_eos=True, top_k=top_k)
        (got,) = engine.generate([PROMPT], params)
        assert _trace(got) == _trace(expected), f"top_k={top_k}"


def test_float32_edges_sample_as_their_meaning(each_path_engine):
    def run(**kwargs):
        (out,) = each_path_engine.generate(
            [PROMPT], SamplingParams(n=2, max_tokens=6, seed=9, ignore_eos=True, **kwargs)
        )
        return out

    # The largest temperature flattens the distribution: every token has probability 1/vocab.
    for s in run(temperature=MAX_TEMPERATURE).samples:
        assert all(abs(lp + math.log(VOCAB)) < 1e-5 for lp in s.logprobs)
    # The least top_p keeps the most likely token alone: greedy tokens, each of processed logprob 0.
    greedy = run(temperature=0).samples[0].token_ids
    for s in run(top_p=MIN_TOP_P).samples:
        assert s.token_ids == greedy and s.logprobs == [0.0] * len(greedy)
    # A min_p past float32's range is 0 there, off; a subnormal one drops none of these tokens.
    off = _trace(run())
    assert _trace(run(min_p=1e-46)) == off and _trace(run(min_p=5e-324)) == off
    _assert_close(_trace(run(min_p=1e-40)), off)


# -- the fuzz ----------------------------------------------------------------------------
HUGE_INTS = [2**31, 2**63 - 1, 2**63, 2**64, 10**30]
EDGE_INTS = [-1, -(2**63), BATCH + 1, VOCAB, MAX_SEED + 1, MAX_TOP_LOGPROBS + 1, *HUGE_INTS]
EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-46, 1e-45, MIN_TOP_P, 1e-40, 1e-38, 9.99e-7, 1e-6, 0.5, 1.0, 1 - 1e-12]
EDGE_FLOATS += [1 + 1e-12, 3.4e38, MAX_TEMPERATURE, 3.403e38, 1e39, 1e308, math.inf, -math.inf, math.nan]
NUMPY = [np.bool_(True), np.int64(7), np.uint64(2**64 - 1), np.int8(-1), np.float32(0.5), np.float32(1e-40)]
NUMPY += [np.float64(1e39), np.longdouble(1e-46), torch.tensor(0.5), torch.tensor([3, 4])]

# Any value of any kind, for one field at a time.
ANYTHING = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from(EDGE_INTS),
    st.floats(),
    st.sampled_from(EDGE_FLOATS),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.lists(st.integers(-3, 2 * VOCAB), max_size=3),
    st.sampled_from(NUMPY),
)

# Per field: accepted values up to its edges, so that most examples reach the step
# (ANYTHING brings the values past them).
ACCEPTED = {
    "n": st.integers(1, 3) | st.just(BATCH),
    "temperature": st.sampled_from([0, 1e-6, 0.7, 1, 2.5, 1e10, 3.4e38, MAX_TEMPERATURE]) | st.floats(1e-6, 50),
    "top_k": st.integers(0, 2 * VOCAB) | st.sampled_from(HUGE_INTS),
    "top_p": st.sampled_from([1.0, 1 - 1e-12, 0.9, 1e-3, 1e-30, 1e-40, MIN_TOP_P]) | st.floats(MIN_TOP_P, 1),
    "min_p": st.sampled_from([0.0, 5e-324, 1e-46, 1e-40, 1e-38, 0.01, 0.5, 1.0]) | st.floats(0, 1),
    "max_tokens": st.integers(1, 4) | st.sampled_from([2**63, 10**30]),
    "stop_token_ids": st.none() | st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "seed": st.none() | st.integers(0, MAX_SEED) | st.just(MAX_SEED),
    "logprobs_mode": st.sampled_from(LOGPROBS_MODES),
    "top_logprobs": st.integers(0, MAX_TOP_LOGPROBS),
}
FIELDS = sorted(ACCEPTED) + ["stop"]


@st.composite
def _fields(draw) -> dict:
    fields = draw(st.fixed_dictionaries({}, optional=ACCEPTED))
    if draw(st.integers(0, 2)) == 0:  # a third of the examples: one field of any kind
        fields[draw(st.sampled_from(FIELDS))] = draw(ANYTHING)
    return fields


@pytest.fixture(scope="module")
def valid_alone(engine):
    (out,) = engine.generate([PROMPT], VALID)
    return _trace(out)


@settings(max_examples=100, deadline=None)
@given(fields=_fields())
@example(fields={"top_k": 2**63})
@example(fields={"temperature": 3.403e38})  # inf in float32
@example(fields={"temperature": 1e39})
@example(fields={"top_p": 1e-46})  # 0 in float32
@example(fields={"min_p": 1e-46, "top_p": MIN_TOP_P, "temperature": MAX_TEMPERATURE, "top_k": 10**30})
def test_any_sampling_value_is_refused_or_sampled_beside_a_valid_request(engine, valid_alone, fields):
    try:
        params = SamplingParams(**fields)
    except (TypeError, ValueError):
        event("refused on construction")
        return
    valid, fuzzed = _beside_valid(engine, params)
    event("refused on submission" if isinstance(fuzzed, Exception) else "sampled")
    for _ in valid:
        pass
    _assert_close(_trace(valid.output), valid_alone)
    if not isinstance(fuzzed, Exception):
        for _ in fuzzed:
            pass
        _assert_well_formed(fuzzed.output, params)
    assert not engine.scheduler.requests and engine.stats()["kv_pages_used"] == 0


def _beside_valid(engine, params):
    """Streams of VALID and of `params` (or the error refusing it) sharing steps: the
    background driver cannot take the guard, so it adds VALID's request, at least,
    when both are submitted; VALID's is still running when the other joins."""
    with engine._guard.held():
        valid = engine.stream(PROMPT, VALID)
        try:
            return valid, engine.stream([9, 10, 11, 12], params)
        except (TypeError, ValueError) as e:
            return valid, e


def _assert_close(got, expected):
    assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in expected]
    for (_, la, _), (_, lb, _) in zip(got, expected, strict=True):
        assert max(abs(a - b) for a, b in zip(la, lb, strict=True)) < 1e-5


def _assert_well_formed(output, params):
    assert len(output.samples) == params.n
    longest = min(params.max_tokens, MAX_SEQ_LEN - len(PROMPT))
    for s in output.samples:
        assert 1 <= len(s.token_ids) <= longest and all(0 <= t < VOCAB for t in s.token_ids)
        assert len(s.logprobs) == len(s.token_ids) and all(-math.inf < lp <= 1e-6 for lp in s.logprobs)
        assert s.finish_reason in ("stop", "length")
        if params.top_logprobs:
            for alternatives in s.top_logprobs:
                assert len(alternatives) == params.top_logprobs
                assert all(0 <= t < VOCAB and not math.isnan(lp) and lp <= 1e-6 for t, lp in alternatives)
