"""Routed experts through a Ray cluster: returned by the actors for calls,
streams and sessions, checked against transformers' router choices and the
engine's own non-streamed routing."""

from __future__ import annotations

import numpy as np

from rollout import RolloutCluster, SamplingParams
from tests.rollout.engine.test_routed_experts import assert_routing_matches, assert_same_routing, hf_routing

KW = dict(num_actors=1, num_cpus_per_actor=1, max_seq_len=128, kv_cache_tokens=2048, max_batch_size=16)


def test_cluster_returns_routed_experts_for_calls_streams_and_sessions(ray_session, moe_checkpoints):
    ck = moe_checkpoints["qwen3_moe"]
    cluster = RolloutCluster(ck.path, **KW)
    try:
        params = SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=1, return_routed_experts=True)
        outs = cluster.generate([[5, 6, 7], list(range(3, 25))], params)
        assert_routing_matches(ck.hf, outs)
        assert isinstance(outs[1].samples[0].routed_experts, np.ndarray)
        stream = cluster.stream(list(range(3, 25)), params)
        list(stream)
        assert_same_routing(stream.output, outs[1])
        turn = SamplingParams(max_tokens=4, ignore_eos=True, seed=2, return_routed_experts=True)
        with cluster.session([5, 6, 7, 8]) as session:
            assert len(session.generate(turn).routed_experts) == 3
            session.append([9, 10])
            session.generate(turn)  # on the pinned actor, from the KV its first turn kept
            np.testing.assert_array_equal(session.routed_experts, hf_routing(ck.hf, session.token_ids)[:-1])
            session.generate(SamplingParams(max_tokens=2))
            assert session.routed_experts is None  # the last turn did not ask
    finally:
        cluster.shutdown()
