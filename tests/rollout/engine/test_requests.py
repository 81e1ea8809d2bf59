"""Bad prompts and sampling parameters: a clear error before anything changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout import SamplingParams
from tests.conftest import make_engine

GOOD = [[5, 6, 7, 8]]
PARAMS = SamplingParams(n=2, max_tokens=12, seed=3, ignore_eos=True)


@pytest.mark.parametrize(
    "kwargs,error,needle",
    [
        (dict(n=0), ValueError, "n must be"),
        (dict(n=True), TypeError, "n must be"),
        (dict(temperature=-0.5), ValueError, "temperature"),
        (dict(temperature=1e-40), ValueError, r"temperature must be 0 \(greedy\) or a finite number >= 1e-06"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature="hot"), TypeError, "temperature"),
        # The step holds the floats as float32: a value the cast makes inf or 0 is refused here.
        (
            dict(temperature=1e39),
            ValueError,
            r"temperature must be .* <= 3.4028234663852886e\+38 \(the largest float32",
        ),
        (dict(temperature=3.403e38), ValueError, "temperature"),  # finite in float64, inf in float32
        (dict(temperature=10**400), ValueError, "temperature"),  # past float64's range too
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(top_k=-1), ValueError, "top_k"),
        (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_p=1e-46), ValueError, r"top_p must be in \(0, 1\] and >= 1.401298464324817e-45"),
        (dict(top_p=np.float32(1e-46)), ValueError, "top_p"),  # 0 already
        (dict(top_p=10**400), ValueError, "top_p"),
        (dict(min_p=-0.1), ValueError, "min_p"),
        (dict(min_p=10**400), ValueError, "min_p"),
        (dict(max_tokens=0), ValueError, "max_tokens"),
        (dict(max_tokens=-3), ValueError, "max_tokens"),
        (dict(max_tokens=8.0), TypeError, "max_tokens"),
        (dict(logprobs_mode="log"), ValueError, "logprobs_mode"),
        (dict(stop_token_ids=[1, "2"]), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids"),
        (dict(stop_token_ids=5), TypeError, "stop_token_ids"),
        (dict(stop=[""]), ValueError, "stop"),
        (dict(stop=[3]), TypeError, "stop"),
        (dict(seed=-2), ValueError, "seed"),
        (dict(seed=2**64), ValueError, "seed"),
        (dict(ignore_eos="yes"), TypeError, "ignore_eos"),
        # numpy and torch forms are held to the same rules
        (dict(n=np.bool_(True)), TypeError, "n must be"),
        (dict(n=np.float64(2.0)), TypeError, "n must be"),
        (dict(max_tokens=np.float32(8)), TypeError, "max_tokens"),
        (dict(top_k=np.int8(-1)), ValueError, "top_k"),
        (dict(temperature=np.bool_(True)), TypeError, "temperature"),
        (dict(temperature=np.float32("nan")), ValueError, "temperature"),
        (dict(top_p=np.float32(1.5)), ValueError, "top_p"),
        (dict(min_p=np.float64(-0.1)), ValueError, "min_p"),
        (dict(seed=np.uint64(2**64 - 1)), ValueError, "seed"),
        (dict(seed=np.float64(3)), TypeError, "seed"),
        (dict(stop_token_ids=np.array([1.0, 2.0])), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=torch.tensor([1.5])), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=np.array([True])), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=torch.tensor([True])), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=[np.bool_(True)]), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=np.array([[1, 2]])), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=np.int64(5)), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=np.array([-1])), ValueError, "stop_token_ids"),
    ],
)
def test_sampling_params_validate_themselves(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        SamplingParams(**kwargs)


def test_fields_set_after_construction_are_checked_at_submission(qwen2):
    engine = make_engine(qwen2.path)
    params = SamplingParams(max_tokens=4)
    params.top_p = 1e-46  # an attribute write skips the checks of construction; 0 in float32
    with pytest.raises(ValueError, match="top_p must be in"):
        engine.generate(GOOD, params)
    assert not engine.scheduler.requests and engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize(
    "prompts,params,error,needle",
    [
        ("just a string", PARAMS, TypeError, "prompts must be a list"),
        ([[]], PARAMS, ValueError, r"prompts\[0\] is empty"),
        ([[5, 96]], PARAMS, ValueError, r"token id 96, outside the vocabulary \[0, 96\)"),
        ([[5, -1]], PARAMS, ValueError, "token id -1"),
        ([[5, 2.0]], PARAMS, TypeError, "int token ids"),
        ([[5, True]], PARAMS, TypeError, "int token ids"),
        ([[5, 6], "text"], PARAMS, TypeError, "mix"),
        (["text"], PARAMS, ValueError, "no tokenizer"),
        ([list(range(1, 65)) * 4], PARAMS, ValueError, "max_seq_len is 256"),
        (GOOD, SamplingParams(stop_token_ids=[500]), ValueError, "stop_token_ids has 500"),
        (GOOD, SamplingParams(stop=["x"]), ValueError, "stop strings need a tokenizer"),
        (GOOD, SamplingParams(n=64), ValueError, "max_batch_size"),
        (GOOD, {"n": 2}, TypeError, "SamplingParams"),
        ([np.array([5.0, 6.0])], PARAMS, TypeError, r"prompts\[0\] must hold int token ids, got an array of dtype"),
        ([torch.tensor([5.0])], PARAMS, TypeError, r"prompts\[0\] must hold int token ids"),
        ([np.array([True, False])], PARAMS, TypeError, r"prompts\[0\] must hold int token ids"),
        ([np.array([[5, 6]])], PARAMS, TypeError, r"prompts\[0\] must be a 1-D sequence"),
        ([torch.tensor([[5, 6]])], PARAMS, TypeError, r"prompts\[0\] must be a 1-D sequence"),
        ([[5, np.bool_(True)]], PARAMS, TypeError, "int token ids"),
        ([[5, np.float64(6.0)]], PARAMS, TypeError, "int token ids"),
        ([np.array([5, 96])], PARAMS, ValueError, "token id 96"),
        ([np.array([], dtype=np.int64)], PARAMS, ValueError, r"prompts\[0\] is empty"),
        ([np.array([5, 6]), "text"], PARAMS, TypeError, "mix"),
        # An array is never the batch itself (see `_prompt_list`).
        (np.array([5, 6]), PARAMS, TypeError, r"got a 1-D array; pass \[array\]"),
        (np.array([[5, 6]]), PARAMS, TypeError, r"got a 2-D array; pass list\(array\)"),
        (torch.tensor([[5, 6]]), PARAMS, TypeError, "got a 2-D array"),
    ],
)
def test_bad_prompts_change_nothing(qwen2, prompts, params, error, needle):
    engine = make_engine(qwen2.path)
    before = engine.generate(GOOD, PARAMS)
    with pytest.raises(error, match=needle):
        engine.generate(prompts, params)
    assert engine.generate(GOOD, PARAMS) == before
    assert engine.stats()["kv_pages_used"] == 0 and not engine.scheduler.requests


@pytest.mark.parametrize(
    "kwargs,error,needle",
    [
        (dict(max_batch_size=np.float64(8)), TypeError, "max_batch_size"),
        (dict(page_size=np.bool_(True)), TypeError, "page_size"),
        (dict(kv_cache_tokens=np.float32(64)), TypeError, "kv_cache_tokens"),
        (dict(seed=np.int64(-1)), ValueError, "seed"),
        (dict(seed=True), TypeError, "seed"),
        (dict(max_seq_len=np.int64(1)), ValueError, "max_seq_len"),
        (dict(max_batch_size=np.int64(8), max_step_tokens=np.int64(4)), ValueError, "max_step_tokens"),
    ],
)
def test_engine_sizes_validate_numpy_like_python(qwen2, kwargs, error, needle):
    with pytest.raises(error, match=needle):
        make_engine(qwen2.path, **kwargs)


def test_request_larger_than_the_kv_pool_is_refused(qwen2):
    engine = make_engine(qwen2.path, kv_cache_tokens=64)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        engine.generate([list(range(1, 40))], SamplingParams(max_tokens=100))


@pytest.mark.parametrize("n,fits", [(4, False), (2, True)])
def test_group_that_cannot_be_admitted_is_refused_up_front(qwen2, n, fits):
    # 4 pages of 16 tokens; a 40-token prompt fills 3 pages, and admitting its
    # group takes one more page per further sample.
    engine = make_engine(qwen2.path, kv_cache_tokens=64)
    params = SamplingParams(n=n, max_tokens=8, ignore_eos=True)
    if fits:
        [out] = engine.generate([list(range(1, 41))], params)
        assert [len(s.token_ids) for s in out.samples] == [8] * n
    else:
        with pytest.raises(ValueError, match=r"n=4 and max_tokens=8 .* kv_cache_tokens is 64"):
            engine.generate([list(range(1, 41))], params)
    assert engine.stats()["kv_pages_used"] == 0 and not engine.scheduler.requests


def test_group_refused_whatever_the_prefix_cache_holds(qwen2):
    # With chunked prefill a cold cache admits the group on its first 32-token
    # chunk (2 pages + 2 forks = 4), but once the prompt's full pages are cached
    # they are attached first and admission needs 3 + 2 = 5 pages: refused either way.
    engine = make_engine(qwen2.path, kv_cache_tokens=64, max_batch_size=4, max_step_tokens=32)
    prompt = list(range(1, 41))
    engine.generate([prompt], SamplingParams(n=1, max_tokens=1))
    with pytest.raises(ValueError, match="n=3"):
        engine.generate([prompt], SamplingParams(n=3, max_tokens=8, ignore_eos=True))
    assert engine.stats()["kv_pages_used"] == 0 and not engine.scheduler.requests
