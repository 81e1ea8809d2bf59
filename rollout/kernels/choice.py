"""Which kernels an engine computes with. `EngineConfig` validates the request
("auto", "compiled", "triton" or "torch") without side effects; `load_kernels`
then builds or loads them, once every other argument is known to be good, so
a bad argument never waits on a compiler."""

from __future__ import annotations

import warnings

import torch

from .build import KernelUnavailable, cpu_ops
from .layer_ops import CompiledOps, LayerOps, TritonOps
from .triton.launch import unavailable_reason

REQUESTS = ("auto", "compiled", "triton", "torch")


def load_kernels(kernels: str, device: torch.device | str = "cpu") -> LayerOps | None:
    """The kernels for a validated request on `device`, or None: torch ops only.

    "torch": None. "compiled" (CPU): the compiled kernels, or `KernelUnavailable`
    with the reason. "triton": the Triton kernels (CUDA, or the CPU under
    `TRITON_INTERPRET=1`). "auto": on the CPU the compiled kernels when they
    build, on CUDA the Triton ones when triton is installed; else None with a
    `RuntimeWarning`, so an engine still runs where no compiler is.
    """
    if kernels not in REQUESTS:
        raise ValueError(f"kernels must be one of {REQUESTS}, got {kernels!r}")
    device = torch.device(device)
    if kernels == "torch":
        return None
    if kernels == "triton" or (kernels == "auto" and device.type != "cpu"):
        reason = unavailable_reason(device)
        if reason is None:
            return TritonOps()
        if kernels == "triton":
            raise KernelUnavailable(reason)
        warnings.warn(f"{reason}; the engine falls back to kernels='torch'", RuntimeWarning, stacklevel=3)
        return None
    try:
        return CompiledOps(cpu_ops())
    except KernelUnavailable as exc:
        if kernels == "compiled":
            raise
        warnings.warn(f"{exc}; the engine falls back to kernels='torch'", RuntimeWarning, stacklevel=3)
        return None
