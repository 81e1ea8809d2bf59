"""Delta pushes through the wire and the cluster: every actor ends with the
trainer's cast weights bit for bit, a replacement too, and a bad or missing
delta bucket commits nowhere."""

from __future__ import annotations

import copy
import os
import signal

import peft
import pytest
import torch

from rollout import RolloutCluster
from rollout.cluster.actor import RolloutWorker
from rollout.cluster.actor_slots import ActorGone
from rollout.cluster.wire import Manifest
from rollout.cluster.wire_send import BucketPacker
from rollout.engine.delta_encoder import DeltaEncoder
from tests.conftest import make_engine
from tests.rollout.engine.test_weight_delta import PARAMS, PROMPTS, _samples, _train_steps, assert_holds
from trainer_bridge import TrainerBridge
from trainer_bridge.lora import export_adapters
from trainer_bridge.names import export_state_dict

BF16 = torch.bfloat16
ENGINE = dict(device="cpu", max_batch_size=8, max_seq_len=128, kv_cache_tokens=1024, dtype="bfloat16")


def _packed(state):
    packed = list(BucketPacker(bucket_bytes=1 << 15).pack_buckets(state))
    manifest = Manifest(tuple(e for p in packed for e in p.entries), tuple(p.nbytes for p in packed))
    return packed, manifest


def test_a_corrupt_or_missing_delta_bucket_commits_nothing(qwen2):
    worker = RolloutWorker(qwen2.path, ENGINE)
    model = copy.deepcopy(qwen2.hf).train()
    enc = DeltaEncoder()
    first = enc.encode(export_state_dict(qwen2.hf, BF16), base=0)
    packed, manifest = _packed(first.state_dict)
    for p in packed:
        worker.stage_bucket("first", p.index, p.entries, list(p.segments))
    worker.prepare_push("first", manifest)
    assert worker.commit_push("first", 1, "keep") == 1
    enc.commit(first)
    next(_train_steps(model, steps=1, lr=3e-4, seed=5))
    cast = export_state_dict(model, BF16)
    delta = enc.encode(cast, base=1)
    assert delta.cost.encoding == "delta"
    packed, manifest = _packed(delta.state_dict)
    assert len(packed) > 1
    before = export_state_dict(qwen2.hf, BF16)
    segments = [s.copy() for s in packed[0].segments]
    segments[0][3] ^= 0x10
    with pytest.raises(ValueError, match="fails its checksum"):
        worker.stage_bucket("bad", 0, packed[0].entries, segments)
    for p in packed[1:]:
        worker.stage_bucket("bad", p.index, p.entries, list(p.segments))
    with pytest.raises(ValueError, match="bucket 0 did not arrive intact"):  # missing: nothing staged
        worker.prepare_push("bad", manifest)
    assert worker.engine.policy_version == 1
    assert_holds(worker.engine, before)
    for p in packed:
        worker.stage_bucket("good", p.index, p.entries, list(p.segments))
    worker.prepare_push("good", manifest)
    assert worker.commit_push("good", 2, "keep") == 2
    assert_holds(worker.engine, cast)


def _actor_samples(cluster, ray_session):
    out = []
    for slot in cluster._slots:  # each actor asked directly
        stream = slot.handle.generate_stream.remote(list(range(len(PROMPTS))), PROMPTS, PARAMS)
        outs = [ray_session.get(ref) for ref in stream]
        out.append(([[(s.token_ids, s.logprobs) for s in o.samples] for o in outs], outs))
    return out


def _kill_and_replace(cluster, index: int) -> None:
    victim, dead_pid = cluster._slots[index], cluster._slots[index].pid
    os.kill(dead_pid, signal.SIGKILL)
    # The cluster learns of a death from a call that fails; this one starts the replacement.
    [(_, gone)] = cluster._pool.call_all([victim], "policy_version", (), "answering after SIGKILL")
    assert isinstance(gone, ActorGone)
    cluster.wait_until_healthy(120)
    assert dead_pid not in [h["pid"] for h in cluster.health()]


def test_delta_and_adapter_pushes_failovers_and_sleep_on_a_cluster(ray_session, qwen2):
    kw = {k: v for k, v in ENGINE.items() if k != "device"}
    cluster = RolloutCluster(qwen2.path, num_actors=2, num_cpus_per_actor=1, timeout_s=120, bucket_bytes=1 << 15, **kw)
    try:
        bridge = TrainerBridge(cluster)
        model = copy.deepcopy(qwen2.hf).train()
        steps = _train_steps(model, steps=3, lr=3e-4, seed=7)
        for round_ in range(3):
            next(steps)
            assert bridge.push(model, delta=True) == round_ + 1
            cost = cluster.last_push
            assert (cost.encoding == "delta") == (round_ > 0) and cost.bytes_sent <= cost.bytes_full
            if round_ == 1:  # an actor dies between two delta pushes
                _kill_and_replace(cluster, 0)
        cast = export_state_dict(model, BF16)
        assert cluster.reference_bytes == sum(t.nbytes for t in cast.values())
        fresh = make_engine(qwen2.path, **ENGINE)
        fresh.update_weights(cast)
        expected = _samples(fresh)
        for samples, outs in _actor_samples(cluster, ray_session):
            assert samples == expected
            assert {v for o in outs for s in o.samples for v in s.versions} == {3}
        # Colocated: the actors sleep while the trainer steps; the push after level 2 goes whole.
        cluster.sleep(level=2)
        with pytest.raises(Exception, match="asleep"):
            cluster.generate(PROMPTS, PARAMS)
        next(_train_steps(model, steps=1, lr=3e-4, seed=9))
        assert bridge.push(model, delta=True) == 4 and cluster.last_push.encoding == "full"
        cluster.wake_up(["kv_cache"])
        fresh.update_weights(export_state_dict(model, BF16))
        expected = _samples(fresh)
        assert [samples for samples, _ in _actor_samples(cluster, ray_session)] == [expected, expected]
        with pytest.raises(ValueError, match="tags must be None or a list"):
            cluster.wake_up(["gpu"])
        assert [slot.replacements for slot in cluster._slots] == [1, 0]  # sleeping is no failure
        # Adapters over those weights, then a failover: the replacement merges them over the same base.
        lora = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj"]))
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        assert bridge.push(lora) == 5 and cluster.last_push.encoding == "lora"
        _kill_and_replace(cluster, 1)
        fresh.update_weights(export_adapters(lora))
        expected = _samples(fresh)
        assert [samples for samples, _ in _actor_samples(cluster, ray_session)] == [expected, expected]
    finally:
        cluster.shutdown()
