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
from collections.abc import Callable

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
        self.remaining = len(prompts)  # outputs not yet taken with next_output
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
        item = next_from_queue(self._queue, timeout)
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


class GroupCollector:
    """Takes finished groups from several sources until `min_groups` pass `keep`."""

    def __init__(
        self,
        min_groups: int,
        keep: Callable[[RolloutOutput, object], bool] | None,
        is_stale: Callable[[RolloutOutput], bool],
        refill: Callable[[int], tuple[object, list]] | None,
        max_refills: int,
    ) -> None:
        self.min_groups = min_groups
        self.keep = keep
        self.is_stale = is_stale
        self.refill = refill  # groups wanted -> (a new source, its prompts)
        self.max_refills = max_refills
        self.stats = {"dropped_groups": 0, "stale_groups": 0, "refill_prompts": 0, "aborted_groups": 0}

    def collect(self, sources: list[tuple[object, list]], timeout: float | None) -> tuple[list, list, list]:
        """(outputs, their prompts, sources with outputs still to come), at most `min_groups` outputs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        taken: list[tuple[RolloutOutput, object]] = []
        refills = 0
        while len(taken) < self.min_groups:
            live = [s for s in sources if s[0].remaining > 0]
            if not live:
                if self.refill is None or refills >= self.max_refills:
                    break
                refills += 1
                want = self.min_groups - len(taken)
                sources.append(self.refill(want))
                self.stats["refill_prompts"] += len(sources[-1][1])
                continue
            got = self._next(live, deadline, timeout)
            if got is None:
                continue
            out, prompts = got
            prompt = prompts[out.index]
            if self.is_stale(out):
                self.stats["stale_groups"] += 1
            elif self.keep is not None and not self.keep(out, prompt):
                self.stats["dropped_groups"] += 1
            else:
                taken.append((out, prompt))
        leftovers = [s for s in sources if s[0].remaining > 0]
        return [o for o, _ in taken], [p for _, p in taken], leftovers

    def _next(self, live: list, deadline: float | None, timeout: float | None):
        for source, prompts in live:  # anything finished already, oldest source first
            out = source.next_output(0)
            if out is not None:
                return out, prompts
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {self.min_groups} groups finished within {timeout} s")
        out = live[-1][0].next_output(POLL_S)
        return (out, live[-1][1]) if out is not None else None
