"""Argument checks shared by the public entry points. Each raises a
`TypeError` (wrong kind) or `ValueError` (out of range) whose message names
the field and the allowed values, before the caller changes any state.

Callers pass numpy from datasets, so numpy integer and floating scalars count
as ints and numbers, and 1-D integer numpy arrays and torch tensors as token
lists. The `as_*` and `check_*` helpers return plain Python values, so
nothing past the boundary (JSON, pickling, the scheduler) sees numpy or torch.
Bools, numpy's included, are never ints."""

from __future__ import annotations

import sys

import numpy as np


def is_int(value: object) -> bool:
    """An integer that is not a bool (`True` is an int to Python, never to a caller):
    a Python int or a numpy integer scalar (`np.bool_` is not one)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, np.integer)


def is_number(value: object) -> bool:
    """An int or float that is not a bool, Python's or a numpy scalar."""
    return is_int(value) or isinstance(value, (float, np.floating))


def as_number(value: object) -> int | float:
    """`value` (an `is_number`) as a plain Python int or float of the same kind."""
    return value.item() if isinstance(value, np.generic) else value


def check_int(name: str, value: object, low: int, extra: str = "") -> int:
    """`value` as a plain int when it is an int >= `low`; `extra` adds to the allowed range in the message."""
    allowed = f"{name} must be an int >= {low} {extra}".rstrip()
    if not is_int(value):
        raise TypeError(f"{allowed}, got {type(value).__name__}")
    value = int(value)
    if value < low:
        raise ValueError(f"{allowed}, got {value}")
    return value


def check_number(name: str, value: object, allowed: str) -> int | float:
    """`value` as a plain int or float when it is a number; `allowed` completes
    "`name` must be a number ..." in the message. Range checks are the caller's."""
    if not is_number(value):
        raise TypeError(f"{name} must be a number {allowed}, got {type(value).__name__}")
    return as_number(value)


def check_positive(name: str, value: object) -> float:
    """`value` when it is a number > 0 (timeouts, rates)."""
    if not is_number(value) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return as_number(value)


def array_shape(value: object) -> tuple[int, str] | None:
    """`(ndim, kind)` of a numpy array or torch tensor, None for anything else.
    `kind` is numpy's dtype kind ("i", "u" integer, "b" bool, "f" float, ...);
    every torch integer dtype reads as "i"."""
    if isinstance(value, np.ndarray):
        return value.ndim, value.dtype.kind
    # A tensor exists only once torch is imported, so this never imports it.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        dt = value.dtype
        kind = "b" if dt == torch.bool else "f" if dt.is_floating_point else "c" if dt.is_complex else "i"
        return value.dim(), kind
    return None


def as_token_ids(name: str, ids: object) -> list[int]:
    """Token ids as a plain `list[int]`: from a list, tuple or other iterable
    of ints, or a 1-D integer numpy array or torch tensor. Raises `TypeError`
    naming `name` for anything else (strings, floats, bools, 2-D arrays);
    the range of the ids is the caller's to check."""
    shape = array_shape(ids)
    if shape is not None:
        ndim, kind = shape
        if ndim != 1:
            raise TypeError(f"{name} must be a 1-D sequence of int token ids, got a {ndim}-D array")
        if kind not in ("i", "u"):
            raise TypeError(f"{name} must hold int token ids, got an array of dtype {ids.dtype}")
        return [int(t) for t in ids.tolist()]
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a list of int token ids, got {type(ids).__name__}")
    out = []
    for t in ids:
        if not is_int(t):
            raise TypeError(f"{name} must hold int token ids, got {t!r} ({type(t).__name__})")
        out.append(int(t))
    return out


def next_version(current: int, requested: object) -> int:
    """The policy version a commit would install over `current`: `requested`,
    or `current + 1` when it is None; anything else not newer is refused."""
    if requested is None:
        return current + 1
    if not is_int(requested):
        raise TypeError(f"version must be an int > {current} or None, got {type(requested).__name__}")
    requested = int(requested)
    if requested <= current:
        raise ValueError(f"version must be > the current policy version {current}, got {requested}")
    return requested
