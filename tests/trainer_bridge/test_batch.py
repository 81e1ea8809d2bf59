from __future__ import annotations

import pytest
import torch

from rollout import RolloutOutput, Sample, SamplingParams
from rollout.engine.sampler import MODE_CODES
from trainer_bridge import RolloutBatch, StalenessPolicy

PARAMS = SamplingParams(n=2, temperature=0.7, top_k=5, logprobs_mode="scaled")


def _outputs():
    return [
        RolloutOutput(
            [11, 12],
            [
                Sample([21, 22, 23], [-0.1, -0.2, -0.3], [0, 0, 1], "length", "a"),
                Sample([24], [-0.4], [1], "stop", "b"),
            ],
            index=0,
        ),
        RolloutOutput(
            [13, 14, 15, 16],
            [Sample([25, 26], [-0.5, -0.6], [1, 1], "stop", "c"), Sample([], [], [], "abort", "")],
            index=1,
        ),
    ]


def test_layout_against_hand_built_tensors():
    b = RolloutBatch.from_outputs(_outputs(), PARAMS, policy_version=2, pad_token_id=0)
    assert torch.equal(b.prompt_ids, torch.tensor([[0, 0, 11, 12], [0, 0, 11, 12], [13, 14, 15, 16], [13, 14, 15, 16]]))
    assert torch.equal(b.prompt_mask, torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]))
    assert torch.equal(b.response_ids, torch.tensor([[21, 22, 23], [24, 0, 0], [25, 26, 0], [0, 0, 0]]))
    assert torch.equal(b.response_mask, torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]]))
    assert torch.allclose(b.old_logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0, 0], [-0.5, -0.6, 0], [0, 0, 0]]))
    assert torch.equal(b.versions, torch.tensor([[0, 0, 1], [1, -1, -1], [1, 1, -1], [-1, -1, -1]]))
    assert b.group_index.tolist() == [0, 0, 1, 1] and b.sample_index.tolist() == [0, 1, 0, 1]
    assert b.finish_reasons == ["length", "stop", "stop", "abort"] and b.texts == ["a", "b", "c", ""]
    assert torch.equal(b.input_ids[1], torch.tensor([0, 0, 11, 12, 24, 0, 0]))
    assert torch.equal(b.attention_mask[1], torch.tensor([0, 0, 1, 1, 1, 0, 0]))
    assert torch.equal(b.position_ids[1], torch.tensor([0, 0, 0, 1, 2, 2, 2]))
    assert torch.equal(b.position_ids[2], torch.tensor([0, 1, 2, 3, 4, 5, 5]))
    assert b.temperature.tolist() == pytest.approx([0.7] * 4) and b.top_k.tolist() == [5] * 4
    assert b.staleness == {"max": 2.0, "mean": pytest.approx(6 / 6 + 2 / 6)}  # lags 2,2,1,1,1,1
    sub = b.select([2, 0])
    assert sub.group_index.tolist() == [1, 0] and sub.texts == ["c", "a"]
    assert b.to("cpu").response_ids.data_ptr() == b.response_ids.data_ptr()


def test_staleness_policy_marks_old_groups():
    outs = _outputs()
    assert StalenessPolicy(None).stale_groups(outs, 5) == []
    assert StalenessPolicy(1).stale_groups(outs, 2) == [0]  # a token of version 0 is 2 behind
    assert StalenessPolicy(0).stale_groups(outs, 1) == [0]
    assert StalenessPolicy(1).stale_groups(outs, 1) == []
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessPolicy(-1)
    with pytest.raises(ValueError, match="stale action"):
        StalenessPolicy(1, "ignore")


def test_empty_batch_is_refused():
    with pytest.raises(ValueError, match="no samples"):
        RolloutBatch.from_outputs([], PARAMS, 0)


def test_each_output_can_bring_its_own_settings():
    """A group carried from another step keeps its settings: row by row, by hand."""
    other = SamplingParams(n=2, temperature=1.0, top_p=0.9, min_p=0.05, logprobs_mode="raw")
    b = RolloutBatch.from_outputs(_outputs(), [PARAMS, other], policy_version=2)
    assert b.temperature.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0]) and b.top_k.tolist() == [5, 5, 0, 0]
    assert b.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9, 0.9])
    assert b.min_p.tolist() == pytest.approx([0, 0, 0.05, 0.05])
    assert b.logprobs_mode.tolist() == [MODE_CODES["scaled"]] * 2 + [MODE_CODES["raw"]] * 2
    same = RolloutBatch.from_outputs(_outputs(), [PARAMS, PARAMS], policy_version=2)
    one = RolloutBatch.from_outputs(_outputs(), PARAMS, policy_version=2)
    for name in ("temperature", "top_k", "top_p", "min_p", "logprobs_mode"):
        assert torch.equal(getattr(same, name), getattr(one, name))


def test_bad_per_output_settings_are_refused():
    with pytest.raises(ValueError, match=r"one SamplingParams per output \(2\), got 1"):
        RolloutBatch.from_outputs(_outputs(), [PARAMS], 0)
    with pytest.raises(TypeError, match="params must be a SamplingParams or a list of them, got dict"):
        RolloutBatch.from_outputs(_outputs(), {"temperature": 1.0}, 0)
    with pytest.raises(TypeError, match="params must be a SamplingParams or a list of them"):
        RolloutBatch.from_outputs(_outputs(), [PARAMS, None], 0)


def test_a_top_k_past_int64_keeps_every_token_in_the_batch():
    """`SamplingParams` takes any k >= 0 (the engine caps it at the vocabulary); the batch's column must hold it."""
    from rollout.engine.sampler import logprobs_of
    from trainer_bridge.logprobs import _sampling

    huge = RolloutBatch.from_outputs(_outputs(), SamplingParams(n=2, temperature=0.7, top_k=2**70), 0)
    off = RolloutBatch.from_outputs(_outputs(), SamplingParams(n=2, temperature=0.7, top_k=0), 0)
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([3, 1, 4, 1])
    rows = torch.arange(4)
    got = logprobs_of(logits, tokens, _sampling(huge, rows))
    expected = torch.log_softmax(logits.double() / 0.7, -1)[rows, tokens]  # no filter: a plain softmax
    assert torch.allclose(got.double(), expected, atol=1e-5)
    assert torch.equal(got, logprobs_of(logits, tokens, _sampling(off, rows)))
