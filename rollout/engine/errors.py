"""The engine's own exception types."""

from __future__ import annotations


class ClosedError(ValueError, RuntimeError):
    """A call on an engine or cluster that was closed or shut down. A
    ValueError (as for I/O on a closed file) and a RuntimeError, so either
    kind of handler catches it."""
