"""Argument checks shared by the public entry points. Each raises a
`TypeError` (wrong kind) or `ValueError` (out of range) whose message names
the field and the allowed values, before the caller changes any state."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """An integer that is not a bool (`True` is an int to Python, never to a caller)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int, extra: str = "") -> int:
    """`value` when it is an int >= `low`; `extra` adds to the allowed range in the message."""
    allowed = f"{name} must be an int >= {low} {extra}".rstrip()
    if not is_int(value):
        raise TypeError(f"{allowed}, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{allowed}, got {value}")
    return value


def check_positive(name: str, value: object) -> float:
    """`value` when it is a number > 0 (timeouts, rates)."""
    if not is_number(value) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return value


def next_version(current: int, requested: object) -> int:
    """The policy version a commit would install over `current`: `requested`,
    or `current + 1` when it is None; anything else not newer is refused."""
    if requested is None:
        return current + 1
    if not is_int(requested):
        raise TypeError(f"version must be an int > {current} or None, got {type(requested).__name__}")
    if requested <= current:
        raise ValueError(f"version must be > the current policy version {current}, got {requested}")
    return requested
