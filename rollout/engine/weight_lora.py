"""LoRA adapter pushes: a push that carries, per adapted tensor `name`,
`name + A` (r x cols), `name + B` (rows x r) and `name + SCALING` (one
element), and sets that tensor to

    merged = base + scaling * B @ A

computed in float32 (float64 for a float64 engine) and rounded once to the
engine's dtype. `base` is the tensor's value before its first adapter push
(or the whole value the same push carries), kept by the engine, so every
adapter push recomputes the merge from it and rounding never accumulates.
A later push that sets the tensor whole or by a delta replaces the base:
the next adapter push starts from the weights then live.

The merge runs in phase one (`WeightUpdater.stage_merges`), written
straight into the parameter's staging buffer (a spare one after the first
push), and the commit installs that buffer as for a whole push: a rebind on
the host, one device copy on a device. Merging into the live weights at
commit instead would save that buffer but pause generation for the whole
merge under the guard, could not write host weights adopted from the object
store (shared with other actors), and would find an overflow (a merge of
finite adapters can exceed the dtype) only after other actors committed: a
push must fail everywhere before any commit, so phase one merges.

A PEFT embedding adapter (`W += scaling * (B @ A).T`) travels as
`B = A_peft.T`, `A = B_peft.T`, so one formula serves both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .weight_delta import PushCost, all_finite

A = "@lora.A"
B = "@lora.B"
SCALING = "@lora.scaling"
_SUFFIXES = (A, B, SCALING)


@dataclass(frozen=True, slots=True)
class Adapter:
    a: torch.Tensor  # (r, cols)
    b: torch.Tensor  # (rows, r)
    scaling: float


def has_adapters(state_dict: Mapping[str, torch.Tensor]) -> bool:
    return any(isinstance(k, str) and k.endswith(_SUFFIXES) for k in state_dict)


def split(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Adapter]]:
    """Whole tensors and adapters; `ValueError`/`TypeError` naming the first bad entry."""
    whole, names = {}, []
    for key, tensor in state_dict.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            whole[key] = tensor
        elif key[: -len(suffix)] not in names:
            names.append(key[: -len(suffix)])
    return whole, {name: _adapter(state_dict, name) for name in names}


def _adapter(state_dict: Mapping[str, torch.Tensor], name: str) -> Adapter:
    parts = [state_dict.get(name + s) for s in _SUFFIXES]
    if any(p is None for p in parts):
        raise ValueError(f"adapter of {name!r} must have {name + A!r}, {name + B!r} and {name + SCALING!r}")
    a, b, scaling = parts
    for suffix, t in zip(_SUFFIXES, parts, strict=True):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"state_dict[{name + suffix!r}] must be a floating-point torch.Tensor")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
        raise ValueError(
            f"adapter of {name!r}: A must be (r, cols) and B (rows, r) with one r >= 1, "
            f"got A {tuple(a.shape)} and B {tuple(b.shape)}"
        )
    if scaling.numel() != 1 or not torch.isfinite(scaling).all():
        raise ValueError(f"state_dict[{name + SCALING!r}] must hold one finite number")
    if not (all_finite(a) and all_finite(b)):
        raise ValueError(f"adapter of {name!r} holds NaN or inf values")
    return Adapter(a, b, float(scaling.reshape(-1)[0]))


MERGE_BLOCK = 1 << 16  # elements of the wide scratch one block of rows is merged in (torch's host path)


def merge(name: str, base: torch.Tensor, adapter: Adapter) -> torch.Tensor:
    """`base + scaling * B @ A` as a new tensor of `base`'s dtype and device (see `merge_into`)."""
    out = torch.empty_like(base, memory_format=torch.contiguous_format)
    if not merge_into(name, out, base, adapter):
        raise ValueError(f"adapter of {name!r} makes values that are not finite in {base.dtype}")
    return out


def merge_into(name: str, out: torch.Tensor, base: torch.Tensor, adapter: Adapter) -> bool:
    """Write `base + scaling * B @ A` into `out` (`base`'s shape, dtype and
    device; it may be `base` itself): computed in float32 (float64 for
    float64) and rounded once to the dtype. Returns whether every value is
    finite (a merge of finite operands can still overflow the dtype).

    On the host, bfloat16 and float32 tensors go through the compiled
    `lora_merge` (csrc/lora_merge.cpp): one read of the base and one write of
    `out`, the products accumulated in registers. Its arithmetic (A scaled
    first, an FMA per rank step from k = 0, the base added, rounded to
    nearest even) is the order of oneDNN's kernel for torch's float32 host
    `addmm`, but the bits may differ from torch's path, whose blocking and
    kernel choice vary with the shape and the host (the tests hold the
    kernel to a float64 recompute and to torch's rounding where the sum is
    exact); `merge_torch` is the path elsewhere (a device, no compiler,
    float16 and float64)."""
    rows, cols = adapter.b.shape[0], adapter.a.shape[1]
    if base.dim() != 2 or tuple(base.shape) != (rows, cols):
        raise ValueError(f"adapter of {name!r} makes a ({rows}, {cols}) update; the tensor is {tuple(base.shape)}")
    ops = _host_ops() if base.device.type == "cpu" and base.dtype in (torch.bfloat16, torch.float32) else None
    if ops is not None and out.is_contiguous() and base.is_contiguous():
        a, b = (t.to(torch.float32).contiguous() for t in (adapter.a, adapter.b))
        return bool(ops.lora_merge(out, base, b, a, adapter.scaling))
    merge_torch(out, base, adapter)
    return all_finite(out)


def merge_torch(out: torch.Tensor, base: torch.Tensor, adapter: Adapter) -> None:
    """`merge_into` with torch's ops: on a device one `addmm` over a wide
    copy; on the host over blocks of rows through one cache-sized wide
    scratch, so no whole wide copy of the tensor is made (each row's result
    is the same as one `addmm` over the whole tensor: a row's dot products do
    not depend on the other rows)."""
    wide = torch.float64 if base.dtype == torch.float64 else torch.float32
    a, b = (t.to(base.device, wide) for t in (adapter.a, adapter.b))
    rows, cols = out.shape
    if base.device.type != "cpu":
        out.copy_(torch.addmm(base.to(wide), b, a, alpha=adapter.scaling))
        return
    step = max(1, MERGE_BLOCK // max(cols, 1))
    scratch = torch.empty(min(step, rows), cols, dtype=wide)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        block = scratch[:n]
        block.copy_(base[start : start + n])
        block.addmm_(b[start : start + n], a, alpha=adapter.scaling)
        out[start : start + n].copy_(block)


@functools.cache
def _host_ops():
    """The compiled kernels with `lora_merge`, or None where they cannot be built."""
    from ..kernels import KernelUnavailable, cpu_ops

    try:
        ops = cpu_ops()
    except KernelUnavailable:
        return None
    return ops if hasattr(ops, "lora_merge") else None


def same(x: Adapter, y: Adapter) -> bool:
    """Whether two adapters are bit for bit the same update."""
    return x.scaling == y.scaling and all(
        p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q) for p, q in ((x.a, y.a), (x.b, y.b))
    )


class LoraPlan(NamedTuple):
    """What an adapter push sets, and what its commit does to the kept bases."""

    full: dict[str, torch.Tensor]  # the tensors the push sets whole
    new_bases: dict[str, torch.Tensor]  # bases kept from now on (first adapter push, or a whole value with one)
    cleared: frozenset[str]  # tensors set without an adapter: their base goes
    merged: dict[str, Adapter] = {}  # the adapters to merge (copies, kept once committed)
    merges: dict[str, tuple[torch.Tensor, Adapter]] = {}  # name -> (base, adapter): phase one merges these
    from_live: frozenset[str] = frozenset()  # new bases that are the live value itself (its storage is kept)

    def values(self) -> dict[str, torch.Tensor]:
        """Every tensor the push sets, adapted ones merged into new tensors."""
        return self.full | {name: merge(name, base, adapter) for name, (base, adapter) in self.merges.items()}


class LoraBases:
    """Per adapted tensor, its base weights: the value before its first
    adapter push, at the engine's dtype, `nbytes` in all; and the adapter
    merged into the live value, so a push that resends it unchanged merges
    nothing for that tensor. A base is a copy on a device, whose live
    weights are written in place; on the host, where a commit rebinds
    parameters to new storage, it is the replaced live storage itself (or
    the object-store bucket the weights were adopted from): no copy."""

    def __init__(self) -> None:
        self.bases: dict[str, torch.Tensor] = {}
        self.merged: dict[str, Adapter] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.bases.values())

    def expand(
        self,
        state_dict: Mapping[str, torch.Tensor],
        live: Callable[[str], torch.Tensor],
        keep_live: bool = False,
        keep_whole: bool = False,
    ) -> LoraPlan:
        """The tensors the push sets whole, the merges it needs and what its
        commit does to the bases; `live(name)` is a tensor's live value.
        `keep_live`: a first adapter push may keep the live value itself as
        the base (its storage is replaced, never written, at commit); else
        it is cloned. `keep_whole`: a whole value sent with an adapter may be
        kept as the base without a copy (the caller lets the engine keep
        its tensors). Checks the adapters; nothing changes here."""
        whole, adapters = split(state_dict)
        new_bases, merged, merges, from_live = {}, {}, {}, set()
        for name, adapter in adapters.items():
            current = live(name)
            if name in whole:
                if not isinstance(whole[name], torch.Tensor) or not whole[name].is_floating_point():
                    raise TypeError(f"state_dict[{name!r}] must be a floating-point torch.Tensor")
                base = whole[name].to(current.device, current.dtype, copy=not keep_whole)
                new_bases[name] = base
            elif name in self.bases:
                if name in self.merged and same(adapter, self.merged[name]):
                    continue  # the live value is this very merge already
                base = self.bases[name]
            elif keep_live:
                base = new_bases[name] = current
                from_live.add(name)
            else:
                base = new_bases[name] = current.clone()
            rows, cols = adapter.b.shape[0], adapter.a.shape[1]
            if tuple(base.shape) != (rows, cols):
                raise ValueError(
                    f"adapter of {name!r} makes a ({rows}, {cols}) update; the tensor is {tuple(base.shape)}"
                )
            merges[name] = (base, adapter)
            merged[name] = Adapter(adapter.a.clone(), adapter.b.clone(), adapter.scaling)  # not the bucket's memory
        rest = {k: v for k, v in whole.items() if k not in adapters}
        return LoraPlan(rest, new_bases, frozenset(whole) - frozenset(adapters), merged, merges, frozenset(from_live))

    def commit(self, plan: LoraPlan) -> None:
        """`plan`'s push committed: tensors it set without an adapter lose their base."""
        for name in plan.cleared:
            self.bases.pop(name, None)
            self.merged.pop(name, None)
        self.bases.update(plan.new_bases)
        self.merged.update(plan.merged)

    def clear(self) -> None:
        self.bases.clear()
        self.merged.clear()


def adapter_cost(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype, seconds: float) -> PushCost:
    """What an adapter push sent against a whole push of the tensors it sets, at `dtype`."""
    whole, adapters = split(state_dict)
    itemsize = torch.empty((), dtype=dtype).element_size()
    full = sum(t.numel() * itemsize for t in whole.values())
    full += sum(a.b.shape[0] * a.a.shape[1] * itemsize for a in adapters.values())
    sent = sum(t.nbytes for t in state_dict.values())
    counts = {"full": len(whole), "adapter": len(adapters)}
    return PushCost(sent, full, seconds, "lora", counts, 1.0)
