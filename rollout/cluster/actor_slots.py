"""The driver's view of its actors: one `ActorSlot` per actor position, the
latest published push, and the error a dead actor's calls come back as."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .wire import Manifest


@dataclass(slots=True)
class ActorSlot:
    """One actor position of the cluster; its handle changes when it is respawned."""

    index: int
    handle: Any
    node: str = ""  # Ray node id: actors on one node share its object store
    generation: int = 0  # bumps on every respawn, so stale failure reports are ignored
    state: str = "starting"  # starting | alive | restarting | dead
    load: int = 0  # outstanding work dispatched to it (samples x max_tokens)
    pid: int | None = None
    error: str | None = None  # why it is dead

    @property
    def label(self) -> str:
        return f"actor {self.index} (pid {self.pid})"


@dataclass(frozen=True, slots=True)
class Published:
    """The latest committed push: what a replacement actor loads before it serves."""

    manifest: Manifest
    version: int
    refs: tuple  # Ray object refs of the buckets, kept alive here


class ActorGone(RuntimeError):
    """An actor died while answering; it is being replaced."""


def unwrap(e: BaseException) -> BaseException:
    """The original exception of an error raised inside an actor."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
