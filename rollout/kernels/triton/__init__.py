"""Triton kernels for CUDA engines (`kernels="triton"`, the default there).

On a CPU device they run under Triton's interpreter (`TRITON_INTERPRET=1` set
before `triton` is first imported), slowly, so the tests exercise the whole
engine path through them without a GPU. `launch.py` is the one place kernels
are launched from, which lets a test count them.
"""

from .launch import interpreted, launch, launches, unavailable_reason

__all__ = ["interpreted", "launch", "launches", "unavailable_reason"]
