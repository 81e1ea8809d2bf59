"""The weight wire format, shared by the trainer side and the actors.

A state dict travels as a few large contiguous byte buckets plus a
`Manifest` (name, dtype, shape, bucket, offset, size and checksum of every
tensor). The checksum is XXH3-64: it ran at 30 GB/s here against 6.4 GB/s
for crc32, which would have cost a fifth of a push on each side. Buckets
are plain uint8 arrays, which Ray's object store hands out
zero-copy; `unpack` turns received buckets back into tensors that are views
of those bytes, so an actor reads the weights where the store put them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

ALIGN = 64  # byte alignment of every tensor inside a bucket
DEFAULT_BUCKET_BYTES = 256 * 2**20

_DTYPES = {
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
    name: str  # the checkpoint (Hugging Face) name
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    bucket: int  # index of the bucket holding the bytes
    offset: int  # byte offset inside the bucket (ALIGN-aligned)
    nbytes: int
    checksum: int  # XXH3-64 of the tensor's bytes


@dataclass(frozen=True, slots=True)
class Manifest:
    entries: tuple[TensorEntry, ...]
    bucket_nbytes: tuple[int, ...]  # size of each bucket

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


class BucketPacker:
    """Trainer side: flattens state dicts into contiguous buckets.

    The bucket arrays are allocated on the first push and reused while the
    layout fits, so later pushes copy into warm memory (a copy into freshly
    allocated pages ran 30x slower here).
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes must be an int >= {ALIGN}, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self._buffers: list[np.ndarray] = []

    def pack(self, state_dict: Mapping[str, torch.Tensor]) -> tuple[list[np.ndarray], Manifest]:
        """Copy every tensor into the buckets; returns the buckets and their manifest.

        Raises `TypeError`/`ValueError` naming the entry for a non-string
        name, a non-tensor value or an unsupported dtype, before copying.
        """
        buckets, entries = [], []
        for _, bucket, bucket_entries in self.pack_buckets(state_dict):
            buckets.append(bucket)
            entries.extend(bucket_entries)
        return buckets, Manifest(tuple(entries), tuple(b.nbytes for b in buckets))

    def pack_buckets(
        self, state_dict: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[int, np.ndarray, tuple[TensorEntry, ...]]]:
        """Pack bucket by bucket, yielding `(index, bucket, its entries)` as each
        is ready, so a sender can ship one while the next is packed. The whole
        state dict is checked before the first copy."""
        layout, sizes = self._layout(_checked(state_dict))
        buffers = self._buffers_for(sizes)
        for index, bucket in enumerate(buffers):
            entries = []
            for name, tensor, offset in layout[index]:
                nbytes = tensor.numel() * tensor.element_size()
                dst = torch.from_numpy(bucket[offset : offset + nbytes])
                dst.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
                digest = checksum(bucket[offset : offset + nbytes])
                dtype = str(tensor.dtype).removeprefix("torch.")
                entries.append(TensorEntry(name, dtype, tuple(tensor.shape), index, offset, nbytes, digest))
            yield index, bucket, tuple(entries)

    def _layout(self, state_dict):
        """Per bucket, the (name, tensor, offset) it holds; and each bucket's size."""
        layout: list[list] = []
        sizes: list[int] = []
        used = self.bucket_bytes
        for name, tensor in state_dict.items():
            nbytes = tensor.numel() * tensor.element_size()
            offset = -(-used // ALIGN) * ALIGN
            if not sizes or offset + nbytes > max(self.bucket_bytes, sizes[-1]):
                layout.append([])
                sizes.append(0)
                offset = 0
            layout[-1].append((name, tensor, offset))
            used = offset + nbytes
            sizes[-1] = used
        return layout, sizes

    def _buffers_for(self, sizes: list[int]) -> list[np.ndarray]:
        if len(self._buffers) != len(sizes) or any(b.nbytes < s for b, s in zip(self._buffers, sizes, strict=True)):
            self._buffers = [np.empty(max(s, 1), dtype=np.uint8) for s in sizes]
        return [b[:s] for b, s in zip(self._buffers, sizes, strict=True)]


def _checked(state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of name -> tensor, got {type(state_dict).__name__}")
    if not state_dict:
        raise ValueError("state_dict is empty: nothing to push")
    for name, tensor in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"state_dict names must be strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}")
        if str(tensor.dtype).removeprefix("torch.") not in _DTYPES:
            raise TypeError(f"state_dict[{name!r}] has dtype {tensor.dtype}, not one of {sorted(_DTYPES)}")
    return state_dict


def checksum(raw: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(raw))


def verify(buckets: Sequence[np.ndarray], manifest: Manifest) -> None:
    """Check bucket sizes and every tensor's checksum; raises `ValueError` naming the first mismatch."""
    if len(buckets) != len(manifest.bucket_nbytes):
        raise ValueError(f"weight push has {len(buckets)} buckets, its manifest names {len(manifest.bucket_nbytes)}")
    for i, bucket in enumerate(buckets):
        verify_bucket(i, bucket, manifest)


def verify_bucket(index: int, bucket: np.ndarray, manifest: Manifest) -> None:
    """Check one bucket's size and the checksums of the tensors it holds."""
    if not 0 <= index < len(manifest.bucket_nbytes):
        raise ValueError(f"weight bucket {index} is not in the manifest ({len(manifest.bucket_nbytes)} buckets)")
    if bucket.nbytes != manifest.bucket_nbytes[index]:
        raise ValueError(
            f"weight bucket {index} has {bucket.nbytes} bytes, its manifest says {manifest.bucket_nbytes[index]}"
        )
    verify_entries(bucket, [e for e in manifest.entries if e.bucket == index])


def verify_entries(bucket: np.ndarray, entries: Sequence[TensorEntry]) -> None:
    """Check the checksums of `entries`, all held by `bucket`."""
    for e in entries:
        if e.offset + e.nbytes > bucket.nbytes:
            raise ValueError(f"weight push tensor {e.name!r} lies past the end of bucket {e.bucket}")
        if checksum(bucket[e.offset : e.offset + e.nbytes]) != e.checksum:
            raise ValueError(f"weight push tensor {e.name!r} fails its checksum (bucket {e.bucket}, offset {e.offset})")


def unpack(buckets: Sequence[np.ndarray], manifest: Manifest) -> dict[str, torch.Tensor]:
    """Tensors viewing the bucket bytes (no copy); read-only when the buckets are."""
    out = {}
    for index, bucket in enumerate(buckets):
        out.update(unpack_entries(bucket, [e for e in manifest.entries if e.bucket == index]))
    return {e.name: out[e.name] for e in manifest.entries}


def unpack_entries(bucket: np.ndarray, entries: Sequence[TensorEntry]) -> dict[str, torch.Tensor]:
    """The tensors of `entries`, all held by `bucket`, as views of its bytes."""
    return {
        e.name: _frombuffer(bucket[e.offset : e.offset + e.nbytes]).view(_DTYPES[e.dtype]).view(e.shape)
        for e in entries
    }


def _frombuffer(raw: np.ndarray) -> torch.Tensor:
    if raw.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if raw.flags.writeable:
        return torch.from_numpy(raw)
    # Object-store buffers are read-only; the engine only ever reads them.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)
