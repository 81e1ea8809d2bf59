"""A bad manifest on the trainer's node (no checksums there): the actor
refuses it with a ValueError naming the entry and field, and nothing of the
push reaches the engine."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from rollout.cluster.actor import RolloutWorker
from rollout.cluster.wire import ALIGN, Manifest
from rollout.cluster.wire_send import BucketPacker
from tests.factories import _randomize

ENGINE = dict(device="cpu", max_batch_size=2, max_seq_len=32, kv_cache_tokens=256)
NORM = "model.layers.1.post_attention_layernorm.weight"  # in the last bucket: the ones before it stage fine
OTHER = "model.layers.1.input_layernorm.weight"  # same bucket, same shape
HEAD = "lm_head.weight"  # last in that bucket: moved past its end, it overlaps nothing


@pytest.fixture(scope="module")
def worker(qwen2):
    return RolloutWorker(qwen2.path, ENGINE)


@pytest.fixture(scope="module")
def push(qwen2):
    """A new policy's state dict, packed: its buckets (as segments) and manifest."""
    policy = type(qwen2.hf)(qwen2.hf.config)
    _randomize(policy, seed=9)
    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    packed = list(BucketPacker(bucket_bytes=1 << 16).pack_buckets(state))
    manifest = Manifest(tuple(e for p in packed for e in p.entries), tuple(p.nbytes for p in packed))
    return state, packed, manifest


def _stage(worker: RolloutWorker, push_id: str, packed, manifest: Manifest) -> list[str]:
    """Stage every bucket as the trainer's node does (checksums=False); the
    refusals, as the driver collects each actor call's failure."""
    refused = []
    for p in packed:
        try:
            worker.stage_bucket(push_id, p.index, manifest.bucket_entries(p.index), list(p.segments), checksums=False)
        except ValueError as e:
            refused.append(str(e))
    return refused


def _bad(manifest: Manifest, target: str, changes: dict) -> Manifest:
    entries = [dataclasses.replace(e, **changes) if e.name == target else e for e in manifest.entries]
    return Manifest(tuple(entries), manifest.bucket_nbytes)


def _cases(manifest: Manifest) -> dict:
    norm = next(e for e in manifest.entries if e.name == NORM)
    assert next(e for e in manifest.entries if e.name == HEAD).bucket == norm.bucket
    other = next(e for e in manifest.entries if e.name == OTHER)
    end = manifest.bucket_nbytes[norm.bucket]
    return {
        "negative offset": (dict(offset=-4 * ALIGN), f"'{NORM}': offset must be an int >= 0"),
        "overlap": (dict(offset=other.offset), f"'{NORM}': bytes .* overlap those of '{OTHER}'"),
        "duplicate name": (dict(name=OTHER), f"'{OTHER}': name '{OTHER}' appears twice"),
        "past the bucket": (dict(offset=end - ALIGN), f"'{HEAD}': offset {end - ALIGN} .* past the end of bucket"),
        "bad dtype": (dict(dtype="complex64"), f"'{NORM}': dtype must be one of"),
        "negative dim": (dict(shape=(-64,)), f"'{NORM}': shape must be a tuple of ints >= 0"),
        "nbytes": (dict(nbytes=norm.nbytes + ALIGN), rf"'{NORM}': nbytes must be {norm.nbytes} \(numel x itemsize"),
    }


CASES = ["negative offset", "overlap", "duplicate name", "past the bucket", "bad dtype", "negative dim", "nbytes"]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_manifest_is_refused_and_nothing_is_staged(worker, push, case):
    state, packed, manifest = push
    changes, needle = _cases(manifest)[case]
    before = {n: s.view().clone() for n, s in worker.engine.model.weight_slots().items()}
    version = worker.engine.policy_version
    bad = _bad(manifest, HEAD if case == "past the bucket" else NORM, changes)
    refused = _stage(worker, f"bad-{case}", packed, bad)
    assert len(refused) == 1 and re.search(needle, refused[0]), refused
    with pytest.raises(ValueError, match="bucket 6 did not arrive intact"):  # the sender goes on regardless
        worker.prepare_push(f"bad-{case}", bad)
    worker.abort_push(f"bad-{case}")  # what the driver does with a refused push
    assert worker.engine.policy_version == version
    for name, slot in worker.engine.model.weight_slots().items():
        assert torch.equal(slot.view(), before[name]), name
    # The same buckets with their true manifest still go through: the actor is not left half-way.
    assert _stage(worker, f"good-{case}", packed, manifest) == []
    assert worker.prepare_push(f"good-{case}", manifest) > 0
    assert worker.commit_push(f"good-{case}", version + 1, "recompute") == version + 1
    assert torch.equal(worker.engine.model.weight_slots()[NORM].view(), state[NORM])
