"""The receiving side of the weight wire format (see `wire`): a bucket made
whole from its segments, verified share by share, and viewed as tensors."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..checks import is_int
from .wire import WIRE_DTYPES, Manifest, TensorEntry, check_manifest, checksum


def assemble(segments: Sequence[np.ndarray]) -> tuple[np.ndarray, bool]:
    """The bucket `segments` make, as one read-only uint8 array, and whether
    it had to be copied together. Segments the object store laid side by
    side (one object) come back as a view of that memory; the view keeps
    every segment alive."""
    arrays = [np.asarray(s) for s in segments]
    for i, a in enumerate(arrays):
        if a.dtype != np.uint8 or a.ndim != 1:
            raise TypeError(f"weight bucket segment {i} must be a 1-D uint8 array, got {a.dtype} {a.shape}")
    nbytes = sum(a.nbytes for a in arrays)
    if not arrays or nbytes == 0:
        return np.zeros(0, dtype=np.uint8), False
    base, cursor = arrays[0].ctypes.data, 0
    for a in arrays:
        if a.ctypes.data != base + cursor or not a.flags.c_contiguous:
            whole = np.concatenate(arrays)
            whole.flags.writeable = False
            return whole, True
        cursor += a.nbytes
    view = np.lib.stride_tricks.as_strided(arrays[0], shape=(nbytes,), strides=(1,), writeable=False)
    return _Bucket.over(view, arrays), False


class _Bucket(np.ndarray):
    """A uint8 view spanning several arrays; holds them so their memory stays valid."""

    segments: tuple

    @classmethod
    def over(cls, view: np.ndarray, segments: list[np.ndarray]) -> _Bucket:
        """`view` as a bucket that keeps `segments` alive."""
        bucket = view.view(cls)
        bucket.segments = tuple(segments)
        return bucket


class VerifyShare(NamedTuple):
    """The share of one bucket that one actor verifies: share `part` of
    `verification_shares(bucket entries, parts)`; `checksums` False where
    the bytes never left the trainer's node (then only NaN/inf are checked)."""

    bucket: int
    part: int
    parts: int
    checksums: bool


def verification_shares(entries: Sequence[TensorEntry], parts: int) -> list[tuple[TensorEntry, ...]]:
    """`entries` split into `parts` shares of about equal bytes (largest
    first, each to the lightest share), in bucket order inside a share. The
    split is the same on every process, so actors that share an object
    store can each verify one share of a bucket. Names that share bytes
    (a tied `lm_head.weight`) are checked once."""
    if not is_int(parts) or parts < 1:
        raise ValueError(f"parts must be an int >= 1, got {parts!r}")
    loads, shares = [0] * parts, [[] for _ in range(parts)]
    for e in sorted(_distinct(entries), key=lambda e: (-e.nbytes, e.offset)):
        lightest = loads.index(min(loads))
        shares[lightest].append(e)
        loads[lightest] += e.nbytes
    return [tuple(sorted(share, key=lambda e: e.offset)) for share in shares]


def verify_entries(bucket: np.ndarray, entries: Sequence[TensorEntry]) -> None:
    """Check the checksums of `entries`, all held by `bucket` (checked by `wire.check_bucket_entries`)."""
    for e in _distinct(entries):
        if checksum(bucket[e.offset : e.offset + e.nbytes]) != e.checksum:
            raise ValueError(f"weight push tensor {e.name!r} fails its checksum (bucket {e.bucket}, offset {e.offset})")


def unpack(buckets: Sequence[np.ndarray], manifest: Manifest) -> dict[str, torch.Tensor]:
    """Tensors viewing the bucket bytes (no copy); read-only when the buckets
    are. The manifest is checked whole first (`wire.check_manifest`), and
    against the buckets' sizes: a bad one raises `ValueError` before any view."""
    check_manifest(manifest)
    sizes = tuple(b.nbytes for b in buckets)
    if sizes != manifest.bucket_nbytes:
        raise ValueError(f"weight push buckets hold {sizes} bytes, the manifest says {manifest.bucket_nbytes}")
    out = {}
    for index, bucket in enumerate(buckets):
        out.update(unpack_entries(bucket, manifest.bucket_entries(index)))
    return {e.name: out[e.name] for e in manifest.entries}


def unpack_entries(bucket: np.ndarray, entries: Sequence[TensorEntry]) -> dict[str, torch.Tensor]:
    """The tensors of `entries`, all held by `bucket`, as views of its bytes.
    They share one storage, so neighbours can be viewed as one tensor.
    `entries` must have passed `wire.check_bucket_entries` against `bucket`
    (the actor checks a bucket's entries as it arrives, `unpack` a whole manifest)."""
    whole = _frombuffer(bucket)
    return {e.name: whole.narrow(0, e.offset, e.nbytes).view(WIRE_DTYPES[e.dtype]).view(e.shape) for e in entries}


def _frombuffer(raw: np.ndarray) -> torch.Tensor:
    if raw.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(raw)


# Object-store buckets are read-only and torch warns when it views them; the
# engine only ever reads them. One targeted filter, set once: a
# catch_warnings() block around each view is not thread-safe, and actors
# receive buckets on several threads.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


def _distinct(entries: Sequence[TensorEntry]) -> list[TensorEntry]:
    """`entries` without the repeats of one already listed: same bytes, checksum, dtype and shape."""
    seen: set[tuple] = set()
    out = []
    for e in entries:
        key = (e.offset, e.nbytes, e.checksum, e.dtype, e.shape)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out
