"""Which kernels an engine computes with. `EngineConfig` validates the request
("auto", "compiled" or "torch") without side effects; `load_kernels` then
builds or loads the library, once every other argument is known to be good,
so a bad argument never waits on a compiler."""

from __future__ import annotations

import warnings

from .build import KernelUnavailable, cpu_ops

REQUESTS = ("auto", "compiled", "torch")


def load_kernels(kernels: str):
    """The compiled kernels (`torch.ops.rollout`) for a validated request, or
    None: torch ops only.

    "torch": None. "compiled": the kernels, or `KernelUnavailable` with the
    reason. "auto": the kernels when they build, else None with a
    `RuntimeWarning`, so an engine still runs where no compiler is.
    """
    if kernels not in REQUESTS:
        raise ValueError(f"kernels must be one of {REQUESTS}, got {kernels!r}")
    if kernels == "torch":
        return None
    try:
        return cpu_ops()
    except KernelUnavailable as exc:
        if kernels == "compiled":
            raise
        warnings.warn(f"{exc}; the engine falls back to kernels='torch'", RuntimeWarning, stacklevel=3)
        return None
