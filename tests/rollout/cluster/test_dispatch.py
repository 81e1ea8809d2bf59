"""The generation dispatch without Ray: group balancing, load accounting,
exactly-once delivery and re-dispatch when an actor dies, error paths.

A fake pool stands in for the actors; each fake stream hands out exactly
what the test puts into it, so every step is driven by the test."""

from __future__ import annotations

import queue
import threading

import pytest

from rollout.cluster.actor_slots import ActorGone, ActorSlot
from rollout.cluster.dispatch import GenerationDispatch, balance
from rollout.engine.requests import PromptLimits
from rollout.outputs import RolloutOutput, Sample
from rollout.sampling_params import SamplingParams

LIMITS = PromptLimits(vocab_size=100, max_seq_len=256, max_batch_size=16, page_size=16, num_pages=64)
PARAMS = SamplingParams(n=2, max_tokens=5)  # every prompt adds 2 x 5 = 10 to its actor's load
STALL = object()  # put into a stream: it reports no output within the poll interval
WAIT = 10.0  # bound of every wait: reached only when a test fails


class FakeStream:
    """One share of prompts on a fake actor; it yields what the test puts in."""

    def __init__(self, actor: FakeActor, indices: list[int], prompts: list[list[int]], params) -> None:
        self.actor, self.indices, self.prompts, self.params = actor, indices, prompts, params
        self.items: queue.Queue = queue.Queue()
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()

    def next(self, timeout: float):
        item = self.items.get(timeout=WAIT)
        if item is STALL:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def emit(self, index: int) -> None:
        """The output of prompt `index`; its tokens name the actor that made it."""
        prompt = self.prompts[self.indices.index(index)]
        samples = [Sample([self.actor.index], [0.0], [0], "length") for _ in range(self.params.n)]
        self.items.put(RolloutOutput(prompt, samples, index=index))

    def emit_all(self) -> None:
        for i in self.indices:
            self.emit(i)


class FakeActor:
    def __init__(self, index: int) -> None:
        self.index = index
        self.streams: list[FakeStream] = []
        self._cond = threading.Condition()

    def open(self, indices, prompts, params) -> FakeStream:
        with self._cond:
            self.streams.append(FakeStream(self, list(indices), list(prompts), params))
            self._cond.notify_all()
            return self.streams[-1]

    def stream(self, k: int) -> FakeStream:
        """The `k`-th stream opened on this actor, waiting for it."""
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.streams) > k, WAIT), f"actor {self.index} got no stream {k}"
            return self.streams[k]


class NotifyingCondition(threading.Condition):
    """Wakes its waiters whenever a holder lets go, so a test can wait for the
    dispatch's load accounting (which changes slots without notifying)."""

    def __exit__(self, *exc):
        self.notify_all()
        return super().__exit__(*exc)


class FakePool:
    """The `Pool` interface over fake actors; a death marks the slot restarting."""

    def __init__(self, loads: list[int]) -> None:
        self.cond = NotifyingCondition()
        self.slots = [ActorSlot(i, FakeActor(i), state="alive", load=n, pid=100 + i) for i, n in enumerate(loads)]
        self.deaths: list[tuple[int, int, str]] = []
        self.serving_checks = 0  # times a reader asked whether its actor still serves

    def check_open(self) -> None:
        pass

    def wait_for_live(self, stop=None) -> list[ActorSlot]:
        live = [s for s in self.slots if s.state == "alive"]
        if not live:
            raise RuntimeError("no rollout actor is alive")
        return live

    def wake(self) -> None:
        pass

    def actor_died(self, slot: ActorSlot, generation: int, why: str) -> None:
        with self.cond:
            self.deaths.append((slot.index, generation, why))
            if slot.generation == generation:
                slot.state, slot.load = "restarting", 0

    def serving(self, slot: ActorSlot, generation: int) -> bool:
        with self.cond:
            self.serving_checks += 1
            return slot.generation == generation and slot.state == "alive"

    def open_stream(self, actor: FakeActor, label, indices, prompts, params) -> FakeStream:
        return actor.open(indices, prompts, params)

    def actor(self, index: int) -> FakeActor:
        return self.slots[index].handle

    def loads(self) -> list[int]:
        with self.cond:
            return [s.load for s in self.slots]

    def wait_loads(self, expected: list[int]) -> None:
        """Wait until the slots' loads are `expected` (the dispatch unloads after it delivers)."""
        with self.cond:
            self.cond.wait_for(lambda: [s.load for s in self.slots] == expected, WAIT)
        assert self.loads() == expected


def dispatch(pool: FakePool) -> GenerationDispatch:
    return GenerationDispatch(pool, LIMITS, None)


def prompts(*lengths: int) -> list[list[int]]:
    return [list(range(1, 1 + n)) for n in lengths]


def test_groups_go_longest_first_to_the_least_loaded_actor():
    lengths = prompts(3, 9, 5, 9, 1, 2)
    loads = {0: 0, 1: 10, 2: 0}
    # Order by length, ties by index: 1, 3, 2, 0, 5, 4. With cost 6 the loads (0, 10, 0) go:
    # 1 -> a0 (6, 10, 0); 3 -> a2 (6, 10, 6); 2 -> a0, first of the tie (12, 10, 6); 0 -> a2 (12, 10, 12);
    # 5 -> a1 (12, 16, 12); 4 -> a0, first of the tie (18, 16, 12).
    assert balance(range(6), lengths, loads, 6) == {0: [1, 2, 4], 1: [5], 2: [0, 3]}
    assert loads == {0: 0, 1: 10, 2: 0}  # the caller's loads are not changed
    assert balance([4, 0], lengths, {3: 5, 1: 5}, 1) == {3: [0], 1: [4]}  # only the given prompts and actors


def test_a_group_never_splits_and_its_load_is_accounted_until_delivered():
    pool = FakePool([0, 30])
    handle = dispatch(pool).submit(prompts(4, 7, 2, 6), PARAMS)
    # Cost 10 per prompt, loads (0, 30): 1 (7 tokens) -> a0 (10, 30); 3 -> a0 (20, 30); 0 -> a0 (30, 30);
    # 2 -> a0, first of the tie (40, 30).
    first = pool.actor(0).stream(0)
    assert first.indices == [0, 1, 2, 3] and first.prompts == prompts(4, 7, 2, 6)
    assert first.params.n == 2 and pool.actor(1).streams == []  # every sample of a prompt on one actor
    assert pool.loads() == [40, 30]
    first.emit(1)
    first.emit(3)
    assert [o.index for o in _take(handle, 2)] == [1, 3]
    pool.wait_loads([20, 30])
    # Now (20, 30): the next call's two prompts go to a0 (30, 30), then a0 again (40, 30).
    second = dispatch(pool).submit(prompts(5, 3), PARAMS)
    assert pool.actor(0).stream(1).indices == [0, 1] and pool.loads() == [40, 30]
    first.emit(2)
    first.emit(0)
    pool.actor(0).stream(1).emit_all()
    assert [o.index for o in handle.result(WAIT)] == [0, 1, 2, 3]
    assert [o.prompt_token_ids for o in second.result(WAIT)] == prompts(5, 3)
    pool.wait_loads([0, 30])


def test_a_dead_actors_undelivered_groups_are_regenerated_elsewhere_once():
    pool = FakePool([0, 0])
    handle = dispatch(pool).submit(prompts(8, 6, 4, 2, 7), PARAMS)
    # Order 0, 4, 1, 2, 3 with cost 10: 0 -> a0, 4 -> a1, 1 -> a0, 2 -> a1, 3 -> a0.
    doomed, survivor = pool.actor(0).stream(0), pool.actor(1).stream(0)
    assert (doomed.indices, survivor.indices) == ([0, 1, 3], [2, 4])
    doomed.emit(1)
    assert [o.index for o in _take(handle, 1)] == [1]
    doomed.items.put(ActorGone("actor 0 died while generating"))
    again = pool.actor(1).stream(1)  # what actor 0 had not delivered, on the only live actor
    assert again.indices == [0, 3] and again.prompts == prompts(8, 2)
    assert pool.deaths == [(0, 0, "died while generating")]
    assert pool.loads() == [0, 40]  # the dead actor's load is dropped; a1 holds its own 20 and the 20 moved
    survivor.emit_all()
    again.emit_all()
    rest = _take(handle, 4)
    assert sorted(o.index for o in rest) == [0, 2, 3, 4]  # every prompt exactly once
    outs = handle.result(WAIT)
    assert [o.samples[0].token_ids for o in outs] == [[1], [0], [1], [1], [1]]  # prompt 1 came from actor 0
    assert [len(o.samples) for o in outs] == [2] * 5
    pool.wait_loads([0, 0])


def test_a_death_with_no_actor_left_fails_the_generation():
    pool = FakePool([0])
    handle = dispatch(pool).submit(prompts(3, 4), PARAMS)
    pool.actor(0).stream(0).items.put(ActorGone("actor 0 died"))
    with pytest.raises(RuntimeError, match="no rollout actor is alive"):
        handle.result(WAIT)


def test_an_actors_own_error_fails_the_generation_with_its_cause():
    class RemoteError(Exception):  # how Ray wraps an exception raised inside an actor
        def __init__(self, cause: BaseException) -> None:
            super().__init__(str(cause))
            self.cause = cause

    pool = FakePool([0, 0])
    handle = dispatch(pool).submit(prompts(3, 4), PARAMS)
    pool.actor(0).stream(0).items.put(RemoteError(ValueError("engine exploded")))
    with pytest.raises(ValueError, match="engine exploded"):
        handle.result(WAIT)
    assert pool.deaths == []
    pool.actor(1).stream(0).emit_all()  # the other share finishes and unloads its actor
    pool.wait_loads([0, 0])


def test_a_silent_actor_is_waited_on_until_it_is_replaced_then_its_prompts_move():
    pool = FakePool([0, 0])
    handle = dispatch(pool).submit(prompts(3, 4, 5, 6), PARAMS)
    silent, other = pool.actor(0).stream(0), pool.actor(1).stream(0)
    silent.emit(silent.indices[0])
    silent.items.put(STALL)  # no output for a while, but the actor still serves: the reader waits on
    other.emit_all()
    with pool.cond:
        assert pool.cond.wait_for(lambda: pool.serving_checks == 1, WAIT)
    assert not handle.done() and pool.deaths == []
    pool.actor_died(pool.slots[0], 0, "hung: answered no liveness ping")  # the watchdog's verdict
    silent.items.put(STALL)  # the next silence finds it replaced
    moved = pool.actor(1).stream(1)
    assert moved.indices == silent.indices[1:]
    moved.emit_all()
    outs = handle.result(WAIT)
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert [o.samples[0].token_ids for o in outs] == [[0] if i == silent.indices[0] else [1] for i in range(4)]
    pool.wait_loads([0, 0])


def _take(handle, k: int) -> list[RolloutOutput]:
    """The next `k` outputs as they finish."""
    outputs = handle.as_completed(timeout=WAIT)
    return [next(outputs) for _ in range(k)]


def test_abort_reaches_every_share_and_regenerates_nothing_after_a_death():
    pool = FakePool([0, 0])
    dispatch = GenerationDispatch(pool, LIMITS, None)
    handle = dispatch.submit([[1, 2], [3, 4]], PARAMS)
    dead, alive = pool.actor(0).stream(0), pool.actor(1).stream(0)
    handle.abort()
    assert dead.aborted.is_set() and alive.aborted.is_set()
    dead.items.put(ActorGone("actor 0 died"))
    alive.emit_all()
    outs = handle.result(WAIT)
    (lost,) = dead.indices
    assert all(s.finish_reason == "abort" and s.token_ids == [] for s in outs[lost].samples)
    assert len(outs[lost].samples) == PARAMS.n and outs[lost].prompt_token_ids == [[1, 2], [3, 4]][lost]
    assert len(pool.actor(1).streams) == 1  # nothing dispatched again
    handle.abort()  # idempotent
