"""numpy scalars and integer arrays (and torch integer tensors) are accepted
wherever ints, floats and token lists are, become plain Python values at the
boundary, and sample exactly what the plain-Python call samples."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rollout import SamplingParams
from rollout.engine.requests import PromptLimits, validate_prompts
from tests.conftest import make_engine

PROMPT = [5, 6, 7, 8]
BASE = dict(n=2, max_tokens=6, seed=3, ignore_eos=True)


def _plain(value) -> bool:
    if isinstance(value, list):
        return all(type(t) is int for t in value)
    return value is None or type(value) in (int, float, bool, str)


@pytest.fixture(scope="module")
def engine(qwen2):
    return make_engine(qwen2.path)


@pytest.mark.parametrize(
    "field,value,plain",
    [
        ("n", np.int64(2), 2),
        ("n", np.uint8(3), 3),
        ("temperature", np.float32(0.7), 0.7),
        ("temperature", np.int64(1), 1),
        ("top_k", np.int32(5), 5),
        ("top_p", np.float64(0.9), 0.9),
        ("min_p", np.float16(0.125), 0.125),
        ("max_tokens", np.int16(5), 5),
        ("seed", np.uint64(7), 7),
        ("stop_token_ids", np.array([3, 4]), [3, 4]),
        ("stop_token_ids", np.array([3, 4], dtype=np.uint16), [3, 4]),
        ("stop_token_ids", torch.tensor([3, 4]), [3, 4]),
        ("stop_token_ids", torch.tensor([3, 4], dtype=torch.int32), [3, 4]),
        ("stop_token_ids", [np.int64(3), 4], [3, 4]),
    ],
)
def test_sampling_params_take_numpy_and_sample_as_plain_python(engine, field, value, plain):
    params = SamplingParams(**{**BASE, field: value})
    expected = SamplingParams(**{**BASE, field: plain})
    for f in dataclasses.fields(SamplingParams):
        assert _plain(getattr(params, f.name)), f.name
    assert getattr(params, field) == pytest.approx(plain, rel=1e-7)
    assert engine.generate([PROMPT], params) == engine.generate([PROMPT], expected)


@pytest.mark.parametrize(
    "prompts",
    [
        [np.array(PROMPT)],
        [np.array(PROMPT, dtype=np.int32)],
        [np.array(PROMPT, dtype=np.uint8)],
        [torch.tensor(PROMPT)],
        [torch.tensor(PROMPT, dtype=torch.int32)],
        [[np.int64(t) for t in PROMPT]],
        (tuple(PROMPT),),
        list(np.array([PROMPT])),  # the rows of a 2-D array, made explicit
    ],
    ids=["np-int64", "np-int32", "np-uint8", "torch-int64", "torch-int32", "list-of-np", "tuple", "rows"],
)
def test_prompts_take_arrays_and_sample_as_plain_python(engine, prompts):
    params = SamplingParams(**BASE)
    [out] = engine.generate(prompts, params)
    assert out == engine.generate([PROMPT], params)[0]
    assert _plain(out.prompt_token_ids)


def test_prompt_batch_validated_for_the_cluster_is_plain():
    limits = PromptLimits(vocab_size=100, max_seq_len=64, max_batch_size=4, page_size=16, num_pages=8)
    prompts = [np.array([5, 6]), torch.tensor([7]), [np.int32(8)]]
    token_lists, texts = validate_prompts(prompts, SamplingParams(n=np.int64(2)), limits, None)
    assert token_lists == [[5, 6], [7], [8]] and texts == [None] * 3
    assert all(_plain(ids) for ids in token_lists)


def test_engine_sizes_take_numpy_ints(qwen2):
    sizes = dict(max_batch_size=8, max_seq_len=128, kv_cache_tokens=512, seed=5, page_size=8, max_step_tokens=64)
    plain = make_engine(qwen2.path, **sizes)
    numpy_engine = make_engine(qwen2.path, **{k: np.int64(v) for k, v in sizes.items()})
    assert plain.config == numpy_engine.config
    assert all(type(getattr(numpy_engine.config, f)) is int for f in sizes)
    params = SamplingParams(n=2, max_tokens=6, ignore_eos=True)  # unseeded: the engine's seed draws
    assert numpy_engine.generate([PROMPT], params) == plain.generate([PROMPT], params)
