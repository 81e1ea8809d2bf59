"""Requests queued on the driver while no actor is alive, without Ray: the
real `ActorPool`'s waiting, with fake actor handles and streams. A cluster
stream waits for a live actor on a thread of its own (its caller, a server's
event loop, goes on), and a stream cancelled or a generation aborted while
it waits never starts on any actor."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout.cluster.actor_pool import ActorPool
from rollout.cluster.actor_slots import ActorGone, ActorSlot, PushGate
from rollout.cluster.dispatch import GenerationDispatch
from rollout.cluster.streams import start_stream
from rollout.sampling_params import SamplingParams
from tests.rollout.cluster.test_dispatch import LIMITS, PARAMS, WAIT, FakeActor

TIMEOUT_S = 12 * WAIT  # how long the pool waits for a replacement: far past every wait here, so a caller
# still waiting (the cancel or abort did not stop it) fails the test instead of timing out on its own


class RecordingHandle:
    """An actor handle that records the generating calls made to it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, method: str):
        return self

    def options(self, **kwargs):
        return self

    def remote(self, *args):
        self.calls.append(args)
        return None


class FakeActorPool(ActorPool):
    """An `ActorPool` whose actors are fakes: a death leaves the slot
    restarting until the test brings it back."""

    def __init__(self, handles: list) -> None:
        super().__init__("unused", {}, (1, 1), TIMEOUT_S, PushGate())
        self.slots = [ActorSlot(i, h, state="alive", pid=100 + i) for i, h in enumerate(handles)]
        self.waiting = threading.Event()  # set when a caller waits with no actor alive

    def open_stream(self, actor: FakeActor, label, indices, prompts, params):
        return actor.open(indices, prompts, params)

    def wait_for_live(self, stop=None) -> list[ActorSlot]:
        if not any(s.state == "alive" for s in self.slots):
            self.waiting.set()
        return super().wait_for_live(stop)

    def actor_died(self, slot: ActorSlot, generation: int, why: str) -> None:
        with self.cond:
            slot.state, slot.load = "restarting", 0

    def revive(self, index: int) -> None:
        with self.cond:
            self.slots[index].state = "alive"
            self.slots[index].generation += 1
            self.cond.notify_all()


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before]


def test_a_stream_cancelled_while_no_actor_is_alive_never_starts():
    handle = RecordingHandle()
    pool = FakeActorPool([handle])
    pool.slots[0].state = "restarting"
    before = set(threading.enumerate())
    stream = start_stream(pool, LIMITS, None, [1, 2, 3], SamplingParams(max_tokens=50), WAIT)  # returns at once
    (reader,) = _new_threads(before)
    stream.cancel()
    reader.join(WAIT)
    assert not reader.is_alive()  # it stopped waiting for an actor
    pool.revive(0)
    assert handle.calls == [] and pool.slots[0].load == 0
    with pytest.raises(asyncio.CancelledError):
        list(stream)


def test_a_generation_aborted_while_it_waits_to_run_again_never_starts():
    actor = FakeActor(0)
    pool = FakeActorPool([actor])
    handle = GenerationDispatch(pool, LIMITS, None).submit([[1, 2], [3, 4]], PARAMS)
    first = actor.stream(0)
    first.emit(0)
    first.items.put(ActorGone("actor 0 died"))
    out0 = handle.next_output(WAIT)
    assert pool.waiting.wait(WAIT)  # prompt 1 waits for a live actor to run again on
    handle.abort()
    outs = handle.result(WAIT)
    assert out0.index == 0 and outs[0].samples[0].finish_reason == "length"
    assert [(s.finish_reason, s.token_ids) for s in outs[1].samples] == [("abort", [])] * PARAMS.n
    pool.revive(0)
    assert len(actor.streams) == 1  # nothing started again after the abort
