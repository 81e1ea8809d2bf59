"""Penalties and logit_bias through the server, read by the real `openai`
client: the same tokens and logprobs as the in-process engine given the
same `SamplingParams`, whole and streamed."""

from __future__ import annotations

import pytest

from rollout import SamplingParams

PROMPT = [1, 40, 41, 40, 42]


@pytest.mark.parametrize("stream", [False, True])
def test_penalised_completions_equal_the_engines(tiny_server, tiny_engine, stream):
    client = tiny_server.openai()
    response = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0.9,
        seed=7,
        logprobs=0,
        frequency_penalty=0.8,
        presence_penalty=0.3,
        logit_bias={"40": 4.0, "43": -100},
        stream=stream,
        extra_body={"repetition_penalty": 1.5, "return_token_ids": True, "ignore_eos": True},
    )
    chunks = list(response) if stream else [response]
    ids = [t for c in chunks for ch in c.choices for t in (ch.token_ids or [])]
    logprobs = [lp for c in chunks for ch in c.choices if ch.logprobs for lp in ch.logprobs.token_logprobs]
    params = SamplingParams(
        max_tokens=10,
        temperature=0.9,
        seed=7,
        frequency_penalty=0.8,
        presence_penalty=0.3,
        repetition_penalty=1.5,
        logit_bias={40: 4.0, 43: -100.0},
        ignore_eos=True,
    )
    (reference,) = tiny_engine.generate([PROMPT], params)
    assert ids == reference.samples[0].token_ids and 43 not in ids
    assert logprobs == pytest.approx(reference.samples[0].logprobs, abs=1e-6)
