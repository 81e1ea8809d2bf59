"""The contracts between the scheduler and the stepper: what a step computes
(`StepPlan`) and what it returned (`StepResult`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
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
    """What one step computes: its chunks, in schedule order.

    The scheduler plans a pure decode (every row one token of its own
    sequence, which samples it: the steady state) as two lists, `decodes` and
    `starts`, which the hot paths read; its chunks are made only if something
    asks for them (a cache miss, a failed step). `add` makes a plan mixed.
    """

    _chunks: list[ScheduledChunk] | None  # None: a pure decode's, made from `decodes` when first read
    page_copies: list[tuple[int, int]]  # (src, dst) copy-on-write page copies to run first
    version: int  # policy version the step runs under
    decodes: list[Sequence] | None = None  # a pure decode's rows (and samplers), in order; None: mixed
    starts: list[int] | None = None  # a pure decode's positions, one per row
    _samplers: list[Sequence] | None = None  # `samplers`, listed once
    _num_tokens: int | None = None  # `num_tokens`, summed once
    graph: bool = False  # set by the stepper: a decode graph served the step (captured, or its eager stand-in)

    @classmethod
    def decode(cls, version: int) -> StepPlan:
        """An empty pure decode, to which the scheduler appends rows."""
        return cls(None, [], version, [], [])

    @property
    def pure_decode(self) -> bool:
        return self.decodes is not None

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """Not changed once the plan is read (see the caches below), but by `add` while it is planned."""
        if self._chunks is None:
            self._chunks = [ScheduledChunk(s, p, 1, [s]) for s, p in zip(self.decodes, self.starts, strict=True)]
        return self._chunks

    def spans(self) -> Iterator[tuple[Sequence, int, int]]:
        """`(sequence, start, length)` of each chunk in order, read from a pure decode's lists
        without making its chunks."""
        if self.decodes is not None:
            return zip(self.decodes, self.starts, repeat(1))
        return ((c.seq, c.start, c.length) for c in self._chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.decodes if self._chunks is None else self._chunks)

    def add(self, chunk: ScheduledChunk) -> None:
        """Append `chunk` (while planning): the plan is mixed from now on."""
        self.chunks.append(chunk)
        self.decodes = self.starts = self._samplers = self._num_tokens = None

    @property
    def num_tokens(self) -> int:
        if self._num_tokens is None:
            self._num_tokens = len(self.decodes) if self.decodes is not None else sum(c.length for c in self.chunks)
        return self._num_tokens

    @property
    def samplers(self) -> list[Sequence]:
        """The sequences that sample a token, in row order (listed at the first read)."""
        if self._samplers is None:
            self._samplers = self.decodes if self.decodes is not None else [s for c in self.chunks for s in c.samplers]
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
