"""The sending side of the weight wire format (see `wire`): `BucketPacker`
lays a state dict out as buckets of segments, ready for the object store.

A bucket is one object-store object and one contiguous run of bytes on
arrival, but the trainer never copies it together: the packer hands the
object store the bucket's *segments*, each a uint8 view of one tensor in
place, and the store's single copy lays them side by side (Ray 2.x puts
out-of-band buffers of at least 2 KiB at 64-byte alignment, and every
segment is a multiple of 64 bytes and at least that long). Tensors that
cannot be viewed in place (on a device, strided, small or of odd size) are
copied into reusable host scratch segments. Putting the segments beats
copying the state dict into one buffer and putting that: the store's copy
is then the only one, and its cost per buffer is small. On the receiving
side, `wire_receive.assemble` checks the layout and returns the bucket
zero-copy, or copies it together when a transport laid the segments out
otherwise.

Names are ordered so that the sibling tensors an engine fuses (q/k/v,
gate/up) lie next to each other in the bucket: an engine on the host can
then adopt them as one fused parameter without a copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import is_int
from .wire import ALIGN, TensorEntry, check_state_dict, checksum

SEGMENT_MIN = 2048  # smallest segment: Ray aligns smaller out-of-band buffers to 8 bytes only
DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class WireBucket:
    """One packed bucket, ready to put into the object store."""

    index: int  # position in the manifest
    segments: tuple[np.ndarray, ...]  # uint8 arrays that, side by side, make the bucket
    nbytes: int  # bucket size: the sum of the segment sizes
    pending: Future  # the entries, while their checksums are computed

    @property
    def entries(self) -> tuple[TensorEntry, ...]:
        """The tensors it holds, with their checksums (waits for them)."""
        return self.pending.result()


@dataclass(slots=True)
class _Segment:
    """Layout of one segment: a tensor sent in place, or a run of copied tensors."""

    offset: int  # byte offset inside the bucket
    nbytes: int  # size, padded to ALIGN (and to SEGMENT_MIN once closed)
    tensors: list[tuple[str, torch.Tensor, int]]  # (name, tensor, byte offset inside the bucket)
    in_place: bool = False  # one tensor, viewed where it lies


class BucketPacker:
    """Trainer side: lays state dicts out as buckets of segments.

    Contiguous host tensors whose size is a multiple of `ALIGN` and at
    least `SEGMENT_MIN` bytes go out in place; the rest are copied into
    scratch segments, allocated on the first push and reused while the
    layout fits (copying into freshly allocated pages is far slower than
    into pages that are already mapped).
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if not is_int(bucket_bytes) or bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes must be an int >= {ALIGN}, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self._scratch: list[np.ndarray] = []  # per bucket: host memory of its copied tensors

    def pack_buckets(self, state_dict: Mapping[str, torch.Tensor]) -> Iterator[WireBucket]:
        """Pack bucket by bucket, yielding each as soon as its segments are
        ready: its checksums are computed on a helper thread (XXH3 releases
        the GIL) while the caller puts the segments, and `entries` waits for
        them. The segments view the caller's tensors: they must not change
        until the buckets are put.

        The whole state dict is checked before anything is copied: a
        non-string name, a non-tensor value or an unsupported dtype raises
        `TypeError`/`ValueError` naming the entry.
        """
        state_dict, aliases = _shared(check_state_dict(state_dict))
        layout = self._layout(state_dict)
        scratch = self._scratch_for([sum(s.nbytes for s in b if not s.in_place) for b in layout])
        with ThreadPoolExecutor(1, thread_name_prefix="rollout-pack") as pool:
            for index, segments in enumerate(layout):
                arrays, placed = _fill(segments, scratch[index])
                entries = pool.submit(_entries, index, placed, aliases)
                yield WireBucket(index, arrays, sum(a.nbytes for a in arrays), entries)

    def _layout(self, state_dict: Mapping[str, torch.Tensor]) -> list[list[_Segment]]:
        """Buckets of segments. A module's tensors share a bucket unless they
        alone overflow one, so fused siblings are not split across buckets."""
        buckets: list[list[_Segment]] = []
        for group in wire_order(state_dict):
            group_bytes = sum(_padded(state_dict[n]) for n in group)
            if not buckets or (buckets[-1] and _end(buckets[-1]) + group_bytes > self.bucket_bytes):
                buckets.append([])
            for name in group:
                tensor = state_dict[name]
                if buckets[-1] and _end(buckets[-1]) + _padded(tensor) > self.bucket_bytes:
                    buckets.append([])
                _place(buckets[-1], name, tensor)
        for segments in buckets:
            _close(segments)
        return [b for b in buckets if b]

    def _scratch_for(self, sizes: list[int]) -> list[np.ndarray]:
        if len(self._scratch) != len(sizes) or any(b.nbytes < s for b, s in zip(self._scratch, sizes, strict=True)):
            self._scratch = [np.zeros(s, dtype=np.uint8) for s in sizes]
        return self._scratch


def wire_order(names: Iterable[str]) -> list[list[str]]:
    """Names grouped by parent module in order of first appearance, weights
    before biases inside a group, so that q/k/v (and gate/up) weights are
    adjacent even where each projection's bias follows its weight."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parent = name.rpartition(".")[0].rpartition(".")[0]
        groups.setdefault(parent, []).append(name)
    return [sorted(g, key=lambda n: not n.endswith(".weight")) for g in groups.values()]


def _fill(segments: list[_Segment], scratch: np.ndarray) -> tuple[tuple[np.ndarray, ...], list]:
    """A bucket's segment arrays (in-place views, or scratch with the small
    tensors copied in) and, per tensor, `(name, tensor, offset, its bytes)`."""
    arrays, placed, cursor = [], [], 0
    for seg in segments:
        if seg.in_place:
            arrays.append(_bytes_of(seg.tensors[0][1]))
        else:
            arrays.append(scratch[cursor : cursor + seg.nbytes])
            cursor += seg.nbytes
        for name, tensor, offset in seg.tensors:
            raw = arrays[-1][offset - seg.offset : offset - seg.offset + _nbytes(tensor)]
            if not seg.in_place:
                _copy_into(raw, tensor.detach())
            placed.append((name, tensor, offset, raw))
    return tuple(arrays), placed


def _copy_into(raw: np.ndarray, tensor: torch.Tensor) -> None:
    """Copy `tensor` into the bytes `raw`: a host tensor through numpy (one
    thread: a torch copy of a delta's small tensors waits on its worker
    threads longer than it copies, on a busy host)."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        np.copyto(raw, tensor.reshape(-1).view(torch.uint8).numpy())
    else:
        torch.from_numpy(raw).view(tensor.dtype).view(tensor.shape).copy_(tensor)


def _entries(index: int, placed: list, aliases: dict[str, list[str]]) -> tuple[TensorEntry, ...]:
    """Entries of one bucket's tensors, each followed by entries of the names
    that share its memory (same bytes, same place)."""
    entries = []
    for name, t, offset, raw in placed:
        dtype, digest = str(t.dtype).removeprefix("torch."), checksum(raw)
        for each in (name, *aliases.get(name, ())):
            entries.append(TensorEntry(each, dtype, tuple(t.shape), index, offset, raw.nbytes, digest))
    return tuple(entries)


def _shared(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """The tensors to send, and per sent name the other names that view the
    very same memory (a tied `lm_head.weight`), which travel as entries only:
    a tied embedding, often the largest tensor, would otherwise travel twice."""
    unique: dict[str, torch.Tensor] = {}
    first: dict[tuple, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, t in state_dict.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and key in first:
            aliases.setdefault(first[key], []).append(name)
        else:
            first.setdefault(key, name)
            unique[name] = t
    return unique, aliases


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _padded(tensor: torch.Tensor) -> int:
    return -(-_nbytes(tensor) // ALIGN) * ALIGN


def _in_place(tensor: torch.Tensor) -> bool:
    n = _nbytes(tensor)
    return tensor.device.type == "cpu" and tensor.is_contiguous() and n % ALIGN == 0 and n >= SEGMENT_MIN


def _place(segments: list[_Segment], name: str, tensor: torch.Tensor) -> None:
    """Add `tensor` to a bucket's segments: in place, or into the open scratch segment."""
    if _in_place(tensor):
        _close(segments)
        offset = _end(segments)
        segments.append(_Segment(offset, _nbytes(tensor), [(name, tensor, offset)], in_place=True))
        return
    if not segments or segments[-1].in_place:
        segments.append(_Segment(_end(segments), 0, []))
    seg = segments[-1]
    seg.tensors.append((name, tensor, seg.offset + seg.nbytes))
    seg.nbytes += _padded(tensor)


def _end(segments: list[_Segment]) -> int:
    return segments[-1].offset + segments[-1].nbytes if segments else 0


def _close(segments: list[_Segment]) -> None:
    """Pad an open scratch segment so the object store aligns the next one."""
    if segments and not segments[-1].in_place:
        segments[-1].nbytes = max(segments[-1].nbytes, SEGMENT_MIN)


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    raw = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    raw.flags.writeable = False  # a view of the trainer's weights: nothing on the way may write it
    return raw
