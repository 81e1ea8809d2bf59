"""Overlapped (asynchronous) scheduling: at most one step in flight.

With `overlap` on, a step is launched and its result applied one engine step
later: the host schedules and launches step N+1 while step N still runs on
the device, then collects N's tokens (a staging copy; see `Stepper.launch`)
and applies them. Step N+1 was planned before N's tokens were known, so:

- a sequence N sampled for has one token `pending`; N+1 feeds it on the
  device (the decode cache's reuse path, or a gather from N's out buffer);
- a sequence whose pending token is its last whatever it is (`max_tokens`,
  or scored only) is not scheduled again; one that N ends with a stop token
  or stop string was scheduled in N+1 anyway: that extra token is computed,
  then dropped when N+1 is applied, and the KV page it took given back
  (`Scheduler.finish`);
- every token is applied with the version of the step that computed it; a
  weight commit, a sleep or a failure settles the step in flight first, and a
  step whose rows need their history on the host (penalties, a grammar's
  matcher) is settled before the next one is planned.

Sampling is counter-based (seed, sample index, output position), so the
tokens and logprobs are those of the synchronous engine. With `overlap` off
(the CPU default: there is nothing to overlap with) every step is applied as
soon as it is launched, through the same code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

from .inflight_io import Launched
from .plan import StepPlan
from .scheduler import Scheduler
from .step_failures import RequestFailures, by_request, find_culprits
from .stepper import Stepper


class InFlight(NamedTuple):
    plan: StepPlan
    launched: Launched


class StepPipeline:
    """Launches the scheduler's plans on the stepper and applies their results,
    one step late when `overlap` is on."""

    def __init__(self, stepper: Stepper, scheduler: Scheduler, overlap: bool) -> None:
        self.stepper = stepper
        self.scheduler = scheduler
        self.overlap = overlap
        self.inflight: InFlight | None = None

    def run(self, plan: StepPlan, failures: RequestFailures) -> bool:
        """Launch `plan`, then apply the step before it (or, without overlap, `plan`
        itself). True when `plan` was launched; when it raises, the requests whose
        own rows raise end with their errors in `failures` and False is returned
        (see `step_failures`), or the error propagates."""
        try:
            launched = self.stepper.launch(plan, staged=self.overlap)
            result = None if self.overlap else self.stepper.collect(launched)  # a device error shows here
        except Exception:
            self.settle()  # the step before it ran: its tokens are applied first
            if not self._isolate(plan, failures):
                raise
            return False
        self.scheduler.advance(plan)
        if result is not None:
            self.scheduler.apply(plan, result)
            return True
        previous, self.inflight = self.inflight, InFlight(plan, launched)
        if previous is not None:
            self._apply(previous)
        return True

    def settle(self) -> None:
        """Apply the step in flight, if there is one (waiting for the device). If that
        fails, its tokens are dropped and the running sequences recomputed (`recover`)."""
        inflight, self.inflight = self.inflight, None
        if inflight is None:
            return
        try:
            self._apply(inflight)
        except BaseException:
            self.inflight = inflight
            self.recover()
            raise

    def settle_for_host(self) -> bool:
        """Settle when the next step needs the in-flight step's tokens on the host (its
        rows' penalties count them, a grammar's matcher advances with them, or it scored
        prompt tokens: see `Launched.needs_host`); True when it did."""
        if self.inflight is None or not self.inflight.launched.needs_host:
            return False
        self.settle()
        return True

    def drop(self) -> None:
        """Forget the step in flight (a failed step: its tokens are sampled again)."""
        inflight, self.inflight = self.inflight, None
        if inflight is not None:
            for s in inflight.plan.samplers:
                s.pending = 0

    def _apply(self, inflight: InFlight) -> None:
        self.scheduler.apply(inflight.plan, self.stepper.collect(inflight.launched))

    def _isolate(self, plan: StepPlan, failures: RequestFailures) -> bool:
        """After `plan` raised (its predecessor settled): run each request's share
        alone; the requests whose own share raises end with that error, every other
        one is recomputed. False when no single request reproduces the error, or
        every one of several does (the device, not a row): it is the step's then."""
        chunks = [c for c in plan.chunks if not c.seq.is_finished]  # some ended when the step before it applied
        shares = by_request(chunks)
        culprits = find_culprits(self.stepper, StepPlan(chunks, plan.page_copies, plan.version), shares)
        if not culprits or len(shares) > 1 and len(culprits) == len(shares):
            return False
        self.recover()
        for request, error in culprits:
            self.scheduler.abort([request])
            failures.record(request, error)
        return True

    def recover(self) -> None:
        """After a step failed midway: the KV it wrote and the device state carried
        between steps are not trusted, so running sequences are recomputed."""
        self.drop()
        self.scheduler.recover()
        self.stepper.invalidate()

    @contextlib.contextmanager
    def recovering(self) -> Iterator[None]:
        """`recover` when the block raises (scheduling, a step or its result failed midway)."""
        try:
            yield
        except BaseException:
            self.recover()
            raise
