"""A hypothesis strategy for manifests another process might send (a valid
one with a few random changes: a field of an entry set to anything, a
reshape or same-width retype that keeps the bytes, a bucket's size), and
the format's rules written out plainly as the reference to check against."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import strategies as st

from rollout.cluster.wire import ALIGN, WIRE_DTYPES, Manifest

INTS = st.integers(-2 * ALIGN, 2200) | st.integers(-2, 36).map(lambda k: k * ALIGN) | st.sampled_from([2**64, -1])
ODD = st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=3)


def field_values(manifest: Manifest, dtypes: list[str]) -> dict[str, st.SearchStrategy]:
    """What each entry field may be set to: right-looking values and wrong kinds."""
    names = [e.name for e in manifest.entries]
    return {
        "name": st.sampled_from([*names, "", "x.new.weight"]) | ODD,
        "dtype": st.sampled_from([*dtypes, "complex64", "float8"]) | ODD,
        "shape": st.lists(st.integers(-2, 40), max_size=3).map(tuple) | st.lists(st.integers(0, 9), max_size=2) | ODD,
        "bucket": st.integers(-1, len(manifest.bucket_nbytes)) | ODD,
        "offset": INTS | ODD,
        "nbytes": INTS | ODD,
        "checksum": INTS | st.integers(0, 2**64 - 1) | ODD,
    }


@st.composite
def mutations(draw, manifest: Manifest, dtypes: list[str] | None = None) -> Manifest:
    """`manifest` with one to three random changes; dtypes are drawn from
    `dtypes` (default: every wire dtype)."""
    dtypes = dtypes or list(WIRE_DTYPES)
    fields = field_values(manifest, dtypes)
    entries, sizes = list(manifest.entries), list(manifest.bucket_nbytes)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(entries) - 1))
        kind = draw(st.sampled_from([*fields, "reshape", "retype", "bucket_nbytes"]))
        e = entries[i]
        if kind == "reshape" and isinstance(e.shape, tuple) and all(isinstance(d, int) for d in e.shape):
            entries[i] = dataclasses.replace(e, shape=(1, math.prod(e.shape)))
        elif kind == "retype" and e.dtype in WIRE_DTYPES:
            width = WIRE_DTYPES[e.dtype].itemsize
            same = [d for d in dtypes if WIRE_DTYPES[d].itemsize == width] or [e.dtype]
            entries[i] = dataclasses.replace(e, dtype=draw(st.sampled_from(same)))
        elif kind == "bucket_nbytes":
            sizes[i % len(sizes)] = draw(INTS)
        elif kind in fields:
            entries[i] = dataclasses.replace(e, **{kind: draw(fields[kind])})
    return Manifest(tuple(entries), tuple(sizes))


def follows_format(m: Manifest, sizes: tuple[int, ...]) -> bool:
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
