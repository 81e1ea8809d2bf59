"""The sending side of delta pushes (`weight_delta`): the copy of the live
weights a push is compared with, and the encoding of each push against it.

On the host one compiled pass per tensor (`delta_compare`,
`rollout/kernels/csrc/delta_encode.cpp`) reads the new bits and the copy's
side by side and writes, as it goes, the bitmask of changed elements, their
int32 positions and their new values into scratch kept between pushes, and
gives up as soon as so many changed that the tensor goes whole. Before it, a
tensor of `SAMPLE_MIN` elements or more is sampled (`SAMPLES` evenly spaced
elements): when the sample says more than `WHOLE_ABOVE` past the densest
fraction a delta encoding can take, the tensor goes whole with no compare
at all. The sample only picks the encoding; what is sent is exact either
way. Without the compiled kernels (no compiler) the host falls back to numpy
passes, and tensors on a device use torch's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Mapping

import numpy as np
import torch

from .weight_delta import (
    BASE,
    INDEX,
    MASK,
    VALUES,
    Encoded,
    PushCost,
    _as_bits,
    _flat_nonzero,
    choose,
    host_ops,
    pack_mask,
    put,
    unpack_mask,
)

SAMPLE_MIN = 1 << 16  # elements from which a tensor is sampled before its compare
SAMPLES = 2048  # elements sampled
WHOLE_ABOVE = 1 / 16  # a sampled fraction this far above the densest delta encoding's goes whole


@functools.cache
def densest(numel: int, itemsize: int) -> int:
    """The most changed elements for which a delta encoding (index or mask) is
    smaller than the whole tensor (`choose` gives "full" above it)."""
    k = max(numel * itemsize // (4 + itemsize), (numel * itemsize // 2 - math.ceil(numel / 8)) // itemsize)
    k = min(max(k, 0), numel)
    while k > 0 and choose(numel, k, itemsize) == "full":
        k -= 1
    while k < numel and choose(numel, k + 1, itemsize) != "full":
        k += 1
    return k


def _fast(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.element_size() in (2, 4) and t.numel() < 2**31 and host_ops() is not None


class DeltaEncoder:
    """The sending side of delta pushes.

    `reference` holds, per name, the cast weights of the last committed push
    that set it: one copy of every pushed tensor, on the tensors' device,
    `nbytes` in all. `encode` compares a new state dict with it bit for bit;
    `commit` applies an encoded push to it once every engine holds it, so a
    push that fails leaves the reference at the weights the engines serve.
    On the host the compare writes into scratch kept between pushes (the
    mask, positions and values of the largest tensor's densest delta).
    """

    def __init__(self) -> None:
        self.reference: dict[str, torch.Tensor] = {}
        self._borrowed: set[str] = set()  # names whose reference is read-only memory the caller lent (`borrow`)
        self._scratch = np.empty(0, dtype=np.bool_)  # numpy's path: one bool per element
        self._mask = torch.empty(0, dtype=torch.uint8)
        self._index = torch.empty(0, dtype=torch.int32)
        self._values = torch.empty(0, dtype=torch.int32)  # viewed as the tensor's bits

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.reference.values())

    def encode(
        self,
        state_dict: Mapping[str, torch.Tensor],
        base: int,
        delta: bool = True,
        stable: bool = False,
        borrow: bool = False,
    ) -> Encoded:
        """The push to send and what `commit` applies. With `delta=False`, or
        for names the reference lacks or holds at another shape or dtype,
        tensors go whole. `stable=True`: the caller's tensors keep their
        values until `commit` (a push that waits for its commit), so a tensor
        sent whole is copied into the reference's own memory then, not
        cloned now (no new memory to fault in). `borrow=True`: the caller
        hands `commit` read-only views of the bytes it sent (the object
        store's) for the host tensors sent whole, which become the reference
        as they are: neither cloned nor copied. `cost.changed_fraction`
        counts a tensor sent whole on its sample's say by the sample."""
        start = time.perf_counter()
        out: dict[str, torch.Tensor] = {BASE: torch.tensor([base], dtype=torch.int64)} if delta else {}
        pending: dict[str, tuple] = {}
        counts = dict.fromkeys(("full", "mask", "index", "unchanged"), 0)
        elements = changed_elements = 0
        for name, new in state_dict.items():
            old = self.reference.get(name)
            elements += new.numel()
            if not delta or old is None or old.shape != new.shape or old.dtype != new.dtype:
                how, k, parts = "full", new.numel(), None
            elif _fast(new) and old.device.type == "cpu":
                how, k, parts = self._encode_host(new.detach(), old)
            else:
                how, k, parts = self._encode_torch(new.detach(), old)
            changed_elements += k
            if how == "unchanged":
                counts["unchanged"] += 1
                continue
            counts[how] += 1
            if how == "full":
                out[name], pending[name] = new, self._whole(new, old, stable, borrow)
                continue
            where, values = parts
            out[name + (MASK if how == "mask" else INDEX)], out[name + VALUES] = where, values
            # A mask marks more than 1/32 of the tensor: copying it whole beats a scatter of so many elements
            # (docs/weight_sync.md), where the caller's tensor stays as sent until the commit.
            pending[name] = ("copy", new.detach()) if stable and how == "mask" else (how, where, values)
        used_delta = counts["mask"] + counts["index"] + counts["unchanged"] > 0
        # Every tensor whole: a plain push, valid over any version.
        out = {k: v for k, v in out.items() if used_delta or k != BASE}
        sent = sum(t.nbytes for t in out.values())
        full = sum(t.nbytes for t in state_dict.values())
        cost = PushCost(sent, full, 0.0, "delta" if used_delta else "full", counts, changed_elements / max(elements, 1))
        return Encoded(out, pending, dataclasses.replace(cost, seconds=time.perf_counter() - start))

    def _encode_host(self, new: torch.Tensor, old: torch.Tensor) -> tuple[str, int, tuple | None]:
        """(encoding, changed elements, (mask or int32 positions, values)) by the compiled pass."""
        n, itemsize = new.numel(), new.element_size()
        a, b = _as_bits(new.contiguous()), _as_bits(old)
        stop = densest(n, itemsize)
        if n >= SAMPLE_MIN:
            sampled = sample_changed(a, b)
            if sampled > stop / n + WHOLE_ABOVE:
                return "full", round(sampled * n), None
        mask, index, values = self._host_scratch(n, stop, a.dtype)
        k = host_ops().delta_compare(a, b, mask, index, values, stop)
        if k > stop:  # more changed than any delta encoding pays for: counted no further
            return "full", k, None
        if k == 0:
            return "unchanged", 0, None
        how = choose(n, k, itemsize)
        where = _own(mask[: math.ceil(n / 8)]) if how == "mask" else _own(index[:k])
        return how, k, (where, _own(values[:k]).view(new.dtype))

    def _host_scratch(self, n: int, stop: int, bits: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mask, positions and values scratch for a tensor of `n` elements, grown as needed and kept."""
        if self._mask.numel() < math.ceil(n / 8) + 8:
            self._mask = torch.empty(math.ceil(n / 8) + 8, dtype=torch.uint8)
        if self._index.numel() < stop:
            self._index = torch.empty(stop, dtype=torch.int32)
        width = torch.empty(0, dtype=bits).element_size()
        if self._values.numel() * 4 < stop * width:
            self._values = torch.empty(math.ceil(stop * width / 4), dtype=torch.int32)
        return self._mask, self._index[:stop], self._values.view(bits)[:stop]

    def _encode_torch(self, new: torch.Tensor, old: torch.Tensor) -> tuple[str, int, tuple | None]:
        """The same by numpy passes on the host (no compiled kernels) or torch ops on a device."""
        changed = self._compare(new, old)
        k = int(changed.count_nonzero()) if changed.device.type != "cpu" else np.count_nonzero(changed.numpy())
        if k == 0:
            return "unchanged", 0, None
        how = choose(new.numel(), k, new.element_size())
        if how == "full":
            return how, k, None
        where = _flat_nonzero(changed)  # only now: for a tensor sent whole it is not needed
        values = _take(new, where)
        if how == "mask":
            return how, k, (pack_mask(changed), values)
        return how, k, (where.to(torch.int32) if where.device.type != "cpu" else _as_int32(where), values)

    def _compare(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """The flat bool mask of the elements whose bits differ. On the host
        one numpy `not_equal` of the bit patterns (bf16 as int16) into the
        kept scratch, allocating nothing; valid until the next call."""
        if new.device.type != "cpu":
            return torch.ne(_as_bits(new), _as_bits(old))
        n = new.numel()
        if self._scratch.size < n:
            self._scratch = np.empty(n, dtype=np.bool_)
        return torch.from_numpy(np.not_equal(_as_bits(new).numpy(), _as_bits(old).numpy(), out=self._scratch[:n]))

    @staticmethod
    def _whole(new: torch.Tensor, old: torch.Tensor | None, stable: bool, borrow: bool) -> tuple:
        """What `commit` does for a tensor sent whole."""
        if borrow and new.device.type == "cpu":
            return ("borrow",)
        same = old is not None and old.shape == new.shape and old.dtype == new.dtype and old.device == new.device
        if stable and same:
            return ("copy", new.detach())
        return ("whole", new.detach().clone())

    def commit(self, encoded: Encoded, sent: Mapping[str, torch.Tensor] | None = None) -> None:
        """Every engine holds `encoded`: make it the reference. `sent`: for
        a push encoded with `borrow=True`, read-only views of the bytes of
        its tensors sent whole, kept as they are (and copied once, the first
        time a later delta must write into one of them)."""
        for name, item in encoded.pending.items():
            if item[0] == "borrow":
                self.reference[name] = sent[name]
                self._borrowed.add(name)
                continue
            if name in self._borrowed:  # never written: other processes read that memory
                self._borrowed.discard(name)
                if item[0] == "copy":
                    self.reference[name] = _own_tensor(item[1])
                    continue
                if item[0] != "whole":
                    self.reference[name] = _own_tensor(self.reference[name])
            if item[0] == "copy":
                _copy(self.reference[name], item[1])
            elif item[0] == "whole":
                self.reference[name] = item[1]
            else:
                scatter(self.reference[name].view(-1), item[1], item[2])

    def clear(self) -> None:
        self.reference.clear()
        self._borrowed.clear()


def sample_changed(a: torch.Tensor, b: torch.Tensor) -> float:
    """The changed fraction of `SAMPLES` evenly spaced elements of two flat bit tensors."""
    step = max(1, a.numel() // SAMPLES)
    x, y = a.numpy()[::step][:SAMPLES], b.numpy()[::step][:SAMPLES]
    return np.count_nonzero(x != y) / x.size


def scatter(flat: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """`flat` at the changed elements set to `values`, `where` a uint8 mask
    or int32/int64 positions: one compiled pass on the host, else `put`."""
    if _fast(flat) and where.device.type == "cpu":
        host_ops().delta_scatter(_as_bits(flat.detach()), where, _as_bits(values.detach()))
        return
    if where.dtype == torch.uint8:
        where = _flat_nonzero(unpack_mask(where, flat.numel()))
    put(flat, where.to(torch.int64) if where.device.type != "cpu" else where, values)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, on the host through numpy (one thread, see `weight_delta.put`)."""
    if dst.device.type == "cpu" and src.device.type == "cpu" and src.is_contiguous():
        np.copyto(_as_bits(dst).numpy(), _as_bits(src).numpy())
    else:
        dst.copy_(src)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A copy of a host tensor by numpy: one thread (torch's `clone` waits on
    its worker threads on a busy host, longer than the copy takes)."""
    return torch.from_numpy(t.numpy().copy())


def _own_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a host tensor of any dtype, by numpy (see `_own`)."""
    return _own(_as_bits(t.contiguous())).view(t.dtype).view(t.shape)


def _as_int32(where: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(where.numpy().astype(np.int32))


def _take(t: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """The elements of `t` at the flat positions `where`, in order."""
    flat = t.reshape(-1)
    if flat.device.type != "cpu":
        return flat.index_select(0, where)
    return torch.from_numpy(np.take(_as_bits(flat).numpy(), where.numpy())).view(t.dtype)
