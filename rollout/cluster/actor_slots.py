"""The driver's view of its actors: one `ActorSlot` per actor position, the
calls made to them, the weights a replacement loads, and the error a dead
actor's calls come back as."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from .published import Published, compose
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
    replacements: int = 0  # times the position's actor was replaced (died, hung, stalled, failed a commit)
    replaced_because: str | None = None  # why it was last replaced
    hangs: int = 0  # actors of this position the watchdog found hung
    stalls: int = 0  # actors of this position the watchdog found stalled
    failed_starts: int = 0  # replacements that failed to start or hung while loading, each killed
    failed_start_because: str | None = None  # why the last one failed

    @property
    def label(self) -> str:
        """How errors name the actor."""
        return f"actor {self.index} (pid {self.pid})"


class ActorCall(NamedTuple):
    """One call in flight: its actor slot, the slot's generation when it was
    made (a failure then is reported against that actor, not its
    replacement), and the Ray object ref of its result."""

    slot: ActorSlot
    generation: int
    ref: Any


class PushGate:
    """Orders weight pushes against respawns. A push holds `lock` from its
    start to its end; a replacement actor is spawned holding it too and
    loads `latest`, so it can neither miss a push nor join one half-way.

    `latest` is every push committed since the checkpoint, composed
    (`published.compose`), not the last push alone: a push may set only
    some tensors, and a replacement must hold what the live actors hold.
    Delta pushes are not composed (their buckets hold changed elements
    only): they leave a snapshot due, which `latest` puts in the store on
    first read (the trainer's copy of the live weights), composed over the
    record. `aliases` (per checkpoint name, the other names the engine holds
    in the same weight) comes from the actors' description, before any push."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._record: Published | None = None
        self._snapshot: tuple[int, Callable[[], tuple[Manifest, tuple]]] | None = None  # (version, make)
        self.aliases: Mapping[str, tuple[str, ...]] = {}

    @property
    def latest(self) -> Published | None:
        """The weights a replacement loads; read holding `lock`."""
        self.make_due_snapshot()
        return self._record

    def make_due_snapshot(self) -> None:
        """Put a due snapshot in the store and compose it into the record now; call holding `lock`."""
        if self._snapshot is not None:
            version, make = self._snapshot
            manifest, refs = make()
            self._record = compose(self._record, manifest, version, refs, self.aliases)
            self._snapshot = None

    @latest.setter
    def latest(self, value: Published | None) -> None:
        self._record, self._snapshot = value, None

    def publish(self, manifest: Manifest, version: int, refs: tuple) -> None:
        """Record an accepted push for replacement actors; call holding `lock`."""
        self._record = compose(self._record, manifest, version, refs, self.aliases)

    def publish_snapshot(self, version: int, make: Callable[[], tuple[Manifest, tuple]]) -> None:
        """Record an accepted push as a snapshot `make()` puts in the store
        when a replacement needs it: `(manifest, refs)` of the live weights
        of every tensor a delta push may have set; call holding `lock`."""
        self._snapshot = (version, make)

    def saved(self) -> tuple:
        """What `restore` puts back, without making a due snapshot."""
        return self._record, self._snapshot

    def restore(self, saved: tuple) -> None:
        self._record, self._snapshot = saved


class ActorGone(RuntimeError):
    """An actor died while answering; it is being replaced."""


def unwrap(e: BaseException) -> BaseException:
    """The original exception of an error raised inside an actor."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
