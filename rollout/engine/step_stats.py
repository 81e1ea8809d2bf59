"""Step statistics: what one engine step did (`StepInfo`), the bounded log of
recent steps (`StepLog`), and the longest pause such logs show
(`generation_pause`).

A step's record is read under the policy version guard (`StepInfo.read`: a
few counters and two clocks, so its numbers agree with each other); it is
logged, and passed to the callback, after the guard is released, so a commit
waiting for the guard never waits on bookkeeping.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import StepPlan
    from .scheduler import Scheduler

STEP_LOG_SIZE = 8192


@dataclass(slots=True)
class StepInfo:
    """Passed to `step_callback` after every step, outside the guard, and kept
    in a bounded log (`Engine.step_log`)."""

    end_time: float  # time.time() when the step finished (comparable across processes)
    seconds: float  # wall time of the step under the guard
    version: int  # policy version the step ran under
    num_tokens: int  # tokens computed
    num_sampled: int  # tokens sampled
    num_running: int  # sequences holding KV after the step
    num_waiting: int  # sequences queued for (re)admission
    kv_pages_used: int  # KV pages held after the step
    graph: bool = False  # a decode graph served the step (see `rollout.engine.decode_graphs`); False: eager

    @classmethod
    def read(cls, started: float, plan: StepPlan, scheduler: Scheduler) -> StepInfo:
        """The step that began at `started` (`time.perf_counter()`) and ran `plan`.

        Call under the guard, after the scheduler's update: the sizes then
        describe one state of the scheduler, and the clocks the step's end,
        not the moment another thread's step let this one log it.
        """
        return cls(
            end_time=time.time(),
            seconds=time.perf_counter() - started,
            version=plan.version,
            num_tokens=plan.num_tokens,
            num_sampled=len(plan.samplers),
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_pages_used=scheduler.kv.allocator.num_used,
            graph=plan.graph,
        )


class StepLog:
    """The most recent steps, up to `size`; appended to by every thread that steps."""

    def __init__(self, size: int = STEP_LOG_SIZE) -> None:
        self._steps: deque[StepInfo] = deque(maxlen=size)
        self._lock = threading.Lock()  # appends come from several generating threads at once
        self.count = 0  # steps recorded since the log was made, never reset: a progress counter

    def record(self, info: StepInfo) -> None:
        with self._lock:
            self._steps.append(info)
            self.count += 1

    def since(self, since: float | None = None) -> list[StepInfo]:
        """The logged steps in order of their end, only those ending after `since` when given.

        Sorted here: two threads that step one after the other may log in the
        opposite order, as each logs after releasing the guard.
        """
        with self._lock:
            steps = sorted(self._steps, key=lambda info: info.end_time)
        return steps if since is None else [info for info in steps if info.end_time > since]


def generation_pause(logs: list[list[StepInfo]], start: float, end: float) -> float:
    """The longest gap between consecutive steps of any engine that overlaps
    `[start, end]` (seconds); 0 when no engine was generating then."""
    longest = 0.0
    for log in logs:
        ends = [info.end_time for info in log]
        for a, b in zip(ends, ends[1:], strict=False):
            if a < end and b > start:
                longest = max(longest, b - a)
    return longest
