"""The weight wire format, shared by the trainer side (`wire_send`) and the
actors (`wire_receive`).

A state dict travels as a few large buckets plus a `Manifest` (name,
dtype, shape, bucket, offset, size and checksum of every tensor). Every
tensor starts at an `ALIGN`-aligned offset inside its bucket. The checksum
is XXH3-64: crc32 is several times slower and would cost a noticeable share
of every push on each side.

A manifest is data from another process: `check_manifest` (a whole push)
and `check_bucket_entries` (one bucket's entries) validate it before any
view of a bucket is made, and `wire_receive` calls them on every path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import is_int

ALIGN = 64  # byte alignment of every tensor and segment inside a bucket

WIRE_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one named tensor lies in a push, and how to check its bytes."""

    name: str  # the checkpoint (Hugging Face) name
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    bucket: int  # index of the bucket holding the bytes
    offset: int  # byte offset inside the bucket (ALIGN-aligned)
    nbytes: int
    checksum: int  # XXH3-64 of the tensor's bytes


@dataclass(frozen=True, slots=True)
class Manifest:
    """Every tensor of a push and the size of every bucket."""

    entries: tuple[TensorEntry, ...]
    bucket_nbytes: tuple[int, ...]  # size of each bucket

    @property
    def total_bytes(self) -> int:
        """Bytes of every named tensor (names that share memory count each time)."""
        return sum(e.nbytes for e in self.entries)

    def bucket_entries(self, index: int) -> tuple[TensorEntry, ...]:
        """The entries of bucket `index`, in manifest order."""
        return tuple(e for e in self.entries if e.bucket == index)


def check_state_dict(state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """`state_dict` if it can travel; `TypeError`/`ValueError` naming the first entry that cannot."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of name -> tensor, got {type(state_dict).__name__}")
    if not state_dict:
        raise ValueError("state_dict is empty: nothing to push")
    for name, tensor in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"state_dict names must be strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}")
        if str(tensor.dtype).removeprefix("torch.") not in WIRE_DTYPES:
            raise TypeError(f"state_dict[{name!r}] has dtype {tensor.dtype}, not one of {sorted(WIRE_DTYPES)}")
        if tensor.layout != torch.strided or tensor.is_meta:
            raise TypeError(
                f"state_dict[{name!r}] must be a dense tensor with data, got layout {tensor.layout} on {tensor.device}"
            )
    return state_dict


def check_manifest(manifest: Manifest) -> Manifest:
    """`manifest` if it is whole and consistent, else `ValueError` naming
    the entry and field: every entry well formed (`check_bucket_entries`)
    and inside a bucket `bucket_nbytes` lists, every name once."""
    if not isinstance(manifest, Manifest):
        raise TypeError(f"a weight push manifest must be a Manifest, got {type(manifest).__name__}")
    sizes, entries = manifest.bucket_nbytes, manifest.entries
    if not isinstance(sizes, tuple):
        raise ValueError(f"weight push manifest bucket_nbytes must be a tuple, got {type(sizes).__name__}")
    for index, n in enumerate(sizes):
        if not is_int(n) or n < 0 or n % ALIGN:
            raise ValueError(
                f"weight push manifest bucket_nbytes[{index}] must be an int >= 0, a multiple of {ALIGN}, got {n!r}"
            )
    if not isinstance(entries, tuple):
        raise ValueError(f"weight push manifest entries must be a tuple, got {type(entries).__name__}")
    buckets: dict[int, list[TensorEntry]] = {}
    for i, e in enumerate(entries):
        _check_entry(e, i)
        if e.bucket >= len(sizes):
            raise ValueError(f"{_where(e, i)}: bucket must be < {len(sizes)} (the buckets listed), got {e.bucket}")
        buckets.setdefault(e.bucket, []).append(e)
    for index, bucket_entries in buckets.items():
        _check_bucket(bucket_entries, sizes[index])
    _check_unique(entries)
    return manifest


def check_bucket_entries(entries: Sequence[TensorEntry], nbytes: int | None = None) -> None:
    """`ValueError` naming the entry and field unless `entries` are one
    bucket's: each well formed (a name, a wire dtype, a shape of ints >= 0,
    an `ALIGN`-aligned offset >= 0, nbytes = numel x itemsize, a 64-bit
    checksum), all in one bucket, names unique, no two overlapping (names of
    one shared tensor, same place and checksum, may) and, given the bucket's
    size `nbytes`, all inside it."""
    if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)):
        raise ValueError(f"weight push bucket entries must be a sequence, got {type(entries).__name__}")
    for i, e in enumerate(entries):
        _check_entry(e, i)
    _check_bucket(entries, nbytes)


def _check_bucket(entries: Sequence[TensorEntry], nbytes: int | None) -> None:
    """How well-formed entries lie in one bucket: `check_bucket_entries` past the fields."""
    for i, e in enumerate(entries):
        if e.bucket != entries[0].bucket:
            raise ValueError(
                f"{_where(e, i)}: bucket is {e.bucket}, its bucket's other entries say {entries[0].bucket}"
            )
        if nbytes is not None and e.offset + e.nbytes > nbytes:
            raise ValueError(
                f"{_where(e, i)}: offset {e.offset} + nbytes {e.nbytes} lies past the end of bucket {e.bucket} "
                f"({nbytes} bytes)"
            )
    _check_unique(entries)
    _check_disjoint(entries)


def _check_entry(e: object, i: int) -> None:
    """One entry's fields, each of the right kind and range."""
    if not isinstance(e, TensorEntry):
        raise ValueError(f"weight push manifest entry {i} must be a TensorEntry, got {type(e).__name__}")
    where = _where(e, i)
    if not isinstance(e.name, str) or not e.name:
        raise ValueError(f"{where}: name must be a non-empty str, got {e.name!r}")
    if not isinstance(e.dtype, str) or e.dtype not in WIRE_DTYPES:
        raise ValueError(f"{where}: dtype must be one of {sorted(WIRE_DTYPES)}, got {e.dtype!r}")
    if not isinstance(e.shape, tuple) or not all(is_int(d) and d >= 0 for d in e.shape):
        raise ValueError(f"{where}: shape must be a tuple of ints >= 0, got {e.shape!r}")
    for field in ("bucket", "offset"):
        if not is_int(getattr(e, field)) or getattr(e, field) < 0:
            raise ValueError(f"{where}: {field} must be an int >= 0, got {getattr(e, field)!r}")
    if e.offset % ALIGN:
        raise ValueError(f"{where}: offset must be a multiple of {ALIGN}, got {e.offset}")
    expected = math.prod(e.shape) * WIRE_DTYPES[e.dtype].itemsize
    if not is_int(e.nbytes) or e.nbytes != expected:
        raise ValueError(
            f"{where}: nbytes must be {expected} (numel x itemsize of {e.dtype} {e.shape}), got {e.nbytes!r}"
        )
    if not is_int(e.checksum) or not 0 <= e.checksum < 2**64:
        raise ValueError(f"{where}: checksum must be an XXH3-64 digest (an int in [0, 2**64)), got {e.checksum!r}")


def _check_unique(entries: Sequence[TensorEntry]) -> None:
    seen: set[str] = set()
    for i, e in enumerate(entries):
        if e.name in seen:
            raise ValueError(f"{_where(e, i)}: name {e.name!r} appears twice; each tensor is named once")
        seen.add(e.name)


def _check_disjoint(entries: Sequence[TensorEntry]) -> None:
    """No two entries share bytes unless they name one tensor (a tied head):
    same offset, size, dtype, shape and checksum."""
    last: TensorEntry | None = None  # the entry reaching furthest so far, in offset order
    for e in sorted((e for e in entries if e.nbytes), key=lambda e: (e.offset, e.nbytes)):
        if last is not None and e.offset < last.offset + last.nbytes and _region(e) != _region(last):
            raise ValueError(
                f"weight push entry {e.name!r}: bytes {e.offset}..{e.offset + e.nbytes} overlap those of "
                f"{last.name!r} ({last.offset}..{last.offset + last.nbytes}) in bucket {e.bucket}"
            )
        if last is None or e.offset + e.nbytes >= last.offset + last.nbytes:
            last = e


def _region(e: TensorEntry) -> tuple:
    return (e.offset, e.nbytes, e.dtype, e.shape, e.checksum)


def _where(e: TensorEntry, i: int) -> str:
    return f"weight push entry {e.name!r}" if isinstance(e.name, str) and e.name else f"weight push entry {i}"


def checksum(raw: np.ndarray) -> int:
    """XXH3-64 of `raw`'s bytes."""
    return _xxh3()(memoryview(raw))


@functools.cache
def _xxh3():
    # Imported on first use: the wire format needs it, an engine alone does not
    # (a GPU box running `python -m scripts.gpu_check` has no xxhash).
    import xxhash

    return xxhash.xxh3_64_intdigest
