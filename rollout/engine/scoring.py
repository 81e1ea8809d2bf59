"""Teacher-forced logprobs of given tokens: `Engine.score` and the prompt
logprobs of `SamplingParams.prompt_logprobs`.

Both are prefill. A request that asks keeps the logits of every prompt
position it needs: position p's logits score token p + 1, so a chunk of
positions [a, b) yields the logprobs of tokens a + 1 .. b, the next chunk's
first token included (it is known, never sampled). The step computes the
chunk's hidden states as usual; the stepper scores the rows these requests
need (`compute_scores`) as the sampler reports logprobs (temperature, filters,
`logprobs_mode`), so the distribution is the one a trainer recomputes. On the
compiled CPU kernels, rows whose distribution has no filter (the common case)
take the fused path: blocks of `FUSED_ROWS` rows meet the LM head a slice of
`FUSED_VOCAB` token ids at a time, and `score_block` folds each slice's logits
into an online logsumexp, the target's logit and a running top k while they
are in cache. Otherwise the head projects `SCORE_BLOCK` rows at a time and the
sampler's own `logprobs_of` and `top_logprobs` score them.

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

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ..sampling_params import SamplingParams
from .sampler import MODE_CODES, SamplerFlags, SamplingBatch, logprobs_of, top_logprobs

if TYPE_CHECKING:
    from .plan import ScheduledChunk
    from .sequence import Sequence

SCORE_BLOCK = 128  # rows of [rows, vocab] logits projected at once (torch path): bounds the step's extra memory
# The fused path: rows per block, and token ids per slice of the LM head; a [256, 4096]
# float32 block of logits (4 MB) stays in cache while the kernel folds it in, and oneDNN
# multiplies these slices about a fifth faster than the whole head (docs/benchmarks.md).
FUSED_ROWS = 256
FUSED_VOCAB = 4096


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


def compute_scores(model, hidden: torch.Tensor, spans: list[ScoreSpan], kernel=None) -> list[SpanScores]:
    """Logprobs (and top logprobs) of every span's targets; `hidden` `[T, H]` is the
    step's last hidden states, `model` maps them to logits (`logits`, `head_slices`).
    With `kernel` (the compiled `score_block`) and rows whose distribution needs no
    filter, the fused path (`_fused_scores`); else `_torch_scores`."""
    device = hidden.device
    rows = torch.tensor([r for s in spans for r in range(s.row, s.row + len(s.targets))], device=device)
    targets = torch.tensor([t for s in spans for t in s.targets], device=device)
    per_row = [s.seq.request.params for s in spans for _ in s.targets]
    batch = _batch(per_row, device)
    k = max(s.seq.request.prompt_scores.top for s in spans)
    fused = kernel is not None and device.type == "cpu" and not batch.flags.any_filter
    block = FUSED_ROWS if fused else SCORE_BLOCK
    values, top_ids, top_values = [], [], []
    for lo in range(0, len(per_row), block):
        index = torch.arange(lo, min(lo + block, len(per_row)), device=device)
        h, sub = hidden.index_select(0, rows[index]), batch.rows(index)
        if fused:
            lp, ids, vals = _fused_scores(model.head_slices(h, FUSED_VOCAB), targets[index], _divisor(sub), k, kernel)
        else:
            lp, ids, vals = _torch_scores(model.logits(h), targets[index], sub, k)
        values.append(lp)
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


def _torch_scores(logits: torch.Tensor, targets: torch.Tensor, batch: SamplingBatch, k: int):
    """The sampler's `logprobs_of` and `top_logprobs` on `[R, vocab]` logits (every
    distribution: filters, modes, temperature), one log-softmax in the raw case."""
    raw = (batch.temperature == 1) | (batch.temperature == 0) | (batch.mode == MODE_CODES["raw"])
    if not batch.flags.any_filter and bool(raw.all()):
        lp = logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
    else:
        lp = logprobs_of(logits, targets, batch)
    ids, vals = top_logprobs(logits, batch, k) if k else (None, None)
    return lp, ids, vals


def _divisor(batch: SamplingBatch) -> torch.Tensor:
    """Per row, the temperature the unfiltered distribution divides the logits by: 1
    for the raw one (greedy rows and `logprobs_mode="raw"`), else the temperature
    (`"processed"` without filters is `"scaled"`)."""
    raw = (batch.temperature == 0) | (batch.mode == MODE_CODES["raw"])
    return torch.where(raw, torch.ones_like(batch.temperature), batch.temperature)


def _fused_scores(slices, targets: torch.Tensor, divisor: torch.Tensor, k: int, kernel):
    """Logprobs of `targets` `[R]` (and the top `k`) under log_softmax(logits / divisor),
    from `slices`, (first token id, `[R, n]` float32 logits) pairs covering the
    vocabulary in order: `kernel` folds each slice into an online logsumexp, the
    target's logit and a running top k while it is in cache, so no `[R, vocab]`
    logits exist (see `csrc/score_block.cpp`)."""
    r = targets.shape[0]
    top = torch.full((r,), -math.inf)
    total = torch.zeros(r, dtype=torch.float64)
    picked = torch.zeros(r)
    top_values = torch.full((r, k), -math.inf)
    top_ids = torch.full((r, k), -1, dtype=torch.int64)
    for first, logits in slices:
        kernel(logits, first, targets, divisor, top, total, picked, top_values, top_ids)
    lse = top.double() + total.log()
    return (picked.double() - lse).float(), top_ids, (top_values.double() - lse[:, None]).float()


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
