"""Routing replay: the trainer's transformers MoE model forced onto the
engine's recorded experts gives the engine's logprobs, even when its own
router would route otherwise; the router still gets gradients."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from rollout import SamplingParams
from tests.conftest import make_engine
from tests.factories import make_checkpoint
from tests.rollout.engine.test_routed_experts import hf_routing
from tests.trainer_bridge.test_episode_batch import ToolEnv
from trainer_bridge import RolloutBatch, routing_replay, sparse_routers, token_logprobs

PROMPTS = [[5, 6, 7, 8], list(range(3, 30))]
PARAMS = SamplingParams(n=2, max_tokens=12, ignore_eos=True, seed=9, logprobs_mode="raw", return_routed_experts=True)


@pytest.fixture(scope="module")
def top1(tmp_path_factory):
    """A mixtral with one expert per token: its renormalised gate weight is 1 whatever
    the router's logits, so a perturbed router changes only which expert runs."""
    path = tmp_path_factory.mktemp("ckpt_mixtral_top1")
    return path, make_checkpoint(path, "mixtral", seed=31, num_experts_per_tok=1)


def _own_routing(model, batch) -> torch.Tensor:
    """The experts `model`'s routers pick for the batch, `[B, T, layers, top_k]`."""
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True)
    k = model.config.num_experts_per_tok
    picks = [x.topk(k, dim=-1).indices.view(*batch.input_ids.shape, k) for x in out.router_logits]
    return torch.stack(picks, 2)


def test_batch_routing_is_aligned_with_input_ids(moe_checkpoints):
    outs = make_engine(moe_checkpoints["qwen3_moe"].path).generate(PROMPTS, PARAMS)
    batch = RolloutBatch.from_outputs(outs, PARAMS, 0)
    p = batch.prompt_ids.shape[1]
    assert batch.routed_experts.shape == (4, p + 12, 2, 2)
    short = batch.routed_experts[0]
    assert (short[: p - 4] == -1).all() and (short[-1] == -1).all()  # left padding, the last token
    assert short[p - 4 : p].tolist() == outs[0].prompt_routed_experts.tolist()
    assert short[p:-1].tolist() == outs[0].samples[0].routed_experts.tolist()


def test_episode_rows_carry_their_trajectorys_routing_and_replay_exactly(moe_checkpoints):
    ck = moe_checkpoints["qwen3_moe"]
    params = SamplingParams(max_tokens=5, ignore_eos=True, seed=9, logprobs_mode="raw", return_routed_experts=True)
    episodes = make_engine(ck.path).run_episodes([ToolEnv(k) for k in range(3)], params, max_turns=4)
    batch = RolloutBatch.from_episodes(episodes, params, 0)
    p = batch.prompt_ids.shape[1]
    for i, e in enumerate(episodes):
        k, n = e.prompt_len, len(e.token_ids)
        ref = hf_routing(ck.hf, e.token_ids)  # prompt, turns and observations in one forward
        np.testing.assert_array_equal(e.routed_experts, ref[:-1])  # the last token was sampled, never computed
        row = batch.routed_experts[i]
        assert row[p - k : p + n - k - 1].tolist() == ref[:-1].tolist()
        assert (row[: p - k] == -1).all() and (row[p + n - k - 1 :] == -1).all()
    replayed = token_logprobs(ck.hf, batch, replay_routing=True)
    mask = batch.response_mask.bool()
    assert (replayed - batch.old_logprobs)[mask].abs().max() < 1e-5
    unasked = make_engine(ck.path).run_episodes([ToolEnv(0)], SamplingParams(max_tokens=3), max_turns=2)
    assert unasked[0].routed_experts is None
    assert RolloutBatch.from_episodes(unasked, SamplingParams(max_tokens=3), 0).routed_experts is None


def test_replay_gives_the_engines_logprobs_under_a_router_that_flips_decisions(top1):
    path, hf = top1
    outs = make_engine(path).generate(PROMPTS, PARAMS)
    batch = RolloutBatch.from_outputs(outs, PARAMS, 0)
    trainer = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for router in sparse_routers(trainer):
            router.weight.add_(0.1 * torch.randn(router.weight.shape, generator=g))
    recorded = batch.routed_experts
    real = recorded[..., 0] >= 0
    flipped = (_own_routing(trainer, batch) != recorded)[real].float().mean()
    assert flipped > 0.1  # the perturbed router would route a good share of the positions elsewhere
    mask = batch.response_mask.bool()
    replayed = token_logprobs(trainer, batch, replay_routing=True)
    assert (replayed - batch.old_logprobs)[mask].abs().max() < 1e-5
    assert batch.mismatch["max_abs"] < 1e-5
    own = token_logprobs(trainer, batch)
    assert (own - batch.old_logprobs)[mask].abs().max() > 1e-3


def test_replay_with_the_engines_weights_matches_and_trains_the_router(moe_checkpoints):
    ck = moe_checkpoints["qwen3_moe"]  # top-2 of 8, not renormalised: the gate weights are the router's
    batch = RolloutBatch.from_outputs(make_engine(ck.path).generate(PROMPTS, PARAMS), PARAMS, 0)
    trainer = copy.deepcopy(ck.hf)
    for p in trainer.parameters():
        p.requires_grad_(True)
    replayed = token_logprobs(trainer, batch, replay_routing=True)
    assert (replayed - batch.old_logprobs)[batch.response_mask.bool()].abs().max() < 1e-5
    replayed.sum().backward()
    for router in sparse_routers(trainer):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_bad_replay_inputs_are_named(moe_checkpoints, qwen2):
    ck = moe_checkpoints["mixtral"]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    batch = RolloutBatch.from_outputs(make_engine(ck.path).generate(PROMPTS[:1], params), params, 0)
    assert batch.routed_experts is None
    with pytest.raises(ValueError, match="replay_routing=True needs batch.routed_experts"):
        token_logprobs(ck.hf, batch, replay_routing=True)
    routed = torch.zeros(1, 7, 2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"must be \[batch, tokens, 2 sparse layers, top_k\]"):
        with routing_replay(ck.hf, routed[:, :, :1]):
            pass
    with pytest.raises(TypeError, match="must be an integer torch.Tensor"):
        with routing_replay(ck.hf, routed.float()):
            pass
    with pytest.raises(ValueError, match="has no mixture-of-experts blocks"):
        with routing_replay(qwen2.hf, routed):
            pass
    with pytest.raises(ValueError, match="the forward routes 5 tokens, routed_experts holds 7"):
        with routing_replay(ck.hf, routed), torch.no_grad():
            ck.hf(torch.tensor([[5, 6, 7, 8, 9]]))
