"""Penalties and logit_bias: `penalize` against the definition in float64,
the engine's sampled logprobs (compiled and torch samplers, greedy and
sampled, each logprobs mode) against a float64 recompute on the transformers
model, and `trainer_bridge.token_logprobs` reproducing them from the batch."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from rollout import SamplingParams
from rollout.engine.penalties import bias_rows, penalize
from tests.conftest import make_engine
from trainer_bridge import TrainerBridge, token_logprobs
from trainer_bridge.batch import RolloutBatch

PROMPT = [3, 9, 9, 14, 27, 5, 9]
PENALTIES = {"frequency_penalty": 0.7, "presence_penalty": -0.4, "repetition_penalty": 1.6, "logit_bias": {9: 3.0}}


def reference(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """vLLM's definition, token by token, in float64 (plain Python)."""
    out = []
    for v, x in enumerate(logits):
        x += (p.logit_bias or {}).get(v, 0.0)
        count = output.count(v)
        if v in prompt or count:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        out.append(x - p.frequency_penalty * count - p.presence_penalty * (count > 0))
    return out


def test_penalize_is_the_definition():
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(3, vocab, generator=gen) * 4
    histories = [([1, 2, 2], [2, 5, 5, 5]), ([], [0]), ([7] * 3, [])]
    params = [SamplingParams(**PENALTIES), SamplingParams(repetition_penalty=0.5), SamplingParams(logit_bias={3: -2})]
    counts = torch.zeros(3, vocab)
    seen = torch.zeros(3, vocab, dtype=torch.bool)
    for i, (prompt, output) in enumerate(histories):
        seen[i, prompt] = True
        for t in output:
            counts[i, t] += 1

    def column(name):
        return torch.tensor([getattr(p, name) for p in params])

    names = ("frequency_penalty", "presence_penalty", "repetition_penalty")
    got = penalize(logits, counts, seen, *map(column, names), bias_rows([p.logit_bias for p in params], vocab, "cpu"))
    for i, ((prompt, output), p) in enumerate(zip(histories, params, strict=True)):
        want = torch.tensor(reference(logits[i].double().tolist(), prompt, output, p), dtype=torch.float64)
        assert (got[i].double() - want).abs().max() < 1e-5


def recompute(hf64, prompt: list[int], tokens: list[int], p: SamplingParams) -> tuple[list[float], list[int]]:
    """Per output token, in float64: its logprob in `p.logprobs_mode`, the greedy
    choice, and the log-distribution the logprob is of."""
    with torch.no_grad():
        logits = hf64(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    lps, greedy, dists = [], [], []
    for t, row in enumerate(logits.tolist()):
        penalised = reference(row, prompt, tokens[:t], p)
        x = torch.tensor(row if p.logprobs_mode == "raw" else penalised, dtype=torch.float64)
        if p.temperature > 0 and p.logprobs_mode != "raw":
            x = x / p.temperature
        dists.append(torch.log_softmax(x, -1))
        lps.append(float(dists[-1][tokens[t]]))
        greedy.append(int(torch.tensor(penalised).argmax()))
    return lps, greedy, dists


@pytest.fixture(scope="module")
def hf64(qwen2):
    return copy.deepcopy(qwen2.hf).double().eval()


@pytest.mark.parametrize(
    ("options", "temperature", "mode"),
    [({}, 0.9, "processed"), ({"kernels": "torch"}, 0.9, "processed"), ({}, 0.0, "processed"), ({}, 0.9, "raw")],
    ids=["compiled", "torch", "greedy", "raw"],
)
def test_engine_logprobs_are_the_penalised_distributions(qwen2, hf64, options, temperature, mode):
    engine = make_engine(qwen2.path, **options)
    params = SamplingParams(
        n=2,
        max_tokens=14,
        temperature=temperature,
        seed=5,
        ignore_eos=True,
        logprobs_mode=mode,
        top_logprobs=2,
        **PENALTIES,
    )
    try:
        (out,) = engine.generate([PROMPT], params)
        (plain,) = engine.generate([PROMPT], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
    finally:
        engine.close()
    for s in out.samples:
        lps, greedy, dists = recompute(hf64, PROMPT, s.token_ids, params)
        assert max(abs(a - b) for a, b in zip(s.logprobs, lps, strict=True)) < 1e-4
        for top, dist in zip(s.top_logprobs, dists, strict=True):  # the same distribution's best two
            values, ids = dist.topk(2)
            assert [i for i, _ in top] == ids.tolist()
            assert max(abs(v - w) for (_, v), w in zip(top, values.tolist(), strict=True)) < 1e-4
        if temperature == 0:
            assert s.token_ids == greedy and s.token_ids != plain.samples[0].token_ids  # the penalties acted


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_token_logprobs_recomputes_them_from_the_batch(qwen2, mode):
    bridge = TrainerBridge(make_engine(qwen2.path))
    params = SamplingParams(n=3, max_tokens=12, temperature=0.8, seed=2, logprobs_mode=mode, top_p=0.95, **PENALTIES)
    batch = bridge.generate([PROMPT, [4, 4, 8]], params)
    mask = batch.response_mask.bool()
    recomputed = token_logprobs(qwen2.hf, batch)
    assert (recomputed[mask] - batch.old_logprobs[mask]).abs().max() < 1e-4
    subset = batch.select([4, 0])  # per-row biases follow the rows
    assert (token_logprobs(qwen2.hf, subset) - subset.old_logprobs)[subset.response_mask.bool()].abs().max() < 1e-4
    if mode == "processed":  # without them the trainer would be far off: they are what it reproduces
        plain = replace(batch, frequency_penalty=None)
        assert (token_logprobs(qwen2.hf, plain) - batch.old_logprobs)[mask].abs().max() > 0.1


def test_multi_turn_batches_refuse_penalties():
    with pytest.raises(ValueError, match="multi-turn batches take none"):
        RolloutBatch.from_episodes([object()], SamplingParams(presence_penalty=0.5), 0)


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"frequency_penalty": 2.5}, ValueError, r"frequency_penalty must be in \[-2, 2\]"),
        ({"presence_penalty": "1"}, TypeError, "presence_penalty must be a number"),
        ({"repetition_penalty": 0}, ValueError, r"repetition_penalty must be in \(0, 2\]"),
        ({"logit_bias": {"5": 1.0}}, ValueError, "logit_bias keys must be token ids"),
        ({"logit_bias": {5: 101}}, ValueError, r"logit_bias\[5\] must be in \[-100, 100\]"),
        ({"logit_bias": [5]}, TypeError, "logit_bias must be a dict"),
    ],
)
def test_bad_penalties_are_refused_naming_the_field(fields, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**fields)


def test_a_bias_outside_the_vocabulary_is_refused(qwen2):
    engine = make_engine(qwen2.path)
    try:
        with pytest.raises(ValueError, match=r"logit_bias has token 99999, outside the vocabulary"):
            engine.generate([PROMPT], SamplingParams(logit_bias={99999: 1.0}))
    finally:
        engine.close()


def test_counts_kept_with_the_sequence_equal_its_history():
    """`Sequence.penalty` counts each appended token and forgets the outputs on a restart,
    as a rebuild from the sequence's history counts them."""
    from rollout.engine.penalties import PenaltyCounts
    from rollout.engine.sequence import Request, Sequence

    request = Request(0, PROMPT, SamplingParams(**PENALTIES), seed=0, max_tokens=8, stop_token_ids=frozenset())
    seq = Sequence(0, request, 0, list(PROMPT), penalty=PenaltyCounts(PROMPT, 40))
    for t in [5, 9, 5, 30]:
        seq.append(t, -1.0, 0)
    rebuilt = PenaltyCounts.of(seq, 40)
    assert torch.equal(seq.penalty.counts, rebuilt.counts) and torch.equal(seq.penalty.prompt_seen, rebuilt.prompt_seen)
    assert seq.penalty.counts[5] == 2 and seq.penalty.counts.sum() == 4 and seq.penalty.prompt_seen[[3, 9, 14]].all()
    seq.reset_outputs()
    seq.append(7, -1.0, 0)
    assert torch.equal(seq.penalty.counts, PenaltyCounts.of(seq, 40).counts) and seq.penalty.counts.sum() == 1
