"""Sampling on CUDA without sorting the vocabulary: the semantics of
`rollout.engine.sampler.sample` (its uniforms, kept set, logprob modes and
greedy rule) in one Triton kernel per batch, plus one `torch.topk` when some
row filters.

A row without filters inverts its CDF over the whole vocabulary with three
passes over its logits (max, sums, the scan to the crossing token). A row with
filters works on the `CANDIDATES` largest logits of its row: it orders them as
the reference's stable sort does, keeps the reference's set among them and
inverts the CDF of the kept tokens in vocabulary order. Where the kept set may
reach past the candidates (top_k off or above them, and neither top-p nor min-p
ends the set among them) the row is flagged inexact, and the caller samples it
again with `rollout.engine.sampler.sample`.

Nothing reads the device from the host: `p.flags` alone picks the branches, so
a decode graph can capture the call.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .launch import launch
from .uniform import uniform

# Candidates per filtering row. Common top_k settings (20 to 1000) fall within
# them, so those rows are always exact; top-p and min-p sets of model outputs
# end well inside 1024 tokens unless the distribution is nearly flat, which is
# the rare row the caller re-samples. Larger K makes topk and the two
# in-register bitonic sorts of 64-bit keys per row dearer for those rare rows.
CANDIDATES = 1024
_VOCAB_BLOCK = 4096


class SamplingRows(Protocol):
    """What this sampler reads of a `rollout.engine.sampler.SamplingBatch` (the
    kernels do not import the engine): per-row device tensors `[R]` and the
    host-known flags."""

    temperature: torch.Tensor  # float32, 0 = greedy
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32, 1 = off
    min_p: torch.Tensor  # float32, 0 = off
    seed: torch.Tensor  # int64
    sample_index: torch.Tensor  # int64: the RNG stream
    rng_pos: torch.Tensor  # int64: the RNG counter
    mode: torch.Tensor  # int64 logprobs mode code
    flags: tuple  # (any_filter, any_greedy, all_greedy)


_LOW32: tl.constexpr = tl.constexpr(0xFFFFFFFF)
_SIGN32: tl.constexpr = tl.constexpr(0x80000000)


@triton.jit
def _exp(x, ACCURATE_EXP: tl.constexpr):
    # tl.exp is ex2.approx on CUDA; torch's expf is libdevice's, and the top-p edge needs the same bits.
    if ACCURATE_EXP:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _row_max(row_ptr, vocab: tl.constexpr, BLOCK: tl.constexpr):
    """The largest logit and torch.argmax's token (the first NaN, else the first maximum)."""
    best = tl.full([], float("-inf"), tl.float32)
    best_at = tl.full([], 0, tl.int64)
    first_nan = tl.full([], vocab, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < vocab
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf"))
        nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, offs, vocab)))
        block_max = tl.max(tl.where(nan, float("-inf"), x))
        block_at = tl.min(tl.where(mask & (x == block_max), offs, vocab))
        better = (block_max > best) | ((start == 0) & (block_at < vocab))
        best_at = tl.where(better, block_at, best_at)
        best = tl.where(better, block_max, best)
    return best, tl.where(first_nan < vocab, first_nan, best_at)


@triton.jit
def _row_sums(
    row_ptr, vocab: tl.constexpr, temperature, raw_max, scaled_max, BLOCK: tl.constexpr, ACCURATE_EXP: tl.constexpr
):
    """float64 sums of the float32 weights exp(x - max) of the raw and the scaled logits."""
    raw = tl.full([], 0.0, tl.float64)
    scaled = tl.full([], 0.0, tl.float64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf"))
        raw += tl.sum(_exp(x - raw_max, ACCURATE_EXP).to(tl.float64))
        scaled += tl.sum(_exp(tl.math.div_rn(x, temperature) - scaled_max, ACCURATE_EXP).to(tl.float64))
    return raw, scaled


@triton.jit
def _scan_vocabulary(
    row_ptr, vocab: tl.constexpr, temperature, scaled_max, target, BLOCK: tl.constexpr, ACCURATE_EXP: tl.constexpr
):
    """The first token whose running weight (in vocabulary order) passes `target`;
    the last token with weight if rounding leaves `target` at the total."""
    carry = tl.full([], 0.0, tl.float64)
    token = tl.full([], -1, tl.int64)
    last = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf"))
        w = _exp(tl.math.div_rn(x, temperature) - scaled_max, ACCURATE_EXP).to(tl.float64)
        passed = tl.min(tl.where(carry + tl.cumsum(w, 0) > target, offs, vocab))
        token = tl.where((token < 0) & (passed < vocab), passed, token)
        last = tl.maximum(last, tl.max(tl.where(w > 0, offs, 0)))
        carry += tl.sum(w)
    return tl.where(token < 0, last, token)


@triton.jit
def _order_key(value, token):
    """uint64 keys that sort descending as the reference's stable sort orders
    (value descending, ties by lower token id; -0 and +0 tie)."""
    bits = tl.where(value == 0, 0.0, value).to(tl.uint32, bitcast=True)
    ordered = tl.where(bits >= _SIGN32, bits ^ _LOW32, bits | _SIGN32)
    return (ordered.to(tl.uint64) << 32) | (token.to(tl.uint64) ^ _LOW32)


@triton.jit
def _key_value(key):
    ordered = (key >> 32).to(tl.uint32)
    bits = tl.where(ordered >= _SIGN32, ordered ^ _SIGN32, ordered ^ _LOW32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _budget_bounds(incl, weight, rank, n_cand, kept_k, vocab, full_mass):
    """Bounds on the float64 mass of the top-k set, whose top_p share is the
    top-p budget: exact when the set lies within the candidates or is the whole
    vocabulary; otherwise the candidates' mass plus what the tokens past them
    can weigh (at most the last candidate's weight each, at least their mean)."""
    candidate_mass = tl.sum(tl.where(rank == tl.minimum(kept_k, n_cand) - 1, incl, 0.0))
    last_weight = tl.sum(tl.where(rank == n_cand - 1, weight, 0.0))
    past = (kept_k - n_cand).to(tl.float64)
    outside = tl.maximum(tl.full([], vocab - n_cand, tl.float64), 1.0)
    high = tl.minimum(full_mass, candidate_mass + past * last_weight) * (1 + 1e-12)
    low = (candidate_mass + (full_mass - candidate_mass) * (past / outside)) * (1 - 1e-12)
    exact = tl.where(kept_k <= n_cand, candidate_mass, full_mass)
    within = (kept_k <= n_cand) | (kept_k == vocab)
    return tl.where(within, exact, low), tl.where(within, exact, high)


@triton.jit
def _kept_candidates(
    cand_logit_ptr,
    cand_id_ptr,
    n_cand,
    vocab,
    temperature,
    top_k,
    top_p,
    min_p,
    scaled_max,
    full_mass,
    CANDIDATE_BLOCK: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
):
    """The reference's kept set among the candidates, in its order: (ids, float32
    weights, keep mask) by rank, and whether the set is surely the reference's."""
    rank = tl.arange(0, CANDIDATE_BLOCK)
    real = rank < n_cand
    logit = tl.load(cand_logit_ptr + rank, mask=real, other=float("-inf"))
    token = tl.load(cand_id_ptr + rank, mask=real, other=0)
    key = _order_key(tl.math.div_rn(logit, temperature), token)
    key = tl.sort(tl.where(real, key, tl.zeros_like(key)), descending=True)
    scaled = _key_value(key)
    token = ((key & _LOW32) ^ _LOW32).to(tl.int64)
    weight = tl.where(real, _exp(scaled - scaled_max, ACCURATE_EXP), 0.0)
    incl = tl.cumsum(weight.to(tl.float64), 0)  # the mass through each rank
    kept_k = tl.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    low, high = _budget_bounds(incl, weight.to(tl.float64), rank, n_cand, kept_k, vocab, full_mass)
    # top-p keeps rank r when the mass before it (through r - 1) is below the budget: ranks 0..n.
    p = top_p.to(tl.float64)
    n_low = tl.sum((real & (incl < p * low)).to(tl.int32))
    n_high = tl.sum((real & (incl < p * high)).to(tl.int32))
    through = tl.where(top_p >= 1, CANDIDATE_BLOCK, n_high)
    keep = (rank == 0) | ((rank < kept_k) & (rank <= through) & (weight >= min_p) & real)
    # Past the candidates the top-k set goes on; top-p or min-p must end the set among them.
    last_weight = tl.sum(tl.where(rank == n_cand - 1, weight, 0.0))
    ended = (kept_k <= n_cand) | ((top_p < 1) & (n_high < n_cand)) | (last_weight < min_p)
    decided = (top_p >= 1) | (n_low == n_high)
    # topk may hold any of the tokens tied with its smallest value: those must all be dropped.
    smallest = tl.min(tl.where(real, scaled, float("inf")))
    ties_out = (n_cand == vocab) | (tl.sum((keep & (scaled == smallest)).to(tl.int32)) == 0)
    return token, weight, keep, ended & decided & ties_out


@triton.jit
def _sample_candidates(
    cand_logit_ptr,
    cand_id_ptr,
    n_cand,
    vocab,
    temperature,
    top_k,
    top_p,
    min_p,
    scaled_max,
    full_mass,
    u,
    CANDIDATE_BLOCK: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
):
    """(token, float64 kept mass, exact) of a filtering row: the kept candidates'
    CDF inverted in vocabulary order."""
    token, weight, keep, exact = _kept_candidates(
        cand_logit_ptr,
        cand_id_ptr,
        n_cand,
        vocab,
        temperature,
        top_k,
        top_p,
        min_p,
        scaled_max,
        full_mass,
        CANDIDATE_BLOCK,
        ACCURATE_EXP,
    )
    bits = weight.to(tl.uint32, bitcast=True).to(tl.uint64)
    dropped = tl.full([CANDIDATE_BLOCK], _LOW32, tl.uint64) << 32  # after every kept token
    key = tl.sort(tl.where(keep, (token.to(tl.uint64) << 32) | bits, dropped))
    token = (key >> 32).to(tl.int64)
    weight = (key & _LOW32).to(tl.uint32).to(tl.float32, bitcast=True).to(tl.float64)
    total = tl.sum(weight)
    rank = tl.arange(0, CANDIDATE_BLOCK)
    passed = tl.min(tl.where(tl.cumsum(weight, 0) > u.to(tl.float64) * total, rank, CANDIDATE_BLOCK))
    at = tl.where(passed < CANDIDATE_BLOCK, passed, tl.max(tl.where(weight > 0, rank, 0)))
    return tl.sum(tl.where(rank == at, token, 0)), total, exact


@triton.jit
def _sample_rows(
    logits_ptr,
    row_stride,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    stream_ptr,
    counter_ptr,
    mode_ptr,
    cand_logit_ptr,
    cand_id_ptr,
    out_token_ptr,
    out_logprob_ptr,
    out_exact_ptr,
    vocab: tl.constexpr,
    n_cand: tl.constexpr,
    FILTERS: tl.constexpr,
    BLOCK: tl.constexpr,
    CANDIDATE_BLOCK: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    greedy = tl.load(temperature_ptr + row) == 0
    temperature = tl.where(greedy, 1.0, tl.load(temperature_ptr + row))
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    u = uniform(tl.load(seed_ptr + row), tl.load(stream_ptr + row), tl.load(counter_ptr + row))
    raw_max, token = _row_max(row_ptr, vocab, BLOCK)
    scaled_max = tl.math.div_rn(raw_max, temperature)  # division by a positive number keeps the order
    raw_mass, full_mass = _row_sums(row_ptr, vocab, temperature, raw_max, scaled_max, BLOCK, ACCURATE_EXP)
    # A top_k of the vocabulary or more keeps every token, as no filter does.
    filters = ((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0)
    kept_mass = full_mass
    exact = greedy | (filters == 0)
    if FILTERS:
        if (greedy == 0) & filters:
            token, kept_mass, exact = _sample_candidates(
                cand_logit_ptr + row * n_cand,
                cand_id_ptr + row * n_cand,
                n_cand,
                vocab,
                temperature,
                top_k,
                top_p,
                min_p,
                scaled_max,
                full_mass,
                u,
                CANDIDATE_BLOCK,
                ACCURATE_EXP,
            )
    if (greedy == 0) & (filters == 0):
        target = u.to(tl.float64) * full_mass
        token = _scan_vocabulary(row_ptr, vocab, temperature, scaled_max, target, BLOCK, ACCURATE_EXP)
    logit = tl.load(row_ptr + token)
    scaled = tl.math.div_rn(logit, temperature)
    raw_lp = logit - (raw_max + tl.log(raw_mass.to(tl.float32)))
    scaled_lp = scaled - (scaled_max + tl.log(full_mass.to(tl.float32)))
    processed_lp = scaled - (scaled_max + tl.log(kept_mass.to(tl.float32)))
    mode = tl.load(mode_ptr + row)
    logprob = tl.where(mode == 2, scaled_lp, tl.where(mode == 1, raw_lp, processed_lp))
    tl.store(out_token_ptr + row, token)
    tl.store(out_logprob_ptr + row, tl.where(greedy, raw_lp, logprob))
    tl.store(out_exact_ptr + row, exact)


def sample(
    logits: torch.Tensor,
    p: SamplingRows,
    out_tokens: torch.Tensor,
    out_logprobs: torch.Tensor,
    out_exact: torch.Tensor,
    candidates: int = CANDIDATES,
) -> None:
    """Sample one token per row of float32 `logits` `[R, V]` (unit stride along
    V) into `out_tokens` `[R]` int64, its logprob (per row mode) into
    `out_logprobs` `[R]` float32, and into `out_exact` `[R]` bool whether the
    row is `rollout.engine.sampler.sample`'s: False where the row's kept set may
    reach past its `candidates` largest logits; its token and logprob are then
    unspecified, and the caller samples that row with the reference.

    One Triton launch when no row filters; `torch.topk` and that launch when one does.
    A row that filters in a batch whose `p.flags` say none is flagged inexact.

    Where an exact row may still differ from the reference: the running sums
    add float32 weights exp(s - max) in float64, in vocabulary order, and
    compare them with u times their total; the reference adds normalised
    float32 probabilities in float32 (torch.cumsum). The two pick different
    tokens only where u lies within float32 rounding of a CDF boundary. The
    float64 mass of the whole vocabulary (the top-p budget when top_k is off)
    is summed in another order than the reference's cumsum in sorted order,
    which moves the top-p edge only where the mass before a token lies within
    float64 rounding of the budget.
    """
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be float32 with unit stride along the vocabulary, got {logits.dtype}")
    filters = p.flags.any_filter and not p.flags.all_greedy
    n_cand = min(vocab, candidates)
    if filters:
        # Over the logits, not the scaled ones: x / T never reverses an order, so every token
        # scaled above the candidates' smallest value is among them, which is all the kernel needs.
        cand_logits, cand_ids = torch.topk(logits, n_cand, dim=-1, sorted=False)
    else:
        cand_logits, cand_ids = logits, out_tokens  # not read
    launch(
        _sample_rows,
        (rows,),
        logits,
        logits.stride(0),
        p.temperature,
        p.top_k,
        p.top_p,
        p.min_p,
        p.seed,
        p.sample_index,
        p.rng_pos,
        p.mode,
        cand_logits,
        cand_ids,
        out_tokens,
        out_logprobs,
        out_exact,
        vocab=vocab,  # fixed by the model: one compilation per engine
        n_cand=n_cand,
        FILTERS=filters,
        BLOCK=min(_VOCAB_BLOCK, triton.next_power_of_2(vocab)),
        CANDIDATE_BLOCK=triton.next_power_of_2(n_cand),
        ACCURATE_EXP=logits.is_cuda,
        num_warps=8,
    )
