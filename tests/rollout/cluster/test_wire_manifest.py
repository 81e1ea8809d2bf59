"""A push manifest is validated whole before any view of a bucket is made:
each bad entry is a ValueError naming the entry and the field."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from rollout.cluster.wire import ALIGN, WIRE_DTYPES, Manifest, check_manifest
from rollout.cluster.wire_receive import unpack, unpack_entries, verification_shares
from tests.factories import pack_state


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
    split each bucket into shares, view each bucket's entries, then view the
    whole push as the prepare step does."""
    for index, bucket in enumerate(buckets):
        entries = manifest.bucket_entries(index)
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


def _valid(m: Manifest, sizes: tuple[int, ...]) -> bool:
    """The format's rules, written out plainly (pairwise, no sorting): the
    reference the property holds the checks to."""

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if m.bucket_nbytes != sizes:
        return False
    for e in m.entries:
        if not (isinstance(e.name, str) and e.name and isinstance(e.dtype, str) and e.dtype in WIRE_DTYPES):
            return False
        if not (isinstance(e.shape, tuple) and all(is_int(d) and d >= 0 for d in e.shape)):
            return False
        if not all(is_int(v) for v in (e.bucket, e.offset, e.nbytes, e.checksum)):
            return False
        if not (0 <= e.bucket < len(sizes) and e.offset >= 0 and e.offset % ALIGN == 0 and 0 <= e.checksum < 2**64):
            return False
        if e.nbytes != math.prod(e.shape) * WIRE_DTYPES[e.dtype].itemsize or e.offset + e.nbytes > sizes[e.bucket]:
            return False
    if len({e.name for e in m.entries}) != len(m.entries):
        return False
    for a in m.entries:
        for b in m.entries:
            same = (a.offset, a.nbytes, a.dtype, a.shape, a.checksum) == (
                b.offset,
                b.nbytes,
                b.dtype,
                b.shape,
                b.checksum,
            )
            apart = a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
            if a is not b and a.bucket == b.bucket and a.nbytes and b.nbytes and not (apart or same):
                return False
    return True


_INTS = st.integers(-2 * ALIGN, 2200) | st.integers(-2, 36).map(lambda k: k * ALIGN) | st.sampled_from([2**64, -1])
_ODD = st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=3)
_FIELDS = {
    "name": st.sampled_from([*STATE, "", "x.new.weight"]) | _ODD,
    "dtype": st.sampled_from([*WIRE_DTYPES, "complex64", "float8"]) | _ODD,
    "shape": st.lists(st.integers(-2, 40), max_size=3).map(tuple) | st.lists(st.integers(0, 9), max_size=2) | _ODD,
    "bucket": st.integers(-1, len(BUCKETS)) | _ODD,
    "offset": _INTS | _ODD,
    "nbytes": _INTS | _ODD,
    "checksum": _INTS | st.integers(0, 2**64 - 1) | _ODD,
}


@st.composite
def _mutations(draw) -> Manifest:
    """`MANIFEST` with one to three random changes: a field of an entry, a
    reshape or same-width retype that keeps the bytes, or a bucket's size."""
    entries, sizes = list(MANIFEST.entries), list(MANIFEST.bucket_nbytes)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(entries) - 1))
        kind = draw(st.sampled_from([*_FIELDS, "reshape", "retype", "bucket_nbytes"]))
        e = entries[i]
        if kind == "reshape" and isinstance(e.shape, tuple) and all(isinstance(d, int) for d in e.shape):
            entries[i] = dataclasses.replace(e, shape=(1, math.prod(e.shape)))
        elif kind == "retype" and e.dtype in WIRE_DTYPES:
            width = WIRE_DTYPES[e.dtype].itemsize
            same = [d for d, t in WIRE_DTYPES.items() if t.itemsize == width]
            entries[i] = dataclasses.replace(e, dtype=draw(st.sampled_from(same)))
        elif kind == "bucket_nbytes":
            sizes[i % len(sizes)] = draw(_INTS)
        elif kind in _FIELDS:
            entries[i] = dataclasses.replace(e, **{kind: draw(_FIELDS[kind])})
    return Manifest(tuple(entries), tuple(sizes))


@settings(max_examples=150, deadline=None)
@given(_mutations())
def test_a_mutated_manifest_is_refused_with_value_error_or_round_trips_exactly(manifest):
    try:
        out = _receive(BUCKETS, manifest)
    except ValueError:
        event("refused")
        assert not _valid(manifest, MANIFEST.bucket_nbytes)
        return
    event("accepted")
    assert _valid(manifest, MANIFEST.bucket_nbytes)
    original = {(e.bucket, e.offset, e.dtype, e.shape): e.name for e in MANIFEST.entries}
    for e in manifest.entries:
        tensor = out[e.name]
        assert tensor.dtype == WIRE_DTYPES[e.dtype] and tuple(tensor.shape) == e.shape
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert raw == BUCKETS[e.bucket].tobytes()[e.offset : e.offset + e.nbytes]
        source = original.get((e.bucket, e.offset, e.dtype, e.shape))
        if source is not None:  # the bytes and their meaning untouched: the sender's tensor, exactly
            assert torch.equal(tensor, STATE[source])
