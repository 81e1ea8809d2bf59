"""Sessions on a cluster: each pinned to one actor, surviving its death.

`RolloutCluster.session(prompt)` returns the engine's `Session` over a
`ClusterTurns` backend. The driver's `Session` holds the whole trajectory;
each turn sends it to the pinned actor, whose engine session keeps the KV
between turns (`actor_sessions.EngineSessions`), so a turn there computes
only what was added since the last. When the pinned actor is dead (found
dead at a turn's start, or dying during one), the session is pinned again,
to the least loaded live actor (a replacement included), and the turn runs
there from the same token ids: only the work of the turn in flight is lost,
and a seeded turn samples the same tokens again.

Ray is touched only through `ray_runtime`, on first use.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections import Counter
from concurrent.futures import Executor, Future, ThreadPoolExecutor

from ..engine.requests import PromptLimits, validate_prompts
from ..outputs import Sample
from ..sampling_params import SamplingParams
from ..tokenizer import TextCodec
from .actor_slots import ActorGone, ActorSlot, unwrap
from .dispatch import Pool
from .ray_runtime import SESSIONS, control, ray_module


class ClusterSessions:
    """What a cluster's sessions share: which actor each is pinned to (so
    new sessions spread over actors) and the threads of `generate_async`.

    `turn_timeout_s` bounds each turn on one actor; `threads` sizes the
    executor (turns an actor runs at once, times the actors).
    """

    def __init__(self, pool: Pool, turn_timeout_s: float, threads: int) -> None:
        self.pool = pool
        self.turn_timeout_s = turn_timeout_s
        self._threads = threads
        self._pins: Counter[int] = Counter()  # slot index -> open sessions pinned there; guarded by pool.cond
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def pin(self, previous: ActorSlot | None = None) -> tuple[ActorSlot, int]:
        """A live actor for a session (moving from `previous`, if given) and its
        generation: the least loaded, then the one with the fewest sessions.
        Waits a bounded time when none is alive (`Pool.wait_for_live`)."""
        with self.pool.cond:
            live = self.pool.wait_for_live()
            slot = min(live, key=lambda s: (s.load, self._pins[s.index], s.index))
            if previous is not None:
                self._pins[previous.index] -= 1
            self._pins[slot.index] += 1
            return slot, slot.generation

    def unpin(self, slot: ActorSlot) -> None:
        with self.pool.cond:
            self._pins[slot.index] -= 1

    def run_turn(self, slot: ActorSlot, session_id: str, token_ids: list[int], params: SamplingParams) -> Sample:
        """One turn on `slot`'s actor, on its generate threads. Raises
        `ActorGone` when the actor died, `TimeoutError` past `turn_timeout_s`,
        else the actor's own error as it was raised there."""
        ray = ray_module()
        try:
            ref = slot.handle.session_turn.options(concurrency_group=SESSIONS).remote(session_id, token_ids, params)
            return ray.get(ref, timeout=self.turn_timeout_s)
        except ray.exceptions.RayActorError as e:
            raise ActorGone(f"{slot.label} died while running a session turn: {e}") from e
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{slot.label} did not finish a session turn within {self.turn_timeout_s} s") from None
        except Exception as e:  # the actor's own error, raised in its process
            raise unwrap(e) from None

    def close_on(self, slot: ActorSlot, session_id: str) -> None:
        """Tell `slot`'s actor to drop its engine session, without waiting; a
        dead actor (or a Ray already shut down) has nothing left to drop."""
        with contextlib.suppress(Exception):
            control(slot.handle, "session_close").remote(session_id)

    def executor(self) -> Executor:
        """The threads that run `generate_async` turns, made on first use."""
        with self._lock:
            self.pool.check_open()
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._threads, "rollout-cluster-session")
            return self._executor

    def shutdown(self) -> None:
        """Stop the executor's threads (turns on them end with the cluster's actors)."""
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None


class ClusterTurns:
    """A session's turns on a cluster, pinned to one actor (a `SessionBackend`).

    `limits` and `codec` are what the actors described at start: the driver
    checks every turn against them before any actor sees it.
    """

    def __init__(self, sessions: ClusterSessions, limits: PromptLimits, codec: TextCodec | None) -> None:
        self._sessions = sessions
        self._limits = limits
        self.codec = codec
        self.vocab_size = limits.vocab_size
        self.max_seq_len = limits.max_seq_len
        self.session_id = uuid.uuid4().hex  # names the session's engine session on its actor
        self.slot, self.generation = sessions.pin()  # the actor of `generation` in `slot` holds its KV
        self._released = False

    def turn(self, token_ids: list[int], params: SamplingParams) -> Future:
        """Start sampling one continuation of `token_ids` on the pinned actor
        (on one of the cluster's session threads, which waits on the actor);
        the future gives its `Sample`. The turn is checked here first."""
        self._sessions.pool.check_open()
        validate_prompts([token_ids], params, self._limits, self.codec)  # as the actor would, before it does
        return self._sessions.executor().submit(self._run, list(token_ids), params)

    def _run(self, token_ids: list[int], params: SamplingParams) -> Sample:
        """The turn on the pinned actor, pinning again and running the turn
        again from `token_ids` when it died."""
        pool = self._sessions.pool
        cost = params.max_tokens
        while True:
            slot, generation = self._start(cost)
            try:
                return self._sessions.run_turn(slot, self.session_id, token_ids, params)
            except ActorGone:
                pool.actor_died(slot, generation, "died while running a session turn")
            finally:
                with pool.cond:
                    if slot.generation == generation:  # a replacement starts with no load
                        slot.load = max(0, slot.load - cost)

    def _start(self, cost: int) -> tuple[ActorSlot, int]:
        """The actor for a turn, pinned again if the pinned one is no longer
        alive; its load counts the turn, as dispatch counts a group."""
        pool = self._sessions.pool
        with pool.cond:
            if self.slot.state != "alive" or self.slot.generation != self.generation:
                self.slot, self.generation = self._sessions.pin(self.slot)
            self.slot.load += cost
            return self.slot, self.generation

    def abort(self) -> None:
        """End the turn in flight on the pinned actor (it returns with reason "abort")."""
        with contextlib.suppress(Exception):  # a dead actor has no turn left to end
            control(self.slot.handle, "session_abort").remote(self.session_id)

    def release(self) -> None:
        """Drop the engine session on the pinned actor; idempotent."""
        if not self._released:
            self._released = True
            self._sessions.unpin(self.slot)
            self._sessions.close_on(self.slot, self.session_id)
