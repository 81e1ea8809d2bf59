"""Routed experts returned by mixture-of-experts engines, checked against
transformers' own router choices (`output_router_logits`) on the final
tokens: prompts and outputs, whole and streamed, prefix-cache hits,
preemption, a weight commit with recompute, and sessions."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from rollout import SamplingParams
from rollout.engine.routing import routing_dtype
from tests.conftest import make_engine
from tests.factories import MOE_FAMILIES
from tests.rollout.engine.test_weight_updates import UpdateAtStep

LONG = list(range(3, 43))  # 40 tokens: two full pages of 16
PARAMS = SamplingParams(n=2, max_tokens=10, ignore_eos=True, seed=3, return_routed_experts=True)


def hf_routing(hf, ids: list[int]) -> np.ndarray:
    """transformers' top-k experts of every position of `ids`, `[len(ids), sparse layers, top_k]`."""
    k = hf.config.num_experts_per_tok
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    return torch.stack([torch.softmax(x.float(), -1).topk(k).indices for x in logits], 1).numpy()


def assert_routing_matches(hf, outs) -> None:
    for out in outs:
        p = len(out.prompt_token_ids)
        for s in out.samples:
            ref = hf_routing(hf, out.prompt_token_ids + s.token_ids)
            assert out.prompt_routed_experts.dtype == s.routed_experts.dtype == np.uint8
            assert s.routed_experts.shape == (len(s.token_ids) - 1, *ref.shape[1:])
            np.testing.assert_array_equal(out.prompt_routed_experts, ref[:p])
            np.testing.assert_array_equal(s.routed_experts, ref[p:-1])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routed_experts_of_prompts_and_outputs_match_transformers(moe_checkpoints, family):
    ck = moe_checkpoints[family]
    engine = make_engine(ck.path)
    outs = engine.generate([[5, 6, 7], LONG], PARAMS)
    assert_routing_matches(ck.hf, outs)
    layers = 2  # qwen3_moe: layers 0 and 2 of 3; mixtral: both
    assert outs[0].prompt_routed_experts.shape == (3, layers, 2)
    stream = engine.stream(LONG, PARAMS)  # the prompt's pages now come from the prefix cache
    list(stream)
    assert_same_routing(stream.output, outs[1])


def assert_same_routing(out, ref) -> None:
    """`out` sampled the same tokens as `ref` (the same seed) and returned the same routing."""
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in ref.samples]
    np.testing.assert_array_equal(out.prompt_routed_experts, ref.prompt_routed_experts)
    for s, r in zip(out.samples, ref.samples, strict=True):
        np.testing.assert_array_equal(s.routed_experts, r.routed_experts)


def test_prefix_hits_and_preemption_keep_each_positions_routing(moe_checkpoints):
    ck = moe_checkpoints["qwen3_moe"]
    engine = make_engine(ck.path, kv_cache_tokens=8 * 16)
    params = SamplingParams(n=3, max_tokens=40, ignore_eos=True, seed=4, return_routed_experts=True)
    first = engine.generate([LONG], params)
    assert engine.stats()["preemptions"] > 0  # three samples of 80 positions share two pages, not 11
    hits = engine.stats()["prefix_hit_tokens"]
    second = engine.generate([LONG], params)
    assert engine.stats()["prefix_hit_tokens"] >= hits + 32  # the prompt's full pages came from the cache
    assert_routing_matches(ck.hf, first + second)


def test_routing_after_a_recompute_commit_is_the_new_policys(moe_checkpoints):
    ck = moe_checkpoints["mixtral"]
    hf_b = copy.deepcopy(ck.hf)
    g = torch.Generator().manual_seed(8)
    routers = {n: torch.randn(t.shape, generator=g) for n, t in hf_b.state_dict().items() if n.endswith("gate.weight")}
    hf_b.load_state_dict(routers, strict=False)
    hook = UpdateAtStep(at=4)
    engine = make_engine(ck.path, step_callback=hook)
    hook.action = lambda: engine.update_weights(routers, inflight="recompute")
    outs = engine.generate([LONG], PARAMS)
    assert {v for s in outs[0].samples for v in s.versions} == {0, 1}
    assert_routing_matches(hf_b, outs)  # every position's KV, and routing, was recomputed under version 1
    before = hf_routing(ck.hf, LONG)
    assert (before != outs[0].prompt_routed_experts).any()  # the new routers route otherwise


def test_session_routing_covers_the_trajectory(moe_checkpoints):
    ck = moe_checkpoints["qwen3_moe"]
    engine = make_engine(ck.path)
    turn = SamplingParams(max_tokens=6, ignore_eos=True, seed=2, return_routed_experts=True)
    with engine.session(LONG) as session:
        first = session.generate(turn)
        assert len(first.routed_experts) == 5
        session.append([7, 8, 9])
        session.generate(turn)
        ids = session.token_ids
        np.testing.assert_array_equal(session.routed_experts, hf_routing(ck.hf, ids)[:-1])
        session.append([10])
        session.generate(SamplingParams(max_tokens=2))
        assert session.routed_experts is None  # the last turn did not ask


def test_dense_models_refuse_and_ids_widen_past_256_experts(qwen2):
    engine = make_engine(qwen2.path)
    with pytest.raises(ValueError, match="return_routed_experts=True needs a mixture-of-experts model"):
        engine.generate([[5, 6]], SamplingParams(return_routed_experts=True))
    with pytest.raises(TypeError, match="return_routed_experts must be a bool"):
        SamplingParams(return_routed_experts=1)
    assert (routing_dtype(256), routing_dtype(257)) == (torch.uint8, torch.int16)
