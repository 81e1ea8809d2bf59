"""Routed experts through a Ray cluster: returned by the actors, checked
against transformers' router choices."""

from __future__ import annotations

import numpy as np

from rollout import RolloutCluster, SamplingParams
from tests.rollout.engine.test_routed_experts import assert_routing_matches

KW = dict(num_actors=1, num_cpus_per_actor=1, max_seq_len=128, kv_cache_tokens=2048, max_batch_size=16)


def test_cluster_returns_routed_experts(ray_session, moe_checkpoints):
    ck = moe_checkpoints["qwen3_moe"]
    cluster = RolloutCluster(ck.path, **KW)
    try:
        params = SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=1, return_routed_experts=True)
        outs = cluster.generate([[5, 6, 7], list(range(3, 25))], params)
        assert_routing_matches(ck.hf, outs)
        assert isinstance(outs[1].samples[0].routed_experts, np.ndarray)
    finally:
        cluster.shutdown()
