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

A PEFT embedding adapter (`W += scaling * (B @ A).T`) travels as
`B = A_peft.T`, `A = B_peft.T`, so one formula serves both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .weight_delta import PushCost

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
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"adapter of {name!r}: A must be (r, cols) and B (rows, r) with one r, "
            f"got A {tuple(a.shape)} and B {tuple(b.shape)}"
        )
    if scaling.numel() != 1 or not torch.isfinite(scaling).all():
        raise ValueError(f"state_dict[{name + SCALING!r}] must hold one finite number")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ValueError(f"adapter of {name!r} holds NaN or inf values")
    return Adapter(a, b, float(scaling.reshape(-1)[0]))


MERGE_BLOCK = 1 << 16  # elements of the wide scratch one block of rows is merged in: it stays in cache


def merge(name: str, base: torch.Tensor, adapter: Adapter) -> torch.Tensor:
    """`base + scaling * B @ A` in float32 (float64 for float64), in `base`'s dtype and device.

    On the host it runs over blocks of rows through one cache-sized wide
    scratch, so no whole float32 copy of the tensor is made (each row's
    result is the same as one `addmm` over the whole tensor: a row's dot
    products do not depend on the other rows)."""
    rows, cols = adapter.b.shape[0], adapter.a.shape[1]
    if base.dim() != 2 or tuple(base.shape) != (rows, cols):
        raise ValueError(f"adapter of {name!r} makes a ({rows}, {cols}) update; the tensor is {tuple(base.shape)}")
    wide = torch.float64 if base.dtype == torch.float64 else torch.float32
    a, b = (t.to(base.device, wide) for t in (adapter.a, adapter.b))
    if base.device.type != "cpu":
        return torch.addmm(base.to(wide), b, a, alpha=adapter.scaling).to(base.dtype)
    out = torch.empty_like(base)
    step = max(1, MERGE_BLOCK // max(cols, 1))
    scratch = torch.empty(min(step, rows), cols, dtype=wide)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        block = scratch[:n]
        block.copy_(base[start : start + n])
        block.addmm_(b[start : start + n], a, alpha=adapter.scaling)
        out[start : start + n].copy_(block)
    return out


def same(x: Adapter, y: Adapter) -> bool:
    """Whether two adapters are bit for bit the same update."""
    return x.scaling == y.scaling and all(
        p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q) for p, q in ((x.a, y.a), (x.b, y.b))
    )


class LoraPlan(NamedTuple):
    """What an adapter push sets, and what its commit does to the kept bases."""

    full: dict[str, torch.Tensor]  # every tensor the push sets, adapted ones merged
    new_bases: dict[str, torch.Tensor]  # bases kept from now on (first adapter push, or a whole value with one)
    cleared: frozenset[str]  # tensors set without an adapter: their base goes
    merged: dict[str, Adapter] = {}  # the adapters merged into `full` (copies, kept once committed)


class LoraBases:
    """Per adapted tensor, its base weights: one copy of every tensor an
    adapter push set, at the engine's dtype, `nbytes` in all; and the
    adapter merged into the live value, so a push that resends it unchanged
    merges nothing for that tensor."""

    def __init__(self) -> None:
        self.bases: dict[str, torch.Tensor] = {}
        self.merged: dict[str, Adapter] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.bases.values())

    def expand(self, state_dict: Mapping[str, torch.Tensor], live: Callable[[str], torch.Tensor]) -> LoraPlan:
        """Every tensor the push sets (adapted ones merged) and what its commit
        does to the bases; `live(name)` is a tensor's live value. Nothing
        changes here."""
        whole, adapters = split(state_dict)
        full, new_bases, merged = dict(whole), {}, {}
        for name, adapter in adapters.items():
            current = live(name)
            if name in whole:
                base = new_bases[name] = whole[name].to(current.device, current.dtype)
            elif name in self.bases:
                if name in self.merged and same(adapter, self.merged[name]):
                    continue  # the live value is this very merge already
                base = self.bases[name]
            else:
                base = new_bases[name] = current.clone()
            full[name] = merge(name, base, adapter)
            merged[name] = Adapter(adapter.a.clone(), adapter.b.clone(), adapter.scaling)  # not the bucket's memory
        return LoraPlan(full, new_bases, frozenset(whole) - frozenset(adapters), merged)

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
