"""The weight wire format, shared by the trainer side (`wire_send`) and the
actors (`wire_receive`).

A state dict travels as a few large buckets plus a `Manifest` (name,
dtype, shape, bucket, offset, size and checksum of every tensor). Every
tensor starts at an `ALIGN`-aligned offset inside its bucket. The checksum
is XXH3-64: crc32 is several times slower and would cost a noticeable share
of every push on each side.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

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


def checksum(raw: np.ndarray) -> int:
    """XXH3-64 of `raw`'s bytes."""
    return _xxh3()(memoryview(raw))


@functools.cache
def _xxh3():
    # Imported on first use: the wire format needs it, an engine alone does not
    # (a GPU box running `python -m scripts.gpu_check` has no xxhash).
    import xxhash

    return xxhash.xxh3_64_intdigest
