"""Structured outputs in the engine: a random tiny model whose character
tokenizer spells all of printable ASCII, so every token is one character and
the tokens a constraint allows next can be worked out by hand. Outputs parse
and validate against their JSON schema (jsonschema); the sampled "processed"
logprobs and top logprobs are a float64 recompute of the transformers
model's distribution with the disallowed tokens dropped, "raw" the unmasked
one; compiled and torch samplers alike."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from rollout import SamplingParams, StructuredOutputs
from tests.conftest import make_engine

EOS = 2  # "</s>" of the tests' character tokenizer
OFFSET = 4  # token id of chr(32); ids 0..3 are special
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", "emu"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "kind", "n"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe", "nope"]


@pytest.fixture(scope="module")
def torch_engine(ascii_checkpoint):
    """An engine of the same checkpoint on the torch sampler (the session's is compiled)."""
    e = make_engine(ascii_checkpoint.path, kernels="torch")
    yield e
    e.close()


def text_of(ids: list[int]) -> str:
    return "".join(chr(t - OFFSET + 32) for t in ids)


def test_outputs_parse_and_validate_against_the_schema(ascii_engine):
    engine = ascii_engine
    params = SamplingParams(n=2, max_tokens=48, temperature=1.0, seed=3, structured_outputs=StructuredOutputs(SCHEMA))
    (out,) = engine.generate(["Pet: "], params)
    for s in out.samples:
        assert s.finish_reason == "stop" and s.token_ids[-1] == EOS
        jsonschema.validate(json.loads(s.text), SCHEMA)
    (free,) = engine.generate(["Pet: "], SamplingParams(max_tokens=12, temperature=1.0, seed=3))
    with pytest.raises(json.JSONDecodeError):  # unconstrained, the model writes no JSON
        json.loads(free.samples[0].text)
    any_object = SamplingParams(n=2, max_tokens=40, seed=1, structured_outputs=StructuredOutputs(json_object=True))
    (obj,) = engine.generate(["{"], any_object)
    done = [s for s in obj.samples if s.finish_reason == "stop"]  # the others ran out of tokens mid-object
    assert done and all(isinstance(json.loads(s.text), dict) for s in done)


def allowed_next(prefix: str) -> list[int]:
    """The tokens `CHOICES` allow after `prefix`, by hand: each character that
    continues some choice, and the stop token once `prefix` is one."""
    chars = {c[len(prefix)] for c in CHOICES if c.startswith(prefix) and len(c) > len(prefix)}
    return sorted([ord(ch) - 32 + OFFSET for ch in chars] + ([EOS] if prefix in CHOICES else []))


@pytest.mark.parametrize(
    ("sampler", "mode", "temperature"),
    [("compiled", "processed", 0.8), ("compiled", "raw", 0.8), ("compiled", "processed", 0.0)]
    + [("torch", "processed", 0.8)],
)
def test_logprobs_are_the_masked_distribution(request, ascii_checkpoint, sampler, mode, temperature):
    engine = request.getfixturevalue("ascii_engine" if sampler == "compiled" else "torch_engine")
    hf = ascii_checkpoint.hf
    prompt = [1, 40, 41, 42, 43]
    params = SamplingParams(
        n=3,
        max_tokens=8,
        temperature=temperature,
        seed=11,
        logprobs_mode=mode,
        top_logprobs=2,
        structured_outputs=StructuredOutputs(choice=CHOICES),
    )
    (out,) = engine.generate([prompt], params)
    for s in out.samples:
        assert text_of(s.token_ids[:-1]) in CHOICES and s.token_ids[-1] == EOS
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1]
        for t, row in enumerate(logits):
            allowed = allowed_next(text_of(s.token_ids[:t]))
            assert s.token_ids[t] in allowed
            masked = torch.full_like(row, float("-inf"))
            masked[allowed] = row[allowed]
            if mode == "raw" or temperature == 0:
                dist = torch.log_softmax(masked if mode != "raw" else row, -1)
            else:
                dist = torch.log_softmax(masked / temperature, -1)
            if temperature == 0:
                assert s.token_ids[t] == int(masked.argmax())
            assert abs(s.logprobs[t] - float(dist[s.token_ids[t]])) < 1e-4
            values, ids = dist.topk(min(2, len(allowed)) if mode != "raw" else 2)
            assert [i for i, _ in s.top_logprobs[t]][: len(ids)] == ids.tolist()
            assert max(abs(v - w) for (_, v), w in zip(s.top_logprobs[t], values.tolist(), strict=False)) < 1e-4


def test_bad_constraints_are_refused_naming_the_field(ascii_engine):
    engine = ascii_engine

    def ask(spec, **kwargs):
        engine.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec, **kwargs))

    with pytest.raises(ValueError, match=r"structured_outputs.json is not a valid JSON schema"):
        ask(StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}))
    with pytest.raises(ValueError, match=r"structured_outputs.regex is not a valid regular expression"):
        ask(StructuredOutputs(regex="(unclosed"))
    with pytest.raises(ValueError, match="the request has none"):
        ask(StructuredOutputs(json_object=True), ignore_eos=True)
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs(json=SCHEMA, regex="a")
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputs"):
        SamplingParams(structured_outputs={"json": SCHEMA})
