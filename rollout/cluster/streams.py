"""Token streams on a cluster (`RolloutCluster.stream`): one prompt's samples
token by token from one actor, as `Engine.stream` gives them in process.

The driver checks and encodes the prompt (chat messages with the template
the actors sent) and returns the `TokenStream` at once. A thread of the
driver's then waits for a live actor (while a replacement starts, there may
be none), picks the least loaded one, starts the actor's `stream_tokens`, a
Ray generator that yields the `SampleDelta`s as they are sampled and then
the finished `RolloutOutput`, and reads it into the stream: a server's event
loop never waits on Ray or on the actors. `cancel()` before the prompt is
started keeps it from starting; after, it tells the actor to abort the
request (its KV is freed there, even if the cancel arrives before the call).
A stream whose actor dies ends with `ActorGone`: tokens already delivered
cannot be taken back, so it is not rerun elsewhere.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from concurrent.futures import Future
from typing import Any, NamedTuple

from ..engine.requests import PromptLimits, validate_prompts
from ..engine.streams import TokenStream
from ..outputs import RolloutOutput
from ..sampling_params import SamplingParams
from ..tokenizer import TextCodec
from .actor_slots import ActorGone, ActorSlot, unwrap
from .dispatch import Pool
from .ray_runtime import SESSIONS, control, ray_module


def start_stream(
    pool: Pool, limits: PromptLimits, codec: TextCodec | None, prompt, params: SamplingParams, stall_timeout_s: float
) -> TokenStream:
    """Check `prompt` and return its stream at once; raises `ValueError`/`TypeError`
    on bad input and `ClosedError` after shutdown. The prompt starts on the
    least loaded live actor from a thread of its own."""
    pool.check_open()
    params = SamplingParams() if params is None else params
    (ids,), (text,) = validate_prompts([prompt], params, limits, codec)
    stream, future = TokenStream(), Future()
    stream.attach(future)
    reader = _Reader(pool, ids, params, text, stream, future, stall_timeout_s)
    future.add_done_callback(lambda f: f.cancelled() and reader.cancel())
    threading.Thread(target=reader.run, name=f"rollout-stream-{reader.stream_id[:8]}", daemon=True).start()
    return stream


def _cancel_on(slot: ActorSlot, stream_id: str) -> None:
    with contextlib.suppress(Exception):  # a dead actor has nothing left to abort
        control(slot.handle, "cancel_stream").remote(stream_id)


class _Started(NamedTuple):
    """A stream's call on its actor."""

    slot: ActorSlot
    generation: int  # the slot's generation when it started: a death report names this actor
    refs: Any  # Ray's generator of object refs, one per item


class _Reader:
    """Starts one prompt on an actor and reads its stream into a `TokenStream` and its future."""

    def __init__(self, pool: Pool, ids: list[int], params: SamplingParams, text, stream, future, stall_timeout_s):
        self.pool, self.ids, self.params, self.text = pool, ids, params, text
        self.stream, self.future, self.stall_timeout_s = stream, future, stall_timeout_s
        self.cost = params.n * params.max_tokens
        self.stream_id = uuid.uuid4().hex
        self._lock = threading.Lock()  # orders starting the call against a cancel
        self._slot: ActorSlot | None = None  # the actor, once the call is made

    def cancel(self) -> None:
        """The caller cancelled: stop waiting for an actor, or abort the call on its actor."""
        with self._lock:
            slot = self._slot
        if slot is not None:
            _cancel_on(slot, self.stream_id)
        self.pool.wake()

    def run(self) -> None:
        try:
            started = self._start()
        except BaseException as e:  # no actor came back, or the cluster shut down
            self._fail(unwrap(e))
            return
        if started is not None:  # else cancelled before it started: nothing runs anywhere
            try:
                self._read(started)
            finally:
                self._unload(started.slot, started.generation)

    def _start(self) -> _Started | None:
        """Start the call on the least loaded live actor; None if cancelled first."""
        with self.pool.cond:
            live = self.pool.wait_for_live(self.future.done)
            if not live:
                return None
            slot = min(live, key=lambda s: (s.load, s.index))
            slot.load += self.cost
            generation = slot.generation
        with self._lock:
            if self.future.done():  # cancelled while the actor was chosen
                self._unload(slot, generation)
                return None
            method = slot.handle.stream_tokens.options(concurrency_group=SESSIONS)
            refs = method.remote(self.stream_id, self.ids, self.params)
            self._slot = slot
        return _Started(slot, generation, refs)

    def _read(self, started: _Started) -> None:
        ray = ray_module()
        slot = started.slot
        try:
            while not self.future.done():
                ready, _ = ray.wait([started.refs], timeout=self.stall_timeout_s)
                if not ready:
                    raise TimeoutError(f"{slot.label} sent no token for {self.stall_timeout_s} s")
                item = ray.get(next(started.refs))
                if isinstance(item, RolloutOutput):
                    item.prompt = self.text
                    with contextlib.suppress(Exception):  # cancelled meanwhile
                        self.future.set_result(item)
                else:
                    self.stream.push([item])
        except ray.exceptions.RayActorError as e:
            self.pool.actor_died(slot, started.generation, "died while streaming")
            self._fail(ActorGone(f"{slot.label} died while streaming: {e}"))
        except StopIteration:
            self._fail(RuntimeError(f"{slot.label} ended a token stream early"))
        except BaseException as e:  # the actor's own error, raised in its process
            self._fail(unwrap(e))

    def _unload(self, slot: ActorSlot, generation: int) -> None:
        with self.pool.cond:
            if slot.generation == generation:  # a replacement starts with no load
                slot.load = max(0, slot.load - self.cost)

    def _fail(self, error: BaseException) -> None:
        with contextlib.suppress(Exception):  # cancelled or finished meanwhile
            self.future.set_exception(error)
