"""Collecting a training batch group by group: over-sampling (take the first
`min_groups` prompt groups that finish, abort or keep the rest, as in APRIL,
arXiv 2509.18521) and dynamic sampling (drop groups a filter rejects, e.g.
all-equal rewards as in DAPO, and top the batch up with fresh prompts).

A source is a running rollout with the `GenerationHandle` interface
(`next_output`, `abort`, `remaining`): a cluster's handle, or `EngineRun`
for an in-process engine. `TrainerBridge.collect` drives it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from rollout import Engine, RolloutOutput, SamplingParams
from rollout.cluster.handles import next_from_queue

POLL_S = 0.02  # how long to wait on one source before looking at the others


class EngineRun:
    """`generate_iter` on an in-process engine, on a thread of its own, behind
    the `GenerationHandle` interface: outputs as they finish, `abort()`."""

    def __init__(self, engine: Engine, prompts, params: SamplingParams) -> None:
        self._generation = engine.generate_iter(prompts, params)  # checks the prompts now
        self._results: list[RolloutOutput | None] = [None] * len(prompts)
        self._queue: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.remaining = len(prompts)  # outputs next_output has yet to hand out (none once it raised)
        threading.Thread(target=self._run, name="rollout-bridge-generate", daemon=True).start()

    def _run(self) -> None:
        try:
            for i, out in self._generation:
                self._results[i] = out
                self._queue.put(out)
        except BaseException as e:  # handed to whoever waits
            self._error = e
            self._queue.put(e)
        finally:
            self._done.set()

    def next_output(self, timeout: float | None) -> RolloutOutput | None:
        """The next finished prompt's output, or None when none finished within `timeout` s."""
        try:
            item = next_from_queue(self._queue, timeout)
        except BaseException:
            self.remaining = 0  # the generation failed: nothing more will come
            raise
        if item is not None:
            self.remaining -= 1
        return item

    def result(self, timeout: float | None = None) -> list[RolloutOutput]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"rollouts not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return list(self._results)

    def abort(self) -> None:
        self._generation.abort()


class GroupSource(NamedTuple):
    """A running rollout `collect` reads groups from."""

    source: object  # a GenerationHandle or an EngineRun
    prompts: list  # the prompts as submitted, by output index
    params: SamplingParams  # the settings its groups are sampled with

    def group(self, out: RolloutOutput) -> Group:
        """`out`, one of this source's outputs, with its prompt and settings."""
        return Group(out, self.prompts[out.index], self.params, self.source)


class Group(NamedTuple):
    """A finished prompt group, with what a batch row needs to know about it."""

    output: RolloutOutput
    prompt: object  # the prompt as submitted
    params: SamplingParams  # the settings it was sampled with (rows are recomputed under them)
    source: object  # the source it came from


class GroupCollector:
    """Takes finished groups until `min_groups` pass the staleness check and
    `keep`: first the `ready` groups an earlier collect gave back, then the
    `sources` (oldest first), then refills. What it has taken but not judged
    or returned stays readable (`unread`, `live`) when it raises, so the
    caller can give it back. A source whose read raises (its generation
    failed) has nothing `remaining` after it, so it leaves the live sources;
    it is aborted, its error propagates, and the groups it never delivered
    are `lost_groups`."""

    def __init__(
        self,
        min_groups: int,
        keep: Callable[[RolloutOutput, object], bool] | None,
        is_stale: Callable[[RolloutOutput], bool],
        refill: Callable[[int], GroupSource] | None,
        max_refills: int,
    ) -> None:
        self.min_groups = min_groups
        self.keep = keep
        self.is_stale = is_stale
        self.refill = refill  # groups wanted -> a new source
        self.max_refills = max_refills
        self.taken: list[Group] = []  # passed, in the order they finished
        self.ready: deque[Group] = deque()  # finished, not judged yet
        self.sources: list[GroupSource] = []
        self.stats = {
            "dropped_groups": 0,
            "stale_groups": 0,
            "refill_prompts": 0,
            "aborted_groups": 0,
            "lost_groups": 0,
        }

    def collect(self, ready: list[Group], sources: list[GroupSource], timeout: float | None) -> list[Group]:
        """At most `min_groups` groups that passed; fewer when every source ran
        dry and no refill is left. Raises TimeoutError past `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.ready.extend(ready)
        self.sources.extend(sources)
        refills = 0
        while len(self.taken) < self.min_groups:
            if not self.ready:
                live = self.live()
                if not live:
                    if self.refill is None or refills >= self.max_refills:
                        break
                    refills += 1
                    self._top_up()
                    continue
                if not self._read(live, deadline, timeout):
                    continue
            self._judge(self.ready[0])
            self.ready.popleft()  # only once judged: a keep that raises leaves it unread
        return self.taken

    def live(self) -> list[GroupSource]:
        """The sources with outputs still to come."""
        return [s for s in self.sources if s.source.remaining > 0]

    def unread(self) -> list[Group]:
        """Every finished group taken and not dropped: what a failed collect gives back."""
        return [*self.taken, *self.ready]

    def _top_up(self) -> None:
        self.sources.append(self.refill(self.min_groups - len(self.taken)))
        self.stats["refill_prompts"] += len(self.sources[-1].prompts)

    def _judge(self, group: Group) -> None:
        if self.is_stale(group.output):
            self.stats["stale_groups"] += 1
        elif self.keep is not None and not self.keep(group.output, group.prompt):
            self.stats["dropped_groups"] += 1
        else:
            self.taken.append(group)

    def _read(self, live: list[GroupSource], deadline: float | None, timeout: float | None) -> bool:
        """Move one finished output into `ready`; False when none came within a poll."""
        for s in live:  # anything finished already, oldest source first
            if self._next(s, 0):
                return True
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {self.min_groups} groups finished within {timeout} s")
        return self._next(live[-1], POLL_S)

    def _next(self, s: GroupSource, timeout: float) -> bool:
        """Move `s`'s next output into `ready`; False when none came within `timeout` s.
        A read that raises is `s`'s generation failing (its error comes out once,
        after which `s` has nothing `remaining`, so no collect reads it again): the
        groups it never delivered are lost, and its other work is aborted."""
        unread = s.source.remaining
        try:
            out = s.source.next_output(timeout)
        except Exception as error:  # not BaseException: an interrupt during the wait is no failure of `s`
            self.stats["lost_groups"] += unread
            try:
                s.source.abort()
            except Exception as abort_error:  # the generation's error is the one to raise
                error.add_note(f"aborting the failed source raised {abort_error!r} too")
            raise
        if out is not None:
            self.ready.append(s.group(out))
        return out is not None
