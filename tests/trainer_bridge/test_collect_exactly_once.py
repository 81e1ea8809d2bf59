"""`TrainerBridge.collect(min_groups=...)` accounts for every submitted group
exactly once: delivered in a batch, dropped as stale, aborted, or lost with
a source whose generation failed, whatever the sequence of submits, timeouts,
failures, retries, carries and refills. Sources are
scripted (the test decides which group finishes when), the bridge, its
collector and the engine's policy version are the real ones."""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from rollout import RolloutOutput, Sample, SamplingParams
from tests.conftest import make_engine
from trainer_bridge import PendingRollout, TrainerBridge

TIMEOUT_S = 0.05  # a collect short of groups gives up this soon; one with enough never waits
TEMPERATURES = (0.6, 0.8, 1.0)
BOUND_S = 30.0  # a collect with timeout=None that should return gets this long before the test fails


class GenerationFailed(RuntimeError):
    """A scripted source's generation error."""


class ScriptedSource:
    """A `GenerationHandle` whose groups finish when the test says: `finish(i, version)`
    queues group i's output (one sample, one token of that version); `abort()` queues
    every unfinished group with `finish_reason="abort"`, as a real handle does;
    `fail(error)` ends the generation: its unfinished groups never finish and
    `next_output` raises `error` once, after the outputs queued before it."""

    def __init__(self, prompts: list, params: SamplingParams) -> None:
        self.prompts, self.params = prompts, params
        self.unfinished = list(range(len(prompts)))
        self.finished_at: dict[int, int] = {}  # group -> the policy version it finished at
        self.outputs: dict[int, RolloutOutput] = {}
        self.handed_out: list[int] = []  # groups next_output gave away, in order
        self.aborted = False
        self.lost: list[int] = []  # groups a failure ended unfinished
        self.error: Exception | None = None
        self.remaining = len(prompts)
        self._queue: deque[RolloutOutput | Exception] = deque()
        self._nothing = threading.Event()  # never set: next_output waits like an idle handle

    def finish(self, i: int, version: int, reason: str = "length") -> None:
        self.unfinished.remove(i)
        self.finished_at[i] = version
        sample = Sample([5], [-0.5], [version], reason)
        self.outputs[i] = RolloutOutput(list(self.prompts[i]), [sample], index=i)
        self._queue.append(self.outputs[i])

    def finish_all(self, version: int) -> None:
        for i in list(self.unfinished):
            self.finish(i, version)

    def fail(self, error: Exception) -> None:
        self.lost, self.unfinished, self.error = list(self.unfinished), [], error
        self._queue.append(error)

    def next_output(self, timeout: float | None) -> RolloutOutput | None:
        if not self._queue:
            self._nothing.wait(timeout)
            return None
        out = self._queue.popleft()
        if isinstance(out, Exception):
            self.remaining = 0  # as a real handle: nothing more comes once its error came out
            raise out
        self.remaining -= 1
        self.handed_out.append(out.index)
        return out

    def result(self, timeout: float | None = None) -> list[RolloutOutput]:
        """Every output in prompt order (a plain collect), read or not by next_output."""
        if self.error is not None:
            raise self.error
        if self.unfinished:
            self._nothing.wait(timeout)
            raise TimeoutError(f"rollouts not finished after {timeout} s")
        return [self.outputs[i] for i in range(len(self.prompts))]

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            for i in list(self.unfinished):
                self.finish(i, -1, reason="abort")


class Script:
    """A bridge over a real engine whose submits start `ScriptedSource`s; every
    group's prompt is `[its id]`, unique over the run. `push()` makes a new
    policy version with one small tensor: as real as a full push for staleness."""

    def __init__(self, engine, norm, max_staleness: int | None) -> None:
        self.engine, self.norm = engine, norm
        self.bridge = TrainerBridge(engine, max_staleness=max_staleness)
        self.bridge.submit = self.submit  # refills go through it too
        self.sources: list[ScriptedSource] = []
        self.next_id = 0

    def submit(self, prompts: list, params: SamplingParams | None = None) -> PendingRollout:
        source = ScriptedSource(list(prompts), params or SamplingParams())
        self.sources.append(source)
        return PendingRollout(source.prompts, source.params, source, time.perf_counter())

    def new_prompts(self, count: int) -> list[list[int]]:
        self.next_id += count
        return [[g] for g in range(self.next_id - count, self.next_id)]

    def push(self) -> None:
        self.engine.update_weights({"model.norm.weight": self.norm})

    @property
    def version(self) -> int:
        return self.engine.policy_version


@pytest.fixture(scope="module")
def script(qwen2):
    """A fresh `Script` per call, over one engine (versions only grow)."""
    engine = make_engine(qwen2.path)
    norm = qwen2.hf.state_dict()["model.norm.weight"].clone()
    return lambda max_staleness=None: Script(engine, norm, max_staleness)


def _ids(batch) -> list[int]:
    """The group ids of a batch, checked against its rows' prompt tokens."""
    ids = [prompt[0] for prompt in batch.prompts]
    for g, gid in enumerate(ids):
        for r in (batch.group_index == g).nonzero().flatten().tolist():
            assert batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist() == [gid]
    return ids


def test_a_timed_out_collect_gives_its_groups_to_the_retry(script):
    s = script()
    pending = s.submit(s.new_prompts(6))
    pending.source.finish(0, s.version)
    with pytest.raises(TimeoutError):
        s.bridge.collect(pending, timeout=TIMEOUT_S, min_groups=6)
    pending.source.finish_all(s.version)
    batch = s.bridge.collect(pending, timeout=TIMEOUT_S, min_groups=6)
    assert sorted(_ids(batch)) == list(range(6))
    assert not pending.source.aborted


def test_a_timed_out_collect_keeps_the_carry(script):
    s = script()
    first = s.submit(s.new_prompts(4), SamplingParams(temperature=0.6))
    for i in range(3):
        first.source.finish(i, s.version)
    batch = s.bridge.collect(first, timeout=TIMEOUT_S, min_groups=2, leftover="keep")
    assert _ids(batch) == [0, 1] and batch.collect_stats["carried_groups"] == 2  # group 2 unread, 3 running
    second = s.submit(s.new_prompts(2), SamplingParams(temperature=1.0))
    with pytest.raises(TimeoutError):
        s.bridge.collect(second, timeout=TIMEOUT_S, min_groups=4, leftover="keep")
    assert not first.source.aborted  # the carried source runs on for the retry
    first.source.finish_all(s.version)
    second.source.finish_all(s.version)
    batch = s.bridge.collect(second, timeout=TIMEOUT_S, min_groups=4, leftover="keep")
    assert sorted(_ids(batch)) == [2, 3, 4, 5]
    by_id = dict(zip(_ids(batch), batch.temperature[batch.sample_index == 0].tolist(), strict=True))
    assert by_id == pytest.approx({2: 0.6, 3: 0.6, 4: 1.0, 5: 1.0})  # each group's own settings


def test_a_plain_collect_after_a_timed_out_one_takes_its_groups_from_the_carry(script):
    s = script()
    pending = s.submit(s.new_prompts(3))
    pending.source.finish(0, s.version)
    with pytest.raises(TimeoutError):
        s.bridge.collect(pending, timeout=TIMEOUT_S, min_groups=3)
    pending.source.finish_all(s.version)
    assert s.bridge.collect(pending, timeout=TIMEOUT_S).group_index.tolist() == [0, 1, 2]
    later = s.submit(s.new_prompts(1))
    later.source.finish_all(s.version)
    assert _ids(s.bridge.collect(later, timeout=TIMEOUT_S, min_groups=4)) == [3]  # none of 0-2 again


def test_abort_carried_ends_what_collect_left_running(script):
    s = script()
    pending = s.submit(s.new_prompts(4))
    for i in range(2):
        pending.source.finish(i, s.version)
    s.bridge.collect(pending, timeout=TIMEOUT_S, min_groups=1, leftover="keep")
    assert s.bridge.abort_carried() == 3  # group 1 finished unread, 2 and 3 running
    assert pending.source.aborted and s.bridge.abort_carried() == 0
    later = s.submit(s.new_prompts(1))
    later.source.finish_all(s.version)
    assert _ids(s.bridge.collect(later, timeout=TIMEOUT_S, min_groups=4)) == [4]  # nothing carried


class Counts:
    """The bridge's metrics sink: sums what each collect says it dropped, aborted, lost."""

    def __init__(self) -> None:
        self.total = {"rollout/stale_groups": 0, "rollout/aborted_groups": 0, "rollout/lost_groups": 0}

    def log(self, values: dict) -> None:
        for name in self.total:
            self.total[name] += values.get(name, 0)


def _within(seconds: float, collect):
    """`collect()` in a thread, failing the test if it has not returned within
    `seconds` (a collect with timeout=None that waits for ever fails, not hangs)."""
    box: dict = {}

    def run() -> None:
        try:
            box["batch"] = collect()
        except BaseException as e:  # raised in the test's thread below
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the collect still waits after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["batch"]


def test_a_failed_source_raises_once_and_the_other_sources_carry_on(script):
    s = script()
    counts = s.bridge.metrics = Counts()
    first = s.submit(s.new_prompts(4))
    for i in range(3):
        first.source.finish(i, s.version)
    batch = s.bridge.collect(first, timeout=TIMEOUT_S, min_groups=1, leftover="keep")
    assert _ids(batch) == [0] and batch.collect_stats["carried_groups"] == 3  # 1, 2 finished unread, 3 running
    second = s.submit(s.new_prompts(3))
    second.source.finish(0, s.version)
    first.source.fail(GenerationFailed("engine died"))  # group 3 never finishes
    with pytest.raises(GenerationFailed, match="engine died"):  # after reading groups 1 and 2
        s.bridge.collect(second, timeout=TIMEOUT_S, min_groups=6, leftover="keep")
    assert first.source.aborted and not second.source.aborted
    assert counts.total["rollout/lost_groups"] == 1  # group 3
    second.source.finish(1, s.version)
    batch = _within(BOUND_S, lambda: s.bridge.collect(second, timeout=None, min_groups=4, leftover="keep"))
    assert _ids(batch) == [1, 2, 4, 5]  # what was read from the failed source before its error, then the rest
    assert batch.collect_stats["carried_groups"] == 1  # group 6, running; not the failed source's group 3
    second.source.finish(2, s.version)
    third = s.submit(s.new_prompts(1))
    third.source.finish_all(s.version)
    batch = _within(BOUND_S, lambda: s.bridge.collect(third, timeout=None, min_groups=3, leftover="keep"))
    assert _ids(batch) == [6, 7] and batch.collect_stats["carried_groups"] == 0  # no live source left: it ends
    assert first.source.handed_out == [0, 1, 2]
    assert counts.total["rollout/lost_groups"] == 1 and counts.total["rollout/aborted_groups"] == 0


def test_a_retry_with_a_failed_pending_does_not_wait_for_it(script):
    s = script()
    pending = s.submit(s.new_prompts(3))
    pending.source.finish(0, s.version)
    pending.source.fail(GenerationFailed("engine died"))
    with pytest.raises(GenerationFailed):
        s.bridge.collect(pending, timeout=TIMEOUT_S, min_groups=3)
    batch = _within(BOUND_S, lambda: s.bridge.collect(pending, timeout=None, min_groups=3))
    assert _ids(batch) == [0]  # read before the error, carried; 1 and 2 are lost
    with pytest.raises(ValueError, match="no prompt group passed"):  # nothing left to wait for
        _within(BOUND_S, lambda: s.bridge.collect(pending, timeout=None, min_groups=3))
    with pytest.raises(GenerationFailed):  # a plain collect raises the generation's error
        s.bridge.collect(pending, timeout=TIMEOUT_S)


OPS = st.one_of(
    st.tuples(st.just("finish"), st.integers(0, 31), st.integers(1, 6)),  # which unfinished groups, how many
    st.tuples(st.just("push")),
    # which running source's generation fails, if the draw is 0: rarer than the others, so most sources live
    st.tuples(st.just("fail"), st.integers(0, 31), st.integers(0, 1)),
    st.tuples(st.just("submit"), st.integers(1, 4), st.sampled_from(TEMPERATURES)),
    # min_groups, leftover, refill, whether refilled groups finish at once
    st.tuples(st.just("collect"), st.integers(1, 5), st.sampled_from(["keep", "abort"]), st.booleans(), st.booleans()),
)


class Run:
    """Plays a sequence of `OPS` against `Script`, recording what collect delivered."""

    def __init__(self, s: Script) -> None:
        self.s = s
        self.counts = s.bridge.metrics = Counts()
        self.pending, self.consumed = s.submit(s.new_prompts(3)), False
        self.delivered: list[int] = []
        self.finish_refills = False

    def submit(self, prompts: list, params: SamplingParams | None = None) -> PendingRollout:
        pending = Script.submit(self.s, prompts, params)
        if self.finish_refills:
            pending.source.finish_all(self.s.version)
        return pending

    def play(self, op: tuple) -> None:
        if op[0] == "finish":
            for _ in range(op[2]):
                running = [(src, i) for src in self.s.sources if not src.aborted for i in src.unfinished]
                if running:
                    src, i = running[op[1] % len(running)]
                    src.finish(i, self.s.version)
        elif op[0] == "push":
            self.s.push()
        elif op[0] == "fail" and op[2] == 0:
            running = [src for src in self.s.sources if not src.aborted and src.unfinished]
            if running:
                running[op[1] % len(running)].fail(GenerationFailed("engine died"))
        elif op[0] == "submit" and self.consumed:  # a trainer submits the next step once it collected this one
            self.pending = self.s.submit(self.s.new_prompts(op[1]), SamplingParams(temperature=op[2]))
            self.consumed = False
        elif op[0] == "collect":
            self.collect(*op[1:])

    def collect(self, min_groups: int, leftover: str, refill: bool, finish_refills: bool) -> None:
        if self.consumed:
            self.pending, self.consumed = self.s.submit(self.s.new_prompts(2)), False
        self.s.bridge.submit, self.finish_refills = self.submit, finish_refills
        try:
            batch = self.s.bridge.collect(
                self.pending,
                timeout=TIMEOUT_S,
                min_groups=min_groups,
                leftover=leftover,
                refill=self.s.new_prompts if refill else None,
                max_refills=2,
            )
        except TimeoutError:
            event("a collect timed out")
            return  # the retry is the next collect of the same pending
        except GenerationFailed:
            event("a collect read a failed source")
            return  # retried too: a failed pending is not read again
        except ValueError as e:  # every group it read was stale
            assert "no prompt group passed" in str(e)
            event("a collect found every group stale")
        else:
            self._record(batch)
            for name in ("carried_groups", "stale_groups", "refill_prompts", "aborted_groups"):
                if batch.collect_stats[name]:
                    event(f"a batch with {name}")
        self.consumed = True

    def _record(self, batch) -> None:
        ids = _ids(batch)
        params = {src.prompts[i][0]: src.params for src in self.s.sources for i in range(len(src.prompts))}
        for g, gid in enumerate(ids):
            rows = batch.group_index == g
            assert batch.temperature[rows].tolist() == pytest.approx([params[gid].temperature] * int(rows.sum()))
        self.delivered += ids

    def drain(self) -> None:
        """Finish everything still running and collect it all (the last pending too)."""
        if self.consumed:
            self.pending = self.s.submit(self.s.new_prompts(1))
        for src in self.s.sources:
            src.finish_all(self.s.version)
        self.s.bridge.submit, self.finish_refills = self.submit, False
        for _ in range(len(self.s.sources) + 1):  # each failed source's error comes out once
            try:
                batch = self.s.bridge.collect(self.pending, timeout=TIMEOUT_S, min_groups=10**6, leftover="abort")
            except GenerationFailed:
                continue
            except ValueError as e:  # every group left was stale
                assert "no prompt group passed" in str(e)
            else:
                self._record(batch)
            return
        raise AssertionError("more failures came out than sources failed")


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(OPS, min_size=4, max_size=16), max_staleness=st.sampled_from([None, 0, 1]))
def test_every_group_is_delivered_dropped_aborted_or_lost_exactly_once(script, ops, max_staleness):
    run = Run(script(max_staleness))
    for op in ops:
        run.play(op)
    run.drain()
    s, final = run.s, run.s.version
    assert len(run.delivered) == len(set(run.delivered)), "a group was delivered twice"
    submitted = {src.prompts[i][0] for src in s.sources for i in range(len(src.prompts))}
    assert set(run.delivered) <= submitted
    undelivered = submitted - set(run.delivered)
    counted = sum(run.counts.total.values())
    assert counted == len(undelivered), f"{len(undelivered)} undelivered, {counted} counted stale, aborted or lost"
    for src in s.sources:  # a failed source is aborted once its error is read; its unfinished groups never come
        assert not {src.prompts[i][0] for i in src.lost} & set(run.delivered)
    for src in s.sources:  # each undelivered group: aborted with its source, read and judged stale, or
        for i, version in src.finished_at.items():  # read and left over by a collect that aborted the rest
            stale = max_staleness is not None and final - version > max_staleness
            assert src.prompts[i][0] in run.delivered or src.aborted or (i in src.handed_out) or stale
