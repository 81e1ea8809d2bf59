"""Teacher-forced logprobs of given tokens: `Engine.score` and the prompt
logprobs of `SamplingParams.prompt_logprobs`.

Both are prefill. A request that asks keeps the logits of every prompt
position it needs: position p's logits score token p + 1, so a chunk of
positions [a, b) yields the logprobs of tokens a + 1 .. b, the next chunk's
first token included (it is known, never sampled). The step computes the
chunk's hidden states as usual; the stepper projects the rows these requests
need through the head in blocks (`compute_scores`, at most `SCORE_BLOCK` rows
of vocabulary-wide logits at a time) and scores them with the sampler's own
`logprobs_of` and `top_logprobs`, so the distribution is the one sampling
reports (temperature, filters, `logprobs_mode`) and a trainer recomputes.

The prefix cache. A cache hit attaches pages whose positions are not
computed, so their logits do not exist. A request that asks for logprobs
from position `start` needs logits from position `start - 1` on: its prefix
match stops before that position (`PromptScores.cache_limit`), and the
positions the caller does not need (a prompt before the scored response)
are taken from the cache. Every computed page is published to the cache as
any prefill's, so later requests (and later scores of the same prefix) hit
it.

Versions. A score is computed under one policy version: a commit with
`inflight="recompute"` or `"restart"` recomputes the unfinished positions
anyway, and under `"keep"` a request whose prompt logprobs are unfinished is
recomputed too (the scheduler requeues it), so its logprobs never mix two
policies' weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ..sampling_params import SamplingParams
from .sampler import MODE_CODES, SamplerFlags, SamplingBatch, logprobs_of, top_logprobs

if TYPE_CHECKING:
    from collections.abc import Callable

    from .plan import ScheduledChunk
    from .sequence import Sequence

SCORE_BLOCK = 128  # rows of [rows, vocab] logits projected at once: bounds the step's extra memory


@dataclass(slots=True)
class PromptScores:
    """A request's prompt logprobs as its prefill computes them (the scheduler writes them)."""

    start: int  # first position whose logprob is wanted (>= 1); earlier entries stay None
    top: int  # alternatives per position (0: none)
    logprobs: list[float | None]  # per prompt position
    top_logprobs: list[dict[int, float] | None] | None  # per prompt position; None when top is 0
    version: int = -1  # the policy version of the step that computed the last of them
    done: bool = False  # every wanted position is computed

    @classmethod
    def new(cls, length: int, start: int, top: int) -> PromptScores:
        return cls(start, top, [None] * length, [None] * length if top else None)

    def cache_limit(self, num_tokens: int) -> int:
        """How many leading tokens a prefix-cache hit may cover: none whose logits are needed."""
        return num_tokens - 1 if self.done else min(num_tokens - 1, self.start - 1)

    def reset(self) -> None:
        """Forget what was computed (a restart under new weights computes it again)."""
        self.done = False
        self.logprobs = [None] * len(self.logprobs)
        if self.top_logprobs is not None:
            self.top_logprobs = [None] * len(self.top_logprobs)

    def record(self, scores: SpanScores, version: int) -> None:
        end = scores.first + len(scores.logprobs)
        self.logprobs[scores.first : end] = scores.logprobs
        if self.top_logprobs is not None and scores.top is not None:
            self.top_logprobs[scores.first : end] = scores.top
        self.version = version

    def finish(self, version: int) -> None:
        self.done = True
        self.version = version

    def snapshot(self) -> PromptScores:
        """A copy whose lists the scheduler never writes again."""
        top = None if self.top_logprobs is None else list(self.top_logprobs)
        return replace(self, logprobs=list(self.logprobs), top_logprobs=top)


@dataclass(frozen=True, slots=True)
class ScoreSpan:
    """Rows of one step chunk whose logits score the next token."""

    seq: Sequence  # whose chunk
    row: int  # the step's token row of the logits at position `first - 1`
    first: int  # position of the first token scored
    targets: list[int]  # the tokens scored: positions first, first + 1, ...


@dataclass(frozen=True, slots=True)
class SpanScores:
    """What the stepper returns for a `ScoreSpan`; the scheduler records it."""

    seq: Sequence
    first: int  # position of logprobs[0]
    logprobs: list[float]
    top: list[dict[int, float]] | None = field(default=None)  # per position; None: not asked


def score_spans(chunks: list[ScheduledChunk]) -> list[ScoreSpan]:
    """The rows of a step's chunks (flattened in chunk order) whose logits some
    request's unfinished prompt logprobs need."""
    spans, row = [], 0
    for c in chunks:
        scores = c.seq.request.prompt_scores
        if scores is not None and not scores.done:
            lo = max(c.start, scores.start - 1)
            hi = min(c.start + c.length, c.seq.num_prompt_tokens - 1)  # the last prompt row samples, never scores
            if lo < hi:
                spans.append(ScoreSpan(c.seq, row + lo - c.start, lo + 1, c.seq.token_ids[lo + 1 : hi + 1]))
        row += c.length
    return spans


def compute_scores(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, spans: list[ScoreSpan]
) -> list[SpanScores]:
    """Logprobs (and top logprobs) of every span's targets: `head` maps hidden rows
    to float32 logits, `hidden` `[T, H]` is the step's last hidden states."""
    device = hidden.device
    rows = torch.tensor([r for s in spans for r in range(s.row, s.row + len(s.targets))], device=device)
    targets = torch.tensor([t for s in spans for t in s.targets], device=device)
    per_row = [s.seq.request.params for s in spans for _ in s.targets]
    batch = _batch(per_row, device)
    k = max(s.seq.request.prompt_scores.top for s in spans)
    values, top_ids, top_values = [], [], []
    for lo in range(0, len(per_row), SCORE_BLOCK):
        index = torch.arange(lo, min(lo + SCORE_BLOCK, len(per_row)), device=device)
        logits = head(hidden.index_select(0, rows[index]))
        sub = batch.rows(index)
        values.append(_logprobs(logits, targets[index], sub))
        if k:
            ids, vals = top_logprobs(logits, sub, k)
            top_ids.append(ids)
            top_values.append(vals)
    lp = torch.cat(values).tolist()
    ids = torch.cat(top_ids).tolist() if k else None
    vals = torch.cat(top_values).tolist() if k else None
    out, at = [], 0
    for s in spans:
        n, want = len(s.targets), s.seq.request.prompt_scores.top
        top = None
        if want:
            top = [
                {**dict(zip(ids[at + i][:want], vals[at + i][:want], strict=True)), s.targets[i]: lp[at + i]}
                for i in range(n)
            ]
        out.append(SpanScores(s.seq, s.first, lp[at : at + n], top))
        at += n
    return out


def _batch(params: list[SamplingParams], device: torch.device) -> SamplingBatch:
    def column(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    return SamplingBatch(
        temperature=column([p.temperature for p in params], torch.float32),
        top_k=column([p.top_k for p in params], torch.int64),
        top_p=column([p.top_p for p in params], torch.float32),
        min_p=column([p.min_p for p in params], torch.float32),
        seed=column([0] * len(params), torch.int64),
        sample_index=column([0] * len(params), torch.int64),
        rng_pos=column([0] * len(params), torch.int64),
        mode=column([MODE_CODES[p.logprobs_mode] for p in params], torch.int64),
        flags=SamplerFlags.of(params),
    )


def _logprobs(logits: torch.Tensor, targets: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`logprobs_of`, with one log-softmax where every row's distribution is the
    raw one (no filter, and temperature 1, 0 or the raw mode): the common case."""
    raw = (batch.temperature == 1) | (batch.temperature == 0) | (batch.mode == MODE_CODES["raw"])
    if not batch.flags.any_filter and bool(raw.all()):
        return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
    return logprobs_of(logits, targets, batch)
