"""A request's state: `Request` (one prompt, n samples) and `Sequence` (one sample).

Progress is counters: `num_computed_tokens` says how much of `token_ids`
has KV in the sequence's pages; what is left to compute, and whether the
next step samples, follow from it. Only the scheduler mutates these, under
the policy version guard; a finished request's results leave as a
`RequestResult` copied under it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..outputs import RolloutOutput, Sample, ScoredSequence
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from .grammar import GrammarState
    from .leases import LeaseSlot
    from .penalties import PenaltyCounts
    from .scoring import PromptScores


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)admission
    RUNNING = "running"  # holds KV pages, advanced every step
    FORK_PENDING = "fork_pending"  # waits for its group leader's prompt, then shares its pages
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int  # unique for the engine's life; never reused
    request: Request
    sample_index: int  # which of the request's n samples (its RNG stream)
    token_ids: list[int]  # prompt tokens, then output tokens
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose KV is in block_table (or is being written)
    pending: int = 0  # tokens sampled by a launched step whose result is not applied yet (0 or 1)
    kv_high_water: int = 0  # positions whose KV was ever computed: computing them again is a recompute
    block_table: list[int] = field(default_factory=list)  # page ids, in position order
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full computed pages
    cacheable: bool = True  # False while its KV mixes policy versions ("keep" updates)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # when the params ask
    finish_reason: str | None = None
    stop_text_end: int | None = None  # text cut where a stop string began
    admitted_at: int = -1  # admission counter: larger = younger, preempted first
    num_restarts: int = 0  # times its outputs were dropped to start over (a `restart` commit)
    routed: np.ndarray | None = None  # routed experts [positions, sparse layers, top_k] when the params ask
    grammar: GrammarState | None = None  # structured outputs: its matcher, advanced by `append`
    penalty: PenaltyCounts | None = None  # penalties: its output token counts, kept by `append`

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens to feed before the next sample, a pending token (still on the device) included."""
        return len(self.token_ids) + self.pending - self.num_computed_tokens

    @property
    def next_rng_pos(self) -> int:
        """The output index of the token the next step samples for this sequence (its RNG counter)."""
        return len(self.token_ids) + self.pending - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def mark_finished(self, reason: str) -> None:
        """Record why the sample ended, then publish it as finished: the status
        is written last, so whoever sees FINISHED also sees the reason."""
        self.finish_reason = reason
        if self.status is not SeqStatus.FINISHED:
            self.request.num_finished += 1
        self.status = SeqStatus.FINISHED

    def append(
        self, token: int, logprob: float, version: int, top: tuple[tuple[int, float], ...] | None = None
    ) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if top is not None:
            self.top_logprobs.append(top)
        if self.grammar is not None:
            self.grammar.accept(token)
        if self.penalty is not None:
            self.penalty.add(token)

    def reset_outputs(self) -> None:
        """Drop the outputs to start over; `num_restarts` tells a stream that they went,
        however many tokens the sample has sampled again by the time it looks."""
        self.num_restarts += 1
        del self.token_ids[self.num_prompt_tokens :]
        self.kv_high_water = min(self.kv_high_water, self.num_prompt_tokens)
        self.logprobs.clear()
        self.versions.clear()
        self.top_logprobs.clear()
        self.stop_text_end = None
        if self.grammar is not None:
            self.grammar.reset()
        if self.penalty is not None:
            self.penalty.reset()
        if self.routed is not None:
            self.routed = self.routed[: self.num_prompt_tokens]


@dataclass(eq=False, slots=True)
class Request:
    """One prompt and its n samples."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: the params' seed, or one drawn from the engine's seed
    max_tokens: int  # params.max_tokens capped by the context length
    stop_token_ids: frozenset[int]  # params' stop ids plus eos unless ignore_eos
    prompt: str | None = None
    samples: list[Sequence] = field(default_factory=list)
    pending_forks: list[Sequence] = field(default_factory=list)  # wait on samples[leader]
    leader: Sequence | None = None  # computes the shared prompt for pending_forks
    started: bool = False  # some sample was admitted (the request is in flight)
    lease_slot: LeaseSlot | None = None  # a session's turn: its KV is kept there when it finishes
    score_only: bool = False  # `Engine.score`: the prompt's logprobs are the result; nothing is sampled
    prompt_scores: PromptScores | None = None  # the prompt's logprobs when the params ask (see `scoring`)
    longest_stop: int = field(init=False)  # characters in the params' longest stop string (0: none)
    num_finished: int = 0  # samples finished (`is_finished` asks every step: a count, not a walk)

    def __post_init__(self) -> None:
        self.longest_stop = max(map(len, self.params.stop or ()), default=0)  # the stop matcher asks every token

    @property
    def is_finished(self) -> bool:
        return self.num_finished >= len(self.samples)

    def group(self, members: list[Sequence]) -> None:
        """Make members[0] the leader that prefills the prompt once; the rest
        fork from it when the prompt is computed."""
        self.leader = members[0]
        self.pending_forks = list(members[1:])
        for s in self.pending_forks:
            s.status = SeqStatus.FORK_PENDING

    def result(self) -> RequestResult:
        """A copy of the samples as they are now. Take it under the guard: another
        thread's step may be finishing them, and the copy is then all of one state."""
        samples = tuple(
            SampleResult(
                tuple(s.output_token_ids),
                tuple(s.logprobs),
                tuple(s.versions),
                s.finish_reason,
                s.stop_text_end,
                tuple(s.top_logprobs) if self.params.top_logprobs else None,
                s.routed if self.params.return_routed_experts else None,
            )
            for s in self.samples
        )
        scores = None if self.prompt_scores is None else self.prompt_scores.snapshot()
        return RequestResult(tuple(self.prompt_token_ids), self.prompt, samples, scores, self.score_only)


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: tuple[int, ...]  # output tokens only
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str | None
    stop_text_end: int | None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None  # None: not asked for
    routed: np.ndarray | None = None  # routed experts of its positions, prompt included; None: not asked for


@dataclass(frozen=True, slots=True)
class RequestResult:
    """A request's samples copied under the guard; `to_output` decodes them
    after it is released, so no step waits on the tokenizer."""

    prompt_token_ids: tuple[int, ...]
    prompt: str | None
    samples: tuple[SampleResult, ...]
    prompt_scores: PromptScores | None = None  # a copy of the request's, when it asked for them
    score_only: bool = False  # the result is a `ScoredSequence`

    def to_output(self, decode, index: int | None = None) -> RolloutOutput | ScoredSequence:
        scores = self.prompt_scores
        if self.score_only:
            ids, top = list(self.prompt_token_ids), scores.top_logprobs
            top = None if top is None else list(top)
            return ScoredSequence(ids, list(scores.logprobs), top, scores.version, self.prompt, index)
        samples = []
        for s in self.samples:
            text = None
            if decode is not None:
                text = decode(list(s.token_ids))
                if s.stop_text_end is not None:
                    text = text[: s.stop_text_end]
            top = None if s.top_logprobs is None else list(s.top_logprobs)
            samples.append(Sample(list(s.token_ids), list(s.logprobs), list(s.versions), s.finish_reason, text, top))
        out = RolloutOutput(list(self.prompt_token_ids), samples, self.prompt, index)
        if any(s.routed is not None for s in self.samples):
            split_routing(out, [s.routed for s in self.samples])
        if scores is not None:
            out.prompt_logprobs = list(scores.logprobs)
            out.prompt_top_logprobs = None if scores.top_logprobs is None else list(scores.top_logprobs)
        return out


def split_routing(out: RolloutOutput, routed: list[np.ndarray | None]) -> None:
    """Set `out`'s routed experts from each sample's routing of all its positions: the prompt's
    (from a sample that computed all of it; None when none did) and each sample's own
    `[len(token_ids) - 1, layers, top_k]`, the positions after the prompt that were computed."""
    p = len(out.prompt_token_ids)
    full = [r for r in routed if r is not None and len(r) >= p]
    out.prompt_routed_experts = full[0][:p].copy() if full else None
    shape = next(r.shape[1:] for r in routed if r is not None)
    dtype = next(r.dtype for r in routed if r is not None)
    for sample, r in zip(out.samples, routed, strict=True):
        end = p + max(len(sample.token_ids) - 1, 0)
        sample.routed_experts = r[p:end].copy() if r is not None else np.zeros((0, *shape), dtype)
