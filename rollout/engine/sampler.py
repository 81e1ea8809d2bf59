"""Batched sampling in tensor ops: temperature, top-k, top-p, min-p,
per-row counter-based randomness, and the three logprob modes. CPU engines
with compiled kernels run the same semantics as one op (`sample(kernel=...)`,
`csrc/sampler.cpp`); this file stays the definition, and the path of CUDA
engines and of `kernels="torch"`.

Randomness is a pure function of (seed, sample index, output position), so a
seeded request draws the same numbers alone or inside any batch, and a
preempted sequence recomputed later draws what it would have drawn.

The kept set of top-k, top-p and min-p is computed as the compiled op computes
it (float32 weights, float64 running sums in sorted order, ties by lower token
id; `_apply_filters`): float32 cumulative sums of normalised probabilities
round differently from the op's double sums and can put the top-p edge one
token off, where a token the engine drew would score -inf on the trainer. One
rule makes both paths keep the same tokens from the same logits. A trainer's
logits differ from the engine's, though, and can move any edge across the
sampled token; so `logprobs_of` adds each scored token to its row's kept set,
and a sampled token never scores -inf. Carrying the engine's set (its size or
edge logit) with every token instead would add a value per token to every
batch and still need the sampled token added, since the trainer's order or
logits near the edge can differ from the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

MODE_CODES = {"processed": 0, "raw": 1, "scaled": 2}
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # PCG-RXS-M-XS on 32-bit values held in int64 (products stay below 2**63).
    state = (x * 747796405 + 2891336453) & _M32
    word = ((state >> ((state >> 28) + 4)) ^ state) * 277803737 & _M32
    return ((word >> 22) ^ word) & _M32


def counter_uniform(seed: torch.Tensor, stream: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1), one per row, from int64 `seed`, `stream`, `counter`."""
    h = _mix32(counter & _M32)
    h = _mix32(h ^ (stream & _M32))
    h = _mix32(h ^ (seed & _M32))
    h = _mix32(h ^ ((seed >> 32) & _M32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


class SamplerFlags(NamedTuple):
    """Host-known facts about a batch that pick the sampler's branches. Known
    without reading the device, so a decode graph can be keyed by them."""

    any_filter: bool  # some row uses top-k, top-p or min-p
    any_greedy: bool  # some row has temperature 0
    all_greedy: bool  # every row has temperature 0

    @classmethod
    def of(cls, params: Iterable) -> SamplerFlags:
        """The flags of a batch whose rows sample with `params` (`SamplingParams`)."""
        params = list(params)
        greedy = [p.is_greedy for p in params]
        return cls(any(p.has_filters for p in params), any(greedy), all(greedy))


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters (device tensors `[R]`) plus host-known flags."""

    temperature: torch.Tensor  # float32, 0 = greedy
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32, 1 = off
    min_p: torch.Tensor  # float32, 0 = off
    seed: torch.Tensor  # int64
    sample_index: torch.Tensor  # int64: which of the request's n samples (RNG stream)
    rng_pos: torch.Tensor  # int64: index of the output token being sampled (RNG counter)
    mode: torch.Tensor  # int64 MODE_CODES
    flags: SamplerFlags  # which branches the rows need

    @classmethod
    def of(
        cls,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        mode: torch.Tensor,
        seed: torch.Tensor | None = None,
        sample_index: torch.Tensor | None = None,
        rng_pos: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """A batch with the flags derived from the tensors (one host sync each).
        RNG fields default to zeros: enough for scoring with `logprobs_of`."""
        zeros = torch.zeros_like(top_k)
        greedy = temperature == 0
        return cls(
            temperature,
            top_k,
            top_p,
            min_p,
            zeros if seed is None else seed,
            zeros if sample_index is None else sample_index,
            zeros if rng_pos is None else rng_pos,
            mode,
            SamplerFlags(
                any_filter=bool(((top_k > 0) | (top_p < 1) | (min_p > 0)).any()),
                any_greedy=bool(greedy.any()),
                all_greedy=bool(greedy.all()),
            ),
        )

    def rows(self, index: torch.Tensor) -> SamplingBatch:
        """The batch of rows `index` (a device index tensor); the flags stay the
        whole batch's, which are true of any subset where they matter."""
        fields = {name: getattr(self, name).index_select(0, index) for name in SAMPLING_FIELDS}
        return SamplingBatch(**fields, flags=self.flags)


# The per-row tensors of a `SamplingBatch` (the stepper keeps one workspace buffer of each).
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "sample_index", "rng_pos", "mode")


def sample(
    logits: torch.Tensor,
    p: SamplingBatch,
    out_tokens: torch.Tensor,
    out_logprobs: torch.Tensor,
    kernel: Callable[..., None] | None = None,
) -> None:
    """Sample one token per row of float32 `logits` `[R, V]` into `out_tokens`,
    its log-probability (per row mode) into `out_logprobs`.

    Filters only mask tokens out; every row then inverts the CDF of its
    final distribution in vocabulary order, so a row's token depends on its
    own logits and uniform alone, never on which path its batch took.
    `kernel` (the compiled `sample_rows` of `rollout.kernels`, for CPU
    logits) samples the batch in one op, to float32 rounding of this path, at
    the uniforms of the library's `counter_uniform` (this file's, bit for bit).
    """
    if kernel is not None:
        u = torch.empty_like(p.temperature)
        torch.ops.rollout.counter_uniform(p.seed, p.sample_index, p.rng_pos, u)  # loaded with the kernel
        kernel(logits, p.temperature, p.top_k, p.top_p, p.min_p, p.mode, u, out_tokens, out_logprobs)
        return
    if p.flags.all_greedy:
        tokens = logits.argmax(dim=-1)
        out_tokens.copy_(tokens)
        out_logprobs.copy_(logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1))
        return
    scaled, final = _distributions(logits, p)
    u = counter_uniform(p.seed, p.sample_index, p.rng_pos)
    tokens = _inverse_cdf(torch.softmax(final, dim=-1), u)
    if p.flags.any_greedy:
        tokens = torch.where(p.temperature == 0, logits.argmax(dim=-1), tokens)
    out_tokens.copy_(tokens)
    out_logprobs.copy_(_logprobs(logits, scaled, final, tokens, p))


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, p: SamplingBatch) -> torch.Tensor:
    """Log-probabilities `[R]` of given `tokens` under each row's sampling
    settings and logprobs mode: exactly what `sample` reports for a token it
    drew. Differentiable in `logits` (a trainer recomputes with it).

    Each token is scored as a member of its row's kept set: the filters run,
    then the token is added to what they keep. A token `sample` drew is
    already kept, so nothing changes for it. But a token sampled from other
    logits (the engine's, where the trainer recomputes on its own model) can
    lie just past the top-p or min-p edge, or past a top-k tie, of these ones;
    dropping it would give -inf and an infinite importance ratio. Kept, it
    gets its probability among the tokens these logits keep: the engine's
    logprob, up to the two models' arithmetic, wherever both place the edge
    alike, and off by the edge token's share of the mass where they do not."""
    scaled, final = _distributions(logits, p, tokens)
    return _logprobs(logits, scaled, final, tokens, p)


def top_logprobs(logits: torch.Tensor, p: SamplingBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` most likely tokens of each row and their log-probabilities,
    best first: `(ids [R, k], logprobs [R, k])` of the distribution each
    row's logprobs are reported in (its mode; the raw one for greedy rows),
    so the sampled token's logprob is its entry when it is among them.
    Under "processed", tokens the filters dropped score -inf and rank last."""
    scaled, final = _distributions(logits, p)
    raw = torch.log_softmax(logits, dim=-1)
    lp = torch.log_softmax(final, dim=-1) if p.flags.any_filter else torch.log_softmax(scaled, dim=-1)
    if p.flags.any_filter:
        lp = torch.where((p.mode == MODE_CODES["scaled"])[:, None], torch.log_softmax(scaled, dim=-1), lp)
    lp = torch.where(((p.mode == MODE_CODES["raw"]) | (p.temperature == 0))[:, None], raw, lp)
    values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return ids, values


def _distributions(
    logits: torch.Tensor, p: SamplingBatch, force: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-scaled logits and the final (filtered) ones, which keep the
    tokens `force`; greedy rows use temperature 1."""
    temperature = torch.where(p.temperature == 0, torch.ones_like(p.temperature), p.temperature)
    scaled = logits / temperature[:, None]
    return scaled, _apply_filters(scaled, p, force) if p.flags.any_filter else scaled


def _logprobs(logits, scaled, final, tokens, p: SamplingBatch) -> torch.Tensor:
    picked = tokens[:, None]
    raw = logits.gather(1, picked).squeeze(1) - torch.logsumexp(logits, dim=-1)
    scaled_lp = scaled.gather(1, picked).squeeze(1) - torch.logsumexp(scaled, dim=-1)
    processed = final.gather(1, picked).squeeze(1) - torch.logsumexp(final, dim=-1) if p.flags.any_filter else scaled_lp
    lp = torch.where(p.mode == MODE_CODES["scaled"], scaled_lp, processed)
    lp = torch.where(p.mode == MODE_CODES["raw"], raw, lp)
    return torch.where(p.temperature == 0, raw, lp)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def _apply_filters(scaled: torch.Tensor, p: SamplingBatch, force: torch.Tensor | None = None) -> torch.Tensor:
    """`scaled` with the tokens dropped by top-k, top-p and min-p set to -inf;
    the tokens `force` `[R]`, when given, are kept whatever the filters say.

    The kept set is the compiled sampler's, sum for sum: the order of `scaled`
    descending, ties by lower token id (a stable sort); float32 weights
    exp(s - max); the mass before each token a float64 running sum of those
    weights in that order, compared with `top_p` times their float64 total
    over the top-k set; min-p on the weights. A float32 cumulative sum of
    normalised probabilities rounds differently, enough to move the top-p
    edge by one token. With one rule the paths keep the same set from the
    same logits, unless the two exps' last bits carry a sum across the edge.
    (vec_exp's 0 below e^-87 vanishes from these double sums, which are at
    least 1; it matters only to a min_p under 1e-37.)
    """
    ordered, order = scaled.detach().sort(dim=-1, descending=True, stable=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    keep = (p.top_k[:, None] == 0) | (ranks < p.top_k[:, None])
    weight = torch.exp(ordered - ordered[:, :1])
    mass = weight.cumsum(dim=-1, dtype=torch.float64)  # through each token
    last = torch.where(p.top_k > 0, p.top_k.clamp(max=vocab) - 1, vocab - 1)  # the top-k set's last token
    budget = p.top_p.double()[:, None] * mass.gather(1, last[:, None])
    keep[:, 1:] &= (p.top_p[:, None] >= 1) | (mass[:, :-1] < budget)  # the mass strictly before each token
    keep &= weight >= p.min_p[:, None]
    keep[:, 0] = True
    keep_vocab = torch.empty_like(keep).scatter_(1, order, keep)
    if force is not None:
        keep_vocab.scatter_(1, force[:, None], True)
    return scaled.masked_fill(~keep_vocab, float("-inf"))
