"""`SamplingParams.top_logprobs`: per token, the k most likely tokens and their
logprobs in the request's logprobs mode, against a float64 recompute on the
transformers model that wrote the checkpoint."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout import SamplingParams
from rollout.engine.streams import SampleDelta
from tests.conftest import make_engine
from tests.reference import processed_logprobs

PROMPT = list(range(3, 40))
K = 5


def _reference(hf, prompt, tokens, mode, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """float64 logprobs `[len(tokens), V]` of the distribution `mode` reports, per position."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].double()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    if mode == "raw" or temperature == 0:
        return torch.log_softmax(rows, -1)
    if mode == "scaled":
        return torch.log_softmax(rows / temperature, -1)
    return torch.stack([processed_logprobs(r, temperature, top_k, top_p, min_p) for r in rows])


def _check(sample, ref, k):
    assert sample.top_logprobs is not None and len(sample.top_logprobs) == len(sample.token_ids)
    for i, (token, lp, top) in enumerate(zip(sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True)):
        assert len(top) == k, f"token {i}"
        ids = [t for t, _ in top]
        values = torch.tensor([v for _, v in top], dtype=torch.float64)
        ref_values, _ = ref[i].topk(k)
        finite = torch.isfinite(ref_values)
        assert torch.equal(torch.isfinite(values), finite), f"token {i}"
        assert torch.allclose(values[finite], ref_values[finite], atol=1e-4), f"token {i}"
        assert torch.allclose(ref[i][ids][finite], values[finite], atol=1e-4), f"token {i}: ids"
        assert list(values) == sorted(values, reverse=True)
        if token in ids:  # the sampled token's entry is its reported logprob
            assert abs(dict(top)[token] - lp) < 1e-4


@pytest.mark.parametrize(
    "mode, options",
    [
        ("processed", {}),
        ("raw", {}),
        ("scaled", {}),
        ("processed", {"kernels": "torch"}),
        ("processed", {"decode_graphs": "eager"}),  # steps that ask run eagerly: a graph keeps no logits
    ],
)
def test_top_logprobs_match_a_float64_recompute_in_each_mode(qwen2, mode, options):
    engine = make_engine(qwen2.path, **options)
    params = SamplingParams(
        n=2, max_tokens=12, temperature=0.7, top_p=0.9, ignore_eos=True, seed=3, logprobs_mode=mode, top_logprobs=K
    )
    out = engine.generate([PROMPT], params)[0]
    for s in out.samples:
        _check(s, _reference(qwen2.hf, out.prompt_token_ids, s.token_ids, mode, 0.7, top_p=0.9), K)


def test_processed_top_logprobs_past_the_kept_set_are_minus_infinity(qwen2):
    engine = make_engine(qwen2.path)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=3, ignore_eos=True, seed=1, top_logprobs=6)
    s = engine.generate([PROMPT], params)[0].samples[0]
    _check(s, _reference(qwen2.hf, PROMPT, s.token_ids, "processed", 1.0, top_k=3), 6)
    for top in s.top_logprobs:
        assert [v == float("-inf") for _, v in top] == [False] * 3 + [True] * 3


def test_greedy_top_logprobs_are_raw_and_the_first_is_the_sampled_token(qwen2):
    engine = make_engine(qwen2.path)
    s = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, top_logprobs=3))[0]
    s = s.samples[0]
    _check(s, _reference(qwen2.hf, PROMPT, s.token_ids, "raw", 0), 3)
    assert [top[0][0] for top in s.top_logprobs] == s.token_ids


def test_only_rows_that_ask_get_top_logprobs_and_tokens_do_not_change(qwen2):
    """Beside another caller's rows that ask for none, a request samples what it samples
    alone, and only its rows carry top logprobs."""
    asking = SamplingParams(n=3, max_tokens=10, temperature=0.9, ignore_eos=True, seed=8, top_logprobs=2)
    alone = make_engine(qwen2.path).generate([PROMPT], asking)[0]
    started, results = threading.Event(), {}
    engine = make_engine(qwen2.path, step_callback=lambda info: started.set())

    def other():
        results["other"] = engine.generate([PROMPT[:20]] * 2, SamplingParams(n=2, max_tokens=60, ignore_eos=True))

    t = threading.Thread(target=other)
    t.start()
    assert started.wait(30)
    mixed = engine.generate([PROMPT], asking)[0]
    t.join(60)
    assert not t.is_alive()
    assert [s.token_ids for s in mixed.samples] == [s.token_ids for s in alone.samples]
    for a, b in zip(alone.samples, mixed.samples, strict=True):
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]
    assert all(s.top_logprobs is None for out in results["other"] for s in out.samples)


def test_streamed_deltas_carry_the_top_logprobs_of_their_tokens(qwen2):
    engine = make_engine(qwen2.path)
    params = SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True, seed=2, top_logprobs=4)
    stream = engine.stream(PROMPT, params)
    tops = []
    for item in stream:
        if isinstance(item, SampleDelta):
            assert len(item.top_logprobs) == len(item.token_ids)
            tops.extend(item.top_logprobs)
    assert tops == stream.output.samples[0].top_logprobs


@pytest.mark.parametrize("bad", [-1, 21, 2.5, "3", True])
def test_top_logprobs_out_of_range_is_refused(bad):
    error = TypeError if isinstance(bad, (bool, float, str)) else ValueError
    with pytest.raises(error, match="top_logprobs"):
        SamplingParams(top_logprobs=bad)
