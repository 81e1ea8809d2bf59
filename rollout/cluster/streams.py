"""Token streams on a cluster (`RolloutCluster.stream`): one prompt's samples
token by token from one actor, as `Engine.stream` gives them in process.

The driver checks and encodes the prompt (chat messages with the template
the actors sent), picks the least loaded live actor, and starts the actor's
`stream_tokens`, a Ray generator that yields the `SampleDelta`s as they are
sampled and then the finished `RolloutOutput`. A thread of the driver's reads it into a
`TokenStream`, so a server's event loop never waits on Ray. `cancel()`
tells the actor to abort the request (its KV is freed there). A stream whose
actor dies ends with `ActorGone`: tokens already delivered cannot be taken
back, so it is not rerun elsewhere.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from concurrent.futures import Future

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
    """Check `prompt`, start it on the least loaded live actor and return its stream."""
    pool.check_open()
    params = SamplingParams() if params is None else params
    (ids,), (text,) = validate_prompts([prompt], params, limits, codec)
    cost = params.n * params.max_tokens
    with pool.cond:
        slot = min(pool.wait_for_live(), key=lambda s: (s.load, s.index))
        slot.load += cost
        generation = slot.generation
    stream_id = uuid.uuid4().hex
    refs = slot.handle.stream_tokens.options(concurrency_group=SESSIONS).remote(stream_id, ids, params)
    stream, future = TokenStream(), Future()
    stream.attach(future)
    future.add_done_callback(lambda f: f.cancelled() and _cancel_on(slot, stream_id))
    reader = _Reader(pool, slot, generation, cost, refs, stream, future, text, stall_timeout_s)
    threading.Thread(target=reader.run, name=f"rollout-stream-{stream_id[:8]}", daemon=True).start()
    return stream


def _cancel_on(slot: ActorSlot, stream_id: str) -> None:
    with contextlib.suppress(Exception):  # a dead actor has nothing left to abort
        control(slot.handle, "cancel_stream").remote(stream_id)


class _Reader:
    """Reads one actor stream into a `TokenStream` and its future."""

    def __init__(self, pool, slot, generation, cost, refs, stream, future, text, stall_timeout_s) -> None:
        self.pool, self.slot, self.generation, self.cost = pool, slot, generation, cost
        self.refs, self.stream, self.future, self.text = refs, stream, future, text
        self.stall_timeout_s = stall_timeout_s

    def run(self) -> None:
        ray = ray_module()
        try:
            while not self.future.done():
                ready, _ = ray.wait([self.refs], timeout=self.stall_timeout_s)
                if not ready:
                    raise TimeoutError(f"{self.slot.label} sent no token for {self.stall_timeout_s} s")
                item = ray.get(next(self.refs))
                if isinstance(item, RolloutOutput):
                    item.prompt = self.text
                    with contextlib.suppress(Exception):  # cancelled meanwhile
                        self.future.set_result(item)
                else:
                    self.stream.push([item])
        except ray.exceptions.RayActorError as e:
            self.pool.actor_died(self.slot, self.generation, "died while streaming")
            self._fail(ActorGone(f"{self.slot.label} died while streaming: {e}"))
        except StopIteration:
            self._fail(RuntimeError(f"{self.slot.label} ended a token stream early"))
        except BaseException as e:  # the actor's own error, raised in its process
            self._fail(unwrap(e))
        finally:
            with self.pool.cond:
                if self.slot.generation == self.generation:  # a replacement starts with no load
                    self.slot.load = max(0, self.slot.load - self.cost)

    def _fail(self, error: BaseException) -> None:
        with contextlib.suppress(Exception):  # cancelled or finished meanwhile
            self.future.set_exception(error)
