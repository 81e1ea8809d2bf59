"""The contracts between the scheduler and the stepper: what a step computes
(`StepPlan`) and what it returned (`StepResult`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .sequence import Sequence

if TYPE_CHECKING:
    from .scoring import SpanScores


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens of one sequence computed in a step."""

    seq: Sequence  # whose tokens are computed (and whose pages receive their KV)
    start: int  # first position computed: seq.num_computed_tokens when scheduled
    length: int  # tokens computed this step
    samplers: list[Sequence]  # sample a token from the chunk's last row: [], [seq] or [seq, *forks]


@dataclass(slots=True)
class StepPlan:
    """What one step computes."""

    chunks: list[ScheduledChunk]  # in schedule order; not changed once the plan is read (see the caches below)
    page_copies: list[tuple[int, int]]  # (src, dst) copy-on-write page copies to run first
    version: int  # policy version the step runs under
    _samplers: list[Sequence] | None = None  # `samplers`, listed once
    _num_tokens: int | None = None  # `num_tokens`, summed once
    pure_decode: bool = False  # set by the scheduler: every chunk decodes one token of its own sequence
    graph: bool = False  # set by the stepper: a decode graph served the step (captured, or its eager stand-in)

    @property
    def num_tokens(self) -> int:
        if self._num_tokens is None:
            self._num_tokens = sum(c.length for c in self.chunks)
        return self._num_tokens

    @property
    def samplers(self) -> list[Sequence]:
        """The sequences that sample a token, in row order (listed at the first read)."""
        if self._samplers is None:
            self._samplers = [s for c in self.chunks for s in c.samplers]
        return self._samplers


# Per sampler row: its (token id, logprob) alternatives, best first, or None where the row asked for none.
TopLogprobs = list[tuple[tuple[int, float], ...] | None]


@dataclass(slots=True)
class StepResult:
    """What the stepper returns: one entry per sampler row of the plan, in order."""

    tokens: list[int]
    logprobs: list[float]
    version: int  # policy version whose weights produced the tokens
    top: TopLogprobs | None = None  # None: no row asked for top logprobs
    scores: list[SpanScores] | None = None  # prompt logprobs the step's chunks computed (see `scoring`)


@dataclass(slots=True)
class SchedulerStats:
    computed_tokens: int = 0  # every token whose KV was computed
    prompt_tokens: int = 0  # of those, prompt positions (a group's prompt counts once)
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    recomputed_tokens: int = 0  # computed again after their KV was dropped (preemption, recompute, restart)
    discarded_tokens: int = 0  # sampled tokens a restart threw away
