"""`RolloutCluster.score`: sequences balanced over the actors like prompts, each
scored as transformers' teacher-forced log-softmax says, and an actor killed
mid-score loses none (its sequences are scored again on the other)."""

from __future__ import annotations

import os
import signal
import threading

import torch

from rollout import RolloutCluster
from tests.rollout.cluster.test_cluster import wait_until

KW = dict(
    num_actors=2,
    num_cpus_per_actor=1,
    max_seq_len=256,
    kv_cache_tokens=4096,
    max_batch_size=8,
    max_step_tokens=8,  # many steps per sequence: the kill lands mid-score
    timeout_s=120,
    stall_timeout_s=120,
)


def test_cluster_score_survives_an_actor_killed_mid_score(ray_session, qwen2):
    g = torch.Generator().manual_seed(3)
    seqs = torch.randint(3, qwen2.hf.config.vocab_size, (8, 64), generator=g)
    with torch.no_grad():
        ref = torch.log_softmax(qwen2.hf(seqs).logits.float(), -1)
    cluster = RolloutCluster(qwen2.path, **KW)
    try:
        result = {}
        caller = threading.Thread(target=lambda: result.update(out=cluster.score([s.tolist() for s in seqs], 2)))
        caller.start()
        busy = []  # an actor seen scoring: the victim

        def some_actor_scores() -> bool:
            busy.extend(h["pid"] for h in cluster.health() if h.get("running", 0) > 0)
            return bool(busy)

        wait_until(some_actor_scores)
        os.kill(busy[0], signal.SIGKILL)
        caller.join(120)
        outs = result["out"]
        assert [o.index for o in outs] == list(range(len(seqs)))
        for o, ids, lp in zip(outs, seqs.tolist(), ref, strict=True):
            assert o.token_ids == ids and o.version == 0 and o.logprobs[0] is None
            expected = lp[torch.arange(len(ids) - 1), ids[1:]]
            assert torch.allclose(torch.tensor(o.logprobs[1:]), expected, atol=1e-5)
            assert all(set(o.top_logprobs[i]) == set(lp[i - 1].topk(2).indices.tolist()) | {ids[i]} for i in (1, 40))
    finally:
        cluster.shutdown()
