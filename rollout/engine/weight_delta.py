"""Delta pushes: only the elements whose value, in the engine's dtype,
changed since the last committed push.

A delta push is an ordinary state dict, so it travels as any push does
(buckets, manifest, checksums, two phases) and an in-process engine takes
it from `update_weights` as it is. Besides plain tensors (sent whole) it
holds, per changed tensor `name`, one of two encodings:

- `name + MASK` (uint8, one bit per element, little-endian within a byte)
  and `name + VALUES` (the new values of the set bits, in order);
- `name + INDEX` (int32 flat indices, strictly increasing) and
  `name + VALUES`;

and `BASE` (int64, one element): the policy version the delta is relative
to. An engine whose version is not `BASE` refuses it. Each tensor gets the
smallest of whole, mask and index for its density (`choose`); a tensor
with no changed element is left out.

`delta_encoder.DeltaEncoder` is the sending side: it keeps the last
committed cast weights (the reference the deltas are taken against) and
reports each push's cost (`PushCost`). The receiving side (`split`, `changed_at`) turns
each patch into checked flat indices and values in phase one; the engine
writes them with one scatter per tensor (`put`, from `weight_update`), into the
live weights at commit or into a staged copy where the live ones are not
its own to write.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

BASE = "@delta.base"
MASK = "@delta.mask"
INDEX = "@delta.index"
VALUES = "@delta.values"
_SUFFIXES = (MASK, INDEX, VALUES)
_BITS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class PushCost:
    """What one push sent, against a full push of the same tensors."""

    bytes_sent: int  # bytes of tensors the push carried (encodings included)
    bytes_full: int  # bytes a full push of the same tensors would carry
    seconds: float  # from the call until the push committed (or, for `wait=False`, until in the store)
    encoding: str  # "full": every tensor whole; "delta": some sent as changed elements only
    tensors: dict[str, int] = field(default_factory=dict)  # per encoding (full, mask, index, unchanged): tensors
    changed_fraction: float = 1.0  # changed elements / elements, over the push's tensors


@dataclass(slots=True)
class Encoded:
    """One encoded push: what to send, what `DeltaEncoder.commit` applies, its cost."""

    state_dict: dict[str, torch.Tensor]  # the push to send
    pending: dict[str, tuple]  # name -> ("whole", copy) | ("copy", the caller's tensor) | ("index" | "mask",
    # int32 flat positions or the uint8 mask of the changed elements, their values)
    cost: PushCost  # seconds: the encoding's alone


@dataclass(slots=True)
class Patch:
    """The changed elements of one tensor, as received."""

    values: torch.Tensor  # new values of the changed elements, in flat order
    mask: torch.Tensor | None = None  # uint8 bitmask of changed elements, or
    index: torch.Tensor | None = None  # int32 flat indices of changed elements


@dataclass(slots=True)
class DeltaParts:
    """A delta push split into what it sets."""

    base: int  # the version it is relative to
    whole: dict[str, torch.Tensor]  # tensors sent whole
    patches: dict[str, Patch]  # tensors sent as changed elements


def is_delta(state_dict: Mapping[str, torch.Tensor]) -> bool:
    return BASE in state_dict


def sizes(numel: int, changed: int, itemsize: int) -> dict[str, int]:
    """Bytes of each encoding of a tensor of `numel` elements, `changed` of them changed."""
    out = {"full": numel * itemsize, "mask": math.ceil(numel / 8) + changed * itemsize}
    if numel < 2**31:
        out["index"] = changed * (4 + itemsize)
    return out


def choose(numel: int, changed: int, itemsize: int) -> str:
    """The smallest encoding, except that a mask must at least halve the
    tensor's bytes: selecting and scattering through a dense mask costs a few
    passes over the tensor on each side, more time than a whole tensor's
    copy saves when the bytes barely shrink. Whole wins ties."""
    s = sizes(numel, changed, itemsize)
    if s["mask"] * 2 > s["full"]:
        del s["mask"]
    return min(s, key=lambda k: (s[k], k != "full"))


def pack_mask(changed: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor as bits, 8 to a byte, element 0 in bit 0 (numpy's
    `packbits` on the host: one pass, no per-bit temporaries)."""
    flat = changed.reshape(-1)
    if flat.device.type == "cpu":
        return torch.from_numpy(np.packbits(flat.numpy(), bitorder="little"))
    pad = (-flat.numel()) % 8
    bits = torch.nn.functional.pad(flat.to(torch.uint8), (0, pad)).view(-1, 8)
    return (bits * _BITS.to(bits.device)).sum(1, dtype=torch.uint8)


def unpack_mask(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """`pack_mask`'s inverse: `numel` bools."""
    if mask.device.type == "cpu":  # bytes of 0 or 1 are valid bools: a view, not a conversion
        return torch.from_numpy(np.unpackbits(mask.numpy(), count=numel, bitorder="little")).view(torch.bool)
    bits = (mask.view(-1, 1) >> torch.arange(8, dtype=torch.uint8, device=mask.device)) & 1
    return bits.view(-1)[:numel].bool()


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """`t` flat, as integers of its element size: equal means the same bits."""
    flat = t.reshape(-1)
    if t.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_INT_OF_SIZE[t.element_size()])


def split(state_dict: Mapping[str, torch.Tensor]) -> DeltaParts:
    """A delta push's parts; `ValueError`/`TypeError` naming the first bad entry."""
    base = state_dict[BASE]
    if not isinstance(base, torch.Tensor) or base.dtype != torch.int64 or base.numel() != 1:
        raise ValueError(f"state_dict[{BASE!r}] must be an int64 tensor of one element (the base version)")
    whole, patches = {}, {}
    for key, tensor in state_dict.items():
        if key == BASE:
            continue
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            whole[key] = tensor
            continue
        name = key[: -len(suffix)]
        if name in patches:
            continue
        patches[name] = _patch(state_dict, name)
    both = sorted(set(whole) & set(patches))
    if both:
        raise ValueError(f"delta push sets {both[0]!r} both whole and as changed elements")
    return DeltaParts(int(base.item()), whole, patches)


def _patch(state_dict: Mapping[str, torch.Tensor], name: str) -> Patch:
    values, mask, index = (state_dict.get(name + s) for s in (VALUES, MASK, INDEX))
    if values is None or (mask is None) == (index is None):
        raise ValueError(
            f"delta push entry {name!r} must have {name + VALUES!r} and exactly one of {name + MASK!r} "
            f"and {name + INDEX!r}"
        )
    for key, t in ((VALUES, values), (MASK, mask), (INDEX, index)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name + key!r}] must be a torch.Tensor, got {type(t).__name__}")
    if not values.is_floating_point() or values.dim() != 1:
        raise TypeError(f"state_dict[{name + VALUES!r}] must be a 1-d floating-point tensor")
    if mask is not None and (mask.dtype != torch.uint8 or mask.dim() != 1):
        raise TypeError(f"state_dict[{name + MASK!r}] must be a 1-d uint8 tensor")
    if index is not None and (index.dtype != torch.int32 or index.dim() != 1):
        raise TypeError(f"state_dict[{name + INDEX!r}] must be a 1-d int32 tensor")
    return Patch(values, mask, index)


def changed_at(name: str, live: torch.Tensor, patch: Patch) -> tuple[torch.Tensor, torch.Tensor]:
    """`patch` as (where, values in `live`'s dtype), both on `live`'s device,
    for `put`. `where` is the flat positions of the changed elements: int64,
    or, on the host with the compiled scatter, the int32 positions as they
    came, and a mask as it came (uint8, `ceil(n / 8)` bytes: a mask patch
    is dense, more than 1/32 of the tensor, so the engine stages a copy for
    it whichever form it takes). Raises `ValueError` naming `name` when the
    patch does not fit `live`; nothing is written."""
    n = live.numel()
    if patch.mask is not None:
        mask = patch.mask.contiguous()
        if mask.numel() != math.ceil(n / 8):
            raise ValueError(f"delta mask of {name!r} has {mask.numel()} bytes, expected {math.ceil(n / 8)}")
        if n % 8 and int(mask[-1]) >> (n % 8):
            raise ValueError(f"delta mask of {name!r} sets bits past the tensor's {n} elements")
        if mask.device.type == "cpu" and live.device.type == "cpu" and _scatters(live):
            marked = int(np.bitwise_count(mask.numpy()).sum(dtype=np.int64))
            if marked != patch.values.numel():
                raise ValueError(
                    f"delta of {name!r} marks {marked} changed elements but carries {patch.values.numel()} values"
                )
            return mask, patch.values.to(live.dtype)
        where = _flat_nonzero(unpack_mask(mask, n))
    else:
        where = patch.index
        if where.numel() and (int(where[0]) < 0 or int(where[-1]) >= n or not _increasing(where)):
            raise ValueError(f"delta indices of {name!r} must be strictly increasing and in [0, {n})")
        if where.device.type != "cpu" or not _scatters(live):
            where = _as_int64(where)
    if where.numel() != patch.values.numel():
        raise ValueError(
            f"delta of {name!r} marks {where.numel()} changed elements but carries {patch.values.numel()} values"
        )
    return where.to(live.device), patch.values.to(live.device, live.dtype)


def _increasing(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        a = t.numpy()
        return bool(np.all(a[1:] > a[:-1]))
    return bool((t[1:] > t[:-1]).all())


def put(flat: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """`flat[where] = values` in place, for a flat tensor, int32 or int64
    flat positions and values of its dtype. On the host by the compiled
    `delta_scatter` (one pass, no int64 copy of the positions), else
    numpy's indexed assignment on the bit patterns: one thread either way
    (torch's `index_copy_` waits on its worker threads on a busy host). Each
    element is a random memory access, so the time grows with the changed
    elements, not the tensor."""
    if flat.device.type != "cpu":
        flat.index_copy_(0, where.to(torch.int64), values)
        return
    if _scatters(flat):
        host_ops().delta_scatter(_as_bits(flat.detach()), where.contiguous(), _as_bits(values.detach().contiguous()))
        return
    _as_bits(flat.detach()).numpy()[where.numpy()] = _as_bits(values.detach()).numpy()


def _scatters(t: torch.Tensor) -> bool:
    """Whether `delta_scatter` writes into the host tensor `t` (elements of 2 or 4 bytes)."""
    return t.element_size() in (2, 4) and host_ops() is not None


@functools.cache
def host_ops():
    """The compiled delta kernels (`csrc/delta_encode.cpp`), or None where they
    cannot be built: numpy's passes then."""
    from ..kernels import KernelUnavailable, cpu_ops

    try:
        ops = cpu_ops()
    except KernelUnavailable:
        return None
    return ops if hasattr(ops, "delta_compare") else None


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu":
        return t.to(torch.int64)
    return torch.from_numpy(t.numpy().astype(np.int64))


def _flat_nonzero(changed: torch.Tensor) -> torch.Tensor:
    """int64 positions of the set elements of a flat bool tensor; on the host
    numpy's, several times faster than torch's `nonzero` there."""
    if changed.device.type != "cpu":
        return changed.nonzero().view(-1)
    return torch.from_numpy(np.flatnonzero(changed.numpy()))


def all_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no NaN or inf.

    For float32/float64 a sum comes first: it is NaN or inf whenever an
    element is (and, rarely, when finite values overflow) and is cheaper
    than a min/max pass, so only a non-finite sum pays for the exact check.
    That check is one reduction pass (NaN and +-inf reach the min or max)
    that allocates nothing, where isfinite().all() builds a whole mask; for
    16-bit dtypes it is the cheaper pass too, as a float32 sum of them
    converts every element first (see docs/benchmarks.md).
    """
    if t.numel() == 0:
        return True
    if t.dtype in (torch.float32, torch.float64) and torch.isfinite(t.sum()):
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))
