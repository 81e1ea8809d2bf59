"""TrainerBridge over an Engine and a cluster; token_logprobs equals the
engine's logprobs in every mode on the transformers model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rollout import RolloutCluster, SamplingParams
from tests.conftest import make_engine
from tests.factories import _randomize
from trainer_bridge import TrainerBridge, token_logprobs

PROMPTS = [list(range(3, 3 + k)) for k in (5, 12, 3, 20)]


@pytest.fixture(scope="module")
def hf_b(qwen2):
    model = copy.deepcopy(qwen2.hf)
    _randomize(model, 77)
    return model


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, max_tokens=16, seed=1, logprobs_mode="raw", temperature=0.8),
        SamplingParams(n=3, max_tokens=16, seed=2, logprobs_mode="scaled", temperature=0.6),
        SamplingParams(
            n=3, max_tokens=16, seed=3, logprobs_mode="processed", temperature=0.9, top_k=12, top_p=0.9, min_p=0.02
        ),
        SamplingParams(n=2, max_tokens=16, seed=4, temperature=0.0),
    ],
    ids=["raw", "scaled", "processed-filters", "greedy"],
)
def test_token_logprobs_match_the_engine(qwen2, params):
    bridge = TrainerBridge(make_engine(qwen2.path))
    batch = bridge.generate(PROMPTS, params)
    recomputed = token_logprobs(qwen2.hf, batch)
    mask = batch.response_mask.bool()
    assert recomputed.shape == batch.old_logprobs.shape
    assert (recomputed[~mask] == 0).all()
    assert (recomputed[mask] - batch.old_logprobs[mask]).abs().max() < 1e-4
    assert batch.mismatch["max_abs"] < 1e-4 and abs(batch.mismatch["k3_kl"]) < 1e-8


def test_token_logprobs_is_differentiable_and_reports_real_mismatch(qwen2, hf_b):
    bridge = TrainerBridge(make_engine(qwen2.path))
    batch = bridge.generate(PROMPTS, SamplingParams(n=2, max_tokens=12, seed=5))
    model = copy.deepcopy(hf_b).train()
    lp = token_logprobs(model, batch)
    (lp * batch.response_mask).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    assert batch.mismatch["mean_abs"] > 0.1 and batch.mismatch["k3_kl"] > 0  # other weights: a real gap


def test_push_strips_wrappers_and_serves_the_pushed_model(qwen2, hf_b):
    class DDPLike(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    bridge = TrainerBridge(make_engine(qwen2.path))
    assert bridge.push(DDPLike(hf_b)) == 1 and bridge.policy_version == 1
    batch = bridge.generate(PROMPTS, SamplingParams(n=2, max_tokens=12, seed=6, logprobs_mode="raw"))
    assert (batch.versions[batch.response_mask.bool()] == 1).all()
    assert (token_logprobs(hf_b, batch) - batch.old_logprobs)[batch.response_mask.bool()].abs().max() < 1e-4
    assert bridge.last_push_seconds is not None


def test_staleness_bound_regenerates_or_drops(qwen2, hf_b):
    params = SamplingParams(n=2, max_tokens=10, seed=7, logprobs_mode="raw")
    bridge = TrainerBridge(make_engine(qwen2.path), max_staleness=0)
    pending = bridge.submit(PROMPTS, params)
    pending.result(60)  # generated under version 0
    bridge.push(hf_b)
    batch = bridge.collect(pending)
    assert batch.policy_version == 1 and batch.staleness["max"] == 0  # regenerated under version 1
    assert sorted(set(batch.group_index.tolist())) == [0, 1, 2, 3]
    assert (token_logprobs(hf_b, batch) - batch.old_logprobs)[batch.response_mask.bool()].abs().max() < 1e-4

    dropper = TrainerBridge(bridge.target, max_staleness=0, stale="drop")
    fresh = dropper.submit(PROMPTS[:2], params)
    fresh.result(60)
    dropper.push(hf_b)  # version 2: the two groups are now stale
    later = dropper.submit(PROMPTS[2:], params)
    late_batch = dropper.collect(later)
    assert late_batch.staleness["max"] == 0
    with pytest.raises(ValueError, match="every prompt group was staler than max_staleness=0"):
        dropper.collect(fresh)  # every group stale: all dropped


def test_bridge_over_a_cluster(ray_session, qwen2, hf_b):
    cluster = RolloutCluster(
        qwen2.path, num_actors=2, num_cpus_per_actor=1, max_seq_len=256, kv_cache_tokens=4096, timeout_s=120
    )
    try:
        bridge = TrainerBridge(cluster, max_staleness=1)
        assert bridge.dtype == torch.float32
        assert bridge.push(hf_b.state_dict()) == 1
        batch = bridge.generate(PROMPTS, SamplingParams(n=2, max_tokens=12, seed=8, logprobs_mode="raw"))
        assert len(batch) == 8 and batch.group_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert (token_logprobs(hf_b, batch) - batch.old_logprobs)[batch.response_mask.bool()].abs().max() < 1e-4
    finally:
        cluster.shutdown()


def test_bridge_rejects_other_targets():
    with pytest.raises(TypeError, match="RolloutCluster or an Engine"):
        TrainerBridge(object())


def test_push_reports_the_generation_pause_and_kv_usage(qwen2, hf_b):
    import threading

    from trainer_bridge.metrics import Metrics

    engine = make_engine(qwen2.path)
    metrics = Metrics(enabled=False)
    bridge = TrainerBridge(engine, metrics=metrics)
    started = threading.Event()
    engine._step_callback = lambda info: started.set()
    pending = bridge.submit(PROMPTS * 4, SamplingParams(n=4, max_tokens=120, ignore_eos=True, seed=1))
    assert started.wait(60)
    bridge.push(hf_b, inflight="keep")
    batch = bridge.collect(pending, timeout=120)
    log = engine.step_log()
    gaps = [b.end_time - a.end_time for a, b in zip(log, log[1:], strict=False)]
    assert 0 < bridge.last_push_pause <= max(gaps)  # a real gap between two steps around the push
    assert {0, 1} <= set(batch.versions[batch.response_mask.bool()].tolist())
    assert bridge.kv_usage() == 0.0  # everything finished and released
    logged = {k for row in metrics.history for k in row}
    assert {"push/generation_pause_s", "rollout/kv_usage", "rollout/tokens_per_s"} <= logged
    assert TrainerBridge(engine).push(hf_b, inflight="keep") == 2  # without metrics: no pause is computed


def test_generation_pause_counts_only_gaps_overlapping_the_push():
    from types import SimpleNamespace

    from rollout import generation_pause

    log = [SimpleNamespace(end_time=t) for t in (1.0, 1.1, 1.2, 1.9, 2.0)]
    assert generation_pause([log], 1.5, 1.6) == pytest.approx(0.7)
    assert generation_pause([log], 1.05, 1.08) == pytest.approx(0.1)
    assert generation_pause([log], 3.0, 4.0) == 0.0
