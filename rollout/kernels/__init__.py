"""The compiled CPU kernels (`csrc/`) and their build: compiled on first use of
`cpu_ops()` (for an engine, by `load_kernels`), cached by a hash of the
sources, flags and torch version."""

from .build import KernelUnavailable, cpu_ops
from .choice import load_kernels

__all__ = ["KernelUnavailable", "cpu_ops", "load_kernels"]
