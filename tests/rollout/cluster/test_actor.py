"""RolloutWorker without Ray: receiving buckets as segments, who verifies them."""

from __future__ import annotations

import copy
import os
import sys
import threading

import pytest
import torch

from rollout.cluster.actor import RolloutWorker
from rollout.cluster.wire import Manifest
from rollout.cluster.wire_receive import VerifyShare, verification_shares
from rollout.cluster.wire_send import BucketPacker
from tests.factories import _randomize

ENGINE = dict(device="cpu", max_batch_size=8, max_seq_len=128, kv_cache_tokens=1024)


def _packed(state):
    packed = list(BucketPacker(bucket_bytes=1 << 16).pack_buckets(state))
    manifest = Manifest(tuple(e for p in packed for e in p.entries), tuple(p.nbytes for p in packed))
    return packed, manifest


def test_each_actor_verifies_its_share_and_prepare_verifies_orphans(qwen2):
    worker = RolloutWorker(qwen2.path, ENGINE)
    state = {k: v.clone() for k, v in qwen2.hf.state_dict().items()}
    bad = "model.layers.1.mlp.down_proj.weight"
    state[bad][3, 3] = float("nan")
    packed, manifest = _packed(state)
    assert len(packed) > 2
    hit = next(e.bucket for e in manifest.entries if e.name == bad)
    shares = verification_shares(packed[hit].entries, 2)
    mine = next(j for j in (0, 1) if bad not in {e.name for e in shares[j]})
    for p in packed:  # a node mate verifies the other share of each bucket
        worker.stage_bucket("push", p.index, p.entries, list(p.segments), share=(mine, 2))
    with pytest.raises(ValueError, match=f"{bad}.*NaN"):  # that actor died: this one verifies its share
        worker.prepare_push("push", manifest, verify=(VerifyShare(hit, 1 - mine, 2, True),))
    with pytest.raises(ValueError, match=f"{bad}.*NaN"):  # alone on its node: verifies everything
        worker.stage_bucket("again", hit, packed[hit].entries, list(packed[hit].segments))
    assert worker.engine.policy_version == 0


def test_verification_shares_split_a_bucket_by_bytes():
    packed, _ = _packed({f"l.{i}.weight": torch.zeros(n) for i, n in enumerate([4096, 1024, 1024, 1024, 512, 512])})
    entries = packed[0].entries
    shares = verification_shares(entries, 2)
    assert sorted(e.name for s in shares for e in s) == sorted(e.name for e in entries)
    assert [sum(e.nbytes for e in s) for s in shares] == [16384, 16384]
    assert verification_shares(entries, 1) == [entries]


def test_corrupt_segments_fail_their_checksum_and_good_pushes_commit(qwen2):
    worker = RolloutWorker(qwen2.path, ENGINE)
    policy = copy.deepcopy(qwen2.hf)
    _randomize(policy, seed=5)
    new = policy.state_dict()
    packed, manifest = _packed(new)
    segments = [s.copy() for s in packed[1].segments]
    segments[0][7] ^= 0xFF
    with pytest.raises(ValueError, match="fails its checksum"):
        worker.stage_bucket("push", 1, packed[1].entries, segments)
    # On the trainer's node the bytes are the put's own memory: only NaN/inf are checked.
    assert worker.stage_bucket("local", 1, packed[1].entries, segments, checksums=False) == packed[1].nbytes
    worker.abort_push("local")
    copied = worker.health()["buckets_copied"]
    for p in packed:
        worker.stage_bucket("good", p.index, p.entries, list(p.segments))
    assert worker.prepare_push("good", manifest) > 0
    assert worker.commit_push("good", 4, "recompute") == 4
    assert worker.health()["version"] == 4 and worker.health()["buckets_copied"] == copied + len(packed)
    model, p = worker.engine.model, "model.layers.0.self_attn."
    assert torch.equal(model.norm, new["model.norm.weight"])
    assert torch.equal(model.layers[0].qkv, torch.cat([new[p + f"{x}_proj.weight"] for x in "qkv"]))


def test_buckets_of_an_abandoned_push_do_not_linger(qwen2):
    worker = RolloutWorker(qwen2.path, ENGINE)
    packed, manifest = _packed(qwen2.hf.state_dict())
    worker.stage_bucket("old", 0, packed[0].entries, list(packed[0].segments))
    for p in packed:  # a newer push: the older one is over, its buckets are dropped
        worker.stage_bucket("new", p.index, p.entries, list(p.segments))
    with pytest.raises(ValueError, match="did not arrive intact"):
        worker.prepare_push("old", manifest)
    worker.abort_push("gone")
    worker.stage_bucket("gone", 0, packed[0].entries, list(packed[0].segments))  # late: ignored
    assert worker.prepare_push("new", manifest) > 0  # still whole
    with pytest.raises(ValueError, match=r"share must be \(part, parts\)"):
        worker.stage_bucket("new", 0, packed[0].entries, list(packed[0].segments), share=(2, 2))


def test_a_prepared_push_whose_driver_never_came_back_is_dropped_by_the_next(qwen2):
    worker = RolloutWorker(qwen2.path, ENGINE)
    packed, manifest = _packed(qwen2.hf.state_dict())
    for p in packed:
        worker.stage_bucket("interrupted", p.index, p.entries, list(p.segments))
    assert worker.staged_pushes() == 1
    worker.prepare_push("interrupted", manifest)  # its driver stopped here: no commit, no abort
    assert worker.health()["staged_pushes"] == 1
    worker.stage_bucket("next", 0, packed[0].entries, list(packed[0].segments))
    assert worker.staged_pushes() == 1  # only the new one
    with pytest.raises(KeyError):
        worker.commit_push("interrupted", 1, "recompute")
    for p in packed[1:]:
        worker.stage_bucket("next", p.index, p.entries, list(p.segments))
    worker.prepare_push("next", manifest)
    assert worker.commit_push("next", 1, "recompute") == 1 and worker.staged_pushes() == 0


def test_a_push_aborted_while_it_is_prepared_is_not_kept(qwen2, monkeypatch):
    worker = RolloutWorker(qwen2.path, ENGINE)
    packed, manifest = _packed(qwen2.hf.state_dict())
    for p in packed:
        worker.stage_bucket("push", p.index, p.entries, list(p.segments))
    prepare = worker.engine.prepare_weights

    def abort_meanwhile(*args, **kwargs):
        staged = prepare(*args, **kwargs)
        worker.abort_push("push")  # the driver's abort, on another control thread
        return staged

    monkeypatch.setattr(worker.engine, "prepare_weights", abort_meanwhile)
    with pytest.raises(ValueError, match="aborted while it was being prepared"):
        worker.prepare_push("push", manifest)
    assert worker.staged_pushes() == 0 and worker.engine.policy_version == 0


def test_verification_runs_on_a_thread_that_yields_to_generation(qwen2):
    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice values are a Linux feature")
    worker = RolloutWorker(qwen2.path, ENGINE)

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    here = priority()
    verifier = worker._background.submit(priority).result(10)
    assert verifier == min(here + 10, 19)  # the verifying thread yields
    assert priority() == here  # the calling thread (and generation) does not
