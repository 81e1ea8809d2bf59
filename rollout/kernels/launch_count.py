"""Counting the kernels a block of model code launches: the torch ops that run a
kernel plus the engine's Triton launches. On the CPU (Triton's interpreter)
this counts what the same code launches on CUDA, since it is the same op
sequence; views and allocations launch nothing and are not counted.

    with counted_launches() as count:
        stepper._forward(...)
    count.total, count.torch_ops, count.triton
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .triton.launch import launches, launching

aten = torch.ops.aten
# Ops that allocate or relabel memory without running a kernel.
_NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.empty_strided.default,
    aten.new_empty_strided.default,
    aten.detach.default,
    aten.lift_fresh.default,
    aten._local_scalar_dense.default,  # a host read: a sync, not a launch
}


@dataclass(slots=True)
class LaunchCount:
    torch_ops: Counter = field(default_factory=Counter)  # aten op name -> calls that run a kernel
    triton: Counter = field(default_factory=Counter)  # Triton kernel name -> launches

    @property
    def total(self) -> int:
        return sum(self.torch_ops.values()) + sum(self.triton.values())


class _Counting(TorchDispatchMode):
    def __init__(self, count: LaunchCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not launching() and not func.is_view and func not in _NO_KERNEL:
            self.count.torch_ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counted_launches() -> Iterator[LaunchCount]:
    """The kernels launched inside the block (filled in when it exits)."""
    count = LaunchCount()
    with launches() as names, _Counting(count):
        yield count
    count.triton.update(names)
