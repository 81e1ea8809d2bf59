"""The Ray rollout cluster: pushes reach every actor, in-flight modes, two-phase
rejection, concurrent callers and pushes, actor deaths mid-generate and mid-push."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import pytest
import ray
import torch

import rollout
from rollout import RolloutCluster, SamplingParams
from tests.factories import _randomize, hf_logprobs, pack_state

KW = dict(
    num_actors=2,
    num_cpus_per_actor=1,
    max_seq_len=256,
    kv_cache_tokens=8192,
    max_batch_size=64,
    timeout_s=120,
    stall_timeout_s=120,
    bucket_bytes=64 * 1024,  # several buckets, so both actors verify some
)
PROMPTS = [list(range(3, 3 + k)) for k in (5, 9, 17, 30, 6, 11, 2, 21)]
PARAMS = SamplingParams(n=3, max_tokens=16, ignore_eos=True, seed=4, logprobs_mode="raw")


@pytest.fixture(scope="module")
def policies(qwen2):
    """The policy at versions 0, 1 and 2."""
    out = [qwen2.hf]
    for seed in (99, 123):
        model = copy.deepcopy(qwen2.hf)
        _randomize(model, seed)
        out.append(model)
    return out


@pytest.fixture
def cluster(ray_session, qwen2):
    c = RolloutCluster(qwen2.path, **KW)
    yield c
    c.shutdown()


def assert_per_version(outs, policies, atol=1e-4):
    """Every token matches the policy of its recorded version (recompute semantics)."""
    for out in outs:
        for s in out.samples:
            assert s.versions == sorted(s.versions)
            refs = {v: hf_logprobs(policies[v], out.prompt_token_ids, s.token_ids) for v in set(s.versions)}
            for i, (lp, v) in enumerate(zip(s.logprobs, s.versions, strict=True)):
                assert abs(lp - refs[v][i].item()) < atol, f"token {i} of version {v}"


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_after_a_push_every_actor_serves_the_new_weights(cluster, policies, ray_session):
    assert cluster.policy_version() == 0
    assert_per_version(cluster.generate(PROMPTS, PARAMS), policies)
    assert cluster.push_weights(policies[1].state_dict()) == 1
    for slot in cluster._slots:  # ask each actor directly
        stream = slot.handle.generate_stream.remote([0, 1], PROMPTS[:2], PARAMS)
        outs = [ray_session.get(ref) for ref in stream]
        assert_per_version(outs, policies)
        assert {v for o in outs for s in o.samples for v in s.versions} == {1}
    outs = cluster.generate(PROMPTS, PARAMS)
    assert [o.index for o in outs] == list(range(len(PROMPTS)))
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert {v for o in outs for s in o.samples for v in s.versions} == {1}
    health = cluster.health()
    assert {h["version"] for h in health} == {1}
    assert [h["buckets_copied"] for h in health] == [0, 0]  # the object store laid every bucket out whole


def test_a_push_rejected_by_one_actor_commits_on_none(cluster, policies, ray_session):
    ray_session.get(cluster._slots[1].handle.inject_fault.remote("prepare_push", "disk on fire"))
    with pytest.raises(ValueError, match=r"actor 1 .* rejected weight push v1; no actor committed it: disk on fire"):
        cluster.push_weights(policies[1].state_dict())
    bad = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"q_proj.weight.*shape \(3, 3\)"):
        cluster.push_weights(bad)
    nan = policies[1].state_dict()
    _, manifest = pack_state(nan, KW["bucket_bytes"])
    for bucket in (0, 1):  # verified by actor 0 and actor 1
        name = next(e.name for e in manifest.entries if e.bucket == bucket)
        poisoned = dict(nan, **{name: nan[name].clone().fill_(float("nan"))})
        with pytest.raises(ValueError, match=rf"rejected weight push v1; no actor committed it: .*{name}.*NaN"):
            cluster.push_weights(poisoned)
    assert cluster.policy_version() == 0 and {h["version"] for h in cluster.health()} == {0}
    assert_per_version(cluster.generate(PROMPTS, PARAMS), policies)
    assert {v for o in cluster.generate(PROMPTS, PARAMS) for s in o.samples for v in s.versions} == {0}
    assert cluster.push_weights(policies[1].state_dict(), version=5) == 5  # works afterwards


@pytest.mark.parametrize("inflight", ["recompute", "keep", "drain", "restart"])
def test_inflight_modes_through_the_cluster(cluster, policies, inflight):
    params = SamplingParams(n=4, max_tokens=150, ignore_eos=True, seed=9, logprobs_mode="raw")
    handle = cluster.submit(PROMPTS, params)
    wait_until(lambda: all(h.get("running", 0) > 0 for h in cluster.health()))
    assert cluster.push_weights(policies[1].state_dict(), inflight=inflight) == 1
    outs = handle.result(120)
    versions = [s.versions for o in outs for s in o.samples]
    assert all(v == sorted(v) for v in versions)
    if inflight == "recompute":
        assert_per_version(outs, policies)
        assert any(len(set(v)) == 2 for v in versions)
    elif inflight == "keep":
        assert any(len(set(v)) == 2 for v in versions)
    elif inflight == "drain":
        assert all(set(v) == {0} for v in versions)  # everything was in flight: it finished on v0
    else:
        assert all(set(v) == {1} for v in versions)
        assert_per_version(outs, policies)
    assert_per_version(cluster.generate(PROMPTS[:2], PARAMS), policies)  # new work: v1


def test_concurrent_callers_with_concurrent_pushes(cluster, policies):
    results, errors = [], []

    def caller(seed):
        try:
            for k in range(2):
                results.extend(
                    cluster.generate(
                        PROMPTS, SamplingParams(n=2, max_tokens=40, seed=seed + k, ignore_eos=True, logprobs_mode="raw")
                    )
                )
        except Exception as e:  # reported below
            errors.append(e)

    def pusher():
        for model in policies[1:]:
            cluster.push_weights(model.state_dict())
            time.sleep(0.05)

    threads = [threading.Thread(target=caller, args=(s,)) for s in (1, 10, 20)] + [threading.Thread(target=pusher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(results) == 3 * 2 * len(PROMPTS) and cluster.policy_version() == 2
    assert_per_version(results, policies)


def test_actor_killed_mid_generate_loses_nothing(cluster, policies):
    cluster.push_weights(policies[1].state_dict())
    params = SamplingParams(n=3, max_tokens=160, ignore_eos=True, seed=5, logprobs_mode="raw")
    handle = cluster.submit(PROMPTS * 2, params)
    busy = []  # an actor seen generating: the victim (its share outlives a few polls at 160 tokens)

    def some_actor_generates() -> bool:
        busy.extend(h["pid"] for h in cluster.health() if h.get("running", 0) > 0)
        return bool(busy)

    wait_until(some_actor_generates)
    victim = busy[0]
    os.kill(victim, signal.SIGKILL)
    outs = handle.result(120)
    assert [o.index for o in outs] == list(range(2 * len(PROMPTS)))
    assert all(len(o.samples) == 3 and all(len(s.token_ids) == 160 for s in o.samples) for o in outs)
    assert {v for o in outs for s in o.samples for v in s.versions} == {1}
    assert_per_version(outs, policies)
    cluster.wait_until_healthy(120)
    health = cluster.health()
    assert victim not in [h["pid"] for h in health] and {h["version"] for h in health} == {1}
    assert_per_version(cluster.generate(PROMPTS, PARAMS), policies)


def test_a_background_push_has_the_weights_when_it_returns(cluster, policies):
    state = {k: v.clone() for k, v in policies[1].state_dict().items()}
    handle = cluster.push_weights(state, wait=False)
    for tensor in state.values():  # the trainer's next step overwrites its tensors at once
        tensor.fill_(float("nan"))
    assert handle.result(120) == 1
    assert_per_version(cluster.generate(PROMPTS, PARAMS), policies)


def test_a_push_that_fails_while_shipping_is_aborted_and_the_next_one_works(cluster, policies, monkeypatch):
    real_put, puts = ray.put, []

    def failing_put(value, **kwargs):
        puts.append(1)
        if len(puts) == 2:  # the first bucket has reached the actors already
            raise MemoryError("object store full")
        return real_put(value, **kwargs)

    monkeypatch.setattr(ray, "put", failing_put)
    with pytest.raises(MemoryError, match="object store full"):
        cluster.push_weights(policies[1].state_dict())
    monkeypatch.setattr(ray, "put", real_put)
    assert cluster.policy_version() == 0 and {h["version"] for h in cluster.health()} == {0}
    assert cluster.push_weights(policies[1].state_dict()) == 1
    assert_per_version(cluster.generate(PROMPTS, PARAMS), policies)


def test_push_while_an_actor_is_dead_neither_hangs_nor_splits_versions(cluster, policies):
    os.kill(cluster.health()[1]["pid"], signal.SIGKILL)
    handle = cluster.push_weights(policies[1].state_dict(), wait=False)
    assert handle.result(120) == 1
    cluster.wait_until_healthy(120)
    assert {h["version"] for h in cluster.health()} == {1}
    outs = cluster.generate(PROMPTS * 2, PARAMS)
    assert {v for o in outs for s in o.samples for v in s.versions} == {1}
    assert_per_version(outs, policies)


def test_actor_killed_during_a_push_all_actors_end_on_one_version(cluster, policies):
    victim = cluster.health()[0]["pid"]
    handle = cluster.push_weights(policies[1].state_dict(), wait=False)
    os.kill(victim, signal.SIGKILL)  # lands before, during or after the push: every case must converge
    version = handle.result(120)
    cluster.wait_until_healthy(120)
    assert version == 1 and {h["version"] for h in cluster.health()} == {1}
    outs = cluster.generate(PROMPTS * 2, PARAMS)
    assert {v for o in outs for s in o.samples for v in s.versions} == {1}
    assert_per_version(outs, policies)


def test_an_error_inside_an_actor_reaches_the_caller_with_its_cause(cluster, policies, ray_session):
    ray_session.get(cluster._slots[0].handle.inject_fault.remote("generate_stream", "engine exploded"))
    ray_session.get(cluster._slots[1].handle.inject_fault.remote("generate_stream", "engine exploded"))
    with pytest.raises(ValueError, match="engine exploded"):
        cluster.generate(PROMPTS, PARAMS, timeout=60)
    assert_per_version(cluster.generate(PROMPTS, PARAMS), policies)  # and the cluster keeps serving
    assert {h["state"] for h in cluster.health()} == {"alive"}


def test_as_completed_yields_every_prompt_once(cluster):
    handle = cluster.submit(PROMPTS, SamplingParams(n=2, max_tokens=30, seed=1, stop_token_ids=[10, 11, 12]))
    seen = [o.index for o in handle.as_completed(timeout=60)]
    assert sorted(seen) == list(range(len(PROMPTS)))
    assert handle.done() and [o.index for o in handle.result(1)] == list(range(len(PROMPTS)))


def test_module_level_api_and_reinit(ray_session, qwen2, policies):
    cluster = rollout.init(qwen2.path, **KW)
    try:
        with pytest.raises(RuntimeError, match="already"):
            rollout.init(qwen2.path, **KW)
        assert rollout.policy_version() == 0
        assert rollout.push_weights(policies[1].state_dict()) == 1 == cluster.policy_version()
        assert_per_version(rollout.generate(PROMPTS[:3], PARAMS), policies)
        assert len(rollout.health()) == 2
    finally:
        rollout.shutdown()
    with pytest.raises(RuntimeError, match="rollout.init"):
        rollout.generate(PROMPTS, PARAMS)
    with pytest.raises(ValueError, match="shut down"):
        cluster.generate(PROMPTS, PARAMS)
    with pytest.raises(ValueError, match="shut down"):
        cluster.push_weights(policies[1].state_dict())
    states = {pg["state"] for pg in ray_session.util.placement_group_table().values()}
    assert states <= {"REMOVED"}  # shutdown released the placement group
    rollout.init(qwen2.path, **KW)  # a second init in the same process works
    try:
        assert rollout.policy_version() == 0 and len(rollout.generate(PROMPTS[:2], PARAMS)) == 2
    finally:
        rollout.shutdown()


@pytest.mark.parametrize(
    "kwargs,error,needle",
    [
        (dict(num_actors=0), ValueError, "num_actors"),
        (dict(num_actors=True), TypeError, "num_actors"),
        (dict(num_gpus_per_actor=1), ValueError, "GPUs"),
        (dict(num_cpus_per_actor=64), ValueError, "CPUs"),
        (dict(timeout_s=0), ValueError, "timeout_s"),
        (dict(generate_concurrency=0), ValueError, "generate_concurrency"),
    ],
)
def test_cluster_arguments_are_validated(ray_session, qwen2, kwargs, error, needle):
    before = ray_session.util.placement_group_table()
    with pytest.raises(error, match=needle):
        RolloutCluster(qwen2.path, **{**KW, **kwargs})
    assert ray_session.util.placement_group_table() == before  # refused before reserving anything
