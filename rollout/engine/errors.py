"""The engine's own exception types."""

from __future__ import annotations


class UnavailableError(RuntimeError):
    """Nothing can serve the call now (the engine is closed, no actor of a
    cluster is alive): not the caller's mistake nor a bug; a server answers 503."""


class ClosedError(ValueError, UnavailableError):
    """A call on an engine or cluster that was closed or shut down. A
    ValueError (as for I/O on a closed file) and a RuntimeError, so either
    kind of handler catches it."""


class EngineAsleepError(UnavailableError):
    """A call that would generate on an engine put to sleep (`Engine.sleep`):
    `wake_up()` first, and after level 2 push the weights. A server answers 503."""


class NoLiveActorError(UnavailableError):
    """Every actor of a cluster is dead for good."""


class NoActorInTimeError(UnavailableError, TimeoutError):
    """No actor of a cluster came back within its timeout (a TimeoutError too)."""
