"""The driver's watchdog: it finds rollout actors that hang or stall and has
the pool replace them, exactly as if they had died.

Two signals come from one ping, which each live actor answers on a thread of
its own (`RolloutWorker.progress`, never queued behind generation or a push):

- **liveness**: an actor that has not answered a ping within
  `liveness_timeout_s` is hung: a stopped process, a GPU or collective hang,
  a swap storm, a deadlock. Ray still reports it alive, so nothing else would
  notice.
- **progress**: an actor whose answers show it holding sequences while its
  engine completes no step for `progress_timeout_s` is stalled. The bound is
  on engine steps, which the actor counts, not on tokens or outputs: a long
  prefill is many steps, and a first token that takes minutes still moves
  the counter.

The bookkeeping (`ActorWatch`) is plain Python over a clock; `Watchdog` adds
the thread and the Ray calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ..checks import check_positive
from .actor_slots import ActorSlot
from .ray_runtime import ping, ray_module

log = logging.getLogger("rollout.cluster")

POLL_S = 1.0  # how often, at most, the watchdog reads answers in and judges


@dataclass(frozen=True, slots=True)
class HangBounds:
    """When the watchdog calls an actor hung or stalled (seconds).

    The defaults find a real hang within about a minute on a GPU cluster and
    stay clear of a busy but healthy actor: a ping costs the actor a few
    counter reads on an idle thread, answered in milliseconds even mid-step,
    so 30 s of silence is no load spike; and a GPU engine step takes well
    under a second (a prefill chunk is bounded by `max_step_tokens`), so a
    minute without one while holding work is no slow step.
    """

    ping_interval_s: float = 5.0  # how often each live actor is pinged
    liveness_timeout_s: float = 30.0  # a ping unanswered this long: hung
    progress_timeout_s: float = 60.0  # holding work with no engine step completed this long: stalled

    def __post_init__(self) -> None:
        for name in ("ping_interval_s", "liveness_timeout_s", "progress_timeout_s"):
            object.__setattr__(self, name, check_positive(name, getattr(self, name)))
        if self.ping_interval_s >= self.liveness_timeout_s:
            raise ValueError(
                f"ping_interval_s must be < liveness_timeout_s, got {self.ping_interval_s} >= {self.liveness_timeout_s}"
            )


class Fault(NamedTuple):
    """The watchdog's verdict on one actor."""

    kind: str  # "hung" or "stalled"
    why: str  # what it saw, for health(), the log and errors


@dataclass(slots=True)
class ActorWatch:
    """What the pings of one actor (one generation of a slot) have shown."""

    generation: int  # the slot's generation watched: a replacement gets a fresh watch
    progress_at: float  # when an answer last showed a new step, or no work held
    steps: int = -1  # engine steps completed, as last answered
    ping: Any = None  # the ping in flight (an object ref), None between pings
    ping_sent_at: float = float("-inf")  # when the last ping was sent

    def sent(self, ref: Any, now: float) -> None:
        self.ping, self.ping_sent_at = ref, now

    def answered(self, steps: int | None, holding: bool, now: float) -> None:
        """Record an answer; `steps` None: the actor answered but could not say (it lives)."""
        self.ping = None
        if steps is None:
            return
        if steps != self.steps or not holding:
            self.progress_at = now
        self.steps = steps

    def verdict(self, now: float, bounds: HangBounds) -> Fault | None:
        """Hung, stalled, or None while it looks healthy."""
        silent = now - self.ping_sent_at if self.ping is not None else 0.0
        if silent > bounds.liveness_timeout_s:
            return Fault("hung", f"answered no liveness ping for {silent:.1f} s")
        idle = now - self.progress_at
        if idle > bounds.progress_timeout_s:
            return Fault("stalled", f"held work and completed no engine step for {idle:.1f} s")
        return None


class WatchedPool(Protocol):
    """What the watchdog needs of the actors (see `ActorPool`)."""

    def alive(self) -> list[ActorSlot]:
        """The slots whose actor is alive now."""

    def kill(self, slot: ActorSlot, why: str, generation: int | None = None, fault: str | None = None) -> None:
        """Kill the actor of `generation` in `slot`, its process included, and replace it."""

    def actor_died(self, slot: ActorSlot, generation: int, why: str) -> None:
        """Report that the actor of `generation` in `slot` died (the pool replaces it)."""

    def watchdog_failed(self, error: BaseException) -> None:
        """The watchdog stopped on `error`: the pool's next public call raises it."""


class Watchdog:
    """Pings every live actor of `pool` every `bounds.ping_interval_s` from a
    daemon thread (judging the answers every second, or every interval when
    that is shorter), and has the pool kill and replace an actor it finds hung
    or stalled (`ActorPool.kill`). `start()` starts the thread, `stop()` ends
    it; an error of its own stops it and is handed to the pool, whose next
    public call raises it."""

    def __init__(self, pool: WatchedPool, bounds: HangBounds, clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self.bounds = bounds
        self._clock = clock
        self._watches: dict[int, ActorWatch] = {}  # slot index -> its current actor's watch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread (a round under way finishes first); idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)

    def _run(self) -> None:
        tick = min(self.bounds.ping_interval_s, POLL_S)  # verdicts come within a tick, pings go every interval
        try:
            while not self._stop.wait(tick):
                self.poll()
        except BaseException as e:  # handed to the pool: its next public call raises it
            log.error("the rollout watchdog stopped: %s", e)
            self._pool.watchdog_failed(e)

    def poll(self) -> None:
        """One round: read the answers in, judge every live actor, ping again."""
        ray = ray_module()
        now = self._clock()
        live = self._pool.alive()
        self._watches = {s.index: w for s in live if (w := self._watches.get(s.index)) and w.generation == s.generation}
        for slot in live:
            watch = self._watches.setdefault(slot.index, ActorWatch(slot.generation, progress_at=now))
            if watch.ping is not None and ray.wait([watch.ping], timeout=0)[0]:
                if not self._read(slot, watch, now):
                    continue
            fault = watch.verdict(now, self.bounds)
            if fault is not None:
                del self._watches[slot.index]
                self._pool.kill(slot, f"{fault.kind}: {fault.why}", watch.generation, fault.kind)
            elif watch.ping is None and now - watch.ping_sent_at >= self.bounds.ping_interval_s:
                watch.sent(ping(slot.handle), now)

    def _read(self, slot: ActorSlot, watch: ActorWatch, now: float) -> bool:
        """Take the answer of `watch`'s ping; False when it shows the actor died."""
        ray = ray_module()
        try:
            answer = ray.get(watch.ping)
        except ray.exceptions.RayActorError:
            del self._watches[slot.index]
            self._pool.actor_died(slot, watch.generation, "died (its liveness ping failed)")
            return False
        except Exception:  # the actor's own error: it answered, so it lives, but says nothing of its progress
            watch.answered(None, True, now)
            return True
        watch.answered(answer["steps"], answer["holding"] > 0, now)
        return True
