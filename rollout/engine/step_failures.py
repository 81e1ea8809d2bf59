"""A failed step, pinned on the requests whose rows make it fail.

A step computes every scheduled request's rows together, so one request's
data (a value its buffers cannot hold, a row the sampler rejects) would fail
the step of every request batched with it, and with it other callers'
requests. When the stepper raises, the step's work is run again one request
at a time: a request whose own share raises is a culprit, ended and failed
with that error; every other request is recomputed (the failed step's KV is
not trusted) and goes on as if the step had not run. An error that no single
request reproduces (a transient fault), or that every one of several does (a
device that fails whatever it runs), stays the error of the caller whose
thread ran the step, as any failed step is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from .plan import ScheduledChunk, StepPlan
from .sequence import Request, RequestResult
from .step_stats import StepInfo
from .stepper import Stepper


class StepOutcome(NamedTuple):
    """What one engine step did for a caller's pending requests (keyed as the caller keys them)."""

    info: StepInfo | None  # the step's record; None when no step ran or its result was dropped
    finished: list[tuple[int, RequestResult]]  # pending requests that finished, their samples copied
    failed: list[tuple[int, Exception]]  # pending requests a failed step was pinned on, and its error
    seen: int  # the scheduler's `finishes` when `finished` was listed: pass it to the caller's next step


class RequestFailures:
    """The errors of requests ended by a failed step, kept until their caller
    collects them. Used under the policy version guard only."""

    def __init__(self) -> None:
        self._errors: dict[int, Exception] = {}  # request id -> why its rows failed the step

    def record(self, request: Request, error: Exception) -> None:
        self._errors[request.request_id] = error

    def collect(self, pending: dict[int, Request]) -> list[tuple[int, Exception]]:
        """The failed ones among `pending`, as `(key, error)`, each handed out once."""
        if not self._errors:  # every step asks: almost always nothing failed
            return []
        return [(key, self._errors.pop(r.request_id)) for key, r in pending.items() if r.request_id in self._errors]

    def forget(self, requests: Iterable[Request]) -> None:
        """Drop the errors of requests whose caller stopped waiting."""
        for r in requests:
            self._errors.pop(r.request_id, None)


def find_culprits(
    stepper: Stepper, plan: StepPlan, shares: list[tuple[Request, list[ScheduledChunk]]]
) -> list[tuple[Request, Exception]]:
    """The requests of `plan` whose share of the step raises when run alone, with
    their errors. `shares` are the plan's chunks by request (`by_request`); each
    is run as a plan of its request's chunks (in plan order, so
    prefills stay first) and the step's page copies (copying a shared page again
    rewrites the same values). Run before recovery: the shares write KV only to
    pages the plan reserved, which recovery drops."""
    culprits = []
    for request, chunks in shares:
        try:
            stepper.step(StepPlan(chunks, plan.page_copies, plan.version))
        except Exception as error:
            culprits.append((request, error))
    return culprits


def by_request(chunks: list[ScheduledChunk]) -> list[tuple[Request, list[ScheduledChunk]]]:
    groups: dict[int, tuple[Request, list[ScheduledChunk]]] = {}
    for c in chunks:
        groups.setdefault(c.seq.request.request_id, (c.seq.request, []))[1].append(c)
    return list(groups.values())
