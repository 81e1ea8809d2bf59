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
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import numpy as np

from ..engine.requests import PromptLimits, validate_prompts
from ..outputs import Sample, unstarted_sample
from ..sampling_params import SamplingParams
from ..tokenizer import TextCodec
from .actor_slots import ActorGone, ActorSlot, unwrap
from .dispatch import Pool
from .ray_runtime import SESSIONS, control, ray_module

POLL_S = 1.0  # while a turn runs, how often its waiter asks whether the actor still serves


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

    def pin(
        self, previous: ActorSlot | None = None, stop: Callable[[], bool] | None = None
    ) -> tuple[ActorSlot, int] | None:
        """A live actor for a session (moving from `previous`, if given) and its
        generation: the least loaded, then the one with the fewest sessions.
        Waits a bounded time when none is alive (`Pool.wait_for_live`); None
        once `stop()` is true."""
        with self.pool.cond:
            live = self.pool.wait_for_live(stop)
            if not live:
                return None
            slot = min(live, key=lambda s: (s.load, self._pins[s.index], s.index))
            if previous is not None:
                self._pins[previous.index] -= 1
            self._pins[slot.index] += 1
            return slot, slot.generation

    def unpin(self, slot: ActorSlot) -> None:
        with self.pool.cond:
            self._pins[slot.index] -= 1

    def run_turn(self, slot: ActorSlot, generation: int, ref) -> tuple[Sample, np.ndarray | None]:
        """Wait for the turn `ref` (`TurnCall.start`) on `slot`'s actor of
        `generation`: its sample and prompt routing (`EngineSessions.turn`).
        Raises `ActorGone` when the actor died or was replaced (the watchdog
        found it hung or stalled), `TimeoutError` past
        `turn_timeout_s`, else the actor's own error as it was raised there."""
        ray = ray_module()
        deadline = time.monotonic() + self.turn_timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{slot.label} did not finish a session turn within {self.turn_timeout_s} s")
                try:
                    return ray.get(ref, timeout=min(left, POLL_S))
                except ray.exceptions.GetTimeoutError:
                    if not self.pool.serving(slot, generation):
                        raise ActorGone(f"{slot.label} was replaced while running a session turn") from None
        except ray.exceptions.RayActorError as e:
            raise ActorGone(f"{slot.label} died while running a session turn: {e}") from e
        except (ActorGone, TimeoutError):
            raise
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


class TurnCall:
    """One turn of a cluster session, named by its own id: an abort ends this
    turn only, whether it is waiting for a live actor (it never starts),
    started (the actor ends it, even if the abort gets there first) or
    running again after its actor died (it is not run again)."""

    def __init__(self) -> None:
        self.turn_id = uuid.uuid4().hex
        self._lock = threading.Lock()  # orders starting the turn on an actor against an abort
        self.aborted = False
        self._slot: ActorSlot | None = None  # where it was last started

    def start(self, slot: ActorSlot, session_id: str, token_ids: list[int], params: SamplingParams):
        """Start the turn on `slot`'s actor: the call's ref, None once aborted."""
        with self._lock:
            if self.aborted:
                return None
            method = slot.handle.session_turn.options(concurrency_group=SESSIONS)
            ref = method.remote(session_id, token_ids, params, self.turn_id)
            self._slot = slot
            return ref

    def abort(self, pool: Pool) -> None:
        """End the turn wherever it is; wakes it if it waits for a live actor."""
        with self._lock:
            self.aborted = True
            slot = self._slot
        if slot is not None:
            with contextlib.suppress(Exception):  # a dead actor has no turn left to end
                control(slot.handle, "session_abort").remote(self.turn_id)
        pool.wake()


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
        self._current: TurnCall | None = None  # the turn under way, what `abort` ends
        # The last turn's prompt routing, when it asked (`Session` joins it to the sample's, as on an engine).
        self.prompt_routing: np.ndarray | None = None

    def turn(self, token_ids: list[int], params: SamplingParams) -> Future:
        """Start sampling one continuation of `token_ids` on the pinned actor
        (on one of the cluster's session threads, which waits on the actor);
        the future gives its `Sample`. The turn is checked here first."""
        self._sessions.pool.check_open()
        validate_prompts([token_ids], params, self._limits, self.codec)  # as the actor would, before it does
        call = TurnCall()
        self._current = call
        return self._sessions.executor().submit(self._run, call, list(token_ids), params)

    def _run(self, call: TurnCall, token_ids: list[int], params: SamplingParams) -> Sample:
        """The turn on the pinned actor, pinning again and running the turn
        again from `token_ids` when it died; aborted before it started
        anywhere (or before it ran again), it gives a sample with no tokens."""
        pool = self._sessions.pool
        cost = params.max_tokens
        self.prompt_routing = None
        try:
            while True:
                pinned = self._start(call, cost)
                if pinned is None:
                    return unstarted_sample(params.top_logprobs, self.codec is not None)
                slot, generation = pinned
                try:
                    ref = call.start(slot, self.session_id, token_ids, params)
                    if ref is None:
                        return unstarted_sample(params.top_logprobs, self.codec is not None)
                    sample, self.prompt_routing = self._sessions.run_turn(slot, generation, ref)
                    return sample
                except ActorGone:
                    pool.actor_died(slot, generation, "died while running a session turn")
                finally:
                    with pool.cond:
                        if slot.generation == generation:  # a replacement starts with no load
                            slot.load = max(0, slot.load - cost)
        finally:
            if self._current is call:
                self._current = None

    def _start(self, call: TurnCall, cost: int) -> tuple[ActorSlot, int] | None:
        """The actor for a turn, pinned again if the pinned one is no longer
        alive; its load counts the turn, as dispatch counts a group. None
        once `call` is aborted while it waits for a live actor."""
        pool = self._sessions.pool
        with pool.cond:
            if self.slot.state != "alive" or self.slot.generation != self.generation:
                pinned = self._sessions.pin(self.slot, lambda: call.aborted)
                if pinned is None:
                    return None
                self.slot, self.generation = pinned
            self.slot.load += cost
            return self.slot, self.generation

    def abort(self) -> None:
        """End the turn under way (it returns with reason "abort"), even one that has not started on an actor."""
        call = self._current
        if call is not None:
            call.abort(self._sessions.pool)

    def release(self) -> None:
        """Drop the engine session on the pinned actor; idempotent."""
        if not self._released:
            self._released = True
            self._sessions.unpin(self.slot)
            self._sessions.close_on(self.slot, self.session_id)
