"""Two shortcuts for the tests that run the Triton kernels under Triton's
interpreter, each giving what the interpreter gives.

`tl.sort` of integer keys, computed with numpy. The interpreter runs `tl.sort`
as Triton's own bitonic network, element by element in Python (a reduction per
compare-and-swap stage): most of the time of a test that samples with filters.
A sort of integers has one answer, so numpy's gives the same keys in the same
order; tests/rollout/kernels/test_triton_interpreter_sort.py checks that
against the interpreted network on keys like the sampler's. Floating-point
keys (NaN, -0.0 and their orders) keep Triton's network, as do compiles for a
GPU, which never run here.

The names of the builtins the interpreter swaps for its own before every call
of a kernel or of a function a kernel calls, read once. It finds them by
listing every member of `triton.language` and of its tensor, math and core
namespaces on each call (about a quarter of an interpreted test's time); the
namespaces do not change, so the builtins it swaps are the same ones.
"""

from __future__ import annotations

import inspect

import numpy as np

ORIGINAL_SORT = None  # triton.language.sort as Triton defines it, once `install` has run
BUILTIN_NAMES: dict[int, list[str]] = {}  # id(namespace) -> its builtins' names, read by `install`


def install() -> None:
    """Route `tl.sort` (what the kernels call) through `sort`, and the interpreter's
    `_patch_builtin` through a list of names read now, before any kernel has run
    (so before the interpreter has swapped anything); only under the interpreter."""
    global ORIGINAL_SORT
    import triton.language as tl
    from triton.runtime import interpreter

    if ORIGINAL_SORT is not None:
        return
    ORIGINAL_SORT = tl.sort
    tl.sort = sort
    namespaces = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    BUILTIN_NAMES.update({id(ns): [n for n, m in inspect.getmembers(ns) if tl.core.is_builtin(m)] for ns in namespaces})
    listing = interpreter._patch_builtin

    def patch_builtin(pkg, builder, scope) -> None:
        """`_patch_builtin` as Triton writes it (every member of `pkg` still a builtin is
        swapped, in name order), over the names of its builtins instead of all its members."""
        names = BUILTIN_NAMES.get(id(pkg))
        if names is None:
            return listing(pkg, builder, scope)
        for name in names:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


def sort(x, dim=None, descending=False, **kwargs):
    """`tl.sort(x, dim, descending)` under the interpreter: integer keys sorted by numpy
    along the last dimension (the only one `tl.sort` sorts along); anything else by Triton."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    data = x.handle.data
    last = len(x.shape) - 1
    dim, descending = getattr(dim, "value", dim), bool(getattr(descending, "value", descending))
    if not np.issubdtype(data.dtype, np.integer) or dim not in (None, last) or kwargs:
        return ORIGINAL_SORT(x, dim=dim, descending=descending, **kwargs)
    ordered = np.sort(data, axis=-1, kind="stable")
    if descending:
        ordered = np.flip(ordered, axis=-1)
    return tl.core.tensor(TensorHandle(np.ascontiguousarray(ordered), x.handle.dtype), x.type)
