"""Launching the engine's Triton kernels, and counting the launches.

Every kernel in this folder is launched through `launch`, so `launches()`
sees all of them: `rollout.kernels.launch_count` adds them to the torch ops
of a step (the launch-count test, the GPU benchmark's launches per step).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_counters: list[list[str]] = []  # the open `launches()` blocks, innermost last
_inside = [0]  # launches running now: torch ops they issue (the interpreter's copies) are not the step's


def interpreted() -> bool:
    """Whether Triton kernels run under the interpreter (on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on `device`, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        return None if interpreted() else "Triton kernels run on a CPU device only with TRITON_INTERPRET=1"
    return f"Triton kernels need a CUDA device, got {device}"


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """Launch the `triton.jit` function `kernel` over `grid` (recorded in every open `launches()`)."""
    if interpreted():
        _fix_interpreter_scalar_index()
    for names in _counters:
        names.append(kernel.fn.__name__)
    _inside[0] += 1
    try:
        kernel[grid](*args, **meta)
    finally:
        _inside[0] -= 1


def launching() -> bool:
    """Whether a Triton kernel is being launched (or, interpreted, run) now."""
    return _inside[0] > 0


@contextmanager
def launches() -> Iterator[list[str]]:
    """Collects the names of the Triton kernels launched inside the block, in order."""
    names: list[str] = []
    _counters.append(names)
    try:
        yield names
    finally:
        _counters.remove(names)


def _fix_interpreter_scalar_index() -> None:
    """Let loops with run-time bounds run under the interpreter with numpy >= 2.4.

    Triton 3.6's interpreter holds scalars as 1-element arrays and converts them
    with `int(array)`, which numpy 2.4 refuses for arrays of rank > 0, so
    `range(start, stop)` over a loaded length fails. Upstream fixed it
    (triton-lang/triton#9172) after 3.6; this applies the same fix on each
    kernel's patch scope, once per process.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "scalar_index_fixed", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.scalar_index_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor
