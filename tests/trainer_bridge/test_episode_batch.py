"""`RolloutBatch.from_episodes`: one row per multi-turn episode, the loss mask
covering exactly the sampled tokens, observations attended but not trained;
`token_logprobs` on the trainer's model (transformers) reproduces the
rollout logprobs over the whole multi-turn trajectory."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams
from tests.conftest import make_engine
from trainer_bridge import RolloutBatch, token_logprobs

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True, seed=9, temperature=0.8, top_p=0.9)


class ToolEnv:
    """Answers every turn with three tokens; reward 1.0 on the last turn; 2 or 3 turns."""

    def __init__(self, k: int) -> None:
        self.k, self.turn = k, 0

    def reset(self):
        return [3 + self.k] * (2 + self.k % 3)  # prompts of different lengths: left padding

    def step(self, sample):
        self.turn += 1
        done = self.turn >= 2 + self.k % 2
        return [7, 8, 9 + self.k], float(done), done


def test_episode_rows_mask_observations_and_recompute_exactly(qwen2):
    engine = make_engine(qwen2.path)
    episodes = engine.run_episodes([ToolEnv(k) for k in range(4)], PARAMS, max_turns=4)
    batch = RolloutBatch.from_episodes(episodes, PARAMS, policy_version=0, group_size=2)
    assert batch.group_index.tolist() == [0, 0, 1, 1] and batch.sample_index.tolist() == [0, 1, 0, 1]
    assert batch.rewards.tolist() == [1.0] * 4
    for i, e in enumerate(episodes):
        k = e.prompt_len
        response = e.token_ids[k:]
        assert batch.response_ids[i, : len(response)].tolist() == response
        assert batch.response_mask[i, : len(response)].tolist() == e.loss_mask[k:]
        assert batch.response_attention[i, : len(response)].tolist() == [1] * len(response)
        assert int(batch.response_mask[i].sum()) == sum(len(s.token_ids) for s in e.samples)
        assert batch.prompt_ids[i, -k:].tolist() == e.token_ids[:k]
    with torch.no_grad():
        trainer = token_logprobs(qwen2.hf, batch)
    mask = batch.response_mask.bool()
    assert torch.allclose(trainer[mask], batch.old_logprobs[mask], atol=1e-4)
    assert (trainer[~mask] == 0).all() and batch.mismatch["max_abs"] < 1e-4
    assert batch.staleness == {"max": 0.0, "mean": 0.0}


def test_from_episodes_refuses_bad_groups(qwen2):
    engine = make_engine(qwen2.path)
    episodes = engine.run_episodes([ToolEnv(k) for k in range(3)], PARAMS, max_turns=4)
    with pytest.raises(ValueError, match="group_size"):
        RolloutBatch.from_episodes(episodes, PARAMS, 0, group_size=2)
    with pytest.raises(ValueError, match="no episodes"):
        RolloutBatch.from_episodes([], PARAMS, 0)


def test_submit_episodes_checks_its_arguments_before_anything_runs(qwen2):
    from trainer_bridge import TrainerBridge

    engine = make_engine(qwen2.path)
    bridge = TrainerBridge(engine)
    envs = [ToolEnv(k) for k in range(4)]
    with pytest.raises(ValueError, match="group_size"):
        bridge.submit_episodes(envs, PARAMS, group_size=0)
    with pytest.raises(ValueError, match="group_size must divide"):
        bridge.submit_episodes(envs, PARAMS, group_size=3)
    with pytest.raises(ValueError, match="max_turns"):
        bridge.submit_episodes(envs, PARAMS, max_turns=0)
    with pytest.raises(ValueError, match="n must be 1"):
        bridge.submit_episodes(envs, SamplingParams(n=2))
    assert engine.stats()["computed_tokens"] == 0
    batch = bridge.collect(bridge.submit_episodes(envs, PARAMS, max_turns=4, group_size=2))
    assert len(batch) == 4 and batch.group_index.tolist() == [0, 0, 1, 1]
