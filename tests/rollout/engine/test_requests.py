"""Bad prompts and sampling parameters: a clear error before anything changes."""

from __future__ import annotations

import pytest

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
        (dict(top_k=-1), ValueError, "top_k"),
        (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(min_p=-0.1), ValueError, "min_p"),
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
    ],
)
def test_sampling_params_validate_themselves(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        SamplingParams(**kwargs)


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
    ],
)
def test_bad_prompts_change_nothing(qwen2, prompts, params, error, needle):
    engine = make_engine(qwen2.path)
    before = engine.generate(GOOD, PARAMS)
    with pytest.raises(error, match=needle):
        engine.generate(prompts, params)
    assert engine.generate(GOOD, PARAMS) == before
    assert engine.stats()["kv_pages_used"] == 0 and not engine.scheduler.requests


def test_request_larger_than_the_kv_pool_is_refused(qwen2):
    engine = make_engine(qwen2.path, kv_cache_tokens=64)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        engine.generate([list(range(1, 40))], SamplingParams(max_tokens=100))
