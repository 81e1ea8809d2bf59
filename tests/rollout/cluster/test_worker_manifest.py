"""A bad manifest, on the trainer's node (no checksums there) or across
nodes: the actor refuses it with a ValueError naming the entry and field,
and nothing of the push reaches the engine."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rollout.cluster.actor import RolloutWorker
from rollout.cluster.wire import ALIGN, WIRE_DTYPES, Manifest
from rollout.cluster.wire_send import BucketPacker
from tests.factories import _randomize
from tests.rollout.cluster.manifest_mutations import follows_format, mutations

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


def _stage(worker: RolloutWorker, push_id: str, packed, manifest: Manifest, checksums: bool = False) -> list[str]:
    """Stage every bucket as the trainer's node does (checksums=False) or
    another node (True); the refusals, as the driver collects each actor
    call's failure."""
    refused = []
    for p in packed:
        try:
            worker.stage_bucket(
                push_id, p.index, manifest.bucket_entries(p.index), list(p.segments), checksums=checksums
            )
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


@pytest.mark.parametrize("checksums", [False, True], ids=["same node", "across nodes"])
@pytest.mark.parametrize("case", CASES)
def test_a_bad_manifest_is_refused_and_nothing_is_staged(worker, push, case, checksums):
    state, packed, manifest = push
    changes, needle = _cases(manifest)[case]
    before = {n: s.view().clone() for n, s in worker.engine.model.weight_slots().items()}
    version = worker.engine.policy_version
    bad = _bad(manifest, HEAD if case == "past the bucket" else NORM, changes)
    refused = _stage(worker, f"bad-{case}-{checksums}", packed, bad, checksums)
    assert len(refused) == 1 and re.search(needle, refused[0]), refused
    with pytest.raises(ValueError, match=f"bucket {len(packed) - 1} did not arrive intact"):  # the sender goes on
        worker.prepare_push(f"bad-{case}-{checksums}", bad)
    worker.abort_push(f"bad-{case}-{checksums}")  # what the driver does with a refused push
    assert worker.engine.policy_version == version
    for name, slot in worker.engine.model.weight_slots().items():
        assert torch.equal(slot.view(), before[name]), name
    # The same buckets with their true manifest still go through: the actor is not left half-way.
    assert _stage(worker, f"good-{case}-{checksums}", packed, manifest) == []
    assert worker.prepare_push(f"good-{case}-{checksums}", manifest) > 0
    assert worker.commit_push(f"good-{case}-{checksums}", version + 1, "recompute") == version + 1
    assert torch.equal(worker.engine.model.weight_slots()[NORM].view(), state[NORM])


def _expected(buckets: list[bytes], manifest: Manifest, name: str, like: torch.Tensor) -> torch.Tensor:
    """The tensor `manifest` says `name` is, read from the raw bytes (not through the wire's views)."""
    e = next(e for e in manifest.entries if e.name == name)
    raw = bytearray(buckets[e.bucket][e.offset : e.offset + e.nbytes])
    tensor = torch.frombuffer(raw, dtype=WIRE_DTYPES[e.dtype]) if raw else torch.zeros(0, dtype=WIRE_DTYPES[e.dtype])
    return tensor.reshape(e.shape).to(like.dtype)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_push_is_refused_whole_or_installed_exactly(worker, push, data):
    """Any mutation: a ValueError and the engine untouched, or the push
    committed with every named weight equal to the bytes its entry names."""
    _, packed, manifest = push
    bad = data.draw(mutations(manifest, dtypes=["float32"]))  # the engine takes floating-point weights only
    before = {n: s.view().clone() for n, s in worker.engine.model.weight_slots().items()}
    version, push_id = worker.engine.policy_version, f"p{worker.engine.policy_version}-{id(bad)}"
    refused = _stage(worker, push_id, packed, bad)
    try:
        worker.prepare_push(push_id, bad)
    except ValueError:
        event("refused")
        worker.abort_push(push_id)
        assert worker.engine.policy_version == version
        assert all(torch.equal(s.view(), before[n]) for n, s in worker.engine.model.weight_slots().items())
        return
    event("installed")
    assert not refused
    worker.commit_push(push_id, version + 1, "recompute")
    assert follows_format(bad, manifest.bucket_nbytes)
    raw = [b"".join(s.tobytes() for s in p.segments) for p in packed]  # each bucket's bytes, side by side
    named = {e.name for e in bad.entries}
    for name, slot in worker.engine.model.weight_slots().items():
        want = _expected(raw, bad, name, before[name]) if name in named else before[name]
        assert torch.equal(slot.view(), want), name
