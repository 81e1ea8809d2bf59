"""A push manifest is validated whole before any view of a bucket is made:
each bad entry is a ValueError naming the entry and the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import event, given, settings

from rollout.cluster.wire import ALIGN, WIRE_DTYPES, Manifest, check_bucket_entries, check_manifest
from rollout.cluster.wire_receive import unpack, unpack_entries, verification_shares
from tests.factories import pack_state
from tests.rollout.cluster.manifest_mutations import follows_format, mutations


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    embed = torch.randn(16, 8, generator=g)
    return {
        "model.embed_tokens.weight": embed,
        "a.q.weight": torch.randn(24, 8, generator=g),
        "a.k.weight": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "a.k.bias": torch.randn(5, generator=g).to(torch.float16),
        "b.steps": torch.arange(7),
        "b.mask": torch.tensor([True, False, True]),
        "c.empty": torch.zeros(0, 4),
        "lm_head.weight": embed,  # tied: travels once, named twice
    }


STATE = _state()
BUCKETS, MANIFEST = pack_state(STATE, bucket_bytes=1024)


def _entry(name: str) -> int:
    return next(i for i, e in enumerate(MANIFEST.entries) if e.name == name)


def _mutated(target: str, changes: dict) -> Manifest:
    """`MANIFEST` with entry `target`'s fields changed, as another process might send it."""
    entries = list(MANIFEST.entries)
    i = _entry(target)
    entries[i] = dataclasses.replace(entries[i], **changes)
    return Manifest(tuple(entries), MANIFEST.bucket_nbytes)


def _receive(buckets, manifest: Manifest) -> dict[str, torch.Tensor]:
    """What an actor on the trainer's node does with a push (no checksums):
    check each bucket's entries as it arrives, split it into shares and view
    its entries, then view the whole push as the prepare step does."""
    for index, bucket in enumerate(buckets):
        entries = manifest.bucket_entries(index)
        check_bucket_entries(entries, bucket.nbytes)
        verification_shares(entries, 2)
        unpack_entries(bucket, entries)
    return unpack(buckets, manifest)


Q = MANIFEST.entries[_entry("a.q.weight")]
K = MANIFEST.entries[_entry("a.k.weight")]
BAD = {
    "negative offset": ("a.k.weight", dict(offset=-ALIGN), "'a.k.weight': offset must be an int >= 0, got -64"),
    "unaligned offset": (
        "a.k.weight",
        dict(offset=K.offset + 8),
        f"'a.k.weight': offset must be a multiple of {ALIGN}",
    ),
    "overlap": ("a.k.weight", dict(offset=Q.offset + ALIGN), "'a.k.weight': bytes .* overlap those of 'a.q.weight'"),
    "duplicate name": ("a.k.weight", dict(name="a.q.weight"), "'a.q.weight': name 'a.q.weight' appears twice"),
    "empty name": ("a.k.weight", dict(name=""), r"entry \d+: name must be a non-empty str, got ''"),
    "past the bucket": (
        "a.q.weight",
        dict(offset=MANIFEST.bucket_nbytes[Q.bucket] - ALIGN),
        "'a.q.weight': offset .* lies past the end of bucket",
    ),
    "bad dtype": ("a.k.weight", dict(dtype="complex64"), "'a.k.weight': dtype must be one of"),
    "negative dim": ("a.k.weight", dict(shape=(-5, -3)), r"'a.k.weight': shape must be a tuple of ints >= 0"),
    "nbytes": ("a.k.weight", dict(nbytes=K.nbytes + ALIGN), r"'a.k.weight': nbytes must be 30 \(numel x itemsize"),
    "checksum": ("a.k.weight", dict(checksum=2**64), r"'a.k.weight': checksum must be an XXH3-64 digest"),
    "bucket": ("a.k.weight", dict(bucket=len(BUCKETS)), f"'a.k.weight': bucket must be < {len(BUCKETS)}"),
    "alias apart": ("lm_head.weight", dict(checksum=1), "overlap those of"),
}


def test_the_packed_manifest_is_valid_and_round_trips():
    assert len(BUCKETS) >= 2 and check_manifest(MANIFEST) is MANIFEST
    out = _receive(BUCKETS, MANIFEST)
    assert sorted(out) == sorted(STATE)
    for name, tensor in STATE.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor)


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_entry_is_named_before_any_view(case):
    name, changes, needle = BAD[case]
    bad = _mutated(name, changes)
    with pytest.raises(ValueError, match=needle):
        _receive(BUCKETS, bad)
    with pytest.raises(ValueError, match=needle):
        check_manifest(bad)


@pytest.mark.parametrize(
    "sizes,needle",
    [
        (MANIFEST.bucket_nbytes[:-1], "bucket must be <"),
        ((-64, *MANIFEST.bucket_nbytes[1:]), r"bucket_nbytes\[0\] must be an int >= 0, a multiple of 64, got -64"),
        (list(MANIFEST.bucket_nbytes), "bucket_nbytes must be a tuple"),
        ((MANIFEST.bucket_nbytes[0] + ALIGN, *MANIFEST.bucket_nbytes[1:]), "the manifest says"),
    ],
)
def test_bucket_sizes_must_match_the_buckets(sizes, needle):
    with pytest.raises(ValueError, match=needle):
        unpack(BUCKETS, Manifest(MANIFEST.entries, sizes))


@settings(max_examples=150, deadline=None)
@given(mutations(MANIFEST))
def test_a_mutated_manifest_is_refused_with_value_error_or_round_trips_exactly(manifest):
    try:
        out = _receive(BUCKETS, manifest)
    except ValueError:
        event("refused")
        assert not follows_format(manifest, MANIFEST.bucket_nbytes)
        return
    event("accepted")
    assert follows_format(manifest, MANIFEST.bucket_nbytes)
    original = {(e.bucket, e.offset, e.dtype, e.shape): e.name for e in MANIFEST.entries}
    for e in manifest.entries:
        tensor = out[e.name]
        assert tensor.dtype == WIRE_DTYPES[e.dtype] and tuple(tensor.shape) == e.shape
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert raw == BUCKETS[e.bucket].tobytes()[e.offset : e.offset + e.nbytes]
        source = original.get((e.bucket, e.offset, e.dtype, e.shape))
        if source is not None:  # the bytes and their meaning untouched: the sender's tensor, exactly
            assert torch.equal(tensor, STATE[source])
