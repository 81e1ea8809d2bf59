"""The compiled CPU kernels (`csrc/`) and their build: compiled on first use of
`cpu_ops()`, cached by a hash of the sources, flags and torch version."""

from .build import KernelUnavailable, cpu_ops

__all__ = ["KernelUnavailable", "cpu_ops"]
